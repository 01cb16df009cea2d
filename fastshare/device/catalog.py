"""GPU model catalog: what each supported model looks like (memory, SMs, MIG profiles).

The source is ../shared/design/GPU-FACTS.md. At run time NVML is the truth; this table feeds
the simulated NVML, validation, the placement engine (which must reason about models it is
not connected to) and the tests.

Memory per MIG profile: the A100-40GB values (4864 / 9856 / 19968 / 40192 MiB) are from the
GPU-FACTS tables. A100-80GB and H100 values are those public ``nvidia-smi mig -lgip`` outputs
show; H200, H100 PCIe and A30 values are DERIVED (per-memory-slice size = total memory / memory
slices, rounded down to 128 MiB, times the profile's memory slices) because no table gave them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from fastshare.device.api import MigProfile

# NVML_GPU_INSTANCE_PROFILE_* enum INDEXES (not the profile ids create calls take).
ENUM_1_SLICE = 0x0
ENUM_2_SLICE = 0x1
ENUM_3_SLICE = 0x2
ENUM_4_SLICE = 0x3
ENUM_7_SLICE = 0x4
ENUM_1_SLICE_REV1 = 0x7  # 1g + media extensions
ENUM_2_SLICE_REV1 = 0x8  # 2g + media extensions (A30 only here)
ENUM_1_SLICE_REV2 = 0x9  # 1g with two memory slices


class MigEngines(NamedTuple):
    """The copy and media engines of a GPU instance of one profile, as NVML reports them (its
    compute instances and MIG devices share them). No MIG-capable model here has an encoder."""

    copy: int
    decoders: int
    jpeg: int
    ofa: int


class CatalogError(ValueError):
    """Unknown model or profile, or no profile can satisfy a request (message says why)."""


def find_profile(profiles: Iterable[MigProfile], name_or_id: str | int) -> MigProfile | None:
    """A profile by name ("3g.20gb", case-insensitive) or id (9 or "9"), or None."""
    text = str(name_or_id).strip().lower()
    for p in profiles:
        if p.name.lower() == text or (text.isascii() and text.isdigit() and p.profile_id == int(text)):
            return p
    return None


def known_profiles(profiles: Iterable[MigProfile]) -> str:
    return ", ".join(f"{p.name} (id {p.profile_id})" for p in profiles) or "none"


@dataclass(frozen=True)
class GpuModel:
    """One GPU model as the catalog knows it."""

    key: str                     # short name used on the command line, e.g. "A100-SXM4-40GB"
    name: str                    # NVML product name, e.g. "NVIDIA A100-SXM4-40GB"
    architecture: str            # "volta" | "turing" | "ampere" | "ada" | "hopper" | "pascal"
    memory_mib: int
    sm_count: int
    pci_device_id: int
    mig_capable: bool = False
    # Ampere keeps a MIG mode change pending until the GPU is reset; Hopper applies it at once.
    mig_pending_until_reset: bool = False
    compute_slices: int = 0
    memory_slices: int = 0
    profiles: tuple[MigProfile, ...] = ()
    profile_enum: tuple[tuple[int, int], ...] = ()   # (NVML enum index, profile id)
    mig_engines: tuple[tuple[int, MigEngines], ...] = ()   # (profile id, its engines)
    aliases: tuple[str, ...] = ()

    def profile(self, name_or_id: str | int) -> MigProfile:
        """A profile by name ("3g.20gb", case-insensitive) or id (9 or "9")."""
        found = find_profile(self.profiles, name_or_id)
        if found is None:
            raise CatalogError(f"profile {name_or_id!r} does not exist on {self.key}; "
                               f"known: {known_profiles(self.profiles)}")
        return found

    def profile_by_enum(self, enum_index: int) -> MigProfile | None:
        """The profile NVML reports for a NVML_GPU_INSTANCE_PROFILE_* index, if any."""
        for index, profile_id in self.profile_enum:
            if index == enum_index:
                return self.profile(profile_id)
        return None

    def engines(self, profile_id: int) -> MigEngines:
        for pid, engines in self.mig_engines:
            if pid == profile_id:
                return engines
        raise CatalogError(f"profile id {profile_id} does not exist on {self.key}")

    def enum_of(self, profile_id: int) -> int:
        for index, pid in self.profile_enum:
            if pid == profile_id:
                return index
        raise CatalogError(f"profile id {profile_id} does not exist on {self.key}")


def _derived(total_mib: int, memory_slices: int, slices: int) -> int:
    """Memory of a profile that no table gave us: its share of the memory slices."""
    per_slice = (total_mib // memory_slices) // 128 * 128
    return per_slice * slices


# (enum, id, name suffix template, compute slices, memory slices, max instances, placements)
_A100_SHAPES = (
    (ENUM_1_SLICE, 19, "1g.{m1}gb", 1, 1, 7, (0, 1, 2, 3, 4, 5, 6)),
    (ENUM_1_SLICE_REV1, 20, "1g.{m1}gb+me", 1, 1, 1, (0, 1, 2, 3, 4, 5, 6)),
    (ENUM_1_SLICE_REV2, 15, "1g.{m2}gb", 1, 2, 4, (0, 2, 4, 6)),
    (ENUM_2_SLICE, 14, "2g.{m2}gb", 2, 2, 3, (0, 2, 4)),
    (ENUM_3_SLICE, 9, "3g.{m4}gb", 3, 4, 2, (0, 4)),
    (ENUM_4_SLICE, 5, "4g.{m4}gb", 4, 4, 1, (0,)),
    (ENUM_7_SLICE, 0, "7g.{m8}gb", 7, 8, 1, (0,)),
)


# Engines per profile id: the MIG user guide's "Supported MIG Profiles" tables (A100-SXM4-40GB,
# whose -80GB names differ only in memory; H100 80GB "PCIe and SXM5"; H200 141GB), which
# `nvidia-smi mig -lgip` on A100s and H100s shows alike. Hopper has a JPEG decoder per slice
# and 8 copy engines in its 7g.
_AMPERE_ENGINES = ((19, MigEngines(1, 0, 0, 0)), (20, MigEngines(1, 1, 1, 1)), (15, MigEngines(1, 1, 0, 0)),
                   (14, MigEngines(2, 1, 0, 0)), (9, MigEngines(3, 2, 0, 0)), (5, MigEngines(4, 2, 0, 0)),
                   (0, MigEngines(7, 5, 1, 1)))
_HOPPER_ENGINES = ((19, MigEngines(1, 1, 1, 0)), (20, MigEngines(1, 1, 1, 1)), (15, MigEngines(1, 1, 1, 0)),
                   (14, MigEngines(2, 2, 2, 0)), (9, MigEngines(3, 3, 3, 0)), (5, MigEngines(4, 4, 4, 0)),
                   (0, MigEngines(8, 7, 7, 1)))
# A30: `nvidia-smi mig -lgip` on A30s (R535), which gives its 1g.6gb a decoder where the
# guide's table says none; NVML is the truth. Its 2g.12gb+me: 2 CE, 2 DEC, 1 JPEG, 1 OFA in
# both the guide's table and that listing.
_A30_ENGINES = ((14, MigEngines(1, 1, 0, 0)), (21, MigEngines(1, 1, 1, 1)), (5, MigEngines(2, 2, 0, 0)),
                (6, MigEngines(2, 2, 1, 1)), (0, MigEngines(4, 4, 1, 1)))


def _seven_slice_profiles(
    gb: dict[str, int], sms: dict[int, int], mib: dict[int, int]
) -> tuple[tuple[MigProfile, ...], tuple[tuple[int, int], ...]]:
    """Profiles of a 7-compute/8-memory-slice GPU (A100, H100, H200 share placements)."""
    profiles = []
    enum = []
    for index, pid, template, cslices, mslices, max_n, starts in _A100_SHAPES:
        sm_pid = 19 if pid == 20 else pid   # 1g+me has the SMs and memory of 1g
        profiles.append(MigProfile(
            profile_id=pid, name=template.format(**{f"m{k}": v for k, v in gb.items()}),
            slices=cslices, memory_slices=mslices, memory_mib=mib[sm_pid], sm_count=sms[sm_pid],
            max_instances=max_n, placements=starts,
        ))
        enum.append((index, pid))
    return tuple(profiles), tuple(enum)


def _mib_derived(total: int) -> dict[int, int]:
    return {19: _derived(total, 8, 1), 15: _derived(total, 8, 2), 14: _derived(total, 8, 2),
            9: _derived(total, 8, 4), 5: _derived(total, 8, 4), 0: _derived(total, 8, 8)}


def _mig_model(key: str, name: str, arch: str, memory_mib: int, sm_count: int, pci: int,
               gb: dict[str, int], sms: dict[int, int], mib: dict[int, int],
               aliases: tuple[str, ...] = ()) -> GpuModel:
    profiles, enum = _seven_slice_profiles(gb, sms, mib)
    return GpuModel(
        key=key, name=name, architecture=arch, memory_mib=memory_mib, sm_count=sm_count,
        pci_device_id=pci, mig_capable=True, mig_pending_until_reset=(arch == "ampere"),
        compute_slices=7, memory_slices=8, profiles=profiles, profile_enum=enum,
        mig_engines=_AMPERE_ENGINES if arch == "ampere" else _HOPPER_ENGINES, aliases=aliases,
    )


def _a30() -> GpuModel:
    # A30 shapes are inferred from a public mock (GPU-FACTS.md), memory derived.
    # 2g.12gb+me (driver R525 and later: the MIG user guide's "Supported MIG Profiles" A30 table
    # and its note): id 6, 28 SMs, max 1 instance, placements {0,2}:2 from `nvidia-smi mig -lgip`
    # and -lgipp on an A30 with driver 535.183.01; NVML index 2_SLICE_REV1 (0x8) from nvml.h's
    # NVML_GPU_INSTANCE_PROFILE_* defines. That listing gives it the 2g.12gb's memory (11.69 GiB
    # both); the catalog's is DERIVED, as the 2g.12gb's is (the 4g's differs across drivers:
    # 23.50 GiB on an older listing, 23.44 on that one). Its memory and slices equal the
    # 2g.12gb's, so a request that does not name it gets the plain one (see _fitting and
    # fastshare.placement.mig.smallest_profiles).
    total = 24576
    rows = (
        (ENUM_1_SLICE, 14, "1g.6gb", 1, 1, 4, (0, 1, 2, 3), 14),
        (ENUM_1_SLICE_REV1, 21, "1g.6gb+me", 1, 1, 1, (0, 1, 2, 3), 14),
        (ENUM_2_SLICE, 5, "2g.12gb", 2, 2, 2, (0, 2), 28),
        (ENUM_2_SLICE_REV1, 6, "2g.12gb+me", 2, 2, 1, (0, 2), 28),
        (ENUM_4_SLICE, 0, "4g.24gb", 4, 4, 1, (0,), 56),
    )
    profiles = tuple(
        MigProfile(profile_id=pid, name=name, slices=c, memory_slices=m,
                   memory_mib=_derived(total, 4, m), sm_count=sm, max_instances=n, placements=s)
        for _, pid, name, c, m, n, s, sm in rows
    )
    return GpuModel(
        key="A30-24GB", name="NVIDIA A30", architecture="ampere", memory_mib=total, sm_count=56,
        pci_device_id=0x20B710DE, mig_capable=True, mig_pending_until_reset=True,
        compute_slices=4, memory_slices=4, profiles=profiles,
        profile_enum=tuple((r[0], r[1]) for r in rows), mig_engines=_A30_ENGINES, aliases=("A30",),
    )


def _plain(key: str, name: str, arch: str, memory_mib: int, sm_count: int, pci: int,
           aliases: tuple[str, ...] = ()) -> GpuModel:
    return GpuModel(key=key, name=name, architecture=arch, memory_mib=memory_mib,
                    sm_count=sm_count, pci_device_id=pci, aliases=aliases)


_H100_80_MIB = {19: 9984, 15: 19968, 14: 20096, 9: 40320, 5: 40320, 0: 80768}

MODELS: dict[str, GpuModel] = {m.key: m for m in (
    _mig_model(
        "A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", "ampere", 40960, 108, 0x20B010DE,
        gb={"1": 5, "2": 10, "4": 20, "8": 40},
        sms={19: 14, 15: 14, 14: 28, 9: 42, 5: 56, 0: 98},
        mib={19: 4864, 15: 9856, 14: 9856, 9: 19968, 5: 19968, 0: 40192},
        aliases=("A100-40GB", "A100"),
    ),
    _mig_model(
        "A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB", "ampere", 81920, 108, 0x20B210DE,
        gb={"1": 10, "2": 20, "4": 40, "8": 80},
        sms={19: 14, 15: 14, 14: 28, 9: 42, 5: 56, 0: 98},
        mib={19: 9728, 15: 19968, 14: 19968, 9: 40192, 5: 40192, 0: 80896},
        aliases=("A100-80GB",),
    ),
    _mig_model(
        "H100-SXM5-80GB", "NVIDIA H100 80GB HBM3", "hopper", 81559, 132, 0x233010DE,
        gb={"1": 10, "2": 20, "4": 40, "8": 80},
        sms={19: 16, 15: 26, 14: 32, 9: 60, 5: 64, 0: 132},
        mib=_H100_80_MIB, aliases=("H100-80GB", "H100", "H100-SXM"),
    ),
    _mig_model(
        "H100-PCIE-80GB", "NVIDIA H100 PCIe", "hopper", 81559, 114, 0x233110DE,
        gb={"1": 10, "2": 20, "4": 40, "8": 80},
        sms={19: 14, 15: 14, 14: 30, 9: 46, 5: 62, 0: 114},
        mib=_H100_80_MIB, aliases=("H100-PCIE",),
    ),
    _mig_model(
        "H200-SXM5-141GB", "NVIDIA H200", "hopper", 143771, 132, 0x233510DE,
        gb={"1": 18, "2": 35, "4": 71, "8": 141},
        sms={19: 16, 15: 26, 14: 32, 9: 60, 5: 64, 0: 132},
        mib=_mib_derived(143771), aliases=("H200",),
    ),
    _a30(),
    _plain("L4", "NVIDIA L4", "ada", 23034, 58, 0x27B810DE),
    _plain("V100-SXM2-16GB", "Tesla V100-SXM2-16GB", "volta", 16384, 80, 0x1DB110DE,
           aliases=("V100", "V100M16")),
    _plain("V100-SXM2-32GB", "Tesla V100-SXM2-32GB", "volta", 32768, 80, 0x1DB510DE,
           aliases=("V100M32",)),
    _plain("T4", "Tesla T4", "turing", 15360, 40, 0x1EB810DE),
    _plain("A10", "NVIDIA A10", "ampere", 23028, 72, 0x223610DE),
    _plain("P100-PCIE-16GB", "Tesla P100-PCIE-16GB", "pascal", 16384, 56, 0x15F810DE,
           aliases=("P100",)),
)}


def _norm(text: str) -> str:
    text = text.strip().upper().replace(" ", "-").replace("_", "-")
    for prefix in ("NVIDIA-", "TESLA-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text


# Every name a model goes by, normalized, to the first model in MODELS that has it. Asked for
# each GPU of each inventory a reconcile pass reads: going over the catalog for each took half of
# a pass at 5,000 nodes.
_BY_NAME: dict[str, GpuModel] = {}
for _model in MODELS.values():
    for _name in (_model.key, _model.name, *_model.aliases):
        _BY_NAME.setdefault(_norm(_name), _model)


def get_model(name: str) -> GpuModel:
    """A model by catalog key, alias or NVML product name (case-insensitive)."""
    model = _BY_NAME.get(_norm(name))
    if model is None:
        raise CatalogError(f"unknown GPU model {name!r}; known: {', '.join(MODELS)}")
    return model


def find_model(name: str) -> GpuModel | None:
    """Like :func:`get_model` but None for an unknown model (NVML may report anything)."""
    try:
        return get_model(name)
    except CatalogError:
        return None


def required_sms(model: GpuModel, sm_count: int | None = None,
                 sm_percent: float | None = None) -> int:
    """SMs a request needs: an absolute count or a percentage of the WHOLE GPU's SMs."""
    need = 0
    if sm_count is not None:
        if sm_count < 0:
            raise CatalogError(f"sm_count must be >= 0, got {sm_count}")
        need = sm_count
    if sm_percent is not None:
        if not 0 <= sm_percent <= 100:
            raise CatalogError(f"sm_percent must be within 0..100, got {sm_percent}")
        need = max(need, math.ceil(sm_percent * model.sm_count / 100 - 1e-9))
    return need


