"""``rankwise ckpt``: encode, verify, repair, retrieve and inspect 2-D coded checkpoints.

A coded checkpoint is a folder with one folder per worker (party) i, ``rank{i}/``, holding the
worker's fragment (``fragment.rwck``) and the checkpoint's metadata with the commitment
(``.metadata.rwck``, the same in every folder): :mod:`rankwise.ckpt._layout`. ``encode`` writes
one from a file; ``dcp.save`` with :class:`rankwise.ckpt.CodedStorageWriter` writes one too, which
``verify``, ``repair``, ``retrieve`` (the checkpoint's raw bytes) and ``inspect`` read alike. The
metadata a quorum of the folders hold byte for byte is the checkpoint's. These five commands
never import torch.

Overwrites: ``encode`` refuses an output folder that already holds a coded checkpoint, or part
of one (a ``rank{i}`` folder with a fragment or a metadata file); ``--force`` replaces it: every
old metadata file is removed first (an interrupted run never leaves a mix that looks complete),
then each worker's fragment and metadata are written, and stale ``rank{i}`` folders beyond the
new n that hold nothing but those two files are deleted (nothing else is); ``retrieve`` refuses
an existing ``--out`` file without ``--force``; ``repair`` rewrites only a worker whose fragment
is missing or does not match the commitment (a matching fragment whose metadata is missing or
differs gets the metadata alone; ``--force`` rebuilds a valid fragment too); ``demo`` refuses a
``--workdir`` that holds an earlier demo without ``--force`` and never deletes anything else
there.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from .._checks import code_geometry_problem
from ._common import (
    FULL_DISK,
    Command,
    Force,
    UserError,
    check_new_file,
    check_range,
    claim_output_dir,
    lock_output,
    new_app,
    unwritable_folder,
)

app = new_app("2-D coded checkpoints: any k = n − t workers restore, any worker is rebuilt "
              "from two small symbols of each of k peers.")
console = Console()
Folder = Annotated[Path, typer.Argument(
    help="A coded checkpoint: the folder with one folder rank{i} per worker i (its fragment.rwck and "
    ".metadata.rwck), written by `rankwise ckpt encode` or by dcp.save with "
    "rankwise.ckpt.CodedStorageWriter.", metavar="FOLDER", show_default=False)]


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _party_number(name: str) -> int:
    return int(name[4:]) if name[4:].isdigit() else -1


def _no_checkpoint(folder: Path, s) -> UserError:
    """The refusal of a folder where no metadata has a quorum, naming what was found there."""
    names = sorted({*(f"rank{i}" for i in s.parties), *s.skipped}, key=_party_number)
    if not names:
        return UserError(f"no rank{{i}} folders in {folder}; is this a coded checkpoint (written by "
                         "`rankwise ckpt encode`, or by dcp.save with CodedStorageWriter)?", 1)
    why = "; ".join(f"{name}: {s.skipped[name]}" for name in names if name in s.skipped)
    return UserError(_one_line(
        f"no coded checkpoint in {folder}: no metadata that a quorum of its {len(names)} rank folders "
        f"hold alike" + (f" ({why[:600]}{'…' if len(why) > 600 else ''})" if why else "")), 1)


def _open(folder: Path, *, pinned: bytes | None = None):
    """``(code, scan)`` of a coded checkpoint folder (:func:`rankwise.ckpt._layout.scan`), or a
    one-line UserError: a folder that is not one, or where no metadata has a quorum (malformed
    metadata, or a commitment of another format, has none: :func:`._layout.commitment_of` refuses it), or
    whose commitment is inconsistent (its fields do not hash to its root), is refused; so is one
    whose root is not `pinned` (``--root``), before any fragment is read. Imports the codec
    (numpy), never torch."""
    if not folder.is_dir():
        raise UserError(f"FOLDER {folder} " + ("is not a folder" if folder.exists() else "does not exist"))
    from ..ckpt import Code2D, _layout

    for fragments in ((False, True) if pinned is not None else (True,)):
        try:
            s = _layout.scan(folder, fragments=fragments)
        except FileNotFoundError as e:
            raise UserError(_one_line(e), 1) from None
        if s.com is None:
            raise _no_checkpoint(folder, s)
        com = s.com
        try:
            code = Code2D(com.n, com.t, hash=com.hash)
            code._check(com)  # its fields hash to its root, its block size fits its length
        except ValueError as e:
            raise UserError(_one_line(f"{folder}: {e}"), 1) from None
        if pinned is not None and com.root != pinned:
            raise UserError(f"{folder}'s commitment has root {com.root.hex()}, not the --root given; "
                            "the commitment was replaced", 1)
    return code, s


def _status(code, s) -> tuple[dict[int, str], set[int]]:
    """Every worker's status ("ok" or what is wrong) and the workers whose fragments match the
    commitment. A matching fragment beside metadata that is missing, unreadable or not the
    quorum's is not "ok" either (that worker lost its vote: ``repair`` rewrites its metadata)."""
    from ..ckpt import _layout

    com = s.com
    status: dict[int, str] = {}
    good: set[int] = set()
    for i in range(com.n):
        name, frag = _layout.folder(i), s.fragments.get(i)
        why = s.skipped.get(name)
        if frag is not None:
            if code.verify(frag, com):
                good.add(i)
                status[i] = "ok" if why is None else f"fragment ok; {why}"
            else:
                status[i] = "does not match the commitment" + ("" if why is None else f"; {why}")
        elif i not in s.parties:
            status[i] = why or f"missing (no {name} folder)"
        elif not os.path.lexists(s.parties[i] / _layout.FRAGMENT):
            status[i] = f"missing (no {_layout.FRAGMENT})"
        else:
            status[i] = why or "missing"
    return status, good


