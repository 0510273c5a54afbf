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

Differentiating the backward (``create_graph=True``: gradient penalties such as WGAN-GP and R1,
``torch.func.grad`` / ``jacrev`` / ``hessian``): the input gradient ``dx = dy U S Vᵀ`` is itself
computed by a low-rank Function (the layer's adjoint) in the same mode, so a loss term on ``dx``
adds ∇_W of that term to the factors in the same form (factor mode: G_K, G_S, G_L; else the true
gradients), and the intermediate ``h`` is recomputed so that the graph reaches x and V.

The Functions use the ``forward`` + ``setup_context`` style with ``generate_vmap_rule`` and a
``jvp``, so ``torch.func.grad``, ``vmap`` (per-sample gradients), ``jacrev``, ``jacfwd`` and
``hessian`` over ``torch.func.functional_call`` work (factor mode has no forward-mode form: a
``jvp`` is the true tangent). Which form runs is chosen per call (:func:`_fn`): plain eager calls
take the same code in the ctx-in-forward style, ``torch.compile`` the form without ``jvp``. Limits
that are torch's own: ``torch.compile`` (aot_autograd, the default) refuses a double backward
in its own words, and Dynamo cannot ``vmap`` a custom Function (run ``torch.func.vmap`` eagerly).

The forwards follow torch's autocast rules as ``nn.Linear`` and ``nn.Conv2d`` do (``F.linear`` /
``F.conv2d`` with the bias), so under autocast the output has the dtype the dense layer's would
have (the bias no longer promotes it to float32).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def _finish(needs, factors, gk_fn, gl_fn, s_fn, S):
    """Shared tail of the backward passes: U's, S's and V's gradients (factor mode: G_K, G_S,
    G_L; else dU = G_K Sᵀ, dS, dV = G_L S). `needs`: whether (U, S, V) need a gradient."""
    need_u, need_s, need_v = needs
    gk = gk_fn() if need_u else None
    gl = gl_fn() if need_v else None
    dS = s_fn() if need_s else None
    if factors:
        return gk, dS, gl
    return (gk @ S.mT if need_u else None), dS, (gl @ S if need_v else None)


def _multilinear_jvp(f, primals, tangents):
    """The forward-mode derivative of ``f``, linear in each of `primals`: the sum of ``f`` with one
    primal replaced by its tangent (None: no tangent)."""
    out = None
    for i, t in enumerate(tangents):
        if t is not None:
            term = f(*primals[:i], t, *primals[i + 1:])
            out = term if out is None else out + term
    return out


def _linear_param_grads(needs, factors, x, dy, U, S, V, h=None):
    """(U, S, V) gradients of ``⟨dy, x (U S Vᵀ)ᵀ⟩`` for x (..., n), dy (..., m); `h` = x V if
    already at hand (else computed, which keeps the graph to x and V when differentiated)."""
    if not any(needs):
        return None, None, None
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    h2 = (x2 @ V) if h is None else h.reshape(-1, h.shape[-1])
    t = dy2 @ U  # (N, r)
    return _finish(needs, factors, lambda: dy2.mT @ h2, lambda: x2.mT @ t, lambda: t.mT @ h2, S)


def _fn(plain):
    """Which form of the Function `plain` to apply: `plain` itself under ``torch.compile`` /
    ``torch.export`` (Dynamo breaks the graph at a Function that defines ``jvp``); under torch.func
    transforms the subclass with a ``jvp`` (forward mode: ``jacfwd``, ``hessian``); else, in plain
    eager, the same Function in the ctx-in-forward style (with the ``jvp``), since torch binds the
    arguments with ``inspect.signature`` on every call of a ``setup_context`` Function (its cost:
    docs/lowrank.md, "Choices made on a measurement")."""
    if torch.compiler.is_compiling():
        return plain
    fwd, eager = _VARIANTS[plain]
    return fwd if torch._C._are_functorch_transforms_active() else eager


