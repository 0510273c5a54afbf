"""How ``rankwise train`` and ``rankwise demo`` show a run: the progress bar and the tables."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from .._provenance import source_commit
from ._common import progress_columns


@contextmanager
def progress(console: Console) -> Iterator:
    """A rich progress display; yields ``bar(label) -> callback`` that adds one bar per run.

    The bar shows the running means of this epoch's minibatch loss and accuracy (each batch
    measured as it was trained: "batch acc"), the last epoch's test accuracy and the ranks.
    Where the console is not a terminal (a pipe, a log file: rich draws no bars there), a run
    prints a line each tenth of its steps instead (and at its last step)."""
    with Progress(*progress_columns(), console=console) as prog:
        def bar(label: str):
            task = prog.add_task(f"{label:>5}", total=None, info="", visible=console.is_terminal)
            tenths = [0]

            def callback(p) -> None:
                info = f"ep {p.epoch}/{p.epochs} loss {p.loss:.3f} batch acc {p.acc:.3f}"
                if p.record is not None:
                    info += f" test {p.record.test_acc:.3f}"
                if p.ranks:
                    info += " r " + "/".join(str(r) for r in p.ranks.values())
                total, done = p.epochs * p.steps, (p.epoch - 1) * p.steps + p.step
                if not console.is_terminal:
                    tenth = 10 * done // total
                    if tenth > tenths[0]:
                        tenths[0] = tenth
                        prog.console.print(f"{label}: step {done}/{total} {info}", highlight=False,
                                           soft_wrap=True)
                    return
                prog.update(task, total=total, completed=done, info=info)

            return callback

        yield bar


def _ranks(ranks: dict[str, int]) -> str:
    return " ".join(f"{name}:{r}" for name, r in ranks.items()) or "-"


def summary_table(s: dict[str, Any]) -> Table:
    cfg, comp = s["config"], s["compression"]
    table = Table(title=f"rankwise train: {cfg['method']} / {cfg['model']}", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    rows = [
        ("test accuracy", f"{s['test_acc']:.4f}"),
        ("train accuracy (eval, whole split)", f"{s['train_acc']:.4f}"),
        ("compression", f"{comp['ratio']:.1%} ({comp['stored_params']:,} of "
                        f"{comp['dense_params']:,} params stored)"),
        ("final ranks", _ranks(s["ranks"])),
        ("final τ", " ".join(f"{n}:{t:.3g}" for n, t in s["taus"].items()) or "-"),
        ("epochs", str(cfg["epochs"])),
        ("wall time", f"{s['wall_time']:.1f} s" + (f" ({s['nproc']} processes, data-parallel)"
                                                     if s.get("nproc", 1) > 1 else "")),
        ("records", cfg["out"] or "-"),
    ]
    for row in rows:
        table.add_row(*row)
    return table


def _layers(summaries: list[dict[str, Any]]) -> list[str]:
    return next((list(s["ranks"]) for s in summaries if s["ranks"]), [])


def _row(s: dict[str, Any], layers: list[str]) -> list[str]:
    ranks = "/".join(str(s["ranks"][n]) for n in layers) if s["ranks"] else "dense"
    comp = s["compression"]
    compression = f"{comp['ratio']:.1%}"
    if comp.get("buffer_params"):
        compression += f" ({comp['training_ratio']:.1%} counting its buffer)"
    return [s["config"]["method"].upper() if s["config"]["method"] != "dense" else "dense",
            f"{s['test_acc']:.4f}", f"{s['train_acc']:.4f}", compression, ranks, f"{s['wall_time']:.1f} s"]


_HEADERS = ("method", "test acc", "train acc (eval)", "compression", "final ranks", "wall time")
TABLE_HEADER = "| " + " | ".join(_HEADERS) + " |"  # the first line of comparison_markdown


def _level(tau: float | None, target: float | None) -> str:
    return f"τ = {tau:g}" if target is None else f"{100 * target:g} % compression"


def comparison_table(summaries: list[dict[str, Any]], *, epochs: int, rank: int, tau: float | None = None,
                     target: float | None = None) -> Table:
    layers = _layers(summaries)
    caption = [f"final ranks of {'/'.join(layers)} (all start at rank ≤ {rank})" if layers else "",
               "compression = 1 − stored / dense parameters (inference)",
               "train acc: the final model on the whole training split, in eval mode"]
    caption += ["SDLRT: final τ " + "/".join(f"{t:.2g}" for t in s["taus"].values())
                for s in summaries if s["config"]["method"] == "sdlrt" and s["config"].get("target") is None]
    table = Table(title=f"LeNet-5 on digits: {epochs} epochs, {_level(tau, target)}",
                  caption="\n".join(c for c in caption if c))
    for name in _HEADERS:
        table.add_column(name, justify="left" if name in ("method", "final ranks") else "right")
    for s in summaries:
        table.add_row(*_row(s, layers))
    return table


def comparison_markdown(summaries: list[dict[str, Any]]) -> str:
    """The comparison as a Markdown table with the command and commit that produced it."""
    layers = _layers(summaries)
    cfg = summaries[0]["config"]
    low = next((s["config"] for s in summaries if s["config"]["rank"] is not None), cfg)
    rank = low["rank"]
    level = f"--tau {low['tau']}" if low.get("target") is None else f"--target {low['target']:g}"
    lines = [TABLE_HEADER, "|" + "---|" * len(_HEADERS)]
    lines += ["| " + " | ".join(_row(s, layers)) + " |" for s in summaries]
    note = (f"*Produced by `rankwise demo --epochs {cfg['epochs']} {level} --rank {rank} "
            f"--seed {cfg['seed']}` (`make docs-figures`) at commit {source_commit()}; final ranks of "
            f"{'/'.join(layers)}; train acc is the final model on the whole training split in eval "
            "mode. Accuracies, compressions and ranks repeat exactly from run to run on one machine; "
            "on another CPU the float rounding differs and they move (by about 2 points of accuracy "
            "and a rank or two, as seeds do); wall times depend on the machine and its load.*")
    return "\n".join(lines) + "\n\n" + note + "\n"
