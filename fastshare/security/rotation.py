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
from pathlib import Path
from typing import cast

from cryptography import x509

from fastshare.security.certs import agent_name, describe, reissue_command

RENEW_FRACTION = 2 / 3
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
# How often the loop asks whether to renew at once (the CA it was signed with, or the CA bundle
# it is checked with, was replaced): a rotated CA takes effect within about this long.
CHECK_INTERVAL_S = 30.0
# Certificates nothing renews by itself (bare metal: `fastshare certs issue`, the pki role):
# how long before their end the server that uses one starts saying so, and how often.
EXPIRY_WARNING = dt.timedelta(days=7)
EXPIRY_CHECK_INTERVAL_S = 86400.0


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


def expiry_notice(cert_path: Path, role: str, name: str,
                  now: dt.datetime | None = None) -> tuple[int, str] | None:
    """(logging.WARNING, message) when the certificate at ``cert_path`` ends within
    :data:`EXPIRY_WARNING`, (logging.ERROR, message) once it has ended, else None; None too when
    the file cannot be read (the server's own checks name that). The message names the file,
    the end and the command that issues it again with the same names."""
    try:
        info = describe(Path(cert_path))
    except (OSError, ValueError):
        return None
    now = now or dt.datetime.now(dt.UTC)
    ends = dt.datetime.fromisoformat(str(info["not_after"]))
    if ends - now > EXPIRY_WARNING:
        return None
    implied = {name, agent_name(name)}   # what issue adds by itself
    sans = "".join(f" --san {san}" for san in cast(list[str], info["sans"]) if san not in implied)
    renew = (f"renew it with `{reissue_command(role, name)}{sans} --ca CA_DIR --out OUT_DIR` where the CA "
             "is, and put the new certificate and key in place of this one and its key (or run the playbook "
             "again: its pki role renews certificates due within pki_renew_days); they are re-read without "
             "a restart")
    if ends <= now:
        return (logging.ERROR,
                f"certificate {cert_path} expired on {ends.isoformat()}: peers refuse it; {renew}")
    left = str(ends - now).split(".")[0]
    return logging.WARNING, f"certificate {cert_path} expires on {ends.isoformat()} (in {left}); {renew}"


def watch_expiry(cert_path: Path, role: str, name: str, log: logging.Logger, stop: threading.Event,
                 interval: float = EXPIRY_CHECK_INTERVAL_S) -> threading.Thread:
    """Log :func:`expiry_notice` now, then every ``interval`` (a day) until ``stop``, re-reading
    the file each time (a renewal in place silences it). Returns the started daemon thread."""
    def loop() -> None:
        while True:
            notice = expiry_notice(cert_path, role, name)
            if notice is not None:
                log.log(*notice)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=loop, name="cert-expiry", daemon=True)
    thread.start()
    return thread
