"""Render the Kubernetes manifests (CRD, namespace, RBAC, controller, node agent) from jinja2.

The templates in ``templates/`` are the single source: the Ansible role ``roles/controller``
renders the same files (it has the same ``to_nice_yaml`` filter), and ``fastshare k8s
manifests`` prints them. Values are ``templates/defaults.yaml`` deep-merged with the user's.
"""

from __future__ import annotations

import copy
import re
from importlib import resources
from typing import Any

import jinja2
import yaml

from fastshare.controller import validation
from fastshare.k8s import names
from fastshare.k8s.resources import TOKEN_AUDIENCE

# Apply order: the namespace and CRD first, workloads last.
TEMPLATES = (
    "namespace.yaml.j2",
    "crd-fastpods.yaml.j2",
    "crd-fastshareallocations.yaml.j2",
    "rbac.yaml.j2",
    "controller.yaml.j2",
    "node-agent.yaml.j2",
)


class ValuesError(ValueError):
    """A values file has a key the templates do not know, or a value of the wrong type."""


def _templates():
    return resources.files("fastshare.k8s") / "templates"


def default_values() -> dict[str, Any]:
    return yaml.safe_load((_templates() / "defaults.yaml").read_text())


# What a value (or a free-form map's key) may be: the characters of Kubernetes names, labels,
# image references, paths and quantities. Values are pasted into YAML by the templates, so
# quotes, colons followed by a space, '#', newlines or braces could change the document.
_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@+=-]{0,252}$")


def _scalar(where: str, default: Any, value: Any) -> Any:
    """``value`` if it has the default's type and only characters that render as themselves."""
    kind = type(default)
    low, high = (1, 65535) if where.lower().endswith("port") else (0, 2**31 - 1)   # a Pod's ports
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
        raise ValuesError(f"{where}: must be an integer in {low}..{high}, got {value!r}")
    if kind is str and not (isinstance(value, str) and _SAFE.fullmatch(value)):
        raise ValuesError(f"{where}: must be 1-253 characters of letters, digits and . _ / : @ + = - "
                          f"(starting with a letter or digit), got {value!r}")
    return value


def _free_form(where: str, base: dict[str, Any], value: dict[str, Any]) -> dict[str, Any]:
    """Maps such as labels and resources take the user's keys; keys and leaves must be safe."""
    merged = copy.deepcopy(base)
    for key, item in value.items():
        _scalar(f"{where} key", "", key)
        if isinstance(item, dict):
            inner = base.get(key) if isinstance(base.get(key), dict) else {}
            merged[key] = _free_form(f"{where}.{key}", inner, item)
        elif (isinstance(item, int | float) and not isinstance(item, bool)) or item == "":
            merged[key] = item
        else:
            merged[key] = _scalar(f"{where}.{key}", "", item)
    return merged


# Values that existed once: what replaced them.
_REMOVED = {
    "agent.tlsSecret": "each node agent now gets its own certificate from the controller (agent.caConfigMap "
                       "names the ConfigMap with the CA certificate; README, Kubernetes)",
}


def _merge(base: dict[str, Any], override: dict[str, Any], path: str = "") -> dict[str, Any]:
    """Deep merge; a key absent from the defaults is a typo, so it is refused by name."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        where = f"{path}{key}"
        if key not in base:
            removed = f"; {_REMOVED[where]}" if where in _REMOVED else ""
            raise ValuesError(f"{where}: unknown value (known: {', '.join(sorted(base))}){removed}")
        if isinstance(base[key], dict):
            if not isinstance(value, dict):
                raise ValuesError(f"{where}: must be a mapping, got {type(value).__name__}")
            free_form = key in ("labels", "resources")
            merged[key] = _free_form(where, base[key], value) if free_form else _merge(base[key], value,
                                                                                       f"{where}.")
        else:
            merged[key] = _scalar(where, base[key], value)
    return merged


# Values that name a Kubernetes object: the kind the API server checks the name as, and its rule
# (a refused name would otherwise fail only at `kubectl apply`).
_NAMES = {
    "namespace": ("a Namespace", names.namespace_problem),
    # also its Deployment, ClusterRole(Binding)s, Roles (NAME-...) and Pods' app.kubernetes.io/name
    "controller.name": ("a Service", names.service_name_problem),
    "controller.serviceAccount": ("a ServiceAccount", names.name_problem),
    "controller.leaseName": ("a Lease", names.name_problem),
    "controller.tlsSecret": ("a Secret", names.name_problem),
    "agent.name": ("a DaemonSet", names.labelled_name_problem),   # and its Pods' app.kubernetes.io/name
    "agent.serviceAccount": ("a ServiceAccount", names.name_problem),
    "agent.caConfigMap": ("a ConfigMap", names.name_problem),
}


def _check_names(values: dict[str, Any]) -> None:
    """Refuse a name, label key or label value Kubernetes refuses, naming the key, the value and the rule."""
    for key, (kind, problem) in _NAMES.items():
        value = values
        for part in key.split("."):
            value = value[part]
        if why := problem(value):
            raise ValuesError(f"{key}: {value!r} cannot name {kind}: {why}")
    if why := names.label_key_problem(values["gpuNodeLabel"]):
        raise ValuesError(f"gpuNodeLabel: {values['gpuNodeLabel']!r} cannot be a label key: {why}")
    for key, value in values["labels"].items():
        if why := names.label_key_problem(key):
            raise ValuesError(f"labels: {key!r} cannot be a label key: {why}")
        why = names.label_value_problem(value) if isinstance(value, str) else "must be a string"
        if why:
            raise ValuesError(f"labels.{key}: {value!r} cannot be a label value: {why}")


def _to_nice_yaml(value: Any, indent: int = 2) -> str:
    """Block-style YAML, like Ansible's filter of the same name (so both render alike)."""
    return yaml.safe_dump(value, default_flow_style=False, indent=indent, sort_keys=True)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FunctionLoader(lambda name: (_templates() / name).read_text()),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # YAML, not HTML
    )
    env.filters["to_nice_yaml"] = _to_nice_yaml
    env.globals["limits"] = validation.schema_limits()  # not a value: the controller's own ranges
    env.globals["tokenAudience"] = TOKEN_AUDIENCE   # not a value: the controller checks this one
    return env


def merged_values(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """The templates' defaults with ``values`` merged in (what the manifests are rendered from)."""
    merged = _merge(default_values(), values or {})
    _check_names(merged)
    return merged


def render_text(values: dict[str, Any] | None = None) -> str:
    """All manifests as one multi-document YAML stream."""
    merged = merged_values(values)
    env = _environment()
    return "---\n".join(env.get_template(name).render(**merged).strip() + "\n" for name in TEMPLATES)


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """All manifests as Kubernetes objects, in apply order."""
    return [doc for doc in yaml.safe_load_all(render_text(values)) if doc]


def crds(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The CustomResourceDefinitions alone (FastPod, FastShareAllocation), in apply order."""
    return [d for d in render(values) if d["kind"] == "CustomResourceDefinition"]


def crd(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """The FastPod CustomResourceDefinition alone."""
    return next(d for d in crds(values) if d["metadata"]["name"] == "fastpods.fastshare.io")
