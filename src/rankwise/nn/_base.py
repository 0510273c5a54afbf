"""The shared shell of low-rank layers: factors U S Vᵀ, the compensation buffer, rank changes."""

from __future__ import annotations

import abc
import contextlib
import sys
import weakref
from typing import Literal

import torch
from torch import Tensor, nn

from ..linalg import truncated_svd, work_dtype
from ._autograd import DenseWeightFn
from ._view import DenseView, as_view

GradMode = Literal["full", "factors", "core"]


_BY_PARAM: weakref.WeakValueDictionary[int, AbstractLowRankLayer] = weakref.WeakValueDictionary()


_CHANGES = [0]  # factor replacements (set_factors, load_state_dict) of any layer so far


def factor_changes() -> int:
    """How many times any low-rank layer's factors were replaced (``set_factors``,
    ``load_state_dict``): an optimizer that sees a change it did not make checks its state."""
    return _CHANGES[0]


def _dynamic_size(t: Tensor) -> Tensor:
    """`t`, its size marked as ``torch._dynamo.maybe_mark_dynamic(t, 0)`` does (dynamic from the first
    compile), without importing torch._dynamo (over a second) where it is not imported yet."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.maybe_mark_dynamic(t, 0)
    else:  # (what maybe_mark_dynamic records on the tensor)
        t._dynamo_weak_dynamic_indices = {0}
        t._has_dynamo_dim_marking = True
    return t


def fsdp_classes() -> tuple[type, ...]:
    """torch's FSDP module classes (``FSDPModule`` of fully_shard, ``FullyShardedDataParallel``)."""
    try:
        from torch.distributed import fsdp
    except ImportError:  # torch built without distributed
        return ()
    names = ("FSDPModule", "FullyShardedDataParallel")
    return tuple(c for c in (getattr(fsdp, n, None) for n in names) if c is not None)


def layer_of(p: Tensor) -> AbstractLowRankLayer | None:
    """The low-rank layer whose U, S or V `p` is (None for any other tensor)."""
    m = _BY_PARAM.get(id(p))
    return m if m is not None and any(t is p for t in (m.U, m.S, m.V)) else None


def orthonormal(rows: int, cols: int, *, generator=None, **kw) -> Tensor:
    q, _ = torch.linalg.qr(torch.randn(rows, cols, generator=generator, **kw))
    return q


def _swap_data(p: nn.Parameter, new: Tensor) -> None:
    """``p.data = new`` that also works when the shape changes while an old autograd graph is
    still alive (e.g. a user kept a non-detached loss): autograd caches one gradient
    accumulator per leaf, with the shape it had when created, and ``.data`` assignment only
    drops that cache on a dtype or device change. A brief dtype change forces the reset."""
    if new.shape != p.shape:
        other = torch.float16 if new.dtype != torch.float16 else torch.float32
        p.data = torch.empty(0, dtype=other, device=new.device)
    p.data = new


@torch.no_grad()
def write_fixed(layers: list[AbstractLowRankLayer], U: list[Tensor], S: list[Tensor], V: list[Tensor],
                U_buf: list[Tensor], V_buf: list[Tensor]) -> None:
    """``set_factors`` of many fixed-capacity layers at once, in a few ``_foreach`` ops: each layer's
    U (out, r), S (r, r), V (in, r) and buffer U_buf (out, b), V_buf (in, b) into the first columns
    of its tensors, zeros after them; its live rank and buffer width to [r, b]."""
    _CHANGES[0] += 1
    for m, ub in zip(layers, U_buf, strict=True):
        if ub.shape[1]:
            m.reserve_buffer()
    pairs = [(getattr(m, k), new) for k, news in (("U", U), ("S", S), ("V", V))
             for m, new in zip(layers, news, strict=True)]
    pairs += [(buf, new) for m, ub, vb in zip(layers, U_buf, V_buf, strict=True) if m.U_buf.shape[1]
              for buf, new in ((m.U_buf, ub), (m.V_buf, vb))]
    torch._foreach_zero_([dst for dst, _ in pairs])
    torch._foreach_copy_([dst[:new.shape[0], :new.shape[1]] for dst, new in pairs], [new for _, new in pairs])
    live = torch.tensor([[s.shape[0], ub.shape[1]] for s, ub in zip(S, U_buf, strict=True)],
                        dtype=torch.int64)
    torch._foreach_copy_([m.live for m in layers], list(live.to(layers[0].live.device).unbind(0)))
    for m, s, ub in zip(layers, S, U_buf, strict=True):
        m._set_live(s.shape[0], ub.shape[1])
        m.U.grad = m.S.grad = m.V.grad = None


