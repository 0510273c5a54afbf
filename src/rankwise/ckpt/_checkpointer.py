"""CodedCheckpointer: numbered coded checkpoints of a training state, on ``torch.distributed.checkpoint``.

Every step is one coded DCP checkpoint (:mod:`._dcp`, the one layout of :mod:`._layout`):
``store_dir/step_{step:010d}/rank{i}/``, rank i writing only its own folder on its own disk. The
state (identical on every rank, as under DDP) is one entry, written once; each rank's per-rank
extras (RNG states) are its own entry. A restore takes the newest step whose metadata a quorum
of ranks holds, rebuilds a lost or damaged rank from its peers' symbols, and falls back to the
next older step when a step cannot be retrieved. For sharded state (FSDP2) use ``dcp.save`` /
``dcp.load`` with :class:`CodedStorageWriter` / :class:`CodedStorageReader` directly.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import io
import logging
import os
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..dist import group_timeout
from . import _layout, _store, _wire
from ._dcp import CodedStorageReader, CodedStorageWriter, side_group
from ._transport import Transport, attend

log = logging.getLogger(__name__)
_STEP = re.compile(r"step_([0-9]{10,20})")
STEP_LIMIT = 2**64  # steps are below this
_ROUNDS: collections.Counter[str] = collections.Counter()  # restores per side group, for attend


def step_of(name: str) -> int | None:
    """The step of a folder named exactly ``step_{s:010d}`` (ASCII digits, s < 2⁶⁴), else None."""
    m = _STEP.fullmatch(name)
    if m is None:
        return None
    s = int(m.group(1))
    return s if s < STEP_LIMIT and name == f"step_{s:010d}" else None


@dataclass(frozen=True)
class Restored:
    """What :meth:`CodedCheckpointer.restore` restored: the saved `state` and its `step`, this
    rank's `per_rank` object (``None`` if the save had none), the ranks whose folders were rebuilt
    (`repaired`), the ranks named bad by more than t ranks (`bad_helpers`), who reported whom
    (`reported`), this rank's figures (`stats`) and the newer steps that could not be retrieved,
    with why (`skipped`). Unpacks as ``state, step = restored``."""

    state: Any
    step: int
    per_rank: Any
    repaired: list[int]
    bad_helpers: list[int]
    reported: dict[int, list[int]]
    stats: dict[str, Any]
    skipped: list[tuple[int, str]] = field(default_factory=list)

    def __iter__(self):
        return iter((self.state, self.step))


def _last_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[-1][:300] if text else ""


def _tensor(obj: Any) -> torch.Tensor:
    """`obj`'s ``torch.save`` bytes as a uint8 tensor: stored raw (a ``bytes`` value would be
    pickled by DCP's planner again, 1.5× its size)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)


def _object(t: torch.Tensor, weights_only: bool) -> Any:
    return torch.load(io.BytesIO(t.numpy().tobytes()), map_location="cpu", weights_only=weights_only)


