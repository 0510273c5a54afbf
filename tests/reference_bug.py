r"""An independent, per-layer float64 reference of the rank-adaptive augmented BUG step
(DLRT / SDLRT), written from the equations of docs/lowrank.md and the SDLRT seed.

It imports nothing from ``rankwise``: a model is a list of :class:`Layer` (W = U S Vᵀ and a
bias) with tanh between layers, its gradient ∇W comes from plain autograd on the dense W,
and every quantity below is formed from ∇W. One augmenting step of a layer
W0 = U0 S0 V0ᵀ (U0 (m, r0), S0 (r0, r0), V0 (n, r0)):

1. factor gradients ``G_K = ∇W V0``, ``G_L = ∇Wᵀ U0``, ``G_S = U0ᵀ ∇W V0``; the rule (SGD with
   momentum or Adam, as ``torch.optim``) gives ``ΔK`` for K = U0 S0, ``ΔL`` for L = V0 S0ᵀ and
   ``ΔS`` for S0 (rate × ``core_lr_ratio``), each with its own moments;
2. ``Ū = [U0, U_buf, orth((I − P)ΔK)]``, P the projector onto [U0, U_buf] (directions
   numerically inside it dropped), ``V̄`` likewise with ΔL;
3. single pass: ``S̄ = Ūᵀ (W0 + ΔW) V̄`` with the tangent-space update
   ``ΔW = U0 ΔS V0ᵀ + (I − U0U0ᵀ) ΔK V0ᵀ + U0 ΔLᵀ (I − V0V0ᵀ)``;
   two passes: ``S̄ = S̄(0) + ΔS̄``, ``S̄(0) = Ūᵀ W0 V̄``, ΔS̄ the rule on ``Ḡ = Ūᵀ ∇W V̄`` (the
   gradient at the augmented point, which is the same weight) with the state
   ``[[m_S, m_Lᵀ Ṽ], [Ũᵀ m_K, 0]]`` (Ũ = Ū[:, r0:], Ṽ = V̄[:, r0:]; for Adam's v the same
   blocks with the entrywise squares Ũ², Ṽ²);
4. ``S̄ = P Σ Qᵀ``; r1 the smallest r with ``‖σ[r:]‖ ≤ τ‖σ‖`` (at least 1), capped at the
   numerical rank ``#{σ > k·eps·σ_max}`` (k = min of the core's sides), clamped to
   [min(min_rank, hi), hi] with hi = min(max_rank, the layer's max rank), and to [1, k];
   ``adaptive=False``: r1 = r0. ``U1 = Ū P_{r1}``, ``S1 = Σ_{r1}``, ``V1 = V̄ Q_{r1}``;
   buffer (SDLRT) ``b = min(r1, k − r1)``, ``U_buf = Ū P[:, r1:r1+b]``, ``V_buf`` likewise;
5. feedback: seed ``τ ← max(ωτ, τ_min)`` if r1 < r_init; two-sided also
   ``τ ← min(τ/ω, max(τ0, τ_max))`` if r1 > r_init;
6. moments (``"rotate"``): with ``T_U = U0ᵀU1``, ``T_V = V0ᵀV1``: ``m_K ← m_K T_V``,
   ``m_L ← m_L T_U``, ``m_S ← T_Uᵀ m_S T_V`` (two passes: ``m_S ← (ŪᵀU1)ᵀ m̄ (V̄ᵀV1)``);
   Adam's v by the entrywise squared maps (``v_K ← v_K T_V²``, …); step counts kept.
   ``"reset"``: all three emptied.

Between augmentations (``update_every`` > 1) only S takes the rule on G_S. Biases take the
rule at every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

F64 = torch.float64
EPS = torch.finfo(F64).eps


@dataclass(frozen=True)
class Config:
    """The optimizer's settings (defaults as ``rankwise.AugmentedBUG``'s)."""

    lr: float
    tau: float
    rule: str = "sgd"  # "sgd", "adam" or "muon" (the factors; AdamW on the biases)
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False  # Adam's weight decay as AdamW's
    buffer: bool = False
    feedback: str | None = None  # None, "seed" or "two-sided"
    omega: float = 0.8
    tau_min: float = 0.0
    tau_max: float = 0.5
    min_rank: int = 2
    max_rank: int | None = None
    adaptive: bool = True
    update_every: int = 1
    single_pass: bool = True
    moments: str = "rotate"
    core_lr_ratio: float = 1.0
    nesterov: bool = True  # muon
    ns_steps: int = 5  # muon


@dataclass
class Layer:
    """One low-rank layer W = U S Vᵀ (+ bias) with its optimizer state. ``tail_sigma``: the
    singular values the last truncation discarded (the buffer holds the first b of them)."""

    U: Tensor
    S: Tensor
    V: Tensor
    bias: Tensor | None
    max_rank: int
    tau: float
    r_init: int
    U_buf: Tensor = None  # type: ignore[assignment]
    V_buf: Tensor = None  # type: ignore[assignment]
    tail_sigma: Tensor = None  # type: ignore[assignment]
    K: dict = field(default_factory=dict)
    L: dict = field(default_factory=dict)
    S_state: dict = field(default_factory=dict)
    bias_state: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        m, n = self.U.shape[0], self.V.shape[0]
        self.U_buf = torch.zeros(m, 0, dtype=F64) if self.U_buf is None else self.U_buf
        self.V_buf = torch.zeros(n, 0, dtype=F64) if self.V_buf is None else self.V_buf
        self.tail_sigma = torch.zeros(0, dtype=F64) if self.tail_sigma is None else self.tail_sigma

    @property
    def rank(self) -> int:
        return self.S.shape[0]

    def weight(self) -> Tensor:
        return self.U @ self.S @ self.V.T


def newton_schulz(X: Tensor, steps: int) -> Tensor:
    """Muon's quintic iteration (coefficients 3.4445, −4.7750, 2.0315) on one matrix, in the
    orientation with fewer rows, after scaling to Frobenius norm 1."""
    wide = X.T if X.shape[0] > X.shape[1] else X
    Y = wide / max(float(torch.linalg.matrix_norm(wide)), 1e-7)
    for _ in range(steps):
        A = Y @ Y.T
        Y = 3.4445 * Y + (-4.7750 * A + 2.0315 * A @ A) @ Y
    return Y.T if X.shape[0] > X.shape[1] else Y


def rule(cfg: Config, g: Tensor, p: Tensor, state: dict, lr: float,
         scale: float = 0.0) -> tuple[Tensor, dict]:
    r"""One step of the update rule: ``(Δ, new state)``.

    SGD (torch.optim.SGD, no dampening): ``g ← g + wd·p``, ``m ← μm + g`` (m = g at first),
    ``Δ = −lr·m``. Adam (torch.optim.Adam): ``g ← g + wd·p`` (L2) or decoupled
    (``Δ −= lr·wd·p``), ``m ← β1 m + (1 − β1) g``, ``v ← β2 v + (1 − β2) g²``,
    ``Δ = −lr · (m / (1 − β1ᵗ)) / (√(v / (1 − β2ᵗ)) + eps)``.
    """
    wd = cfg.weight_decay
    if cfg.rule == "muon" and g.ndim == 2:  # Muon: Nesterov momentum, orthogonalised, `scale` × lr
        mu = cfg.momentum
        m = (1 - mu) * g if "m" not in state else mu * state["m"] + (1 - mu) * g
        u = (1 - mu) * g + mu * m if cfg.nesterov else m
        return -lr * scale * newton_schulz(u, cfg.ns_steps) - lr * wd * p, {"m": m}
    if cfg.rule == "muon":  # its vectors: AdamW
        cfg = replace(cfg, decoupled=True)
    if cfg.rule == "sgd":
        g = g + wd * p if wd else g
        if not cfg.momentum:
            return -lr * g, {}
        m = g.clone() if "m" not in state else cfg.momentum * state["m"] + g
        return -lr * m, {"m": m}
    b1, b2 = cfg.betas
    if wd and not cfg.decoupled:
        g = g + wd * p
    m = (1 - b1) * g if "m" not in state else b1 * state["m"] + (1 - b1) * g
    v = (1 - b2) * g * g if "v" not in state else b2 * state["v"] + (1 - b2) * g * g
    t = state.get("step", 0) + 1
    tm, tv = t - state.get("m_from", 0), t - state.get("v_from", 0)  # steps since each moment (re)started
    delta = -lr * (m / (1 - b1**tm)) / ((v / (1 - b2**tv)).sqrt() + cfg.eps)
    if wd and cfg.decoupled:
        delta = delta - lr * wd * p
    kept = {k: state[k] for k in ("m_from", "v_from") if k in state}
    return delta, {"m": m, "v": v, "step": t, **kept}


def muon_scale(layer: Layer) -> float:
    """The Muon rule's rate factor for every factor of a layer: 0.2·√max(m, n) of its m×n weight
    (a step of spectral norm 1 in K, L or S moves W by as much as a dense Muon step)."""
    return 0.2 * max(layer.U.shape[0], layer.V.shape[0]) ** 0.5


def transport(state: dict, left: Tensor | None, right: Tensor | None) -> dict:
    """Moments into new coordinates: ``m ↦ leftᵀ m right``, ``v ↦ (left²)ᵀ v right²`` with
    entrywise squares (``None``: that side unchanged); the step count is kept."""
    out = dict(state)
    if "m" in state:
        m = state["m"] if left is None else left.T @ state["m"]
        out["m"] = m if right is None else m @ right
    if "v" in state:
        v = state["v"] if left is None else (left**2).T @ state["v"]
        out["v"] = v if right is None else v @ right**2
    return out


def orth_rtol(c: int) -> float:
    """The relative size below which a direction of ΔK (c columns) counts as numerically
    inside [U0, U_buf]: √eps, but no smaller than what a float64 Gram matrix of c unit columns
    resolves, √(10³·c·eps) (the rule rankwise.linalg documents for its orthogonalisation)."""
    return max(EPS**0.5, (1e3 * c * EPS) ** 0.5)


def new_directions(Q0: Tensor, X: Tensor) -> tuple[Tensor, Tensor]:
    """Orthonormal basis (m, e) of ``(I − Q0Q0ᵀ) span(X)``: X projected off Q0, its columns
    scaled by X's column norms, the left singular vectors with σ > ``orth_rtol(c)`` kept,
    projected off Q0 once more (a singular vector of a small σ carries roundoff along Q0)
    and QR'd. Also returns the scaled residual's singular values (all of them)."""
    R = X - Q0 @ (Q0.T @ X)
    norms = torch.linalg.vector_norm(X, dim=0)
    R = R / torch.where(norms > 0, norms, torch.ones_like(norms))
    Y, s, _ = torch.linalg.svd(R, full_matrices=False)
    Y = Y[:, s > orth_rtol(X.shape[1])]
    return torch.linalg.qr(Y - Q0 @ (Q0.T @ Y))[0], s


def choose_rank(s: Tensor, tau: float, lo: int, hi: int) -> int:
    """Smallest r with ``‖s[r:]‖ ≤ τ‖s‖`` (at least 1), at most the numerical rank
    ``#{σ > k·eps·σ_max}``, clamped to [lo, hi] and to [1, k]."""
    k = s.numel()
    total = float(torch.linalg.vector_norm(s))
    r = next(i for i in range(1, k + 1) if float(torch.linalg.vector_norm(s[i:])) <= tau * total)
    numerical = int((s > k * EPS * s[0]).sum())
    r = max(min(r, numerical, hi), lo)
    return max(1, min(r, k))


