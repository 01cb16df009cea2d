"""Kubernetes names typed on the command line: the whole value must be a name."""

import pytest

from fastshare.k8s import names


@pytest.mark.parametrize(("check", "good"), [(names.namespace_problem, "fastshare-system"),
                                             (names.name_problem, "fastshare.controller"),
                                             (names.label_key_problem, "fastshare.io/gpu")])
def test_a_name_with_a_trailing_newline_is_refused(check, good):
    """'$' also matches before a final newline; the API server would refuse such a name later."""
    assert check(good) is None
    assert check(good + "\n") is not None
