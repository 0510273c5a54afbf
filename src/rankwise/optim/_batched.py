r"""The optimizer's step, batched over layer groups, with one host read.

:class:`~rankwise.AugmentedBUG` calls :func:`augmenting_step` at an augmentation and
:func:`core_step` between augmentations, on one process or data parallel. Layers of one shape
(out, in), **rank bucket** (:func:`._step.rank_bucket`), buffer bucket, dtype, device and
optimizer-state layout form a group: their factors, gradients and moments are stacked,
zero-padded to the group's largest rank and buffer, and integrated by the pure functions of
:mod:`._step` (rule, augment, core, SVD, tolerance ranks), so the number of groups is bounded
by shapes × buckets, not by distinct ranks. How the new ranks are chosen is the optimizer's
truncation strategy's (:mod:`._truncation`: on the device, from the host, what a layer keeps).
Then every layer's new rank, its core size and the finiteness flags (and, under a
:class:`Budget`, the spectra) reach the host in **one** transfer, one typed record
(:class:`._readback.ReadBack`); the host cuts each layer's new factors and moments from the group's and writes
them back, with one ``torch._foreach_copy_`` per kind where a layer's shapes did not change.
A layer whose fixed-width augmentation failed (its Cholesky factorisation; not expected after
the eigen filter) or, with SDLRT's buffer, that needs more new directions than its group made
room for (:func:`_width`) sends the step, before anything is written, to a retry with room
for every direction, no padding and Householder QR where Cholesky fails (one more host
read). Dense parameters take their rule with ``torch._foreach_*`` ops.

Between augmentations (:func:`core_step`) nothing is read back: a non-finite loss or gradient
leaves weights and moments as they were (``torch.where`` on the device), and the number of
such skipped steps is reported (warning or error, as `on_nonfinite` says) at the next
augmentation.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..linalg import work_dtype
from ..nn._base import write_fixed
from . import _closure, _integrators, _step, functional
from ._readback import ReadBack
from .parallel import _shard
from .parallel._fsdp import is_dtensor
from .parallel._replicas import _all_finite_flag, core_slot
from .rules._rules import State, foreach_update, weight_scale

_MOMENTS = ("m", "v")


def _signature(state: State) -> tuple:
    """What a rule's state must share to be stacked: which moments it holds, its step and where
    its moments restarted."""
    return (tuple(k for k in _MOMENTS if state.get(k) is not None), state.get("step"), state.get("m_from"),
            state.get("v_from"))


def _stack(ts: list[Tensor], dt: torch.dtype) -> Tensor:
    """Tensors of up to two dimensions as one batch (N, ...) in `dt`, each zero-padded at the end
    of its dimensions to the largest (layers of several ranks in one group)."""
    shape = tuple(max(t.shape[d] for t in ts) for d in range(ts[0].ndim))
    if all(tuple(t.shape) == shape for t in ts):
        return torch.stack(ts).to(dt)
    out = ts[0].new_zeros(len(ts), *shape, dtype=dt)
    torch._foreach_copy_(_rows(out, [tuple(t.shape) for t in ts]), ts)
    return out


def _rows(batch: Tensor, shapes: list[tuple[int, ...]]) -> list[Tensor]:
    """Row i of `batch` (N, ...) cut to shapes[i] (views)."""
    out = []
    for r, sh in zip(batch.unbind(0), shapes, strict=True):
        for d, n in enumerate(sh):
            r = r if r.shape[d] == n else r.narrow(d, 0, n)
        out.append(r)
    return out


RULE_KEYS = ("m", "v", "step", "m_from", "v_from")
"""A rule's state entries (:mod:`._rules`): the moments, Adam's step count and the steps at which
a moment restarted (``moments="reset_m"``/``"reset_v"``). The optimizer's
state is torch's, flat: K's rule state under U, L's under V, S's under S, beside the layer's
counters (``r_init``, ``tau``, ``augmentations``, ...)."""


def _rule_states(opt: Optimizer, layers: list, key: str) -> list[State]:
    """The rule states of K (`key` ``"K"``: under U), L (under V) or S of `layers`; at a fixed
    capacity, each moment's live part (its storage is at the capacity, :func:`_capacity_shape`)."""
    out = []
    for m in layers:
        st = {k: v for k, v in opt.state[getattr(m, _HOLDER[key])].items() if k in RULE_KEYS}
        if m.capacity is not None:
            a, b = _live_shape(m, key)
            st = {k: v[:a, :b] if k in _MOMENTS and torch.is_tensor(v) else v for k, v in st.items()}
        out.append(st)
    return out