def _others(s) -> list[str]:
    """The folders `scan` left out that are no worker of this checkpoint (beyond its n, say)."""
    from ..ckpt import _layout

    mine = {_layout.folder(i) for i in range(s.com.n)}
    return [f"{name} ({why})" for name, why in sorted(s.skipped.items(), key=lambda kv: _party_number(kv[0]))
            if name not in mine]


# --------------------------------------------------------------------------- encode
def _real_folder(parent: Path, name: str) -> bool | None:
    """True: ``parent/name`` is a real folder; False: it is something else (a link, a file);
    None: nothing is there."""
    try:
        st = os.lstat(parent / name)
    except FileNotFoundError:
        return None
    return stat.S_ISDIR(st.st_mode)


def _rank_folders(out: Path) -> list[str]:
    """The real ``rank{i}`` folders in `out` (the names :func:`._layout.scan` reads), by i."""
    from ..ckpt import _layout

    names = [p.name for p in out.iterdir() if _layout._FOLDER.fullmatch(p.name)]
    return sorted((n for n in names if _real_folder(out, n)), key=_party_number)


def _unlink(fd: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=fd)


def _drop_metadata(out: Path) -> None:
    """Remove the metadata of every rank folder in `out` (first, under ``--force``): until the
    new metadata is written, the folder holds no checkpoint that looks complete."""
    from ..ckpt import _layout, _store

    for name in _rank_folders(out):
        with _store.opened_folder(out, name) as fd:
            try:
                os.unlink(_layout.META, dir_fd=fd)
            except FileNotFoundError:
                continue
            except OSError as e:  # (a folder in its place)
                raise UserError(f"--out {out}: cannot remove {name}/{_layout.META} ({e.strerror}); "
                                "remove it, or choose another --out", 1) from None
            os.fsync(fd)


def _drop_stale(out: Path, n: int) -> tuple[list[str], list[str]]:
    """Delete the rank folders ``rank{i}``, i >= n, that hold nothing but a fragment and
    metadata (an earlier, larger checkpoint's). Anything else stays. Returns the folders
    deleted and what could not be (each with why): their metadata is gone already, so they
    cost nothing but space."""
    from ..ckpt import _layout, _store

    dropped, kept = [], []
    for name in _rank_folders(out):
        if _party_number(name) < n:
            continue
        try:
            with _store.opened_folder(out) as top, _store.opened_folder(top, name, where=out) as fd:
                if not set(os.listdir(fd)) <= {_layout.FRAGMENT, _layout.META}:
                    continue
                for f in (_layout.FRAGMENT, _layout.META):
                    _unlink(fd, f)
                os.rmdir(name, dir_fd=top)
                os.fsync(top)
            dropped.append(name)
        except (OSError, ValueError) as e:
            kept.append(f"{name} ({getattr(e, 'strerror', None) or e})")
    return dropped, kept


def _undo(out: Path, touched: list[tuple[str, bool]]) -> None:
    """Remove what an encode that failed wrote: each touched worker's fragment and metadata,
    and the rank folders it created (when empty)."""
    from ..ckpt import _layout, _store

    for name, created in touched:
        with contextlib.suppress(OSError, ValueError):
            with _store.opened_folder(out, name) as fd:
                for f in (_layout.META, _layout.FRAGMENT):
                    _unlink(fd, f)
            if created:
                os.rmdir(out / name)


