"""Progress where the output is not a terminal: lines that show runs advancing (issue 49)."""

from __future__ import annotations


def test_progress_written_to_a_file_shows_runs_advancing():
    """Issue 49's note: `rankwise lm ... > log` wrote nothing until a run ended (rich draws no
    bars where the output is not a terminal): a 5-minute run looked hung."""
    import io

    from rich.console import Console

    from rankwise.cli._common import run_bars

    out = io.StringIO()
    with run_bars(Console(file=out), lambda r: f"{r['key']} done") as (on_progress, on_done):
        for step in range(1, 101):
            on_progress("a", step, 100, f"loss {1 / step:.2f}")
            on_progress("b", step // 2, 50, "")
        on_done({"key": "a"})
    lines = [x for x in out.getvalue().splitlines() if x]
    assert [x for x in lines if x.startswith("a:")] == [f"a: step {10 * t}/100 loss {1 / (10 * t):.2f}"
                                                         for t in range(1, 10)]
    assert len([x for x in lines if x.startswith("b:")]) == 9 and lines[-1] == "a done"