_HOLDER = {"K": "U", "L": "V", "S": "S"}


def _live_shape(m, key: str) -> tuple[int, int]:
    """The shape of a layer's K (out, r), L (in, r) or S (r, r) at its live rank."""
    return {"K": (m.out_features, m.rank), "L": (m.in_features, m.rank), "S": (m.rank, m.rank)}[key]


def _capacity_shape(m, key: str) -> tuple[int, int] | None:
    """At a fixed capacity R, where a layer's K, L or S moments are stored: (out, R), (in, R),
    (R, R), the parameter's shape; None for a layer at its live shapes."""
    return None if m.capacity is None else tuple(getattr(m, _HOLDER[key]).shape)


def _put_rule_states(opt: Optimizer, layers: list, key: str, new: State | None,
                     shapes: list[tuple[int, ...]]) -> None:
    """Write a stacked rule state (None: reset, the entries removed) into each layer's state.
    At a fixed capacity an entry is never removed: a moment restarts as zeros (what the rules
    take an absent one for, bit for bit) and a count as 0, so that the state keeps its keys and
    shapes (what ``torch.distributed.checkpoint`` loads into)."""
    targets = [opt.state[getattr(m, _HOLDER[key])] for m in layers]
    caps = [_capacity_shape(m, key) for m in layers]
    for t, cap in zip(targets, caps, strict=True):
        for k in [k for k in t if k in RULE_KEYS and (new is None or k not in new)]:
            if cap is None:
                del t[k]
            elif torch.is_tensor(t[k]):
                t[k].zero_()
            else:
                t[k] = 0
    if new is not None:
        _write_states(targets, new, shapes, caps)


def _stack_states(states: list[State], dt: torch.dtype) -> State:
    """Per-layer rule states of one signature as one state of stacked (zero-padded) moments."""
    out = {k: v for k, v in states[0].items() if k not in _MOMENTS}
    for k in _MOMENTS:
        if states[0].get(k) is not None:
            out[k] = _stack([s[k] for s in states], dt)
    return out


def _write_states(targets: list[State], new: State, shapes: list[tuple[int, ...]],
                  caps: list[tuple[int, int] | None] | None = None) -> None:
    """Write a stacked state (N, ...) into N per-layer state dicts, row i cut to shapes[i]: into
    their tensors in one ``_foreach_copy_`` where every tensor is there with that shape and
    dtype, else as fresh per-layer tensors (own storage: a view would save the whole batch).
    Where ``caps[i]`` is a shape (a fixed capacity), the moment is stored at that shape: its
    first rows and columns get the row, the rest zeros."""
    caps = caps or [None] * len(targets)
    for k, v in new.items():
        if k not in _MOMENTS:
            for t in targets:
                t[k] = v
            continue
        old = [t.get(k) for t in targets]
        rows = _rows(v, shapes)
        if all(c is None for c in caps) and all(o is not None and o.shape == r.shape and o.dtype == r.dtype
                                                for o, r in zip(old, rows, strict=True)):
            torch._foreach_copy_(old, rows)
            continue
        held, live = [], []  # (fixed capacity: zeroed, then the live part copied in, two ops for all)
        for t, o, r, cap in zip(targets, old, rows, caps, strict=True):
            if cap is None:
                t[k] = r.clone()
                continue
            if o is None or tuple(o.shape) != cap or o.dtype != r.dtype:
                o = t[k] = r.new_zeros(cap)
            held.append(o)
            live.append(r)
        if held:
            torch._foreach_zero_(held)
            torch._foreach_copy_([o[:r.shape[0], :r.shape[1]] for o, r in zip(held, live, strict=True)], live)