def _save(ctx, *tensors):
    """The same tensors for the backward and the forward mode: torch's generated vmap rule keeps
    one record of the saved tensors' batch dims for both; and their device, for _no_autocast."""
    ctx.save_for_backward(*tensors)
    ctx.save_for_forward(*tensors)
    ctx.device_type = tensors[1].device.type


def _no_autocast(backward):
    """`backward` run with autocast off: it works in the factors' dtype, also when the backward
    runs inside an autocast region (``torch.autograd.grad(..., create_graph=True)`` for a gradient
    penalty written inside ``with torch.autocast(...)``), where autocast would mix dtypes."""

    @functools.wraps(backward)
    def wrapped(ctx, *grads):
        if not torch.is_autocast_enabled(ctx.device_type):
            return backward(ctx, *grads)
        with torch.autocast(ctx.device_type, enabled=False):
            return backward(ctx, *grads)

    return wrapped


def _setup_layer(ctx, inputs: tuple, output) -> None:
    """A layer Function's ``setup_context``: inputs (x, U, S, V, bias, factors, keep_h); with
    `keep_h` the output is (y, h = x V), h saved and not differentiable."""
    x, U, S, V, bias, factors, keep_h = inputs
    if keep_h:
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)
        _save(ctx, x, U, S, V, output[1])
    else:
        _save(ctx, x, U, S, V)
    ctx.factors, ctx.has_bias, ctx.keep_h = factors, bias is not None, keep_h


def _backward_start(ctx, dy: torch.Tensor, input_grad):
    """A layer Function's backward up to its parameter gradients: the saved x, U, S, V and dy in
    the factors' dtype (under autocast the forward ran in lower precision), the input's gradient
    ``input_grad(ctx, dy, U, S, V, x, differentiated)`` in x's dtype where needed
    (`differentiated`: the backward is itself differentiated, create_graph=True or torch.func:
    the adjoint as a Function), and the saved h = x V where it may be reused (None otherwise)."""
    x_in, U, S, V, *h = ctx.saved_tensors
    x, dy = x_in.to(U.dtype), dy.to(U.dtype)
    differentiated = torch.is_grad_enabled()
    dx = input_grad(ctx, dy, U, S, V, x, differentiated).to(x_in.dtype) if ctx.needs_input_grad[0] else None
    h = h[0].to(U.dtype) if h and not differentiated else None
    return x, dy, U, S, V, h, dx


def _linear_dx(ctx, dy, U, S, V, x, differentiated):
    """dx = dy U S Vᵀ; differentiated: dy (V Sᵀ Uᵀ)ᵀ as the adjoint layer, whose backward gives U,
    S, V gradients of the same kind (G_K, G_S, G_L in factor mode)."""
    if differentiated:
        return _fn(_LinearFn).apply(dy, V, S.mT, U, None, ctx.factors, False)
    return ((dy @ U) @ S) @ V.mT


def _conv_dx(ctx, dy, U, S, V, x, differentiated):
    """The conv's input gradient; differentiated: the adjoint as a Function of the same mode
    (see :func:`_linear_dx`)."""
    if differentiated:
        return _fn(_Conv2dAdjointFn).apply(dy, U, S, V, ctx.factors, tuple(x.shape), *ctx.geom)
    return _conv_input_grad(dy, U, S, V, x.shape, ctx.geom)


