"""``rankwise ckpt``: encode, verify, repair, retrieve and inspect 2-D coded checkpoints.

Overwrites: ``encode`` refuses an output folder that already holds a coded checkpoint
(``--force`` replaces it: the old commitment is removed first, then fragments are written,
stale ``worker{i}.rwck`` beyond the new n are deleted, and the commitment is written last);
``retrieve`` refuses an existing ``--out`` file without ``--force``; ``repair`` rewrites only
a worker whose fragment is missing or does not match the commitment (``--force`` rebuilds a
valid one too); ``demo`` refuses a ``--workdir`` that holds an earlier demo without ``--force``
and never deletes anything else there.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from .._checks import code_geometry_problem
from ._common import (
    Command,
    Force,
    UserError,
    check_new_file,
    check_range,
    claim_output_dir,
    full_disk_cleaned,
    lock_output,
    new_app,
    unwritable_folder,
)

app = new_app("2-D coded checkpoints: any k = n − t workers restore, any worker is rebuilt "
              "from two small symbols of each of k peers.")
console = Console()
Folder = Annotated[Path, typer.Argument(help="Folder with commitment.rwck and worker{i}.rwck, or a step "
                                        "folder STORE/rank{i}/step_* of a CodedCheckpointer store (`rankwise "
                                        "train --checkpoint-dir STORE`): worker i is rank i.",
                                        metavar="FOLDER", show_default=False)]
CODED_OUTPUTS = (r"commitment\.rwck", r"worker\d+\.rwck")  # regexes


COMMITMENT = "commitment.rwck"  # = rankwise.ckpt._store.COMMITMENT_FILE (importing that imports torch)


V1Ok = Annotated[bool, typer.Option(
    "--v1-not-tamper-evident", help="Read a folder whose commitment has format 1 anyway: its root does "
    "not bind n, t, the data length or the block size, so a rewritten header (e.g. the data cut short) "
    "is not detected.")]


def _open(folder: Path, *, v1_ok: bool = True, pinned: bytes | None = None):
    """(code, commitment, found fragments, problems, ``(store, step)`` for a checkpointer step
    folder else None) of a folder, or a one-line UserError. A folder with no commitment is
    refused before the codec (and torch) is imported; one whose commitment has format 1 unless
    `v1_ok`; one whose root is not `pinned` (``--root``) before any worker file is read. A step
    folder of a ``CodedCheckpointer`` store (``STORE/rank{i}/step_*``, e.g. from ``rankwise train
    --checkpoint-dir``) is read as one checkpoint whose worker i is
    ``STORE/rank{i}/step_*/fragment.rwck``."""
    if not folder.is_dir():
        raise UserError(f"FOLDER {folder} " + ("is not a folder" if folder.exists() else "does not exist"))
    if not (folder / COMMITMENT).exists():
        raise UserError(f"no {COMMITMENT} in {folder}; is this a folder written by `rankwise ckpt "
                        "encode`?", 1)
    from ..ckpt import Code2D, _store, load_commitment, load_fragments

    try:
        com = load_commitment(folder)
        code = Code2D(com.n, com.t, hash=com.hash)
        code._check(com)  # its fields hash to its root, its block size fits its length
    except FileNotFoundError as e:
        raise UserError(f"{e}; is this a folder written by `rankwise ckpt encode`?", 1) from e
    except ValueError as e:
        raise UserError(f"{folder}: {e}", 1) from e
    if pinned is not None and com.root != pinned:
        raise UserError(f"{folder}'s commitment has root {com.root.hex()}, not the --root given; "
                        "the commitment was replaced", 1)
    if com.version < 2 and not v1_ok:
        raise UserError(f"{folder}'s commitment has format {com.version}, whose root does not bind its "
                        "header (n, t, data length, block size): a rewritten header is not detected. "
                        "Re-encode the data to upgrade, or pass --v1-not-tamper-evident to read it anyway", 1)
    in_store = _store.store_step(folder)
    if in_store is None:
        found, problems = load_fragments(folder, com)
    else:  # a checkpointer step: worker i is rank i's fragment
        store, step = in_store
        found, problems = load_fragments(folder, com, where=lambda i: _store.step_fragment(store, i, step))
    return code, com, found, problems, in_store


def _check(code, com, found: dict, problems: dict) -> dict[int, str]:
    """Every worker's status against the commitment: "ok" or what is wrong."""
    status = {}
    for i in range(com.n):
        if i in found:
            status[i] = "ok" if code.verify(found[i], com) else "does not match the commitment"
        else:
            status[i] = problems.get(i, "missing")
    return status


