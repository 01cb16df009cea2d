"""held_device_uuids: what MIG reconfiguration reads from an agent journal, read-only."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastshare.node.journal import Journal, held_device_uuids
from fastshare.node.model import ShareSpec
from fastshare.sqlite_file import StateFileError


def test_lists_the_devices_shares_hold_without_writing(tmp_path: Path):
    path = tmp_path / "journal.db"
    journal = Journal(path)
    journal.begin_share(ShareSpec(id="s1", kind="exclusive", device_uuids=("MIG-a",)), "MIG-a", None)
    journal.begin_share(ShareSpec(id="s3", kind="mps", device_uuids=("GPU-b",)), "GPU-b", None)
    journal.begin_share(ShareSpec(id="s2", kind="mps", device_uuids=("GPU-b",)), "GPU-b", None)
    journal.close()
    before = path.read_bytes()
    assert held_device_uuids(path) == {"MIG-a": ["s1"], "GPU-b": ["s2", "s3"]}   # the shares, for messages
    assert path.read_bytes() == before
    assert held_device_uuids(None) == {} and held_device_uuids(tmp_path / "absent.db") == {}


def test_a_whole_share_of_several_gpus_holds_each_of_them(tmp_path: Path):
    """A whole share's row names its first GPU only (device_uuid): the others were not listed, so
    `mig enable` without an agent was not refused on the second GPU of a two-GPU share. An exclusive
    share's spec names the GPU it was carved from, which it does not hold whole."""
    path = tmp_path / "journal.db"
    journal = Journal(path)
    journal.begin_share(ShareSpec(id="w", kind="whole", device_uuids=("GPU-a", "GPU-b")), "GPU-a", None)
    journal.begin_share(ShareSpec(id="ex", kind="exclusive", device_uuids=("GPU-c",), mig_profile="1g.10gb"),
                        "MIG-c", None)
    journal.close()
    assert held_device_uuids(path) == {"GPU-a": ["w"], "GPU-b": ["w"], "MIG-c": ["ex"]}


@pytest.mark.parametrize("content", [b"", b"not a database at all" * 10])
def test_a_file_that_is_not_a_journal_is_reported_and_left_alone(tmp_path: Path, content: bytes):
    path = tmp_path / "journal.db"
    path.write_bytes(content)
    with pytest.raises(StateFileError) as caught:
        held_device_uuids(path)
    assert str(caught.value).startswith(f"{path} cannot be read as a node agent journal (")
    assert str(caught.value).endswith("); give the agent's journal (e.g. /var/lib/fastshare/node/journal.db) "
                                      "or none")
    assert path.read_bytes() == content


def test_a_running_agents_journal_is_read_with_what_is_only_in_its_wal(tmp_path: Path):
    path = tmp_path / "journal.db"
    journal = Journal(path)   # open, as under a running agent: its commits are in the WAL file
    try:
        journal.begin_share(ShareSpec(id="s1", kind="whole", device_uuids=("GPU-a",)), "GPU-a", None)
        assert held_device_uuids(path) == {"GPU-a": ["s1"]}
        assert held_device_uuids(str(path)) == {"GPU-a": ["s1"]}
        journal.delete_share("s1")
        assert held_device_uuids(path) == {}
    finally:
        journal.close()
