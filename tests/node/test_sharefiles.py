"""Share files: one writer, atomic replacement, request before limit, removal when empty."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastshare.node import sharefiles
from fastshare.node.sharefiles import ShareEntry, ShareFileError

UUID = "GPU-11111111-2222-3333-4444-555555555555"


def test_format_is_count_then_key_request_limit_memory(tmp_path):
    sharefiles.write(tmp_path, UUID, [ShareEntry("b", 0.25, 0.5, 1 << 30, 50101),
                                      ShareEntry("a", 0.1, 1.0, 2048, 50100)])
    assert sharefiles.config_path(tmp_path, UUID).read_text() == (
        "2\na 0.1 1.0 2048\nb 0.25 0.5 1073741824\n")
    assert sharefiles.port_path(tmp_path, UUID).read_text() == "2\na 50100\nb 50101\n"


def test_last_share_leaving_removes_the_files(tmp_path):
    sharefiles.write(tmp_path, UUID, [ShareEntry("a", 0.5, 0.5, 1, 50100)])
    assert sharefiles.devices(tmp_path) == [UUID]
    sharefiles.write(tmp_path, UUID, [])
    assert not sharefiles.config_path(tmp_path, UUID).exists()
    assert not sharefiles.port_path(tmp_path, UUID).exists()
    assert sharefiles.read(tmp_path, UUID) == []
    sharefiles.write(tmp_path, UUID, [])  # idempotent


def test_unchanged_content_is_not_rewritten(tmp_path):
    entries = [ShareEntry("a", 0.5, 0.5, 1, 50100)]
    sharefiles.write(tmp_path, UUID, entries)
    inodes = [p.stat().st_ino for p in (sharefiles.config_path(tmp_path, UUID),
                                         sharefiles.port_path(tmp_path, UUID))]
    sharefiles.write(tmp_path, UUID, list(entries))
    assert [p.stat().st_ino for p in (sharefiles.config_path(tmp_path, UUID),
                                       sharefiles.port_path(tmp_path, UUID))] == inodes
    sharefiles.write(tmp_path, UUID, [*entries, ShareEntry("b", 0.25, 0.5, 1, 50101)])
    assert sharefiles.config_path(tmp_path, UUID).stat().st_ino != inodes[0]
    assert sharefiles.read(tmp_path, UUID)[1].key == "b"


def test_a_lone_port_file_is_listed_so_the_agent_start_removes_it(tmp_path):
    sharefiles.write(tmp_path, UUID, [ShareEntry("a", 0.5, 0.5, 1, 50100)])
    sharefiles.config_path(tmp_path, UUID).unlink()        # a crash between the two unlinks
    assert sharefiles.devices(tmp_path) == [UUID]
    sharefiles.write(tmp_path, UUID, [])
    assert sharefiles.devices(tmp_path) == []


@pytest.mark.parametrize("entry", [
    ShareEntry("a", 0.6, 0.5, 1, 50100),     # request above limit
    ShareEntry("a", 0.0, 0.5, 1, 50100),     # zero request
    ShareEntry("a", 0.5, 1.5, 1, 50100),     # limit above 1
    ShareEntry("a b", 0.5, 0.5, 1, 50100),   # whitespace in key
    ShareEntry("a\tb", 0.5, 0.5, 1, 50100),  # tab in key
    ShareEntry("a\n", 0.5, 0.5, 1, 50100),   # line break in key (would forge a line)
    ShareEntry("", 0.5, 0.5, 1, 50100),      # empty key
    ShareEntry("a", 0.5, 0.5, 1, 0),         # no port
    ShareEntry("a", 0.5, 0.5, 1, 65536),     # port out of range
    ShareEntry("a", 0.5, 0.5, -1, 50100),    # negative memory
    ShareEntry("ok", 0.25, 0.5, 1, 50101),   # the same key twice
])
def test_invalid_entries_leave_previous_files_untouched(tmp_path, entry):
    sharefiles.write(tmp_path, UUID, [ShareEntry("ok", 0.5, 0.5, 1, 50100)])
    before = sharefiles.config_path(tmp_path, UUID).read_text()
    with pytest.raises(ShareFileError):
        sharefiles.write(tmp_path, UUID, [ShareEntry("ok", 0.5, 0.5, 1, 50100), entry])
    assert sharefiles.config_path(tmp_path, UUID).read_text() == before
    assert [p for p in os.listdir(tmp_path / "config") if p.startswith(".")] == []


def test_reader_rejects_a_count_that_does_not_match(tmp_path):
    sharefiles.write(tmp_path, UUID, [ShareEntry("a", 0.5, 0.5, 1, 50100)])
    sharefiles.config_path(tmp_path, UUID).write_text("2\na 0.5 0.5 1\n")
    with pytest.raises(ShareFileError, match="header says 2"):
        sharefiles.read(tmp_path, UUID)


_fraction = st.floats(min_value=0.001, max_value=1.0, allow_nan=False)


@st.composite
def _entries(draw):
    keys = draw(st.lists(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True),
                         unique=True, max_size=8))
    out = []
    for i, key in enumerate(keys):
        a, b = draw(_fraction), draw(_fraction)
        out.append(ShareEntry(key, min(a, b), max(a, b), draw(st.integers(0, 1 << 40)), 50100 + i))
    return out


@settings(max_examples=60, deadline=None)
@given(entries=_entries())
def test_reader_gets_back_exactly_what_the_writer_wrote(tmp_path_factory, entries):
    root = tmp_path_factory.mktemp("share")
    sharefiles.write(root, UUID, entries)
    assert sharefiles.read(root, UUID) == sorted(entries)
    for entry in sharefiles.read(root, UUID):
        assert entry.request <= entry.limit  # the column order KubeShare v2 once swapped


@pytest.fixture(params=["disk", "tmpfs"])
def any_root(request, tmp_path):
    """A share root on the test's disk, and one on tmpfs (/run in production)."""
    if request.param == "disk":
        return tmp_path
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    root = tempfile.mkdtemp(prefix="sharefiles-", dir="/dev/shm")
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    return Path(root)


