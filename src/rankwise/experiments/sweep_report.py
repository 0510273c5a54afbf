"""Compare methods at equal final compression (not only equal τ) from sweep results."""

from __future__ import annotations

import statistics

import numpy as np

from ..methods import REGISTRY
from ._stats import mean_sd
from ._sweep_spec import level


def _curve(results: list[dict], task: str, method: str) -> list[tuple[float, float, float, float]]:
    """(τ or target, mean compression, mean test acc, std test acc) per τ (or per target, for
    runs with one), sorted by compression."""
    by: dict[float, list[dict]] = {}
    for r in results:
        s = r["spec"]
        if s["task"] == task and s["method"] == method:
            by.setdefault(level(s), []).append(r)
    pts = []
    for tau, rs in by.items():
        accs = [r["test_acc"] for r in rs]
        pts.append((tau, statistics.mean(r["compression"] for r in rs), statistics.mean(accs),
                    statistics.stdev(accs) if len(accs) > 1 else 0.0))
    return sorted(pts, key=lambda p: p[1])


def equal_compression_markdown(results: list[dict], reference: str = "dlrt") -> str:
    """For every (task, method, τ) point, the reference method's accuracy interpolated (linearly
    in compression) at the same final compression, and the difference. Points outside the
    reference's compression range are marked "outside"."""
    lines = [f"| task | method | τ | compression | test acc | {reference} acc at that compression | Δ acc |",
             "|---|---|---|---|---|---|---|"]
    tasks = sorted({r["spec"]["task"] for r in results})
    methods = sorted({r["spec"]["method"] for r in results} - {"dense", reference})
    for task in tasks:
        ref = _curve(results, task, reference)
        if len(ref) < 2:
            continue
        xs, ys = np.array([p[1] for p in ref]), np.array([p[2] for p in ref])
        for m in methods:
            for tau, c, a, sd in sorted(_curve(results, task, m)):
                if xs.min() <= c <= xs.max():
                    at = float(np.interp(c, xs, ys))
                    lines.append(f"| {task} | {m} | {tau:g} | {c:.3f} | {a:.4f} ± {sd:.4f} | {at:.4f} "
                                 f"| {a - at:+.4f} |")
                else:
                    lines.append(f"| {task} | {m} | {tau:g} | {c:.3f} | {a:.4f} ± {sd:.4f} | outside "
                                 f"[{xs.min():.3f}, {xs.max():.3f}] | |")
    return "\n".join(lines) + "\n"


RANKWISE: tuple[str, ...] = tuple(n for n, m in REGISTRY.items() if not m.baseline)
"""The rank-adaptive methods (every variant: ``dlrt-muon-reset`` too); the other methods with a
target (fixed, dense-svd) are baselines."""


def versus_baselines_markdown(results: list[dict]) -> str:
    """Per task and compression target: the rankwise variant (any allocation) and the baseline
    with the best mean *validation* accuracy, their test accuracies (mean ± sample std over
    seeds) and whether the rankwise one is ahead, and by more than one std (the larger of the
    two). Test accuracy decides nothing here: it is only reported for what validation chose."""
    groups: dict[tuple[str, float, str], list[dict]] = {}
    for r in results:
        s = r["spec"]
        if s["method"] != "dense" and s.get("target") is not None:
            groups.setdefault((s["task"], s["target"], r["label"]), []).append(r)

    lines = ["| task | target | rankwise (best val) | test acc | baseline (best val) | test acc | Δ test | "
             "ahead | by > 1 std |", "|---|---|---|---|---|---|---|---|---|"]
    for task, target in sorted({(t, g) for t, g, _ in groups}):
        picks = []
        for side in (True, False):
            cands = {lab: rs for (t, g, lab), rs in groups.items() if t == task and g == target
                     and (rs[0]["spec"]["method"] in RANKWISE) == side}
            if not cands:
                break
            lab = max(cands, key=lambda k: mean_sd([r["val_acc"] for r in cands[k]])[0])
            picks.append((lab, *mean_sd([r["test_acc"] for r in cands[lab]])))
        if len(picks) < 2:
            continue
        (a, ma, sa), (b, mb, sb) = picks
        d = ma - mb
        lines.append(f"| {task} | {target:g} | {a} | {ma:.4f} ± {sa:.4f} | {b} | {mb:.4f} ± {sb:.4f} | "
                     f"{d:+.4f} | {'yes' if d > 0 else 'no'} | {'yes' if d > max(sa, sb) else 'no'} |")
    return "\n".join(lines) + "\n"
