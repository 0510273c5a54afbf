"""The dense weight of a low-rank layer as foreign code sees it: readable, never writable.

A low-rank layer computes ``weight`` from its factors on every access, so a write into it
(``nn.init.zeros_(layer.weight)``, ``layer.weight.data.mul_(2)``, ``layer.weight[0] = 0``,
``F.relu(layer.weight, inplace=True)``) would change a temporary and be lost: the model would
silently stay as it was. :class:`DenseView` refuses such writes in one line; every read
(``F.linear(x, layer.weight)``, ``.shape``, ``.norm()``, autograd through it) works as on a
plain tensor and returns plain tensors.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor

# methods that write into their tensor without a trailing underscore
_WRITES = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                     "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                     "__irshift__", "__imatmul__"})
_HARMLESS = frozenset({"requires_grad_", "retain_grad", "share_memory_"})  # in place, but no values


class DenseView(Tensor):
    """A tensor whose in-place writes (and those into its aliases: ``.data``, ``detach()``,
    views) raise ``RuntimeError`` saying what it is (`what`) and what to edit `instead`; other
    operations return plain tensors."""

    what: str = "this tensor"
    instead: str = ""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__set__":  # a property's setter: only `.data = …` replaces the values
            name = f"{getattr(getattr(func, '__self__', None), '__name__', '')} ="
        # what the call writes into: its first argument (every tensor of it for `_foreach_*_`) for
        # an in-place method or a functional given `inplace=True` (``F.relu(w, inplace=True)``,
        # ``F.dropout``: torch passes it as a keyword), `out=` for any; `buf.copy_(weight)` only
        # reads the view
        inplace = kwargs.get("inplace") is True
        written = (_flat(args[:1]) if args and (_writes(name) or inplace) else []) + _outs(kwargs)
        hit = next((t for t in written if isinstance(t, DenseView)), None)
        if hit is not None:
            op = (f"{name}(inplace=True)" if inplace
                  else f"{name}, out=" if _outs(kwargs) and not _writes(name) else name)
            raise RuntimeError(f"{hit.what} is computed on every read, so writing into it ({op}) would be "
                               f"lost; {hit.instead}")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        views = [a for a in _flat((*args, *kwargs.values())) if isinstance(a, DenseView)]
        if views:  # `.data`, `detach()`, a slice, `unbind()`'s rows: writes there are lost too
            out = _wrap_aliases(out, views)
        return out

    def __reduce_ex__(self, proto: int) -> Any:  # torch.save / pickle: a plain tensor
        return _plain(self).__reduce_ex__(proto)

    def __deepcopy__(self, memo: dict) -> Tensor:
        return copy.deepcopy(_plain(self), memo)


def _plain(t: Tensor) -> Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(Tensor)


def _wrap_aliases(out: Any, views: list) -> Any:
    if isinstance(out, Tensor):
        if type(out) is not DenseView and any(_aliases(out, v) for v in views):
            return as_view(out, views[0].what, views[0].instead)
        return out
    if isinstance(out, (tuple, list)) and any(isinstance(o, Tensor) for o in out):
        return type(out)(_wrap_aliases(o, views) for o in out)
    return out


def _writes(name: str) -> bool:
    if name in _HARMLESS:
        return False
    return name in _WRITES or name == "data =" or (name.endswith("_") and not name.endswith("__"))


def _flat(items: tuple) -> list:
    """`items` with lists and tuples opened one level (``torch.cat([w, …])``, ``_foreach_mul_``)."""
    return [x for a in items for x in (a if isinstance(a, (list, tuple)) else (a,))]


def _outs(kwargs: dict) -> list:
    out = kwargs.get("out")
    return [] if out is None else list(out) if isinstance(out, (tuple, list)) else [out]


def _aliases(a: Tensor, b: Tensor) -> bool:
    if a.device.type == "meta" or b.device.type == "meta" or a.numel() == 0:
        return False
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except RuntimeError:  # a tensor without storage (e.g. a functional wrapper)
        return False


def as_view(t: Tensor, what: str, instead: str) -> Tensor:
    """`t` (still attached to its autograd graph) as a :class:`DenseView`: `what` it is, and
    what a user should edit `instead` (both for the error a write raises). Under
    ``torch.compile`` `t` itself (dynamo does not trace this subclass)."""
    if getattr(torch.compiler, "is_compiling", lambda: False)():
        return t
    with torch._C.DisableTorchFunctionSubclass():
        v = t.as_subclass(DenseView)
    v.what, v.instead = what, instead
    return v
