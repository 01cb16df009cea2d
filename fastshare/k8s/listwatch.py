"""List, then watch: the loop that keeps a cache of Kubernetes objects current.

client-go's reflector, reduced to what the controller needs: one full listing (in pages if
asked), then watch requests from its resourceVersion, each renewed where the last one ended;
a listing again only when the API server refuses that version.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from kubernetes import client, watch

log = logging.getLogger("fastshare.k8s.controller")


def raw(response: Any) -> dict[str, Any]:
    """The JSON of a ``_preload_content=False`` response. Pods are handled as plain dicts: the
    client's typed models cost ~7 ms per Pod to build, which dominated a 50-replica pass."""
    try:
        return json.loads(response.data)
    finally:
        response.release_conn()


class ListWatch:
    """Runs list-then-watch loops until ``stop`` is set; each watch request stays open at most
    ``watch_timeout`` seconds."""

    def __init__(self, stop: threading.Event, watch_timeout: int) -> None:
        self.stop, self.watch_timeout = stop, watch_timeout

    def run(self, list_fn: Callable[..., Any], on_event: Callable[[str, dict[str, Any]], None],
            on_list: Callable[[dict[str, Any]], None] | None = None, page: int = 0,
            on_progress: Callable[[str], None] | None = None, **kwargs: Any) -> None:
        """List (``on_list``, then each item as "LISTED"), then watch from the list's
        resourceVersion (``on_event(type, object)``). A watch that ends (its timeout, a network
        blip, an API server restart) is renewed from the last resourceVersion it saw (an event's
        or a bookmark's): listing a big cluster again every ``watch_timeout`` was a steady load on
        the API server. An ERROR event (the API server's Status on the watch: 410 Gone for a version
        it no longer has, "too large resource version" after an etcd restore) lists again, as
        client-go's reflector does; resuming from that version would be refused for good.
        ``on_progress(version)``: every event up to ``version`` was handled
        (at each renewal; the caches forget their tombstones up to it there, see WatchCache).
        ``page`` > 0: list in pages of that many, and ``on_list`` gets the items as an iterator
        that fetches them page by page (each item goes to ``on_event`` as it is read)."""
        version: str | None = None
        while not self.stop.is_set():
            try:
                if version is None:
                    version = self._list_into(list_fn, on_event, on_list, page, **kwargs)
                with contextlib.closing(self._watch(list_fn, version, **kwargs)) as events:
                    for event in events:
                        if self.stop.is_set():
                            return
                        obj = event["object"]
                        if event["type"] == "ERROR":   # the API server refuses this version
                            version = None
                            raise client.ApiException(status=obj.get("code"),
                                                      reason=f"{obj.get('reason')}: {obj.get('message')}")
                        if event["type"] != "BOOKMARK":
                            on_event(event["type"], obj)
                        version = obj["metadata"]["resourceVersion"]
                if on_progress is not None:
                    on_progress(version)
            except Exception as exc:  # the API server restarted, a network blip: resume; 410 Gone: relist
                if isinstance(exc, client.ApiException) and exc.status == 410:   # on the request itself
                    version = None
                if not self.stop.is_set():
                    log.info("watch %s %s: %s", getattr(list_fn, "__name__", "?"),
                             "lists again" if version is None else f"resumes from {version}", exc)
                    self.stop.wait(1.0)

    def _list_into(self, list_fn: Callable[..., Any], on_event: Callable[[str, dict[str, Any]], None],
                   on_list: Callable[[dict[str, Any]], None] | None, page: int, **kwargs: Any) -> str:
        """One full listing handed on (see run); its resourceVersion."""
        if page > 0:
            listing = self._paged(list_fn, page, on_event, **kwargs)
            if on_list is not None:
                on_list(listing)
            for _ in listing["items"]:   # what on_list did not read
                pass
        else:
            listing = raw(list_fn(**kwargs, _preload_content=False))
            if on_list is not None:
                on_list(listing)
            for item in listing["items"]:
                on_event("LISTED", item)
        return listing["metadata"]["resourceVersion"]

    def _watch(self, list_fn: Callable[..., Any], since: str, /, **kwargs: Any) -> Iterator[dict[str, Any]]:
        """The events (bookmarks and errors included) of one watch request from ``since``,
        until its timeout. Not the client's Watch: without deserializing, it raises KeyError on
        the ERROR event that says 410 Gone."""
        response = list_fn(**kwargs, watch=True, resource_version=since, allow_watch_bookmarks=True,
                           timeout_seconds=self.watch_timeout, _preload_content=False)
        try:
            for line in watch.watch.iter_resp_lines(response):
                if line.strip():
                    yield json.loads(line)
        finally:
            response.close()
            response.release_conn()

    @staticmethod
    def _paged(list_fn: Callable[..., Any], page: int, on_event: Callable[[str, dict[str, Any]], None],
               **kwargs: Any) -> dict[str, Any]:
        """A listing whose ``items`` are read page by page (the first page now, for the
        resourceVersion that every page of one listing shares)."""
        listing = pages(list_fn, page, **kwargs)
        first = next(listing)

        def items() -> Iterator[dict[str, Any]]:
            for one in itertools.chain([first], listing):
                for item in one["items"]:
                    on_event("LISTED", item)
                    yield item

        return {"metadata": first["metadata"], "items": items()}


def pages(list_fn: Callable[..., Any], limit: int, **kwargs: Any) -> Iterator[dict[str, Any]]:
    """The pages of one listing of at most ``limit`` objects each, fetched as they are read."""
    token = None
    while True:
        page = raw(list_fn(**kwargs, limit=limit, _continue=token, _preload_content=False))
        yield page
        token = page["metadata"].get("continue")
        if not token:
            return
