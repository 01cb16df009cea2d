"""print_table: the layout a reader sees at a given terminal width."""

from fastshare.cli._output import print_table

COLUMNS = ["final alloc %", "pods failed"]
ROWS = [["96.29", "2444"]]


def _lines(capsys, monkeypatch, width: int) -> list[str]:
    monkeypatch.setenv("COLUMNS", str(width))
    print_table("GPU allocation ratio, fastshare on default (seed 42, tune 1.3)", COLUMNS, ROWS)
    return [line.rstrip() for line in capsys.readouterr().out.splitlines()]


def test_whole_headers_two_spaces_apart_when_they_fit(capsys, monkeypatch):
    lines = _lines(capsys, monkeypatch, 80)
    assert lines[0] == "GPU allocation ratio, fastshare on default (seed 42, tune 1.3)"
    assert lines[1] == "final alloc %  pods failed"
    assert lines[3] == "96.29          2444"


def test_headers_wrap_at_spaces_when_whole_ones_do_not_fit(capsys, monkeypatch):
    lines = _lines(capsys, monkeypatch, 25)
    # the title is its own line, folded only by the terminal's width, never by the table's
    assert "GPU allocation ratio" in lines[0]
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("final")):]
    assert table[:3] == ["final", "alloc pods", "%     failed"]   # headers end on one line
    assert table[4] == "96.29 2444"
    assert all(len(line) <= 25 for line in lines)


def test_cells_are_shown_as_written_not_read_as_markup(capsys, monkeypatch):
    # cells hold what users typed (an allocation's --owner, a cordon --reason): rich markup in
    # them crashed `fastshare status` for everyone ("[/x]": MarkupError) or was swallowed
    monkeypatch.setenv("COLUMNS", "80")
    print_table(None, ["owner", "state"], [["[/x]", "cordoned: [bold]disk[/bold] :smile:"]])
    out = capsys.readouterr().out
    assert "[/x]" in out
    assert "cordoned: [bold]disk[/bold] :smile:" in out
