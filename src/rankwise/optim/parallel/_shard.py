"""The sharded integrator's pieces: which rank integrates which layer, and moving a layer's
new factors and optimizer state from its owner to every rank.

Under ``AugmentedBUG(..., process_group=g, settings with data_parallel="sharded")`` each
low-rank layer is integrated by one rank of `g`, its *owner*; every rank still runs forward and
backward on its shard of the batch and averages the gradients. After the truncation each owner
sends its layers' factors, buffers, τ and optimizer state to the others, so every rank holds
the same complete model and optimizer state (a ``state_dict`` on any rank is whole).

Nothing a peer sends is unpickled: plain data travels as JSON in a uint8 tensor
(:func:`gather_objects`, :func:`encode` / :func:`decode`), tensors as raw bytes of a dtype
from a fixed list; a peer's malformed message is a ``ValueError`` naming the rank, never code
run here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ...dist import global_rank


def integration_cost(out_features: int, in_features: int, rank: int) -> float:
    """The integrator's arithmetic for one layer at `rank` (its largest), up to a constant: the
    QRs of the (out, 2r) and (in, 2r) augmented bases and the SVD of the 2r × 2r core,
    ``(m + n)(2r)² + (2r)³``."""
    r2 = 2 * rank
    return float((out_features + in_features) * r2 * r2 + r2 ** 3)


def assign_owners(costs: Mapping[str, float], world: int) -> dict[str, int]:
    """{layer: owning rank}: the longest-processing-time rule (layers by decreasing cost, each
    to the rank with the least cost so far; ties to the lower rank, equal costs in the given
    order). A pure function of the costs and the order of the layers, so identical on every
    rank and after a restart (costs from the layers' shapes and rank caps, not their ranks)."""
    if world < 1:
        raise ValueError(f"`world` must be >= 1; got {world}")
    load = [0.0] * world
    owners: dict[str, int] = {}
    for name in sorted(costs, key=lambda n: -costs[n]):  # sorted() is stable: ties keep their order
        r = min(range(world), key=lambda i: (load[i], i))
        owners[name] = r
        load[r] += costs[name]
    return {n: owners[n] for n in costs}


def _split(value: Any, tensors: list[Tensor]) -> Any:
    """`value` (nested dicts, lists, tuples, scalars, tensors) with every tensor replaced by a
    placeholder ``("__tensor__", index, shape, dtype)`` and appended to `tensors`."""
    if torch.is_tensor(value):
        tensors.append(value)
        return ("__tensor__", len(tensors) - 1, tuple(value.shape), str(value.dtype).removeprefix("torch."))
    if isinstance(value, dict):
        return {k: _split(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_split(v, tensors) for v in value)
    return value


def _is_placeholder(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 4 and value[0] == "__tensor__"


def _join(value: Any, tensors: list[Tensor]) -> Any:
    """Inverse of :func:`_split`."""
    if _is_placeholder(value):
        return tensors[value[1]]
    if isinstance(value, dict):
        return {k: _join(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_join(v, tensors) for v in value)
    return value


def _placeholders(value: Any, out: list[tuple]) -> list[tuple]:
    if _is_placeholder(value):
        out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _placeholders(v, out)
    elif isinstance(value, list | tuple):
        for v in value:
            _placeholders(v, out)
    return out


def share_from_owners(mine: Mapping[str, Any], owners: Mapping[str, int], group,
                      device: torch.device) -> tuple[dict[str, Any], int]:
    """Every rank's values for the layers it owns, on every rank.

    `mine`: {layer: value} for the layers this rank owns and has news of (a value: nested
    dicts / lists / tuples of tensors and plain data). Returns ({layer: value} for every
    layer of every rank, tensors on `device`, each a compact copy, this rank's own too) and the bytes
    of tensor data this rank sent. One :func:`gather_objects` of the structure (shapes,
    dtypes, scalars: JSON, nothing unpickled), then per owner one broadcast per dtype of its
    tensors, flattened."""
    me = dist.get_rank(group)
    tensors: list[Tensor] = []
    skeleton = {name: _split(v, tensors) for name, v in mine.items()}
    skeletons = gather_objects(skeleton, group)
    for r, sk in enumerate(skeletons):
        who = f"rank {global_rank(group, r)}"
        if not isinstance(sk, dict):
            raise ValueError(f"{who} sent a {type(sk).__name__} where the layers' states were expected")
        if any(owners.get(name) != r for name in sk):
            bad = next(name for name in sk if owners.get(name) != r)
            raise RuntimeError(f"{who} sent the state of layer {bad!r}, which it does not own")
        _check_placeholders(_placeholders(sk, []), who)
    out: dict[str, Any] = {}
    sent = 0
    for r, sk in enumerate(skeletons):
        if not sk:
            continue
        slots = _placeholders(sk, [])
        theirs: list[Tensor | None] = [None] * len(slots)
        by_dtype: dict[str, list[tuple]] = {}
        for ph in slots:
            by_dtype.setdefault(ph[3], []).append(ph)
        for dtype_name, phs in by_dtype.items():
            dtype = WIRE_DTYPES[dtype_name]
            sizes = [math.prod(ph[2]) for ph in phs]
            if r == me:
                flat = torch.cat([tensors[ph[1]].detach().reshape(-1).to(device) for ph in phs])
                sent += flat.numel() * flat.element_size()
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            dist.broadcast(flat, src=global_rank(group, r), group=group)
            for ph, part in zip(phs, torch.split(flat, sizes), strict=True):
                theirs[ph[1]] = part.view(ph[2]).clone()
        # the owner too takes the copies: every rank then holds tensors of one layout (compact,
        # each its own storage), so serialising the state gives the same bytes on every rank
        out.update({name: _join(v, theirs) for name, v in sk.items()})  # type: ignore[arg-type]
    return out, sent


def _check_placeholders(slots: list[tuple], who: str) -> None:
    """A peer's tensor placeholders: indices 0..n-1 once each, known dtypes, whole shapes."""
    ok = sorted(ph[1] for ph in slots if type(ph[1]) is int) == list(range(len(slots))) and all(
        isinstance(ph[3], str) and ph[3] in WIRE_DTYPES and isinstance(ph[2], tuple)
        and all(type(d) is int and d >= 0 for d in ph[2]) for ph in slots)
    if not ok:
        raise ValueError(f"{who} sent a malformed layer state (tensor placeholders with unknown dtypes, "
                         "shapes or indices); every rank must run the same rankwise")


# ----------------------------------------------------------------------------- plain data between ranks
WIRE_DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in (
    "float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32", "int16", "int8",
    "uint8", "bool")}
OBJECT_LIMIT = 1 << 30  # bytes: the most one rank's message may hold


def encode(value: Any) -> bytes:
    """`value` (nested dicts, lists, tuples of str / int / float / bool / None and tensors) as
    bytes: an 8-byte length, a JSON header (the structure, each tensor's dtype and shape), then
    the tensors' raw bytes. ``TypeError`` for anything else (no object is pickled)."""
    tensors: list[Tensor] = []

    def enc(v: Any) -> Any:
        if torch.is_tensor(v):
            if str(v.dtype).removeprefix("torch.") not in WIRE_DTYPES:
                raise TypeError(f"cannot send a {v.dtype} tensor to the other ranks")
            tensors.append(v.detach().to("cpu").contiguous())
            return {"t": len(tensors) - 1}
        if v is None or isinstance(v, bool | int | float | str):
            return v
        if isinstance(v, tuple):
            return {"u": [enc(x) for x in v]}
        if isinstance(v, list):
            return [enc(x) for x in v]
        if isinstance(v, dict):
            return {"d": [[enc(k), enc(x)] for k, x in v.items()]}
        raise TypeError(f"cannot send a {type(v).__name__} to the other ranks (plain data and tensors only)")

    body = enc(value)
    specs = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    head = json.dumps({"v": body, "t": specs}, separators=(",", ":")).encode()
    blobs = [t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors]
    return b"".join([len(head).to_bytes(8, "little"), head, *blobs])


def decode(data: bytes, who: str = "a peer") -> Any:
    """Inverse of :func:`encode`; ``ValueError`` naming `who` for bytes it did not write."""
    def bad(why: str) -> ValueError:
        return ValueError(f"{who} sent a message that is not rankwise's exchange format ({why}); every rank "
                          "must run the same rankwise")

    if len(data) < 8 or 8 + int.from_bytes(data[:8], "little") > len(data):
        raise bad("a truncated header")
    n = int.from_bytes(data[:8], "little")
    try:
        head = json.loads(data[8:8 + n])
    except RecursionError:
        raise bad("nested too deep") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"not JSON: {e}") from None
    if not (isinstance(head, dict) and isinstance(head.get("t"), list) and "v" in head):
        raise bad("no structure")
    tensors, offset = [], 8 + n
    for spec in head["t"]:
        if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str)
                and spec[0] in WIRE_DTYPES and isinstance(spec[1], list)
                and all(type(d) is int and d >= 0 for d in spec[1])):
            raise bad(f"a tensor of dtype/shape {spec!r}")
        dtype = WIRE_DTYPES[spec[0]]
        nbytes = math.prod(spec[1]) * torch.empty((), dtype=dtype).element_size()
        if offset + nbytes > len(data):
            raise bad("tensor bytes past the end")
        raw = torch.frombuffer(bytearray(data[offset:offset + nbytes]), dtype=torch.uint8) if nbytes else \
            torch.empty(0, dtype=torch.uint8)
        tensors.append(raw.view(dtype).reshape(spec[1]))
        offset += nbytes
    if offset != len(data):
        raise bad("bytes after the last tensor")

    def dec(v: Any) -> Any:
        if isinstance(v, list):
            return [dec(x) for x in v]
        if not isinstance(v, dict):
            return v
        if set(v) == {"t"} and type(v["t"]) is int and 0 <= v["t"] < len(tensors):
            return tensors[v["t"]]
        if set(v) == {"u"} and isinstance(v["u"], list):
            return tuple(dec(x) for x in v["u"])
        if set(v) == {"d"} and isinstance(v["d"], list) and all(isinstance(kv, list) and len(kv) == 2
                                                               for kv in v["d"]):
            return {dec(k): dec(x) for k, x in v["d"]}
        raise bad(f"an unknown node {str(v)[:40]}")

    try:
        return dec(head["v"])
    except (RecursionError, TypeError):  # (TypeError: an unhashable key)
        raise bad("a malformed structure") from None


