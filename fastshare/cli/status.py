"""`fastshare status`: nodes, GPUs with what is used on each (bars), and allocations."""

from __future__ import annotations

import time

import click

from fastshare.cli._controller import call_controller, to_json
from fastshare.cli._output import print_json, print_table
from fastshare.controller.client import client_options

GiB = 1024**3
BAR = 10
SLICE_MARKS = "ABCDEFGHJKLMNPQRSTUVWXYZ"


def bar(fraction: float, width: int = BAR) -> str:
    """A fixed-width bar: filled cells for the used fraction (clamped to 0..1)."""
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * filled + "░" * (width - filled)


def mig_map(gpu, marks: dict[str, str]) -> str:
    """Memory slices of a MIG GPU by placement: a letter per allocation, '·' free."""
    cells = ["·"] * (gpu.memory_slices or 8)
    for s in gpu.mig_slices:
        for i in range(s.mig_start, min(len(cells), s.mig_start + max(1, s.mig_size))):
            cells[i] = marks.get(s.mig_profile + str(s.mig_start) + s.gpu_uuid, "?")
    return "[" + "".join(cells) + "]"


def _gib(n: int) -> str:
    return f"{n / GiB:.1f}".rstrip("0").rstrip(".")


def _amount(a) -> str:
    s = a.spec
    kind = _kind(s.kind)
    if kind == "fastpod":
        quota = f" q{s.quota_request:g}:{s.quota_limit:g}" if s.quota_request else ""
        return f"{s.sm_percent}% SM, {_gib(s.memory_bytes)} GiB{quota}"
    if kind == "mps":
        return f"{_gib(s.memory_bytes)} GiB"
    if kind == "exclusive":
        shown = [d.mig_profile for d in a.devices if d.mig_profile]
        return shown[0] if shown else (s.mig_profile or f"{s.sm_count or s.sm_percent} SM")
    return f"{s.gpu_count} GPU(s)"


def _kind(value: int) -> str:
    from fastshare.v1 import common_pb2

    return common_pb2.ShareKind.Name(value).removeprefix("SHARE_KIND_").lower()


def _state(value: int) -> str:
    from fastshare.v1 import controller_pb2 as pb

    return pb.AllocationState.Name(value).removeprefix("ALLOCATION_STATE_").lower()


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--all", "include_finished", is_flag=True, help="Also released and failed allocations.")
@click.option("--node", "nodes", multiple=True, metavar="NAME",
              help="Only this node and its allocations (repeatable; default: the whole cluster).")
@client_options
def status(client_config, as_json: bool, include_finished: bool, nodes: tuple[str, ...]) -> None:
    """Cluster view: nodes, per-GPU usage (SM %, memory, MIG slices by placement), allocations."""
    from fastshare.v1 import controller_pb2 as pb

    st = call_controller(client_config, "Status",
                         pb.ClusterStatusRequest(include_finished=include_finished, nodes=nodes))
    if as_json:
        print_json(to_json(st))
        return
    render(st)


def _mig_change(gpu) -> str:
    """The MIG mode change a GPU waits for a reset to make (its mode now is ``mig_enabled``)."""
    return "MIG disable" if gpu.mig_enabled else "MIG enable"


def _node_state(node) -> str:
    state = "available" if node.available else "UNAVAILABLE"
    if node.cordoned:
        state += ", cordoned" + (f": {node.cordon_reason}" if node.cordon_reason else "")
    if node.mps_unavailable:
        state += f", no MPS shares: {node.mps_unavailable}"
    return state


OVER_COMMITTED = "over-committed: "   # how the controller starts such an active allocation's reason
ADOPTED = "adopted: "   # ... and one rebuilt from a share the state database had no record of
FINISHED = ("released", "failed")   # hold nothing on their node: whether it is up says nothing of them


