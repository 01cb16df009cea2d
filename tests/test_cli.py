"""The installed `fastshare` entry point works and the generated protobuf code imports."""

import subprocess

from click.testing import CliRunner

from fastshare import __version__
from fastshare.cli import main


def test_version_option_reports_package_version():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert __version__ in result.output


def test_console_script_is_installed():
    out = subprocess.run(["fastshare", "--help"], capture_output=True, text=True, check=True)
    assert "Usage: fastshare" in out.stdout


def test_generated_protos_import():
    from fastshare.v1 import common_pb2

    assert common_pb2.SHARE_KIND_EXCLUSIVE == 3
