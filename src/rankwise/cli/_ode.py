"""``rankwise ode``: the matrix-memory ODE classifiers under fixed, adaptive, replay-aware and
memory-budget control, and the stored-graph baseline."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from .._fields import options_named
from .._io import write_atomic
from ..experiments._ode_spec import OdeRunConfig as Spec
from ._common import (
    Force,
    Jobs,
    UserError,
    claim_output_dir,
    config_option,
    lock_output,
    no_repeats,
    print_whole,
    refuse_unused,
)

_COLUMNS = (("test_acc", "test acc", "{:.3f}"), ("mean_rank", "mean rank", "{:.2f}"),
            ("mean_checkpoints", "checkpoints", "{:.1f}"), ("peak_mib", "peak MiB", "{:.2f}"),
            ("mean_recomputed", "recomputed/iter", "{:.1f}"),
            ("max_delta", "max δ", "{:.1e}"), ("grad_cosine", "grad cosine", "{:.5f}"),
            ("mean_replays", "replays/iter", "{:.2f}"), ("loss_var_2nd_half", "loss var", "{:.3f}"),
            ("loss_spikes", "loss spikes", "{:.1f}"), ("seconds", "s/run", "{:.0f}"))
ODE_OUTPUTS = (r"results\.json", r"traces\.csv", r"ode_traces\.png")  # regexes


_ENTRY = re.compile(r"(fixed|adaptive|replay|budget|autograd|gru)(?::(\d+)(?:-(\d+))?)?(?::r(\d+))?")


def _parse_grid(grid: str) -> list[tuple[str, int, int | None, int | None]]:
    """``controller[:C[-CMAX]][:rR]`` entries -> (controller, C, C_max or None, rank or None);
    C defaults to 8; for ``budget`` it is the budget in states (default 12), for ``gru`` the
    hidden size (default 128)."""
    out = []
    for item in grid.split(","):
        entry = item.strip()
        m = _ENTRY.fullmatch(entry)
        if m is None:
            what = "an empty entry" if not entry else repr(entry)
            raise UserError(f"--grid entries are controller[:C[-CMAX]][:rR] with controller fixed, "
                            f"adaptive, replay, budget (budget:STATES), autograd or gru (gru:HIDDEN), e.g. "
                            f"fixed:8,adaptive:8-16:r4,budget:12; got {what} in {grid!r}")
        kind, c, cmax, r = m.groups()
        if kind in ("fixed", "budget", "autograd", "gru") and cmax is not None:
            raise UserError(f"--grid entry {entry!r}: a {kind} controller has no CMAX")
        if kind == "autograd" and c is not None:
            raise UserError(f"--grid entry {entry!r}: autograd takes no C (use autograd or autograd:rR)")
        if kind == "gru" and r is not None:
            raise UserError(f"--grid entry {entry!r}: the GRU has no rank (gru:HIDDEN)")
        size = {"gru": "HIDDEN", "budget": "STATES"}.get(kind, "C")
        for value, name in ((c, size), (cmax, "CMAX"), (r, "rank R")):
            if value is not None and int(value) < 1:
                raise UserError(f"--grid entry {entry!r}: {name} must be >= 1; got {value}")
        out.append((kind, int(c) if c else 12 if kind == "budget" else 128 if kind == "gru" else 8,
                    None if cmax is None else int(cmax),
                    None if r is None else int(r)))
    no_repeats([x.strip() for x in grid.split(",")], grid, "--grid", keys=out)
    return out


# the OdeRunConfig fields this command sets, and how its messages name those set through --grid
_EXPOSED = ("c", "c_max", "rank", "max_rank", "budget_in", "recurrence", "validation", "depth_steps",
            "layers", "epochs", "data", "model")
_SAID = {"c": "C in --grid", "c_max": "--c-max (or -CMAX in --grid)", "rank": "--rank (or :rR in --grid)"}


def _run_one(cfg, report=None) -> dict:
    """One run, as a study record (``runs/<key>.json``): its settings under ``"spec"``."""
    import torch

    from ..experiments.ode_seq import run

    torch.set_num_threads(1)
    r = run(cfg) if report is None else run(cfg, callback=lambda i, n, loss: report(i, n, f"loss {loss:.3f}"))
    return dict(r, spec=r["config"])


def _key(cfg) -> str:
    """A run's record name: data, model, controller settings and seed, e.g.
    ``digits_gated_adaptive_C8-32_r8-32_s0``."""
    name = cfg.name.replace("→", "-").replace("=", "")
    return "_".join([cfg.data, cfg.model, *re.sub(r"[^A-Za-z0-9.-]+", " ", name).split(), f"s{cfg.seed}"])


def ode_cmd(
    ctx: typer.Context,
    data: Annotated[str, config_option(Spec, "data")] = Spec.data,
    grid: Annotated[str, typer.Option(help="Comma-separated entries: fixed:C, adaptive:C or adaptive:C-CMAX, "
                                      "replay:C or replay:C-CMAX (C: checkpoint spacing), budget:STATES, "
                                      "autograd (the stored-graph baseline), gru:HIDDEN (torch.nn.GRU, same "
                                      "training); :rR after an entry sets its rank R.")]
    = "fixed:8,adaptive:8",
    model: Annotated[str, config_option(Spec, "model")] = Spec.model,
    rank: Annotated[int, config_option(Spec, "rank", min=1)] = Spec.rank,
    max_rank: Annotated[int, config_option(Spec, "max_rank", min=1)] = Spec.max_rank,
    c_max: Annotated[int, config_option(Spec, "c_max", min=1)] = Spec.c_max,
    layers: Annotated[int, config_option(Spec, "layers", min=1)] = Spec.layers,
    depth_steps: Annotated[int, config_option(Spec, "depth_steps", min=1)] = Spec.depth_steps,
    epochs: Annotated[int, config_option(Spec, "epochs", min=1)] = Spec.epochs,
    seeds: Annotated[int, typer.Option(help="Seeds per configuration.", min=1)] = 1,
    causal: Annotated[bool, config_option(Spec, "causal")] = Spec.causal,
    recurrence: Annotated[str, config_option(Spec, "recurrence")] = Spec.recurrence,
    budget_in: Annotated[str, config_option(Spec, "budget_in")] = Spec.budget_in,
    validation: Annotated[float, config_option(Spec, "validation")] = Spec.validation,
    jobs: Jobs = 1,
    out: Annotated[Path, typer.Option(help="Folder for runs/*.json (one record per run: a run stored there "
                                      "with the same settings is reused, not rerun), results.json, "
                                      "traces.csv and ode_traces.png.")] = Path("runs/ode"),
    force: Force = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check the arguments, print the plan (how many "
                                          "runs) and exit without running or writing anything.")] = False,
) -> None:
    """The reversible low-rank ODE experiment: checkpoint/rank controllers compared.

    Trains the matrix-memory ODE classifier for each grid entry and seed, prints one table
    (mean ± std over seeds) and writes results, per-iteration traces and a δ/rank plot to
    --out."""
    entries = _parse_grid(grid)
    if model == "layered" and (recurrence != "kron" or not causal):
        given = "--recurrence " + recurrence if recurrence != "kron" else "--no-causal"
        raise UserError(f"{given} applies to the gated model; --model layered has no gates (leave it out)")
    try:  # (OdeRunConfig checks every setting; its messages name the options)
        cfgs = [Spec(data=data, model=model, controller=k, c=8 if k in ("budget", "gru") else c,
                             budget_states=c if k == "budget" else 12, gru_hidden=c if k == "gru" else 128,
                             c_max=c_max if cm is None else cm,
                             rank=rank if r is None else r, max_rank=max_rank, layers=layers,
                             depth_steps=depth_steps, epochs=epochs, seed=s, causal=causal,
                             budget_in=budget_in, recurrence=recurrence, validation=validation)
                for k, c, cm, r in entries for s in range(seeds)]
    except ValueError as e:  # name the options, not the dataclass fields
        raise UserError(options_named(str(e), Spec, said=_SAID, only=_EXPOSED)) from e
    keys = [_key(c) for c in cfgs]
    if len(set(keys)) != len(keys):
        raise UserError(f"--grid names a run twice ({grid}): each would train the same runs")
    kinds = {k for k, _, _, _ in entries}
    if model != "layered":
        refuse_unused(ctx, {n: f"it shapes --model layered, not the {model} model"
                            for n in ("layers", "depth_steps")})
    if "budget" not in kinds:
        refuse_unused(ctx, {"budget_in": "it is how a budget:STATES entry counts, and --grid has none"})
    if not kinds & {"adaptive", "replay"}:
        refuse_unused(ctx, {n: "it caps the adaptive and replay controllers, and --grid has neither"
                            for n in ("c_max", "max_rank")})
    from ..experiments._resume import stored_count

    stored = stored_count(cfgs, out / "runs", key=_key)
    if dry_run:
        print(f"plan: {len(cfgs)} runs ({len(entries)} --grid entries × {seeds} seed(s)), {stored} stored in "
              f"{out} with the same settings, {len(cfgs) - stored} to train; nothing was run (--dry-run)")
        return
    # a folder of this command's run records is resumed, its summaries rewritten from them;
    # summary-named files without such records are someone else's: replaced only with --force
    lock_output(out)  # one command at a time in --out; a refused first run leaves no folder
    claim_output_dir(out, produced=ODE_OUTPUTS, force=force, records="controller",
                     what="ode experiment")

    from rich.table import Table

    from ..experiments._resume import run_resumable
    from ..experiments._stats import mean_std
    from ..experiments.ode_seq import plot_traces
    from ._common import run_bars

    scored = ("val_acc", "val acc") if validation else ("test_acc", "test acc")
    columns = ((*scored, "{:.3f}"), *_COLUMNS[1:])
    console = Console()

    count = [0]

    def describe(r: dict) -> str:
        count[0] += 1
        return (f"[{count[0]}/{len(cfgs) - stored}] {r['name']} s{r['config']['seed']}: {scored[1]} "
                f"{r[scored[0]]:.3f}")

    def form(it: int, total: int, info: str) -> str:
        return f"it {it}/{total} {info}"

    with run_bars(console, describe, form) as (on_progress, done):
        results = run_resumable(cfgs, out / "runs", _run_one, key=_key, jobs=jobs, fresh_process=jobs > 1,
                                overwrite=force, on_progress=on_progress,
                                on_done=lambda r: done({**r, "key": _key(Spec(**r["spec"]))}),
                                hint="rerun with --force to replace them, or choose another --out")
    write_atomic(out / "results.json", json.dumps(results, indent=1).encode())
    rows = ["name,seed,it,loss,rank,checkpoints,max_delta,min_rho,tape_bytes,peak_bytes,recomputed,reloads"]
    for r in results:
        for t in r["trace"]:
            rho = "" if t["min_rho"] is None else f"{t['min_rho']:.3g}"  # (None: no reversal, the GRU)
            rows.append(f"{r['name']},{r['config']['seed']},{t['it']},{t['loss']:.6g},{t['rank']:.3g},"
                        f"{t['checkpoints']},{t['max_delta']:.3g},{rho},{t['tape_bytes']},{t['peak_bytes']},"
                        f"{t['recomputed']},{t['reloads']}")
    write_atomic(out / "traces.csv", ("\n".join(rows) + "\n").encode())
    what = f"{layers} layers" if model == "layered" else "gated"
    plot_traces(results, out / "ode_traces.png", title=f"{data}: {what}, {epochs} epoch(s)")

    held = f", validation {validation:g} of train" if validation else ""
    table = Table(title=f"matrix-memory ODE ({what}) on {data}{held}: {epochs} epoch(s), {seeds} seed(s)")
    table.add_column("run")
    for _, head, _ in columns:
        table.add_column(head)
    for name in dict.fromkeys(r["name"] for r in results):
        rs = [r for r in results if r["name"] == name]
        table.add_row(name, *(mean_std([r[key] for r in rs], fmt) for key, _, fmt in columns))
    print_whole(console, table)
    console.print(f"wrote {out}/results.json, traces.csv, ode_traces.png")
