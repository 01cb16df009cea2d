"""roles/fastshare_package against a virtualenv under tmp_path, with small hand-made wheels of a
distribution named fastshare (no index: pip gets --no-index and a local --find-links)."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from fs_collection import COLLECTION, run_tasks


def _wheel(directory: Path, version: str, marker: str) -> Path:
    """A pure-Python wheel of fastshare VERSION whose module ``fastshare_marker`` holds MARKER."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"fastshare-{version}-py3-none-any.whl"
    info = f"fastshare-{version}.dist-info"
    files = {"fastshare_marker.py": f"MARKER = {marker!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: fastshare\nVersion: {version}\n",
             f"{info}/WHEEL": ("Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\n"
                               "Tag: py3-none-any\n")}
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def _converge(collections_path: Path, tmp_path: Path, check: bool = False, **role_vars) -> bool:
    """The role on localhost; whether anything changed (asserting nothing failed)."""
    defaults = {"fastshare_package_venv": str(tmp_path / "venv"), "fastshare_package_python": sys.executable,
                "fastshare_package_pip_args": ["--no-index", "--find-links", str(tmp_path / "index")]}
    results = run_tasks(collections_path, [
        {"ansible.builtin.include_role": {"name": f"{COLLECTION}.fastshare_package"},
         "vars": {**defaults, **role_vars}}], tmp_path, gather_facts=True,
        extra_args=["--check"] if check else None)
    failed = [r.get("msg") or r.get("stderr") for r in results if r.get("failed")]
    assert not failed, failed
    return any(r.get("changed") for r in results)


def _installed(tmp_path: Path) -> tuple[str, str]:
    """Version and marker of the fastshare installed in the virtualenv."""
    probe = "import importlib.metadata as m, fastshare_marker as f; print(m.version('fastshare'), f.MARKER)"
    out = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c", probe],
                         capture_output=True, text=True, check=True, cwd=tmp_path).stdout.split()
    return out[0], out[1]


def test_a_wheel_rebuilt_with_the_same_version_is_installed_again(collections_path: Path, tmp_path: Path):
    """pip keeps an installed version it is offered again; the role installs a changed wheel."""
    source = tmp_path / "dist"
    _wheel(tmp_path / "index", "0.1.0", "index")   # what --find-links offers; never taken for a wheel

    def converge(**extra) -> bool:
        return _converge(collections_path, tmp_path, fastshare_package_source="wheel",
                         fastshare_package_wheel=str(source / "fastshare-0.1.0-py3-none-any.whl"), **extra)

    _wheel(source, "0.1.0", "first")
    assert converge() is True
    assert _installed(tmp_path) == ("0.1.0", "first")
    assert converge() is False, "the same wheel again changes nothing"

    _wheel(source, "0.1.0", "rebuilt")
    assert converge(check=True) is True, "check mode shows the changed wheel"
    assert _installed(tmp_path) == ("0.1.0", "first"), "and installs nothing"
    assert converge() is True
    assert _installed(tmp_path) == ("0.1.0", "rebuilt")
    assert converge() is False


def test_check_mode_says_whether_pip_would_install_another_version(collections_path: Path, tmp_path: Path):
    _wheel(tmp_path / "index", "0.1.0", "one")
    _wheel(tmp_path / "index", "0.2.0", "two")

    def converge(version: str, check: bool = False) -> bool:
        return _converge(collections_path, tmp_path, check=check, fastshare_package_version=version)

    assert converge("0.1.0") is True
    assert _installed(tmp_path) == ("0.1.0", "one")
    assert converge("0.1.0", check=True) is False, "the installed version: nothing to do"
    assert converge("0.2.0", check=True) is True, "another version would be installed"
    assert _installed(tmp_path) == ("0.1.0", "one"), "check mode installed nothing"
    assert converge("0.2.0") is True
    assert _installed(tmp_path) == ("0.2.0", "two")
    assert converge("0.2.0") is False
