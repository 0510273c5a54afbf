"""The seed's first cheap experiment, offline: a low-rank matrix-memory neural ODE on sequences
(permuted 8×8 digits, 64 steps; mnist1d, 40 steps), trained by reversal backprop.

**Models.** ``model="gated"`` (the default) is :class:`rankwise.ode.SequenceClassifier`: one
block whose field is a GRU-ODE on the memory's p×p core, read by an MLP. ``model="layered"`` is
the first study's 6-layer model (:mod:`._layered_ode`).

Checkpoint spacing does not change the forward values (the reverse is exact): it trades stored
memory against replay time. The rank is what can change accuracy.
"""

from __future__ import annotations

import io
import math
import statistics
import time
from dataclasses import asdict

import torch
from torch import Tensor, nn

from .._io import write_atomic
from ..data import load_digits, load_mnist1d
from ..ode import (
    AbstractController,
    DefectController,
    FixedController,
    LowRankODEBlock,
    MemoryBudget,
    SequenceClassifier,
    audit_gradients,
)
from ..train import Callback, Loop, accuracy, fit
from ._layered_ode import LayeredMemoryODE as LayeredMemoryODE
from ._ode_spec import CONTROLLERS as CONTROLLERS
from ._ode_spec import OdeRunConfig as OdeRunConfig


class FromInitialMemory(nn.Module):
    """``model`` on the fixed sequences ``u`` as a function of the initial memory F0: what
    :func:`audit_gradients` perturbs (its gradient covers F0 and every parameter)."""

    def __init__(self, model: LayeredMemoryODE | SequenceClassifier, u: Tensor) -> None:
        super().__init__()
        self.model, self.u = model, u

    def forward(self, F0: Tensor) -> Tensor:
        self.model.set_input(self.u)
        return self.model.integrate(F0)




class GRUClassifier(nn.Module):
    """The recurrent baseline: ``torch.nn.GRU`` (one layer, ``hidden`` units) reading the
    sequence u (B, T) one element per step, and the gated model's head (an MLP with 128 hidden
    units) on its last hidden state. ``forward(u)`` -> logits (B, classes)."""

    def __init__(self, classes: int, *, hidden: int = 128, head: int = 128) -> None:
        super().__init__()
        self.gru = nn.GRU(1, hidden, batch_first=True)
        self.head = nn.Sequential(nn.Linear(hidden, head), nn.ReLU(), nn.Linear(head, classes))

    def forward(self, u: Tensor) -> Tensor:
        _, last = self.gru(u[..., None])  # last: (1, B, hidden)
        return self.head(last[0])