def _from_metadata(keys: list[str]):
    """A DCP load planner that makes the entries `keys` from the checkpoint's metadata (their sizes
    are known only there), so that a restore needs no template."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class FromMetadata(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
            for key in keys:
                md = metadata.state_dict_metadata.get(key) if metadata is not None else None
                if md is None or not hasattr(md, "size"):
                    raise ValueError(f"the checkpoint has no tensor entry {key!r} (saved by another world "
                                     "size or program?)")
                state_dict[key] = torch.empty(md.size, dtype=md.properties.dtype)
            super().set_up_planner(state_dict, metadata, is_coordinator)

    return FromMetadata()


class CodedCheckpointer:
    """Save and restore a data-parallel training state as numbered coded checkpoints.

    **Arguments:**
    - `t`: lost or damaged ranks tolerated (n = world size, k = n − t, 3t < n).
    - `store_dir`: node-local root; rank i writes only ``store_dir/step_*/rank{i}/``.
    - `process_group`: ``None`` or the default group (the code spans every rank).
    - `hash`: ``"blake3"`` or ``"sha256"`` for the Merkle commitments.
    - `keep`: steps kept (this rank's older folders are removed after each save).
    - `weights_only`: passed to ``torch.load`` of the restored state.
    - `transport`: the :class:`._transport.Transport` class its ranks talk through (a lying one
      in tests: :class:`rankwise.ckpt.testing.LyingCheckpointer`).
    - `join_timeout`: seconds a restore waits for every rank to join it (default: the process
      group's timeout); the ranks that joined then restore without the others (a silent rank
      costs its vote only: at most t may be missing), and a rank that joins later raises.
    """

    def __init__(self, *, t: int, store_dir: str | Path, process_group: dist.ProcessGroup | None = None,
                 hash: str = "blake3", keep: int = 2, weights_only: bool = True,
                 transport: type[Transport] = Transport, join_timeout: float | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("CodedCheckpointer needs an initialised process group "
                               "(rankwise.dist.init_process_group() under torchrun)")
        if keep < 1:
            raise ValueError(f"`keep` must be >= 1; got {keep}")
        if process_group not in (None, dist.group.WORLD) and (
                dist.get_world_size(process_group) != dist.get_world_size()):
            raise ValueError("CodedCheckpointer codes over every rank of the world; a process_group that "
                             "is a subgroup is not supported (pass None)")
        self.rank, self.n = dist.get_rank(), dist.get_world_size()
        from .._checks import code_geometry_problem

        if (problem := code_geometry_problem(self.n, t)) is not None:
            raise ValueError(f"CodedCheckpointer with t={t} on {self.n} rank(s) (n is the world size: one "
                             f"party per rank): {problem}")
        self.t, self.k = t, self.n - t
        self.hash, self.keep, self.weights_only = hash, keep, weights_only
        self.transport = transport
        self.root_dir = Path(store_dir)
        self.group = side_group()  # the code's collectives: never training's group
        # the step scan's own time bound (before the restore's first collective): a quarter of the
        # group's timeout, at most 60 s, so a rank on a slow disk still votes in time
        self.scan_seconds = min(60.0, group_timeout().total_seconds() / 4)
        if join_timeout is not None and not join_timeout > 0:
            raise ValueError(f"`join_timeout` must be > 0 seconds; got {join_timeout!r}")
        self.join_timeout = group_timeout().total_seconds() if join_timeout is None else join_timeout
        self.per_rank: Any = None
        self._stats: dict[str, Any] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def _step_dir(self, step: int) -> Path:
        return self.root_dir / self._step_name(step)

    @staticmethod
    def _step_name(step: int) -> str:
        return f"step_{step:010d}"

    # ------------------------------------------------------------------ save
    def save(self, state: Any, step: int, *, per_rank: Any = None, blocking: bool = True) -> Future | None:
        """Collective. Save `state` (identical on every rank) and this rank's `per_rank` extras as
        step `step`, then remove this rank's folders of steps older than the newest `keep`.

        ``blocking=False`` serialises the state to host memory (a snapshot: training may change
        the originals as soon as it returns) and returns a ``concurrent.futures.Future`` while a
        background thread codes and writes it; one save is in flight at a time."""
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < STEP_LIMIT:
            raise ValueError(f"`step` must be an int in [0, 2**64); got {step!r}")
        t0 = time.perf_counter()
        blob = _tensor(state)
        sd = {f"per_rank/{self.rank}": _tensor(per_rank)}
        if self.rank == 0:  # written once (every rank holds the same state)
            sd["state"] = blob
        self.wait()
        self._same_state(blob, step)
        if blocking:
            self._save(sd, step, t0, 0.0)
            return None
        blocked = time.perf_counter() - t0
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rankwise-ckpt")
        self._pending = self._executor.submit(self._save, sd, step, t0, blocked)
        return self._pending

    def _same_state(self, blob: torch.Tensor, step: int) -> None:
        """Every rank's serialised state must be the same bytes (only rank 0's is written): the
        ranks exchange a blake3 digest of theirs, and every rank raises alike, naming the groups,
        when replicas diverged."""
        tp = self.transport(self.group)
        tp.phase = "digest"
        got = tp.gather(blake3.blake3(blob.numpy()).digest(), 32)
        if len(set(got)) > 1:
            groups: dict[bytes | None, list[int]] = {}
            for r, g in enumerate(got):
                groups.setdefault(g, []).append(r)
            raise RuntimeError(f"save(step={step}): the ranks hold different states (ranks grouped by "
                               f"state digest: {sorted(groups.values())})")

    def _save(self, sd: dict, step: int, t0: float, blocked: float) -> None:
        import torch.distributed.checkpoint as dcp

        writer = CodedStorageWriter(self.root_dir, t=self.t, hash=self.hash, transport=self.transport,
                                    inner=(self._step_name(step),))
        # no_dist: DCP's own coordination would exchange (pickled, relayed) plans; the coded
        # storage exchanges what it needs itself, in fixed formats over direct pairs
        try:
            dcp.save(sd, storage_writer=writer, no_dist=True)
        except CheckpointException as e:  # (a BaseException: `except Exception` would not see it)
            raise RuntimeError(f"coded save of step {step} failed: {_last_line(e)}") from e
        self._prune(step)
        self._stats = dict(op="save", step=step, state_bytes=sd["state"].numel() if "state" in sd else None,
                           blocked_seconds=blocked,
                           seconds=time.perf_counter() - t0, **writer.stats)

    def wait(self) -> None:
        """Wait for a background save in flight (re-raising its error); no-op if there is none."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for a background save, then stop the background thread."""
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    def _local_steps(self) -> dict[int, bytes]:
        """Step -> SHA-256 of this rank's metadata, for the newest `keep` + 4 complete steps here,
        read within `scan_seconds` (a rank on a slow disk votes with what it read in time)."""
        try:
            names = os.listdir(self.root_dir)
        except OSError:
            return {}
        steps = sorted((s for x in names if (s := step_of(x)) is not None), reverse=True)
        out: dict[int, bytes] = {}
        deadline = time.monotonic() + self.scan_seconds
        for s in steps[:self.keep + 4]:
            if time.monotonic() > deadline:
                log.warning("checkpoint scan: stopped after %.0f s; steps not read: %s", self.scan_seconds,
                            [x for x in steps[:self.keep + 4] if x not in out and x < s] + [s])
                break
            try:  # (neither the step folder nor the rank folder may be a link)
                names = (self._step_name(s), _layout.folder(self.rank))
                with _store.opened_folder(self.root_dir, *names) as fd:
                    out[s] = hashlib.sha256(_store.read_metadata(_layout.META, dir_fd=fd)).digest()
            except (OSError, ValueError):
                continue
        return out

    def _prune(self, newest: int) -> None:
        """Remove this rank's folders of all but the newest `keep` steps, through the step folder's
        descriptor (never through a link); what cannot be removed is logged."""
        steps = sorted((s for s in self._local_steps() if s <= newest), reverse=True)
        for s in steps[self.keep:]:
            try:
                with _store.opened_folder(self.root_dir, self._step_name(s)) as fd:
                    shutil.rmtree(_layout.folder(self.rank), dir_fd=fd)
                with contextlib.suppress(OSError):
                    os.rmdir(self._step_dir(s))  # the last rank's folder gone (a shared disk)
            except (OSError, ValueError, RecursionError) as e:
                why = type(e).__name__ if isinstance(e, RecursionError) else e
                log.warning("checkpoint store: could not remove %s/%s: %s", self._step_dir(s),
                            _layout.folder(self.rank), why)

    # ------------------------------------------------------------------ restore
    def restore(self) -> Restored | None:
        """Collective. Restore the newest step whose metadata a quorum of ranks holds (rebuilding a
        lost or damaged rank's folder from its peers), or the next older one when a step cannot be
        retrieved (``Restored.skipped``); ``None`` when no rank holds any step (a fresh start).
        Raises when steps exist but none has a quorum, or none can be retrieved."""
        import torch.distributed.checkpoint as dcp
        self.wait()
        t0 = time.perf_counter()
        _ROUNDS[self.group.group_name] += 1  # (every rank counts its restores alike)
        absent = attend(self.group, f"{self.group.group_name}/restore{_ROUNDS[self.group.group_name]}",
                        self.join_timeout)
        if len(absent) > self.t:
            raise RuntimeError(f"restore: ranks {sorted(absent)} did not join within "
                               f"{self.join_timeout:g} s; at most t={self.t} may be missing")
        if absent:
            log.error("restore: ranks %s did not join within %g s; the others restore without them",
                      sorted(absent), self.join_timeout)
        transport = functools.partial(self.transport, absent=absent)
        tp = transport(self.group)
        tp.phase = "vote"
        mine = _wire.votes(self._local_steps(), 32)
        held = [_wire.unvotes(b, 32) for b in tp.gather(mine, _wire.votes_size(32))]
        votes: dict[tuple[int, bytes], list[int]] = {}
        for r, steps in enumerate(held):
            for s, digest in steps.items():
                votes.setdefault((s, digest), []).append(r)
        quorum = self.n - (self.n - 1) // 3
        candidates = sorted({s for (s, _), rs in votes.items() if len(rs) >= quorum}, reverse=True)
        if not candidates:
            if votes:
                newest = max(s for s, _ in votes)
                where = sorted({r for (s, _), rs in votes.items() if s == newest for r in rs})
                raise RuntimeError(f"restore: no checkpoint step is held by {quorum} ranks; newest step "
                                   f"{newest} survives on ranks {where} only (t={self.t} lost ranks "
                                   "tolerated)")
            self._stats = dict(op="restore", step=None)
            return None
        skipped: list[tuple[int, str]] = []
        for step in candidates:
            keys = ["state", f"per_rank/{self.rank}"]
            template: dict[str, Any] = dict.fromkeys(keys)  # (made at their sizes by the planner)
            reader = CodedStorageReader(self.root_dir, transport=transport,
                                        inner=(self._step_name(step),))
            why = None
            try:  # (no_dist: see save; the ranks agree on the outcome below, over the transport)
                dcp.load(template, storage_reader=reader, planner=_from_metadata(keys), no_dist=True)
            except (Exception, CheckpointException) as e:  # any failure of this rank's load is voted on
                why = f"{type(e).__name__}: {_last_line(e)}"
            tp.phase = "outcome"
            votes = tp.gather(b"\x00" if why is None else b"\x01", 1)
            com = getattr(reader, "com", None)
            if com is not None and com.n != self.n:  # (every rank read the same metadata)
                raise RuntimeError(f"restore: step {step} was saved by {com.n} ranks and this world has "
                                   f"{self.n}; CodedCheckpointer restores at the world size it saved with "
                                   "(dcp.load with a CodedStorageReader reads it at any world size)")
            failed = [r for r, v in enumerate(votes) if v != b"\x00"]
            if len(failed) > self.t:  # more than t voices: the step is given up on every rank
                why = why or f"ranks {failed} could not retrieve it"
                log.error("restore: step %d cannot be retrieved (%s); trying the next older step", step, why)
                skipped.append((step, why))
                continue
            if why is not None:  # up to t ranks failing cannot roll the others back: this one fails alone
                raise RuntimeError(f"restore of step {step} failed on this rank ({why}); its peers "
                                   "restored it")
            if failed:
                log.error("restore: ranks %s could not retrieve step %d (at most t=%d: not a fall-back)",
                          failed, step, self.t)
            state = _object(template["state"], self.weights_only)
            self.per_rank = _object(template[keys[1]], True)
            flag = b"\x01" if reader.stats.get("repaired") else b"\x00"
            repaired = [r for r, v in enumerate(tp.gather(flag, 1)) if v == b"\x01"]
            st = reader.stats
            self._stats = dict(op="restore", step=step, repaired=repaired, absent=sorted(absent),
                               seconds=time.perf_counter() - t0,
                               state_bytes=template["state"].numel(), skipped=skipped,
                               reported=reader.reported,
                               bad_helpers=reader.bad, data_len=reader.com.data_len,
                               block_size=reader.com.block_size,
                               helpers=st.get("helpers", []),
                               repair_bytes_received=st.get("received", {}).get("repair", 0),
                               repair_bytes_sent=st.get("sent", {}).get("repair", 0),
                               retrieve_bytes_received=st.get("received", {}).get("retrieve", 0),
                               repair_seconds=st.get("repair_s", 0.0),
                               retrieve_seconds=st.get("retrieve_s", 0.0))
            return Restored(state, step, self.per_rank, repaired, reader.bad, reader.reported, self.stats(),
                            skipped)
        raise RuntimeError("restore: no step that a quorum of ranks holds could be retrieved: "
                           + "; ".join(f"step {s}: {why}" for s, why in skipped))

    def stats(self) -> dict[str, Any]:
        """Figures of the last save or restore (bytes moved per phase, seconds, repaired ranks,
        who reported whom) with this rank, n, t and k."""
        return dict(self._stats, rank=self.rank, n=self.n, t=self.t, k=self.k)
