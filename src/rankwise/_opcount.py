"""Counting what a block of torch code dispatches: every aten op, and the host reads among them.

A *host read* is anything that makes the host wait for a device value: ``.item()``,
``int(t)`` / ``float(t)`` / ``bool(t)`` (all ``aten._local_scalar_dense``), ops whose output
shape depends on the data (``nonzero``, ``masked_select``, ``unique``), and ``Tensor.tolist`` /
``Tensor.numpy`` (on the CPU these read memory without dispatching an op, so they are counted
by wrapping them). On CUDA each is a device→host synchronisation; on the CPU they are free,
which is why they are counted rather than timed: a step written to read nothing on the CPU
reads nothing on a GPU either.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READ_OPS = frozenset({
    "aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
    "aten._unique2.default", "aten.unique_dim.default", "aten.unique_consecutive.default",
    "aten.nonzero_static.default", "aten.is_nonzero.default", "aten.equal.default",
})


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: ...`` then ``c.ops`` (dispatched aten ops), ``c.host_reads``
    (their host reads plus ``tolist`` / ``numpy`` calls) and ``c.by_op`` (a Counter by name).
    ``c.paused()`` stops counting inside, e.g. around a closure's forward and backward;
    ``c.kernel_ops``: the ops that are not views (a proxy for a GPU's kernel launches)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.host_reads = 0
        self.views = 0
        self.kernels_by_op: Counter[str] = Counter()  # the ops that are not views, by name
        self.read_ops: Counter[str] = Counter()
        self._active = True
        self._saved: dict = {}

    @property
    def ops(self) -> int:
        return sum(self.by_op.values())

    @property
    def kernel_ops(self) -> int:
        """The dispatched ops that compute (views excluded: a slice or transpose launches
        nothing on a GPU)."""
        return self.ops - self.views

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._active:
            name = str(func)
            self.by_op[name] += 1
            if getattr(func, "is_view", False):
                self.views += 1
            else:
                self.kernels_by_op[name] += 1
            if name in HOST_READ_OPS:
                self.host_reads += 1
                self.read_ops[name] += 1
        return func(*args, **(kwargs or {}))

    def _wrap(self, name: str):
        orig = getattr(torch.Tensor, name)
        counter = self

        def wrapped(t, *a, **k):
            if counter._active:
                counter.host_reads += 1
                counter.read_ops[f"Tensor.{name}"] += 1
            return orig(t, *a, **k)

        self._saved[name] = orig
        setattr(torch.Tensor, name, wrapped)

    def __enter__(self):
        for name in ("tolist", "numpy"):
            self._wrap(name)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, orig in self._saved.items():
            setattr(torch.Tensor, name, orig)
        self._saved.clear()
        return super().__exit__(*exc)

    class _Pause:
        def __init__(self, c: OpCounter) -> None:
            self.c = c

        def __enter__(self):
            self.prev, self.c._active = self.c._active, False

        def __exit__(self, *exc):
            self.c._active = self.prev

    def paused(self) -> OpCounter._Pause:
        return OpCounter._Pause(self)


def step_counts(opt, closure, *, kernels: bool = False) -> tuple[int, ...]:
    """Count one ``opt.step()`` after ``closure()`` (its forward and backward not counted), then
    one whole ``opt.step(closure)``: (the optimizer's dispatched ops, its host reads, the host
    reads of the whole step), and with `kernels` its ops that are not views last."""
    with OpCounter() as c:
        if getattr(getattr(opt, "settings", None), "single_pass", True):
            with c.paused():
                closure()
            opt.step()
        else:  # two-pass BUG calls the closure itself, twice: its forward and backward not counted

            def paused():
                with c.paused():
                    return closure()

            opt.step(paused)
    with OpCounter() as whole:
        opt.step(closure)
    return (c.ops, c.host_reads, whole.host_reads) + ((c.kernel_ops,) if kernels else ())