class NotAParameter(TypeError, KeyError):
    """Raised where torch code takes a low-rank module's dense weight view (``weight``, an
    attention's ``in_proj_weight``) for a parameter (to prune, re-parametrise, replace or delete
    it); a ``KeyError`` too, for code that looks it up in ``module._parameters``."""

    def __str__(self) -> str:
        return str(self.args[0])


class _Parameters(dict):
    """A low-rank module's ``_parameters``: asking it for one of its dense views (``"weight" in
    layer._parameters``, ``layer._parameters["weight"]``, ``del …``: how torch.nn.utils.prune,
    weight_norm, spectral_norm, parametrize and torch.func.functional_call reach a module's
    weight) raises :class:`NotAParameter` naming the module and the way out."""

    def __init__(self, *args, what: str, views: frozenset[str]) -> None:
        super().__init__(*args)
        self.what, self.views = what, views

    def refuse(self, name: str) -> NotAParameter:
        return NotAParameter(
            f"{self.what}: its `{name}` is not a parameter but computed from low-rank factors on every "
            "read, so torch helpers that prune, re-parametrise, replace or delete a module's weight "
            "parameter (torch.nn.utils.prune, weight_norm, spectral_norm, parametrize, functional_call / "
            f"stateless with a '{name}' entry, fuse_*_bn_eval, assigning it) cannot act on it: apply them "
            "to a plain copy, rankwise.export(model), or to a factor by name ('U', 'S', 'V'; "
            "functional_call takes '<layer>.U' …)")

    def __contains__(self, key: object) -> bool:
        if key in self.views and not dict.__contains__(self, key):
            raise self.refuse(key)
        return dict.__contains__(self, key)

    def __missing__(self, key: str):
        raise self.refuse(key) if key in self.views else KeyError(key)

    def __delitem__(self, key: str) -> None:
        if key in self.views and not dict.__contains__(self, key):
            raise self.refuse(key)
        dict.__delitem__(self, key)

    def __reduce__(self):  # pickled and deep-copied as a plain dict (the module puts it back)
        return dict, (dict(self),)


class GuardedViews:
    """Mixin (before ``nn.Module``) for modules whose dense weights are read-only views computed
    from factors (`VIEWS`): registering, assigning or deleting a parameter under such a name,
    or registering a view itself under another (``torch.nn.utils.prune``'s ``weight_orig``),
    raises :class:`NotAParameter`, as does looking one up in ``_parameters``."""

    VIEWS: frozenset[str] = frozenset()

    def _guard_parameters(self) -> None:
        """Put the refusing parameter dict (:class:`_Parameters`) in place."""
        if not isinstance(self.__dict__.get("_parameters"), _Parameters):
            self.__dict__["_parameters"] = _Parameters(self._parameters, what=type(self).__name__,
                                                       views=self.VIEWS)

    def _refuse(self, name: str) -> NotAParameter:
        return _Parameters(what=type(self).__name__, views=self.VIEWS).refuse(name)

    def register_parameter(self, name: str, param) -> None:
        if name in self.VIEWS or isinstance(param, DenseView):
            raise self._refuse(name if name in self.VIEWS else name.removesuffix("_orig"))
        super().register_parameter(name, param)

    def __setattr__(self, name: str, value) -> None:  # (`layer.weight = …`, torch.func.functional_call)
        if name in self.VIEWS:
            raise self._refuse(name)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name in self.VIEWS:
            raise self._refuse(name)
        super().__delattr__(name)

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._guard_parameters()


@torch.no_grad()
def from_dense_weight(make, weight: Tensor, bias: Tensor | None, *, rank: int | None,
                      tau: float | None, max_rank: int | None):
    """Shared body of the ``from_dense`` constructors: the truncated SVD of ``weight`` viewed as
    (out, in·…), a layer built by ``make(rank, max_rank)``, factors and bias copied in."""
    W = weight.reshape(weight.shape[0], -1)
    U, s, V = truncated_svd(W.to(work_dtype(W.dtype)), rank=rank, tau=tau)
    r = s.numel()
    layer = make(r, max(r, max_rank) if max_rank else None)
    layer.set_factors(U, torch.diag(s), V)
    if bias is not None:
        layer.bias.copy_(bias)
    return layer


