"""A server's own certificate that is about to end, or has ended, is logged at start and then
once a day, naming the file, the end and the command that renews it (bare-metal certificates
last `pki_days`, 30, and were renewed only when the playbook ran again, silently)."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from pathlib import Path

from fastshare.security import certs
from fastshare.security.rotation import EXPIRY_WARNING, expiry_notice, watch_expiry
from tests.security.handmade import issue_client_cert


def _issued(tmp_path: Path, days: int) -> Path:
    certs.init_ca(tmp_path / "ca")
    return certs.issue(tmp_path / "ca", "gpu-1", tmp_path / "tls", role="node", days=days).cert_path


def test_a_certificate_far_from_its_end_says_nothing(tmp_path):
    assert dt.timedelta(days=7) == EXPIRY_WARNING
    assert expiry_notice(_issued(tmp_path, 30), "node", "gpu-1") is None


def test_a_certificate_within_seven_days_of_its_end_is_a_warning_naming_file_end_and_command(tmp_path):
    cert = _issued(tmp_path, 30)
    ends = certs.describe(cert)["not_after"]
    level, message = expiry_notice(cert, "node", "gpu-1",
                                   now=dt.datetime.now(dt.UTC) + dt.timedelta(days=25))
    assert level == logging.WARNING
    assert str(cert) in message and f"expires on {ends}" in message, message
    assert "fastshare certs issue --role node --name gpu-1 --ca CA_DIR --out OUT_DIR" in message
    assert "playbook" in message


def test_the_command_keeps_the_certificates_other_names(tmp_path):
    # issued again without them, the certificate would no longer be valid for its IP address
    certs.init_ca(tmp_path / "ca")
    cert = certs.issue(tmp_path / "ca", "gpu-1", tmp_path / "tls", sans=["10.0.0.9", "gpu-1.example"],
                       role="node", days=3).cert_path
    _level, message = expiry_notice(cert, "node", "gpu-1")
    assert "--role node --name gpu-1 --san gpu-1.example --san 10.0.0.9 --ca" in message, message


def test_an_expired_certificate_is_an_error(tmp_path):
    certs.init_ca(tmp_path / "ca")
    issue_client_cert(tmp_path / "ca", "controller", tmp_path / "tls", ends_in_days=-1, role="controller")
    cert = tmp_path / "tls" / "controller.crt"
    level, message = expiry_notice(cert, "controller", "controller")
    assert level == logging.ERROR and f"{cert} expired on" in message, message
    assert "fastshare certs issue --role controller --name controller" in message


def test_an_unreadable_certificate_is_left_to_the_servers_own_checks(tmp_path):
    assert expiry_notice(tmp_path / "missing.crt", "node", "gpu-1") is None
    (tmp_path / "bad.crt").write_text("garbage")
    assert expiry_notice(tmp_path / "bad.crt", "node", "gpu-1") is None


def test_the_watch_says_it_at_start_then_at_every_interval_until_the_file_is_renewed(tmp_path, caplog):
    certs.init_ca(tmp_path / "ca")
    issue_client_cert(tmp_path / "ca", "gpu-1", tmp_path / "tls", ends_in_days=3, role="node")
    cert = tmp_path / "tls" / "gpu-1.crt"
    stop = threading.Event()
    log = logging.getLogger("test.expiry")
    with caplog.at_level(logging.WARNING, logger="test.expiry"):
        thread = watch_expiry(cert, "node", "gpu-1", log, stop, interval=0.2)
        try:
            deadline = time.monotonic() + 10
            while len(caplog.records) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(caplog.records) >= 2 and all(r.levelno == logging.WARNING for r in caplog.records)
            certs.issue(tmp_path / "ca", "gpu-1", tmp_path / "tls", role="node", days=30)   # renewed
            time.sleep(0.5)
            caplog.clear()
            time.sleep(0.6)
            assert caplog.records == []
        finally:
            stop.set()
            thread.join(timeout=5)
    assert not thread.is_alive()