@app.command("encode", cls=Command)
def encode_cmd(
    file: Annotated[Path, typer.Argument(help="The checkpoint file to encode.", metavar="FILE",
                                         show_default=False)],
    n: Annotated[int, typer.Option("--n", help="Number of workers (3t < n <= 255).")],
    t: Annotated[int, typer.Option("--t", help="Workers that may be lost (t >= 1, 3t < n).")],
    out: Annotated[Path, typer.Option(help="Output folder (created if missing): worker i's fragment and "
                                      "the metadata go to rank{i}/ in it.")],
    hash: Annotated[str, typer.Option(help="Merkle hash: blake3 or sha256.")] = "blake3",
    backend: Annotated[str, typer.Option(help="auto, isal or numpy.")] = "auto",
    force: Force = False,
) -> None:
    """Write one folder rank{i} per worker: its fragment and the metadata with the commitment."""
    if not file.is_file():
        raise UserError(f"FILE {file} " + ("is not a file" if file.exists() else "does not exist"))
    if (problem := code_geometry_problem(n, t)) is not None:
        raise UserError(f"--n and --t: {problem}")
    if hash not in ("blake3", "sha256"):
        raise UserError(f"--hash must be blake3 or sha256; got {hash!r}")
    if backend not in ("auto", "isal", "numpy"):
        raise UserError(f"--backend must be auto, isal or numpy; got {backend!r}")
    if file.stat().st_size == 0:
        raise UserError(f"FILE {file} is empty; there is nothing to encode")
    from ..ckpt import Code2D, _layout, _store

    code = Code2D(n, t, hash=hash, backend=backend)
    data = file.read_bytes()  # before --force may replace it (FILE could be one of the outputs)
    # one encode at a time in --out (a second is refused, not interleaved); the folder itself is
    # locked: it holds the rank folders only
    lock_output(out, lock_file=False)
    # an earlier checkpoint's files, or part of one's (an interrupted run's fragments): --force replaces them
    old = [f"{name}/{f}" for name in _rank_folders(out) for f in (_layout.META, _layout.FRAGMENT)
           if os.path.lexists(out / name / f)]
    if old and not force:
        shown = ", ".join(old[:3]) + (" …" if len(old) > 3 else "")
        raise UserError(f"--out {out} already holds a coded checkpoint ({shown}); pass --force to replace "
                        "it, or choose another --out", 1)
    for i in range(n):
        if _real_folder(out, _layout.folder(i)) is False:
            what = "a symbolic link" if (out / _layout.folder(i)).is_symlink() else "not a folder"
            raise UserError(f"--out {out}: {_layout.folder(i)} in it is {what}; worker {i}'s fragment goes "
                            "into a real folder of that name: remove it or choose another --out", 1)
    if (problem := unwritable_folder(out)) is not None:
        raise UserError(f"--out {out}: {problem}; choose another --out", 1)
    t0 = time.perf_counter()
    with console.status(f"encoding {len(data):,} bytes"):
        disp = code.encode(data)
    com = disp.commitment
    body = _layout.file_metadata(len(data), com)
    from rich.progress import track

    touched: list[tuple[str, bool]] = []
    try:
        if force:
            _drop_metadata(out)  # first: an interrupted --force leaves no complete-looking mix
        for frag in track(disp.fragments, description="writing fragments", console=console, transient=True):
            name = _layout.folder(frag.index)
            touched.append((name, _real_folder(out, name) is None))
            with _store.opened_folder(out, name, create=True) as fd:
                _layout.write_party(fd, frag, body)
    except (OSError, _store.StoreError) as e:
        _undo(out, touched)
        where = out / touched[-1][0] if touched else out
        if isinstance(e, OSError) and e.filename is not None and os.sep not in str(e.filename):
            where = where / str(e.filename)
        if isinstance(e, OSError) and e.errno in FULL_DISK:
            raise UserError(f"no space left on device writing {where} ({e.strerror or 'disk full'}); what "
                            f"this run wrote in --out {out} was removed: free some space or choose another "
                            "--out, then rerun", 1) from None
        raise UserError(_one_line(f"cannot write {where}: {getattr(e, 'strerror', None) or e}; what this run "
                                  f"wrote in --out {out} was removed"), 1) from None
    dropped, kept = _drop_stale(out, n) if force else ([], [])
    stored = sum(len(f.row) + len(f.col) for f in disp.fragments)
    console.print(f"{n} fragments of {2 * code.k * com.block_size:,} bytes in {out}/rank{{0…{n - 1}}} "
                  f"(stored {stored / len(data):.2f}× the data; backend {code.backend}; "
                  f"{time.perf_counter() - t0:.2f} s)"
                  + (f"; removed the stale {', '.join(dropped)}" if dropped else "")
                  + (f"; could not remove the stale {', '.join(kept)}" if kept else "")
                  + f"; commitment root {com.root.hex()} (keep it to check the folder later: "
                  "`verify --root`, `retrieve --root`)")