def render(st) -> None:
    now = time.time()
    # active allocations whose record says their GPU's view changed under them (MIG mode, memory,
    # oversubscription): still held, and their GPU takes nothing new until enough is released
    over = {a.id for a in st.allocations
            if (a.reason.startswith(OVER_COMMITTED) or f"; {OVER_COMMITTED}" in a.reason)   # adopted ones too
            and _state(a.state) == "active"}
    print_table("Nodes", ["NODE", "ADDRESS", "STATE", "GPUS", "HEARTBEAT"], [
        (n.name, n.address, _node_state(n), len(n.gpus),
         f"{max(0, now - n.last_heartbeat):.0f}s ago" if n.last_heartbeat else "-") for n in st.nodes])
    marks: dict[str, str] = {}
    labels: dict[str, str] = {}
    for a in st.allocations:
        if _state(a.state) in FINISHED:   # `--all`: no slice on any map is theirs any more
            continue
        for d in a.devices:
            if d.mig_profile:
                mark = SLICE_MARKS[len(marks) % len(SLICE_MARKS)]
                marks[d.mig_profile + str(d.mig_start) + d.gpu_uuid] = mark
                labels[a.id] = mark
    rows = []
    for n in st.nodes:
        for g in n.gpus:
            mem = g.memory_bytes_used / g.memory_bytes if g.memory_bytes else 0
            if g.lost:   # takes no new work; what it held ends failed once its agent drops it
                use = "LOST"
            elif g.whole_held:
                use = "whole"
            elif g.mig_slices or g.mig_enabled:
                use = "MIG " + mig_map(g, marks)
            elif g.allocation_ids:
                use = "shared"
            else:
                use = "idle"
            if g.mig_change_pending and not g.lost:   # takes no new work until reset; what it holds stays
                use += f", {_mig_change(g)} pending"
            if g.over_committed:
                use += ", OVER-COMMITTED"
            rows.append((n.name, g.index, g.model, f"{bar(g.sm_percent_used / 100)} {g.sm_percent_used:3d}%",
                         f"{bar(mem)} {_gib(g.memory_bytes_used)}/{_gib(g.memory_bytes)} GiB", use,
                         len(g.allocation_ids)))
    print_table("GPUs", ["NODE", "GPU", "MODEL", "SM", "MEMORY", "USE", "ALLOCS"], rows)
    print_table("Allocations", ["ID", "KIND", "STATE", "NODE", "GPU", "AMOUNT", "OWNER", "LEASE"], [
        (a.id + (f" [{labels[a.id]}]" if a.id in labels else ""), _kind(a.spec.kind),
         _state(a.state) + (", over-committed" if a.id in over else "")
         + ("" if a.node_available or _state(a.state) in FINISHED else " (node down)"), a.node,
         ",".join(str(d.gpu_index) for d in a.devices),
         _amount(a), a.owner, f"{max(0, a.lease_expires_at - now):.0f}s" if a.lease_expires_at else "-")
        for a in st.allocations])
    adopted = sorted((a.id, a.node, a.owner, a.reason.removeprefix(ADOPTED)) for a in st.allocations
                     if a.reason.startswith(ADOPTED) and _state(a.state) == "active")
    if adopted:
        print_table("Adopted: held on their node, unknown to the state database (restored from an older "
                    "backup?); `fastshare release ID` ends one nothing uses", ["ID", "NODE", "OWNER", "WHY"],
                    adopted)
    over_gpus = [(n.name, g.index, g.over_commit_reason)
                 for n in st.nodes for g in n.gpus if g.over_committed]
    if over_gpus:
        print_table("Over-committed GPUs: they hold shares they no longer take, and take nothing new until "
                    "enough is released", ["NODE", "GPU", "WHY"], over_gpus)
    pending = [(n.name, g.index, g.uuid or "-", _mig_change(g), len(g.allocation_ids),
                f"nvidia-smi -r -i {g.index}")
               for n in st.nodes for g in n.gpus if g.mig_change_pending and not g.lost]
    if pending:
        print_table("GPUs whose MIG mode change is pending: they take no new work until the GPU is reset; "
                    "what they hold loses its device at the reset, so release it first, then reset the "
                    "GPU on its node or reboot the node",
                    ["NODE", "GPU", "UUID", "CHANGE", "ALLOCS", "RESET"], pending)
    lost = [(n.name, g.index, g.uuid or "-", f"NVML_ERROR_{g.lost}")
            for n in st.nodes for g in n.gpus if g.lost]
    if lost:
        print_table("Lost GPUs (fell off the bus?): they take no new work and the shares on them end failed; "
                    "drain the node, then reset the GPU (nvidia-smi -r) or reboot",
                    ["NODE", "GPU", "UUID", "NVML"], lost)


COMMANDS = [status]