@app.command("encode", cls=Command)
def encode_cmd(
    file: Annotated[Path, typer.Argument(help="The checkpoint file to encode.", metavar="FILE",
                                         show_default=False)],
    n: Annotated[int, typer.Option("--n", help="Number of workers (3t < n <= 255).")],
    t: Annotated[int, typer.Option("--t", help="Workers that may be lost (t >= 1, 3t < n).")],
    out: Annotated[Path, typer.Option(help="Output folder (created if missing).")],
    hash: Annotated[str, typer.Option(help="Merkle hash: blake3 or sha256.")] = "blake3",
    backend: Annotated[str, typer.Option(help="auto, isal or numpy.")] = "auto",
    force: Force = False,
) -> None:
    """Write one fragment file per worker and the commitment."""
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
    from ..ckpt import Code2D, save_dispersal

    code = Code2D(n, t, hash=hash, backend=backend)
    data = file.read_bytes()  # before --force may delete it (FILE could be one of the outputs)
    # one encode at a time in --out (a second is refused, not interleaved); the folder itself is
    # locked: it holds exactly the fragments and the commitment
    lock_output(out, lock_file=False)
    # the old commitment goes first, so an interrupted --force leaves an incomplete folder
    claim_output_dir(out, produced=CODED_OUTPUTS, force=force, what="coded checkpoint")
    t0 = time.perf_counter()
    with console.status(f"encoding {len(data):,} bytes"):
        disp = code.encode(data)
    from rich.progress import track

    with full_disk_cleaned(out, CODED_OUTPUTS):  # (a full disk: the fragments written so far go)
        save_dispersal(out, disp, progress=lambda fs: track(fs, description="writing fragments",
                                                            console=console, transient=True))
    com = disp.commitment
    stored = sum(len(f.row) + len(f.col) for f in disp.fragments)
    console.print(f"{n} fragments of {2 * code.k * com.block_size:,} bytes in {out} "
                  f"(stored {stored / len(data):.2f}× the data; backend {code.backend}; "
                  f"{time.perf_counter() - t0:.2f} s); commitment root {com.root.hex()} (keep it to check "
                  "the folder later: `retrieve --root`)")


Root = Annotated[str | None, typer.Option(help="The commitment root `encode` printed (hex): a folder whose "
                                               "commitment has another root is refused before any worker "
                                               "file is read (a commitment forged whole).")]


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
def verify_cmd(folder: Folder, v1: V1Ok = False, root: Root = None) -> None:
    """Check every fragment against the commitment; exit 1 if any is missing or bad."""
    from rich.table import Table

    code, com, found, problems, _ = _open(folder, v1_ok=v1, pinned=_pinned(root))
    status = _check(code, com, found, problems)
    table = Table("worker", "status")
    for i, s in status.items():
        table.add_row(str(i), s)
    console.print(table)
    if any(s != "ok" for s in status.values()):
        raise typer.Exit(1)


