"""The agent's own vocabulary, free of gRPC types: a share request and what preparing it gave."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace

from fastshare.controller.validation import KEY_RE, MAX_KEY_LENGTH, MAX_LEASE_TTL, MIN_LEASE_TTL

KINDS = ("fastpod", "mps", "exclusive", "whole")
# \Z, not $: "$" also matches before a final newline ("fp\n" passed, then broke the share files)
SHARE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
DEVICE_UUID_RE = re.compile(r"^(GPU|MIG)-[A-Za-z0-9-]{1,80}\Z")
OWNER_MAX = 256


class InvalidShare(ValueError):
    """A share request that can never succeed; the message names the field and the range."""


_ENCODER = json.JSONEncoder(sort_keys=True)   # what json.dumps(..., sort_keys=True) builds per call


def _flat_json(obj: object) -> str:
    """JSON of a dataclass whose fields are all JSON values already (str, numbers, tuples, dicts
    of str): ``vars`` gives the same document as ``asdict`` without its deep copy, which was a
    tenth of the agent's CPU per prepare."""
    return _ENCODER.encode(vars(obj))


@dataclass(frozen=True)
class ShareSpec:
    id: str
    kind: str
    device_uuids: tuple[str, ...]
    mig_profile: str = ""
    mig_start: int | None = None
    sm_percent: int = 0
    memory_bytes: int = 0
    quota_request: float = 0.0
    quota_limit: float = 0.0
    owner: str = ""
    # The controller's bookkeeping of the allocation (see agent.proto Share); defaults: journals
    # written before these fields load as "none"
    idempotency_key: str = ""
    lease_ttl_seconds: int = 0

    def same_share(self, other: ShareSpec) -> bool:
        """Whether ``other`` asks for this very share. The key and the lease ttl are the
        controller's bookkeeping, not what the share is: a share journaled by an older agent
        (without them) is the same share when an upgraded controller prepares it again with
        them, and so is one whose lease the client renewed with another ttl."""
        return replace(self, idempotency_key="", lease_ttl_seconds=0) == \
            replace(other, idempotency_key="", lease_ttl_seconds=0)

    def validate(self) -> None:
        """Shape checks only (no device knowledge): raise InvalidShare naming the field."""
        if not SHARE_ID_RE.match(self.id):
            raise InvalidShare("share.id must be 1-128 characters of [A-Za-z0-9._-] starting with a "
                               f"letter or digit, got {self.id!r}")
        if self.kind not in KINDS:
            raise InvalidShare(f"share.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not self.device_uuids:
            raise InvalidShare("share.device_uuids must name the GPU (or MIG device) to use")
        if self.kind != "whole" and len(self.device_uuids) != 1:
            raise InvalidShare(f"share.device_uuids must hold exactly one UUID for kind {self.kind}, "
                               f"got {len(self.device_uuids)}")
        if len(set(self.device_uuids)) != len(self.device_uuids):
            raise InvalidShare("share.device_uuids lists a device twice")
        for uuid in self.device_uuids:
            if not DEVICE_UUID_RE.match(uuid):
                raise InvalidShare(f"share.device_uuids: {uuid!r} is not a GPU-… or MIG-… UUID")
        if len(self.owner) > OWNER_MAX:
            raise InvalidShare(f"share.owner must be at most {OWNER_MAX} characters")
        if self.kind in ("exclusive", "whole") and any(u.startswith("MIG-") for u in self.device_uuids):
            raise InvalidShare(f"share.device_uuids: kind {self.kind} takes GPU UUIDs, not MIG devices")
        if self.kind == "exclusive":
            if not self.mig_profile:
                raise InvalidShare("share.mig_profile is required for kind exclusive (e.g. '3g.20gb')")
            if self.mig_start is not None and not 0 <= self.mig_start <= 7:
                raise InvalidShare(f"share.mig_start must be 0..7, got {self.mig_start}")
        elif self.mig_profile or self.mig_start is not None:
            raise InvalidShare(f"share.mig_profile/mig_start only apply to kind exclusive, not {self.kind}")
        if self.kind == "fastpod":
            if not 1 <= self.sm_percent <= 100:
                raise InvalidShare(f"share.sm_percent must be 1..100 for kind fastpod, got {self.sm_percent}")
            if self.memory_bytes <= 0:
                raise InvalidShare("share.memory_bytes must be > 0 for kind fastpod")
            for name, value in (("quota_request", self.quota_request), ("quota_limit", self.quota_limit)):
                if not (math.isfinite(value) and 0 < value <= 1):
                    raise InvalidShare(f"share.{name} must be in (0, 1] for kind fastpod, got {value}")
            if self.quota_request > self.quota_limit:
                raise InvalidShare(f"share.quota_request ({self.quota_request}) must not exceed "
                                   f"share.quota_limit ({self.quota_limit})")
        elif self.sm_percent or self.quota_request or self.quota_limit:
            raise InvalidShare(f"share.sm_percent/quota_request/quota_limit only apply to kind fastpod, "
                               f"not {self.kind}")
        if self.kind in ("exclusive", "whole") and self.memory_bytes:
            raise InvalidShare(f"share.memory_bytes does not apply to kind {self.kind} "
                               "(the device's memory comes with it)")
        if self.memory_bytes < 0:
            raise InvalidShare("share.memory_bytes must be >= 0")
        if self.idempotency_key and not KEY_RE.fullmatch(self.idempotency_key):
            raise InvalidShare(f"share.idempotency_key must be empty or 1-{MAX_KEY_LENGTH} characters of "
                               "letters, digits, '.', '_', ':', '/', '-'")
        if self.lease_ttl_seconds and not MIN_LEASE_TTL <= self.lease_ttl_seconds <= MAX_LEASE_TTL:
            raise InvalidShare(f"share.lease_ttl_seconds must be 0 (no lease) or in {MIN_LEASE_TTL}.."
                               f"{MAX_LEASE_TTL}, got {self.lease_ttl_seconds}")

    def to_json(self) -> str:
        return _flat_json(self)

    @classmethod
    def from_json(cls, text: str) -> ShareSpec:
        data = json.loads(text)
        data["device_uuids"] = tuple(data["device_uuids"])
        return cls(**data)


@dataclass(frozen=True)
class Prepared:
    """What a prepared share gives its workload."""

    env: dict[str, str] = field(default_factory=dict)
    host_paths: dict[str, str] = field(default_factory=dict)
    device_uuids: tuple[str, ...] = ()
    port: int = 0
    mig_start: int | None = None

    def to_json(self) -> str:
        return _flat_json(self)

    @classmethod
    def from_json(cls, text: str) -> Prepared:
        data = json.loads(text)
        data["device_uuids"] = tuple(data["device_uuids"])
        return cls(**data)
