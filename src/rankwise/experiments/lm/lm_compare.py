"""The language-model comparison behind ``rankwise lm``: a small GPT trained from scratch on
BBC News bytes, dense AdamW against DLRT / SDLRT, a fixed factorisation and GaLore.

Every method trains the same model (:func:`rankwise.models.gpt`) on the same token windows
(drawn with the run's seed from the training articles) for the same number of steps; the
attention and MLP projections are what the low-rank methods compress (embeddings and norms
stay dense). Quality is validation and test loss in bits per token (a token is a byte of
UTF-8 text or the separator after an article), memory is counted from the tensors
(:func:`rankwise.training_memory`) and the peak resident memory of the run's process is
measured.

Methods (``compression`` c is of the projections' parameters; the names are
:mod:`rankwise.methods`'):

- ``dense``: ``torch.optim.AdamW``.
- ``dlrt`` / ``sdlrt``: DLRT / SDLRT with the Adam rule, every projection starting at the rank
  r with r(m + n) + r² ≈ (1 − c)·m·n, the ranks then allocated model-wide by a
  :class:`rankwise.Budget` holding (1 − c) of the projections' parameters (SDLRT's buffer
  counted in it; a budget sets the ranks itself, so SDLRT has no τ feedback here).
- ``dlrt-ue5``, ``dlrt-ue20``: ``dlrt`` augmenting every 5th / 20th step (``update_every``;
  the steps between move the cores S and the dense parameters only).
- ablations of ``dlrt``: ``dlrt-fixedrank`` (the start ranks kept: no budget,
  ``adaptive=False``), ``dlrt-uniform`` (the budget allocated uniformly), ``dlrt-reset`` (the
  rule's moments start afresh at every truncation instead of being rotated), ``dlrt-warm`` and
  ``fixed-warm`` (dense AdamW for the first `warm` share of the steps, then the SVD of the
  trained weights at the start ranks, trained on by ``dlrt`` / ``fixed``), ``dlrt-core3`` and
  ``dlrt-core0.3`` (the core's rate 3× / 0.3× the bases', ``core_lr_ratio``);
  ``dlrt-reset-m`` / ``dlrt-reset-v`` (only the first / second moments restart),
  ``dlrt-reset-ue5`` / ``dlrt-reset-ue20`` (``dlrt-reset`` augmenting every 5th / 20th step),
  ``dlrt-muon`` / ``dlrt-muon-reset`` (the :class:`rankwise.Muon` rule on the factors, its
  momentum rotated / restarted; AdamW on the rest).
- ``fixed``: the same factorisation at rank r, U, S and V trained by AdamW.
- ``galore``: ``galore_torch.GaLoreAdamW`` on the dense model, the projections' gradients
  projected to rank r (DLRT's starting rank at the same c, so that their optimizer states are
  about equal), projection refreshed every 200 steps, scale 0.25 (the paper's defaults).

Every method runs under the same learning-rate schedule (``cosine``: a linear warm-up over
`warmup` of the steps, then a cosine decay to `final_lr` × the rate; or ``constant``) and, with
`clip` > 0, the same gradient clipping (:func:`rankwise.clip_grad_norm_`: for DLRT and SDLRT the
norm of what the integrator reads). The training memory is counted after every backward (with
the step's gradients) and after every step, and the largest count kept.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...methods import REGISTRY
from ...train import Callback, DenseWarmStart, Loop, fit
from ._lm_spec import ABLATIONS as ABLATIONS
from ._lm_spec import ADAM, DENSE, GRID, LmRunSpec
from ._lm_spec import LOWRANK as LOWRANK
from ._lm_spec import METHODS as METHODS
from ._lm_spec import SCHEDULES as SCHEDULES
from ._lm_spec import VERSION as VERSION


def rank_for(m: int, n: int, compression: float) -> int:
    """The rank r ≥ 1 whose factors U (m, r), S (r, r), V (n, r) hold at most (1 − c)·m·n
    parameters: the largest r with r² + r(m + n) ≤ (1 − c)·m·n."""
    keep = (1 - compression) * m * n
    r = int((-(m + n) + math.sqrt((m + n) ** 2 + 4 * keep)) / 2)
    return max(1, r)


def projections(model: nn.Module) -> dict[str, nn.Linear]:
    """The attention (q, k, v, o) and MLP (GPT: fc, proj; LLaMA: gate, up, down) projections, by
    name (a LLaMA's untied output head is left dense, as the GPT's tied one is)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "head"}


