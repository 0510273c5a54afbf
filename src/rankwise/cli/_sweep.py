"""``rankwise sweep``: compression sweeps of dense / DLRT / SDLRT (and SDLRT's ablations) with a
dense shadow for the stability distance; resumable, parallel, one CSV, one table, three plots."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .._fields import options_named
from .._io import write_atomic
from ..experiments._sweep_spec import (
    ALLOCATIONS,
    DEFAULT_METHODS,
    FILE_TASKS,
    METHODS,
    OPTIMIZERS,
    PAPER_TAUS,
    TARGET_DEFAULT,
    TASK_LR,
    TASK_NAMES,
    TASK_RANK,
)
from ..methods import REGISTRY, renamed
from ..train_config import RAMP_SHARE
from ._common import (
    Jobs,
    UserError,
    check_output_dir,
    check_range,
    given,
    lock_output,
    no_repeats,
    print_whole,
    refuse_unused,
    require_dir,
)


def _split(text: str, allowed, option: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise UserError(f"{option} must be a comma-separated list from {', '.join(allowed)}; "
                        f"got {', '.join(bad) if bad else repr(text)}{renamed(bad)}")
    no_repeats(items, text, option)
    return items


def _entries(text: str) -> list[tuple[str, dict]]:
    """--methods: ``METHOD[:ALLOC][:floorX][:freeze]`` entries -> (method, RunSpec settings)."""
    out, items = [], [x.strip() for x in text.split(",") if x.strip()]
    for item in items:
        method, *mods = item.split(":")
        if method not in METHODS:
            raise UserError(f"--methods must be a comma-separated list from {', '.join(METHODS)} (each "
                            f"optionally :ALLOC, :floorX, :freeze); got {method}{renamed([method])}")
        extra: dict = {}
        for mod in mods:
            if mod in ALLOCATIONS:
                extra["alloc"] = mod
            elif mod == "freeze":
                extra["freeze"] = True
            elif mod.startswith("floor"):
                try:
                    extra["floor"] = float(mod[5:])
                except ValueError:
                    raise UserError(f"--methods {item}: floor takes a share, e.g. floor0.5; "
                                    f"got {mod}") from None
                check_range(f"--methods {item}: floor", extra["floor"], 0, 1, hi_open=False)
            else:
                raise UserError(f"--methods {item}: {mod!r} is none of the allocations "
                                f"({', '.join(ALLOCATIONS)}), floorX or freeze")
        out.append((method, extra))
    if not out:
        raise UserError(f"--methods must be a comma-separated list from {', '.join(METHODS)}; got {text!r}")
    no_repeats(items, text, "--methods", keys=[(m, sorted(e.items())) for m, e in out])
    return out


_UNUSED = {  # why no run reads an option (when that is so for every planned run)
    "omega": "ω is the factor of SDLRT's τ feedback, and no planned run has one (an sdlrt method with its "
             "feedback, at --taus: a --targets budget has none)",
    "rank": "no planned run starts from a rank of its own (dense and the baselines set theirs)",
    "dt_every": "the dense shadow's d_t is measured for the low-rank methods only, and none is planned",
}


# the RunSpec fields this command sets from options of the same name (the others are set for it)
_EXPOSED = ("lr", "omega", "ramp", "alloc", "val", "optimizer", "epochs", "rank", "dt_every",
            "finetune_epochs", "data_dir")


SWEEP_SUMMARIES = (r"runs\.csv", r"summary\.md", r"selection\.md", r"equal_compression\.md",
                   r"versus_baselines\.md",
                   r"acc_vs_compression\.png", r"rank_vs_step\.png", r"dt_vs_step\.png",
                   r"acc_vs_target\.png", r"ranks_per_layer\.png")


def _numbers(text: str, option: str, what: str, example: str, *, lo_open: bool) -> list[float]:
    """Comma-separated numbers in [0, 1) (or (0, 1) with `lo_open`), else a UserError."""
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise UserError(f"{option} must be comma-separated numbers, e.g. {example}; got {text!r}") from e
    if not values:
        raise UserError(f"{option} is empty; give at least one {what}")
    no_repeats(values, text, option)
    for v in values:
        check_range(f"{option}: every {what}", v, 0, 1, lo_open=lo_open)
    return values


def _check_data(kinds: list[str], data_dir: Path) -> None:
    """Load each dataset the tasks need once, before any run starts: a missing or unreadable
    file is reported now, not after the other runs."""
    from ..data import load_cifar, load_mnist

    for kind in kinds:
        try:
            load_mnist(data_dir) if kind == "mnist" else load_cifar(data_dir, int(kind[5:]))
        except Exception as e:
            raise UserError(f"--data-dir {data_dir}: cannot read the {kind} files: {e}; put them there or "
                            "choose other --tasks") from e


def sweep_cmd(
    ctx: typer.Context,
    tasks: Annotated[str, typer.Option(help=f"Comma-separated, from: {', '.join(TASK_NAMES)} "
                                       f"({', '.join(FILE_TASKS)} read files from --data-dir).",
                                       show_default="lenet-digits, mlp-mnist1d, vgg-digits16")]
    = "lenet-digits,mlp-mnist1d,vgg-digits16",
    methods: Annotated[str | None, typer.Option(
        help=f"Comma-separated, from: {', '.join(METHODS)} (default: {', '.join(DEFAULT_METHODS)}; with "
             f"--targets: {', '.join(TARGET_DEFAULT)}).")] = None,
    taus: Annotated[str, typer.Option(help="Comma-separated τ values in [0, 1) (default: the paper's "
                                      "grid).")]
    = ",".join(f"{t:g}" for t in PAPER_TAUS),
    seeds: Annotated[int, typer.Option(help="Seeds per configuration.", min=1)] = 3,
    epochs: Annotated[int, typer.Option(help="Training epochs per run (every method).", min=1)] = 10,
    finetune_epochs: Annotated[int | None, typer.Option(
        help="dense-svd: the last epochs, fine-tuning the factors after the SVD, counted inside "
             "--epochs; default epochs // 5 (at least 1).", min=1)] = None,
    rank: Annotated[int | None, typer.Option(
        help="Initial rank of every low-rank layer (clamped per layer); default 32, full rank for "
             "cnn-digits-pretrained.", min=1)] = None,
    lr: Annotated[float | None, typer.Option(help="Learning rate (SGD, momentum 0.9); default 0.05, "
                                             "0.01 for cnn-digits-pretrained (fine-tuning).")] = None,
    omega: Annotated[float, typer.Option(help="SDLRT's feedback factor ω in (0, 1).")] = 0.8,
    jobs: Jobs = 1,
    data_dir: Annotated[Path | None, typer.Option(help="Folder with MNIST IDX / CIFAR batches.")] = None,
    out: Annotated[Path, typer.Option(help="Run folder: runs/*.json, runs.csv, summary.md, PNGs.")]
    = Path("runs/sweep"),
    targets: Annotated[str | None, typer.Option(
        help="Comma-separated compression targets in (0, 1), e.g. 0.8,0.9,0.95: the low-rank methods "
             "then reach each by a global parameter budget instead of using --taus.")] = None,
    ramp: Annotated[float | None, typer.Option(
        help=f"With --targets: the share of the training steps over which the budget falls to the "
             f"target; default {RAMP_SHARE:g}.")] = None,
    alloc: Annotated[str | None, typer.Option(
        help=f"With --targets: how the budget ranks singular directions, one of {', '.join(ALLOCATIONS)} "
             f"(rankwise.Budget); default {ALLOCATIONS[0]}.")] = None,
    optimizer: Annotated[str, typer.Option(
        help=f"Optimizer family of every method without --select: {' or '.join(OPTIMIZERS)} (SGD with "
             "momentum 0.9).")] = "sgd",
    select: Annotated[float | None, typer.Option(
        help="Choose each task and method's optimizer family and learning rate on validation, from "
             "--grid, on seed 0 at this target (one of --targets, e.g. 0.9), then run every target and "
             "seed with its choice (the fair protocol; docs/sdlrt.md).")] = None,
    grid: Annotated[str | None, typer.Option(
        help="With --select: FAMILY:LR,LR,...;FAMILY:... (default: sgd at 0.01, 0.03, 0.1, 0.3; adam at "
             "0.0003, 0.001, 0.003, 0.01). A choice at an edge widens it by one value.")] = None,
    widen: Annotated[int | None, typer.Option(help="With --select: how often a grid may grow at an edge "
                                              "(default 1).", min=0, max=5)] = None,
    val: Annotated[float, typer.Option("--validation", help="Share of the training split held out for "
                                       "validation.")] = 0.15,
    val_alias: Annotated[float | None, typer.Option("--val", hidden=True, help="= --validation (its old "
                                                    "name).")] = None,
    dt_every: Annotated[int, typer.Option(help="Steps between d_t measurements of the dense shadow "
                                          "(0: no shadow, faster).", min=0)] = 5,
    force: Annotated[bool, typer.Option("--force", help="Rerun and replace stored runs whose settings "
                                        "differ from this sweep's (default: refuse).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check the arguments, print the plan (how many "
                                          "runs) and exit without running or writing anything.")] = False,
) -> None:
    """The compression study: dense / DLRT / SDLRT and ablations over τ and seeds (resumable).

    Runs (or resumes) a sweep and writes runs.csv, summary.md (mean ± std over seeds),
    equal_compression.md (each method against DLRT at the same final compression, from two
    --taus or more; with one, the file says so) and the plots
    acc_vs_compression.png, rank_vs_step.png, dt_vs_step.png (with --targets also
    acc_vs_target.png and ranks_per_layer.png) into --out.

    Resuming: a run whose record (runs/KEY.json) exists with the same settings is not rerun.
    A record with the same key but other settings (e.g. other --epochs) makes the sweep stop
    before it starts, unless --force. The summary files and plots are rewritten from all
    records of this sweep every time."""
    if val_alias is not None:  # --val: the old name of --validation (the ode command's)
        if given(ctx, "val"):
            raise UserError("--val is the old name of --validation: give one of them")
        val = val_alias
    task_list = _split(tasks, TASK_NAMES, "--tasks")
    default = DEFAULT_METHODS if targets is None else TARGET_DEFAULT
    entries = _entries(",".join(default) if methods is None else methods)
    method_list = [m for m, _ in entries]
    from ..experiments._select import DEFAULT_GRID, parse_grid

    for option, value in (("--grid", grid), ("--widen", widen)):
        if value is not None and select is None:
            raise UserError(f"{option} applies to --select: give --select too (or leave {option} out)")
    widen = 1 if widen is None else widen
    if finetune_epochs is not None and not any(m.startswith("dense-svd") for m in method_list):
        raise UserError("--finetune-epochs applies to the dense-svd method: add it to --methods (or leave "
                        "--finetune-epochs out)")
    try:
        lr_grid = DEFAULT_GRID if grid is None else parse_grid(grid, OPTIMIZERS)
    except ValueError as e:
        raise UserError(f"--grid: {e}") from None
    if select is not None and lr is not None:
        raise UserError("--select chooses the learning rate: leave --lr out")
    tau_list = _numbers(taus, "--taus", "τ", "0.1,0.2", lo_open=False)
    target_list = None if targets is None else _numbers(targets, "--targets", "target", "0.8,0.9",
                                                         lo_open=True)
    if select is not None and (target_list is None or select not in target_list):
        raise UserError(f"--select {select:g} must be one of the compression --targets (e.g. --targets "
                        "0.8,0.9,0.95 --select 0.9)")
    for option, value in (("--ramp", ramp), ("--alloc", alloc)):
        if value is not None and target_list is None:
            raise UserError(f"{option} applies to compression targets: give --targets too "
                            f"(or leave {option} out)")
    ramp = RAMP_SHARE if ramp is None else ramp
    alloc = ALLOCATIONS[0] if alloc is None else alloc
    from ..experiments._sweep_spec import RunSpec

    levels = [{"tau": t} for t in tau_list] if target_list is None else [{"target": t} for t in target_list]

    def spec(task: str, i: int, level: dict, seed: int, **cfg) -> RunSpec:
        method, extra = entries[i]
        settings = dict(dict(alloc=alloc), **extra) if "target" in level else {}
        return RunSpec(task=task, method=method, seed=seed, epochs=epochs,
                       rank=rank if rank is not None else TASK_RANK.get(task, 32),
                       lr=lr if lr is not None else TASK_LR.get(task, 0.05), omega=omega, ramp=ramp,
                       optimizer=optimizer,
                       val=val, dt_every=dt_every, finetune_epochs=finetune_epochs or max(1, epochs // 5),
                       data_dir=str(data_dir) if data_dir else None,
                       **settings, **level, **cfg)

    def levels_of(method: str) -> list[dict]:
        return [{"tau": 0.0}] if method == "dense" else levels

    try:
        plan = [(task, i, level, seed) for task in task_list for i, (method, _) in enumerate(entries)
                for level in levels_of(method) for seed in range(seeds)]
        specs = [spec(*p) for p in plan]
    except ValueError as e:  # the run spec checks every setting; the message names the option
        raise UserError(options_named(str(e), RunSpec, only=_EXPOSED, said={"val": "--validation"})) from None
    if target_list is not None:
        refuse_unused(ctx, {"taus": "with --targets the low-rank methods reach each target by a parameter "
                                    "budget, not a tolerance τ"})
    for name, field in (("omega", "omega"), ("rank", "rank"), ("dt_every", "dt_every")):
        if all(field in s.unused() for s in specs):  # (a setting none of the planned runs reads)
            refuse_unused(ctx, {name: _UNUSED[name]})
    if data_dir is not None:
        require_dir(data_dir, "--data-dir")
    need = sorted({FILE_TASKS[t] for t in task_list if t in FILE_TASKS})
    if need and data_dir is None:
        raise UserError(f"tasks on {', '.join(need)} read files: give their folder with --data-dir")
    if need:
        _check_data(need, data_dir)
    if "cnn-digits-pretrained" in task_list:
        from .._wheels import digit_cnn_weights_path

        try:
            digit_cnn_weights_path()
        except ImportError as e:
            raise UserError(f"task cnn-digits-pretrained: {e}") from None
    from ..experiments._resume import stored_count

    stored = stored_count(specs, out / "runs", differences=RunSpec.differences)
    if dry_run:
        levels_text = f"{len(target_list)} target(s)" if target_list is not None else f"{len(tau_list)} τ"
        chosen = "" if select is None else ", after the --select grid's runs on validation"
        print(f"plan: {len(specs)} runs ({len(task_list)} task(s) × {len(entries)} method(s) × {levels_text}"
              f" × {seeds} seed(s); dense at one level), {stored} stored in {out} with the same settings, "
              f"{len(specs) - stored} to train{chosen}; nothing was run (--dry-run)")
        return
    # a sweep folder is resumed (its summaries rewritten from its records); summary-named files
    # in a folder without records are someone else's: replaced only with --force
    lock_output(out)  # one command at a time in --out (released when it ends)
    check_output_dir(out, produced=SWEEP_SUMMARIES, force=force, records="task", what="sweep")
    from rich.console import Console

    from ..experiments.sweep import plot, summary_markdown, sweep, write_csv
    from ..experiments.sweep_report import RANKWISE, equal_compression_markdown, versus_baselines_markdown
    from ._common import run_bars

    console = Console()
    count = [0]

    def describe(r: dict) -> str:
        count[0] += 1
        of = "" if select is not None else f"/{len(specs) - stored}"  # (--select adds its grid's runs)
        return (f"[{count[0]}{of}] {r['key']}: test acc {r['test_acc']:.4f}, "
                f"compression {r['compression']:.3f}")

    with run_bars(console, describe, lambda step, steps, info: f"step {step}/{steps} {info}") as (
            on_progress, done):
        def run(batch: list) -> list[dict]:
            return sweep(batch, out, jobs=jobs, overwrite=force, on_done=done, on_progress=on_progress)

        choices = {}
        if select is not None:  # the configuration of each task and method, on seed 0 at --select
            import dataclasses

            from ..experiments._select import select as choose_on_validation

            groups = {(task, i): spec(task, i, {"tau": 0.0} if m == "dense" else {"target": select}, 0)
                      for task in task_list for i, (m, _) in enumerate(entries)}
            choices = choose_on_validation(
                groups, lr_grid, lambda s, family, rate: dataclasses.replace(s, optimizer=family, lr=rate),
                run, widen=widen)
            specs = [dataclasses.replace(s, optimizer=choices[(task, i)].optimizer, lr=choices[(task, i)].lr)
                     for s, (task, i, _, _) in zip(specs, plan, strict=True)]
        results = run(specs)
    if choices:
        from ..experiments._select import choices_markdown

        rows = [(task, groups[(task, i)].label, c) for (task, i), c in choices.items()]
        write_atomic(out / "selection.md", choices_markdown(rows, f"on validation, seed 0, target {select:g}")
                     .encode())
    write_csv(results, out / "runs.csv")
    table = summary_markdown(results)
    write_atomic(out / "summary.md", table.encode())
    equal = "dlrt" in method_list and target_list is None
    no_rows = None
    if equal:  # each method against DLRT's accuracy interpolated at its compression
        text = equal_compression_markdown(results)
        if text.count("\n") <= 2:  # (the header alone: say why instead of an empty table)
            no_rows = ("it interpolates DLRT's accuracy between its compressions at two --taus or more, and "
                       "this sweep has one" if len(tau_list) < 2 else
                       "--methods has no method besides dense and DLRT to compare with DLRT")
            text += f"\n*No rows: {no_rows}.*\n"
        write_atomic(out / "equal_compression.md", text.encode())
    versus = target_list is not None and bool(set(method_list) & set(RANKWISE)) and bool(
        {m for m in method_list if REGISTRY[m].baseline and m != "dense"})
    if versus:
        write_atomic(out / "versus_baselines.md", versus_baselines_markdown(results).encode())
    pngs = plot(results, out)
    # an earlier call's tables that this one does not rewrite would describe other runs: they go
    # (the folder is this sweep's, or --force said its outputs may be replaced)
    written = {"equal_compression.md": equal,
               "selection.md": bool(choices), "versus_baselines.md": bool(versus)}
    for name, wrote in written.items():
        if not wrote and (out / name).is_file():
            (out / name).unlink()
    print_whole(console, table)
    if no_rows is not None:
        console.print(f"equal_compression.md has no rows: {no_rows}", highlight=False)
    trained = f"{count[0]} trained by this call" + (", the selection grid's included" if choices else "")
    console.print(f"{len(results)} runs in the tables ({trained}); wrote {out}/runs.csv, summary.md"
                  + "".join(f", {name}" for name, wrote in written.items() if wrote)
                  + f" and {', '.join(p.name for p in pngs)}")
