"""Autograd for ``y = x W^T`` with ``W = U S V^T``, returning the integrator's gradients.

The backward pass forms the two "factor gradients" that the basis-update & Galerkin
integrator needs, with no division by S:

    G_K = ∇_W L · V   (m, r)   the gradient of K = U S,
    G_L = ∇_W Lᵀ · U  (n, r)   the gradient of L = V Sᵀ,

and from them the true parameter gradients dU = G_K Sᵀ, dV = G_L S, dS = Uᵀ ∇_W L V
(r×r products, cheap). In *factor mode* (``factors=True``, the mode DLRT/SDLRT set) the
backward returns G_K as U's gradient and G_L as V's (they have U's and V's shapes), so that
autograd accumulates them into ``U.grad`` and ``V.grad`` exactly as it accumulates any
``.grad``: only a ``backward()`` that reaches the layer's parameters adds to them
(``torch.autograd.grad(loss, x)`` does not), ``zero_grad`` clears them, ``GradScaler.unscale_``
and ``clip_grad_norm_`` scale them and gradient accumulation sums them. Plain autograd users
(``factors=False``) get the true gradients dU, dV.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _finish(ctx, gk_fn, gl_fn, t_h, S):
    """Shared tail of both backward passes: U's, S's and V's gradients (factor mode: G_K, G_S,
    G_L; else dU = G_K Sᵀ, dS, dV = G_L S)."""
    need_u, need_s, need_v = ctx.needs_input_grad[1:4]
    gk = gk_fn() if need_u else None
    gl = gl_fn() if need_v else None
    if ctx.factors:
        return gk, (t_h if need_s else None), gl
    dU = gk @ S.mT if need_u else None
    dV = gl @ S if need_v else None
    return dU, (t_h if need_s else None), dV


class LowRankLinearFn(torch.autograd.Function):
    """``y = ((x V) Sᵀ) Uᵀ + b`` for x (..., n), U (m, r), S (r, r), V (n, r); `factors`: the
    backward gives (G_K, G_S, G_L) for (U, S, V) instead of their gradients."""

    @staticmethod
    def forward(ctx, x, U, S, V, bias, factors: bool):
        h = x @ V
        y = (h @ S.mT) @ U.mT
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x, U, S, V, h)
        ctx.factors = factors
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x_in, U, S, V, h = ctx.saved_tensors
        # under autocast the forward ran in lower precision: do the backward in the factors' dtype
        x, h, dy = x_in.to(U.dtype), h.to(U.dtype), dy.to(U.dtype)
        x2, h2, dy2 = x.reshape(-1, x.shape[-1]), h.reshape(-1, h.shape[-1]), dy.reshape(-1, dy.shape[-1])
        t = dy2 @ U  # (N, r)
        dx = ((t @ S) @ V.mT).reshape(x.shape).to(x_in.dtype) if ctx.needs_input_grad[0] else None
        dU, dS, dV = _finish(ctx, lambda: dy2.mT @ h2, lambda: x2.mT @ t, t.mT @ h2, S)
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[4] else None
        return dx, dU, dS, dV, db, None


class LowRankConv2dFn(torch.autograd.Function):
    """A conv with r filters (Vᵀ reshaped) followed by a 1×1 conv with U S; no unfold."""

    @staticmethod
    def forward(ctx, x, U, S, V, bias, factors: bool, ksize, stride, padding, dilation):
        filt = V.mT.reshape(V.shape[1], x.shape[1], *ksize)
        h = F.conv2d(x, filt, None, stride, padding, dilation)
        y = F.conv2d(h, (U @ S)[:, :, None, None], bias)
        ctx.save_for_backward(x, U, S, V, h)
        ctx.factors, ctx.has_bias = factors, bias is not None
        ctx.geom = (ksize, stride, padding, dilation)
        return y

    @staticmethod
    def backward(ctx, dy):
        x_in, U, S, V, h = ctx.saved_tensors
        x, h, dy = x_in.to(U.dtype), h.to(U.dtype), dy.to(U.dtype)  # see LowRankLinearFn
        ksize, stride, padding, dilation = ctx.geom
        r = V.shape[1]
        t = torch.einsum("nmhw,mr->nrhw", dy, U)
        dx = None
        if ctx.needs_input_grad[0]:
            dh = torch.einsum("nrhw,rs->nshw", t, S)
            filt = V.mT.reshape(r, x.shape[1], *ksize)
            dx = torch.nn.grad.conv2d_input(x.shape, filt, dh, stride, padding, dilation).to(x_in.dtype)

        def gl():
            w = torch.nn.grad.conv2d_weight(x, (U.shape[1], x.shape[1], *ksize), t, stride, padding,
                                            dilation)
            return w.reshape(U.shape[1], -1).mT

        dU, dS, dV = _finish(
            ctx, lambda: torch.einsum("nmhw,nrhw->mr", dy, h), gl,
            torch.einsum("nrhw,nshw->rs", t, h), S,
        )
        db = dy.sum((0, 2, 3)) if ctx.has_bias and ctx.needs_input_grad[4] else None
        return dx, dU, dS, dV, db, None, None, None, None, None


class DenseWeightFn(torch.autograd.Function):
    """``W = U S Vᵀ`` (m, n) from U (m, r), S (r, r), V (n, r); `factors`: the backward gives
    (G_K = ∇W·V, G_S = Uᵀ∇W·V, G_L = ∇Wᵀ·U) for (U, S, V), as the layers' own backward does in
    factor mode, so that a loss term on the dense weight adds what the integrator reads."""

    @staticmethod
    def forward(ctx, U, S, V, factors: bool):
        ctx.save_for_backward(U, S, V)
        ctx.factors = factors
        return U @ S @ V.mT

    @staticmethod
    def backward(ctx, gW):
        U, S, V = ctx.saved_tensors
        need_u, need_s, need_v = ctx.needs_input_grad[:3]
        gk = gW @ V if (need_u or need_s) else None
        dS = U.mT @ gk if need_s else None
        gl = gW.mT @ U if need_v else None
        if ctx.factors:
            return (gk if need_u else None), dS, gl, None
        return (gk @ S.mT if need_u else None), dS, (gl @ S if need_v else None), None