def _dense_params(opt: Optimizer) -> list[Tensor]:
    return [p for g in opt.param_groups for p in g["params"]
            if id(p) not in opt._factor_ids and p.grad is not None]


def inputs_finite(opt: Optimizer, loss, device: torch.device) -> Tensor:
    """Device bool: the loss and every dense ``.grad`` are finite (layers' gradients: per group)."""
    tensors = [p.grad for p in _dense_params(opt)]
    if loss is not None:
        tensors.append(torch.as_tensor(loss).detach().reshape(1))
    by_device: dict[tuple, list[Tensor]] = defaultdict(list)
    for t in tensors:  # (FSDP2's DTensor gradients apart from plain tensors: torch's ops take one kind)
        by_device[(t.device, is_dtensor(t))].append(t)
    flag = torch.ones((), dtype=torch.bool, device=device)
    for ts in by_device.values():
        flag = flag & _all_finite_flag(ts, device)
    return flag


def dense_step(opt: Optimizer, ok: Tensor | None = None) -> None:
    """The rule on every dense parameter with a gradient, in ``_foreach`` batches (by device,
    dtype and state layout). `ok` (a device bool, core steps): where False nothing changes."""
    name = opt.settings.rule.name
    groups: dict[tuple, list[Tensor]] = defaultdict(list)
    for p in _dense_params(opt):
        groups[(id(opt._hp_of(p)), p.device, p.dtype, _signature(opt.state[p]))].append(p)
    for params in groups.values():
        states, hp = [opt.state[p] for p in params], opt._hp_of(params[0])
        deltas, new = foreach_update(name, [p.grad for p in params], params, states, hp)
        if ok is not None:
            zero = torch.zeros((), dtype=params[0].dtype, device=params[0].device)
            deltas = [torch.where(ok, d, zero) for d in deltas]
            new = [_unless(ok, n, st) for n, st in zip(new, states, strict=True)]
        torch._foreach_add_(params, deltas)
        for st, n in zip(states, new, strict=True):
            st.update(n)


def _unless(ok: Tensor, new: State, old: State) -> State:
    """`new` with each moment kept from `old` (zeros where `old` has none) where the device bool
    `ok` is False: a skipped step leaves the moments as they were, with no host read."""
    out = dict(new)
    for k in _MOMENTS:
        if new.get(k) is not None:
            before = old[k] if old.get(k) is not None else torch.zeros((), dtype=new[k].dtype,
                                                                          device=new[k].device)
            out[k] = torch.where(ok, new[k], before)
    return out


class _Group:
    """One group: its layers (``names``, in order), their own ranks ``r`` and buffer sizes
    ``b``, the stacked inputs and the step planned by :mod:`.functional`. `full`: room for
    every new direction and Householder QR where a Cholesky factorisation fails (the retry of
    a step whose fixed-width augmentation failed for some layer)."""

    def __init__(self, opt: Optimizer, names: list[str], reorth: bool, two_pass: bool = False,
                 full: bool = False) -> None:
        cfg = opt.settings
        self.opt, self.names, self.plan_two_pass = opt, names, two_pass
        self.layers = layers = [opt.layers[n] for n in names]
        self.states = [opt.state[m.S] for m in layers]
        self.r = [m.rank for m in layers]
        self.b = [m.live_buffer()[0].shape[1] if cfg.buffer else 0 for m in layers]
        first = layers[0]
        dt = work_dtype(first.U.dtype)

        def stack(ts: list[Tensor]) -> Tensor:
            return _stack(ts, dt)

        live, grads, bufs = ([m.factors() for m in layers], [m.live_grads() for m in layers],
                             [m.live_buffer() for m in layers])
        f = _integrators.Factors(*(stack([t[j] for t in live]) for j in range(3)),
                        *(stack([g[j] for g in grads]) for j in range(3)),
                        *(stack([b[j] if cfg.buffer else b[j][:, :0] for b in bufs]) for j in range(2)))
        x = functional.Stack(f, *(_stack_states(_rule_states(opt, layers, k), dt) for k in ("K", "L", "S")),
                    _step.padding(self.r, self.b, dt, first.U.device), opt._fills)
        self.padded = x.pad is not None
        self.hp, self.core_hp = opt._hp_of(first.S), opt._core_hp(first.S)  # (a group is one param group)
        width = _width(self.states) if cfg.buffer and not full else None
        self.plan_device = f.U.device
        self.tolerance = opt.strategy.on_device(opt, self)  # (the numbers for ranks chosen on the device)
        self.two: functional.TwoPass | None = None
        if two_pass:  # the second phase (finish_two_pass) takes the S rule at the augmented point
            self.two = functional.augment(x, opt.rule, self.hp, reorth=reorth, width=width, robust=full)
            return
        self.planned = functional.plan(x, opt.rule, self.hp, self.core_hp, reorth=reorth, width=width,
                                       robust=full, ranks=self.tolerance)
        opt.strategy.reorder(self)

    @property
    def plan(self) -> _step.GroupPlan:
        return self.planned.plan

    @property
    def ranks(self) -> Tensor | None:
        return self.planned.ranks

    @property
    def grads_finite(self) -> Tensor:
        return (self.two or self.planned).grads_finite

    def finish_two_pass(self, G: Tensor) -> None:
        """Two-pass BUG's second phase (:func:`.functional.finish`) on the core gradients G
        (N, ku, kv) measured at the augmented point."""
        self.planned = functional.finish(self.two, G, self.opt.rule, self.core_hp, ranks=self.tolerance)
        self.opt.strategy.reorder(self)


