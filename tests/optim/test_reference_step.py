"""DLRT / SDLRT (`rankwise.AugmentedBUG`, default implementation) against the independent
float64 reference of `tests/reference_bug.py`, step by step; and the reference itself against
cases checkable by hand.

The optimizer and the reference start from the same factors; the reference takes its own
gradients (autograd on the dense weights W = U S Vᵀ) and applies the equations of
docs/lowrank.md layer by layer. After every step the ranks, the weights, the cores' singular
values, the tolerances τ, the biases and (SDLRT) the buffers' spans must agree. Learning
rates and tolerances are chosen so that ranks grow and shrink and no decision sits on a
threshold: the reference records how far each tolerance-decided truncation and each kept or
dropped new direction was from its threshold, and the test checks that neither was close.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rankwise import DLRT, SDLRT, LowRankLinear
from reference_bug import Config, Model

F64 = torch.float64

# (in, out, rank) per layer, tanh between layers
MIXED = [(16, 16, 4), (16, 24, 5), (24, 3, 2)]
SAME_SHAPE = [(16, 16, 3), (16, 16, 5), (16, 16, 6)]  # one shape; ranks 5 and 6 share a bucket (8): padded


def _problem(spec, seed: int = 0):
    """A chain of LowRankLinear layers with decaying spectra σ_i = 0.6^i, and a regression
    batch onto a random dense tanh network of the same shapes (so ranks want to change)."""
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for i, (n_in, n_out, r) in enumerate(spec):
        layer = LowRankLinear(n_in, n_out, r, dtype=F64)
        layer.set_factors(layer.U.detach(), torch.diag(0.6 ** torch.arange(r, dtype=F64)), layer.V.detach())
        mods += [layer] + ([nn.Tanh()] if i < len(spec) - 1 else [])
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(64, spec[0][0], generator=g, dtype=F64)
    y = x
    for i, (n_in, n_out, _) in enumerate(spec):
        y = y @ (2 * torch.randn(n_out, n_in, generator=g, dtype=F64) / n_in**0.5).T
        y = torch.tanh(y) if i < len(spec) - 1 else y
    return nn.Sequential(*mods), x, y


def _closure(opt, model, x, y):
    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    return closure


def _reference_config(preset: str, lr: float, kw: dict) -> Config:
    """The reference's settings for ``preset(model, lr, **kw)``."""
    kw = dict(kw)
    optimizer = kw.pop("optimizer", "sgd")
    ref = {"rule": {"sgd": "sgd", "muon": "muon"}.get(optimizer, "adam"), "decoupled": optimizer == "adamw"}
    if optimizer == "muon":
        ref["momentum"] = kw.pop("momentum", 0.95)
        ref["moments"] = kw.pop("moments", "reset")  # moments="auto" under Muon
    if preset == "SDLRT":
        feedback = kw.pop("feedback", True)
        ref["buffer"] = kw.pop("buffer", True)
        ref["feedback"] = {True: "seed", False: None}.get(feedback, feedback)
    return Config(lr=lr, **ref, **kw)


def _buffer_directions(tail: torch.Tensor, b: int, scale: float) -> int:
    """How many leading buffer directions are well defined: the most j <= b whose σ_j stands
    clear of the next discarded σ (or 0). Directions of σ ~ 0 (the single-pass core has rank
    <= 2 r0) are arbitrary, and a tiny σ next to them is ill-conditioned."""
    for j in range(b, 0, -1):
        after = float(tail[j]) if j < tail.numel() else 0.0
        if float(tail[j - 1]) - after > 1e-4 * scale:
            return j
    return 0


