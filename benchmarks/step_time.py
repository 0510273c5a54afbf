"""Training-step time: dense SGD vs DLRT vs SDLRT on a wide MLP (CPU or whatever torch uses).

What is measured
    Wall-clock time of one full optimizer step (``zero_grad`` + forward + backward + update,
    i.e. ``opt.step(closure)``) on a ``depth``-layer MLP of ``width``-wide ``nn.Linear`` layers
    with ReLU in between. *Every* layer, the last one included, is width -> width, the loss is
    MSE against a fixed random target, the batch is one fixed random (batch, width) tensor.

    Configurations, all built and timed in one run:

    - dense: ``torch.optim.SGD(momentum=0.9)`` on the ``nn.Linear`` model;
    - DLRT and SDLRT (momentum 0.9), each single-pass and two-pass (``single_pass=False``),
      with ``update_every`` 1 and 10, at 50 / 80 / 90 % compression. Each layer gets the rank
      r with r(m+n) + r² ≈ (1−c)·m·n, kept fixed (fixed-rank BUG still augments to 2r (DLRT) /
      3r (SDLRT, buffer) -- at most r + batch per new block -- and truncates back to r every
      augmentation). By default (``--pin clamp``) r is pinned with ``min_rank = max_rank = r``
      (adaptive=True), which truncates to r exactly like fixed-rank BUG: with ``adaptive=False``
      (``--pin fixed``) two-pass steps do not truncate back to r (``_optim.py`` reads the fixed
      rank from the layer after the second pass has set it to the augmented size), so their
      rank grows every augmentation and the timing is meaningless;
    - one adaptive run: single-pass SDLRT, ``update_every=1``, at the highest compression,
      ``tau=0.1`` and ``max_rank`` = 2r (so its cost stays bounded); its final ranks are shown;
    - one budget run: single-pass DLRT, ``update_every=1``, at the highest compression, with
      ``target`` = that compression and ``ramp_steps=0``: the same ranks, but every augmentation
      also allocates them model-wide (``budget`` row; compared with the pinned DLRT row).

    Timing is interleaved: after a warm-up, every repeat runs one timed block per
    configuration, in a freshly shuffled order, so that machine noise hits all of them alike;
    the table shows the median over repeats of each block's mean ms/step. A block is a whole
    number of ``update_every`` periods (so update_every=10 rows average 1 augmentation + 9 core
    steps) and at least ``--steps`` steps; cheap configurations run more steps per block, up to
    about ``--block-seconds``.

    Ratios: each method / dense; SDLRT/DLRT (same passes, update_every, compression);
    single-pass/two-pass (same method, update_every, compression); update_every 10 / 1. The
    spec's targets are checked at the end (PASS/FAIL with the measured numbers).

    ``--contend`` then measures every configuration again while another process trains a
    dense MLP at torch's default thread count on the same cores (a shared machine), and
    prints each ×dense ratio idle and contended side by side, with contended/idle.

    ``--phases N`` then times every update_every=1 configuration for N more steps, split into
    phases (forward + backward, the second pass, working copies, update rules, the QR of the
    new bases, the Galerkin core, SVD + truncation + buffer, budget allocation, state
    transport, finiteness checks, the rest), by wrapping the integrator's functions.

    ``--profile`` instead profiles single-pass SDLRT at the highest compression with
    update_every=1: time per phase (cProfile, by function) and the top aten ops (torch.profiler).

How to run
    .venv/bin/python benchmarks/step_time.py                 # default (make bench): ~7.5 min on
                                                             # 2 cores at 2 threads, ~5 at 1
    .venv/bin/python benchmarks/step_time.py --quick         # tiny smoke configuration (seconds)
    .venv/bin/python benchmarks/step_time.py --out step_time.md --threads 1
    .venv/bin/python benchmarks/step_time.py --profile       # where the SDLRT step time goes
    .venv/bin/python benchmarks/step_time.py --compressions 0.8,0.9 --contend   # shared machine

Threads: MKL's LAPACK (QR, SVD) degrades badly when its OpenMP threads compete with other
processes for the cores (on a shared 2-core machine a 716×716 SVD took 12 s at 2 threads vs
0.08 s at 1); on a busy machine pass ``--threads 1``.
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

import rankwise

LR, MOMENTUM = 1e-3, 0.9
ADAPTIVE_TAU = 0.1


# ----------------------------------------------------------------------------- models
def rank_for(m: int, n: int, c: float) -> int:
    """Rank r with r(m+n) + r² ≈ (1−c)·m·n (the positive root, rounded, at least 1)."""
    s = m + n
    return max(1, min(min(m, n), round((-s + math.sqrt(s * s + 4 * (1 - c) * m * n)) / 2)))


def dense_mlp(width: int, depth: int) -> nn.Sequential:
    """``depth`` width->width Linear layers with ReLU in between (none after the last)."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def low_rank_mlp(width: int, depth: int, rank: int) -> nn.Sequential:
    """The same architecture with LowRankLinear layers of rank ``rank`` (their own init: the
    rank-r truncated SVD of the default nn.Linear initialisation)."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(rankwise.LowRankLinear(width, width, rank))
        if i < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


# ----------------------------------------------------------------------------- configurations
@dataclass
class Config:
    """One timed configuration: a model, its optimizer and a closure."""

    method: str  # "dense", "DLRT", "SDLRT"
    compression: float | None = None
    single_pass: bool = True
    update_every: int = 1
    adaptive: bool = False
    budget: bool = False
    rank: int | None = None
    model: nn.Module | None = None
    opt: torch.optim.Optimizer | None = None
    closure: Callable[[], torch.Tensor] | None = None
    block: int = 1  # steps per timed block
    flops: float | None = None  # counted per step (counted_flops)
    times: list[float] = field(default_factory=list)  # mean s/step of each block

    @property
    def key(self) -> tuple:
        return (self.method, self.compression, self.single_pass, self.update_every, self.adaptive,
                self.budget)

    @property
    def label(self) -> str:
        if self.method == "dense":
            return "dense SGD"
        passes = "1-pass" if self.single_pass else "2-pass"
        extra = " adaptive" if self.adaptive else " budget" if self.budget else ""
        return f"{self.method} {passes} ue={self.update_every}{extra}"

    def median_ms(self) -> float:
        return 1e3 * statistics.median(self.times)


def make_closure(opt: torch.optim.Optimizer, model: nn.Module, x: torch.Tensor,
                 y: torch.Tensor) -> Callable[[], torch.Tensor]:
    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    return closure


def pin_rank(r: int, args: argparse.Namespace) -> dict:
    """Optimizer keywords that keep every layer at rank r (see ``--pin``)."""
    if args.pin == "fixed":
        return {"adaptive": False}
    return {"adaptive": True, "min_rank": r, "max_rank": r}


def build_configs(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> list[Config]:
    """Dense, the fixed-rank DLRT/SDLRT grid and the adaptive run, each with its own model
    (low-rank models at one compression are copies of one initialisation)."""
    w, d = args.width, args.depth
    dense = Config("dense", model=dense_mlp(w, d))
    dense.opt = torch.optim.SGD(dense.model.parameters(), lr=LR, momentum=MOMENTUM)
    configs = [dense]
    for c in args.compressions:
        r = rank_for(w, w, c)
        base = low_rank_mlp(w, d, r)
        for method, cls in (("DLRT", rankwise.DLRT), ("SDLRT", rankwise.SDLRT)):
            for single_pass in (True, False):
                for ue in (1, 10):
                    cfg = Config(method, c, single_pass, ue, rank=r, model=copy.deepcopy(base))
                    cfg.opt = cls(cfg.model, LR, tau=ADAPTIVE_TAU, momentum=MOMENTUM,
                                  single_pass=single_pass, update_every=ue, **pin_rank(r, args))
                    configs.append(cfg)
        if args.adaptive and c == max(args.compressions):
            cfg = Config("SDLRT", c, True, 1, adaptive=True, rank=r, model=copy.deepcopy(base))
            cfg.opt = rankwise.SDLRT(cfg.model, LR, tau=ADAPTIVE_TAU, momentum=MOMENTUM,
                                     max_rank=2 * r)
            configs.append(cfg)
        if args.budget and c == max(args.compressions):
            cfg = Config("DLRT", c, True, 1, budget=True, rank=r, model=copy.deepcopy(base))
            target = rankwise.compression(cfg.model)["ratio"]  # exactly the pinned ranks' compression
            cfg.opt = rankwise.DLRT(cfg.model, LR, target=target, ramp_steps=0, momentum=MOMENTUM)
            configs.append(cfg)
    for cfg in configs:
        cfg.closure = make_closure(cfg.opt, cfg.model, x, y)
    return configs


# ----------------------------------------------------------------------------- timing
def run_steps(cfg: Config, n: int) -> float:
    """Run ``n`` steps; return the mean seconds per step."""
    t0 = time.perf_counter()
    for _ in range(n):
        cfg.opt.step(cfg.closure)
    return (time.perf_counter() - t0) / n


def warm_up(configs: list[Config], args: argparse.Namespace) -> None:
    """``--warmup`` steps per configuration (a whole update_every period for ue > 1, so the
    augmentation is exercised too), then choose each configuration's block length."""
    for cfg in configs:
        n = max(args.warmup, cfg.update_every if cfg.update_every > 1 else 0)
        if n:
            run_steps(cfg, n)
        per_step = run_steps(cfg, cfg.update_every)  # one period: the block-length estimate
        want = max(args.steps, math.ceil(args.block_seconds / max(per_step, 1e-6)))
        cfg.block = math.ceil(want / cfg.update_every) * cfg.update_every
        print(f"  warm-up {cfg.label:<28} {_comp(cfg):>4}  ~{1e3 * per_step:9.1f} ms/step, "
              f"block {cfg.block} steps", flush=True)


