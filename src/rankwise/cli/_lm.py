"""``rankwise lm``: a small GPT trained from scratch on BBC News bytes, dense AdamW against
DLRT / SDLRT, a fixed factorisation and GaLore."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .._fields import help_of, options_named
from .._io import write_atomic
from ..experiments.lm._lm_spec import DENSE, METHODS
from ..experiments.lm._lm_spec import LmRunSpec as Spec
from ..methods import REGISTRY
from ._common import (
    Jobs,
    UserError,
    check_output_dir,
    check_range,
    config_option,
    given,
    lock_output,
    print_whole,
    refuse_unused,
    run_bars,
)

DEFAULT = METHODS[:5]  # the variants (update_every, ablations) only when asked for
LM_OUTPUTS = (r"summary\.md", r"rates\.md", r"lm_curves\.png")


def _floats(option: str, text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{option} must be comma-separated numbers; got {text!r}") from None
    if not values:
        raise UserError(f"{option} is empty")
    if len(set(values)) != len(values):
        raise UserError(f"{option} names a value twice: {text!r}")
    return values


def lm_cmd(
    ctx: typer.Context,
    methods: Annotated[str, typer.Option(help=f"Comma-separated, from: {', '.join(METHODS)}.",
                                         show_default=", ".join(DEFAULT))] = ",".join(DEFAULT),
    compressions: Annotated[str, typer.Option(help="Compressions of the projections' parameters for the "
                                              "low-rank methods, in (0, 1).")] = "0.5,0.75",
    seeds: Annotated[int, typer.Option(help="Seeds per configuration.", min=1)] = 2,
    grid: Annotated[str, typer.Option(help="Learning rates to choose from on validation (seed 0), "
                                      "comma-separated; a choice at an edge widens it.")]
    = "0.001,0.003,0.01",
    widen: Annotated[int, typer.Option(help="How often the grid may grow at an edge.", min=0, max=5)] = 1,
    select_at: Annotated[float | None, typer.Option(help="Choose the low-rank methods' rates at this one "
                                                     "compression and reuse them at the others "
                                                     "(default: choose at each).")] = None,
    steps: Annotated[int, config_option(Spec, "steps", min=1)] = Spec.steps,
    batch: Annotated[int, typer.Option("--batch-size", help=help_of(Spec, "batch"), min=1)] = Spec.batch,
    batch_alias: Annotated[int | None, typer.Option("--batch", hidden=True, min=1,
                                                    help="= --batch-size (its old name).")] = None,
    context: Annotated[int, config_option(Spec, "context", min=8, max=1024)] = Spec.context,
    width: Annotated[int, config_option(Spec, "width", min=8)] = Spec.width,
    depth: Annotated[int, config_option(Spec, "depth", min=1)] = Spec.depth,
    heads: Annotated[int, config_option(Spec, "heads", min=1)] = Spec.heads,
    final_windows: Annotated[int, config_option(Spec, "final_windows", min=0)] = Spec.final_windows,
    schedule: Annotated[str, config_option(Spec, "schedule")] = Spec.schedule,
    warmup: Annotated[float, config_option(Spec, "warmup")] = Spec.warmup,
    final_lr: Annotated[float, config_option(Spec, "final_lr")] = Spec.final_lr,
    clip: Annotated[float, config_option(Spec, "clip")] = Spec.clip,
    warm: Annotated[float, config_option(Spec, "warm")] = Spec.warm,
    model: Annotated[str, config_option(Spec, "model")] = Spec.model,
    jobs: Jobs = 1,
    out: Annotated[Path, typer.Option(help="Run folder: runs/*.json, summary.md, lm_curves.png.")]
    = Path("runs/lm"),
    force: Annotated[bool, typer.Option("--force", help="Rerun and replace stored runs whose settings differ "
                                        "(default: refuse).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check the arguments, print the plan and exit "
                                          "without running or writing anything.")] = False,
) -> None:
    """Train a small GPT (or, with --model llama, a LLaMA-style decoder) on BBC News bytes with
    each method at equal steps and tokens; each method's learning rate chosen on validation;
    resumable; writes summary.md and lm_curves.png."""
    from ._sweep import _split

    if batch_alias is not None:  # --batch: the old name of --batch-size (train's)
        if given(ctx, "batch"):
            raise UserError("--batch is the old name of --batch-size: give one of them")
        batch = batch_alias
    method_list = _split(methods, METHODS, "--methods")
    comps = _floats("--compressions", compressions)
    for c in comps:
        check_range("--compressions", c, 0, 1, lo_open=True)
    if select_at is not None and select_at not in comps:
        raise UserError(f"--select-at {select_at:g} is not one of --compressions {compressions}")
    lrs = _floats("--grid", grid)
    for lr in lrs:
        check_range("--grid", lr, 0, 1e3, lo_open=True)  # (finite: inf is not a rate)
    if width % heads:
        raise UserError(f"--heads {heads} must divide --width {width}")
    fixed = dict(steps=steps, batch=batch, context=context, width=width, depth=depth, heads=heads,
                 final_windows=final_windows, schedule=schedule, warmup=warmup, final_lr=final_lr, clip=clip,
                 warm=warm, model=model)
    try:  # every method's run spec, checked as the study will build it; its messages name the options
        for m in method_list:
            Spec(m, 0.0 if m in DENSE else comps[0], lr=lrs[0], **fixed)
    except ValueError as e:
        raise UserError(options_named(str(e), Spec, only=fixed, said={"batch": "--batch-size"})) from None
    if schedule == "constant":
        refuse_unused(ctx, {"warmup": "--schedule constant has no warm-up",
                            "final_lr": "--schedule constant keeps the rate (no decay to end at)"})
    if not any(getattr(REGISTRY.get(m), "warm", False) for m in method_list):
        refuse_unused(ctx, {"warm": "it is the dense share of the *-warm methods, and --methods names none"})
    if dry_run:
        low = [m for m in method_list if m not in DENSE]
        runs = (len(method_list) - len(low) + len(low) * len(comps)) * seeds
        print(f"plan: {runs} runs ({len(method_list)} method(s), the low-rank ones at {len(comps)} "
              f"compression(s), × {seeds} seed(s)) after choosing each rate on seed 0 from {len(lrs)} rates "
              f"(more if a choice widens the grid), into {out}; runs stored there with the same settings "
              "are skipped; nothing was run (--dry-run)")
        return
    lock_output(out)  # one command at a time in --out (released when it ends)
    check_output_dir(out, produced=LM_OUTPUTS, force=force, records="context",
                     what="language-model comparison")
    if "galore" in method_list:
        try:
            import galore_torch  # noqa: F401
        except ImportError as e:
            raise UserError(f"--methods galore needs galore-torch (the rankwise[lm] extra; make installs "
                            f"it): {e}", 1) from None
    from rich.console import Console

    from ..experiments.lm.lm_compare import plot, rates_markdown, study, summary_markdown

    console = Console()
    line = (lambda r: f"{r['key']}: val {r['val_bits']:.3f} bits, test {r['test_bits']:.3f}, "  # noqa: E731
            f"{r['step_seconds']:.3f} s/step, {r['memory']['total'] / 1e6:.2f} MB")
    with run_bars(console, line) as (on_progress, done):
        result = study(method_list, comps, seeds, out, grid=lrs, widen=widen, select_at=select_at, jobs=jobs,
                       overwrite=force, on_done=done, on_progress=on_progress, **fixed)
    table = summary_markdown(result.records, result.chosen, select_at)
    write_atomic(out / "summary.md", table.encode())
    write_atomic(out / "rates.md", rates_markdown(result.records, result.chosen).encode())
    png = plot(result.records, result.chosen, out)
    print_whole(console, table)
    console.print(f"{len(result.records)} runs; wrote {out}/summary.md, {out}/rates.md and {png}")