def _compare(opt, layers: list[LowRankLinear], model: Model, atol: float, step: int) -> None:
    where = f"after step {step}"
    assert [m.rank for m in layers] == [lay.rank for lay in model.layers], where
    assert list(opt.taus().values()) == pytest.approx([lay.tau for lay in model.layers], rel=1e-12, abs=0)
    for i, (m, lay) in enumerate(zip(layers, model.layers, strict=True)):
        at = f"layer {i} {where}"
        torch.testing.assert_close(m.weight_matrix().detach(), lay.weight(), atol=atol, rtol=0, msg=at)
        sigma = torch.linalg.svdvals(lay.S)
        torch.testing.assert_close(torch.linalg.svdvals(m.S.detach()), sigma, atol=atol, rtol=0, msg=at)
        torch.testing.assert_close(m.bias.detach(), lay.bias, atol=atol, rtol=0, msg=at)
        if not model.cfg.buffer:
            continue
        assert m.U_buf.shape[1] == m.V_buf.shape[1] == lay.U_buf.shape[1], at
        j = _buffer_directions(lay.tail_sigma, lay.U_buf.shape[1], float(sigma[0]))
        for real, want in ((m.U_buf[:, :j], lay.U_buf[:, :j]), (m.V_buf[:, :j], lay.V_buf[:, :j])):
            torch.testing.assert_close(real @ real.T, want @ want.T, atol=1e-6, rtol=0, msg=at)


def _run(spec, preset: str, lr: float, kw: dict, *, steps: int = 8, atol: float = 1e-9):
    """Train `spec` with ``preset(model, lr, **kw)`` beside the reference for `steps` steps,
    comparing after each; returns the rank history (initial ranks first)."""
    model, x, y = _problem(spec)
    layers = [m for m in model if isinstance(m, LowRankLinear)]
    ref = Model.from_modules(layers, _reference_config(preset, lr, kw))
    opt = {"DLRT": DLRT, "SDLRT": SDLRT}[preset](model, lr, **kw)
    closure = _closure(opt, model, x, y)
    history = [[m.rank for m in layers]]
    for t in range(steps):
        opt.step(closure)
        ref.step(x, y)
        _compare(opt, layers, ref, atol, t)
        ref.align_signs([m.U for m in layers])  # a gauge; see Model.align_signs
        history.append([m.rank for m in layers])
    assert min(ref.margins, default=1) > 1e-4, f"a truncation {min(ref.margins):.1e} from its threshold"
    assert min(ref.orth_margins) > 1.5, f"a new direction {min(ref.orth_margins):.2f}× from its threshold"
    return history