def load_sequences(data: str, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(u_train, y_train, u_test, y_test), u (N, T) float32. Digits: pixels centred to [−1, 1]
    under a fixed permutation (seed 123); mnist1d: the standardised sequences."""
    if data == "digits":
        tr, te = load_digits(seed=seed)
        perm = torch.randperm(64, generator=torch.Generator().manual_seed(123))
        return (2 * tr.tensors[0].flatten(1)[:, perm] - 1, tr.tensors[1],
                2 * te.tensors[0].flatten(1)[:, perm] - 1, te.tensors[1])
    if data == "mnist1d":
        tr, te = load_mnist1d()
        return tr.tensors[0], tr.tensors[1], te.tensors[0], te.tensors[1]
    raise ValueError(f"data must be 'digits' or 'mnist1d'; got {data!r}")


def split_validation(u_train: Tensor, y_train: Tensor, u_test: Tensor, y_test: Tensor,
                     fraction: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(u, y) to train on and (u, y) to score on: with ``fraction`` > 0, the first 1 − fraction
    of the training set and its last `fraction` (the test set dropped); else unchanged."""
    if not fraction:
        return u_train, y_train, u_test, y_test
    n = len(u_train) - round(fraction * len(u_train))
    if not 1 <= n < len(u_train):
        raise ValueError(f"validation fraction {fraction} of {len(u_train)} training sequences leaves "
                         f"{n} to train on and {len(u_train) - n} to validate on; both need one or more")
    return u_train[:n], y_train[:n], u_train[n:], y_train[n:]


def _state_bytes(cfg: OdeRunConfig) -> int:
    """Bytes of one float32 state (X, S, V) of the first batch at rank ``cfg.rank``."""
    return 4 * cfg.batch_size * (2 * cfg.m * cfg.rank + cfg.rank**2)


def _controller(cfg: OdeRunConfig) -> AbstractController:
    if cfg.controller in ("fixed", "autograd", "gru"):
        return FixedController(cfg.c, cfg.rank)
    if cfg.controller == "budget":
        if cfg.budget_in == "bytes":  # (a smaller last batch gets more states)
            return MemoryBudget(cfg.budget_states * _state_bytes(cfg))
        return MemoryBudget(max_states=cfg.budget_states)
    if cfg.controller in ("adaptive", "replay"):
        return DefectController.for_dtype(torch.float32, c_init=cfg.c, c_max=cfg.c_max,
                                          max_rank=cfg.max_rank, carry=True,
                                          replay_aware=cfg.controller == "replay")
    raise ValueError(f"controller must be 'fixed', 'adaptive' or 'replay'; got {cfg.controller!r}")


class _Trace(Callback):
    """Each iteration's loss, ranks, checkpoints, reversal defect and tape memory, from the blocks."""

    def __init__(self, callback, scheduler=None) -> None:
        self.callback, self.scheduler = callback, scheduler
        self.trace: list[dict] = []

    def on_step_end(self, loop: Loop) -> None:
        if isinstance(loop.model, _SavedBytes):  # the autograd and GRU baselines: the stored graph
            blocks = _blocks(loop.model.model)
            b = loop.model.last
            st = [dict(rank=blocks[0].rank if blocks else 0, checkpoints=0, max_delta=0.0,
                       min_rho=float("nan"), tape_bytes=b, peak_tape_bytes=b)]
        else:
            st = [blk.last_stats for blk in _blocks(loop.model)]
        self.trace.append(dict(
            it=len(self.trace), epoch=loop.epoch - 1, loss=loop.loss,
            rank=sum(s["rank"] for s in st) / len(st), last_rank=st[-1]["rank"],
            checkpoints=sum(s["checkpoints"] for s in st),
            max_delta=max(s["max_delta"] for s in st), min_rho=min(s["min_rho"] for s in st),
            # held from forward to backward: every block's checkpoints, plus the largest
            # segment replay's transient states (blocks run their backward one at a time)
            tape_bytes=sum(s["tape_bytes"] for s in st) + max(s.get("replay_bytes", 0) for s in st),
            # the same, from each backward's own measured peak (checkpoints, the segment end
            # state being reversed, a replay's held states; what MemoryBudget bounds)
            peak_bytes=sum(s["tape_bytes"] for s in st)
            + max(s.get("peak_tape_bytes", s["tape_bytes"]) - s["tape_bytes"] for s in st),
            recomputed=sum(s.get("recomputed", 0) for s in st),
            reloads=sum(s.get("reloads", 0) for s in st)))
        if self.scheduler is not None:
            self.scheduler.step()
        if self.callback:
            self.callback(len(self.trace), loop.epochs * loop.steps, loop.loss)


def _blocks(model: nn.Module) -> list[LowRankODEBlock]:
    return [b for b in model.modules() if isinstance(b, LowRankODEBlock)]


def build_model(cfg: OdeRunConfig, T: int) -> LayeredMemoryODE | SequenceClassifier | GRUClassifier:
    """The model ``cfg`` names, for sequences of length T, with its controller."""
    if cfg.controller == "gru":
        torch.manual_seed(cfg.seed)
        return GRUClassifier(10, hidden=cfg.gru_hidden)
    ctl = _controller(cfg)
    if cfg.model == "gated":
        pw = cfg.data == "digits" if cfg.position_weights is None else cfg.position_weights
        model = SequenceClassifier(T, 10, controller=ctl, m=cfg.m, rank=cfg.rank, p=cfg.p, h=cfg.h,
                                   window=cfg.window, position_weights=pw, seed=cfg.seed, causal=cfg.causal,
                                   recurrence=cfg.recurrence)
    else:
        model = LayeredMemoryODE(ctl, T=T, m=cfg.m, rank=cfg.rank, layers=cfg.layers,
                                 depth_steps=cfg.depth_steps, seed=cfg.seed)
    for blk in _blocks(model):
        blk.reversible = cfg.controller != "autograd"
    return model


class _SavedBytes(nn.Module):
    """``model`` whose forward counts the bytes its autograd graph saves for the backward (each
    storage once): the stored-graph baseline's memory. The count includes the parameters and
    the input the graph saves (under 1 MiB for the ODE models here)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model, self.last = model, 0

    def forward(self, u: Tensor) -> Tensor:
        seen: dict[int, int] = {}

        def pack(t: Tensor) -> Tensor:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.model(u)
        self.last = sum(seen.values())
        return out


def run(cfg: OdeRunConfig, callback=None) -> dict:
    """Train ``cfg`` and return its summary metrics plus a per-iteration ``trace``.

    ``callback(it, total, loss)``, if given, is called after every iteration (1-based `it` of
    `total` = epochs × batches per epoch)."""
    torch.manual_seed(cfg.seed)
    utr, ytr, ute, yte = split_validation(*load_sequences(cfg.data, cfg.seed), cfg.validation)
    model = build_model(cfg, utr.shape[1])
    trained = _SavedBytes(model) if cfg.controller in ("autograd", "gru") else model
    opt = torch.optim.Adam(model.parameters(), cfg.learning_rate)
    sched = None
    if cfg.model == "gated":
        steps = cfg.epochs * -(-len(utr) // cfg.batch_size)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.learning_rate, total_steps=steps)
    tracer = _Trace(callback, sched)
    t0 = time.perf_counter()
    fit(trained, opt, utr, ytr, epochs=cfg.epochs, batch_size=cfg.batch_size, callbacks=[tracer],
        clip_grad_norm=1.0)  # shuffled with the global RNG (seeded above)
    seconds = time.perf_counter() - t0
    trace = tracer.trace
    blocks = _blocks(model)
    for blk in blocks:  # evaluation needs no reverse pass
        blk.reversible = False
    held_acc, train_acc = accuracy(model, ute, yte), accuracy(model, utr[:1000], ytr[:1000])
    for blk in blocks:
        blk.reversible = cfg.controller != "autograd"
    cos = float("nan")  # (the GRU has no reversal to audit)
    if blocks:
        cos = audit_gradients(FromInitialMemory(model, ute[:16]), model.initial_state(16),
                              lambda logits: nn.functional.cross_entropy(logits, yte[:16]))
    losses = [r["loss"] for r in trace]
    tail = losses[len(losses) // 2:]
    mean = sum(tail) / len(tail)
    return _json_ready(dict(
                config=asdict(cfg), name=cfg.name, test_acc=None if cfg.validation else held_acc,
                val_acc=held_acc if cfg.validation else None, train_acc=train_acc,
                mean_rank=sum(r["rank"] for r in trace) / len(trace),
                mean_checkpoints=sum(r["checkpoints"] for r in trace) / len(trace),
                max_delta=max(r["max_delta"] for r in trace),
                mean_delta=sum(r["max_delta"] for r in trace) / len(trace),
                min_rho=min(r["min_rho"] for r in trace),
                peak_tape_mib=max(r["tape_bytes"] for r in trace) / 2**20,
                peak_mib=max(r["peak_bytes"] for r in trace) / 2**20,
                final_rank=trace[-1]["rank"],
                mean_recomputed=sum(r["recomputed"] for r in trace) / len(trace),
                grad_cosine=cos, mean_replays=sum(r["reloads"] for r in trace) / len(trace),
                loss_var_2nd_half=sum((x - mean) ** 2 for x in tail) / len(tail),
                loss_spikes=_spikes(losses),
                seconds=seconds, trace=trace))


def _json_ready(x):
    """`x` with every non-finite float (a metric the run does not have: the GRU's audit and
    ρ, the test accuracy of a validation run) as ``None``: records are strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_ready(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_json_ready(v) for v in x)
    return x


def _spikes(losses: list[float], window: int = 10, rise: float = 0.1) -> int:
    """Iterations whose loss exceeds the median of the ``window`` before it both twice over and
    by more than ``rise`` × the starting loss (the median of the first window): a jump at the
    scale of the training, not minibatch noise once the loss is near 0."""
    if len(losses) <= window:
        return 0
    floor = rise * statistics.median(losses[:window])
    count = 0
    for i in range(window, len(losses)):
        med = statistics.median(losses[i - window:i])
        count += losses[i] > 2 * med and losses[i] - med > floor
    return count


def plot_traces(results: list[dict], path, *, title: str = "") -> None:
    """One PNG: max δ, mean rank and checkpoints per iteration, one line per run name (seed 0)."""
    from .._extras import require

    matplotlib = require("matplotlib", "the plots")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for r in results:
        if r["config"]["seed"] != 0:
            continue
        its = [t["it"] for t in r["trace"]]
        axes[0].semilogy(its, [max(t["max_delta"], 1e-17) for t in r["trace"]], label=r["name"], lw=1)
        axes[1].plot(its, [t["rank"] for t in r["trace"]], label=r["name"], lw=1)
        axes[2].plot(its, [t["checkpoints"] for t in r["trace"]], label=r["name"], lw=1)
    for ax, lab in zip(axes, ("max reversal defect δ", "mean rank over layers", "checkpoints stored"),
                       strict=True):
        ax.set_xlabel("iteration")
        ax.set_title(lab, fontsize=10)
    axes[2].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    write_atomic(path, buf.getvalue())
