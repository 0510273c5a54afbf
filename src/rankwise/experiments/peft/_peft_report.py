"""The tables and the plot of ``rankwise peft``, from run records (no torch)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from ...methods import REGISTRY
from .._select import Choice
from ._peft_spec import METHODS, SETTINGS, PeftRunSpec

_PER_RUN = ("method", "setting", "seed", "optimizer", "lr", "steps")  # what varies within one study
Group = tuple[str, int, str]  # (setting, steps, method)


def study_records(out: Path, like: PeftRunSpec) -> list[dict]:
    """Every record in ``out/runs/`` of the study `like` belongs to: same batch, sequence
    length, rank, τ and protocol version, any method, setting, seed, optimizer, learning rate
    and steps (so that a study run by several commands, e.g. other seed counts per setting,
    has one table). Unreadable files are left out."""
    shared = {k: v for k, v in like.__dict__.items() if k not in _PER_RUN}
    records = []
    for p in sorted((out / "runs").glob("*.json")):
        try:
            rec = json.loads(p.read_text())
            spec = rec["spec"]
            if all(spec.get(k, 1 if k == "version" else None) == v for k, v in shared.items()):
                records.append(rec)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return records


def _config(rec: dict) -> tuple[str, float]:
    return rec["spec"].get("optimizer", "adam"), rec["spec"]["lr"]


def best_by_validation(results: list[dict], choices: Mapping[str, Choice] | None = None
                       ) -> dict[Group, list[dict]]:
    """Per (setting, steps, method): the runs at the method's chosen configuration (`choices`:
    method -> :class:`._select.Choice`), or, for a method without a choice, at the
    (optimizer, learning rate) with the best mean validation accuracy."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        s = r["spec"]
        groups.setdefault((s["setting"], s["steps"], s["method"], _config(r)), []).append(r)
    best: dict[Group, tuple[float, list[dict]]] = {}
    for (setting, steps, method, config), rs in groups.items():
        key = (setting, steps, method)
        if choices and method in choices:
            if config == (choices[method].optimizer, choices[method].lr):
                best[key] = (math.inf, rs)
            continue
        v = float(np.mean([r["val_acc"] for r in rs]))
        if key not in best or v > best[key][0]:
            best[key] = (v, rs)
    return {k: rs for k, (_, rs) in best.items()}


def _ordered(best: dict[Group, list[dict]]) -> Iterator[tuple[str, int, str, list[dict]]]:
    for setting in SETTINGS:
        for steps in sorted({k[1] for k in best if k[0] == setting}):
            for method in METHODS:
                if (setting, steps, method) in best:
                    yield setting, steps, method, best[(setting, steps, method)]


def summary_markdown(results: list[dict], choices: Mapping[str, Choice] | None = None,
                     select: str | None = None) -> str:
    """Per (setting, steps, method), at the method's chosen configuration (or the best mean
    validation accuracy of those run, without a choice): the configuration and whether it sat
    at an edge of the grid, validation and test accuracy (mean ± std over seeds), the most
    trainable parameters held at any step (:func:`rankwise.peft.trainable_parameters`: U, S,
    V and SDLRT's buffer counted), the final ranks, the step time relative to LoRA's and the
    peak memory growth."""
    from .._stats import mean_std

    best = best_by_validation(results, choices)
    lines = ["| setting | steps | method | optimizer, lr | chosen | at grid edge | seeds | val acc | "
             "test acc | trainable params (most) | ranks (min–max) | step / LoRA step | "
             "peak RSS growth (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for setting, steps, method, rs in _ordered(best):
        lora = best.get((setting, steps, "lora"))
        lora_t = float(np.mean([r["step_seconds"] for r in lora])) if lora else math.nan
        ranks = [v for r in rs for v in r["ranks"].values()]
        t = float(np.mean([r["step_seconds"] for r in rs]))
        family, lr = _config(rs[0])
        chosen = choices.get(method) if choices else None
        how = f"on val, {select} s0" if chosen else "best val of runs"
        edge = (chosen.at_edge or "no") if chosen else ""
        most = int(np.mean([r.get("trainable_params_max", r["trainable_params"]) for r in rs]))
        lines.append(f"| {setting} | {steps} | {method} | {family} {lr:g} | {how} | {edge} | {len(rs)} | "
                     f"{mean_std([r['val_acc'] for r in rs], '{:.3f}')} | "
                     f"{mean_std([r['test_acc'] for r in rs], '{:.3f}')} | {most:,} | "
                     f"{min(ranks) if ranks else ''}–{max(ranks) if ranks else ''} | {t / lora_t:.2f} | "
                     f"{np.mean([r['peak_rss_mib'] for r in rs]):.0f} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], out: Path, choices: Mapping[str, Choice] | None = None) -> Path:
    """``peft_acc.png``: test accuracy (mean ± std over seeds, each run a dot) per method at its
    chosen configuration (:func:`best_by_validation`), one panel per setting and step count."""
    import io

    from ..._extras import require

    matplotlib = require("matplotlib", "the plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..._io import write_atomic
    from ..._provenance import source_commit
    from .._stats import mean_sd

    best = best_by_validation(results, choices)
    panels = list(dict.fromkeys((s, n) for s, n, _, _ in _ordered(best)))
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(3.6 * max(len(panels), 1), 3.4), squeeze=False)
    for ax, (setting, steps) in zip(axes[0], panels, strict=False):
        rows = [(m, rs) for s, n, m, rs in _ordered(best) if (s, n) == (setting, steps)]
        for x, (method, rs) in enumerate(rows):
            accs = [r["test_acc"] for r in rs]
            m, sd = mean_sd(accs)
            color = "C0" if REGISTRY[method].baseline else "C1"  # rankwise's integrators in C1
            ax.errorbar([x], [m], yerr=[sd], fmt="o", color=color, capsize=3)
            ax.plot([x] * len(accs), accs, ".", color="0.6", ms=3)
        ax.set_xticks(range(len(rows)), [m for m, _ in rows], rotation=45, ha="right", fontsize=8)
        what = "full training split" if setting == "full" else f"{setting} training articles"
        ax.set_title(f"{what}, {steps} steps", fontsize=9)
        ax.set_ylabel("test accuracy")
    fig.text(0.01, 0.01, f"rankwise peft, {out.name}, commit {source_commit()}", fontsize=6, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    write_atomic(out / "peft_acc.png", buf.getvalue())
    return out / "peft_acc.png"