SGD = {"momentum": 0.9}
ADAM = {"optimizer": "adam"}
CASES = {  # id: (preset, lr, kwargs, atol, the ranks change in both models)
    "dlrt-sgd-momentum": ("DLRT", 1.0, {"tau": 0.2, **SGD}, 1e-9, True),
    "dlrt-sgd-momentum-small-tau": ("DLRT", 1.0, {"tau": 0.005, **SGD}, 1e-9, True),
    "dlrt-sgd-weight-decay": ("DLRT", 1.0, {"tau": 0.1, "weight_decay": 1e-2}, 1e-9, False),
    "dlrt-adam": ("DLRT", 0.05, {"tau": 0.1, **ADAM}, 1e-7, True),
    "dlrt-adamw-core-ratio": ("DLRT", 0.05, {"tau": 0.1, "optimizer": "adamw", "weight_decay": 0.1,
                                             "core_lr_ratio": 0.5}, 1e-7, False),
    "dlrt-fixed-rank": ("DLRT", 1.0, {"tau": 0.2, "adaptive": False, **SGD}, 1e-9, False),
    "dlrt-update-every-2": ("DLRT", 1.0, {"tau": 0.2, "update_every": 2, **SGD}, 1e-9, True),
    "dlrt-rank-clamps": ("DLRT", 1.0, {"tau": 0.005, "min_rank": 3, "max_rank": 6, **SGD}, 1e-9, True),
    "dlrt-two-pass": ("DLRT", 0.3, {"tau": 0.2, "single_pass": False, **SGD}, 1e-9, True),
    "sdlrt-sgd-momentum": ("SDLRT", 1.0, {"tau": 0.2, **SGD}, 1e-9, True),
    "sdlrt-two-sided": ("SDLRT", 1.0, {"tau": 0.1, "feedback": "two-sided", "tau_min": 0.05, **SGD}, 1e-9,
                        True),
    "sdlrt-adam-reset": ("SDLRT", 0.05, {"tau": 0.2, "moments": "reset", "eps": 1e-3, **ADAM}, 1e-7, True),
    "sdlrt-adam-update-every-3": ("SDLRT", 0.05, {"tau": 0.1, "update_every": 3, **ADAM}, 1e-7, False),
    "sdlrt-two-pass": ("SDLRT", 0.3, {"tau": 0.2, "single_pass": False, **SGD}, 1e-9, True),
    "dlrt-adam-reset-v": ("DLRT", 0.05, {"tau": 0.1, "moments": "reset_v", "eps": 1e-3, **ADAM}, 1e-7, True),
    "sdlrt-adam-reset-m-two-pass": ("SDLRT", 0.05, {"tau": 0.2, "moments": "reset_m", "single_pass": False,
                                                    "eps": 1e-3, **ADAM}, 1e-7, True),
    "dlrt-muon": ("DLRT", 0.1, {"tau": 0.1, "optimizer": "muon", "update_every": 2}, 1e-7, True),
    "dlrt-muon-rotate": ("DLRT", 0.1, {"tau": 0.1, "optimizer": "muon", "moments": "rotate"}, 1e-7, True),
    "sdlrt-muon-two-pass": ("SDLRT", 0.1, {"tau": 0.2, "optimizer": "muon", "single_pass": False,
                                           "weight_decay": 0.01}, 1e-7, True),
}