class AbstractLowRankLayer(GuardedViews, nn.Module, abc.ABC):
    """A layer whose weight matrix (out_features, in_features) is ``U S Vᵀ``.

    Parameters: ``U`` (out, r), ``S`` (r, r), ``V`` (in, r), optional ``bias`` (out,).
    Buffers (saved in ``state_dict``): ``U_buf`` (out, b) and ``V_buf`` (in, b), SDLRT's
    compensation buffer of recently discarded directions (b = 0 unless an SDLRT optimizer
    fills it; training-only, never used by ``forward``).

    The rank changes during training. ``state_dict()`` stores the factors at their current
    shapes, and ``load_state_dict()`` resizes this layer's factors to the incoming shapes, so a
    freshly built layer loads a checkpoint of any rank. At a fixed :attr:`capacity` R
    (:meth:`set_capacity`) U (out, R), S (R, R), V (in, R) keep their shapes and storage instead,
    the live rank r in the buffer ``live`` = [r, b], columns beyond it zero; the forward and the
    integrator use :meth:`factors` (the live columns).
    """

    def __init__(self, out_features: int, in_features: int, rank: int, *,
                 max_rank: int | None, bias: bool, device=None, dtype=None) -> None:
        super().__init__()
        full = min(out_features, in_features)
        if not 1 <= rank <= full:
            raise ValueError(
                f"`rank` must be in [1, {full}] for a {out_features}×{in_features} weight; got {rank}"
            )
        if max_rank is not None and not rank <= max_rank:
            raise ValueError(f"`max_rank` must be >= rank ({rank}); got {max_rank}")
        kw = {"device": device, "dtype": dtype}
        self.out_features, self.in_features = out_features, in_features
        self.max_rank = full if max_rank is None else min(max_rank, full)
        self.U = nn.Parameter(torch.empty(out_features, rank, **kw))
        self.S = nn.Parameter(torch.empty(rank, rank, **kw))
        self.V = nn.Parameter(torch.empty(in_features, rank, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        self.register_buffer("U_buf", torch.empty(out_features, 0, **kw))
        self.register_buffer("V_buf", torch.empty(in_features, 0, **kw))
        self.grad_mode: GradMode = "full"
        self._guard_parameters()
        self._register()
        self.reset_parameters()

    # ----------------------------------------------------------------- construction
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The rank-r truncated SVD of the default PyTorch initialisation of the dense weight
        (Kaiming-uniform with a = √5, as nn.Linear / nn.Conv2d), bias as theirs."""
        W = torch.empty(self.out_features, self.in_features, dtype=work_dtype(self.U.dtype))
        nn.init.kaiming_uniform_(W, a=5**0.5)
        r = self.rank
        U, s, V = torch.svd_lowrank(W, q=min(r + 8, min(W.shape)), niter=4)
        self.set_factors(U[:, :r], torch.diag(s[:r]), V[:, :r])
        if self.bias is not None:
            bound = self.in_features**-0.5
            nn.init.uniform_(self.bias, -bound, bound)

    # ----------------------------------------------------------------- factors
    @property
    def rank(self) -> int:
        """Current (live) rank r (an int)."""
        return self.S.shape[0] if self.capacity is None else self._live[0]

    # ----------------------------------------------------------------- fixed capacity
    capacity: int | None = None  # None: U, S, V at the live rank (their shapes change with it)
    _live: tuple[int, int] = (0, 0)  # fixed capacity: (rank r, buffer columns b), on the host
    _point: tuple[Tensor, Tensor, Tensor] | None = None  # two-pass BUG's augmented point (evaluate_at)

    def factors(self) -> tuple[Tensor, Tensor, Tensor]:
        """The live factors (U (out, r), S (r, r), V (in, r)): the parameters themselves, or, at a
        fixed :attr:`capacity`, views of their first r columns (what the forward computes with)."""
        if self._point is not None:
            return self._point
        if self.capacity is None:
            return self.U, self.S, self.V
        r = self._rank_probe.shape[0]  # = self._live[0]; a size, so that torch.compile makes it dynamic
        return self.U[:, :r], self.S[:r, :r], self.V[:, :r]

    def live_grads(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """``.grad`` of U, S, V cut to the live rank (G_K, G_S, G_L in factor mode); None where absent.
        At two-pass BUG's augmented point (:meth:`evaluate_at`), the core gradient there."""
        if self._point is not None:
            return None, self._point[1].grad, None
        if self.capacity is None:
            return self.U.grad, self.S.grad, self.V.grad
        r = self._live[0]
        U, S, V = self.U.grad, self.S.grad, self.V.grad
        return (None if U is None else U[:, :r], None if S is None else S[:r, :r],
                None if V is None else V[:, :r])

    def live_buffer(self) -> tuple[Tensor, Tensor]:
        """SDLRT's compensation buffer (U_buf (out, b), V_buf (in, b)) at its live width b."""
        if self.capacity is None:
            return self.U_buf, self.V_buf
        b = self._live[1]
        return self.U_buf[:, :b], self.V_buf[:, :b]

    def live_params(self) -> int:
        """Parameters of the live factors, (out + in + r)·r (what a compression ratio counts)."""
        r = self.rank
        return (self.out_features + self.in_features + r) * r

    @torch.no_grad()
    def set_capacity(self, capacity: int) -> None:
        """Store U (out, R), S (R, R), V (in, R) (and SDLRT's buffer U_buf (out, R), V_buf (in, R), once an
        SDLRT optimizer reserves it: :meth:`reserve_buffer`) at a fixed capacity R = min(`capacity`, out,
        in) from now on: columns beyond the live rank r (and rows of
        S) are exactly zero, the forward computes at r, and the integrator writes each new rank into
        the same tensors, so the parameters keep their shapes and storage for the life of the layer
        (what DDP's buckets, ``torch.distributed.checkpoint`` and ``torch.compile`` need). The live
        rank and buffer width are host integers, saved as the buffer ``live`` ([r, b]). The rank can
        then grow to R at most (``max_rank`` becomes min(max_rank, R)). Changing the capacity
        (this call again) is a rare, explicit event: a wrapping DDP or an optimizer must be built
        again after it."""
        full = min(self.out_features, self.in_features)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"`capacity` must be an int >= 1; got {capacity!r}")
        R = min(capacity, full)
        if self.rank > R:
            raise ValueError(f"`capacity` {capacity} is below this {self.out_features}×{self.in_features} "
                             f"layer's rank {self.rank}")
        U, S, V = (t.detach().clone() for t in self.factors())
        Ub, Vb = (t.detach().clone() for t in self.live_buffer())
        if Ub.shape[1] > R:  # (a buffer never holds more than the rank's worth of directions)
            Ub, Vb = Ub[:, :R], Vb[:, :R]
        like = self.U
        _swap_data(self.U, like.new_zeros(self.out_features, R))
        _swap_data(self.S, like.new_zeros(R, R))
        _swap_data(self.V, like.new_zeros(self.in_features, R))
        width = R if Ub.shape[1] else 0  # (SDLRT's buffer: reserved at capacity once used, reserve_buffer)
        self.U_buf = like.new_zeros(self.out_features, width)
        self.V_buf = like.new_zeros(self.in_features, width)
        if "live" not in self._buffers:
            self.register_buffer("live", torch.zeros(2, dtype=torch.int64, device=like.device))
        self.capacity = R
        self.max_rank = min(self.max_rank, R)
        self._set_live(0, 0)
        self.set_factors(U, S, V, Ub, Vb)

    def sync_live(self) -> None:
        """Fixed capacity: take the live rank and buffer width from the saved buffer ``live`` (one read
        of the device), after something wrote the layer's tensors in place (DDP's broadcast from rank 0
        at wrapping, ``torch.distributed.checkpoint.load`` into ``model.state_dict()``)."""
        if self.capacity is not None and not self.live.is_meta:
            r, b = (int(v) for v in self.live.tolist())
            if not (1 <= r <= self.capacity and 0 <= b <= self.capacity):
                raise ValueError(f"{type(self).__name__}: its saved live rank and buffer {[r, b]} do not "
                                 f"fit its capacity {self.capacity}")
            self._set_live(r, b)

    @torch.no_grad()
    def reserve_buffer(self) -> None:
        """Fixed capacity: SDLRT's buffer U_buf (out, R), V_buf (in, R) allocated at the capacity (an
        SDLRT optimizer calls this when it is built, so that the layer's shapes are fixed from then on;
        until then a layer holds no buffer columns)."""
        if self.capacity is not None and self.U_buf.shape[1] != self.capacity:
            b = self._live[1]
            U_buf, V_buf = self.U_buf[:, :b].clone(), self.V_buf[:, :b].clone()
            kw = {"dtype": self.U.dtype, "device": self.U.device}  # (plain tensors also under FSDP2)
            self.U_buf = torch.zeros(self.out_features, self.capacity, **kw)
            self.V_buf = torch.zeros(self.in_features, self.capacity, **kw)
            self.U_buf[:, :b], self.V_buf[:, :b] = U_buf, V_buf

    @torch.no_grad()
    def _write_fixed(self, U: Tensor, S: Tensor, V: Tensor, U_buf: Tensor | None,
                     V_buf: Tensor | None) -> None:
        """Fixed capacity: the new factors (and buffer) into the first columns, zeros after them."""
        r, R = S.shape[0], self.capacity
        if S.shape[1] != r or r > R:
            raise ValueError(f"a fixed-capacity layer (capacity {R}) holds a square core of rank <= {R}; "
                             f"got S {tuple(S.shape)} (raise the capacity with set_capacity, a rare, "
                             "explicit event)")
        if U_buf is None:  # (the buffer kept as it is)
            U_buf, V_buf = self.live_buffer()
        if U_buf.shape[1] > R:
            raise ValueError(f"a buffer of {U_buf.shape[1]} columns exceeds this layer's capacity {R}")
        mine = {t.untyped_storage().data_ptr() for t in (self.U, self.S, self.V, self.U_buf, self.V_buf)}
        # (a view of this layer's own tensors would be zeroed before it is copied: copy it first)
        U, S, V, U_buf, V_buf = (t.clone() if t.untyped_storage().data_ptr() in mine else t
                                 for t in (U, S, V, U_buf, V_buf))
        write_fixed([self], [U], [S], [V], [U_buf], [V_buf])

    def _set_live(self, r: int, b: int) -> None:
        """The host's live rank and buffer width, and the rank as the size of an empty meta tensor
        (what the forward slices by: ``torch.compile`` guards on a size and, after one recompile,
        treats it as dynamic, where a plain int attribute would compile a graph for every rank)."""
        self._live = (r, b)
        if getattr(self, "_rank_probe", None) is None or self._rank_probe.shape[0] != r:
            self._rank_probe = _dynamic_size(torch.empty(r, device="meta"))

    def _check_traceable(self) -> None:
        """``torch.fx.symbolic_trace`` records the factors as the layer's parameters: at a fixed
        capacity that would compute at the capacity, not the live rank; refused by name."""
        if self.capacity is not None:
            raise TypeError(f"torch.fx.symbolic_trace of a fixed-capacity {type(self).__name__} is not "
                            "supported (the live rank is a host integer the graph would freeze): trace a "
                            "model converted without `capacity`, or use torch.compile / torch.export")

    @contextlib.contextmanager
    def evaluate_at(self, U: Tensor, S: Tensor, V: Tensor):
        """Within the block, the forward computes with U (out, a), S (a, b), V (in, b) instead of the
        factors, S a fresh leaf whose gradient :meth:`live_grads` returns (two-pass BUG's second
        evaluation, at the augmented point, in core mode). The parameters are not touched."""
        self._point = (U.detach(), S.detach().clone().requires_grad_(True), V.detach())
        try:
            yield
        finally:
            self._point = None

    def weight_matrix(self) -> Tensor:
        """``U S Vᵀ`` as a matrix (out_features, in_features); differentiable, in factor mode with
        the integrator's gradients (:class:`._autograd.DenseWeightFn`)."""
        U, S, V = self.factors()
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in (U, S, V)):
            return U @ S @ V.mT
        return DenseWeightFn.apply(U, S, V, self._factor_mode())

    @abc.abstractmethod
    def dense_weight(self) -> Tensor:
        """The equivalent dense weight in the matching torch layer's shape."""

    @property
    def weight(self) -> Tensor:
        """A read-only dense view, :meth:`dense_weight`, in the shape the matching torch layer's
        ``weight`` has: what code written for ``nn.Linear`` / ``nn.Conv2d`` reads (torch's
        transformer fast path, HF helpers). It is computed on each access and differentiable
        through the factors; it is not a parameter: assigning to it, and writing into it in place
        (``nn.init.*_``, ``.data.mul_``, ``[i] = …``), raise, since the write would be lost
        (:class:`._view.DenseView`).

        In eval mode, read where autograd records nothing (``no_grad``, ``inference_mode``), U S Vᵀ
        is kept until the factors change, so foreign code that reads the view on every call (T5
        reads ``wo.weight.dtype`` in each block, at each step of generation) forms it once: that
        costs the layer's dense size in memory while kept. Each read is a new tensor object.
        Limit: a write into a factor that bypasses its version counter (``layer.S.data.mul_(2)``)
        is not seen by a kept view; in-place ops on the factors and ``set_factors`` are."""
        U, S, V = self.U, self.S, self.V
        if not self._keep_view():
            return self._view()
        key = (factor_changes(), *(id(t) for t in (U, S, V)), *(t._version for t in (U, S, V)),
               *(t.data_ptr() for t in (U, S, V)), U.shape, V.shape, U.dtype, U.device)
        kept = self.__dict__.get("_kept_view")  # (the layer's own: never copied or pickled, see __getstate__)
        if kept is None or kept[0] != key:
            with torch.inference_mode(False), torch.no_grad():  # (never an inference tensor)
                kept = self.__dict__["_kept_view"] = (key, self.dense_weight())
        return as_view(kept[1].detach(), f"{type(self).__name__}.weight ({self._weight_is})",
                       self._edit_instead)

    def _keep_view(self) -> bool:
        """May :attr:`weight` keep its matrix: eval mode, nothing recorded by autograd, plain
        factors (not under ``torch.func`` transforms, forward AD or compile, not subclasses)."""
        U, S, V = self.U, self.S, self.V
        recorded = torch.is_grad_enabled() and (U.requires_grad or S.requires_grad or V.requires_grad)
        if self.training or recorded:
            return False
        if getattr(torch.compiler, "is_compiling", lambda: False)():
            return False
        wrapped = torch._C._functorch.is_functorch_wrapped_tensor
        plain = all(type(t) in (nn.Parameter, Tensor) and not wrapped(t) for t in (U, S, V))
        return plain and torch.autograd.forward_ad._current_level < 0  # (no dual_level() open)

    def _view(self) -> Tensor:
        return as_view(self.dense_weight(), f"{type(self).__name__}.weight ({self._weight_is})",
                       self._edit_instead)

    VIEWS = frozenset({"weight"})  # (GuardedViews: not a parameter name)

    # what `weight` is, and what to edit instead of writing into it (the error of a write)
    _weight_is = "U S Vᵀ of its factors"
    _edit_instead = ("change the factors (`set_factors`), or make the layer dense (`rankwise.export`) before "
                     "editing its weight")

    @torch.no_grad()
    def set_factors(self, U: Tensor, S: Tensor, V: Tensor,
                    U_buf: Tensor | None = None, V_buf: Tensor | None = None) -> None:
        """Replace the factors (and optionally the buffer), possibly changing the rank.

        Parameter objects keep their identity; only their data is swapped, in this layer's
        dtype and device. Shapes: U (out, r), S (r, r), V (in, r), U_buf (out, b), V_buf (in, b).
        (A rectangular core U (out, a), S (a, b), V (in, b) is accepted: two-pass BUG evaluates
        the model once at such an augmented point.)
        """
        a, b = S.shape
        if U.shape != (self.out_features, a) or V.shape != (self.in_features, b):
            raise ValueError(
                f"factor shapes must be U ({self.out_features}, r), S (r, r), V "
                f"({self.in_features}, r); got {tuple(U.shape)}, {tuple(S.shape)}, {tuple(V.shape)}"
            )
        if (U_buf is None) != (V_buf is None) or (U_buf is not None and U_buf.shape[1] != V_buf.shape[1]):
            raise ValueError("U_buf and V_buf must be given together, with the same number of columns")
        like = self.U
        _CHANGES[0] += 1
        if self.capacity is not None:
            self._write_fixed(U, S, V, U_buf, V_buf)
            return
        for p, new in ((self.U, U), (self.S, S), (self.V, V)):
            _swap_data(p, new.to(like).contiguous())
            p.grad = None
        if U_buf is not None and V_buf is not None:
            self.U_buf = U_buf.to(like).contiguous()
            self.V_buf = V_buf.to(like).contiguous()

    def _register(self) -> None:
        """Make :func:`layer_of` find this layer from its U, S and V."""
        for p in (self.U, self.S, self.V):
            _BY_PARAM[id(p)] = self

    def __getstate__(self) -> dict:
        """The module's state without the kept :attr:`weight` view (a copy forms its own)."""
        return {k: v for k, v in super().__getstate__().items() if k not in ("_kept_view", "_stepped")}

    def __setstate__(self, state) -> None:
        """copy.deepcopy and pickle: new U, S, V objects, found by :func:`layer_of`; a copy is
        trained by no optimizer yet, so it starts in plain autograd (``"full"``) mode."""
        super().__setstate__(state)  # (GuardedViews puts the guard back)
        self._register()
        if self.grad_mode != "full":
            self.set_grad_mode("full")
        self._grad_owner = None

    def _apply(self, fn, recurse=True):  # .to() / .cuda() may give new Parameter objects
        out = super()._apply(fn, recurse)
        self.__dict__.pop("_stepped", None)  # (a swapped tensor keeps its object, not its version)
        self._register()
        self.__dict__.pop("_kept_view", None)  # (the kept weight view stays where it was)
        return out

    # ----------------------------------------------------------------- gradient modes
    def set_grad_mode(self, mode: GradMode) -> None:
        """What the backward pass computes (U's, S's and V's ``.grad``).

        - ``"full"``: the true gradients dU, dS, dV (default; any torch optimizer works).
        - ``"factors"``: the integrator's: ``U.grad`` = G_K = ∇W·V (out, r), ``V.grad`` =
          G_L = ∇Wᵀ·U (in, r), ``S.grad`` = G_S = Uᵀ∇W V (r, r) (DLRT/SDLRT set this mode).
        - ``"core"``: only ``S.grad`` (U, V do not require grad; no (out×r) or (in×r) products).

        A frozen layer (``S.requires_grad`` False, e.g. after ``layer.requires_grad_(False)``)
        keeps U's and V's ``requires_grad``: the mode takes effect once it is unfrozen.

        The gradients are ordinary ``.grad`` s, accumulated by autograd, cleared by
        ``zero_grad``; a change of mode drops U's and V's (they would mean something else).
        """
        if mode not in ("full", "factors", "core"):
            raise ValueError(f"`mode` must be 'full', 'factors' or 'core'; got {mode!r}")
        if mode != self.grad_mode:
            self.U.grad = self.V.grad = None
        if mode == "full":  # (released: nothing to check)
            self.__dict__.pop("_stepped", None)
        self.grad_mode = mode
        if self.S.requires_grad:  # a frozen layer stays frozen; the mode applies once it is unfrozen
            self.U.requires_grad_(mode != "core")
            self.V.requires_grad_(mode != "core")

    def factor_grads(self) -> tuple[Tensor | None, Tensor | None]:
        """(G_K (out, r), G_L (in, r)) accumulated since the gradients were last cleared, in factor
        mode (``U.grad``, ``V.grad``); (None, None) in the other modes."""
        if self.grad_mode != "factors":
            return None, None
        return self.U.grad, self.V.grad

    def reset_factor_grads(self) -> None:
        if self.grad_mode == "factors":
            self.U.grad = self.V.grad = None

    def mark_stepped(self, by: str) -> None:
        """Record U's and V's versions after the optimizer that trains this layer (its class name
        `by`) wrote them: a forward in factor mode checks them (:meth:`_factor_mode`). The tensors
        are recorded by ``id``, not by weak reference: ``torch.utils.swap_tensors`` (``.to()`` and
        ``load_state_dict`` under ``set_swap_module_params_on_conversion``, FSDP2) refuses a
        tensor that has one."""
        self.__dict__["_stepped"] = (id(self.U), id(self.V), self.U._version, self.V._version,
                                     factor_changes(), by)

    def _factor_mode(self) -> bool:
        """Whether the backward computes the integrator's factor gradients (``"factors"`` mode).
        A forward with gradients in that mode refuses U or V written in place since the optimizer
        that trains the layer last wrote them, and not by ``set_factors`` / ``load_state_dict``:
        most likely another optimizer stepped them with G_K, G_L, which are not dL/dU, dL/dV (that
        optimizer's step was wrong, and every later one would be). Unchecked: under compile,
        without gradients, at a fixed capacity (loaded in place by DCP: the optimizer's step
        checks it) and for tensors other than the recorded U and V (``functional_call``, FSDP's
        gathered parameters)."""
        if self.grad_mode != "factors":
            return False
        if torch.compiler.is_compiling():  # (first: a traced read of the record would guard on its values)
            return True
        seen = self.__dict__.get("_stepped")
        if seen is None:
            return True
        iU, iV, u, v, changes, by = seen
        U, V = self._parameters.get("U"), self._parameters.get("V")  # (self.U without __getattr__)
        if U is None or V is None or (U._version == u and V._version == v):
            return True  # (the common case, first: a forward pays a dict lookup and two reads)
        if self.capacity is not None or not torch.is_grad_enabled():
            return True
        if id(U) == iU and id(V) == iV and changes == factor_changes():
            raise RuntimeError(
                f"{type(self).__name__}: U or V changed since the {by} that trains this layer last "
                f"stepped, and not by set_factors or load_state_dict: another optimizer stepped it? "
                f"While a {by} trains a layer its U.grad and V.grad hold the factor gradients G_K, G_L "
                f"(not dL/dU, dL/dV), so that step was wrong; call release() on the {by} before "
                "training the layer with another optimizer. To write factors yourself (an EMA swapped "
                "in for evaluation), use load_state_dict or set_factors, which the optimizer follows")
        return True

    # ----------------------------------------------------------------- state dict
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        src = {k: state_dict.get(prefix + k) for k in ("U", "S", "V", "U_buf", "V_buf")}
        _CHANGES[0] += 1
        live = state_dict.get(prefix + "live")  # saved at a fixed capacity: [rank, buffer columns]
        if all(src[k] is not None for k in ("U", "S", "V")):
            self._check_loaded_shapes(prefix, src)
            fits = (live is not None and self.capacity is not None
                    and tuple(src["S"].shape) == tuple(self.S.shape)
                    and (src["U_buf"] is None or tuple(src["U_buf"].shape) == tuple(self.U_buf.shape)))
            if not fits and (live is not None or self.capacity is not None):  # another layout or capacity
                state_dict = self._relaid(state_dict, prefix, src, live)
                src = {k: state_dict.get(prefix + k) for k in src}
                if self.capacity is not None and src["U_buf"].shape[1]:
                    self.reserve_buffer()  # (a saved buffer in use: this layer's at capacity too)
            if self.capacity is None:
                a, b = src["S"].shape
                _swap_data(self.U, self.U.new_empty(self.out_features, a))
                _swap_data(self.S, self.S.new_empty(a, b))
                _swap_data(self.V, self.V.new_empty(self.in_features, b))
        if self.capacity is None and src["U_buf"] is not None and src["V_buf"] is not None:
            b = src["U_buf"].shape[1]
            self.U_buf = self.U_buf.new_empty(self.out_features, b)
            self.V_buf = self.V_buf.new_empty(self.in_features, b)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        self._register()  # load_state_dict(assign=True) puts new Parameter objects in place
        self.sync_live()

    def _relaid(self, state_dict, prefix: str, src: dict, live: Tensor | None) -> dict:
        """This module's entries of `state_dict` in this layer's layout: saved at a fixed capacity
        (`live` = [r, b]) cut to the live rank; into a fixed capacity, zero-padded to it (a rank
        above it is refused). Only this module's own entries are returned (children load theirs
        from the original)."""
        if live is not None:
            r, b = (int(v) for v in live.tolist())
            R = src["S"].shape[0]
            bufs = src["U_buf"] is not None and src["V_buf"] is not None
            if not (1 <= r <= R and 0 <= b <= (src["U_buf"].shape[1] if bufs else 0)):
                raise ValueError(f"{prefix or type(self).__name__ + '.'}: saved live rank and buffer "
                                 f"{[r, b]} do not fit its saved capacity {R}")
            src = {"U": src["U"][:, :r], "S": src["S"][:r, :r], "V": src["V"][:, :r],
                   "U_buf": src["U_buf"][:, :b] if bufs else None,
                   "V_buf": src["V_buf"][:, :b] if bufs else None}
        own = {prefix + n: state_dict[prefix + n] for n in (*self._parameters, *self._buffers)
               if prefix + n in state_dict}
        own.pop(prefix + "live", None)
        if self.capacity is None:
            return {**own, **{prefix + k: v for k, v in src.items() if v is not None}}
        R, (r, b) = self.capacity, tuple(src["S"].shape)
        c = 0 if src["U_buf"] is None else src["U_buf"].shape[1]
        if r != b or r > R or c > R:
            raise ValueError(f"{prefix or type(self).__name__ + '.'}: saved rank {r} (buffer {c}) does not "
                             f"fit this layer's fixed capacity {R}: raise it with set_capacity before "
                             "loading")

        def pad(t: Tensor | None, rows: int, cols: int) -> Tensor:
            out = t.new_zeros(rows, cols) if t is not None else self.U.new_zeros(rows, cols)
            if t is not None:
                out[:t.shape[0], :t.shape[1]] = t
            return out

        width = R if c or self.U_buf.shape[1] else 0  # (the buffer at capacity once it is used)
        return {**own, prefix + "U": pad(src["U"], self.out_features, R), prefix + "S": pad(src["S"], R, R),
                prefix + "V": pad(src["V"], self.in_features, R),
                prefix + "U_buf": pad(src["U_buf"], self.out_features, width),
                prefix + "V_buf": pad(src["V_buf"], self.in_features, width),
                prefix + "live": torch.tensor([r, c], dtype=torch.int64)}

    def _check_loaded_shapes(self, prefix: str, src: dict) -> None:
        """Saved factors of a rank this layer can hold, U (out, a), S (a, b), V (in, b), and a buffer
        U_buf (out, c), V_buf (in, c), checked before anything is allocated (a file declaring rank
        2³¹ would otherwise allocate hundreds of GB)."""
        full = min(self.out_features, self.in_features)
        shapes = {k: tuple(t.shape) for k, t in src.items() if t is not None}
        S = shapes["S"]
        ok = (len(S) == 2 and all(1 <= n <= full for n in S)
              and shapes["U"] == (self.out_features, S[0]) and shapes["V"] == (self.in_features, S[1]))
        if ok and "U_buf" in shapes and "V_buf" in shapes:
            ub, vb = shapes["U_buf"], shapes["V_buf"]
            ok = (len(ub) == 2 and len(vb) == 2 and ub[0] == self.out_features and vb[0] == self.in_features
                  and ub[1] == vb[1] <= full)
        if not ok:
            raise ValueError(f"{prefix or type(self).__name__ + '.'}: saved factors of shapes "
                             f"{', '.join(f'{k} {v}' for k, v in shapes.items())} do not fit this "
                             f"{self.out_features}×{self.in_features} layer: U (out, r), S (r, r), V (in, r) "
                             f"with 1 <= r <= {full}")

    def __prepare_scriptable__(self):
        """``torch.jit.script`` calls this first: refuse by name (the backward is a custom
        ``autograd.Function``, which TorchScript cannot compile)."""
        raise TypeError(f"torch.jit.script cannot compile {type(self).__name__} (its backward is a custom "
                        "autograd.Function): script rankwise.export(model), a plain-PyTorch copy, or use "
                        "torch.jit.trace / torch.export, which work on the low-rank model itself")

    def extra_repr(self) -> str:
        fixed = "" if self.capacity is None else f", capacity={self.capacity}"
        return (f"in={self.in_features}, out={self.out_features}, rank={self.rank}, "
                f"max_rank={self.max_rank}{fixed}, bias={self.bias is not None}")


def check_model(model: object, fn: str) -> None:
    """Refuse anything but an ``nn.Module`` (e.g. ``model.parameters()``) in one line."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn} takes the model (an nn.Module), not its parameters or a "
                        f"{type(model).__name__}: call {fn}(model), not {fn}(model.parameters())")
