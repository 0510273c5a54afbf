"""Two-pass BUG (`single_pass=False`) with SGD momentum, against independent references.

The momentum of one low-rank layer is kept in three states: m_S (r×r, coordinates U, V),
m_K (m×r, right coordinates V) and m_L (n×r, left coordinates U). As dense matrices they are
D_S = U m_S Vᵀ, D_K = m_K Vᵀ and D_L = U m_Lᵀ, and the momentum of the weight's update on
the tangent space at W = U S Vᵀ is

    M = D_S + (I − UUᵀ) D_K + D_L (I − VVᵀ),

which is what the single-pass step applies. A two-pass step must carry the same momentum:
its augmented core sees μM + ∇W projected onto the augmented spaces, so it is the
single-pass step plus the one block only a second pass can see, P_Ũ ∇W P_Ṽ. (The bug these
tests catch: the augmented core's momentum was m_S padded with zeros, so m_K and m_L never
reached the weights and the part of the update leaving span(U) × span(V) got no momentum.)
"""

import copy

import pytest
import torch

from helpers import F64, dense_grad, mse_closure, projector, rank3_problem
from rankwise import DLRT, SDLRT, LowRankLinear

LR, MU = 0.05, 0.9


def _problem(m: int = 30, n: int = 20, samples: int = 200, seed: int = 1):
    """Regression onto a full-rank target with a decaying spectrum (no ties in the singular
    values, so that truncation to a fixed rank is well defined)."""
    g = torch.Generator().manual_seed(seed)
    A = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=F64))[0]
    B = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))[0]
    target = A @ torch.diag(torch.logspace(0.5, -2, n, dtype=F64)) @ B.T
    X = torch.randn(samples, n, generator=g, dtype=F64)
    return X, X @ target.T


def _grad(W: torch.Tensor, X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    W = W.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(((X @ W.T - Y) ** 2).sum(-1).mean(), W)
    return g


def _top(W: torch.Tensor, r: int):
    """Best rank-r approximation by numpy's SVD: (W_r, U_r, V_r)."""
    import numpy as np

    u, s, vt = (torch.from_numpy(a) for a in np.linalg.svd(W.numpy(), full_matrices=False))
    return u[:, :r] @ torch.diag(s[:r]) @ vt[:r], u[:, :r], vt[:r].T


@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_two_pass_fixed_rank_matches_dense_momentum_reference(weight_decay):
    """Fixed-rank two-pass DLRT with momentum, step by step, against the same method written
    with dense m×n matrices, projectors from numpy and numpy's SVD (no factor coordinates, no
    state transport): with G = ∇W + wd·W (L2 on W),

        D_K ← μ D_K + G P_V,  D_L ← μ D_L + P_U G              (K and L momenta)
        Ū = span[U, D_K V],  V̄ = span[V, D_Lᵀ U]               (augmented spaces)
        D̄ = P_Ū (μ M_old + G) P_V̄,  W̄ = W − lr D̄              (S step at the augmented point)
        W ← best rank-r approximation of W̄ (spans U1, V1)
        D_S ← P_U1 D̄ P_V1,  D_K ← D_K P_V1,  D_L ← P_U1 D_L     (momenta into the new bases)

    with M_old the tangent momentum (module docstring) from the states before the step.
    With μ = 0 this is W − lr P_Ū ∇W P_V̄ (classic BUG, cf. test_optim's projector test)."""
    X, Y = _problem()
    r = 4
    layer = LowRankLinear(20, 30, r, bias=False, dtype=F64)
    opt = DLRT(layer, LR, tau=0.0, momentum=MU, weight_decay=weight_decay, adaptive=False,
               single_pass=False)
    W = layer.weight_matrix().detach().clone()
    U, V = layer.U.detach().clone(), layer.V.detach().clone()
    D_S = D_K = D_L = None
    I_m, I_n = torch.eye(30, dtype=F64), torch.eye(20, dtype=F64)
    for step in range(8):
        PU, PV = U @ U.T, V @ V.T
        G = _grad(W, X, Y) + weight_decay * W
        if D_S is None:  # first step: every buffer starts at its gradient (torch.optim.SGD)
            M_old = torch.zeros_like(W)
            K, L = G @ PV, PU @ G
        else:
            M_old = D_S + (I_m - PU) @ D_K + D_L @ (I_n - PV)
            K, L = MU * D_K + G @ PV, MU * D_L + PU @ G
        PUb = projector(torch.cat([U, K @ V], 1))
        PVb = projector(torch.cat([V, L.T @ U], 1))
        D_bar = PUb @ (MU * M_old + G) @ PVb
        W, U, V = _top(W - LR * D_bar, r)
        PU1, PV1 = U @ U.T, V @ V.T
        D_S, D_K, D_L = PU1 @ D_bar @ PV1, K @ PV1, PU1 @ L

        opt.step(mse_closure(opt, layer, X, Y))
        assert layer.rank == r
        torch.testing.assert_close(layer.weight_matrix(), W, atol=1e-10, rtol=0,
                                   msg=lambda m, s=step: f"step {s + 1}: {m}")


@pytest.mark.parametrize("cls,kw", [(DLRT, {}), (DLRT, {"weight_decay": 1e-2}),
                                    (SDLRT, {"feedback": False})])
def test_two_pass_is_single_pass_plus_the_second_pass_block(cls, kw):
    """From the same weights and optimizer state (with momentum history), and without
    truncation (τ = 0), a two-pass step differs from a single-pass step exactly by the block
    only a second pass sees: W_two − W_one = −lr P_Ũ ∇W P_Ṽ, with P_Ũ = P_Ū − P_U0 (Ū spans
    U0, the SDLRT buffer and ΔK ∝ m_K' = μ m_K + ∇W V0 + wd·K0) and likewise P_Ṽ. The momentum
    the K and L states carry reaches the weights in both modes in the same way."""
    X, Y, _ = rank3_problem()
    layer = LowRankLinear(20, 30, 4, bias=False, dtype=F64)
    warm = cls(layer, LR, tau=0.0, momentum=MU, adaptive=False, single_pass=False, **kw)
    for _ in range(4):  # momentum history in all three states (and an SDLRT buffer)
        warm.step(mse_closure(warm, layer, X, Y))
    mK, mL = warm.state[layer.U]["m"], warm.state[layer.V]["m"]  # K's state under U, L's under V
    assert float(mK.norm()) > 0 and float(mL.norm()) > 0

    results = {}
    for single_pass in (True, False):
        twin = copy.deepcopy(layer)
        opt = cls(twin, LR, tau=0.0, momentum=MU, single_pass=single_pass, **kw)
        opt.load_state_dict(warm.state_dict())
        opt.step(mse_closure(opt, twin, X, Y))
        assert twin.rank > layer.rank  # grew: nothing was truncated
        results[single_pass] = twin.weight_matrix().detach()

    wd = kw.get("weight_decay", 0.0)
    U0, S0, V0 = layer.U.detach(), layer.S.detach(), layer.V.detach()
    G = dense_grad(layer, X, Y)
    K_new = MU * mK + G @ V0 + wd * U0 @ S0      # the K rule's new buffer, ΔK = −lr·K_new
    L_new = MU * mL + G.T @ U0 + wd * V0 @ S0.T  # the L rule's
    PUt = projector(torch.cat([U0, layer.U_buf.detach(), K_new], 1)) - projector(U0)
    PVt = projector(torch.cat([V0, layer.V_buf.detach(), L_new], 1)) - projector(V0)
    torch.testing.assert_close(results[False] - results[True], -LR * PUt @ G @ PVt,
                               atol=1e-10, rtol=0)

