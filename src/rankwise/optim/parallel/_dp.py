"""Data parallelism for the low-rank optimizers: what DDP cannot do for them.

DDP sees only ``.grad`` and fixes its buckets at construction; the integrator also reads the
factor gradients G_K (out, r), G_L (in, r) from each layer's sink, and the ranks, hence every
shape, change during training. Here every gradient the optimizer reads is averaged in a
layout rebuilt at each step (the same on every rank, since the ranks are), and after each
truncation the replicas' factors are compared by a hash of their bits.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ...dist import global_rank

BUCKET_BYTES = 25 * 2**20  # as DDP's default bucket_cap_mb


@dataclass
class Slot:
    """One gradient to average: its current value (None: this rank has none), its shape, dtype
    and device (to send zeros in its place), and where the average goes."""

    value: Tensor | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    put: Callable[[Tensor | None], None]
    owner: int | None = None  # a rank of the group: only it needs the average (None: every rank)
    tag: str = ""  # what the caller calls it


def average(slots: Sequence[Slot], group, *, flag: bool | Tensor = False,
            also: bool | Tensor = False) -> tuple[bool, int, list[bool], bool]:
    """Average every slot over the ranks of `group` (a slot missing on a rank counts as zero, as
    in DDP; missing on every rank it stays None), in few collectives: one flat buffer per dtype
    and destination, split at :data:`BUCKET_BYTES`, plus one small vector holding each slot's
    presence, `flag` and `also` (bools, or device bool tensors: they are not read on their own).
    A slot with an `owner` is reduced to that rank only; the others get ``None`` in it. Returns
    whether any rank raised `flag` (e.g. "my loss is not finite"), the bytes this rank sent,
    each slot's presence on any rank, and whether any rank raised `also` (e.g. "the last
    replica check found a difference"). One host read: the presence vector with the flags."""
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    device = slots[0].device if slots else torch.device("cpu")  # (NCCL reduces only GPU tensors)
    values = [float(s.value is not None) for s in slots] + [0.0 if isinstance(f, Tensor) else float(f)
                                                            for f in (flag, also)]
    meta = torch.tensor(values, dtype=torch.float64).to(device)  # one copy; device flags put in place
    for i, f in ((-2, flag), (-1, also)):
        if isinstance(f, Tensor):
            meta[i] = f.to(torch.float64)
    works = [dist.all_reduce(meta, group=group, async_op=True)]
    by_key: dict[tuple, list[int]] = {}
    for i, s in enumerate(slots):
        by_key.setdefault((s.dtype, s.device, s.owner), []).append(i)
    buckets: list[tuple[Tensor, list[int], int | None]] = []
    for (dtype, _, owner), idx in by_key.items():
        start, size, limit = 0, 0, max(1, BUCKET_BYTES // torch.empty(0, dtype=dtype).element_size())
        for k, i in enumerate(idx):
            size += math.prod(slots[i].shape)
            if size >= limit or k == len(idx) - 1:
                part = idx[start:k + 1]
                flat = torch.cat([_flat(slots[i]) for i in part])
                if owner is None:
                    works.append(dist.all_reduce(flat, group=group, async_op=True))
                else:
                    works.append(dist.reduce(flat, dst=global_rank(group, owner), group=group, async_op=True))
                buckets.append((flat, part, owner))
                start, size = k + 1, 0
    for w in works:
        w.wait()
    sent = meta.numel() * 8 + sum(flat.numel() * flat.element_size() for flat, _, owner in buckets
                                  if owner != me)  # (what an owner receives it does not send)
    host = meta.tolist()  # the one host read
    present = [v > 0 for v in host[:-2]]
    for flat, part, owner in buckets:
        mine = owner is None or owner == me
        if mine:
            flat.div_(n)
        offset = 0
        for i in part:
            s = slots[i]
            k = math.prod(s.shape)
            s.put(flat[offset:offset + k].view(s.shape).clone() if mine and present[i] else None)
            offset += k
    return host[-2] > 0, sent, present, host[-1] > 0


def _flat(s: Slot) -> Tensor:
    if s.value is None:
        return torch.zeros(math.prod(s.shape), dtype=s.dtype, device=s.device)
    return s.value.detach().reshape(-1).to(s.dtype)


def shape_hash(tensors: Sequence[Tensor]) -> int:
    """BLAKE2b (64 bits, signed) of the tensors' shapes and dtypes, in order."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(f"{tuple(t.shape)}{t.dtype};".encode())
    return int.from_bytes(h.digest(), "little", signed=True)


# splitmix64's constants as signed int64 (torch's integer arithmetic wraps modulo 2^64)
_GOLDEN, _MIX, _MIX2 = 0x9E3779B97F4A7C15 - 2**64, 0xBF58476D1CE4E5B9 - 2**64, 0x94D049BB133111EB - 2**64


def _shr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 words (torch's ``>>`` is arithmetic)."""
    return (x >> k) & (2 ** (64 - k) - 1)


def _finalise(x: Tensor) -> Tensor:
    """splitmix64's finaliser: a bijection of 64-bit words that mixes every bit into every other."""
    x = (x ^ _shr(x, 30)) * _MIX
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def device_fingerprints(entries: Sequence[Sequence[Tensor]], device: torch.device) -> Tensor:
    """(len(entries),) int64 on `device`, with no host read and a fixed number of ops: per entry,
    Σ f(word ⊕ k) over the 8-byte words of its tensors' bytes (each tensor zero-padded to whole
    words; all entries in one stream), f splitmix64's finaliser (a bijection) and k a key drawn
    from the word's position by the same mixer, plus a host-side hash of its tensors' shapes and
    dtypes. Equal tensors give equal values on any rank; a changed word moves the sum by
    f(a') − f(a) ≠ 0 (f is one-to-one), so one flipped bit, or any change confined to one word,
    always shows; several changed words collide with probability about 2^-64, whatever the
    change: a sign flipped in an even number of words (a singular pair's ±u, ±v), which moves
    each word by 2^63 and would cancel in a weighted sum, shows too. Memory: about 3× the bytes
    hashed. Tensors on other devices (a τ on the host) travel in one copy."""
    here, there = [], []  # (entry, bytes) on `device` / elsewhere (moved at once)
    for e, ts in enumerate(entries):
        for t in ts:
            b = t.detach().contiguous().reshape(-1).view(torch.uint8)
            if b.numel():
                (here if b.device == device else there).append((e, b))
    parts = here + there
    words = [-(-b.numel() // 8) for _, b in parts]
    header = [shape_hash(ts) for ts in entries] + [e for e, _ in parts] + words
    header_t = torch.tensor(header, dtype=torch.int64).to(device)  # one copy: shape hashes, entries, words
    out, entry_ids, counts = header_t.split([len(entries), len(parts), len(parts)])
    if not parts:
        return out

    def padded(bs: list[Tensor], dev: torch.device) -> list[Tensor]:
        zeros = torch.zeros(8, dtype=torch.uint8, device=dev)
        return [x for b in bs for x in (b, zeros[:-b.numel() % 8])]

    stream = padded([b for _, b in here], device)
    if there:
        stream.append(torch.cat(padded([b for _, b in there], there[0][1].device)).to(device))
    w = torch.cat(stream).view(torch.int64)
    key = _finalise(torch.arange(1, w.numel() + 1, dtype=torch.int64, device=device) * _GOLDEN)
    entry_of = torch.repeat_interleave(entry_ids, counts, output_size=w.numel())
    return out.index_add(0, entry_of, _finalise(w ^ key))


@dataclass
class PendingCheck:
    """A replica check in flight: every rank's fingerprints (world, entries) on the device,
    gathered but not read; :meth:`differs` is a device bool to read with the next exchange."""

    names: list[str]
    rows: Tensor
    when: str

    def differs(self) -> Tensor:
        return (self.rows != self.rows[:1]).any()

    def raise_if_diverged(self, group) -> None:
        """Read the rows (one host read) and raise ``RuntimeError`` naming the ranks (and the
        first layer) whose tensors differ from the majority's; with no majority (two ranks, or
        a tie), the ranks that differ, without blaming either side."""
        rows = [tuple(r) for r in self.rows.tolist()]
        if all(r == rows[0] for r in rows):
            return
        first = next(i for i in range(len(rows[0])) if len({r[i] for r in rows}) > 1)
        counts = {r: rows.count(r) for r in rows}
        top = max(counts.values())
        names = [global_rank(group, i) for i in range(len(rows))]
        ref = next(r for r, c in counts.items() if c == top)
        if top > len(rows) / 2:  # a strict majority: the others drifted
            odd = [str(names[i]) for i, r in enumerate(rows) if r != ref]
            what = (f"rank {odd[0]} holds" if len(odd) == 1 else f"ranks {', '.join(odd)} hold") + \
                f" other factors than the other {top} ranks"
        else:
            groups: dict[tuple, list[str]] = {}
            for i, r in enumerate(rows):
                groups.setdefault(r, []).append(str(names[i]))
            what = ("ranks " + " / ".join(", ".join(g) for g in groups.values()) + " hold different factors "
                    "(no majority tells which drifted)")
        raise RuntimeError(
            f"data-parallel replicas diverged {self.when}: {what} in layer {self.names[first]!r} (ranks, "
            "bases or τ differ). Every rank must start from the same model and see the same averaged "
            "gradients; across machines whose floating-point results differ, the integrator's "
            "results can drift apart")


def start_check(named: dict[str, Sequence[Tensor]], group, *, when: str) -> PendingCheck:
    """Gather every rank's :func:`device_fingerprints` of the `named` tensors (one all-gather of
    one int64 per entry), without reading them."""
    names = list(named)
    device = next((t.device for ts in named.values() for t in ts), torch.device("cpu"))
    mine = device_fingerprints([named[k] for k in names], device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return PendingCheck(names, torch.stack(everyone), when)


def check_model(model: torch.nn.Module) -> None:
    """Refuse what data parallelism here cannot keep identical across replicas: batch norm's
    running statistics (each rank's follow its own shard; nothing averages them) and a model
    already wrapped in DDP (its gradients would be averaged twice, its buckets go stale when a
    rank changes)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError("with `process_group` pass the model itself, not a DistributedDataParallel "
                         "wrapper: the optimizer averages the gradients")
    fixed = next((n for n, m in model.named_modules() if getattr(m, "capacity", None) is not None), None)
    if fixed is not None:
        raise ValueError(f"`process_group` does not take fixed-capacity layers yet (layer {fixed!r}): wrap "
                         "the model in DistributedDataParallel instead (DLRT(DDP(model), …))")
    bn = next((n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
               and not isinstance(m, torch.nn.SyncBatchNorm) and m.track_running_stats), None)
    if bn is not None:
        raise ValueError(f"data-parallel DLRT/SDLRT (`process_group`) does not support batch norm yet: layer "
                         f"{bn!r} keeps running statistics of its own rank's shard, and the replicas would "
                         "drift apart")


def broadcast_from_first(tensors: Sequence[Tensor], group) -> None:
    """Copy the group's rank-0 values into `tensors` on every rank (one broadcast per dtype);
    the shapes must agree (checked first by :func:`check_shapes`)."""
    src = global_rank(group, 0)
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for t in ts:
            with torch.no_grad():
                t.copy_(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()


def check_shapes(named: dict[str, Tensor], group) -> None:
    """Every rank must hold the same tensor names and shapes (e.g. the same ranks) before a
    broadcast: else a clear error naming the first rank that differs."""
    from ._shard import gather_objects  # (plain data as JSON: nothing a peer sends is unpickled)

    sig = [(k, tuple(t.shape), str(t.dtype)) for k, t in named.items()]
    everyone = gather_objects(sig, group)
    for r, theirs in enumerate(everyone[1:], start=1):
        if theirs != everyone[0]:
            bad = next(((a, b) for a, b in zip(everyone[0], theirs, strict=False) if a != b), None)
            what = (f"{bad[1]} where rank {global_rank(group, 0)} has {bad[0]}" if bad
                    else "another number of tensors")
            raise RuntimeError(f"data-parallel replicas differ at construction: rank {global_rank(group, r)} "
                               f"has {what}; build the same model (same ranks) on every rank")

