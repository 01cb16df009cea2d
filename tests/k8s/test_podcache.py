"""The controller's Pod cache (no API server needed): what a reconcile pass may believe about its
replicas while watch events, its own create/delete replies and relists arrive in any order."""

from __future__ import annotations

import pytest

from fastshare.k8s.nodeusage import NodeUsage
from fastshare.k8s.peers import PodPeers
from fastshare.k8s.podcache import PodCache, WatchCache
from fastshare.k8s.pods import ALLOCATION_ANNOTATION, FASTPOD_LABEL


def _pod(name: str, version: int, fastpod: str = "fp", namespace: str = "ns", deleting: bool = False) -> dict:
    meta = {"name": name, "namespace": namespace, "resourceVersion": str(version),
            "labels": {FASTPOD_LABEL: fastpod}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"kind": "Pod", "metadata": meta}


def _names(cache: PodCache, fastpod: str = "fp", namespace: str = "ns") -> list[str]:
    return sorted(p["metadata"]["name"] for p in cache.of(namespace, fastpod))


def test_not_synced_until_the_first_list():
    cache = PodCache()
    assert not cache.synced and not cache.wait_synced(0.01)
    cache.replace([_pod("a", 5)], "10")
    assert cache.synced and cache.wait_synced(0) and _names(cache) == ["a"]


def test_an_older_event_never_overwrites_a_newer_reply():
    cache = PodCache()
    cache.replace([], "1")
    cache.put(_pod("a", 20, deleting=True))       # our delete's reply
    cache.put(_pod("a", 12))                       # the watch's late ADDED/MODIFIED
    assert cache.of("ns", "fp")[0]["metadata"]["deletionTimestamp"]


def test_a_deleted_pod_cannot_come_back_from_a_late_reply_but_a_new_one_with_its_name_can():
    cache = PodCache()
    cache.replace([], "1")
    cache.remove(_pod("a", 30))
    cache.put(_pod("a", 25))                       # the create reply, processed late
    assert _names(cache) == []
    cache.put(_pod("a", 40))                       # re-created later under the same name
    assert _names(cache) == ["a"]
    cache.gone("ns", "a")                          # the API said 404
    assert _names(cache) == []


def test_a_relist_drops_what_it_does_not_show_but_keeps_what_is_newer_than_it():
    cache = PodCache()
    cache.replace([_pod("old", 3), _pod("kept", 4)], "5")
    cache.put(_pod("mine", 9))                     # created after the next list was taken
    cache.replace([_pod("kept", 4)], "8")          # "old" was deleted while no watch ran
    assert _names(cache) == ["kept", "mine"]


def test_a_relist_taken_before_our_delete_does_not_bring_the_pod_back_to_life():
    """The list's snapshot was taken, then our delete's reply (newer) went into the cache, then
    the list arrived: the Pod must stay deleting, or a scale-down pass counts it live and deletes
    one more replica."""
    cache = PodCache()
    cache.replace([_pod("a", 3), _pod("b", 4)], "5")
    cache.put(_pod("a", 9, deleting=True))         # our delete's reply
    cache.replace([_pod("a", 3), _pod("b", 4)], "8")   # a relist as of 8, before the delete
    (a,) = [p for p in cache.of("ns", "fp") if p["metadata"]["name"] == "a"]
    assert a["metadata"].get("deletionTimestamp"), "the relist made a deleting Pod live again"


def test_pods_are_told_apart_by_fastpod_and_namespace():
    cache = PodCache()
    unlabelled = _pod("d", 3)
    unlabelled["metadata"]["labels"] = None
    cache.replace([_pod("a", 1), _pod("b", 2, fastpod="other"), _pod("c", 3, namespace="ns2"), unlabelled],
                  "3")
    assert _names(cache) == ["a"] and _names(cache, "other") == ["b"]
    assert _names(cache, namespace="ns2") == ["c"]


def _bound(name: str, version: int, phase: str = "Running") -> dict:
    """A Pod bound to n1; its allocation annotation is its name (what NodeUsage keeps of it)."""
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": str(version),
                         "annotations": {ALLOCATION_ANNOTATION: name}},
            "spec": {"nodeName": "n1", "containers": []}, "status": {"phase": phase}}


def _relist(cache: WatchCache, pods: list[dict], version: str) -> None:
    if isinstance(cache, NodeUsage):
        cache.replace(pods, version)
    else:
        list(cache.replacing(pods, version))


def _held(cache: WatchCache) -> list[str]:
    if isinstance(cache, NodeUsage):
        assert len(cache.on(["n1"])["n1"]) == cache.count("n1")
        return sorted(allocation for _, allocation in cache.on(["n1"])["n1"])
    return sorted(name for _, name in cache.all())


@pytest.mark.parametrize("kind", [NodeUsage, PodPeers])
def test_a_late_create_reply_does_not_bring_back_a_pod_the_watch_saw_end(kind):
    """The create's reply is put after the call returns; the watch may have reported the Pod
    Failed or deleted before that: the older reply must not count it again until the next relist."""
    cache = kind()
    _relist(cache, [], "5")
    cache.remove(_bound("a", 12))                 # DELETED
    cache.put(_bound("a", 10))                    # the create's reply, late
    cache.put(_bound("b", 12, phase="Failed"))   # MODIFIED: it ended
    cache.put(_bound("b", 11))                    # its create's reply, late
    assert _held(cache) == []
    _relist(cache, [], "9")                       # taken before the deletion: its note is kept
    cache.put(_bound("a", 10))
    assert _held(cache) == []
    _relist(cache, [], "20")                      # nothing older than a listing applies after it
    cache.put(_bound("b", 11))
    assert _held(cache) == []
    cache.put(_bound("a", 30))                    # a new Pod of the same name
    assert len(_held(cache)) == 1


