"""The systemd units as shipped: `systemd-analyze security` exposure at most 5.0 ("OK") for
both, while the agent keeps access to the NVIDIA device nodes."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                reason="systemd-analyze not installed")
TEMPLATE = REPO / "roles/controller/templates/fastshare-controller.service.j2"


def _systemd_command():
    """The collection's filter the template calls (plugins/filter/systemd_command.py)."""
    path = REPO / "plugins" / "filter" / "systemd_command.py"
    spec = importlib.util.spec_from_file_location("systemd_command", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.systemd_command


def controller_unit() -> str:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters["regex_replace"] = lambda value, pattern, repl: re.sub(pattern, repl, value)
    env.filters["fastshare.gpu.systemd_command"] = _systemd_command()
    return env.from_string(TEMPLATE.read_text()).render(
        ansible_managed="rendered by the test", controller_user="fastshare", controller_venv="/opt/fastshare",
        controller_state_dir="/var/lib/fastshare/controller")


def node_unit() -> str:
    """What roles/gpu_node installs: the agent's own `fastshare node unit`."""
    cli = str(Path(sys.executable).parent / "fastshare")
    return subprocess.run([cli, "node", "unit"], capture_output=True, text=True, check=True).stdout


def exposure(tmp_path: Path, name: str, text: str) -> float:
    unit = tmp_path / name
    unit.write_text(text)
    out = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)], capture_output=True,
                         text=True, timeout=60)
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out.stdout)
    assert found, out.stdout + out.stderr
    return float(found.group(1))


@pytest.mark.parametrize(("name", "render"), [("fastshare-controller.service", controller_unit),
                                              ("fastshare-node.service", node_unit)])
def test_exposure_is_ok(tmp_path: Path, name: str, render, capsys: pytest.CaptureFixture[str]) -> None:
    score = exposure(tmp_path, name, render())
    with capsys.disabled():
        print(f"\nsystemd-analyze security {name}: {score}")
    assert score <= 5.0


def test_agent_still_reaches_the_gpus() -> None:
    text = node_unit()
    assert "PrivateDevices=yes" not in text and "DevicePolicy=closed" in text
    for device in ("/dev/nvidiactl", "/dev/nvidia-uvm", "char-nvidia-frontend", "char-nvidia-caps"):
        assert re.search(rf"^DeviceAllow={re.escape(device)} rw$", text, re.M), device