Root = Annotated[str | None, typer.Option(help="The commitment root `encode` printed (hex): a checkpoint "
                                               "whose commitment has another root is refused before any "
                                               "fragment is read (a commitment forged whole).")]


def _pinned(root: str | None) -> bytes | None:
    """The `--root` given, as 32 bytes (checked before anything is read)."""
    if root is None:
        return None
    try:
        pinned = bytes.fromhex(root)
    except ValueError:
        raise UserError(f"--root must be the commitment root in hex; got {root!r}") from None
    if len(pinned) != 32:
        raise UserError(f"--root must be the 64 hex digits `encode` printed; got {len(root)} characters")
    return pinned


@app.command("verify", cls=Command)
def verify_cmd(folder: Folder, root: Root = None) -> None:
    """Check every worker's fragment (and metadata) against the commitment; exit 1 if any is
    missing or bad."""
    from rich.table import Table

    code, s = _open(folder, pinned=_pinned(root))
    status, _ = _status(code, s)
    table = Table("worker", "status")
    for i, st in status.items():
        table.add_row(str(i), escape(st))
    console.print(table)
    if others := _others(s):
        console.print(escape("not workers of this checkpoint: " + "; ".join(others)))
    if any(st != "ok" for st in status.values()):
        raise typer.Exit(1)


@app.command("repair", cls=Command)
def repair_cmd(folder: Folder,
               worker: Annotated[int, typer.Option(help="The worker to rebuild (0 to n−1): its folder "
                                                   "rank{i} is made if missing.")],
               force: Annotated[bool, typer.Option("--force", help="Rebuild the worker's fragment even "
                                                   "if the present one is valid.")] = False,
               root: Root = None) -> None:
    """Rebuild one worker's fragment from its peers' repair symbols (deletes nothing)."""
    code, s = _open(folder, pinned=_pinned(root))
    from .. import _io
    from ..ckpt import NotEnoughSymbols, _layout, _store
    from ..ckpt._format import METADATA, seal

    com = s.com
    if not 0 <= worker < com.n:
        raise UserError(f"--worker must be in 0 … {com.n - 1} for this {com.n}-worker checkpoint; "
                        f"got {worker}")
    name = _layout.folder(worker)
    present = s.fragments.get(worker)
    valid = present is not None and code.verify(present, com)
    why = s.skipped.get(name)  # (beside a fragment that was read: what is wrong with the metadata)
    if valid and why is None and not force:
        console.print(f"worker {worker}'s fragment is present and matches the commitment; nothing to "
                      "repair (--force rebuilds it anyway)")
        return
    # where the fragment goes must accept it: checked before the work, not after
    target = folder / name
    problem = unwritable_folder(target)
    if problem is None and _real_folder(folder, name) is not None:
        try:
            with _store.opened_folder(folder, name):
                pass
        except (_store.StoreError, OSError) as e:
            problem = _one_line(getattr(e, "strerror", None) or e)
    if problem is not None:
        raise UserError(f"cannot write worker {worker}'s fragment: {problem}; nothing was repaired (fix "
                        "that, or copy the checkpoint somewhere writable and repair the copy)", 1)
    if valid and not force:  # the fragment is good: its metadata alone is rewritten
        try:
            with _store.opened_folder(folder, name) as fd:
                _io.write_atomic(_layout.META, seal(METADATA, s.body), dir_fd=fd)
        except (_store.StoreError, OSError) as e:
            raise UserError(_one_line(f"cannot write worker {worker}'s metadata: "
                                      f"{getattr(e, 'strerror', None) or e}"), 1) from None
        console.print(escape(f"worker {worker}'s fragment matches the commitment; rewrote its metadata "
                             f"(was: {why})"))
        return
    syms = []
    for j in sorted(s.fragments):  # the first k other workers whose fragments verify help
        if len(syms) == code.k:
            break
        lines = code.verified_lines(s.fragments[j], com) if j != worker else None
        if lines is not None:
            syms.append(code.helper_symbols(lines, worker))
    try:
        frag = code.repair(worker, syms, com)
    except NotEnoughSymbols as e:
        raise UserError(f"cannot repair worker {worker}: {e}", 1) from e
    try:
        with _store.opened_folder(folder, name, create=True) as fd:
            _layout.write_party(fd, frag, s.body)
    except (_store.StoreError, OSError) as e:  # (a link, a file in the folder's place, a full disk)
        raise UserError(_one_line(f"cannot write worker {worker}'s fragment: "
                                  f"{getattr(e, 'strerror', None) or e}"), 1) from None
    payload, wire = sum(x.nbytes for x in syms), sum(x.wire_bytes for x in syms)
    console.print(f"rebuilt worker {worker} ({folder / name}) from {len(syms)} helpers: read {payload:,} "
                  f"payload bytes ({wire:,} with Merkle paths); full retrieval reads {com.data_len:,}")


