"""roles/fastshare_package against a virtualenv under tmp_path, with small hand-made wheels of a
distribution named fastshare (no index: pip gets --no-index and a local --find-links, or an
index served on 127.0.0.1)."""

from __future__ import annotations

import base64
import hashlib
import http.server
import re
import subprocess
import sys
import threading
import tomllib
import urllib.parse
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fs_collection import COLLECTION, REPO, run_tasks

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


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


def _run_role(collections_path: Path, tmp_path: Path, check: bool = False, role: str = "fastshare_package",
              playbook_dir: Path | None = None, **role_vars) -> list[dict]:
    """The role on localhost from a playbook in PLAYBOOK_DIR (default tmp_path); one result per task."""
    defaults = {"fastshare_package_venv": str(tmp_path / "venv"), "fastshare_package_python": sys.executable,
                "fastshare_package_pip_args": ["--no-index", "--find-links", str(tmp_path / "index")]}
    playbook_dir = playbook_dir or tmp_path
    playbook_dir.mkdir(parents=True, exist_ok=True)
    return run_tasks(collections_path, [
        {"ansible.builtin.include_role": {"name": f"{COLLECTION}.{role}"},
         "vars": {**defaults, **role_vars}}], playbook_dir, gather_facts=True,
        extra_args=["--check"] if check else None)


def _converge(collections_path: Path, tmp_path: Path, check: bool = False, **role_vars) -> bool:
    """The role on localhost; whether anything changed (asserting nothing failed)."""
    results = _run_role(collections_path, tmp_path, check, **role_vars)
    failed = [(r.get("msg"), r.get("stderr")) for r in results if r.get("failed")]
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
        return _converge(collections_path, tmp_path, check=check, fastshare_package_source="pip",
                         fastshare_package_version=version)

    assert converge("0.1.0") is True
    assert _installed(tmp_path) == ("0.1.0", "one")
    assert converge("0.1.0", check=True) is False, "the installed version: nothing to do"
    assert converge("0.2.0", check=True) is True, "another version would be installed"
    assert _installed(tmp_path) == ("0.1.0", "one"), "check mode installed nothing"
    assert converge("0.2.0") is True
    assert _installed(tmp_path) == ("0.2.0", "two")
    assert converge("0.2.0") is False


def test_by_default_the_wheel_make_wheel_writes_in_the_checkout_is_installed(collections_path: Path,
                                                                             tmp_path: Path):
    """A playbook in <checkout>/playbooks (playbooks/site.yml) installs <checkout>/dist's wheel,
    the file `make wheel` writes; --find-links offers another fastshare, never taken."""
    _wheel(tmp_path / "index", VERSION, "index")
    _wheel(tmp_path / "dist", VERSION, "checkout")
    results = _run_role(collections_path, tmp_path, playbook_dir=tmp_path / "playbooks")
    assert not [r for r in results if r.get("failed")], results
    assert _installed(tmp_path) == (VERSION, "checkout")


def _make_wheel_files() -> set[str]:
    """The wheel file(s) `make wheel` names (its commands, printed by make -n, not run)."""
    proc = subprocess.run(["make", "-n", "-C", str(REPO), "--no-print-directory", "wheel"],
                          capture_output=True, text=True, check=True)
    return set(re.findall(r"dist/fastshare-\S+?\.whl", proc.stdout))


def test_the_roles_default_wheel_is_the_one_make_wheel_writes():
    """Each role's default names dist/fastshare-<version of pyproject.toml>-py3-none-any.whl, next to
    the playbooks/ directory, and the pip specs pin that version."""
    wheel = f"dist/fastshare-{VERSION}-py3-none-any.whl"
    assert _make_wheel_files() == {wheel}
    expected = {"fastshare_package": ("fastshare_package", "{{ playbook_dir | dirname }}/dist/fastshare-"
                                      "{{ fastshare_package_version }}-py3-none-any.whl"),
                "gpu_node": ("gpu_node_package", "{{ playbook_dir | dirname }}/" + wheel),
                "controller": ("controller_package", "{{ playbook_dir | dirname }}/" + wheel)}
    for role, (prefix, default_wheel) in expected.items():
        defaults = yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text())
        assert defaults[f"{prefix}_source"] == "wheel", role
        assert defaults[f"{prefix}_wheel"] == default_wheel, role
    package = yaml.safe_load((REPO / "roles" / "fastshare_package" / "defaults" / "main.yml").read_text())
    assert package["fastshare_package_version"] == VERSION
    for role in ("gpu_node", "controller"):
        defaults = yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text())
        assert defaults[f"{role}_package_pip_spec"] == f"fastshare=={VERSION}"