class _LinearFn(torch.autograd.Function):
    """``y = (x V Sᵀ) Uᵀ + b``; with `keep_h` it returns (y, h), h = x V non-differentiable and
    saved for the backward (the layers' forward), else y alone and the backward recomputes h (the
    calls made inside a backward: torch's transforms fail on a non-differentiable output there).
    See :class:`LowRankLinearFn`."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, U, S, V, bias, factors: bool, keep_h: bool):
        h = x @ V
        # F.linear with the bias: under autocast the output (and the bias) take the dtype
        # nn.Linear's output has, instead of the bias promoting y back to float32
        y = F.linear(F.linear(h, S), U, bias)
        return (y, h) if keep_h else y

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_layer(ctx, inputs[:7], output)

    @staticmethod
    @_no_autocast
    def backward(ctx, dy, *_dh):
        if dy is None:
            return (None,) * 7
        x, dy, U, S, V, h, dx = _backward_start(ctx, dy, _linear_dx)
        dU, dS, dV = _linear_param_grads(ctx.needs_input_grad[1:4], ctx.factors, x, dy, U, S, V, h)
        db = None
        if ctx.has_bias and ctx.needs_input_grad[4]:
            db = dy.reshape(-1, dy.shape[-1]).sum(0)
        return dx, dU, dS, dV, db, None, None


class _LinearFnFwd(_LinearFn):
    """_LinearFn with forward mode (see :func:`_fn`)."""

    @staticmethod
    def jvp(ctx, dx, dU, dS, dV, db, _factors, _keep_h):
        """Forward mode (``torch.func.jvp``, ``jacfwd``, ``hessian``): y is linear in each of x, U,
        S, V, so its tangent is the sum of the forwards with one of them replaced by its tangent
        (factor mode has no forward-mode form: the true tangent)."""
        x, U, S, V = ctx.saved_tensors[:4]
        dy = _multilinear_jvp(lambda x, U, S, V: F.linear(F.linear(x @ V, S), U), (x, U, S, V),
                              (dx, dU, dS, dV))
        if db is not None:
            dy = db.expand(*x.shape[:-1], -1) if dy is None else dy + db
        return (dy, None) if ctx.keep_h else dy


class LowRankLinearFn:
    """``y = ((x V) Sᵀ) Uᵀ + b`` for x (..., n), U (m, r), S (r, r), V (n, r); `factors`: the
    backward gives (G_K, G_S, G_L) for (U, S, V) instead of their gradients.
    ``LowRankLinearFn.apply(x, U, S, V, bias, factors)`` → y (the autograd Function behind it
    also returns the intermediate x V, which its backward reuses)."""

    @staticmethod
    def apply(x, U, S, V, bias, factors: bool):
        return _fn(_LinearFn).apply(x, U, S, V, bias, factors, True)[0]


def _filters(V, channels, ksize):
    """V (C·kh·kw, r) as r conv filters (r, C, kh, kw)."""
    return V.mT.reshape(V.shape[1], channels, *ksize)


def _conv(x, U, S, V, geom):
    """The low-rank conv without bias: r filters Vᵀ, then the 1×1 conv with U S."""
    ksize, stride, padding, dilation = geom
    h = F.conv2d(x, _filters(V, x.shape[1], ksize), None, stride, padding, dilation)
    return F.conv2d(h, (U @ S)[:, :, None, None])


def _conv_param_grads(needs, factors, x, dy, U, S, V, geom, h=None):
    """(U, S, V) gradients of ``⟨dy, conv(x, U S Vᵀ)⟩`` (the low-rank conv of `geom`); `h`, the
    r-channel conv of x, if already at hand (else computed, keeping the graph to x and V)."""
    if not any(needs):
        return None, None, None
    ksize, stride, padding, dilation = geom
    r = V.shape[1]
    if h is None:
        h = F.conv2d(x, _filters(V, x.shape[1], ksize), None, stride, padding, dilation)
    t = torch.einsum("nmhw,mr->nrhw", dy, U)

    def gl():
        w = torch.nn.grad.conv2d_weight(x, (r, x.shape[1], *ksize), t, stride, padding, dilation)
        return w.reshape(r, -1).mT

    return _finish(needs, factors, lambda: torch.einsum("nmhw,nrhw->mr", dy, h), gl,
                   lambda: torch.einsum("nrhw,nshw->rs", t, h), S)


def _conv_input_grad(dy, U, S, V, x_shape, geom):
    """The adjoint of the low-rank conv: ``dx`` for ``dy``, (U S Vᵀ) reshaped to the kernel."""
    ksize, stride, padding, dilation = geom
    dh = torch.einsum("nrhw,rs->nshw", torch.einsum("nmhw,mr->nrhw", dy, U), S)
    return torch.nn.grad.conv2d_input(x_shape, _filters(V, x_shape[1], ksize), dh, stride, padding,
                                      dilation)


class _Conv2dFn(torch.autograd.Function):
    """The low-rank conv plus bias; with `keep_h` it returns (y, h), h the conv of x with the r
    filters Vᵀ (non-differentiable, saved for the backward), else y alone (see _LinearFn).
    See :class:`LowRankConv2dFn`."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, U, S, V, bias, factors: bool, keep_h: bool, ksize, stride, padding, dilation):
        h = F.conv2d(x, _filters(V, x.shape[1], ksize), None, stride, padding, dilation)
        y = F.conv2d(h, (U @ S)[:, :, None, None], bias)  # (autocast: see _LinearFn)
        return (y, h) if keep_h else y

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_layer(ctx, inputs[:7], output)
        ctx.geom = tuple(inputs[7:])

    @staticmethod
    @_no_autocast
    def backward(ctx, dy, *_dh):
        if dy is None:
            return (None,) * 11
        x, dy, U, S, V, h, dx = _backward_start(ctx, dy, _conv_dx)
        dU, dS, dV = _conv_param_grads(ctx.needs_input_grad[1:4], ctx.factors, x, dy, U, S, V, ctx.geom, h)
        db = dy.sum((0, 2, 3)) if ctx.has_bias and ctx.needs_input_grad[4] else None
        return dx, dU, dS, dV, db, None, None, None, None, None, None