@app.command("retrieve", cls=Command)
def retrieve_cmd(folder: Folder,
                 out: Annotated[Path, typer.Option(help="The file to write the data to (a checkpoint of "
                                                   "dcp.save: its raw bytes).")],
                 force: Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")]
                 = False,
                 root: Root = None) -> None:
    """Decode the original file from any k valid fragments."""
    pinned = _pinned(root)
    check_new_file(out, force=force)
    code, s = _open(folder, pinned=pinned)
    from .. import _io
    from ..ckpt import NotEnoughSymbols

    frags = [s.fragments[i] for i in sorted(s.fragments)]  # systematic workers first
    rejected: list[int] = []
    try:
        data = code.retrieve(frags, s.com, rejected=rejected)
    except NotEnoughSymbols as e:
        raise UserError(f"cannot retrieve from {folder}: {e}", 1) from e
    left_out = sorted({frags[pos].index for pos in rejected} | (set(range(s.com.n)) - set(s.fragments)))
    try:
        _io.write_atomic(out, data)
    except OSError as e:
        raise UserError(f"--out {out}: cannot write it ({e.strerror or e})", 1) from None
    console.print(f"wrote {len(data):,} bytes to {out}"
                  + (f" (left out workers {left_out}: `verify` says why)" if left_out else ""))


@app.command("inspect", cls=Command)
def inspect_cmd(folder: Folder, root: Root = None) -> None:
    """Show the commitment, the metadata and whether each worker's fragment matches (exit 0
    either way; `verify` exits 1 on a problem)."""
    import json

    code, s = _open(folder, pinned=_pinned(root))
    com = s.com
    status, good = _status(code, s)
    bad = {i: st for i, st in status.items() if st != "ok"}
    entries = json.loads(s.body).get("state_dict_metadata") or {}  # (a dict: commitment_of read it)
    if not isinstance(entries, dict):  # (its commitment's checks do not cover this field)
        entries, what = {}, "malformed: its state_dict_metadata is not a mapping"
    elif entries == {"file": {"kind": "bytes"}}:
        what = "a file, `rankwise ckpt encode`"
    else:
        what = "dcp.save with CodedStorageWriter"
    console.print(f"n={com.n} t={com.t} k={com.n - com.t} data {com.data_len:,} bytes, "
                  f"block {com.block_size:,} bytes, hash {com.hash}, codec {com.codec}, "
                  f"root {com.root.hex()}")
    console.print(f"metadata: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} ({what})")
    console.print(f"fragments present: {sorted(s.fragments)}; matching the commitment: {sorted(good)}")
    console.print(escape("problems: " + ("; ".join(f"worker {i}: {st}" for i, st in bad.items()) if bad
                                         else "none")))
    if others := _others(s):
        console.print(escape("not workers of this checkpoint: " + "; ".join(others)))
    if len(good) < code.k:
        console.print(f"[red]only {len(good)} of {com.n} fragments match the commitment, fewer than "
                      f"k={code.k}: the data cannot be retrieved[/red]")
    elif bad:
        console.print(f"{len(bad)} of {com.n} workers need repair (any worker is rebuilt while k={code.k} "
                      "match): `rankwise ckpt repair FOLDER --worker I`")