def test_replacement_keeps_an_open_reader_on_the_old_file(any_root):
    old = [ShareEntry("a", 0.5, 0.5, 1, 50100)]
    sharefiles.write(any_root, UUID, old)
    with open(sharefiles.config_path(any_root, UUID)) as reader:   # an interception library
        previous_umask = os.umask(0o077)
        try:
            sharefiles.write(any_root, UUID, [*old, ShareEntry("b", 0.25, 0.5, 1, 50101)])
        finally:
            os.umask(previous_umask)
        assert reader.read() == "1\na 0.5 0.5 1\n"                 # the old file, whole
    assert [e.key for e in sharefiles.read(any_root, UUID)] == ["a", "b"]
    for path in (sharefiles.config_path(any_root, UUID), sharefiles.port_path(any_root, UUID)):
        assert path.stat().st_mode & 0o777 == 0o644                 # whatever the umask
        assert [p for p in os.listdir(path.parent) if p.startswith(".")] == []


def test_files_changed_or_removed_behind_the_writer_are_rewritten(any_root):
    entries = [ShareEntry("a", 0.5, 0.5, 1, 50100)]
    sharefiles.write(any_root, UUID, entries)
    expected = sharefiles.config_path(any_root, UUID).read_text()
    sharefiles.config_path(any_root, UUID).write_text("garbage\n")
    sharefiles.write(any_root, UUID, entries)                      # same entries as last time
    assert sharefiles.config_path(any_root, UUID).read_text() == expected
    sharefiles.port_path(any_root, UUID).unlink()
    sharefiles.write(any_root, UUID, entries)
    assert sharefiles.read(any_root, UUID) == entries
    shutil.rmtree(any_root / "config")                             # the directory too
    sharefiles.write(any_root, UUID, [*entries, ShareEntry("b", 0.25, 0.5, 1, 50101)])
    assert [e.key for e in sharefiles.read(any_root, UUID)] == ["a", "b"]


