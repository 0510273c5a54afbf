"""The seed's first cheap experiment, offline: a 6-layer low-rank matrix-memory neural ODE on
sequences (permuted 8×8 digits, 64 steps; mnist1d, 40 steps), trained by reversal backprop.

**Model.** The state of every layer is an m×m matrix memory F, kept as X S Vᵀ.

- Layer 1 reads the sequence: step i (one KSL step of size h) writes the input value u_i as the
  rank-1, position-specific term u_i·p_i q_iᵀ, and the memory evolves as
  dF/dt = 0.5·tanh(A F Bᵀ) − 0.2 F + u_i p_i q_iᵀ. The write must depend on the position, or F is
  an unordered bag of input values (tried first: 10–20 % on digits).
- Layers 2…L are autonomous depth blocks, dF/dt = 0.5·tanh(A_ℓ F B_ℓᵀ) − 0.2 F + a_ℓ b_ℓᵀ, each for
  ``depth_steps`` steps, taking the previous layer's factors (and rank) as their initial state.
- A linear layer reads the class from the last F.

Every layer is a :class:`LowRankODEBlock` with its own checkpoints and the shared controller
rules. Checkpoint spacing does not change the forward values (the reverse is exact): it trades
stored memory against replay time. The rank is what can change accuracy.
"""

from __future__ import annotations

import io
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from .._checks import check_training
from .._io import write_atomic
from ..data import load_digits, load_mnist1d
from ..ode import AbstractController, DefectController, FixedController, LowRankODEBlock, audit_gradients
from ..train import Callback, Loop, accuracy, fit


class SequenceField(nn.Module):
    """dF/dt for (B, m, m) states driven by ``self.u`` (B, T), the current batch's sequence."""

    def __init__(self, m: int, T: int, h: float) -> None:
        super().__init__()
        self.m, self.T, self.h = m, T, h
        self.A = nn.Parameter(0.3 * torch.randn(m, m) / m**0.5)
        self.B = nn.Parameter(0.3 * torch.randn(m, m) / m**0.5)
        self.P = nn.Parameter(torch.randn(T, m))
        self.Q = nn.Parameter(torch.randn(T, m))
        self.u: Tensor | None = None

    def forward(self, t: float, F: Tensor) -> Tensor:
        if self.u is None:
            raise RuntimeError("SequenceField.u is not set; call the model, not the block")
        i = min(int(t / self.h + 1e-6), self.T - 1)
        u = self.u[:, i][:, None, None].to(F.dtype)
        inp = u * (self.P[i][:, None] * self.Q[i][None, :]).to(F.dtype)
        return 0.5 * torch.tanh(self.A @ F @ self.B.T) - 0.2 * F + inp


class DepthField(nn.Module):
    """Autonomous dF/dt = 0.5·tanh(A F Bᵀ) − 0.2 F + a bᵀ for (B, m, m) states."""

    def __init__(self, m: int) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.eye(m) + 0.3 * torch.randn(m, m) / m**0.5)
        self.B = nn.Parameter(torch.eye(m) + 0.3 * torch.randn(m, m) / m**0.5)
        self.a = nn.Parameter(0.1 * torch.randn(m))
        self.b = nn.Parameter(0.1 * torch.randn(m))

    def forward(self, t: float, F: Tensor) -> Tensor:
        del t
        bias = (self.a[:, None] * self.b[None, :]).to(F.dtype)
        return 0.5 * torch.tanh(self.A @ F @ self.B.T) - 0.2 * F + bias