@pytest.mark.parametrize("spec", [MIXED, SAME_SHAPE], ids=["mixed", "same-shape"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, spec, one_thread):
    preset, lr, kw, atol, moves = CASES[case]
    history = _run(spec, preset, lr, kw, atol=atol)
    if moves:
        assert any(h != history[0] for h in history), f"the ranks never changed: {history}"
    if kw.get("adaptive", True) is False:
        assert all(h == history[0] for h in history)
    if "max_rank" in kw:
        assert all(kw["min_rank"] <= r <= kw["max_rank"] for h in history[1:] for r in h)
        assert any(kw["max_rank"] in h for h in history) and any(kw["min_rank"] in h for h in history)


# ----------------------------------------------------------------------- the reference itself
def _dense_grads(layers, x, y):
    """∇W and ∇b of the same loss, through a dense nn.Linear copy of the model."""
    dense = []
    for m in layers:
        lin = nn.Linear(m.in_features, m.out_features, dtype=F64)
        with torch.no_grad():
            lin.weight.copy_(m.U @ m.S @ m.V.T)
            lin.bias.copy_(m.bias)
        dense.append(lin)
    h = x
    for i, lin in enumerate(dense):
        h = lin(h)
        h = torch.tanh(h) if i < len(dense) - 1 else h
    nn.functional.mse_loss(h, y).backward()
    return [lin.weight.grad for lin in dense], [lin.bias.grad for lin in dense]


def _orth_projector(A: torch.Tensor) -> torch.Tensor:
    Q = torch.linalg.qr(A)[0]
    return Q @ Q.T


@pytest.mark.parametrize("single_pass", [True, False], ids=["single-pass", "two-pass"])
def test_reference_sgd_step_is_a_projected_gradient_step(single_pass, one_thread):
    """τ = 0 (nothing above roundoff is cut), plain SGD: one single-pass step is
    W1 = W0 − lr·P_T(∇W) with the tangent-space projection
    P_T(Z) = U0U0ᵀZ + Z V0V0ᵀ − U0U0ᵀ Z V0V0ᵀ; one two-pass step is W1 = W0 − lr·P_Ū ∇W P_V̄ with
    span Ū = span[U0, ∇W V0], span V̄ = span[V0, ∇Wᵀ U0]; the bias takes b − lr ∇b."""
    lr = 0.3
    model, x, y = _problem(MIXED)
    layers = [m for m in model if isinstance(m, LowRankLinear)]
    ref = Model.from_modules(layers, Config(lr=lr, tau=0.0, single_pass=single_pass))
    grads, bias_grads = _dense_grads(layers, x, y)
    before = [(lay.weight(), lay.U, lay.V, lay.bias) for lay in ref.layers]
    ref.step(x, y)
    for lay, (W0, U0, V0, b0), G, gb in zip(ref.layers, before, grads, bias_grads, strict=True):
        PU, PV = U0 @ U0.T, V0 @ V0.T
        if single_pass:
            step = PU @ G + G @ PV - PU @ G @ PV
        else:
            left, right = torch.cat([U0, G @ V0], 1), torch.cat([V0, G.T @ U0], 1)
            step = _orth_projector(left) @ G @ _orth_projector(right)
        torch.testing.assert_close(lay.weight(), W0 - lr * step, atol=1e-12, rtol=0)
        torch.testing.assert_close(lay.bias, b0 - lr * gb, atol=1e-14, rtol=0)
        m, n, r0 = *G.shape, U0.shape[1]
        assert lay.rank == min(2 * r0, m, n)  # the tangent step's rank, nothing cut


def test_reference_momentum_at_full_rank_is_dense_sgd(one_thread):
    """Square layers at full rank: every basis is the whole space, so the tangent space is
    everything and the K, L, S momenta rotated into each new basis are one dense momentum:
    the reference must follow torch.optim.SGD(momentum) on the dense weights (and biases)."""
    spec, lr, mu = [(8, 8, 8), (8, 8, 8)], 0.2, 0.9
    model, x, y = _problem(spec)
    layers = [m for m in model if isinstance(m, LowRankLinear)]
    ref = Model.from_modules(layers, Config(lr=lr, tau=0.0, momentum=mu))
    dense = nn.Sequential(nn.Linear(8, 8, dtype=F64), nn.Tanh(), nn.Linear(8, 8, dtype=F64))
    with torch.no_grad():
        for lin, m in zip(dense[::2], layers, strict=True):
            lin.weight.copy_(m.weight_matrix())
            lin.bias.copy_(m.bias)
    sgd = torch.optim.SGD(dense.parameters(), lr=lr, momentum=mu)
    for _ in range(5):
        ref.step(x, y)
        sgd.zero_grad()
        nn.functional.mse_loss(dense(x), y).backward()
        sgd.step()
        for lin, lay in zip(dense[::2], ref.layers, strict=True):
            assert lay.rank == 8
            torch.testing.assert_close(lay.weight(), lin.weight.detach(), atol=1e-12, rtol=0)
            torch.testing.assert_close(lay.bias, lin.bias.detach(), atol=1e-13, rtol=0)


def test_adam_rotate_is_invariant_under_the_factors_signs(one_thread):
    """The same weights with some columns of U and V negated must train identically (as they do
    with SGD, whose rule and transport are sign-equivariant). Adam's second moments are moved by
    the squared maps for this: ``(√v T)²`` depended on the signs (failed before issue 48)."""
    model, x, y = _problem(MIXED)
    twin = copy.deepcopy(model)
    for m in twin:
        if isinstance(m, LowRankLinear):
            d = torch.ones(m.rank, dtype=F64)
            d[1::2] = -1
            m.set_factors(m.U.detach() * d, m.S.detach(), m.V.detach() * d)
    weights = []
    for net in (model, twin):
        opt = DLRT(net, 0.05, tau=0.1, optimizer="adam")
        for _ in range(4):
            opt.step(_closure(opt, net, x, y))
        weights.append([m.weight_matrix().detach() for m in net if isinstance(m, LowRankLinear)])
    for a, b in zip(*weights, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=0)
