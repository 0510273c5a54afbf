"""The ``rankwise`` command line: parse options, call :func:`rankwise.train.train`, print."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..train import Progress as TrainProgress
from ..train import TrainConfig, train
from ._ckpt import app as ckpt_app
from ._ode import ode_cmd
from ._sweep import sweep_cmd

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Low-rank training (DLRT / SDLRT) on the bundled 8×8 digits.")


app.add_typer(ckpt_app, name="ckpt")
app.command("ode")(ode_cmd)
app.command("sweep")(sweep_cmd)


class Method(str, enum.Enum):
    dense = "dense"
    dlrt = "dlrt"
    sdlrt = "sdlrt"


class ModelName(str, enum.Enum):
    lenet = "lenet"
    mlp = "mlp"


_DEFAULTS = TrainConfig()
_THREADS_HELP = ("CPU threads for torch. The models are tiny, so one thread is about as fast as "
                 "several and is not slowed down by other busy processes.")


@app.command("train")
def train_cmd(
    method: Annotated[Method, typer.Option(help="Training method.")] = Method(_DEFAULTS.method),
    model: Annotated[ModelName, typer.Option(help="Reference model.")] = ModelName(_DEFAULTS.model),
    tau: Annotated[float, typer.Option(help="Relative truncation tolerance τ in [0, 1).")] = _DEFAULTS.tau,
    tau_min: Annotated[float, typer.Option(
        help="SDLRT only: floor of the τ feedback (default 0: the paper's rule).")] = _DEFAULTS.tau_min,
    rank: Annotated[int | None, typer.Option(
        help="Initial rank of every low-rank layer (default: full rank).")] = None,
    epochs: Annotated[int, typer.Option(help="Passes over the training set.")] = _DEFAULTS.epochs,
    lr: Annotated[float, typer.Option(help="Learning rate.")] = _DEFAULTS.lr,
    momentum: Annotated[float, typer.Option(help="SGD momentum.")] = _DEFAULTS.momentum,
    batch_size: Annotated[int, typer.Option(help="Minibatch size.")] = _DEFAULTS.batch_size,
    seed: Annotated[int, typer.Option(help="Seed of initialisation, shuffling and split.")] = _DEFAULTS.seed,
    out: Annotated[Path | None, typer.Option(
        help="Directory for metrics.csv, TensorBoard events and final.json (default: none).",
        file_okay=False)] = None,
    threads: Annotated[int, typer.Option(help=_THREADS_HELP, min=1)] = 1,
) -> None:
    """Train one model and print a summary."""
    config = _config(method=method.value, model=model.value, tau=tau, tau_min=tau_min, rank=rank,
                     epochs=epochs, lr=lr, momentum=momentum, batch_size=batch_size, seed=seed,
                     out=out)
    console = Console()
    with _num_threads(threads), _progress(console) as bar:
        summary = train(config, callback=bar(config.method))
    console.print(_summary_table(summary))


@app.command("demo")
def demo_cmd(
    out: Annotated[Path, typer.Option(help="Directory for the three runs' records.",
                                      file_okay=False)] = Path("runs/demo"),
    epochs: Annotated[int, typer.Option(help="Epochs per method.")] = 20,
    tau: Annotated[float, typer.Option(help="Truncation tolerance τ of DLRT and SDLRT.")] = 0.2,
    rank: Annotated[int, typer.Option(help="Initial rank of every low-rank layer.")] = 8,
    seed: Annotated[int, typer.Option(help="Seed shared by the three runs.")] = 0,
    threads: Annotated[int, typer.Option(help=_THREADS_HELP, min=1)] = 1,
) -> None:
    """Dense SGD vs DLRT vs SDLRT: LeNet-5 on the digits, one comparison table.

    Both low-rank methods start from the same compressed initialisation (every layer at
    `rank`, as in the SDLRT paper) and truncate at the same τ."""
    configs = [_config(method=m, model="lenet", tau=tau, rank=None if m == "dense" else rank,
                       epochs=epochs, seed=seed, out=out / m)
               for m in ("dense", "dlrt", "sdlrt")]
    console = Console()
    summaries = []
    with _num_threads(threads), _progress(console) as bar:
        for config in configs:
            summaries.append(train(config, callback=bar(config.method)))
    console.print(_comparison_table(summaries, tau=tau, epochs=epochs, rank=rank))
    console.print(f"Run records (metrics.csv, final.json, TensorBoard): {out}/{{dense,dlrt,sdlrt}}")


def main() -> None:
    """Entry point of the ``rankwise`` console script."""
    app()


# --------------------------------------------------------------------------- helpers
def _config(**kwargs: Any) -> TrainConfig:
    try:
        return TrainConfig(**kwargs)
    except (ValueError, TypeError) as e:
        raise typer.BadParameter(str(e)) from e


def _ranks(ranks: dict[str, int]) -> str:
    return " ".join(f"{name}:{r}" for name, r in ranks.items()) or "-"


@contextmanager
def _num_threads(n: int) -> Iterator[None]:
    """Run with ``torch.set_num_threads(n)``, restoring the previous count afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def _progress(console: Console) -> Iterator:
    """A rich progress display; yields ``bar(label) -> callback`` that adds one bar per run."""
    columns = (TextColumn("{task.description:>5}"), BarColumn(bar_width=16),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        def bar(label: str):
            task = progress.add_task(label, total=None, info="")

            def callback(p: TrainProgress) -> None:
                info = f"ep {p.epoch}/{p.epochs} loss {p.loss:.3f} acc {p.acc:.3f}"
                if p.record is not None:
                    info += f" test {p.record.test_acc:.3f}"
                if p.ranks:
                    info += " r " + "/".join(str(r) for r in p.ranks.values())
                progress.update(task, total=p.epochs * p.steps,
                                completed=(p.epoch - 1) * p.steps + p.step, info=info)

            return callback

        yield bar


def _summary_table(s: dict[str, Any]) -> Table:
    cfg, comp = s["config"], s["compression"]
    table = Table(title=f"rankwise train: {cfg['method']} / {cfg['model']}", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    rows = [
        ("test accuracy", f"{s['test_acc']:.4f}"),
        ("train accuracy", f"{s['train_acc']:.4f}"),
        ("compression", f"{comp['ratio']:.1%} ({comp['stored_params']:,} of "
                        f"{comp['dense_params']:,} params stored)"),
        ("final ranks", _ranks(s["ranks"])),
        ("final τ", " ".join(f"{n}:{t:.3g}" for n, t in s["taus"].items()) or "-"),
        ("epochs", str(cfg["epochs"])),
        ("wall time", f"{s['wall_time']:.1f} s"),
        ("records", cfg["out"] or "-"),
    ]
    for row in rows:
        table.add_row(*row)
    return table


def _comparison_table(summaries: list[dict[str, Any]], *, tau: float, epochs: int, rank: int) -> Table:
    layers = next((list(s["ranks"]) for s in summaries if s["ranks"]), [])
    caption = [f"final ranks of {'/'.join(layers)} (all start at rank ≤ {rank})" if layers else "",
               "compression = 1 − stored / dense parameters (inference)"]
    caption += [f"SDLRT: {s['compression']['training_ratio']:.1%} compression while training "
                "(counting its buffer); final τ "
                + "/".join(f"{t:.2g}" for t in s["taus"].values())
                for s in summaries if s["config"]["method"] == "sdlrt"]
    table = Table(title=f"LeNet-5 on digits: {epochs} epochs, τ = {tau}",
                  caption="\n".join(c for c in caption if c))
    for name, justify in (("method", "left"), ("test acc", "right"), ("train acc", "right"),
                          ("compression", "right"), ("final ranks", "left"), ("wall time", "right")):
        table.add_column(name, justify=justify)
    for s in summaries:
        ranks = "/".join(str(s["ranks"][n]) for n in layers) if s["ranks"] else "dense"
        table.add_row(s["config"]["method"].upper(), f"{s['test_acc']:.4f}", f"{s['train_acc']:.4f}",
                      f"{s['compression']['ratio']:.1%}", ranks, f"{s['wall_time']:.1f} s")
    return table