def measure(configs: list[Config], repeats: int, seed: int) -> None:
    """Round-robin: each repeat times one block of every configuration, in shuffled order."""
    rng = random.Random(seed)
    for rep in range(repeats):
        order = list(configs)
        rng.shuffle(order)
        t0 = time.perf_counter()
        for cfg in order:
            cfg.times.append(run_steps(cfg, cfg.block))
        print(f"  repeat {rep + 1}/{repeats} done in {time.perf_counter() - t0:.1f} s", flush=True)


# ----------------------------------------------------------------------------- flop floor
def _lapack_formulas() -> dict:
    """Operation counts of the factorisations (LAPACK Working Note 41 / Golub–Van Loan), for
    torch's FlopCounterMode, which counts only matrix products by itself. Shapes only."""
    aten = torch.ops.aten

    def batch(a) -> int:  # a batch of matrices (..., m, n) costs one count per matrix
        return math.prod(a[:-2])

    def qr(a, *args, out_shape=None, **kw):  # thin QR with Q formed: 4mn² − 4n³/3
        m, n = a[-2], a[-1]
        k = min(m, n)
        return batch(a) * int(4 * max(m, n) * k * k - 4 * k**3 / 3)

    def eigh(a, *args, out_shape=None, **kw):  # tridiagonalisation + QR iteration with vectors: ~9n³
        return batch(a) * 9 * a[-1] ** 3

    def svd(a, *args, out_shape=None, **kw):  # thin R-SVD with vectors: 6mn² + 20n³ (m ≥ n)
        m, n = max(a[-2], a[-1]), min(a[-2], a[-1])
        return batch(a) * (6 * m * n * n + 20 * n**3)

    def cholesky(a, *args, out_shape=None, **kw):
        return batch(a) * (a[-1] ** 3 // 3)

    def trsm(a, b, *args, out_shape=None, **kw):  # A (n×n) against B: n²·(other side of B)
        n = a[-1]
        return max(batch(a), batch(b)) * n * n * (b[-1] if b[-2] == n else b[-2])

    return {aten.linalg_qr: qr, aten._linalg_eigh: eigh, aten._linalg_svd: svd,
            aten.linalg_cholesky_ex: cholesky, aten.linalg_solve_triangular: trsm}


def counted_flops(cfg: Config) -> float:
    """Floating-point operations per step, averaged over one ``update_every`` period: matrix
    products (torch's FlopCounterMode) plus the factorisations (:func:`_lapack_formulas`);
    elementwise work is not counted. Runs (and so advances) the configuration's training."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping=_lapack_formulas()) as counter:
        for _ in range(cfg.update_every):
            cfg.opt.step(cfg.closure)
    return counter.get_total_flops() / cfg.update_every


# ----------------------------------------------------------------------------- contention
CONTENDER = """
import torch
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
opt = torch.optim.SGD(m.parameters(), lr=1e-3)
x = torch.randn(256, 1024)
while True:
    opt.zero_grad()
    m(x).square().mean().backward()
    opt.step()
"""


def contended(configs: list[Config], args: argparse.Namespace) -> dict[tuple, float]:
    """Every configuration's median ms/step again, with a dense training (torch's default
    threads) running in another process; the idle times are kept in ``cfg.times``."""
    import subprocess

    idle = {cfg.key: list(cfg.times) for cfg in configs}
    proc = subprocess.Popen([sys.executable, "-c", CONTENDER])
    try:
        time.sleep(3.0)  # the contender has imported torch and is training
        if proc.poll() is not None:
            raise RuntimeError(f"the contending process exited early (code {proc.returncode})")
        for cfg in configs:
            cfg.times = []
        measure(configs, args.repeats, args.seed + 1)
        out = {cfg.key: cfg.median_ms() for cfg in configs}
    finally:
        proc.kill()
        proc.wait()
        for cfg in configs:
            cfg.times = idle[cfg.key]
    return out


def contention_rows(configs: list[Config], busy: dict[tuple, float]) -> tuple[list[str], list[list[str]]]:
    dense = next(cfg for cfg in configs if cfg.method == "dense")
    head = ["config", "compr.", "ms idle", "ms contended", "×dense idle", "×dense contended",
            "contended/idle (of ×dense)"]
    rows = []
    for cfg in configs:
        a = cfg.median_ms() / dense.median_ms()
        b = busy[cfg.key] / busy[dense.key]
        rows.append([cfg.label, _comp(cfg), f"{cfg.median_ms():.1f}", f"{busy[cfg.key]:.1f}",
                     _fmt(a), _fmt(b), _fmt(b / a)])
    return head, rows


# ----------------------------------------------------------------------------- report
def _comp(cfg: Config) -> str:
    return "" if cfg.compression is None else f"{round(100 * cfg.compression)}%"


def _fmt(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}"


def table_rows(configs: list[Config]) -> tuple[list[str], list[list[str]]]:
    by_key = {cfg.key: cfg for cfg in configs}
    dense = by_key[("dense", None, True, 1, False, False)]
    dense_ms = dense.median_ms()

    def ratio(cfg: Config, **change) -> float | None:
        k = dict(zip(("method", "compression", "single_pass", "update_every", "adaptive", "budget"),
                     cfg.key, strict=True))
        other = by_key.get(tuple({**k, **change}.values()))
        return None if other is None or other is cfg else cfg.median_ms() / other.median_ms()

    head = ["config", "compr.", "rank", "ratio", "ms/step", "min..max", "×dense", "flop floor", "SDLRT/DLRT",
            "1-pass/2-pass", "ue10/ue1", "budget/τ"]
    rows = []
    for cfg in configs:
        ms = [1e3 * t for t in cfg.times]
        lr = cfg.method != "dense"
        ranks = ""
        if lr:
            rs = sorted(set(cfg.opt.ranks().values()))
            ranks = str(cfg.rank) if rs == [cfg.rank] else f"{cfg.rank}→{'/'.join(map(str, rs))}"
        rows.append([
            cfg.label, _comp(cfg), ranks,
            f"{rankwise.compression(cfg.model)['ratio']:.3f}" if lr else "0",
            f"{cfg.median_ms():.1f}", f"{min(ms):.0f}..{max(ms):.0f}",
            _fmt(cfg.median_ms() / dense_ms),
            _fmt(cfg.flops / dense.flops) if cfg.flops and dense.flops else "",
            _fmt(ratio(cfg, method="DLRT")) if cfg.method == "SDLRT" and not cfg.adaptive else "",
            _fmt(ratio(cfg, single_pass=False)) if lr and cfg.single_pass and not (cfg.adaptive or cfg.budget)
            else "",
            _fmt(ratio(cfg, update_every=1)) if cfg.update_every == 10 else "",
            _fmt(ratio(cfg, budget=False)) if cfg.budget else "",
        ])
    return head, rows


def render(head: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*head), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(lines)


def target_checks(configs: list[Config]) -> list[str]:
    """The spec's step-time targets as PASS/FAIL lines (update_every=1, fixed rank)."""
    by_key = {cfg.key: cfg for cfg in configs}
    dense_ms = by_key[("dense", None, True, 1, False, False)].median_ms()

    def ms(method, c, single_pass=True, budget=False):
        cfg = by_key.get((method, c, single_pass, 1, False, budget))
        return None if cfg is None else cfg.median_ms()

    def line(ok: bool, text: str) -> str:
        return f"{'PASS' if ok else 'FAIL'}  {text}"

    out = []
    comps = sorted({cfg.compression for cfg in configs if cfg.compression is not None})
    for c, bound in ((0.9, 0.40), (0.8, 1.0)):  # issue 25
        if c in comps:
            r = ms("DLRT", c) / dense_ms
            out.append(line(r <= bound, f"1-pass DLRT at {round(100 * c)}% compression ≤ {bound:.2f}× dense: "
                                        f"{r:.2f}×"))
    if 0.9 in comps:
        r = ms("SDLRT", 0.9) / dense_ms
        out.append(line(r <= 0.5, f"1-pass SDLRT at 90% compression ≤ 0.5× dense: {r:.2f}×"))
    low = [c for c in comps if c <= 0.5]
    if low:
        rs = {c: ms("SDLRT", c) / dense_ms for c in low}
        out.append(line(all(v <= 1.0 for v in rs.values()),
                        "break-even (1-pass SDLRT ≤ 1.0× dense) at ≤50% compression: "
                        + ", ".join(f"{round(100 * c)}%: {v:.2f}×" for c, v in rs.items())))
    for c in comps:
        for sp in (True, False):
            r = ms("SDLRT", c, sp) / ms("DLRT", c, sp)
            out.append(line(r <= 1.05, f"SDLRT/DLRT ≤ 1.05 ({'1' if sp else '2'}-pass, "
                                       f"{round(100 * c)}%): {r:.2f}"))
    for c in comps:
        for method in ("DLRT", "SDLRT"):
            r = ms(method, c) / ms(method, c, False)
            out.append(line(r <= 0.6, f"1-pass/2-pass ≤ 0.6 ({method}, {round(100 * c)}%): {r:.2f}"))
    for c in comps:
        if (b := ms("DLRT", c, budget=True)) is not None:
            r = b / ms("DLRT", c)
            out.append(line(r <= 1.05, f"budget/τ ≤ 1.05 (1-pass DLRT, {round(100 * c)}%): {r:.2f}"))
    return out


