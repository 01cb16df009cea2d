"""Request validation at the API: every error names the field and the allowed range.

Runs before anything is placed or stored, so a bad request leaves no state behind. Checks
that depend on the cluster (largest GPU, MIG profiles of the models present) take the GPUs
the controller knows about; with no GPU registered those checks are left to placement, which
then rejects with "no node".
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from fastshare.controller.model import Gpu, Kind, Spec
from fastshare.device import catalog
from fastshare.k8s.names import label_key_problem

MAX_LEASE_TTL = 7 * 24 * 3600
MIN_LEASE_TTL = 5
# Ranges that do not depend on the cluster. The FastPod CRD's schema is rendered from these
# (fastshare.k8s.manifests), so the API server and the controller refuse the same requests.
MAX_GPUS_PER_NODE = 16
MAX_SM_COUNT = 1024
MAX_LIST_ENTRIES = 64
MAX_MODEL_LENGTH = 128
MAX_ID_LENGTH = 128                   # ids are "fs-", hex digits, "-" and 8 hex digits (model.py)
MAX_NODE_NAME_LENGTH = 253            # a host name
MAX_MIG_PROFILE_LENGTH = 32           # a name ("1g.10gb+me") or a profile id
MAX_LABEL_KEY_LENGTH = 253 + 1 + 63   # a Kubernetes label key: DNS prefix, '/', name
MAX_LABEL_VALUE_LENGTH = 63
TAG_PATTERN = r"^[A-Za-z0-9._/-]{1,63}$"
# fullmatch, not match: '$' also matches before a final newline, which neither set allows
# (the API server's RE2 refuses it too)
# Keys fit an in-cluster replica's key: namespace/fastpod/pod is up to 63+1+63+1+70 characters
# (fastshare.k8s.store.replica_key), all of which the FastPod CRD accepts.
MAX_KEY_LENGTH = 256
KEY_RE = re.compile(rf"^[A-Za-z0-9._:/-]{{1,{MAX_KEY_LENGTH}}}$")   # also checked by the node agent
_TAG_RE = re.compile(TAG_PATTERN)
_LABEL_VALUE_RE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def schema_limits() -> dict[str, int | str]:
    """The ranges above, under the names the CRD template uses."""
    return {"max_gpu_count": MAX_GPUS_PER_NODE, "max_sm_count": MAX_SM_COUNT,
            "max_list_entries": MAX_LIST_ENTRIES, "max_model_length": MAX_MODEL_LENGTH,
            "tag_pattern": TAG_PATTERN}
GiB = 1024**3
MiB = 1024**2


class ValidationError(ValueError):
    """A request field is out of range; ``field`` is its name in the API."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message


@dataclass(frozen=True)
class Request:
    """One Allocate call, decoded from the wire."""

    spec: Spec
    owner: str = ""
    idempotency_key: str = ""
    lease_ttl: int = 0


def _fraction(field: str, value: float) -> None:
    if not 0 < value <= 1:
        raise ValidationError(field, f"must be a fraction in (0, 1], got {value:g}")


