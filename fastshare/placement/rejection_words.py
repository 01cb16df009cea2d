"""What a rejection says: the engine's reasons in words a user can act on.

The engine decides and gathers the figures (the folds of ``rejection_folds.py``, the GPUs it
looked at); these functions only word them, so a reason reads the same whichever way the
engine found it (a shape's heap, a fold per block of nodes, a look at every node).
"""

from __future__ import annotations

from collections.abc import Iterable

from fastshare.placement.ledger import GpuRecord, NodeRecord
from fastshare.placement.model import MILLI, GpuView, Request
from fastshare.placement.rejection_folds import HostFold, ShareFold, WholeFold


def fmt_mib(mib: float) -> str:
    return f"{mib / 1024:.1f} GiB" if mib >= 1024 and mib % 1024 else (
        f"{int(mib // 1024)} GiB" if mib >= 1024 else f"{int(mib)} MiB")


def some(names: list[str]) -> str:
    """The first three of ``names``, and how many more, for a message that must stay short."""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"{', '.join(names[:3])}{more}"


def only_looked(looked: int, nodes: int, why: str) -> str:
    """The GPU reason covers the ``looked`` nodes of ``nodes``: why the others were not ("" when
    none was left out)."""
    return f"; only {looked} of {nodes} node(s) were looked at: {why}" if why else ""


def host_words(r: Request, host: HostFold) -> list[str]:
    """How many nodes lack ``r``'s host CPU or memory, and the most free among them."""
    parts = []
    if host.no_cpu:
        parts.append(f"{host.no_cpu} node(s) lack {r.cpu_milli} milli-CPU; most free is "
                     f"{max(0, host.most_cpu[0])} on {host.most_cpu[2]}")
    if host.no_mem:
        parts.append(f"{host.no_mem} node(s) lack {fmt_mib(r.memory_mib)} host memory; most free is "
                     f"{fmt_mib(max(0, host.most_mem[0]))} on {host.most_mem[2]}")
    return parts


def share_words(r: Request, fold: ShareFold, looked: int, tagged: list[str],
                binding: tuple[str, int] | None) -> str:
    """Why no GPU of the ``looked`` nodes folded in ``fold`` takes share ``r``; ``tagged``: the
    GPUs with room for it that only the sharing tags rule out; ``binding``: the node and GPU
    its affinity tag binds it to, if any."""
    what = (f"{r.sm_percent:g} % SMs, {fmt_mib(r.gpu_memory_mib)} and {r.quota_request:g} time quota"
            if r.kind == "fastpod" else fmt_mib(r.gpu_memory_mib))
    if not fold.usable:   # no usable GPU
        models = f" of model {'/'.join(r.gpu_models)}" if r.gpu_models else ""
        if not fold.wanted:
            return f"no GPU{models} on the {looked} node(s) looked at"  # none is busy: none is there
        busy = "in MIG mode, held whole or shared otherwise"
        if fold.no_mps is None and fold.all_shut:   # lost, or closed: place() says why
            return f"no GPU{models} takes new {r.kind} shares now"
        if fold.no_mps is None:
            return (f"no GPU{models} is available for {r.kind} shares "
                    f"({'the others' if fold.any_shut else 'all'} are {busy})")
        more = f" (and {fold.no_mps_nodes - 1} more node(s))" if fold.no_mps_nodes > 1 else ""
        others = "" if fold.all_no_mps else f"the others are {busy}; "
        return (f"no GPU{models} is available for {r.kind} shares: {others}node "
                f"{fold.no_mps_at.view.name}{more} cannot run MPS: {fold.no_mps}")
    big, free = (*fold.big, fold.big_at.view.name), (*fold.free, fold.free_at.view.name)
    sm, quota = (*fold.sm, fold.sm_at.view.name), (*fold.quota, fold.quota_at.view.name)
    if r.gpu_memory_mib > big[0]:
        return (f"no GPU has {fmt_mib(r.gpu_memory_mib)} of memory; the largest is "
                f"{fmt_mib(big[0])} ({big[2]} GPU {-big[1]})")
    # GPUs with room that only the tags rule out: saying "no GPU with ... free" would be false
    if tagged:
        return (f"{what} is free on {len(tagged)} GPU(s), but the sharing tags rule them out: "
                f"{some(tagged)}")
    msg = (f"no GPU with {what} free; largest free memory is "
           f"{fmt_mib(max(0, free[0]))} on {free[2]} GPU {-free[1]}")
    if r.kind == "fastpod":
        msg += f", largest free SM share is {max(0, MILLI - sm[0]) / 10:g} % on {sm[2]} GPU {sm[1]}"
        msg += f", largest free time quota is {max(0.0, 1 - quota[0]):.2f} on {quota[2]} GPU {quota[1]}"
    if binding:
        node, idx = binding
        msg += f"; affinity tag {r.affinity!r} binds it to {node} GPU {idx}"
    return msg