# ----------------------------------------------------------------------------- phases
PHASES = {  # phase: the functions whose exclusive time it collects (module, attribute)
    "fwd+bwd": [("closure", "evaluate")],
    "2nd pass": [("batched", "_second_pass")],
    "working copies": [("batched", "_Group")],  # _Group: stacking, rules
    "rules": [("batched", "dense_step"), ("batched", "core_step")],
    "new bases (QR)": [("step", "augment_group")],
    "Galerkin core": [("step", "core_group")],
    "SVD + truncation + buffer": [("step", "svd_group"), ("batched", "_commit")],
    "budget allocation": [("opt", "_budget_ranks")],
    "state transport": [("functional", "transport")],
    "finiteness checks": [("batched", "inputs_finite")],
}


class _Phases:
    """Exclusive wall time per phase: each wrapped function's time minus that of the wrapped
    functions it calls (a stack of open timers); installed by patching module attributes for
    the duration of a ``with`` block (benchmark instrumentation only)."""

    def __init__(self, phases: dict[str, list[tuple[str, str]]] | None = None) -> None:
        from rankwise.optim import _batched, _closure, _integrators, _optim, _step, functional
        from rankwise.optim.parallel import _replicas, _shard

        self.phases = PHASES if phases is None else phases
        self.modules = {"opt": _optim.AugmentedBUG, "optim": _optim, "bug": _integrators, "shard": _shard,
                        "batched": _batched, "step": _step, "closure": _closure,
                        "replicas": _replicas.Replicas, "functional": functional}
        self.total: dict[str, float] = dict.fromkeys(self.phases, 0.0)
        self.stack: list[list] = []
        self.saved: list[tuple] = []

    def _wrap(self, phase: str, fn: Callable) -> Callable:
        def timed(*a, **k):
            now = time.perf_counter()
            if self.stack:
                top = self.stack[-1]
                self.total[top[0]] += now - top[1]
            self.stack.append([phase, now])
            try:
                return fn(*a, **k)
            finally:
                name, start = self.stack.pop()
                now = time.perf_counter()
                self.total[name] += now - start
                if self.stack:
                    self.stack[-1][1] = now
        return timed

    def __enter__(self) -> _Phases:
        from rankwise.optim import _settings

        for phase, targets in self.phases.items():
            for where, attr in targets:
                obj = self.modules[where]
                fn = getattr(obj, attr)
                self.saved.append((obj, attr, fn))
                setattr(obj, attr, self._wrap(phase, fn))
        for cls in (_settings.SGD, _settings.Adam):  # the rules as the settings objects hold them
            self.saved.append((cls, "update", cls.__dict__["update"]))
            cls.update = staticmethod(self._wrap("rules", cls.__dict__["update"].__func__))
        return self

    def __exit__(self, *exc) -> None:
        for obj, attr, fn in reversed(self.saved):
            setattr(obj, attr, fn)


