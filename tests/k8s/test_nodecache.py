"""The GPU nodes' Node objects as the Node watch keeps them: changes go forward only, a relist
keeps what changed after its snapshot, and only what the controller reads is held."""

from __future__ import annotations

from fastshare.k8s.nodecache import NodeCache


def _node(name: str, version: int, zone: str = "z1") -> dict:
    return {"metadata": {"name": name, "resourceVersion": str(version), "labels": {"zone": zone},
                         "uid": "u", "managedFields": [{"manager": "kubelet"}]},
            "spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]},
            "status": {"allocatable": {"cpu": "8"},
                       "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
                       "images": [{"names": ["x"], "sizeBytes": 1}] * 50, "conditions": [{"type": "Ready"}]}}


def _zones(cache: NodeCache) -> dict[str, str]:
    return {n["metadata"]["name"]: n["metadata"]["labels"]["zone"] for n in cache.nodes()}


def test_only_what_the_controller_reads_is_held():
    cache = NodeCache()
    assert not cache.synced
    cache.replace([_node("b", 5), _node("a", 6)], "10")
    assert cache.synced
    a, b = cache.nodes()
    assert [a["metadata"]["name"], b["metadata"]["name"]] == ["a", "b"]
    assert set(a["status"]) == {"allocatable", "addresses"}
    assert set(a["metadata"]) == {"name", "labels", "resourceVersion"}
    assert a["spec"]["taints"] == [{"key": "k", "effect": "NoSchedule"}]


def test_changes_go_forward_and_a_relist_keeps_what_changed_after_it():
    cache = NodeCache()
    cache.replace([_node("a", 5), _node("b", 6)], "10")
    cache.put(_node("a", 12, zone="z2"))
    cache.put(_node("a", 11, zone="z3"))   # a late, older change
    assert _zones(cache) == {"a": "z2", "b": "z1"}
    cache.remove(_node("b", 13))
    cache.put(_node("b", 12))               # older than its deletion
    cache.put(_node("c", 14))
    assert _zones(cache) == {"a": "z2", "c": "z1"}
    cache.replace([_node("a", 5), _node("b", 6)], "11")   # a relist taken before those changes
    assert _zones(cache) == {"a": "z2", "c": "z1"}
    cache.replace([_node("a", 15, zone="z4")], "16")   # and one taken after them
    assert _zones(cache) == {"a": "z4"}
