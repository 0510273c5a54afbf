"""``rankwise sweep``: compression sweeps of dense / DLRT / SDLRT (and SDLRT's ablations) with a
dense shadow for the stability distance; resumable, parallel, one CSV, one table, three plots."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from .._io import write_atomic
from ..experiments.sweep import (
    METHODS,
    PAPER_TAUS,
    TASK_LR,
    TASKS,
    RunSpec,
    plot,
    summary_markdown,
    sweep,
    write_csv,
)
from ..experiments.sweep_report import equal_compression_markdown


def _split(text: str, allowed, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise typer.BadParameter(f"{what} must be from {sorted(allowed)}; got {bad or text!r}")
    return items


def sweep_cmd(
    tasks: Annotated[str, typer.Option(help=f"Comma-separated, from: {', '.join(TASKS)}.")]
    = "lenet-digits,mlp-mnist1d,vgg-digits16",
    methods: Annotated[str, typer.Option(help=f"Comma-separated, from: {', '.join(METHODS)}.")]
    = ",".join(METHODS),
    taus: Annotated[str, typer.Option(help="Comma-separated τ values (the paper's grid by default).")]
    = ",".join(f"{t:g}" for t in PAPER_TAUS),
    seeds: Annotated[int, typer.Option(help="Seeds per configuration.")] = 3,
    epochs: Annotated[int, typer.Option(help="Training epochs per run.")] = 10,
    rank: Annotated[int, typer.Option(help="Initial rank of every low-rank layer.")] = 32,
    lr: Annotated[float | None, typer.Option(help="Learning rate (SGD, momentum 0.9); default 0.05, "
                                             "0.02 for the VGG tasks.")] = None,
    omega: Annotated[float, typer.Option(help="SDLRT's feedback factor ω.")] = 0.8,
    jobs: Annotated[int, typer.Option(help="Parallel processes (one thread each).")] = 1,
    data_dir: Annotated[Path | None, typer.Option(help="Folder with MNIST IDX / CIFAR batches.")] = None,
    out: Annotated[Path, typer.Option(help="Run folder: runs/*.json, runs.csv, summary.md, PNGs.")]
    = Path("runs/sweep"),
) -> None:
    """Run (or resume) a sweep and write runs.csv, summary.md (mean ± std over seeds),
    equal_compression.md (each method against DLRT at the same final compression) and the plots
    acc_vs_compression.png, rank_vs_step.png, dt_vs_step.png into --out."""
    task_list = _split(tasks, TASKS, "tasks")
    method_list = _split(methods, METHODS, "methods")
    try:
        tau_list = [float(t) for t in taus.split(",")]
    except ValueError as e:
        raise typer.BadParameter(f"taus must be numbers; got {taus!r}") from e
    if seeds < 1 or epochs < 1 or jobs < 1:
        raise typer.BadParameter("seeds, epochs and jobs must be >= 1")
    specs = []
    for task in task_list:
        for method in method_list:
            for tau in ([0.0] if method == "dense" else tau_list):
                for seed in range(seeds):
                    specs.append(RunSpec(task=task, method=method, tau=tau, seed=seed, epochs=epochs,
                                         rank=rank, lr=lr or TASK_LR.get(task, 0.05), omega=omega,
                                         data_dir=str(data_dir) if data_dir else None))
    console = Console()
    count = [0]

    def done(r: dict) -> None:
        count[0] += 1
        console.print(f"[{count[0]}] {r['key']}: test acc {r['test_acc']:.4f}, "
                      f"compression {r['compression']:.3f}")

    results = sweep(specs, out, jobs=jobs, on_done=done)
    write_csv(results, out / "runs.csv")
    table = summary_markdown(results)
    write_atomic(out / "summary.md", table.encode())
    if "dlrt" in method_list:
        write_atomic(out / "equal_compression.md", equal_compression_markdown(results).encode())
    plot(results, out)
    console.print(table)
    console.print(f"{len(results)} runs ({count[0]} new); wrote {out}/runs.csv, summary.md and 3 PNGs")
