"""Generates gRPC/protobuf code from proto/ whenever the package is built or installed.

The generated modules land in fastshare/v1/ (package path = proto package path) and are never
committed: proto/ is the single source.
"""

from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build_py import build_py
from setuptools.command.develop import develop

ROOT = Path(__file__).resolve().parent


def generate_protos() -> None:
    from grpc_tools import protoc  # build requirement

    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    if not protos:
        return
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--python_out={ROOT}",
            f"--pyi_out={ROOT}", f"--grpc_python_out={ROOT}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {protos}")


class GenerateProtos(Command):
    description = "generate protobuf/gRPC modules from proto/"
    user_options: list = []

    def initialize_options(self) -> None: ...

    def finalize_options(self) -> None: ...

    def run(self) -> None:
        generate_protos()


class BuildPy(build_py):
    def run(self) -> None:
        generate_protos()
        super().run()


class Develop(develop):
    def run(self) -> None:
        generate_protos()
        super().run()


setup(cmdclass={"build_py": BuildPy, "develop": Develop, "generate_protos": GenerateProtos})
