"""CodedCheckpointer: 2-D coded checkpoints for data-parallel training over torch.distributed.

Every rank holds one fragment (a row and a column of the coded block matrix) in its node-local
folder. A rank that lost its fragment (a replaced machine, a wiped or corrupted disk) rebuilds
it from two small symbols per peer, each checked against the Merkle commitment, instead of
downloading the checkpoint; the state is then decoded from any k rows.

Under DDP every rank holds the same state, so every rank serialises and encodes it itself and
keeps only its own fragment: saving moves no payload, only 2 Merkle line roots and a digest
of the state per rank (the digests also catch ranks whose states diverged). Where only one
rank holds the state (e.g. a parameter server), that rank encodes and sends fragment i to
rank i (|m|·2/k bytes each) with the same on-disk result; this class implements the
data-parallel case.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import struct
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch
import torch.distributed as dist

from ..dist import global_rank, group_timeout
from . import _store, _wire
from ._code2d import Code2D, Lines, NotEnoughSymbols
from ._format import CODEC, Commitment, Fragment, RepairSymbols, check_consistent
from ._serial import _load_rows, _Rows, _Sink, _to_cpu, deserialize, serialize

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restored:
    """What :meth:`CodedCheckpointer.restore` restored: the saved `state` and its `step`, this
    rank's `per_rank` object (RNG states, ...; ``None`` if the save had none), the ranks whose
    fragments were rebuilt (`repaired`), the ranks named bad by more than t ranks
    (`bad_helpers`), who reported whom (`reported`: rank -> reporting ranks), and the figures
    of :meth:`CodedCheckpointer.stats` (`stats`: bytes moved, seconds per phase), and the newer
    steps that k ranks held but could not be retrieved, with why (`skipped`).

    Unpacks as ``state, step = restored`` (the tuple the method returned before)."""

    state: Any
    step: int
    per_rank: Any
    repaired: list[int]
    bad_helpers: list[int]
    reported: dict[int, list[int]]
    stats: dict[str, Any]
    skipped: list[tuple[int, str]] = field(default_factory=list)  # newer steps that could not be retrieved

    def __iter__(self):
        return iter((self.state, self.step))



def _self_consistent(com: Commitment) -> bool:
    """Do the commitment's own fields (under its own n, t and hash) hash to its root?"""
    try:
        check_consistent(com)
    except ValueError:
        return False
    return True


class StepUnrecoverable(RuntimeError):
    """Raised on every rank alike when a step's rows cannot be retrieved (fewer than k verify)."""


SCAN_SLACK = 4  # step folders read beyond `keep` when a rank lists what it holds