class _Conv2dAdjointFn(torch.autograd.Function):
    """``dx`` = the adjoint of the low-rank conv applied to ``dy``; its backward gives dy the
    low-rank conv of the incoming gradient and (U, S, V) the gradients of the same kind as the
    layer's (G_K, G_S, G_L in factor mode), so that a loss on ``dx`` (a gradient penalty) adds
    to the factors what the integrator reads."""

    generate_vmap_rule = True

    @staticmethod
    def forward(dy, U, S, V, factors: bool, x_shape, ksize, stride, padding, dilation):
        return _conv_input_grad(dy, U, S, V, x_shape, (ksize, stride, padding, dilation))

    @staticmethod
    def setup_context(ctx, inputs, output):
        dy, U, S, V, factors, x_shape, *geom = inputs
        _save(ctx, dy, U, S, V)
        ctx.factors, ctx.x_shape, ctx.geom = factors, x_shape, tuple(geom)

    @staticmethod
    @_no_autocast
    def backward(ctx, g):
        dy, U, S, V = ctx.saved_tensors
        g = g.to(U.dtype)
        # ⟨g, A_Wᵀ dy⟩ = ⟨A_W g, dy⟩: dy's gradient is the layer applied to g, W's that of the
        # layer with input g and output gradient dy
        ddy = (_fn(_Conv2dFn).apply(g, U, S, V, None, ctx.factors, False, *ctx.geom)
               if ctx.needs_input_grad[0] else None)
        dU, dS, dV = _conv_param_grads(ctx.needs_input_grad[1:4], ctx.factors, g, dy, U, S, V, ctx.geom)
        return ddy, dU, dS, dV, None, None, None, None, None, None


class _Conv2dFnFwd(_Conv2dFn):
    """_Conv2dFn with forward mode (see :func:`_fn`)."""

    @staticmethod
    def jvp(ctx, dx, dU, dS, dV, db, *_):
        """Forward mode: as _LinearFn's, y is linear in each of x, U, S, V."""
        x, U, S, V = ctx.saved_tensors[:4]
        dy = _multilinear_jvp(lambda x, U, S, V: _conv(x, U, S, V, ctx.geom), (x, U, S, V),
                              (dx, dU, dS, dV))
        if db is not None:
            db = db[:, None, None]
            dy = db.expand(x.shape[0], -1, *_conv(x, U, S, V, ctx.geom).shape[2:]) if dy is None else dy + db
        return (dy, None) if ctx.keep_h else dy


