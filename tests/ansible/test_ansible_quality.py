"""The collection meets the ecosystem's bar: ansible-lint (production), ansible-test sanity, build.

ansible-test sanity runs with --local against Python 3.11 (no containers here). It creates one
virtualenv per test with pinned requirements from PyPI; it would download pip's bootstrap script
from a host CI cannot reach, so get_pip_offline.py stands in for it (ensurepip + the index).
Those venvs are cached under .venv/, so only the first run pays for them.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from fs_collection import COLLECTION, GALAXY, REPO, run, tool

ANSIBLE_TEST_HOME = REPO / ".venv" / ".ansible-test-home"


def test_sanity_ignore_files_are_empty():
    """No sanity finding is silenced: every ignore file exists only to say so."""
    files = sorted((REPO / "tests" / "sanity").glob("ignore-*.txt"))
    assert files, "tests/sanity/ignore-<version>.txt missing"
    for path in files:
        assert path.read_text().strip() == "", f"{path.name} must stay empty"


def test_ansible_lint_production_profile(tmp_path: Path):
    """Zero violations with the production profile (set in .ansible-lint, enforced here too).

    Offline, ansible-lint does not install the collection it runs in, so a collections path
    with the checkout linked as fastshare.gpu lets it resolve the collection's own modules and
    roles (kubernetes.core comes from the `ansible` package in site-packages).
    """
    link = tmp_path / "ansible_collections" / GALAXY["namespace"] / GALAXY["name"]
    link.parent.mkdir(parents=True)
    link.symlink_to(REPO)
    proc = run([tool("ansible-lint"), "--offline", "--profile", "production", "--nocolor"], cwd=REPO,
               check=False, env={"ANSIBLE_COLLECTIONS_PATH": str(tmp_path)})
    assert proc.returncode == 0, f"ansible-lint found violations:\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.timeout(900)
def test_ansible_test_sanity(sanity_tree: Path):
    cache = ANSIBLE_TEST_HOME / ".ansible" / "test" / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    for pip_version in _bootstrap_pip_versions():
        shutil.copy(Path(__file__).with_name("get_pip_offline.py"),
                    cache / f"get_pip_{pip_version.replace('.', '_')}.py")
    proc = run([tool("ansible-test"), "sanity", "--local", "--python", "3.11", "--color", "no"],
               cwd=sanity_tree, env={"HOME": str(ANSIBLE_TEST_HOME)}, check=False, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"ansible-test sanity failed:\n{output[-20000:]}"
    ran = re.findall(r'Running sanity test "([\w-]+)"', output)
    skipped = re.findall(r'WARNING: Skipping sanity test "([\w-]+)"[^\n]*', output)
    print(f"sanity tests run: {', '.join(ran)}\nskipped: {', '.join(skipped) or 'none'}")
    # The checks that matter most for modules must have run, not been skipped.
    for name in ("ansible-doc", "compile", "import", "pylint", "validate-modules", "yamllint", "pep8"):
        assert name in ran, f"sanity test {name} did not run:\n{output[-5000:]}"


def _bootstrap_pip_versions() -> set[str]:
    """The pip version(s) ansible-test bootstraps its venvs with (asked from ansible-test itself)."""
    from types import SimpleNamespace

    from ansible_test._internal.python_requirements import get_venv_packages

    return {get_venv_packages(SimpleNamespace(version="3.11"))["pip"]}


def test_build_install_and_ansible_doc(collections_path: Path, collection_tarball: Path):
    import tarfile

    with tarfile.open(collection_tarball) as tar:
        names = set(tar.getnames())
    assert "MANIFEST.json" in names and "plugins/modules/gpu_info.py" in names
    not_collection = {"fastshare", "tests", ".venv", "proto", "scripts", "molecule"}
    leaked = sorted(n for n in names if n.split("/")[0] in not_collection)
    assert not leaked, f"the collection tarball ships non-collection files: {leaked[:10]}"
    manifest = json.loads(tar_member(collection_tarball, "MANIFEST.json"))
    assert manifest["collection_info"]["version"] == GALAXY["version"]
    env = {"ANSIBLE_COLLECTIONS_PATH": str(collections_path)}
    listing = run([tool("ansible-doc"), "--list", COLLECTION, "--json"], env=env)
    modules = sorted(json.loads(listing.stdout))
    assert f"{COLLECTION}.gpu_info" in modules
    for module in modules:
        doc = run([tool("ansible-doc"), module], env=env)
        assert "OPTIONS" in doc.stdout and "EXAMPLES" in doc.stdout and "RETURN VALUES" in doc.stdout, module


def tar_member(tarball: Path, name: str) -> str:
    import tarfile

    with tarfile.open(tarball) as tar:
        member = tar.extractfile(name)
        assert member is not None
        return member.read().decode()