def whole_words(r: Request, fold: WholeFold, looked: int) -> str:
    """Why none of the ``looked`` nodes folded in ``fold`` has ``r.gpus`` idle GPUs."""
    models = f" {'/'.join(r.gpu_models)}" if r.gpu_models else ""
    if models and not fold.wanted:
        return f"no GPU of model{models} on the {looked} node(s) looked at"
    if fold.idle_at:
        where = f"; most idle{models} GPUs on one node is {fold.idle} on {fold.idle_at.view.name}"
    elif r.gpus > 1:   # not even one: a GPU freed here or there would not do
        where = f"; none of the {looked} node(s) looked at has an idle{models} GPU"
    else:
        where = ""
    if fold.mig:  # empty, yet not idle: say why, and what would make them usable
        where += (f"; {fold.mig} empty GPU(s) are in MIG mode, which a whole-GPU request cannot use "
                  "until MIG is disabled on them")
    if fold.lost:
        lost = ", ".join(f"{n.view.name} GPU {i}" for n, i in fold.lost_first)
        where += f"; {fold.lost} GPU(s) are lost (fell off the bus?): {lost}"
    return f"no node has {r.gpus} idle{models} GPU(s){where}"


def closed_note(r: Request, nodes: Iterable[NodeRecord]) -> str:
    """Why GPUs looked at take no new share though they work (a MIG mode change pending until a
    GPU reset), to follow a rejection ("" when none is closed)."""
    closed = [(n.view.name, g.view) for n in nodes for g in n.gpus if g.view.closed and not g.view.lost
              and (not r.gpu_models or g.view.model in r.gpu_models)]
    if not closed:
        return ""
    (node, first), others = closed[0], [f"{name} GPU {v.index}" for name, v in closed[1:]]
    also = f"; so are {some(others)}" if others else ""
    return f"; GPU {first.index} of {node}: {first.closed}{also}"


def mig_off_note(r: Request, nodes: Iterable[NodeRecord]) -> str:
    """For an exclusive request: the GPUs it could have had a slice of, were their MIG on (turning
    it on waits for a GPU reset, which a request cannot wait for), and what to do."""
    if r.kind != "exclusive":
        return ""
    off = [f"{n.view.name} GPU {g.view.index}" for n in nodes for g in n.gpus
           if not g.mig_mode and g.view.mig_enable_needs_reset and not g.view.lost and not g.view.closed
           and g.idle and (not r.gpu_models or g.view.model in r.gpu_models)]
    if not off:
        return ""
    return (f"; {len(off)} idle GPU(s) have MIG off ({some(off)}), and turning it on "
            "there waits for a GPU reset: `fastshare mig enable --gpu N` on the node, then reset the "
            "GPU (nvidia-smi -r -i N) or reboot")