@app.command("demo", cls=Command)
def demo_cmd(
    workdir: Annotated[Path, typer.Option(help="Scratch folder; the demo writes reference/, faulty/ and "
                                          "corrupt/ there (an earlier demo's are replaced only with "
                                          "--force).")]
    = Path("runs/ddp_resilience"),
    nproc: Annotated[int, typer.Option(help="Workers (torchrun --nproc_per_node); t = 1 needs >= 4.")] = 4,
    steps: Annotated[int, typer.Option(help="Training steps.")] = 40,
    every: Annotated[int, typer.Option(help="Checkpoint every this many steps.")] = 5,
    kill_step: Annotated[int, typer.Option(help="Step at which rank 2 is killed (not a checkpoint step).")]
    = 22,
    method: Annotated[str, typer.Option(help="dense (DDP + Adam) or sdlrt / dlrt (low-rank hidden layers, "
                                        "the optimizer data-parallel with process_group=).")] = "dense",
    force: Force = False,
) -> None:
    """Data-parallel training under torchrun (gloo, CPU): kill a worker with SIGKILL and wipe its
    store, let torchrun restart the group, repair the lost rank from its peers, finish training,
    and check the loss curve (and, low-rank, the ranks) against an uninterrupted run bitwise;
    then restore once more while rank 1 serves corrupted symbols. About 1.5 min on 2 cores."""
    if not 4 <= nproc <= 255:
        raise UserError(f"--nproc must be in [4, 255] (the demo loses t = 1 worker, the code needs "
                        f"3t < n <= 255); got {nproc}")
    check_range("--every", every, 1)
    check_range("--steps", steps, 1)
    if not 1 <= kill_step < steps or kill_step % every == 0:
        raise UserError(f"--kill-step must be in [1, {steps}) and not a multiple of --every={every} "
                        f"(a checkpoint step: no work would be lost); got {kill_step}")
    if kill_step < every:
        raise UserError(f"--kill-step {kill_step} comes before the first checkpoint (step --every={every}): "
                        f"there would be nothing to restore; give a --kill-step after step {every}, or a "
                        "smaller --every")
    from ..experiments.ddp_resilience import DEMO_OUTPUTS, METHODS, run_demo

    if method not in METHODS:
        raise UserError(f"--method must be one of {', '.join(METHODS)}; got {method!r}")

    claim_output_dir(workdir, produced=DEMO_OUTPUTS, force=force, option="--workdir", what="demo",
                     ours=lambda p: (p / "torchrun.log").is_file())  # each scenario's folder has one
    from rich.table import Table

    what = "running torchrun three times (reference, killed worker, lying rank)"
    if not console.is_terminal:  # (a pipe or a log: rich shows no status there)
        console.print(f"{what}, {steps} steps each; about 1.5 min on 2 cores", highlight=False)
    with console.status(what):
        r = run_demo(workdir, nproc=nproc, steps=steps, every=every, kill_rank=2, kill_step=kill_step,
                     method=method)
    t = Table(title=f"coded checkpoints under torchrun: {nproc} workers, k = {r['k']}", show_header=False)
    t.add_row("killed", f"rank {r['kill_rank']} at step {r['kill_step']} (SIGKILL, store wiped)")
    t.add_row("restored from step", str(r["restored_step"]))
    t.add_row("checkpoint |m| (state, every rank's RNG, framing)", f"{r['checkpoint_bytes']:,} B")
    for h, b in r["repair_bytes_per_helper"].items():
        t.add_row(f"repair bytes from rank {h}", f"{b:,} B")
    t.add_row("repair bytes total (raw blocks)", f"{r['repair_bytes_total']:,} B")
    t.add_row("payload measured vs 2d|m|/k²",
              f"{r['repair_payload_measured']:,} vs {r['repair_payload_formula']:,.0f} B")
    t.add_row("repair time vs full retrieval",
              f"{r['repair_seconds'] * 1e3:.1f} ms vs {r['retrieve_seconds'] * 1e3:.1f} ms")
    if method != "dense":
        t.add_row("ranks (first step → last)", f"{r['ranks_first']} → {r['ranks_final']}")
    t.add_row("loss curve equals uninterrupted run", "bitwise: yes" if r["bitwise_equal"] else "NO")
    cs = r["corrupt_scenario"]
    named = sorted(int(k) for k, v in cs["bad_helpers_seen"].items() if v == [1])
    t.add_row("lying rank 1 named and excluded by ranks", str(named))
    console.print(t)
    if not r["bitwise_equal"]:
        raise typer.Exit(1)
