"""Trace files: strict readers and the published arrival order."""

from __future__ import annotations

import re

import pytest

from fastshare.sim.trace import (
    SimPod,
    TraceError,
    arrival_order,
    node_tie_order,
    read_nodes,
    read_pods,
)

POD_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n"
NODE_HEADER = "sn,cpu_milli,memory_mib,gpu,model\n"


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_reads_valid_files(tmp_path):
    pods = read_pods(write(tmp_path, "p.csv", POD_HEADER + "a,1000,10,1,500,T4|P100\nb,2000,10,0,0,\n"))
    assert pods[0].gpu_spec == frozenset({"T4", "P100"}) and pods[0].gpu_request == 500
    assert pods[1].gpu_request == 0
    nodes = read_nodes(write(tmp_path, "n.csv", NODE_HEADER + "n1,64000,1024,2,T4\n"))
    assert nodes[0].gpus == 2 and nodes[0].model == "T4"


@pytest.mark.parametrize(("body", "message"), [
    ("a,1000,10,1,1200,\n", "line 2: gpu_milli must be 0..1000 (got 1200)"),
    ("a,x,10,1,100,\n", "line 2: cpu_milli must be an integer (got 'x')"),
    ("a,1000,10,2,500,\n", "gpu_milli must be 1000 for a multi-GPU task"),
    ("a,1000,10,1,0,\n", "gpu_milli must be 1..1000 when num_gpu is 1"),
    ("a,1000,10,1,10,\na,1,1,0,0,\n", "line 3: task a appears twice"),
    (",1000,10,1,10,\n", "line 2: name is empty"),
    ("a,-5,10,0,0,\n", "cpu_milli must be >= 0 (got -5)"),
])
def test_bad_pod_rows_name_line_and_field(tmp_path, body, message):
    with pytest.raises(TraceError, match=re.escape(message)):
        read_pods(write(tmp_path, "p.csv", POD_HEADER + body))


def test_bad_files(tmp_path):
    with pytest.raises(TraceError, match="missing column"):
        read_pods(write(tmp_path, "p.csv", "name,cpu\na,1\n"))
    with pytest.raises(TraceError, match="no data rows"):
        read_pods(write(tmp_path, "p.csv", POD_HEADER))
    with pytest.raises(TraceError, match="cannot read"):
        read_pods(tmp_path / "missing.csv")
    with pytest.raises(TraceError, match=r"gpu must be 0\.\.64"):
        read_nodes(write(tmp_path, "n.csv", NODE_HEADER + "n1,1,1,99,T4\n"))


def _pods(n):
    return [SimPod(f"p{i:03d}", 1000, 10, 1, 100 + (i % 9) * 100) for i in range(n)]


def test_arrival_order_is_seeded_and_tuned():
    pods = _pods(50)
    a = arrival_order(pods, 42, 1.3, 20_000)
    assert a == arrival_order(list(reversed(pods)), 42, 1.3, 20_000)  # sorted by name first
    assert a != arrival_order(pods, 43, 1.3, 20_000)
    assert sorted(p.name for p in a[:50]) == sorted(p.name for p in pods)
    clones = a[50:]
    assert clones and all(p.clone for p in clones)
    total = sum(p.gpu_request for p in a)
    assert total <= 1.3 * 20_000 < total + 900  # stops when the next copy would pass the target
    assert arrival_order(pods, 42, 0, 20_000) == a[:50]


def test_tie_order_is_a_seeded_permutation(tmp_path):
    nodes = read_nodes(write(tmp_path, "n.csv", NODE_HEADER + "".join(f"n{i},1,1,1,T4\n" for i in range(20))))
    r = node_tie_order(nodes, 42)
    assert sorted(r) == list(range(20)) and r == node_tie_order(nodes, 42) and r != node_tie_order(nodes, 1)


def test_a_byte_order_mark_and_padded_header_names_are_read(tmp_path):
    # a CSV saved by Excel or PowerShell starts with a UTF-8 BOM, and some exports put a space
    # after each comma; both were refused with "missing column(s) name"
    body = "a,1000,10,1,500,T4\n"
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + (POD_HEADER + body).encode())
    assert read_pods(tmp_path / "bom.csv")[0].name == "a"
    padded = write(tmp_path, "sp.csv", "name, cpu_milli , memory_mib, num_gpu, gpu_milli, gpu_spec\n" + body)
    assert read_pods(padded)[0].gpu_request == 500
    (tmp_path / "n.csv").write_bytes(b"\xef\xbb\xbf" + (NODE_HEADER + "n1,64000,1024,2,T4\n").encode())
    assert read_nodes(tmp_path / "n.csv")[0].name == "n1"


def test_errors_name_the_physical_line_after_blank_lines_and_quoted_newlines(tmp_path):
    # rows were numbered by their index, so a blank line (or a quoted field spanning lines)
    # before the bad row sent the user to the wrong line
    text = POD_HEADER + "a,1000,10,1,500,\n\n\nb,1000,10,1,500,\"T4\nP100\"\nc,-1,10,0,0,\n"
    with pytest.raises(TraceError, match=re.escape("line 7: cpu_milli must be >= 0 (got -1)")):
        read_pods(write(tmp_path, "p.csv", text))
    nodes = NODE_HEADER + "n1,1,1,1,T4\r\n\r\nn1,1,1,1,T4\r\n"
    with pytest.raises(TraceError, match=re.escape("line 4: node n1 appears twice")):
        read_nodes(write(tmp_path, "n.csv", nodes))
    with pytest.raises(TraceError, match=re.escape("line 3: not a CSV file")):
        read_nodes(write(tmp_path, "big.csv", NODE_HEADER + "n1,1,1,1,T4\nn2,1,1,1," + "T" * 200_000 + "\n"))


def test_a_duplicated_column_or_a_row_with_more_fields_than_the_header_is_refused(tmp_path):
    # both were read silently: the last of two gpu_milli columns won, and an unquoted
    # "T4,P100" gave gpu_spec T4 and dropped P100 into the next column (or nowhere)
    with pytest.raises(TraceError, match=re.escape("column gpu_milli appears twice in the header")):
        read_pods(write(tmp_path, "p.csv", POD_HEADER.strip() + ",gpu_milli\na,1000,10,1,500,,900\n"))
    with pytest.raises(TraceError, match=re.escape("line 3: 7 fields, but the header has 6 columns")):
        read_pods(write(tmp_path, "p.csv", POD_HEADER + "a,1000,10,1,500,\nb,1000,10,1,500,T4,P100\n"))
    # empty trailing fields (a trailing comma) are harmless
    assert len(read_pods(write(tmp_path, "p.csv", POD_HEADER + "a,1000,10,1,500,T4,\n"))) == 1


def test_a_trace_without_gpu_tasks_gets_no_copies():
    # no copy can bring the requested GPU total to tune x capacity: the loop appended
    # 50 x the trace + 1,000 copies (100 CPU-only tasks became 6,101) before giving up
    pods = [SimPod(f"c{i}", 1000, 10, 0, 0) for i in range(100)]
    assert len(arrival_order(pods, 42, 1.3, 20_000)) == 100


def test_gpu_spec_models_are_read_without_the_spaces_around_them(tmp_path):
    # "T4 | P100" gave the models "T4 " and " P100", which no node has: the task failed everywhere
    pods = read_pods(write(tmp_path, "p.csv", POD_HEADER + "a,1000,10,1,500, T4 | P100 |\n"))
    assert pods[0].gpu_spec == frozenset({"T4", "P100"})
