"""The ledger records: giving back is the exact inverse of holding, whatever the order."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from fastshare.placement.ledger import GpuRecord, NodeRecord
from fastshare.placement.model import MigSlot, Request

from .conftest import gpu, node
from .test_properties import requests

SLOT = MigSlot(19, "1g.5gb", 0, 1, 14, 4864)


def _fields(g: GpuRecord) -> tuple:
    return (g.sm_used, g.mem_used, g.share_kind, dict(g.sharers), dict(g.mig), g.whole, g.quota_used)


@given(st.integers(1, 12), st.data())
def test_giving_back_in_any_order_undoes_holding(count, data):
    g = GpuRecord(gpu(0))
    n = NodeRecord(node("n", n_gpus=1), [g])
    empty_gpu, empty_node = _fields(g), (n.cpu_used, n.mem_used, dict(n.tags))
    held = []
    for i in range(count):
        r = data.draw(requests(i))
        if g.clash(r) is None:   # the engine counts nothing that clashes (restore refuses it)
            slot = replace(SLOT, start=len(g.mig)) if r.kind == "exclusive" else None
            g.hold(r, slot)
            n.hold(r, r.kind)
            held.append(r)
    for r in data.draw(st.permutations(held)):
        g.give_back(r)
        n.give_back(r, r.kind)
    assert _fields(g) == empty_gpu
    assert (n.cpu_used, n.mem_used, dict(n.tags)) == empty_node


def test_a_clash_names_what_the_gpu_holds():
    g = GpuRecord(gpu(0))
    share = Request("s", "mps", gpu_memory_mib=1024)
    g.hold(share, None)
    assert g.clash(Request("w", "whole", gpus=1)) == "holds shares or MIG slices"
    assert g.clash(Request("f", "fastpod", sm_percent=10, gpu_memory_mib=1)) == "is shared as mps"
    assert g.clash(Request("x", "exclusive", sm_count=14)) == "holds MPS shares"
    g.give_back(share)
    g.hold(Request("w", "whole", gpus=1), None)
    assert g.clash(share) == "is held whole by w"