class _Conv2dAdjointFnFwd(_Conv2dAdjointFn):
    """_Conv2dAdjointFn with forward mode (see :func:`_fn`)."""

    @staticmethod
    def jvp(ctx, ddy, dU, dS, dV, *_):
        """Forward mode: dx is linear in each of dy, U, S, V."""
        return _multilinear_jvp(lambda *a: _conv_input_grad(*a, ctx.x_shape, ctx.geom),
                                ctx.saved_tensors, (ddy, dU, dS, dV))


class LowRankConv2dFn:
    """A conv with r filters (Vᵀ reshaped) followed by a 1×1 conv with U S; no unfold.
    ``LowRankConv2dFn.apply(x, U, S, V, bias, factors, ksize, stride, padding, dilation)`` → y."""

    @staticmethod
    def apply(x, U, S, V, bias, factors: bool, ksize, stride, padding, dilation):
        return _fn(_Conv2dFn).apply(x, U, S, V, bias, factors, True, ksize, stride, padding,
                                                  dilation)[0]


class _DenseWeightFn(torch.autograd.Function):
    """``W = U S Vᵀ`` (m, n) from U (m, r), S (r, r), V (n, r); `factors`: the backward gives
    (G_K = ∇W·V, G_S = Uᵀ∇W·V, G_L = ∇Wᵀ·U) for (U, S, V), as the layers' own backward does in
    factor mode, so that a loss term on the dense weight adds what the integrator reads."""

    generate_vmap_rule = True

    @staticmethod
    def forward(U, S, V, factors: bool):
        return U @ S @ V.mT

    @staticmethod
    def setup_context(ctx, inputs, output):
        U, S, V, factors = inputs
        _save(ctx, U, S, V)
        ctx.factors = factors

    @staticmethod
    @_no_autocast
    def backward(ctx, gW):
        U, S, V = ctx.saved_tensors
        need_u, need_s, need_v = ctx.needs_input_grad[:3]
        gk = gW @ V if (need_u or need_s) else None
        dS = U.mT @ gk if need_s else None
        gl = gW.mT @ U if need_v else None
        if ctx.factors:
            return (gk if need_u else None), dS, gl, None
        return (gk @ S.mT if need_u else None), dS, (gl @ S if need_v else None), None


class _DenseWeightFnFwd(_DenseWeightFn):
    """_DenseWeightFn with forward mode (see :func:`_fn`)."""

    @staticmethod
    def jvp(ctx, dU, dS, dV, _factors):
        """Forward mode: W is linear in each of U, S, V."""
        return _multilinear_jvp(lambda U, S, V: U @ S @ V.mT, ctx.saved_tensors, (dU, dS, dV))


class DenseWeightFn:
    """``DenseWeightFn.apply(U, S, V, factors)`` → W = U S Vᵀ; see :class:`_DenseWeightFn`."""

    @staticmethod
    def apply(U, S, V, factors: bool):
        return _fn(_DenseWeightFn).apply(U, S, V, factors)


def _eager(cls, name):
    """`cls` (forward + setup_context) as a Function with the ctx in its forward, named `name`."""

    def forward(ctx, *args):
        out = cls.forward(*args)
        cls.setup_context(ctx, args, out)
        return out

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(cls.backward),
        "jvp": staticmethod(cls.jvp), "__doc__": cls.__doc__})


# plain Function → (its subclass with a jvp, the ctx-in-forward form); see _fn
_VARIANTS = {plain: (fwd, _eager(fwd, name)) for plain, fwd, name in (
    (_LinearFn, _LinearFnFwd, "LowRankLinearFn"),
    (_Conv2dFn, _Conv2dFnFwd, "LowRankConv2dFn"),
    (_Conv2dAdjointFn, _Conv2dAdjointFnFwd, "LowRankConv2dAdjointFn"),
    (_DenseWeightFn, _DenseWeightFnFwd, "DenseWeightFn"),
)}