def _human(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def _unused(spec: Spec, kind: Kind, names: Iterable[str]) -> None:
    for name in names:
        if getattr(spec, name):
            raise ValidationError(f"spec.{name}", f"does not apply to kind {kind.value}; leave it unset")


def _strings(field: str, values: Sequence[str]) -> None:
    if len(values) > MAX_LIST_ENTRIES:
        raise ValidationError(field, f"at most {MAX_LIST_ENTRIES} entries, got {len(values)}")
    if not all(values):
        raise ValidationError(field, "entries must not be empty")
    too_long = [v for v in values if len(v) > MAX_MODEL_LENGTH]
    if too_long:
        raise ValidationError(field, f"entries of at most {MAX_MODEL_LENGTH} characters, got "
                                     f"{len(too_long[0])}")


def _mig_models(gpus: Sequence[Gpu]) -> list[catalog.GpuModel]:
    found: dict[str, catalog.GpuModel] = {}
    for gpu in gpus:
        model = catalog.find_model(gpu.model)
        if model is not None and model.mig_capable:
            found[model.key] = model
    return list(found.values())


def _exclusive(spec: Spec, gpus: Sequence[Gpu]) -> None:
    if len(spec.mig_profile) > MAX_MIG_PROFILE_LENGTH:   # refusals below quote the name
        raise ValidationError("spec.mig_profile", f"at most {MAX_MIG_PROFILE_LENGTH} characters (a profile "
                                                  f"name such as 3g.20gb), got {len(spec.mig_profile)}")
    shapes = [n for n in ("mig_profile", "sm_count", "sm_percent") if getattr(spec, n)]
    if len(shapes) != 1:
        raise ValidationError("spec.mig_profile", "kind exclusive needs exactly one of mig_profile, "
                                                  f"sm_count or sm_percent, got {shapes or 'none'}")
    if spec.sm_percent and not 1 <= spec.sm_percent <= 100:
        raise ValidationError("spec.sm_percent", f"must be in 1..100, got {spec.sm_percent}")
    if not 0 <= spec.sm_count <= MAX_SM_COUNT:
        raise ValidationError("spec.sm_count", f"must be in 1..{MAX_SM_COUNT}, got {spec.sm_count}")
    if not gpus:
        return
    models = _mig_models(gpus)
    if not models:
        present = sorted({g.model for g in gpus})
        raise ValidationError("spec.kind", f"no MIG-capable GPU model is present (present: {present}); "
                                           "use kind fastpod, mps or whole")
    memory_mib = -(-spec.memory_bytes // MiB)
    reasons = []
    for model in models:
        try:
            if spec.mig_profile:
                profile = model.profile(spec.mig_profile)
                if profile.memory_mib < memory_mib:
                    raise catalog.CatalogError(f"{profile.name} on {model.key} has {profile.memory_mib} MiB")
            else:
                catalog.choose_profile(model, sm_count=spec.sm_count or None,
                                       sm_percent=spec.sm_percent or None, memory_mib=memory_mib)
            return
        except catalog.CatalogError as exc:
            reasons.append(str(exc))
    field = "spec.mig_profile" if spec.mig_profile else (
        "spec.sm_count" if spec.sm_count else "spec.sm_percent")
    raise ValidationError(field, "no MIG profile of a GPU model present fits: " + "; ".join(reasons))


def validate(request: Request, gpus: Sequence[Gpu], max_gpus_per_node: int = 0) -> None:
    """Raise :class:`ValidationError` for the first bad field of ``request``.

    ``gpus``: the GPUs the controller knows about, for ranges that depend on the cluster (one
    of each model and memory size will do)."""
    spec = request.spec
    if not isinstance(spec.kind, Kind):
        raise ValidationError("spec.kind", "must be one of fastpod, mps, exclusive, whole")
    kind = spec.kind
    largest = max((g.memory_bytes for g in gpus), default=0)
    if spec.memory_bytes < 0:   # 0 is "no memory asked" for exclusive and whole
        least = "> 0" if kind in (Kind.FASTPOD, Kind.MPS) else ">= 0"
        raise ValidationError("spec.memory_bytes", f"must be {least}, got {spec.memory_bytes}")
    if spec.memory_bytes and largest and spec.memory_bytes > largest:
        most, got = _human(largest), _human(spec.memory_bytes)
        if most == got:   # rounded alike: "<= 79.6 GiB, got 79.6 GiB" would read as a refusal of no excess
            most, got = f"{largest} bytes", f"{spec.memory_bytes} bytes"
        raise ValidationError("spec.memory_bytes", f"must be <= the largest GPU's memory ({most}), got {got}")
    if kind is Kind.FASTPOD:
        if not 1 <= spec.sm_percent <= 100:
            raise ValidationError("spec.sm_percent", f"must be in 1..100, got {spec.sm_percent}")
        if spec.memory_bytes <= 0:
            raise ValidationError("spec.memory_bytes", "must be > 0 for kind fastpod (a memory limit)")
        if spec.quota_request or spec.quota_limit:
            _fraction("spec.quota_request", spec.quota_request)
            _fraction("spec.quota_limit", spec.quota_limit)
            if spec.quota_limit < spec.quota_request:
                raise ValidationError("spec.quota_limit", f"must be >= quota_request "
                                      f"({spec.quota_request:g}), got {spec.quota_limit:g}")
        _unused(spec, kind, ("mig_profile", "sm_count"))
    elif kind is Kind.MPS:
        if spec.memory_bytes <= 0:
            raise ValidationError("spec.memory_bytes", "must be > 0 for kind mps")
        _unused(spec, kind, ("sm_percent", "quota_request", "quota_limit", "mig_profile", "sm_count"))
    elif kind is Kind.EXCLUSIVE:
        _unused(spec, kind, ("quota_request", "quota_limit"))
        _exclusive(spec, gpus)
    elif kind is Kind.WHOLE:
        if spec.gpu_count < 1:
            raise ValidationError("spec.gpu_count", f"must be >= 1 for kind whole, got {spec.gpu_count}")
        if spec.gpu_count > MAX_GPUS_PER_NODE:
            raise ValidationError("spec.gpu_count",
                                  f"must be in 1..{MAX_GPUS_PER_NODE}, got {spec.gpu_count}")
        if max_gpus_per_node and spec.gpu_count > max_gpus_per_node:
            raise ValidationError("spec.gpu_count", f"must be <= {max_gpus_per_node} (the most GPUs any "
                                                    f"node has), got {spec.gpu_count}")
        _unused(spec, kind, ("sm_percent", "quota_request", "quota_limit", "mig_profile", "sm_count",
                             "memory_bytes"))
    if kind is not Kind.WHOLE and spec.gpu_count > 1:
        raise ValidationError("spec.gpu_count", f"kind {kind.value} uses one GPU; use kind whole for "
                                                f"{spec.gpu_count} GPUs")
    _strings("spec.models", spec.models)
    for name in ("cpu_milli", "host_memory_bytes"):
        if getattr(spec, name) < 0:
            raise ValidationError(f"spec.{name}", f"must be >= 0, got {getattr(spec, name)}")
    if len(spec.node_selector) > MAX_LIST_ENTRIES:
        raise ValidationError("spec.node_selector",
                              f"at most {MAX_LIST_ENTRIES} entries, got {len(spec.node_selector)}")
    for key, value in spec.node_selector:
        if not key:
            raise ValidationError("spec.node_selector", "keys must not be empty")
        if len(key) > MAX_LABEL_KEY_LENGTH or len(value) > MAX_LABEL_VALUE_LENGTH:
            raise ValidationError("spec.node_selector",
                                  f"keys of at most {MAX_LABEL_KEY_LENGTH} characters and values of at "
                                  f"most {MAX_LABEL_VALUE_LENGTH} (as node labels), got {len(key)} and "
                                  f"{len(value)}")
    for name in ("affinity", "anti_affinity", "exclusion"):
        tag = getattr(spec, name)
        if tag and not _TAG_RE.fullmatch(tag):
            raise ValidationError(f"spec.{name}", f"tag {tag!r} is invalid: 1-63 characters of letters, "
                                                  "digits, '.', '_', '/', '-'")
    if len(request.owner) > 253:
        raise ValidationError("owner", f"at most 253 characters, got {len(request.owner)}")
    if not request.owner.isprintable():   # it is shown in `fastshare status` and in logs
        raise ValidationError("owner", "printable characters only (no newlines, tabs or control "
                                       "characters), e.g. a user or job name")
    if request.idempotency_key and not KEY_RE.fullmatch(request.idempotency_key):
        raise ValidationError("idempotency_key",
                              f"must be 1-{MAX_KEY_LENGTH} characters of letters, digits, "
                              "'.', '_', ':', '/', '-'")
    if request.lease_ttl and not MIN_LEASE_TTL <= request.lease_ttl <= MAX_LEASE_TTL:
        raise ValidationError("lease_ttl_seconds", f"must be 0 (no lease) or in {MIN_LEASE_TTL}.."
                                                   f"{MAX_LEASE_TTL}, got {request.lease_ttl}")


def check_allocation_id(value: str) -> None:
    """Get, Release, RenewLease, Watch: the id is required (except for Watch) and is quoted in
    a NOT_FOUND answer, which must fit gRPC's trailers."""
    if not value:
        raise ValidationError("allocation_id", "required: the id Allocate returned (fs-...)")
    if len(value) > MAX_ID_LENGTH:
        raise ValidationError("allocation_id", f"at most {MAX_ID_LENGTH} characters, got {len(value)}")


def check_node_name(value: str) -> None:
    if len(value) > MAX_NODE_NAME_LENGTH:
        raise ValidationError("node", f"at most {MAX_NODE_NAME_LENGTH} characters (a host name), "
                                      f"got {len(value)}")


def check_node_labels(labels: dict[str, str]) -> None:
    """RegisterNode's labels, by Kubernetes' rules: they are stored with the node and sent in
    every status, so a node's certificate must not be able to make them arbitrarily large."""
    if len(labels) > MAX_LIST_ENTRIES:
        raise ValidationError("labels", f"at most {MAX_LIST_ENTRIES} labels, got {len(labels)}")
    for key, value in labels.items():
        problem = (f"at most {MAX_LABEL_KEY_LENGTH} characters" if len(key) > MAX_LABEL_KEY_LENGTH
                   else label_key_problem(key))
        if problem:
            raise ValidationError("labels", f"label key {key[:80]!r}: {problem}")
        if len(value) > MAX_LABEL_VALUE_LENGTH or (value and not _LABEL_VALUE_RE.fullmatch(value)):
            raise ValidationError("labels", f"label value {value[:80]!r} of {key!r}: empty or at most "
                                            f"{MAX_LABEL_VALUE_LENGTH} letters, digits, '-', '_' and '.', "
                                            "starting and ending with a letter or digit")


def normalise(spec: Spec) -> Spec:
    """Fill defaults that other components count on. A fastpod without a time quota gets a
    guaranteed share equal to its SM share and no ceiling (request = sm %, limit = 1): the
    node agent admits shares while their guaranteed quotas add up to at most 1, and SM shares
    already add up to at most 100 % per GPU, so the default never blocks a placement."""
    if spec.kind is Kind.FASTPOD and not spec.quota_request and not spec.quota_limit:
        return replace(spec, quota_request=spec.sm_percent / 100, quota_limit=1.0)
    return spec
