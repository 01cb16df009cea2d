"""`fastshare k8s ...`: the Kubernetes side (manifests now; the in-cluster controller next)."""

from __future__ import annotations

import sys
from pathlib import Path

import click
import yaml

from fastshare.cli._output import fail


@click.group("k8s")
def k8s() -> None:
    """Run fastshare inside a Kubernetes cluster (FastPod CRD, controller, node agents)."""


@k8s.command("manifests")
@click.option("--values", "values_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="YAML file overriding templates/defaults.yaml (namespace, image, ...).")
@click.option("--crd-only", is_flag=True, help="Print only the FastPod CustomResourceDefinition.")
def manifests_cmd(values_file: Path | None, crd_only: bool) -> None:
    """Print the manifests (CRD, namespace, RBAC, controller, node agent) as YAML for kubectl apply."""
    from fastshare.k8s import manifests

    values = {}
    if values_file is not None:
        try:
            values = yaml.safe_load(values_file.read_text()) or {}
        except yaml.YAMLError as exc:
            fail(f"{values_file}: not valid YAML: {exc}")
        if not isinstance(values, dict):
            fail(f"{values_file}: must be a YAML mapping of values, got {type(values).__name__}")
    try:
        if crd_only:
            sys.stdout.write(yaml.safe_dump(manifests.crd(values), sort_keys=False))
        else:
            sys.stdout.write(manifests.render_text(values))
    except manifests.ValuesError as exc:
        fail(f"{values_file}: {exc}", hint="see `fastshare k8s manifests` output or templates/defaults.yaml")


COMMANDS = [k8s]