def margin(s: Tensor, tau: float, r: int) -> float:
    """How far the tolerance τ‖s‖ is from the tails on either side of rank r, relative to it
    (a small margin: the rank is not robust to roundoff)."""
    tol = tau * float(torch.linalg.vector_norm(s))
    tails = [float(torch.linalg.vector_norm(s[i:])) for i in range(s.numel() + 1)]
    gaps = [tol - tails[r]] + ([tails[r - 1] - tol] if r >= 1 else [])
    return min(gaps) / max(tol, 1e-300)


def augmented_core_state(st_S: dict, st_K: dict, st_L: dict, EU: Tensor, EV: Tensor) -> dict:
    """Two-pass: the S rule's state in the augmented coordinates, ``[[x_S, x_Lᵀ Ṽ], [Ũᵀ x_K, 0]]``
    for first moments, with Ũ², Ṽ² (entrywise squares) for second ones (absent ones stay absent)."""
    out = {k: v for k, v in st_S.items() if k in ("step", "m_from", "v_from")}
    for key, p in (("m", 1), ("v", 2)):
        if key not in st_S and key not in st_K and key not in st_L:
            continue
        r0 = next(st[key].shape[1] for st in (st_K, st_L, st_S) if key in st)
        X = torch.zeros(r0 + EU.shape[1], r0 + EV.shape[1], dtype=F64)
        if key in st_S:
            X[:r0, :r0] = st_S[key]
        if key in st_K:
            X[r0:, :r0] = (EU**p).T @ st_K[key]
        if key in st_L:
            X[:r0, r0:] = st_L[key].T @ EV**p
        out[key] = X
    return out