@pytest.mark.parametrize(("role", "variable"), [("fastshare_package", "fastshare_package_wheel"),
                                                ("gpu_node", "gpu_node_package_wheel"),
                                                ("controller", "controller_package_wheel")])
def test_a_missing_default_wheel_fails_first_naming_the_variable_and_make_wheel(
        collections_path: Path, tmp_path: Path, role: str, variable: str):
    """No wheel where the default looks: the first task of the role fails, before any task that
    could change the host (gpu_node: before the driver; controller: before the package), and says
    which variable to set and how to build the wheel."""
    role_vars = {"gpu_backend": "sim", "fastshare_sim_gpus": ["L4"], "deploy_mode": "systemd",
                 "gpu_node_venv": str(tmp_path / "venv"), "controller_venv": str(tmp_path / "venv")}
    results = _run_role(collections_path, tmp_path, role=role, playbook_dir=tmp_path / "playbooks",
                        **role_vars)
    failed = [r for r in results if r.get("failed")]
    assert len(failed) == 1 and failed[0] is results[-1], results
    msg = failed[0]["msg"]
    assert variable in msg and "make wheel" in msg, msg
    assert str(tmp_path / "dist" / f"fastshare-{VERSION}-py3-none-any.whl") in msg, msg
    assert not any(r.get("changed") for r in results), results
    assert not (tmp_path / "venv").exists(), "nothing may be installed"


class _Index(http.server.BaseHTTPRequestHandler):
    """A PEP 503 simple index with one wheel, whatever host the request names (pip may reach it
    directly or through it as an HTTP proxy)."""

    wheel: Path

    def do_GET(self) -> None:
        # "/simple/..." asked directly, "http://pypi.org/simple/..." asked through the proxy
        path = urllib.parse.urlsplit(self.path).path.lstrip("/")
        if path.rstrip("/") == "simple/fastshare":
            digest = hashlib.sha256(self.wheel.read_bytes()).hexdigest()
            body = f'<a href="../../files/{self.wheel.name}#sha256={digest}">{self.wheel.name}</a>'.encode()
            kind = "text/html"
        elif path == f"files/{self.wheel.name}":
            body, kind = self.wheel.read_bytes(), "application/octet-stream"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None: ...


@pytest.fixture
def index(tmp_path: Path) -> Iterator[str]:
    """HOST:PORT of the index, on 127.0.0.1 only, serving a fastshare 1.0.0 wheel."""
    handler = type("Index", (_Index,), {"wheel": _wheel(tmp_path / "served", "1.0.0", "served")})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()
    server.server_close()


def test_pip_source_refuses_fastshare_from_the_public_pypi(collections_path: Path, tmp_path: Path,
                                                          index: str):
    """The name fastshare on pypi.org is another project's. When pip would download fastshare from
    pypi.org (here: pip asks http://pypi.org/simple through a proxy on 127.0.0.1 that serves a
    fastshare 1.0.0), the role refuses before installing it and says why and what to set."""
    pypi_args = ["--no-cache-dir", "--index-url", "http://pypi.org/simple", "--trusted-host", "pypi.org",
                 "--proxy", f"http://{index}"]
    results = _run_role(collections_path, tmp_path, fastshare_package_source="pip",
                        fastshare_package_pip_spec="fastshare==1.0.0", fastshare_package_pip_args=pypi_args)
    failed = [r for r in results if r.get("failed")]
    assert len(failed) == 1 and failed[0] is results[-1], results
    msg = failed[0]["msg"]
    assert "http://pypi.org/files/fastshare-1.0.0-py3-none-any.whl" in msg, msg
    for words in ("another project", "fastshare_package_pip_args", "fastshare_package_source", "make wheel"):
        assert words in msg, msg
    probe = [str(tmp_path / "venv" / "bin" / "python"), "-c", "import fastshare_marker"]
    assert subprocess.run(probe, capture_output=True, cwd=tmp_path).returncode != 0, "fastshare was installed"

    # The same index as the operator's own (its own address): installed.
    own_args = ["--no-cache-dir", "--index-url", f"http://{index}/simple"]
    assert _converge(collections_path, tmp_path, fastshare_package_source="pip",
                     fastshare_package_pip_spec="fastshare==1.0.0", fastshare_package_pip_args=own_args)
    assert _installed(tmp_path) == ("1.0.0", "served")