@app.command("repair", cls=Command)
def repair_cmd(folder: Folder,
               worker: Annotated[int, typer.Option(help="The worker to rebuild (0 to n−1).")],
               force: Annotated[bool, typer.Option("--force", help="Rebuild the worker's fragment even "
                                                   "if the present one is valid.")] = False,
               v1: V1Ok = False, root: Root = None) -> None:
    """Rebuild one worker's fragment from its peers' repair symbols (deletes nothing)."""
    code, com, found, _, in_store = _open(folder, v1_ok=v1, pinned=_pinned(root))
    from ..ckpt import NotEnoughSymbols, _store, fragment_path

    if not 0 <= worker < com.n:
        raise UserError(f"--worker must be in 0 … {com.n - 1} for this {com.n}-worker checkpoint; "
                        f"got {worker}")
    if worker in found and code.verify(found[worker], com) and not force:
        console.print(f"worker {worker}'s fragment is present and matches the commitment; nothing to "
                      "repair (--force rebuilds it anyway)")
        return
    # where the fragment goes must accept it: checked before the work, not after
    target = (folder if in_store is None else
              in_store[0].joinpath(*_store.step_parts(worker, in_store[1])))
    if (problem := unwritable_folder(target)) is not None:
        raise UserError(f"cannot write worker {worker}'s fragment: {problem}; nothing was repaired (fix "
                        "that, or copy the checkpoint somewhere writable and repair the copy)", 1)
    helpers = [f for i, f in sorted(found.items()) if i != worker and code.verify(f, com)]
    syms = [code.helper_symbols(f, worker) for f in helpers[:code.k]]
    try:
        frag = code.repair(worker, syms, com)
    except NotEnoughSymbols as e:
        raise UserError(f"cannot repair worker {worker}: {e}", 1) from e
    if in_store is not None:  # the rank's step folder (real), and its commitment copy if it lacks one
        store, step = in_store
        try:
            with _store.opened_folder(store, *_store.step_parts(worker, step), create=True) as fd:
                _store.write(_store.STEP_FRAGMENT, frag, dir_fd=fd)
                if not _store.holds(_store.STEP_COMMITMENT, com, dir_fd=fd):
                    _store.write(_store.STEP_COMMITMENT, com, dir_fd=fd)
        except (_store.StoreError, OSError) as e:  # (a link, a file in the folder's place, no permission)
            raise UserError(f"cannot write worker {worker}'s fragment: {e}", 1) from e
    else:
        _store.write(fragment_path(folder, worker), frag)
    payload, wire = sum(s.nbytes for s in syms), sum(s.wire_bytes for s in syms)
    console.print(f"rebuilt worker {worker} from {len(syms)} helpers: read {payload:,} payload bytes "
                  f"({wire:,} with Merkle paths); full retrieval reads {com.data_len:,}")


@app.command("retrieve", cls=Command)
def retrieve_cmd(folder: Folder,
                 out: Annotated[Path, typer.Option(help="The file to write the data to.")],
                 force: Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")]
                 = False,
                 root: Root = None, v1: V1Ok = False) -> None:
    """Decode the original file from any k valid fragments."""
    pinned = _pinned(root)
    check_new_file(out, force=force)
    code, com, found, _, _ = _open(folder, v1_ok=v1, pinned=pinned)
    from .. import _io
    from ..ckpt import NotEnoughSymbols

    try:
        data = code.retrieve(list(found.values()), com)
    except NotEnoughSymbols as e:
        raise UserError(f"cannot retrieve from {folder}: {e}", 1) from e
    _io.write_atomic(out, data)
    console.print(f"wrote {len(data):,} bytes to {out}")


@app.command("inspect", cls=Command)
def inspect_cmd(folder: Folder, root: Root = None) -> None:
    """Show the commitment and whether each fragment matches it (exit 0 either way; `verify`
    exits 1 on a problem)."""
    code, com, found, problems, in_store = _open(folder, pinned=_pinned(root))
    status = _check(code, com, found, problems)
    bad = {i: s for i, s in status.items() if s != "ok"}
    if in_store is not None:
        console.print(f"a CodedCheckpointer step: worker i is {in_store[0]}/rank{{i}}/{folder.name}/"
                      "fragment.rwck")
    console.print(f"n={com.n} t={com.t} k={com.n - com.t} data {com.data_len:,} bytes, "
                  f"block {com.block_size:,} bytes, hash {com.hash}, codec {com.codec}, "
                  f"format {com.version}, root {com.root.hex()}")
    if com.version < 2:
        console.print(f"[yellow]format {com.version}: the root does not bind the header (n, t, data length, "
                      "block size), so a rewritten header is not detected; verify, repair and retrieve "
                      "refuse it without --v1-not-tamper-evident[/yellow]")
    console.print(f"fragments present: {sorted(found)}; matching the commitment: "
                  f"{sorted(i for i, s in status.items() if s == 'ok')}")
    console.print("problems: " + ("; ".join(f"worker {i}: {s}" for i, s in bad.items()) if bad else "none"))
    if 0 < len(bad) <= com.t:
        console.print(f"{len(bad)} of {com.n} workers need repair (up to t={com.t} can be rebuilt): "
                      "`rankwise ckpt repair FOLDER --worker I`")
    elif len(bad) > com.t:
        console.print(f"[red]{len(bad)} of {com.n} workers are bad, more than t={com.t}: "
                      "the data cannot be retrieved[/red]")


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
    t.add_row("checkpoint |m|", f"{r['state_bytes']:,} B")
    for h, b in r["repair_bytes_per_helper"].items():
        t.add_row(f"repair bytes from rank {h}", f"{b:,} B")
    t.add_row("repair bytes total (with Merkle paths)", f"{r['repair_bytes_total']:,} B")
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