class LayeredMemoryODE(nn.Module):
    """``layers`` stacked :class:`LowRankODEBlock` s; ``forward(u)``: u (B, T) -> logits (B, classes)."""

    def __init__(self, controller: AbstractController, *, T: int, classes: int = 10, m: int = 32,
                 rank: int = 8, layers: int = 6, depth_steps: int = 8, h: float = 0.125,
                 seed: int = 0) -> None:
        super().__init__()
        if layers < 1:
            raise ValueError(f"need layers >= 1; got {layers}")
        self.m = m
        self.seq = SequenceField(m, T, h)
        fields = [self.seq] + [DepthField(m) for _ in range(layers - 1)]
        self.blocks = nn.ModuleList(
            LowRankODEBlock(f, rank=rank, steps=T if k == 0 else depth_steps, h=h, controller=controller,
                            seed=seed * 1000 + k)
            for k, f in enumerate(fields))
        self.out = nn.Linear(m * m, classes)

    def initial_state(self, batch: int) -> Tensor:
        """The fixed small initial memory F0 (batch, m, m) every sequence starts from."""
        g = torch.Generator().manual_seed(1)
        return 0.01 * torch.randn(batch, self.m, self.m, generator=g)

    def integrate(self, F0: Tensor) -> Tensor:
        """Logits from an initial memory F0 (B, m, m), for the sequence already set in ``seq.u``."""
        state = F0
        for b in self.blocks:
            state = b(state)
        return self.out(state.dense().flatten(1))

    def forward(self, u: Tensor) -> Tensor:
        self.seq.u = u.detach()
        return self.integrate(self.initial_state(u.shape[0]))


class FromInitialMemory(nn.Module):
    """``model`` on the fixed sequences ``u`` as a function of the initial memory F0: what
    :func:`audit_gradients` perturbs (its gradient covers F0 and every parameter)."""

    def __init__(self, model: LayeredMemoryODE, u: Tensor) -> None:
        super().__init__()
        self.model, self.u = model, u

    def forward(self, F0: Tensor) -> Tensor:
        self.model.seq.u = self.u
        return self.model.integrate(F0)


@dataclass(frozen=True)
class OdeRunConfig:
    """One training run. ``controller``: "fixed" (spacing ``c``, rank ``rank``), "adaptive"
    (:meth:`DefectController.for_dtype` for float32 with ``c_init=c``, ``max_rank``, carry-over)
    or "replay" (the same, replay-aware)."""

    data: str = "digits"  # "digits" (permuted, 64 steps) or "mnist1d" (40 steps)
    controller: str = "fixed"
    c: int = 8
    rank: int = 8
    max_rank: int = 32
    c_max: int = 32
    layers: int = 6
    depth_steps: int = 8
    m: int = 32
    epochs: int = 1
    lr: float = 1e-2
    batch_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.data not in ("digits", "mnist1d"):
            raise ValueError(f"`data` must be 'digits' or 'mnist1d'; got {self.data!r}")
        if self.controller not in ("fixed", "adaptive", "replay"):
            raise ValueError(f"`controller` must be 'fixed', 'adaptive' or 'replay'; got {self.controller!r}")
        check_training(epochs=self.epochs, batch_size=self.batch_size, lr=self.lr, seed=self.seed)
        for name in ("c", "rank", "layers", "depth_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1; got {getattr(self, name)}")
        if not 1 <= self.rank <= self.m:
            raise ValueError(f"`rank` must be in [1, m={self.m}] (the memory is {self.m}×{self.m}); "
                             f"got {self.rank}")
        if self.controller != "fixed" and not self.rank <= self.max_rank <= self.m:
            raise ValueError(f"`max_rank` must be in [rank={self.rank}, m={self.m}]; got {self.max_rank}")
        if self.controller != "fixed" and self.c_max < self.c:
            raise ValueError(f"`c_max` must be >= c={self.c}; got {self.c_max}")

    @property
    def name(self) -> str:
        if self.controller == "fixed":
            return f"fixed C={self.c} r={self.rank}"
        kind = "adaptive" if self.controller == "adaptive" else "replay-aware"
        return f"{kind} C={self.c}→{self.c_max} r={self.rank}→{self.max_rank}"


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


def _controller(cfg: OdeRunConfig) -> AbstractController:
    if cfg.controller == "fixed":
        return FixedController(cfg.c, cfg.rank)
    if cfg.controller in ("adaptive", "replay"):
        return DefectController.for_dtype(torch.float32, c_init=cfg.c, c_max=cfg.c_max,
                                          max_rank=cfg.max_rank, carry=True,
                                          replay_aware=cfg.controller == "replay")
    raise ValueError(f"controller must be 'fixed', 'adaptive' or 'replay'; got {cfg.controller!r}")