def _fitting(model: GpuModel, need_sms: int, memory_mib: int) -> Iterable[MigProfile]:
    for p in model.profiles:
        if p.media:       # media-extension profiles are only chosen by name
            continue
        if p.sm_count >= need_sms and p.memory_mib >= memory_mib:
            yield p


def smallest_profile(model: GpuModel, *, sm_count: int | None = None,
                     sm_percent: float | None = None, memory_mib: int = 0) -> MigProfile | None:
    """The cheapest profile (fewest memory slices, then compute slices) meeting the request."""
    need = required_sms(model, sm_count, sm_percent)
    candidates = sorted(_fitting(model, need, memory_mib),
                        key=lambda p: (p.memory_slices, p.slices, p.memory_mib, p.profile_id))
    return candidates[0] if candidates else None


def choose_profile(model: GpuModel, *, sm_count: int | None = None,
                   sm_percent: float | None = None, memory_mib: int = 0) -> MigProfile:
    """:func:`smallest_profile`, or a CatalogError that says in words why nothing fits."""
    if not model.mig_capable:
        raise CatalogError(f"{model.key} does not support MIG; use a whole GPU or an MPS share")
    found = smallest_profile(model, sm_count=sm_count, sm_percent=sm_percent, memory_mib=memory_mib)
    if found is not None:
        return found
    need = required_sms(model, sm_count, sm_percent)
    biggest_sm = max(p.sm_count for p in model.profiles)
    biggest_mem = max(p.memory_mib for p in model.profiles)
    reasons = []
    if need > biggest_sm:
        reasons.append(
            f"{need} SMs requested but the largest MIG slice on {model.key} has {biggest_sm} of the "
            f"GPU's {model.sm_count} SMs; request a whole GPU instead"
        )
    if memory_mib > biggest_mem:
        reasons.append(f"{memory_mib} MiB requested but the largest MIG slice on {model.key} has "
                       f"{biggest_mem} MiB")
    if not reasons:
        reasons.append(f"no single MIG profile on {model.key} has both {need} SMs and {memory_mib} MiB")
    raise CatalogError("; ".join(reasons))