CPU_CHUNK = 2**19
"""On the CPU a group is integrated in chunks of at most this many elements per stacked
augmented basis (N·m·ku): larger temporaries are returned to the system and faulted back in
at every step (glibc's malloc), which can cost more than batching saves (measured in
docs/lowrank.md, "Choices made on a measurement"). Host reads are free there, so only the
dispatched ops grow. On CUDA a group is never split."""


def _chunks(key: tuple, names: list[str]) -> list[list[str]]:
    m, n, r, b, _, device = key[:6]
    if device.type == "cuda":
        return [names]
    per = max(m, n) * (2 * r + b)
    size = max(1, CPU_CHUNK // per)
    return [names[i:i + size] for i in range(0, len(names), size)]


def _width(states: list[State]) -> int | None:
    """How many new directions per side a group's augmentation makes room for: what each
    layer kept last time, doubled, plus 4, the group's largest; ``None`` (all
    of ΔK's columns) before a layer's first augmentation. A layer that then needs more sends
    the step to a retry at full width (and the next step makes room). SDLRT with momentum keeps few
    new directions (ΔK lies mostly in span[U0, U_buf]), so its cores stay near the exact
    path's size instead of 3r. Only with a buffer: without one the full width is 2r, the exact
    path's largest, and ΔK rarely loses directions."""
    seen = [st.get("new_directions") if st.get("augmentations") else None for st in states]
    if any(e is None for e in seen):
        return None
    return max(2 * e + 4 for e in seen)


def _groups(opt: Optimizer, todo: list[str], two_pass: bool, full: bool) -> list[_Group]:
    """The layers in `todo` as groups: one shape, rank bucket (or, `full`, one rank), buffer
    bucket, dtype, device, param group, optimizer-state layout (and, data parallel, owner), in
    CPU-sized chunks. A layer too wide to pad (twice its bucket plus its buffer's above its
    smaller side) is grouped by its own rank. At a fixed capacity the capacity is the bucket: the
    layers of one shape and capacity form one group whatever their ranks (padded to the group's
    largest), so the number of groups and of ops does not grow as the ranks spread."""
    cfg = opt.settings
    keyed: dict[tuple, list[str]] = defaultdict(list)
    for n in todo:
        m, st = opt.layers[n], opt.state[opt.layers[n].S]
        reorth = st.get("augmentations", 0) % 100 == 0 or work_dtype(m.U.dtype) != m.U.dtype
        r, b = m.rank, m.live_buffer()[0].shape[1] if cfg.buffer else 0
        R, B = _step.rank_bucket(r), _step.rank_bucket(b) if b else 0
        if m.capacity is not None:  # (rank and buffer bucketed by the capacity: one group per shape)
            R, B = m.capacity, m.capacity if cfg.buffer else 0
        if not full and min(m.out_features, m.in_features) >= 2 * R + B:
            r, b = R, B
        states = (*(_signature(opt.state[t]) for t in (m.U, m.V, m.S)), "sensitivity" in st)
        # (data parallel: also by owner, so that sharded and replicated runs form the same groups)
        keyed[(m.out_features, m.in_features, r, b, m.U.dtype, m.U.device, reorth, id(opt._hp_of(m.S)),
               None if opt.dp is None else opt.dp.batch_key(n), *states)].append(n)
    return [_Group(opt, chunk, key[6], two_pass, full) for key, names in keyed.items()
            for chunk in _chunks(key, names)]


def augmenting_step(opt: Optimizer, loss, closure=None) -> bool:
    """Augment and truncate every layer with gradients (module docstring). Returns False if the
    step was skipped (non-finite values; nothing written). With a `closure`, two-pass BUG: the
    closure is evaluated again at the augmented point (:func:`_second_pass`). A layer whose
    fixed-width augmentation failed sends the whole step, before anything is written, to one
    retry with room for every new direction and no padding (`full`; one more host read)."""
    full = opt.implementation == "exact"
    while (done := _attempt(opt, loss, closure, full)) is None:
        full = True  # (at full width a failure is an overflow: never a second retry)
    return done


def _attempt(opt: Optimizer, loss, closure, full: bool) -> bool | None:
    """One try of :func:`augmenting_step` at fixed width (or `full`): True (committed), False
    (skipped), None (a fixed-width augmentation failed: nothing written, try again at full)."""
    todo = [n for n, m in opt.layers.items() if m.factor_grads()[0] is not None and m.S.grad is not None]
    groups = _groups(opt, todo, closure is not None, full)
    device = groups[0].layers[0].U.device if groups else next(
        (p.device for p in _dense_params(opt)), torch.device("cpu"))
    ok_in = inputs_finite(opt, loss, device)
    if closure is not None:
        second = _second_pass(opt, groups, closure, loss, device, full)
        if second is None:
            return None
        if second is False:
            return False
        ok_in = ok_in & second
    for g in groups:
        ok_in = ok_in & g.grads_finite.to(device)
    skipped = opt._skipped if opt._skipped is not None else torch.zeros((), device=device)
    fixed = [n for n in todo if opt.layers[n].capacity is not None]
    read = ReadBack.read(ok_in, skipped, groups, spectra=opt.strategy.spectra, scores=opt.strategy.scores,
                         device=device, live=[opt.layers[n].live for n in fixed])
    _check_live(opt, fixed, read.live)
    ok_inputs, n_skipped = read.ok, read.skipped
    for g, got in zip(groups, read.groups, strict=True):
        g.finite, g.failed, g.k, g.new = got.finite, got.failed, got.k, got.new
        g.r1 = got.ranks if got.ranks is not None else list(g.r)
        g.spectra, g.score_lists = got.spectra, got.scores
    overflow = "non-finite augmented core (overflow in the update)"
    bad = None
    if not ok_inputs:  # (sharded: the averaged factor gradients are on their owner only)
        bad = "non-finite loss or gradient" + ("" if loss is None else f" (loss={float(loss)})")
    elif not all(ok for g in groups for ok in g.finite):
        bad = overflow
    # a fixed width too narrow, or a failed factorisation
    failed = bad is None and any(f for g in groups for f in g.failed)
    sharded = opt.dp is not None and opt.dp.owners is not None
    if sharded:  # each rank saw only its own layers; all decide alike
        elsewhere, failed = opt.dp.agree(bad is not None, failed, device)
        bad = bad or ("non-finite update in a layer integrated by another data-parallel rank"
                      if elsewhere else None)
    if failed and not full:
        return None
    bad = overflow if failed else bad
    opt._skipped = None
    if n_skipped:
        opt._nonfinite(f"{n_skipped} step(s) between augmentations had a non-finite loss or gradient and "
                       "changed nothing")
    if bad is not None:
        return opt._nonfinite(bad)
    opt.strategy.from_host(opt, groups)
    for g in groups:
        for st, e in zip(g.states, g.new, strict=True):
            st["new_directions"] = e
        _commit(opt, g)
    if sharded:  # the owners send their layers' results to every rank
        opt.dp.share(todo, opt.state)
    return True


def _check_live(opt: Optimizer, names: list[str], saved: list[tuple[int, int]]) -> None:
    """A fixed-capacity layer whose saved ``live`` [rank, buffer] is not what the host holds had its
    tensors written in place behind its back (``dcp.load`` into ``model.state_dict()`` without
    ``load_state_dict``): its forward ran at the wrong rank. Refused before anything is written."""
    for n, got in zip(names, saved, strict=True):
        if got != tuple(opt.layers[n]._live):
            raise RuntimeError(
                f"layer {n!r}: its saved live rank and buffer {list(got)} differ from the ones it computes "
                f"with {list(opt.layers[n]._live)}: its tensors were written in place (e.g. "
                "torch.distributed.checkpoint.load into model.state_dict()) without load_state_dict; finish "
                "the load with set_state_dict / model.load_state_dict (or call layer.sync_live()); no "
                "weight was changed")


def _second_pass(opt: Optimizer, groups: list[_Group], closure, loss, device: torch.device, full: bool):
    """Two-pass BUG's second evaluation, for every group at once: each layer is set to its
    augmented point (Ū, S̄(0), V̄) (the same weight; fill directions have zero rows), the closure
    runs again in core mode, and each group takes its S rule on the new core gradient
    (:meth:`_Group.finish_two_pass`). The layers get their factors back before returning (the
    commit writes the new ones). One host read first: a non-finite input skips the step; a
    layer whose fixed-width augmentation failed returns None (the caller retries at full
    width; at full width, a failure skips the step as an overflow). Returns a device bool (the
    second loss is finite), False (skipped) or None."""
    flags = [~inputs_finite(opt, loss, device).reshape(1)]
    flags += [(~g.grads_finite).reshape(-1).to(device) for g in groups]
    flags = [torch.cat(flags).any().reshape(1)]
    flags += [g.two.failed.reshape(-1).to(device) for g in groups]
    bad_input, *failed = torch.cat(flags).tolist()  # (the step's first host read)
    failed = any(f > 0 for f in failed)
    sharded = opt.dp is not None and opt.dp.owners is not None
    if sharded:  # each rank saw its own layers only
        bad_input, failed = opt.dp.agree(bool(bad_input), failed, device)
    if bad_input:
        what = "non-finite loss or gradient" + ("" if loss is None else f" (loss={float(loss)})")
        return opt._nonfinite(what)
    if failed:
        return opt._nonfinite("the augmentation failed (non-finite update)") if full else None
    points = {n: (g.two.U[i], g.two.S0[i], g.two.V[i]) for g in groups for i, n in enumerate(g.names)}
    if sharded:  # every rank evaluates the model at every layer's augmented point
        points, opt.dp.shared_bytes = _shard.share_from_owners(points, opt.dp.owners, opt.dp.group, device)
    saved = {p: None if p.grad is None else p.grad.clone()  # every dense parameter: one whose first
             for g in opt.param_groups for p in g["params"]       # gradient comes in pass 2 gets None back
             if id(p) not in opt._factor_ids}
    originals = {n: (opt.layers[n].U.data, opt.layers[n].S.data, opt.layers[n].V.data) for n in points
                 if opt.layers[n].capacity is None}
    elsewhere = False
    try:
        with contextlib.ExitStack() as at:
            for n, (U, S0, V) in points.items():
                if opt.layers[n].capacity is None:
                    opt.layers[n].set_factors(U, S0, V)
                else:  # (a fixed capacity may be narrower than the augmented point: the forward takes it)
                    at.enter_context(opt.layers[n].evaluate_at(U, S0, V))
                opt.layers[n].set_grad_mode("core")
            with torch.enable_grad():
                loss2 = closure()
            grads = _second_grads(opt, groups, points, loss2, closure)
            elsewhere = grads is None
    finally:
        for p, grad in saved.items():
            p.grad = grad
        for n, (U, S, V) in originals.items():
            opt.layers[n].set_factors(U, S, V)
    if elsewhere:
        return opt._nonfinite("non-finite loss on another data-parallel rank")
    for g, G in zip(groups, grads, strict=True):
        g.finish_two_pass(G)
    return torch.isfinite(torch.as_tensor(loss2).detach()).to(device).reshape(())


def _second_grads(opt: Optimizer, groups: list[_Group], points: dict, loss2,
                  closure) -> list[Tensor] | None:
    """The second pass's core gradients per group (N, ku, kv), averaged over a data-parallel group;
    None when another rank's loss was not finite."""
    _closure.check_loss(type(opt).__name__, loss2)
    if not any(p.grad is not None for group in opt.param_groups for p in group["params"]) and not any(
            m._point is not None and m._point[1].grad is not None for m in opt.layers.values()):
        raise RuntimeError(_closure.no_grad_message(type(opt).__name__, closure, " on its second call "
                                                    "(two-pass, `single_pass=False`)"))
    if opt.dp is not None and opt.dp.average([core_slot(opt.layers[n]) for n in points], loss2, first=False):
        return None  # (every rank's core gradients averaged; another rank's loss was not finite)

    def core_grad(m) -> Tensor:
        G = m.live_grads()[1]
        return G if G is not None else torch.zeros_like(m.factors()[1])

    grads = [torch.stack([core_grad(m) for m in g.layers]) for g in groups]
    if opt.ddp is not None and grads:  # DDP saw no parameter in this pass: average the cores' gradients here
        flat = torch.cat([G.reshape(-1) for G in grads])
        torch.distributed.all_reduce(flat, group=opt.ddp.process_group)
        flat /= torch.distributed.get_world_size(opt.ddp.process_group)
        parts = torch.split(flat, [G.numel() for G in grads])
        grads = [f.view(G.shape) for f, G in zip(parts, grads, strict=True)]
    return grads


def _commit(opt: Optimizer, g: _Group) -> None:
    """Truncate a group to its new ranks and write factors, buffers and states back: the new
    bases of every layer from one product (Ū P, V̄ Q at the group's widest rank and buffer),
    each layer's columns cut from it; into the layers' tensors in one ``_foreach_copy_`` where
    a layer's shapes did not change, else as fresh tensors."""
    cfg, r1 = opt.settings, g.r1
    b1 = [min(r, k - r) if cfg.buffer else 0 for r, k in zip(r1, g.k, strict=True)]
    t = functional.truncate(g.planned, r1, b1, moments=cfg.moments_used, two_pass=g.plan_two_pass)
    UP, VQ, S1 = t.U, t.V, t.S
    layers, N = g.layers, len(g.names)
    m_, n_ = layers[0].out_features, layers[0].in_features
    same = [i for i in range(N) if r1[i] == g.r[i] and b1[i] == g.b[i]]
    if same:
        sel = torch.tensor(same, device=UP.device) if len(same) < N else None

        def pick(t: Tensor, sel=sel) -> Tensor:
            return t if sel is None else t.index_select(0, sel)

        live = [layers[i].factors() for i in same]  # (the parameters, or their live columns)
        torch._foreach_copy_([f[0] for f in live], _rows(pick(UP), [(m_, r1[i]) for i in same]))
        torch._foreach_copy_([f[2] for f in live], _rows(pick(VQ), [(n_, r1[i]) for i in same]))
        torch._foreach_copy_([f[1] for f in live], _rows(pick(S1), [(r1[i], r1[i]) for i in same]))
        bufs = [i for i in same if b1[i]]
        if bufs:
            UB = [UP[i, :, r1[i]:r1[i] + b1[i]] for i in bufs]
            VB = [VQ[i, :, r1[i]:r1[i] + b1[i]] for i in bufs]
            held = [layers[i].live_buffer() for i in bufs]
            torch._foreach_copy_([h[0] for h in held] + [h[1] for h in held], UB + VB)
        for i in same:
            m = layers[i]
            m.U.grad = m.S.grad = m.V.grad = None
    changed = [i for i in range(N) if r1[i] != g.r[i] or b1[i] != g.b[i]]
    fixed = [i for i in changed if layers[i].capacity is not None]
    if fixed:  # (into the same tensors, all layers in a few foreach ops)
        write_fixed([layers[i] for i in fixed], [UP[i, :, :r1[i]] for i in fixed],
                    [S1[i, :r1[i], :r1[i]] for i in fixed], [VQ[i, :, :r1[i]] for i in fixed],
                    [UP[i, :, r1[i]:r1[i] + b1[i]] for i in fixed],
                    [VQ[i, :, r1[i]:r1[i] + b1[i]] for i in fixed])
    for i in (i for i in changed if layers[i].capacity is None):
        r, b = r1[i], b1[i]
        layers[i].set_factors(UP[i, :, :r].clone(), S1[i, :r, :r].clone(), VQ[i, :, :r].clone(),
                              UP[i, :, r:r + b].clone(), VQ[i, :, r:r + b].clone())
    states = g.states
    shapes = {"K": [(m_, r) for r in r1], "L": [(n_, r) for r in r1], "S": [(r, r) for r in r1]}
    for key in ("K", "L", "S"):  # reset: the rule starts afresh in the new bases
        new = None if cfg.moments_used == "reset" else t.states[key]
        _put_rule_states(opt, layers, key, new, shapes[key])
    for i, st in enumerate(states):
        opt.strategy.after_commit(opt, g, i, st)
        st["augmentations"] = st.get("augmentations", 0) + 1


def _core_hp(opt: Optimizer, layers: list, dt: torch.dtype) -> dict:
    """The core rule's hyperparameters for a group of cores; under the Muon rule with each
    layer's weight's rate factor (one number, or (N, 1, 1) where the shapes differ)."""
    hp = opt._core_hp(layers[0].S)
    if opt.settings.rule.name != "muon":
        return hp
    scales = [weight_scale(m.U.shape[0], m.V.shape[0]) for m in layers]
    one = len(set(scales)) == 1
    each = torch.tensor(scales, dtype=dt, device=layers[0].S.device)[:, None, None] if not one else None
    return {**hp, "weight_scale": scales[0] if one else each}


def core_step(opt: Optimizer, loss) -> bool:
    """Between augmentations: the rule on every layer's core S and on the dense parameters,
    batched (cores of one rank bucket zero-padded to one size), reading nothing back; a
    non-finite loss or gradient changes nothing and is counted on the device
    (:func:`augmenting_step` reports it)."""
    todo = [m for m in opt.layers.values() if m.S.grad is not None]
    keyed: dict[tuple, list] = defaultdict(list)
    for m in todo:  # (a layer's live core and its gradient: m.factors()[1], m.live_grads()[1])
        key = (_step.rank_bucket(m.rank), m.S.dtype, m.S.device, id(opt._hp_of(m.S)),
               _signature(opt.state[m.S]))
        keyed[key].append(m)
    device = todo[0].S.device if todo else next((p.device for p in _dense_params(opt)), torch.device("cpu"))
    ok = inputs_finite(opt, loss, device)
    planned = []
    for layers in keyed.values():
        dt = work_dtype(layers[0].S.dtype)
        S0 = _stack([m.factors()[1] for m in layers], dt)
        G = _stack([m.live_grads()[1] for m in layers], dt)
        old = _stack_states(_rule_states(opt, layers, "S"), dt)
        S1, new, finite = functional.core(S0, G, old, opt.rule, _core_hp(opt, layers, dt))
        ok = ok & finite
        planned.append((layers, S0, S1, old, new))
    for layers, S0, S1, old, new in planned:
        shapes = [(m.rank, m.rank) for m in layers]
        torch._foreach_copy_([m.factors()[1] for m in layers], _rows(torch.where(ok, S1, S0), shapes))
        new = {k: v for k, v in _unless(ok, new, old).items() if k in RULE_KEYS}
        caps = [_capacity_shape(m, "S") for m in layers]
        _write_states([opt.state[m.S] for m in layers], new, shapes, caps)
    dense_step(opt, ok)
    bad = (~ok).to(torch.int64)
    opt._skipped = bad if opt._skipped is None else opt._skipped + bad
    return True