def _object_device(group) -> torch.device:
    """Where plain data travels: the device the backend reduces (NCCL: the current GPU)."""
    try:
        return torch.device(dist.distributed_c10d._get_object_coll_device(group))
    except (AttributeError, TypeError, RuntimeError):
        if dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def gather_objects(mine: Any, group) -> list[Any]:
    """Every rank's `mine` (plain data and tensors, :func:`encode`), in rank order, as two
    ``all_gather``s of tensors (the lengths, then the padded bytes): nothing is unpickled.
    Tensors come back on the CPU."""
    data = encode(mine)
    world = dist.get_world_size(group)
    device = _object_device(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes_t = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes_t, size, group=group)
    sizes = [int(v) for v in torch.cat(sizes_t).tolist()]
    big = [global_rank(group, r) for r, v in enumerate(sizes) if not 8 <= v <= OBJECT_LIMIT]
    if big:  # every rank sees the same sizes: every rank raises here
        raise ValueError(f"rank(s) {big} sent a message of {max(sizes):,} bytes (at most {OBJECT_LIMIT:,})")
    buf = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    everyone = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(everyone, buf, group=group)
    return [decode(t[:n].cpu().numpy().tobytes(), f"rank {global_rank(group, r)}")
            for r, (t, n) in enumerate(zip(everyone, sizes, strict=True))]


def max_of(value: float, group, device: torch.device) -> float:
    """The largest of the ranks' `value`s (one all-reduce of one number)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()