def phase_rows(configs: list[Config], steps: int) -> tuple[list[str], list[list[str]]]:
    """Per-phase ms/step of every low-rank configuration with update_every=1 (``steps`` steps
    each, after the timed table: warm)."""
    head = ["config", "comp", "ms/step", *PHASES, "rest"]
    rows = []
    for cfg in configs:
        if cfg.method == "dense" or cfg.update_every != 1:
            continue
        with _Phases() as ph:
            t = run_steps(cfg, steps)
        ms = {k: 1e3 * v / steps for k, v in ph.total.items()}
        rows.append([cfg.label, _comp(cfg), f"{1e3 * t:.1f}", *(f"{ms[k]:.1f}" for k in PHASES),
                     f"{1e3 * t - sum(ms.values()):.1f}"])
    return head, rows


# ----------------------------------------------------------------------------- profile
def profile(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> None:
    """Single-pass SDLRT, update_every=1, fixed rank, at the highest compression: time per
    function (cProfile; forward/backward = the closure) and the top aten ops."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    c = max(args.compressions)
    r = rank_for(args.width, args.width, c)
    model = low_rank_mlp(args.width, args.depth, r)
    opt = rankwise.SDLRT(model, LR, tau=ADAPTIVE_TAU, momentum=MOMENTUM, **pin_rank(r, args))
    closure = make_closure(opt, model, x, y)
    cfg = Config("SDLRT", c, rank=r, model=model, opt=opt, closure=closure)
    print(f"rank pinning: --pin {args.pin}")
    n = max(args.steps, 5)
    run_steps(cfg, max(args.warmup, 2))
    print(f"SDLRT 1-pass ue=1, {round(100 * c)}% compression, rank {r}, width {args.width}, "
          f"depth {args.depth}, batch {args.batch}: {1e3 * run_steps(cfg, n):.1f} ms/step "
          f"(closure alone: {1e3 * _time_closure(closure, n):.1f} ms)\n")

    prof = cProfile.Profile()
    prof.enable()
    run_steps(cfg, n)
    prof.disable()
    print(f"cProfile, {n} steps, functions of rankwise and this script by cumulative time "
          "(closure = zero_grad + forward + backward):")
    stats = pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative")
    stats.print_stats(r"rankwise|step_time|_rules|linalg", 25)

    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        run_steps(cfg, n)
    print(f"torch.profiler, {n} steps, top aten ops by self CPU time:")
    print(p.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total",
                                                          row_limit=25, max_name_column_width=30,
                                                          max_shapes_column_width=60))


def _time_closure(closure: Callable[[], torch.Tensor], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        closure()
    return (time.perf_counter() - t0) / n


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=1,
                   help="minimum steps per timed block (rounded up to whole update_every periods)")
    p.add_argument("--block-seconds", type=float, default=1.0,
                   help="cheap configurations run more steps per block, up to about this long")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps per configuration")
    p.add_argument("--repeats", type=int, default=5, help="interleaved timed rounds (median)")
    p.add_argument("--compressions", type=lambda s: [float(v) for v in s.split(",")],
                   default=[0.5, 0.8, 0.9], help="comma-separated, e.g. 0.5,0.8,0.9")
    p.add_argument("--pin", choices=("clamp", "fixed"), default="clamp",
                   help="how ranks are kept fixed: 'fixed' = adaptive=False; 'clamp' (default) = "
                        "adaptive with min_rank = max_rank = r (same arithmetic; see the docstring)")
    p.add_argument("--no-adaptive", dest="adaptive", action="store_false",
                   help="skip the adaptive SDLRT run")
    p.add_argument("--no-budget", dest="budget", action="store_false",
                   help="skip the budget (target=) DLRT run")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="tiny smoke configuration (width 128, depth 2, batch 32, 1 repeat)")
    p.add_argument("--out", default=None, help="also write the table as markdown to this file")
    p.add_argument("--contend", action="store_true",
                   help="then measure again beside a CPU-bound dense training in another process")
    p.add_argument("--phases", type=int, default=0, metavar="N",
                   help="then time every update_every=1 configuration for N steps, split into phases")
    p.add_argument("--profile", action="store_true",
                   help="profile 1-pass SDLRT (ue=1, highest compression) instead of the table")
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.batch = 128, 2, 32
        args.repeats, args.block_seconds = 1, 0.05
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    setup = (f"width {args.width}, depth {args.depth} (all layers width→width, ReLU, MSE), "
             f"batch {args.batch}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
             f"lr {LR}, momentum {MOMENTUM}")
    print(setup, flush=True)
    if args.profile:
        profile(args, x, y)
        return

    configs = build_configs(args, x, y)
    print(f"built {len(configs)} configurations in {time.perf_counter() - t_start:.1f} s", flush=True)
    warm_up(configs, args)
    for cfg in configs:  # after the warm-up: the augmentation's shapes have settled
        cfg.flops = counted_flops(cfg)
    measure(configs, args.repeats, args.seed)

    head, rows = table_rows(configs)
    checks = target_checks(configs)
    note = (f"median of {args.repeats} interleaved blocks; ×dense = ms / dense ms; flop floor = the "
            "step's counted arithmetic (matrix products and factorisations, per step over an "
            "update_every period) / dense's; fixed rank "
            f"(--pin {args.pin}) except the 'adaptive' row (tau={ADAPTIVE_TAU}, max_rank=2r, "
            "rank shown as start→final) and the 'budget' row (target = the pinned ranks' compression, "
            "ramp_steps=0); ratio = rankwise.compression()['ratio'].")
    print("\n" + setup + "\n" + note + "\n")
    print(render(head, rows, markdown=False))
    print("\nTargets (update_every=1, fixed rank):")
    print("\n".join(checks))
    busy_table = ""
    if args.contend:
        print("\nagain, beside a dense training in another process (torch's default threads):", flush=True)
        bhead, brows = contention_rows(configs, contended(configs, args))
        print("\n" + render(bhead, brows, markdown=False))
        busy_table = ("\n\n## Beside another CPU-bound process\n\n" + render(bhead, brows, markdown=True))
    phase_table = ""
    if args.phases:
        phead, prows = phase_rows(configs, args.phases)
        print(f"\nper phase, ms/step (exclusive wall time, {args.phases} steps each, update_every=1):")
        print("\n" + render(phead, prows, markdown=False))
        phase_table = (f"\n\n## Per phase (ms/step, {args.phases} steps each)\n\n"
                       + render(phead, prows, markdown=True))
    total = time.perf_counter() - t_start
    print(f"\ntotal runtime {total:.0f} s")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(f"# Step time\n\n{setup}.\n\n{note}\n\n{render(head, rows, markdown=True)}\n\n"
                    "## Targets\n\n" + "\n".join(f"- {c}" for c in checks) + busy_table + phase_table
                    + f"\n\nTotal runtime {total:.0f} s.\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