class _Trace(Callback):
    """Each iteration's loss, ranks, checkpoints, reversal defect and tape memory, from the blocks."""

    def __init__(self, callback) -> None:
        self.callback = callback
        self.trace: list[dict] = []

    def on_step_end(self, loop: Loop) -> None:
        blocks = loop.model.blocks
        st = [blk.last_stats for blk in blocks]
        self.trace.append(dict(
            it=len(self.trace), epoch=loop.epoch - 1, loss=loop.loss,
            rank=sum(s["rank"] for s in st) / len(st), last_rank=st[-1]["rank"],
            checkpoints=sum(s["checkpoints"] for s in st),
            max_delta=max(s["max_delta"] for s in st), min_rho=min(s["min_rho"] for s in st),
            # held from forward to backward: every block's checkpoints, plus the largest
            # segment replay's transient states (blocks run their backward one at a time)
            tape_bytes=sum(s["tape_bytes"] for s in st) + max(s.get("replay_bytes", 0) for s in st),
            reloads=sum(s.get("reloads", 0) for s in st)))
        if self.callback:
            self.callback(len(self.trace), loop.epochs * loop.steps, loop.loss)


def run(cfg: OdeRunConfig, callback=None) -> dict:
    """Train ``cfg`` and return its summary metrics plus a per-iteration ``trace``.

    ``callback(it, total, loss)``, if given, is called after every iteration (1-based `it` of
    `total` = epochs × batches per epoch)."""
    ctl = _controller(cfg)
    torch.manual_seed(cfg.seed)
    utr, ytr, ute, yte = load_sequences(cfg.data, cfg.seed)
    model = LayeredMemoryODE(ctl, T=utr.shape[1], m=cfg.m, rank=cfg.rank, layers=cfg.layers,
                             depth_steps=cfg.depth_steps, seed=cfg.seed)
    opt = torch.optim.Adam(model.parameters(), cfg.lr)
    tracer = _Trace(callback)
    t0 = time.perf_counter()
    fit(model, opt, utr, ytr, epochs=cfg.epochs, batch_size=cfg.batch_size, callbacks=[tracer],
        clip_grad_norm=1.0)  # shuffled with the global RNG (seeded above)
    seconds = time.perf_counter() - t0
    trace = tracer.trace
    for blk in model.blocks:  # evaluation needs no reverse pass
        blk.reversible = False
    test_acc, train_acc = accuracy(model, ute, yte), accuracy(model, utr[:1000], ytr[:1000])
    for blk in model.blocks:
        blk.reversible = True
    cos = audit_gradients(FromInitialMemory(model, ute[:16]), model.initial_state(16),
                          lambda logits: nn.functional.cross_entropy(logits, yte[:16]))
    losses = [r["loss"] for r in trace]
    tail = losses[len(losses) // 2:]
    mean = sum(tail) / len(tail)
    return dict(config=asdict(cfg), name=cfg.name, test_acc=test_acc, train_acc=train_acc,
                mean_rank=sum(r["rank"] for r in trace) / len(trace),
                mean_checkpoints=sum(r["checkpoints"] for r in trace) / len(trace),
                max_delta=max(r["max_delta"] for r in trace),
                mean_delta=sum(r["max_delta"] for r in trace) / len(trace),
                min_rho=min(r["min_rho"] for r in trace),
                peak_tape_mib=max(r["tape_bytes"] for r in trace) / 2**20,
                grad_cosine=cos, mean_replays=sum(r["reloads"] for r in trace) / len(trace),
                loss_var_2nd_half=sum((x - mean) ** 2 for x in tail) / len(tail),
                loss_spikes=_spikes(losses),
                seconds=seconds, trace=trace)


def _spikes(losses: list[float], window: int = 10) -> int:
    """Iterations whose loss exceeds twice the median of the ``window`` before it."""
    return sum(1 for i in range(window, len(losses))
               if losses[i] > 2 * statistics.median(losses[i - window:i]))


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