class Model:
    """A chain of low-rank layers, ``h ← tanh(h W_iᵀ + b_i)`` (no tanh after the last), trained
    on the mean squared error by the reference step (:meth:`step`)."""

    def __init__(self, layers: list[Layer], cfg: Config) -> None:
        self.layers, self.cfg, self.steps = layers, cfg, 0
        self.margins: list[float] = []  # each tolerance-decided truncation's margin
        self.orth_margins: list[float] = []  # each orthogonalisation's max(σ/rtol, rtol/σ) nearest 1

    @classmethod
    def from_modules(cls, modules, cfg: Config) -> Model:
        """From rankwise LowRankLinear layers (only their public tensors are read)."""
        layers = [Layer(m.U.detach().clone().double(), m.S.detach().clone().double(),
                        m.V.detach().clone().double(),
                        None if m.bias is None else m.bias.detach().clone().double(),
                        max_rank=m.max_rank if cfg.max_rank is None else min(cfg.max_rank, m.max_rank),
                        tau=cfg.tau, r_init=m.rank) for m in modules]
        return cls(layers, cfg)

    def forward(self, x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> Tensor:
        for i, (W, b) in enumerate(zip(weights, biases, strict=True)):
            x = x @ W.T + (0 if b is None else b)
            x = torch.tanh(x) if i < len(weights) - 1 else x
        return x

    def gradients(self, x: Tensor, y: Tensor) -> tuple[list[Tensor], list[Tensor | None]]:
        """∇W and ∇b of the mean squared error, by autograd on the dense weights."""
        Ws = [layer.weight().detach().requires_grad_() for layer in self.layers]
        bs = [None if lay.bias is None else lay.bias.detach().requires_grad_() for lay in self.layers]
        with torch.enable_grad():
            loss = ((self.forward(x, Ws, bs) - y) ** 2).mean()
            loss.backward()
        return [W.grad for W in Ws], [None if b is None else b.grad for b in bs]

    @torch.no_grad()
    def align_signs(self, Us: list[Tensor]) -> None:
        """Adopt another run's signs of the singular vectors, layer by layer (`Us`: its U's):
        U's and V's columns flipped where ``diag(Uᵀ U_other) < 0``, S ← D S D, first moments
        along (m_K, m_L: columns, m_S ← D m_S D; second moments need nothing: they are moved by
        squared maps, ``(D T)² = T²``). The weight and every step are unchanged: a gauge the SVD
        leaves open, fixed so that the two runs' factors compare entry by entry.
        Raises AssertionError where a column is not ±1 times the other's (other directions)."""
        for i, (layer, other) in enumerate(zip(self.layers, Us, strict=True)):
            c = (layer.U * other.detach().to(F64)).sum(0)
            assert bool((c.abs() > 0.9).all()), f"layer {i}: other singular vectors ({c.tolist()})"
            d = torch.sign(c)
            layer.U, layer.V, layer.S = layer.U * d, layer.V * d, d[:, None] * layer.S * d
            for st, left in ((layer.K, 1), (layer.L, 1), (layer.S_state, d[:, None])):
                if "m" in st:
                    st["m"] = left * st["m"] * d

    @torch.no_grad()
    def step(self, x: Tensor, y: Tensor) -> None:
        cfg = self.cfg
        grads, bias_grads = self.gradients(x, y)
        augment = self.steps % cfg.update_every == 0
        for layer, G, gb in zip(self.layers, grads, bias_grads, strict=True):
            if augment:
                self.augmenting_step(layer, G)
            else:  # only the core, in the current bases
                dS, layer.S_state = rule(cfg, layer.U.T @ G @ layer.V, layer.S, layer.S_state,
                                         cfg.lr * cfg.core_lr_ratio, muon_scale(layer))
                layer.S = layer.S + dS
            if gb is not None:
                db, layer.bias_state = rule(cfg, gb, layer.bias, layer.bias_state, cfg.lr)
                layer.bias = layer.bias + db
        self.steps += 1

    def augmenting_step(self, layer: Layer, G: Tensor) -> None:
        cfg = self.cfg
        U0, S0, V0 = layer.U, layer.S, layer.V
        r0, W0 = S0.shape[0], layer.weight()
        G_K, G_L, G_S = G @ V0, G.T @ U0, U0.T @ G @ V0
        scale = muon_scale(layer)
        dK, st_K = rule(cfg, G_K, U0 @ S0, layer.K, cfg.lr, scale)
        dL, st_L = rule(cfg, G_L, V0 @ S0.T, layer.L, cfg.lr, scale)
        Uk = torch.cat([U0, layer.U_buf], 1) if cfg.buffer else U0
        Vk = torch.cat([V0, layer.V_buf], 1) if cfg.buffer else V0
        (EU, sU), (EV, sV) = new_directions(Uk, dK), new_directions(Vk, dL)
        Ub, Vb = torch.cat([Uk, EU], 1), torch.cat([Vk, EV], 1)
        for sig, c in ((sU, dK.shape[1]), (sV, dL.shape[1])):
            ratio = sig / orth_rtol(c)
            self.orth_margins += torch.maximum(ratio, 1 / ratio).tolist()
        core_lr = cfg.lr * cfg.core_lr_ratio
        if cfg.single_pass:
            dS, st_S = rule(cfg, G_S, S0, layer.S_state, core_lr, scale)
            IU, IV = torch.eye(U0.shape[0], dtype=F64), torch.eye(V0.shape[0], dtype=F64)
            dW = U0 @ dS @ V0.T + (IU - U0 @ U0.T) @ dK @ V0.T + U0 @ dL.T @ (IV - V0 @ V0.T)
            S_bar = Ub.T @ (W0 + dW) @ Vb
        else:
            S_bar0 = Ub.T @ W0 @ Vb
            state = augmented_core_state(layer.S_state, layer.K, layer.L, Ub[:, r0:], Vb[:, r0:])
            dS_bar, st_S = rule(cfg, Ub.T @ G @ Vb, S_bar0, state, core_lr, scale)
            S_bar = S_bar0 + dS_bar
        P, s, Qh = torch.linalg.svd(S_bar, full_matrices=False)
        Q, k = Qh.T, s.numel()
        if cfg.adaptive:
            lo = min(cfg.min_rank, layer.max_rank)
            r1 = choose_rank(s, layer.tau, lo, layer.max_rank)
            if r1 == choose_rank(s, layer.tau, 1, k) and r1 < int((s > k * EPS * s[0]).sum()):
                self.margins.append(margin(s, layer.tau, r1))  # decided by the tolerance alone
        else:
            r1 = r0
        b = min(r1, k - r1) if cfg.buffer else 0
        U1, V1 = Ub @ P[:, :r1], Vb @ Q[:, :r1]
        layer.U_buf, layer.V_buf = Ub @ P[:, r1:r1 + b], Vb @ Q[:, r1:r1 + b]
        layer.tail_sigma = s[r1:]
        if cfg.feedback is not None and r1 < layer.r_init:
            layer.tau = max(cfg.omega * layer.tau, cfg.tau_min)
        elif cfg.feedback == "two-sided" and r1 > layer.r_init:
            layer.tau = min(layer.tau / cfg.omega, max(cfg.tau, cfg.tau_max))
        if cfg.moments == "reset":
            layer.K, layer.L, layer.S_state = {}, {}, {}
        else:
            if cfg.moments in ("reset_m", "reset_v"):  # that moment restarts at this step
                key = cfg.moments[-1]
                st_K, st_L, st_S = ({**{k: v for k, v in st.items() if k != key},
                                     **({f"{key}_from": st["step"]} if key in st and "step" in st else {})}
                                    for st in (st_K, st_L, st_S))
            TU, TV = U0.T @ U1, V0.T @ V1
            layer.K, layer.L = transport(st_K, None, TV), transport(st_L, None, TU)
            layer.S_state = (transport(st_S, TU, TV) if cfg.single_pass
                             else transport(st_S, Ub.T @ U1, Vb.T @ V1))
        layer.U, layer.S, layer.V = U1, torch.diag(s[:r1]), V1


def tail_ok(model: Model, least: float = 1e-3) -> bool:
    """Were all tolerance-decided truncations robust (margin above `least`)?"""
    return all(m > least for m in model.margins)