def build(spec: LmRunSpec) -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    """The model and optimizer of a run, and facts about them (start ranks, budget). The
    ``*-warm`` methods start dense (AdamW); :func:`switch` factorises them later."""
    from rankwise.models import gpt, llama

    torch.manual_seed(spec.seed)
    make = llama if spec.model == "llama" else gpt
    model = make(context=spec.context, width=spec.width, depth=spec.depth, heads=spec.heads)
    proj = projections(model)
    info: dict = {"projection_params": sum(m.weight.numel() for m in proj.values())}
    if spec.method == "dense":
        return model, torch.optim.AdamW(model.parameters(), lr=spec.lr, **ADAM), info
    if spec.method == "muon":
        return model, MuonAdamW(model, proj, spec.lr), info
    ranks = {n: rank_for(m.out_features, m.in_features, spec.compression) for n, m in proj.items()}
    info["start_ranks"] = ranks
    if spec.method == "galore":
        from galore_torch import GaLoreAdamW

        ids = {id(m.weight) for m in proj.values()}
        groups: list[dict] = [{"params": [p for p in model.parameters() if id(p) not in ids]}]
        for r in sorted(set(ranks.values())):  # each projection at DLRT's start rank
            groups.append({"params": [proj[n].weight for n, k in ranks.items() if k == r], "rank": r,
                           "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"})
        info["galore_ranks"] = ranks
        return model, GaLoreAdamW(groups, lr=spec.lr, **ADAM), info
    if spec.method == "cola":  # B·σ(A·x) at the rank whose two factors hold (1 − c)·m·n
        ranks = {n: max(1, int((1 - spec.compression) * m.out_features * m.in_features
                               / (m.out_features + m.in_features))) for n, m in proj.items()}
        info["cola_ranks"] = ranks
        for n, m in proj.items():
            model.set_submodule(n, CoLALinear(m.in_features, m.out_features, ranks[n],
                                              bias=m.bias is not None))
        return model, torch.optim.AdamW(model.parameters(), lr=spec.lr, **ADAM), info
    if REGISTRY[spec.method].warm:
        return model, torch.optim.AdamW(model.parameters(), lr=spec.lr, **ADAM), info
    return model, factorise(model, spec, ranks, info), info


class CoLALinear(nn.Module):
    """CoLA's projection (Liu et al., 2025, "CoLA: Compute-efficient pre-training of LLMs via
    low-rank activation"): ``y = B·σ(A·x)`` with A (r × in), B (out × r), σ = SiLU; two
    ``nn.Linear`` s with their default initialisation (the bias, if any, on B)."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False) -> None:
        super().__init__()
        self.A = nn.Linear(in_features, rank, bias=False)
        self.B = nn.Linear(rank, out_features, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.B(F.silu(self.A(x)))


def factorise(model: nn.Module, spec: LmRunSpec, ranks: dict[str, int], info: dict) -> torch.optim.Optimizer:
    """Replace every projection by its truncated SVD at its start rank (in place) and return
    the method's optimizer for the factored model."""
    import rankwise

    rankwise.to_low_rank(model, rank=ranks)  # every projection at its own start rank
    return optimizer_for(model, spec, info)


def optimizer_for(model: nn.Module, spec: LmRunSpec, info: dict) -> torch.optim.Optimizer:
    """The method's optimizer for the factored `model`: AdamW for the fixed factorisations, else
    the method's integrator (:mod:`rankwise.methods`) with the Adam rule and a budget holding the
    parameters of the starting ranks (SDLRT's buffer counted in it)."""
    import rankwise
    from rankwise import methods

    if REGISTRY[spec.method].baseline:  # fixed, fixed-warm
        return torch.optim.AdamW(model.parameters(), lr=spec.lr, **ADAM)
    lowrank = [m for m in model.modules() if isinstance(m, rankwise.LowRankLinear)]
    params = sum(m.rank * (m.out_features + m.in_features) + m.rank**2 for m in lowrank)
    budget = rankwise.Budget(params=params, ramp_steps=0, count_buffer=REGISTRY[spec.method].buffer)
    info["budget_params"] = params
    return methods.build(spec.method, model, spec.lr, budget, rule=rankwise.Adam(eps=ADAM["eps"]))


