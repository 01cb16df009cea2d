"""Shared fixtures for the fastshare.gpu collection tests: build it once, install it in a temp tree.

Every test drives the real Ansible tools (ansible-galaxy, ansible-test, ansible-lint, ansible,
ansible-playbook) from the same virtualenv as pytest, with a private collections path so the
tests see exactly what `ansible-galaxy collection build` ships.
"""

from __future__ import annotations

import shutil
import tarfile
from pathlib import Path

import pytest
from fs_collection import GALAXY, REPO, run, tool


@pytest.fixture(scope="session")
def collection_tarball(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`ansible-galaxy collection build` of the repository root (the collection root)."""
    out = tmp_path_factory.mktemp("build")
    run([tool("ansible-galaxy"), "collection", "build", "--output-path", str(out), str(REPO)])
    tarballs = list(out.glob("*.tar.gz"))
    expected = f"{GALAXY['namespace']}-{GALAXY['name']}-{GALAXY['version']}.tar.gz"
    assert [t.name for t in tarballs] == [expected]
    return tarballs[0]


@pytest.fixture(scope="session")
def collections_path(collection_tarball: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A collections path with the built collection installed the way users install it.

    --no-deps: Galaxy is unreachable here; kubernetes.core (the one dependency) comes from
    the `ansible` PyPI package in the [dev] extra, which Ansible finds in site-packages.
    """
    path = tmp_path_factory.mktemp("collections")
    run([tool("ansible-galaxy"), "collection", "install", "--no-deps", "-p", str(path),
         str(collection_tarball)])
    assert (path / "ansible_collections" / GALAXY["namespace"] / GALAXY["name"] / "MANIFEST.json").is_file()
    return path


@pytest.fixture(scope="session")
def sanity_tree(collection_tarball: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ansible_collections/fastshare/gpu unpacked from the tarball plus the sanity config.

    tests/ is not shipped (it is the Python package's pytest tree), so the two files
    ansible-test reads (tests/config.yml, tests/sanity/ignore-*.txt) are copied in.
    """
    root = tmp_path_factory.mktemp("sanity") / "ansible_collections" / GALAXY["namespace"] / GALAXY["name"]
    root.mkdir(parents=True)
    with tarfile.open(collection_tarball) as tar:
        tar.extractall(root, filter="data")
    (root / "tests").mkdir()
    shutil.copy(REPO / "tests" / "config.yml", root / "tests" / "config.yml")
    shutil.copytree(REPO / "tests" / "sanity", root / "tests" / "sanity")
    return root
