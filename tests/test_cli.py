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


def _commands(command, path=("fastshare",)):
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _commands(sub, (*path, name))


def test_help_describes_every_option():
    # `--help` is the reference a user reads: an option listed with no words says nothing of
    # what it does (e.g. `bench mig --steps`, `run --kind`, `k8s controller --agent-port`)
    import click

    bare = [f"{' '.join(path)} {param.opts[0]}" for path, command in _commands(main)
            for param in command.params
            if isinstance(param, click.Option) and param.opts[0] != "--help" and not param.help]
    assert not bare, f"options without help text: {', '.join(bare)}"