def no_mig_gpu_reason(r: Request, nodes: list[NodeRecord], tagged: list[str]) -> str:
    """Why no GPU looked at can take a MIG slice now: none can ever (no such model, none
    MIG-capable), the sharing tags rule out ``tagged``, some are lost, or the rest are in use
    (closed ones and those whose MIG mode waits for a reset get notes of their own, in ``place``)."""
    models = f" of model {'/'.join(r.gpu_models)}" if r.gpu_models else ""
    wanted: list[tuple[NodeRecord, GpuRecord]] = [
        (n, g) for n in nodes for g in n.gpus if not r.gpu_models or g.view.model in r.gpu_models]
    if not wanted:
        return f"no GPU{models} on the {len(nodes)} node(s) looked at"
    capable = [(n, g) for n, g in wanted if g.view.mig_capable]
    if not capable:
        names = ", ".join(sorted({g.view.model for _n, g in wanted}))
        return (f"none of the {len(wanted)} GPU(s){models} looked at is MIG-capable ({names}): a slice needs "
                "an A100, A30, H100, H200 or B200; ask for one of those, or for kind fastpod, mps or whole")
    lost = [g.label(n.view.name) for n, g in capable if g.view.lost]
    if any(g.sharers or g.whole is not None for _n, g in capable):
        reason = f"no MIG-capable GPU{models} is free of MPS shares and whole-GPU use"
    else:
        reason = f"no MIG-capable GPU{models} takes a new slice now"
    if tagged:
        tags = f"the sharing tags rule out {len(tagged)} MIG-capable GPU(s){models}: {some(tagged)}"
        others = reason.replace("no ", "of the others no ", 1)
        reason = tags if len(tagged) == len(capable) else f"{tags}; {others}"
    if lost:
        reason += f"; {len(lost)} GPU(s) are lost (fell off the bus?): {some(lost)}"
    return reason


def no_slice_words(r: Request, candidates: int, too_big: list[tuple[GpuView, int]], too_big_gpus: int) -> str:
    """Why none of the ``candidates`` GPUs that may have a MIG slice has room for exclusive ``r``:
    ``too_big`` names the first GPU (its view, and the SMs ``r`` needs of it) of each layout
    with no profile that large, ``too_big_gpus`` counts every such GPU; the rest are full."""
    if too_big_gpus == candidates and r.mig_profile:
        models = ", ".join(sorted({v.model for v, _need in too_big}))
        memory = f" of {fmt_mib(r.gpu_memory_mib)}" if r.gpu_memory_mib else ""
        return (f"no MIG-capable GPU looked at ({models}) has a {r.mig_profile} "
                f"slice{memory}; ask for a profile these models have, or for SMs and memory")
    if too_big_gpus == candidates:
        v, need = too_big[0]
        top = max(v.mig_profiles, key=lambda p: p.sm_count, default=None)
        largest = f"; the largest slice of {v.model} is {top.name} ({top.sm_count} SMs, " \
                  f"{fmt_mib(top.memory_mib)})" if top else ""
        return (f"no MIG profile has {need} SMs and {fmt_mib(r.gpu_memory_mib)}{largest}; "
                "use kind 'whole' for a full GPU")
    sms = f"{r.sm_count} SMs" if r.sm_count else f"{r.sm_percent:g} % SMs" if r.sm_percent else ""
    size = " and ".join(x for x in (sms, fmt_mib(r.gpu_memory_mib) if r.gpu_memory_mib else "") if x)
    slice_ = f"{r.mig_profile} slice" if r.mig_profile else f"slice of {size}"
    # a GPU whose slices are all too small is not full: no release makes room there
    small = ""
    if too_big:
        largest = []
        for model in sorted({v.model for v, _need in too_big}):
            view = next(v for v, _need in too_big if v.model == model)
            top = max(view.mig_profiles, key=lambda p: (p.sm_count, p.memory_mib), default=None)
            largest.append(f"{model}: the largest is {top.name}, {top.sm_count} SMs, "
                           f"{fmt_mib(top.memory_mib)}" if top else f"{model}: no MIG profiles")
        what = f"no {r.mig_profile} slice" if r.mig_profile else "no slice that large"
        small = f"; {too_big_gpus} more have {what} ({'; '.join(largest)})"
    return (f"no MIG-capable GPU has a free placement for a {slice_}; "
            f"{candidates - too_big_gpus} candidate GPU(s) are full{small}")