def _bits(model: nn.Module, x: Tensor, y: Tensor, batch: int = 32) -> float:
    """Mean next-token cross-entropy over the windows ``x``, ``y`` (n, T), in bits."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            logits = model(x[i:i + batch])
            total += float(F.cross_entropy(logits.flatten(0, 1), y[i:i + batch].flatten(), reduction="sum"))
            count += y[i:i + batch].numel()
    model.train()
    return total / count / math.log(2)


class MuonAdamW(torch.optim.Optimizer):
    """The ``muon`` baseline: ``torch.optim.Muon`` (orthogonalised Nesterov momentum, its rate
    matched to AdamW's update RMS, no weight decay, as every method here) on the 2-D weights of
    the projections `proj`, AdamW (:data:`ADAM`) on every other parameter; one optimizer to the
    loop, whose param groups are the two optimizers' (so the schedule reaches both)."""

    def __init__(self, model: nn.Module, proj: dict[str, nn.Linear], lr: float) -> None:
        matrices = [m.weight for m in proj.values()]
        ids = {id(p) for p in matrices}
        rest = [p for p in model.parameters() if id(p) not in ids]
        super().__init__(list(model.parameters()), {"lr": lr})
        self.muon = torch.optim.Muon(matrices, lr=lr, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(rest, lr=lr, **ADAM)
        self.param_groups = self.muon.param_groups + self.adamw.param_groups
        self.state = collections.ChainMap(self.muon.state, self.adamw.state)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss


class _Schedule(Callback):
    """Sets every param group's rate to ``lr × spec.lr_factor(step)`` before each step (on
    whichever optimizer the loop holds: the warm methods switch)."""

    def __init__(self, spec: LmRunSpec) -> None:
        self.spec = spec

    def _set(self, loop: Loop) -> None:
        for g in loop.optimizer.param_groups:
            g["lr"] = self.spec.lr * self.spec.lr_factor(loop.global_step)

    def on_fit_start(self, loop: Loop) -> None:
        self._set(loop)

    def on_step_end(self, loop: Loop) -> None:
        self._set(loop)


class _Curve(Callback):
    """Validation bits every `every` steps (on a fixed subset of windows), step times,
    training losses, and the largest training-memory count seen after a step."""

    def __init__(self, x: Tensor, y: Tensor, every: int, report=None) -> None:
        self.x, self.y, self.every, self.report = x, y, every, report
        self.curve: list[tuple[int, float]] = []
        self.losses: list[float] = []
        self.times: list[float] = []
        self.memory = None

    def count(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        """Keep the largest training-memory count."""
        import rankwise

        count = rankwise.training_memory(model, opt)
        if self.memory is None or count.total > self.memory.total:
            self.memory = count

    def on_after_backward(self, loop: Loop) -> None:
        """The count with the step's gradients (DLRT/SDLRT's factor gradients exist from the
        backward until their step clears them)."""
        self.count(loop.model, loop.optimizer)

    def on_step_end(self, loop: Loop) -> None:
        self.losses.append(loop.loss / math.log(2))
        self.times.append(loop.step_seconds)
        self.count(loop.model, loop.optimizer)
        step = loop.global_step
        if step % self.every == 0 or step == loop.max_steps:
            self.curve.append((step, _bits(loop.model, self.x, self.y)))
        if self.report is not None:
            self.report(step, loop.max_steps, f"loss {self.losses[-1]:.3f} bits")


def run_one(spec: LmRunSpec, report=None, keep: list | None = None) -> dict:
    """Train one run; returns its record (JSON-ready). `keep`: the trained model is appended."""
    from ...data._bytes import load_bbc_text, random_windows, sequential_windows

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    data = load_bbc_text()
    model, opt, info = build(spec)
    g = torch.Generator().manual_seed(spec.seed)
    x, y = random_windows(data.train, spec.steps * spec.batch, spec.context, g)
    vx, vy = sequential_windows(data.val, spec.context)
    pick = torch.randperm(len(vx), generator=torch.Generator().manual_seed(1234))[:spec.eval_windows]
    curve = _Curve(vx[pick], vy[pick], spec.eval_every, report)

    held = [opt]  # the optimizer now (the warm methods switch)

    def switched(new: torch.optim.Optimizer) -> torch.optim.Optimizer:
        held.append(new)
        return new

    callbacks: list[Callback] = []
    if REGISTRY[spec.method].warm:  # dense steps, then the projections factored at their start ranks
        callbacks.append(DenseWarmStart(round(spec.warm * spec.steps), rank=info["start_ranks"],
                                        optimizer=lambda m: switched(optimizer_for(m, spec, info))))
    callbacks += [_Schedule(spec), curve]
    t0 = time.perf_counter()
    failed = None
    try:
        fit(model, opt, x, y, epochs=1, batch_size=spec.batch, max_steps=spec.steps, shuffle=None,
            loss_fn=lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()), callbacks=callbacks,
            clip_grad_norm=spec.clip or None)
    except FloatingPointError as e:  # DLRT/SDLRT refuse a non-finite step: the rate diverged
        failed = str(e)
    seconds = time.perf_counter() - t0
    tx, ty = sequential_windows(data.test, spec.context)
    if spec.final_windows:  # evenly spaced through each split (its articles are in class order)
        (vx, vy), (tx, ty) = spaced(vx, vy, spec.final_windows), spaced(tx, ty, spec.final_windows)
    import rankwise

    opt = held[-1]
    mem = curve.memory or rankwise.training_memory(model, opt)
    end = rankwise.training_memory(model, opt)
    ranks = {n: m.rank for n, m in model.named_modules() if isinstance(m, rankwise.LowRankLinear)}
    step_s = float(np.median(curve.times[1:] or curve.times)) if curve.times else float("nan")
    inf = float("inf")
    if keep is not None:
        keep.append(model)
    return dict(spec=asdict(spec), key=spec.key, val_bits=inf if failed else _finite(_bits(model, vx, vy)),
                test_bits=inf if failed else _finite(_bits(model, tx, ty)), failed=failed, curve=curve.curve,
                final_train_bits=float(np.mean(curve.losses[-20:])) if curve.losses else float("nan"),
                step_seconds=step_s,
                tokens_per_second=spec.batch * spec.context / step_s, train_seconds=seconds,
                memory=dict(weights=mem.weights, grads=mem.grads, optimizer=mem.optimizer,
                            lowrank_buffers=mem.lowrank_buffers, total=mem.total),
                memory_end=dict(weights=end.weights, optimizer=end.optimizer,
                                lowrank_buffers=end.lowrank_buffers, total=end.total),
                params=sum(p.numel() for p in model.parameters()), ranks=ranks, info=info,
                peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                peak_rss_growth_mib=(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024)


def spaced(x: Tensor, y: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """`k` windows (rows of x and y), evenly spaced from the first to the last; all if fewer."""
    i = torch.linspace(0, len(x) - 1, min(k, len(x))).round().long()
    return x[i], y[i]


def _finite(bits: float) -> float:
    """A diverged run's loss as +inf (never chosen, never NaN in a mean)."""
    return bits if math.isfinite(bits) else float("inf")


def _job(spec: LmRunSpec, report=None) -> dict:
    """One run in a worker process (one thread: runs go side by side)."""
    torch.set_num_threads(1)
    return run_one(spec, report)


def compare(specs: Sequence[LmRunSpec], out: Path, *, jobs: int = 1, overwrite: bool = False,
            fresh_process: bool = True, on_done: Callable[[dict], None] | None = None,
            on_progress: Callable[[str, int, int, str], None] | None = None) -> list[dict]:
    """Run every spec not already in ``out/runs/`` (resumable, each in a fresh process, so
    that the peak memory is the run's own); returns all records, in `specs` order."""
    from .._resume import run_resumable

    return run_resumable(list(specs), out / "runs", _job, jobs=jobs, overwrite=overwrite,
                         fresh_process=fresh_process,
                         hint="rerun with --force to replace them, or choose another --out",
                         on_done=on_done, on_progress=on_progress)


@dataclasses.dataclass(frozen=True)
class LmStudy:
    """What :func:`study` produced: every record of this call, and per (method, compression)
    the chosen learning rate and whether it sat at an edge of the grid after widening."""

    records: list[dict]
    chosen: dict[tuple[str, float], tuple[float, bool]]


def _widened(grid: list[float], best: float) -> float | None:
    """One more value beyond the edge `best` sits at (the grid's outer ratio), or None."""
    if len(grid) < 2 or best not in (grid[0], grid[-1]):
        return None
    return grid[0] ** 2 / grid[1] if best == grid[0] else grid[-1] ** 2 / grid[-2]


def study(methods: Sequence[str], compressions: Sequence[float], seeds: int, out: Path, *,
          grid: Sequence[float] = GRID, widen: int = 1, select_at: float | None = None, jobs: int = 1,
          overwrite: bool = False, fresh_process: bool = True,
          on_done: Callable[[dict], None] | None = None,
          on_progress: Callable[[str, int, int, str], None] | None = None, **fixed) -> LmStudy:
    """Every method (and, for the low-rank ones, every compression): the learning rate chosen
    on seed 0 by validation bits from `grid` (an edge choice widens the grid, up to `widen`
    times), then seeds 1.. at that rate. With `select_at` (one of `compressions`) a low-rank
    method's rate is chosen at that compression only and reused at the others (which then run
    seed 0 at that rate like any other seed). `fixed`: other :class:`LmRunSpec` fields (steps,
    width, ...). Resumable (``out/runs``)."""
    if select_at is not None and select_at not in compressions:
        raise ValueError(f"`select_at` {select_at!r} is not one of the compressions {list(compressions)}")
    pairs = [(m, 0.0) for m in methods if m in DENSE] + [(m, c) for m in methods if m not in DENSE
                                                            for c in compressions]
    source = {(m, c): (m, c if m in DENSE or select_at is None else select_at) for m, c in pairs}
    selected = [p for p in pairs if source[p] == p]
    grids = {p: sorted(grid) for p in selected}
    records: dict[str, dict] = {}

    def run(specs: list[LmRunSpec]) -> None:
        for r in compare(specs, out, jobs=jobs, overwrite=overwrite, fresh_process=fresh_process,
                         on_done=on_done, on_progress=on_progress):
            records[r["key"]] = r

    spec = lambda m, c, lr, s: LmRunSpec(m, c, lr=lr, seed=s, **fixed)  # noqa: E731
    run([spec(m, c, lr, 0) for (m, c) in selected for lr in grids[m, c]])
    chosen: dict[tuple[str, float], tuple[float, bool]] = {}
    for p in selected:
        for _ in range(widen + 1):
            g = grids[p]
            best = min(g, key=lambda lr: _finite(records[spec(*p, lr, 0).key]["val_bits"]))
            extra = _widened(g, best)
            if extra is None or len(g) >= len(grid) + widen:
                break
            grids[p] = sorted([*g, extra])
            run([spec(*p, extra, 0)])
        chosen[p] = (best, _widened(grids[p], best) is not None)
    chosen = {p: chosen[source[p]] for p in pairs}
    run([spec(*p, chosen[p][0], s) for p in pairs for s in range(0 if source[p] != p else 1, seeds)])
    return LmStudy(list(records.values()), chosen)


def summary_markdown(records: Sequence[dict], chosen: dict[tuple[str, float], tuple[float, bool]],
                     select_at: float | None = None) -> str:
    """One row per (method, compression) at its chosen rate: bits (mean ± std over seeds),
    counted memory against dense's, peak RSS and step time against dense's. `select_at`: as
    given to :func:`study` (marks the rates reused from that compression)."""
    def stats(v: list[float]) -> str:
        return f"{np.mean(v):.3f} ± {np.std(v, ddof=1) if len(v) > 1 else 0.0:.3f}"

    rows = {}
    for (m, c), (lr, edge) in chosen.items():
        rows[m, c] = ([r for r in records if r["spec"]["method"] == m and r["spec"]["compression"] == c
                       and r["spec"]["lr"] == lr], lr, edge)
    dense = rows.get(("dense", 0.0))
    ref_mem = np.mean([r["memory"]["total"] for r in dense[0]]) if dense else None
    ref_step = np.mean([r["step_seconds"] for r in dense[0]]) if dense else None
    head = ["method", "compression", "lr (chosen)", "seeds", "val bits/token", "test bits/token",
            "weights + grads + state, MB (peak)", "vs dense", "at the end, vs dense",
            "optimizer state + buffers, MB", "ranks moved (Σ over layers)", "process peak RSS, MiB",
            "tokens/s", "step vs dense"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (m, c), (rs, lr, edge) in rows.items():
        if not rs:
            continue
        mem = np.mean([r["memory"]["total"] for r in rs])
        end = np.mean([r.get("memory_end", r["memory"])["total"] for r in rs])
        moved = ""
        if all(r["info"].get("start_ranks") and r["ranks"] for r in rs):
            change = [sum(abs(k - r["info"]["start_ranks"][n]) for n, k in r["ranks"].items()) for r in rs]
            moved = f"{np.mean(change):.0f}"
        state = np.mean([r["memory"]["optimizer"] + r["memory"]["lowrank_buffers"] for r in rs])
        step = np.mean([r["step_seconds"] for r in rs])
        how = (f" (as at {select_at:g})" if select_at is not None and m not in DENSE and c != select_at
               else " (edge)" if edge else "")
        cells = [m, f"{c:g}" if m not in DENSE else "", f"{lr:g}{how}", str(len(rs)),
                 stats([r["val_bits"] for r in rs]), stats([r["test_bits"] for r in rs]), f"{mem / 1e6:.2f}",
                 f"{mem / ref_mem:.2f}" if ref_mem else "", f"{end / ref_mem:.2f}" if ref_mem else "",
                 f"{state / 1e6:.2f}", moved,
                 f"{np.mean([r['peak_rss_mib'] for r in rs]):.0f}",
                 f"{np.mean([r['tokens_per_second'] for r in rs]):.0f}",
                 f"{step / ref_step:.2f}" if ref_step else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def rates_markdown(records: Sequence[dict], chosen: dict[tuple[str, float], tuple[float, bool]]) -> str:
    """Seed 0's validation bits at every rate tried, one row per (method, compression), with the
    chosen rate (the grid the choice was made on)."""
    rates = sorted({r["spec"]["lr"] for r in records if r["spec"]["seed"] == 0})
    head = ["method", "compression", *(f"{lr:g}" for lr in rates), "chosen"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (m, c), (lr, edge) in chosen.items():
        bits = {r["spec"]["lr"]: r["val_bits"] for r in records if r["spec"]["seed"] == 0
                and r["spec"]["method"] == m and r["spec"]["compression"] == c}
        cells = [f"{bits[x]:.3f}" if x in bits else "" for x in rates]
        lines.append("| " + " | ".join([m, f"{c:g}" if m not in DENSE else "", *cells,
                                         f"{lr:g}" + (" (edge)" if edge else "")]) + " |")
    return "\n".join(lines) + "\n"


def plot(records: Sequence[dict], chosen: dict[tuple[str, float], tuple[float, bool]], out: Path) -> Path:
    """``lm_curves.png``: validation bits against step (seed 0 at each chosen rate) and final
    validation bits against counted training memory (every seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..._io import write_atomic

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for (m, c), (lr, _) in chosen.items():
        rs = [r for r in records if r["spec"]["method"] == m and r["spec"]["compression"] == c
              and r["spec"]["lr"] == lr]
        label = m if m in DENSE else f"{m} {c:g}"
        first = [r for r in rs if r["spec"]["seed"] == 0]
        if first:
            steps, bits = zip(*first[0]["curve"], strict=True)
            a.plot(steps, bits, marker=".", label=label)
        b.scatter([r["memory"]["total"] / 1e6 for r in rs], [r["val_bits"] for r in rs], label=label)
    a.set(xlabel="step", ylabel="validation bits per token (subset)", title="validation loss")
    b.set(xlabel="weights + gradients + optimizer state (MB)", ylabel="validation bits per token",
          title="quality against memory")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    path = out / "lm_curves.png"
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    write_atomic(path, buf.getvalue())
    return path