class CodedCheckpointer:
    """Save and restore a data-parallel training state as 2-D coded fragments, one per rank.

    **Arguments:**
    - `t`: lost or corrupted fragments tolerated (n = world size, k = n − t, 3t < n).
    - `store_dir`: node-local root; rank i writes only under ``store_dir/rank{i}/``.
    - `process_group`: default: the default group (must be initialised).
    - `hash`: ``"blake3"`` or ``"sha256"`` for the Merkle commitments.
    - `keep`: complete steps kept per rank (older ones are pruned after each save).
    - `weights_only`: passed to ``torch.load`` on restore.

    A rank that sends bad data, for tests and demonstrations:
    :class:`rankwise.ckpt.testing.LyingCheckpointer`.

    Layout (:mod:`._store`): ``store_dir/rank{i}/step_{step:010d}/{fragment,commitment}.rwck``,
    each written atomically, the commitment last (a folder with a commitment is complete).
    """

    def __init__(self, *, t: int, store_dir: str | Path, process_group: dist.ProcessGroup | None = None,
                 hash: str = "blake3", keep: int = 2, weights_only: bool = True) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("CodedCheckpointer needs an initialised process group "
                               "(rankwise.dist.init_process_group() under torchrun)")
        if keep < 1:
            raise ValueError(f"`keep` must be >= 1; got {keep}")
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.rank, self.n = dist.get_rank(self.group), dist.get_world_size(self.group)
        from .._checks import code_geometry_problem

        if (problem := code_geometry_problem(self.n, t)) is not None:  # n is the group's size here
            raise ValueError(f"CodedCheckpointer with t={t} on a process group of {self.n} rank(s) (n is the "
                             f"group's size: one fragment per rank): {problem}")
        self.code = Code2D(self.n, t, hash=hash)
        self.t, self.k = t, self.code.k
        self.root_dir = Path(store_dir)
        # the step scan's own time bound (it runs before the restore's first collective): a
        # quarter of the group's timeout, at most 60 s, so a rank on a slow disk still votes in time
        self.scan_seconds = min(60.0, group_timeout(self.group).total_seconds() / 4)
        self.keep, self.weights_only = keep, weights_only
        self._stats: dict[str, Any] = {}
        self.per_rank: Any = None  # this rank's ``per_rank`` object after restore()
        self._bg_group = None  # created (collectively) by the first save(blocking=False)
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._sink = _Sink()  # the serialised state, reused by every save (one save at a time)
        self._lines: np.ndarray | None = None  # this rank's two lines of P, reused likewise

    # ------------------------------------------------------------------ helpers
    def _gather(self, payload: bytes, size: int, group: dist.ProcessGroup) -> list[bytes | None]:
        # a background save gathers on its own process group (see save(blocking=False))
        return _wire.all_gather_fixed(payload, size, group)

    def _step_dir(self, step: int) -> Path:
        return _store.step_dir(self.root_dir, self.rank, step)

    def _local_steps(self, folders: _store.RankFolders | None = None) -> dict[int, bytes]:
        """Complete local steps -> commitment root, read through `folders` (a restore's: the
        commitments read are kept in ``folders.commitments`` and the folders stay open for the
        later phases; None: opened and closed here). Unreadable commitments are skipped, and so
        are commitments whose fields do not hash to their root (rewritten by someone) and step
        folders that break the store's rules (a symbolic link: :func:`._store.opened_folder`);
        one of another code (another n, t or hash) keeps its vote, so that restoring it fails
        loudly."""
        if folders is None:
            with _store.RankFolders(self.root_dir, self.rank) as own:
                return self._local_steps(own)
        out: dict[int, bytes] = {}
        try:
            names = os.listdir(folders.rank_folder())
        except FileNotFoundError:
            return out
        except (_store.StoreError, OSError) as e:  # this rank has no vote; it is repaired, not written
            log.warning("rank %d's checkpoint folder is not used: %s", self.rank, e)
            return out
        # only the newest few folders are read (keep + SCAN_SLACK: a save in flight, crashed ones):
        # a store stuffed with step folders costs a directory listing, not a read of each
        steps = sorted((s for name in names if (s := _store.step_of(Path(name))) is not None), reverse=True)
        deadline = time.monotonic() + self.scan_seconds
        for i, step in enumerate(steps[:self.keep + SCAN_SLACK]):
            if i and time.monotonic() > deadline:  # a slow disk: vote with what was read, in time
                log.warning("rank %d's step scan stopped after %d folders (%.1f s bound); older steps "
                            "are not voted for", self.rank, i, self.scan_seconds)
                break
            try:
                com = _store.read_commitment(_store.STEP_COMMITMENT, dir_fd=folders.step_folder(step))
                if not _self_consistent(com):
                    continue
                out[step] = com.root
                folders.commitments[step] = com
            except _store.StoreError as e:
                log.warning("step %d of rank %d is not used: %s", step, self.rank, e)
            except (ValueError, OSError, MemoryError):
                continue
        return out

    def _errors(self, err: str | None, group: dist.ProcessGroup) -> dict[int, str]:
        """Collective: every rank's error (None: none) all-gathered -> {rank: error} of those that failed."""
        errs = [_wire.untext(b) for b in self._gather(_wire.text(err), _wire.TEXT_BYTES, group)]
        return {r: e for r, e in enumerate(errs) if e}

    def _raise_if_over_t(self, err: str | None, what: str, group: dist.ProcessGroup,
                         tolerated: str = "committed by the other ranks; rank(s) {bad} could not write "
                                          "their files and will be repaired at the next restore") -> None:
        """Collective: every rank raises ``RuntimeError`` if more than t ranks failed; with at most
        t (a bad disk, a link planted in one rank's folder) the step is committed by the others and
        recoverable, so the peers log who failed and why (`tolerated`, with ``{bad}`` the failed
        ranks: what that means for this step)."""
        bad = self._errors(err, group)
        if len(bad) > self.t:
            raise RuntimeError(f"{what} failed on rank(s) {sorted(bad)}: "
                               + "; ".join(f"rank {r}: {e}" for r, e in bad.items()))
        if bad:
            log.error("%s: %s: %s", what, tolerated.format(bad=sorted(bad)),
                      "; ".join(f"rank {r}: {e}" for r, e in bad.items()))

    # ------------------------------------------------------------------ save
    def save(self, state: Any, step: int, *, per_rank: Any = None, blocking: bool = True) -> Future | None:
        """Collective. Serialise ``state`` (model / optimizer / scheduler state dicts, ...),
        encode it, write this rank's fragment and the commitment, prune old steps.

        ``state`` must be identical on every rank (as under DDP); if the ranks' states differ
        (their commitment roots disagree) every rank raises. Per-rank extras that legitimately
        differ, such as RNG states, go in ``per_rank``: they are all-gathered (small) and coded
        with the state, so a lost rank gets its own back; :meth:`restore` returns this rank's
        as ``Restored.per_rank``.

        With ``blocking=False`` it copies every tensor of `state` to host memory (a snapshot:
        training may change the originals as soon as it returns), then returns a
        ``concurrent.futures.Future`` while a background thread serialises, encodes, exchanges
        the roots (on a process group of its own, so that training's collectives do not
        interleave with it) and writes; the future's ``result()`` is ``None`` or raises what the
        save raised. One save is in flight at a time: another save (or :meth:`restore`) first
        waits for it. The commitment is written last, so a crash during a background save
        leaves the previous step as the one restored."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"`step` must be a non-negative int; got {step!r}")
        t0 = time.perf_counter()
        extra = None if per_rank is None else serialize(per_rank)
        if blocking:
            self.wait()
            self._save(state, step, extra, t0, self.group)
            return None
        snapshot = _to_cpu(state, copy=True)
        self.wait()  # one in flight at a time
        if self._bg_group is None:  # collective: every rank reaches its first async save together
            self._bg_group = dist.new_group(ranks=dist.get_process_group_ranks(self.group), backend="gloo",
                                            timeout=group_timeout(self.group),  # not torch's 30 min
                                            use_local_synchronization=True)  # only this group's ranks
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rankwise-ckpt")
        blocked = time.perf_counter() - t0  # the snapshot, and waiting for the save before
        self._pending = self._executor.submit(self._background, snapshot, step, extra, t0, blocked)
        return self._pending

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
            dist.destroy_process_group(self._bg_group)
            self._bg_group = None

    def _background(self, state: Any, step: int, extra: bytes | None, t0: float, blocked: float) -> None:
        self._save(state, step, extra, t0, self._bg_group)  # training's collectives stay apart
        self._stats["blocked_seconds"] = blocked

    def _save(self, state: Any, step: int, extra: bytes | None, t0: float, group: dist.ProcessGroup) -> None:
        per_rank = extra
        extra = extra or b""
        # always gathered (ranks must make the same collective calls), with the step; the
        # per-rank extras travel as torch.save bytes and are loaded (weights_only) by their own
        # rank only, after a restore verified them
        heads = self._gather(struct.pack("<QBQ", step, per_rank is not None, len(extra)), 17, group)
        if any(h is None or len(h) != 17 for h in heads):
            raise RuntimeError(f"save(step={step}): malformed message from rank(s) "
                               f"{[r for r, h in enumerate(heads) if h is None or len(h) != 17]}")
        steps, flags, sizes = zip(*(struct.unpack("<QBQ", h) for h in heads), strict=True)
        if len(set(steps)) != 1:
            raise RuntimeError(f"save: the ranks save different steps: {list(steps)}")
        if len(set(flags)) != 1:
            raise RuntimeError(f"save(step={step}): per_rank given on some ranks only")
        if max(sizes) > _wire.MAX_PER_RANK:
            raise RuntimeError(f"save(step={step}): per_rank of {max(sizes)} bytes on rank "
                               f"{sizes.index(max(sizes))}; at most {_wire.MAX_PER_RANK} (RNG states, "
                               "not data)")
        extras = self._gather(extra, max(sizes), group) if flags[0] else None
        blob = self._sink.dump({"state": _to_cpu(state), "per_rank": extras})
        # each rank encodes only its own share; the leaf hashes of its two lines are gathered
        # (with a digest of the bytes, which catches ranks whose states diverged), checked
        # against the peers' at every crossing, and the line roots computed from them
        self._lines = self.code.share_buffer(len(blob), self._lines)
        frag, row_leaves, col_leaves = self.code.encode_share_leaves(blob, self.rank, out=self._lines)
        row_leaves, col_leaves = self._leaves_sent(row_leaves, col_leaves)
        digest = blake3.blake3(blob).digest()
        n, h = self.n, len(row_leaves[0])  # h: bytes per leaf hash
        size = 32 + 2 * n * h
        got = self._gather(digest + b"".join(row_leaves) + b"".join(col_leaves), size, group)
        if any(g is None or len(g) != size for g in got):
            raise RuntimeError(f"save(step={step}): malformed line hashes from rank(s) "
                               f"{[r for r, g in enumerate(got) if g is None or len(g) != size]}")
        leaves = [[g[o:o + h] for o in range(32, size, h)] for g in got]  # 2n per rank: row, then column
        shared = [(g[:32], lv[:n], lv[n:]) for g, lv in zip(got, leaves, strict=True)]
        if len({x[0] for x in shared}) != 1:
            groups: dict[bytes, list[int]] = {}
            for r, x in enumerate(shared):
                groups.setdefault(x[0], []).append(r)
            raise RuntimeError(f"save(step={step}): the ranks hold different states "
                               f"(ranks grouped by state digest: {sorted(groups.values())})")
        self._check_crossings(step, [x[1] for x in shared], [x[2] for x in shared])
        com = self.code.commitment_from_leaves(len(blob), [x[1] for x in shared], [x[2] for x in shared])
        d = self._step_dir(step)
        try:
            self._publish(d, frag, com)
            err = None
        except _store.StoreError as e:  # (names the folder itself)
            err = str(e)
        except OSError as e:
            err = f"writing {d}: {e}"
        self._raise_if_over_t(err, f"save(step={step})", group)  # the honest ranks have written: prune
        if err is None:
            self._prune(step)
        self._stats = dict(op="save", step=step, state_bytes=len(blob),
                           stored_bytes=frag.file_size() + len(com.to_bytes()),
                           save_seconds=time.perf_counter() - t0)

    def _check_crossings(self, step: int, rows: list[list[bytes]], cols: list[list[bytes]]) -> None:
        """Every block P[i, j] is hashed twice, by worker i in its row and by worker j in its
        column: a save commits only when all n(n − 1) pairs agree. Otherwise it fails on every
        rank (the previous step stays the newest restorable one), naming a rank that disagrees
        with more than t peers (at most t ranks are bad, so an honest one never does)."""
        cells = self.code.crossing_mismatches(rows, cols)
        if not cells:
            return
        peers: dict[int, set[int]] = {}
        for i, j in cells:
            peers.setdefault(i, set()).add(j)
            peers.setdefault(j, set()).add(i)
        liars = sorted(r for r, p in peers.items() if len(p) > self.t)
        who = (f"rank(s) {liars} sent line hashes that disagree with more than t={self.t} peers'" if liars
               else f"ranks disagree about the blocks {cells[:8]} (row owner, column owner)")
        raise RuntimeError(f"save(step={step}): {who}; the step is not committed")

    def _publish(self, d: Path, frag: Fragment, com: Commitment) -> None:
        """This rank's files of a step (its folder `d`): the fragment, then the commitment (the
        step is complete); written through the folder's descriptor, never through a link. A link
        or a file planted at this step's name in the rank's folder is removed through the rank
        folder's descriptor (the entry itself, never what it points to) and logged."""
        with _store.opened_folder(self.root_dir, f"rank{self.rank}", create=True) as rank_fd:
            try:
                st = os.stat(d.name, dir_fd=rank_fd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and not stat.S_ISDIR(st.st_mode):
                log.warning("save: rank%d/%s was %s, not a folder; removed (not followed)", self.rank, d.name,
                            "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a file")
                os.unlink(d.name, dir_fd=rank_fd)
        with _store.opened_folder(self.root_dir, f"rank{self.rank}", d.name, create=True) as fd:
            _store.write(_store.STEP_FRAGMENT, frag, dir_fd=fd)
            _store.write(_store.STEP_COMMITMENT, com, dir_fd=fd)

    def _prune(self, newest: int) -> None:
        """Keep the newest ``keep`` complete steps up to ``newest``; drop older ones and
        incomplete folders (a crashed save) older than ``newest``. Only real folders are
        removed, through the rank folder's descriptor (``rmtree(dir_fd=)``: a link swapped in for
        the rank folder or a step folder is never followed, so nothing outside the store is
        deleted); what cannot be removed (a link, a 3,000-level tree) is left and logged: a prune
        never fails the save that committed."""
        complete = sorted(s for s in self._local_steps() if s <= newest)
        keep = set(complete[-self.keep:])
        try:
            with _store.opened_folder(self.root_dir, f"rank{self.rank}") as fd:
                for name in os.listdir(fd):
                    s = _store.step_of(Path(name))
                    if s is None or s >= newest or s in keep:
                        continue
                    try:
                        if not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                            log.warning("prune: rank%d/%s left in place: not a real folder", self.rank, name)
                            continue
                        shutil.rmtree(name, dir_fd=fd)
                    except (OSError, RecursionError) as e:
                        log.warning("prune: rank%d/%s left in place: %s", self.rank, name,
                                    type(e).__name__ if isinstance(e, RecursionError) else e)
        except (_store.StoreError, OSError) as e:
            log.warning("prune: rank%d's folder left as it is: %s", self.rank, e)

    # ------------------------------------------------------------------ restore
    # The restore runs in named phases, each collective (every rank calls it, in this order, and
    # each ends in a collective whose size every rank knows beforehand):
    #   1. _vote()                      which steps k ranks hold: {(step, root): holders}
    #   then, per step, the newest first (_restore_step), until one is retrieved:
    #   2. _agreed_commitment(...)      the holders' copies of the voted commitment -> one
    #   3. _check(...)                  each rank checks its fragment; statuses all-gathered
    #   4. _repair_all(...)             each failed rank rebuilt from the helpers' symbols
    #   5. _write_back(...)             this rank's fragment and commitment copy to its disk
    #                                   (local; then who holds a fragment is all-gathered)
    #   6. _retrieve(...)               k verified rows broadcast; StepUnrecoverable -> older step
    #   7. _load(...)                   the state decoded from those rows and torch.load-ed
    # Phases 2–6 raise alike on every rank, so no rank is left waiting in a collective.
    def restore(self) -> Restored | None:
        """Collective. Find the newest step whose commitment at least k ranks agree on, check
        this rank's fragment against it, rebuild missing or corrupted fragments from peers'
        repair symbols, decode the state from any k rows and return a :class:`Restored` (state,
        step, this rank's per-rank extras, what was repaired and reported, timings; it unpacks
        as ``state, step``); None when no step is restorable (a fresh start). When the newest
        step cannot be retrieved, the next older one that k ranks hold is tried
        (``Restored.skipped`` names what was skipped and why). A background save in flight is
        waited for."""
        self.wait()
        with _store.RankFolders(self.root_dir, self.rank) as folders:
            return self._restore(folders)

    def _restore(self, folders: _store.RankFolders) -> Restored | None:
        t0 = time.perf_counter()
        votes = self._vote(folders)
        ok_steps = sorted((key for key, rs in votes.items() if len(rs) >= self.k), reverse=True)
        if not ok_steps:
            if votes:  # something was saved, but too little of it survives: say so, loudly
                newest = max(s for s, _ in votes)
                where = sorted({r for (s, _), rs in votes.items() if s == newest for r in rs})
                raise RuntimeError(
                    f"restore: no checkpoint step is held by k={self.k} ranks; newest step {newest} "
                    f"survives on ranks {where} only (this code tolerates t={self.t} lost ranks)")
            self._stats = dict(op="restore", step=None)
            return None
        skipped: list[tuple[int, str]] = []
        for step, root in ok_steps:  # the newest first; an older one when a step cannot be retrieved
            try:
                return self._restore_step(folders, step, root, votes[(step, root)], t0, skipped)
            except StepUnrecoverable as e:
                log.error("restore: step %d cannot be retrieved (%s); falling back to the next older step",
                          step, e)
                skipped.append((step, str(e)))
        raise RuntimeError("restore: no step that k ranks hold could be retrieved: "
                           + "; ".join(f"step {s}: {why}" for s, why in skipped))

    def _vote(self, folders: _store.RankFolders) -> dict[tuple[int, bytes], list[int]]:
        """Phase 1, collective: every rank's complete local steps (:meth:`_local_steps`, read
        through `folders` before the collective) all-gathered in fixed-size messages -> (step,
        root) -> the ranks holding that commitment."""
        digest = len(self.code._h(b""))
        mine = _wire.votes(self._local_steps(folders), digest)
        held = [_wire.unvotes(b, digest) for b in self._gather(mine, _wire.votes_size(digest), self.group)]
        votes: dict[tuple[int, bytes], list[int]] = {}
        for r, steps in enumerate(held):
            for s, root in steps.items():
                votes.setdefault((s, root), []).append(r)
        return votes

    def _restore_step(self, folders: _store.RankFolders, step: int, root: bytes, holders: list[int],
                      t0: float, skipped: list[tuple[int, str]]) -> Restored:
        """Phases 2–7 for `step` (its commitment root `root`, voted for by `holders`), this rank's
        files read and written through `folders`. Raises :class:`StepUnrecoverable` on every rank
        alike when fewer than k rows verify."""
        com = self._agreed_commitment(folders, step, root, holders)
        statuses, frag, lines = self._check(folders, step, com)
        targets = [r for r, s in enumerate(statuses) if s != "ok"]
        helpers = [r for r, s in enumerate(statuses) if s == "ok"]
        if targets:
            log.warning("restore step %d: rank(s) %s need repair (%s)", step, targets,
                        {r: statuses[r] for r in targets})
        t_rep = time.perf_counter()
        rebuilt, sent, recv, reporters = self._repair_all(targets, helpers, lines, com)
        if self.rank in targets:
            frag = rebuilt
        t_write = time.perf_counter()
        have = self._write_back(folders, step, frag, com, self.rank in targets)
        t_ret = time.perf_counter()
        rows, idx, s, rc, row_reporters = self._retrieve(frag, com, have)
        for i, by in row_reporters.items():
            reporters.setdefault(i, set()).update(by)
        # named only on the word of more than t ranks: at most t bad ones cannot name an honest rank
        bad_helpers = sorted(r for r, by in reporters.items() if len(by) > self.t)
        t_load = time.perf_counter()
        state = self._load(rows, idx, com)
        self._stats = dict(op="restore", step=step, repaired=targets, helpers=helpers,
                           repair_bytes_sent=sent, repair_bytes_received=recv,
                           retrieve_bytes_sent=s, retrieve_bytes_received=rc,
                           bad_helpers=bad_helpers, check_seconds=t_rep - t0,
                           reported={r: sorted(by) for r, by in sorted(reporters.items())},
                           repair_seconds=t_write - t_rep, write_seconds=t_ret - t_write,
                           retrieve_seconds=t_load - t_ret, load_seconds=time.perf_counter() - t_load,
                           restore_seconds=time.perf_counter() - t0, state_bytes=com.data_len,
                           block_size=com.block_size, skipped=list(skipped))
        return Restored(state, step, self.per_rank, list(targets), bad_helpers, self._stats["reported"],
                        self.stats(), list(skipped))

    def _check(self, folders: _store.RankFolders, step: int, com: Commitment
               ) -> tuple[list[str], Fragment | None, Lines | None]:
        """Phase 3, collective: this rank checks its fragment (:meth:`_check_local`); the
        statuses ("ok" or what is wrong) are all-gathered -> (every rank's status, this rank's
        fragment and verified lines, or None)."""
        status, frag, lines = self._check_local(folders, step, com)
        statuses = [_wire.untext(b) or "(empty status)"
                    for b in self._gather(_wire.text(status), _wire.TEXT_BYTES, self.group)]
        return statuses, frag, lines

    def _repair_all(self, targets: list[int], helpers: list[int], lines: Lines | None, com: Commitment
                    ) -> tuple[Fragment | None, int, int, dict[int, set[int]]]:
        """Phase 4, collective: :meth:`_repair` for every target in turn -> (this rank's rebuilt
        fragment or None, bytes sent, bytes received, rank -> the targets that reported its
        symbols bad)."""
        out, sent, recv = None, 0, 0
        reporters: dict[int, set[int]] = {}
        for target in targets:
            frag_or_none, s, rc, bad = self._repair(target, helpers, lines, com)
            sent, recv = sent + s, recv + rc
            for h in bad:  # the target's word alone: evidence, not a verdict
                reporters.setdefault(h, set()).add(target)
            if target == self.rank:
                out = frag_or_none
        return out, sent, recv, reporters

    def _write_back(self, folders: _store.RankFolders, step: int, frag: Fragment | None, com: Commitment,
                    rebuilt: bool) -> list[bool]:
        """Phase 5: this rank's rebuilt fragment (if `rebuilt`) and its commitment copy (if it
        differs) written to its step folder, the one the vote read (`folders`; created if there
        was none), never through a link (:func:`._store.opened_folder`); a disk that refuses is
        logged, the restore goes on from memory. Collective at its end: which ranks hold a
        fragment (all-gathered)."""
        if frag is not None:
            try:
                fd = folders.step_folder(step, create=True)  # never through a link
                if rebuilt:
                    _store.write(_store.STEP_FRAGMENT, frag, dir_fd=fd)
                if not _store.holds(_store.STEP_COMMITMENT, com, dir_fd=fd):
                    _store.write(_store.STEP_COMMITMENT, com, dir_fd=fd)  # restores its vote
            except (OSError, _store.StoreError) as e:  # (a folder in the file's place, a link in the
                # store's): this restore has what it needs in memory, so it goes on
                log.warning("restore step %d: could not write rank %d's files back (%s); the state is "
                            "restored, but this rank's disk still lacks it", step, self.rank, e)
        return [bool(b and b[0]) for b in self._gather(bytes([frag is not None]), 1, self.group)]

    def _load(self, rows: _Rows, idx: list[int], com: Commitment) -> Any:
        """Phase 7 (local): the state from k verified rows (``torch.load`` with `weights_only`);
        this rank's per-rank extras go to ``self.per_rank``."""
        saved = _load_rows(rows, idx, com.data_len, self.code, self.weights_only)
        mine = saved["per_rank"][self.rank] if saved["per_rank"] is not None else None
        self.per_rank = deserialize(mine) if isinstance(mine, bytes) else mine  # (format v1: objects)
        return saved["state"]

    def _agreed_commitment(self, folders: _store.RankFolders, step: int, root: bytes, holders: list[int]
                           ) -> Commitment:
        """Phase 2, collective: the commitment of `step` whose root `root` k ranks voted for. Every
        holder sends its copy, the one its vote read (``folders.commitments``: never read again, so
        a file rewritten or unreadable since costs nothing), in a fixed number of bytes; each rank
        takes the first copy that parses, is consistent with this code and has that root, so a
        lying holder is passed over. More than t holders of another code (restarted with another
        world size, t or hash) raise on every rank; fewer send no copy."""
        mine, err = b"", None
        com = folders.commitments.get(step)
        if self.rank in holders and com is not None and com.root == root:
            try:
                self.code._check(com)
                mine = self._commitment_copy(com)
            except ValueError as e:
                err = f"step {step} was saved with another code: {e}"
        self._raise_if_over_t(err, f"restore step {step}", self.group,
                              "no more than t holders, rank(s) {bad}, hold it under another code; they send "
                              "no copy")
        copies = self._gather(mine, self._commitment_bytes(), self.group)
        v1: dict[bytes, list[int]] = {}  # format-1 copies by their bytes -> the holders that sent them
        for r in holders:
            try:
                com = Commitment.from_bytes(copies[r] or b"")
                self.code._check(com)
            except ValueError:
                log.warning("restore step %d: rank %d sent an invalid commitment; ignored", step, r)
                continue
            if com.root != root:
                log.warning("restore step %d: rank %d sent a commitment with another root; ignored", step, r)
            elif com.version >= 2:  # the root binds every field: any copy with it is the commitment
                return com
            else:
                v1.setdefault(bytes(copies[r]), []).append(r)
        # format 1 binds only the line roots: a bad holder can rewrite data_len or block_size and
        # keep the root. Take a copy only when more than t holders sent it byte for byte (at least
        # one of them honest; the ≥ k − t honest holders always are enough).
        for blob, senders in v1.items():
            if len(senders) > self.t:
                if len(v1) > 1:
                    log.warning("restore step %d: format-1 commitments differ among holders %s; took the "
                                "one %d holders sent", step, holders, len(senders))
                return Commitment.from_bytes(blob)
        raise RuntimeError(f"restore: no valid commitment of step {step} with the agreed root among its "
                           f"holders {holders}" + (f" (format-1 copies, which do not bind their header, "
                                                   f"agree on at most {max(map(len, v1.values()))} "
                                                   f"holders; more than t={self.t} needed)" if v1 else ""))

    # what this rank sends its peers (test doubles of a bad rank override these four)
    def _helper_payload(self, lines: Lines, target: int) -> list:
        return self.code.helper_symbols(lines, target).to_parts()

    def _commitment_copy(self, com: Commitment) -> bytes:
        return com.to_bytes()

    def _leaves_sent(self, row: list[bytes], col: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        return row, col

    def _row_payload(self, frag: Fragment) -> bytes:
        return frag.row

    def _commitment_bytes(self) -> int:
        """The length of any commitment of this code (the header's size is fixed by it)."""
        d = len(self.code._h(b""))
        lines = (bytes(d),) * (2 * self.n)
        dummy = Commitment(self.n, self.t, 0, 1, self.code.hash_name, CODEC, lines, bytes(d))
        return len(dummy.to_bytes())

    def _check_local(self, folders: _store.RankFolders, step: int, com: Commitment
                     ) -> tuple[str, Fragment | None, Lines | None]:
        """This rank's status ("ok" or what is wrong), fragment and verified :class:`Lines`,
        the fragment read in the step folder the vote opened (`folders`)."""
        try:
            fd = folders.step_folder(step)
        except FileNotFoundError:
            return "missing", None, None
        except (_store.StoreError, OSError) as e:  # a link in the store: repaired, never written through
            return f"refused ({e})", None, None
        try:
            frag = _store.read_fragment(_store.STEP_FRAGMENT, com, dir_fd=fd)  # a regular file of com's size
        except FileNotFoundError:
            return "missing", None, None
        except (ValueError, OSError, MemoryError) as e:  # a local failure is a status, not a raise
            return f"unreadable ({e})", None, None
        if frag.index != self.rank:
            return f"holds rank {frag.index}'s fragment", None, None
        lines = self.code.verified_lines(frag, com)
        if lines is None:
            return "corrupt (does not match the commitment)", None, None
        return "ok", frag, lines

    def _repair(self, target: int, helpers: list[int], lines: Lines | None,
                com: Commitment) -> tuple[Fragment | None, int, int, list[int]]:
        """Collective over the helpers and the target: each helper sends its two symbols (with
        Merkle paths) to the target. Returns (rebuilt fragment on the target, or None when it
        could not be rebuilt, bytes sent, bytes received, helpers whose symbols failed
        verification). A failed rebuild is the target's alone (e.g. its line was committed
        wrong): it restores from its peers' rows like everybody else."""
        sent = recv = 0
        err, out, bad = None, None, []
        size = self.code.symbols_size(target, com.block_size)  # exactly this much from each helper
        if self.rank in helpers:
            assert lines is not None
            parts = self._helper_payload(lines, target)
            if sum(len(memoryview(p).cast("B")) for p in parts) != size:  # pragma: no cover - ours fit
                raise RuntimeError(f"repair symbols of the wrong size, expected {size}")
            msg, pos = torch.empty(size, dtype=torch.uint8), 0
            for p in parts:  # the blocks are copied once, into the message
                b = np.frombuffer(p, np.uint8)
                msg.numpy()[pos:pos + len(b)] = b
                pos += len(b)
            dist.send(msg, global_rank(self.group, target), group=self.group)
            sent += size
        elif self.rank == target:
            symbols: list[RepairSymbols] = []
            for h in helpers:
                buf = torch.empty(size, dtype=torch.uint8)
                dist.recv(buf, global_rank(self.group, h), group=self.group)
                recv += buf.numel()
                try:
                    sym = RepairSymbols.from_bytes(buf.numpy())  # the blocks are views of buf
                    if sym.helper != h:
                        raise ValueError(f"claims to come from helper {sym.helper}")
                    symbols.append(sym)
                except ValueError as e:
                    log.warning("repair of rank %d: unreadable symbols from rank %d: %s", target, h, e)
                    bad.append(h)
            try:
                good, failed = self.code.verified_symbols(target, symbols, com)
                if failed:
                    log.warning("repair of rank %d: symbols from rank(s) %s failed verification", target,
                                failed)
                bad = sorted(set(bad) | set(failed))
                if len(good) < self.k:
                    err = str(NotEnoughSymbols(len(good), self.k, bad))
                else:
                    out = self.code.rebuild(target, good, com)
            except Exception as e:  # the target goes on without a fragment (see restore)
                err = f"{type(e).__name__}: {e}"
            if err is not None:
                log.warning("repair of rank %d failed (%s); it restores from its peers' rows", target, err)
        named = torch.frombuffer(bytearray(_wire.bitmap(self._repair_report(bad) if self.rank == target
                                                        else [], self.n)), dtype=torch.uint8)
        _wire.broadcast_direct(named, target, self.group)  # (from the target itself, never relayed)
        return out, sent, recv, _wire.unbitmap(named.numpy().tobytes())

    def _retrieve(self, frag: Fragment | None, com: Commitment, have: list[bool]
                  ) -> tuple[_Rows, list[int], int, int, dict[int, set[int]]]:
        """Phase 6, collective: k rows C[i, :] (|m|/k bytes each) that this rank verified itself ->
        (the rows, their indices, bytes sent, bytes received, the ranks that reported each
        row that any rank reported bad). Only ranks that hold a fragment (`have`, the same on
        every rank) send rows.

        The systematic rows 0..k−1 are sent by their holders to every rank directly
        (:func:`._wire.exchange`: never relayed) into one (n, k·B) buffer, so
        that when they all verify the data is that buffer's first k rows (no decode, no copy).
        Each rank verifies every row it receives and reports the ones that failed (an
        all-gather of bitmaps); the union of the reports only decides how many of the next
        parity rows are broadcast (so every rank fetches what any rank misses, at most n rows
        in all). Each rank decodes from rows it verified itself, and a row is named bad only
        when at least t + 1 ranks report it: a lying report (from at most t ranks) can neither
        block the restore nor get an honest rank named. (Direct sends moved 256 MiB over gloo in
        0.21–0.23 s, k broadcasts in 0.58–0.61 s, an all-gather of all n rows in 1.2–2.5 s, 4
        processes; see docs/ckpt.md.)"""
        n, k, L = self.n, self.k, self.k * com.block_size
        rows = _Rows(n, L)  # pages of unused parity rows are never touched
        try:
            mine: list[int] = []  # rows this rank verified (its own counts: checked on disk)
            reporters: dict[int, set[int]] = {}  # row -> the ranks that reported it bad
            sent = recv = 0
            holders = [i for i in range(n) if have[i]]
            pending, spare = holders[:k], holders[k:]
            payload = self._row_payload(frag) if frag is not None else b""
            while pending:
                if self.rank in pending:
                    rows.array[self.rank] = np.frombuffer(payload, dtype=np.uint8)  # (L,)
                    sent += L * (n - 1)
                recv += L * sum(i != self.rank for i in pending)
                # each row sent by its holder to every rank directly (never relayed through a third
                # rank), all queued at once; each row is verified as soon as it has arrived, while
                # the next ones are still on the wire
                others = [p for p in range(n) if p != self.rank]
                received, sending = _wire.exchange(
                    {p: rows.tensor[self.rank] for p in others} if self.rank in pending else {},
                    {i: rows.tensor[i] for i in pending if i != self.rank}, self.group)
                failed = []
                for i, work in received.items():
                    work.wait()
                    if not self.code.verify_row(i, rows.array[i], com):
                        failed.append(i)
                for work in sending:
                    work.wait()
                if self.rank in pending and frag is not None and payload is not frag.row:
                    # (a test double sent other bytes: it decodes its own)
                    rows.array[self.rank] = np.frombuffer(frag.row, dtype=np.uint8)
                mine += [i for i in pending if i not in failed]
                union: set[int] = set()
                for r, f in enumerate(self._gather(_wire.bitmap(self._row_report(failed), n), n, self.group)):
                    got = {i for i in _wire.unbitmap(f or b"") if i in pending}
                    union |= got
                    for i in got:
                        reporters.setdefault(i, set()).add(r)
                more = len(union)  # the same on every rank, and ≥ any rank's own failures
                pending, spare = spare[:more], spare[more:]
            bad = sorted(i for i, by in reporters.items() if len(by) > self.t)
            if bad:
                log.warning("retrieve: rows from rank(s) %s failed verification and were excluded", bad)
            err = None if len(mine) >= k else str(NotEnoughSymbols(len(mine), k, bad, "retrieve", "rows"))
            # every rank takes part, whatever its count; the step is given up (restore then tries an
            # older one) only when more than t ranks report it so: honest ranks verify the same
            # bytes and agree, so a lone reporter cannot roll the group back
            self._unrecoverable_if_over_t(err)
        except BaseException:
            rows.close()  # (the memfd and its pages are not left behind)
            raise
        return rows, sorted(mine)[:k], sent, recv, reporters

    def _unrecoverable_if_over_t(self, err: str | None) -> None:
        """Collective: every rank raises :class:`StepUnrecoverable` when more than t ranks could
        not retrieve the step. With at most t reporters the step stands: the others log them as
        an error, and a reporter whose own retrieval really failed raises alone."""
        bad = self._errors(err, self.group)
        if len(bad) > self.t:
            raise StepUnrecoverable(f"retrieve failed on rank(s) {sorted(bad)}: "
                                    + "; ".join(f"rank {r}: {e}" for r, e in bad.items()))
        if err is not None:
            raise StepUnrecoverable(f"retrieve failed on this rank ({err}) but on no more than t={self.t} "
                                    "ranks: the others restore this step")
        if bad:
            log.error("retrieve: rank(s) %s reported the step unrecoverable (%s), but no more than t=%d "
                      "ranks did and this rank retrieved it: the step is restored, the reports are not "
                      "trusted", sorted(bad), "; ".join(f"rank {r}: {e}" for r, e in bad.items()), self.t)

    def _repair_report(self, failed: list[int]) -> list[int]:
        """The helpers this repair target reports as bad (a test double of a bad rank overrides it)."""
        return failed

    def _row_report(self, failed: list[int]) -> list[int]:
        """The rows this rank reports as failed (a test double of a bad rank overrides it)."""
        return failed

    def stats(self) -> dict[str, Any]:
        """Figures of the last save or restore: bytes moved (repair and retrieval, sent and
        received by this rank), times, repaired ranks, helpers; ``reported``: each rank whose
        repair symbols or row some rank found bad -> the ranks that said so; ``bad_helpers``: the
        ranks reported by more than t ranks (excluded and named: t bad ranks cannot name an
        honest one)."""
        return dict(self._stats, rank=self.rank, n=self.n, t=self.t, k=self.k)