def test_a_watch_caught_up_forgets_tombstones_but_a_late_reply_still_does_not_bring_a_pod_back():
    """Watches are renewed from their last version, not relisted: the tombstones go once the
    watch is past them, and a reply older than that for a Pod not held is stale."""
    cache = PodCache()
    cache.replace([], "1")
    cache.put(_pod("a", 10))                       # ADDED
    cache.remove(_pod("a", 12))                    # DELETED
    cache.caught_up("15")
    assert cache._gone == {}
    cache.put(_pod("a", 10))                       # the create's reply, very late
    assert _names(cache) == []
    cache.put(_pod("b", 16))                       # a new Pod's reply before the watch shows it
    cache.put(_pod("a", 20))                       # re-created under the same name
    assert _names(cache) == ["a", "b"]


@pytest.mark.parametrize("kind", [NodeUsage, PodPeers])
def test_a_watch_caught_up_forgets_its_notes_and_older_changes(kind):
    cache = kind()
    _relist(cache, [], "5")
    cache.put(_bound("a", 10))
    cache.remove(_bound("b", 11))
    cache.caught_up("12")
    assert cache._since == {}
    cache.put(_bound("b", 9))                     # the create's reply, late: the watch saw it go
    assert len(_held(cache)) == 1


def test_a_relist_drops_a_pod_deleted_after_its_snapshot_but_not_one_re_created_before_it():
    """Our delete's reply (or the watch's DELETED) applied before a relist taken earlier must
    keep the Pod gone; a tombstone older than the listing must not hide the Pod of that name the
    listing shows (re-created since)."""
    cache = PodCache()
    cache.replace([_pod("a", 3), _pod("b", 4)], "5")
    cache.remove(_pod("a", 9))                     # deleted after the next listing's snapshot
    cache.remove(_pod("b", 6))                     # deleted, then re-created at 7, before it
    cache.replace([_pod("a", 3), _pod("b", 7)], "8")
    assert _names(cache) == ["b"]
    cache.put(_pod("c", 7))                        # a reply older than the listing, of a Pod it does not show
    assert _names(cache) == ["b"], "a Pod the listing showed gone came back from a late reply"


def test_a_late_deleted_event_does_not_remove_a_newer_pod_of_its_name():
    cache = PodCache()
    cache.replace([_pod("a", 3)], "5")
    cache.put(_pod("a", 20))                       # the reply for a Pod of that name, newer
    cache.remove(_pod("a", 12))                    # the older one's DELETED, processed later
    assert [p["metadata"]["resourceVersion"] for p in cache.of("ns", "fp")] == ["20"]


def test_a_pod_the_api_said_is_gone_stays_gone_until_a_newer_version_of_it_arrives():
    cache = PodCache()
    cache.replace([], "1")
    cache.gone("ns", "never-held")                 # our delete's 404 for a Pod the watch removed meanwhile
    cache.put(_pod("a", 10))                       # our create's reply
    cache.gone("ns", "a")                          # deleted by someone else: our delete got 404
    cache.put(_pod("a", 10))                       # the watch's ADDED, late
    assert _names(cache) == [], "the API said 404 but a late event made the Pod live again"
    cache.put(_pod("a", 30))                       # re-created under its name
    assert _names(cache) == ["a"]


def test_versions_that_are_no_number_count_as_the_oldest_and_break_nothing():
    """resourceVersions are opaque to clients: one that is no number (or none) must not stop
    the watch that fills the cache."""
    odd, bare = _pod("odd", 1), _pod("bare", 1)
    odd["metadata"]["resourceVersion"] = "x"
    del bare["metadata"]["resourceVersion"]
    cache = PodCache()
    cache.replace([odd, bare], "not-a-number")
    assert cache.synced and _names(cache) == ["bare", "odd"]
    cache.put(_pod("odd", 5))                      # any real version is newer
    versions = {p["metadata"]["name"]: p["metadata"].get("resourceVersion") for p in cache.of("ns", "fp")}
    assert versions == {"odd": "5", "bare": None}
    cache.remove(bare)
    cache.caught_up("y")
    assert _names(cache) == ["odd"]


@pytest.mark.parametrize("kind", [NodeUsage, PodPeers])
def test_a_relist_keeps_what_changed_after_its_snapshot_and_drops_what_it_shows_gone(kind):
    """Our create's reply and a watch's DELETED that are newer than a relist's snapshot survive
    it; a Pod put before the snapshot that the listing does not show (deleted while no watch
    ran) goes, and a reply older than the listing does not bring a Pod back."""
    cache = kind()
    _relist(cache, [_bound("gone", 3), _bound("deleted", 4)], "5")
    cache.put(_bound("old", 6))                   # ADDED, before the next listing's snapshot
    cache.put(_bound("new", 12))                  # our create's reply, after it
    cache.remove(_bound("deleted", 13))           # DELETED, after it
    _relist(cache, [_bound("deleted", 4)], "10")
    assert _held(cache) == ["new"]
    cache.put(_bound("late", 8))                  # a create's reply older than the listing: it is gone
    assert _held(cache) == ["new"]