def test_a_file_longer_than_what_it_should_say_is_rewritten(tmp_path):
    # the unchanged-content check reads one byte more than it expects: a file that starts with
    # the right text but goes on (a line added behind the writer) must not pass as unchanged
    entries = [ShareEntry("a", 0.5, 0.5, 1, 50100)]
    sharefiles.write(tmp_path, UUID, entries)
    expected = sharefiles.config_path(tmp_path, UUID).read_text()
    with open(sharefiles.config_path(tmp_path, UUID), "a") as f:
        f.write("b 0.5 0.5 1\n")
    sharefiles.write(tmp_path, UUID, entries)
    assert sharefiles.config_path(tmp_path, UUID).read_text() == expected


@pytest.mark.parametrize(("config", "ports", "message"), [
    ("1\na 0.5 0.5 1\n", "1\nb 50100\n", "list different shares"),
    ("one\na 0.5 0.5 1\n", "1\na 50100\n", "first line must be the number of entries"),
    ("", "1\na 50100\n", "first line must be the number of entries"),
    ("1\na 0.5 0.5\n", "1\na 50100\n", "entries of 4 fields"),
])
def test_reader_rejects_files_an_interception_library_could_not_trust(tmp_path, config, ports, message):
    sharefiles.write(tmp_path, UUID, [ShareEntry("a", 0.5, 0.5, 1, 50100)])
    sharefiles.config_path(tmp_path, UUID).write_text(config)
    sharefiles.port_path(tmp_path, UUID).write_text(ports)
    with pytest.raises(ShareFileError, match=message):
        sharefiles.read(tmp_path, UUID)


@pytest.mark.parametrize("which", ["config", "ports"])
def test_a_half_removed_pair_is_not_read_as_no_shares(tmp_path, which):
    sharefiles.write(tmp_path, UUID, [ShareEntry("a", 0.5, 0.5, 1, 50100)])
    (sharefiles.config_path if which == "config" else sharefiles.port_path)(tmp_path, UUID).unlink()
    with pytest.raises(OSError):
        sharefiles.read(tmp_path, UUID)


def test_ports_at_both_ends_of_the_range_are_written(tmp_path):
    entries = [ShareEntry("a", 0.5, 0.5, 0, 1), ShareEntry("b", 0.5, 0.5, 0, 65535)]
    sharefiles.write(tmp_path, UUID, entries)
    assert sharefiles.read(tmp_path, UUID) == entries


def test_a_root_without_files_has_no_devices(tmp_path):
    assert sharefiles.devices(tmp_path / "never-written") == []


def test_a_writers_leftover_temporary_file_is_not_a_device(tmp_path):
    sharefiles.write(tmp_path, UUID, [ShareEntry("a", 0.5, 0.5, 1, 50100)])
    (tmp_path / "config" / f".{UUID}.new").write_text("1\n")   # a crash before the rename
    (tmp_path / "podmanagerport" / ".other.new").write_text("1\n")
    assert sharefiles.devices(tmp_path) == [UUID]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    entries = [ShareEntry("a", 0.5, 0.5, 1, 50100)]
    sharefiles.write(tmp_path, UUID, entries)
    before = sharefiles.config_path(tmp_path, UUID).read_text()

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sharefiles.os, "write", full)
    with pytest.raises(OSError, match="No space left"):
        sharefiles.write(tmp_path, UUID, [*entries, ShareEntry("b", 0.25, 0.5, 1, 50101)])
    monkeypatch.undo()
    assert sharefiles.config_path(tmp_path, UUID).read_text() == before
    assert [p for p in os.listdir(tmp_path / "config") if p.startswith(".")] == []
    sharefiles.write(tmp_path, UUID, [*entries, ShareEntry("b", 0.25, 0.5, 1, 50101)])   # and then it works
    assert [e.key for e in sharefiles.read(tmp_path, UUID)] == ["a", "b"]
