"""Renewing a short-lived certificate before it ends: when, and the loop that does it.

Shared by the node agent (which asks the controller for its certificate, see
:mod:`fastshare.node.bootstrap`) and the in-cluster controller (which signs its own, see
:mod:`fastshare.k8s.controller_cert`). Both replace the files in place; the servers and the
controller's agent pool re-read changed files (see :mod:`fastshare.security.tls`), so a renewal
needs no restart.
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import threading
import time
from collections.abc import Callable

from cryptography import x509

RENEW_FRACTION = 2 / 3
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
# How often the loop asks whether to renew at once (the CA it was signed with, or the CA bundle
# it is checked with, was replaced): a rotated CA takes effect within about this long.
CHECK_INTERVAL_S = 30.0


def remaining(cert: x509.Certificate, now: dt.datetime) -> dt.timedelta:
    return cert.not_valid_after_utc - now


def renew_at(cert: x509.Certificate) -> dt.datetime:
    """When a certificate should be replaced: at 2/3 of its life."""
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return start + (end - start) * RENEW_FRACTION


def backoff(delay: float, hint: float = 0.0) -> float:
    """How long to wait before the next try: ``delay`` jittered by 20 %, but never less than the
    signer's ``hint`` (stretched by up to half, so that callers refused together do not all come
    back together)."""
    return max(delay * random.uniform(0.8, 1.2), hint * random.uniform(1.0, 1.5))


def renew_forever(cert: x509.Certificate, renew: Callable[[], x509.Certificate], stop: threading.Event, *,
                  what: str, log: logging.Logger, min_interval: float,
                  errors: tuple[type[BaseException], ...],
                  explain: Callable[[BaseException], str] = str,
                  retry_after: Callable[[BaseException], float] = lambda exc: 0.0,
                  changed: Callable[[], str | None] | None = None,
                  check_interval: float = CHECK_INTERVAL_S) -> None:
    """Replace ``cert`` (by calling ``renew``, which returns the new one) at 2/3 of its life,
    and each new one likewise, until ``stop``. ``renew`` raising one of ``errors`` is logged
    (``what`` names the certificate, ``explain`` the error) and retried with backoff, never
    sooner than ``retry_after`` of the error (the signer's own hint, 0 if none); the old
    certificate keeps serving until it expires. ``changed`` (asked every ``check_interval``
    seconds) says why to renew at once (a new CA), or None. At least ``min_interval`` seconds
    pass between two renewals, even when a certificate is due at once (a very short lifetime,
    a clock ahead of the signer's): never a tight loop."""
    delay = FIRST_BACKOFF_S
    earliest = 0.0   # (monotonic) no renewal before: the minimum interval, or the backoff after a failure
    reason: str | None = None
    while True:
        due = (renew_at(cert) - dt.datetime.now(dt.UTC)).total_seconds()
        if due > 0 and reason is None and changed is not None:
            reason = changed()
        if due > 0 and reason is None:
            wait = min(due, check_interval) if changed is not None else due
        else:
            wait = earliest - time.monotonic()   # renew now, once the floor allows
        if stop.wait(max(wait, 0.0)):
            return
        if wait > 0:
            continue
        if reason:
            log.info("renewing %s now: %s", what, reason)
        try:
            cert = renew()
        except errors as exc:
            left = remaining(cert, dt.datetime.now(dt.UTC))
            floor = backoff(delay, retry_after(exc))
            log.error("renewing %s failed (%s); the current one expires in %s; retrying in %.0f s",
                      what, explain(exc), str(left).split(".")[0], floor)
            earliest = time.monotonic() + floor
            delay = min(delay * 2, MAX_BACKOFF_S)
        else:
            earliest, delay, reason = time.monotonic() + min_interval, FIRST_BACKOFF_S, None
