"""``rankwise ckpt``: encode, verify, repair, retrieve and inspect 2-D coded checkpoints."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import track
from rich.table import Table

from .. import _io
from ..ckpt import Code2D, NotEnoughSymbols, fragment_path, load_commitment, load_fragments, save_dispersal

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="2-D coded checkpoints: any k = n − t workers restore, any worker is rebuilt "
                       "from two small symbols of each of k peers.")
console = Console()
Folder = Annotated[Path, typer.Argument(help="Folder with commitment.rwck and worker{i}.rwck.",
                                        file_okay=False)]


def _code(folder: Path):
    try:
        com = load_commitment(folder)
    except (FileNotFoundError, ValueError) as e:
        raise typer.BadParameter(str(e)) from e
    return Code2D(com.n, com.t, hash=com.hash), com


@app.command("encode")
def encode_cmd(
    file: Annotated[Path, typer.Argument(help="The checkpoint file to encode.", exists=True, dir_okay=False)],
    n: Annotated[int, typer.Option("--n", help="Number of workers.")],
    t: Annotated[int, typer.Option("--t", help="Workers that may be lost (3t < n).")],
    out: Annotated[Path, typer.Option(help="Output folder.", file_okay=False)],
    hash: Annotated[str, typer.Option(help="Merkle hash: blake3 or sha256.")] = "blake3",
    backend: Annotated[str, typer.Option(help="auto, isal or numpy.")] = "auto",
) -> None:
    """Write one fragment file per worker and the commitment."""
    try:
        code = Code2D(n, t, hash=hash, backend=backend)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    data = file.read_bytes()
    t0 = time.perf_counter()
    with console.status(f"encoding {len(data):,} bytes"):
        disp = code.encode(data)
    save_dispersal(out, disp, progress=lambda it: track(it, description="writing fragments",
                                                        console=console, transient=True))
    com = disp.commitment
    stored = sum(len(f.row) + len(f.col) for f in disp.fragments)
    console.print(f"{n} fragments of {2 * code.k * com.block_size:,} bytes in {out} "
                  f"(stored {stored / max(len(data), 1):.2f}× the data; backend {code.backend}; "
                  f"{time.perf_counter() - t0:.2f} s)")


@app.command("verify")
def verify_cmd(folder: Folder) -> None:
    """Check every fragment against the commitment; exit 1 if any is missing or bad."""
    code, com = _code(folder)
    found, problems = load_fragments(folder, com.n)
    table = Table("worker", "status")
    for i in track(range(com.n), description="verifying", console=console, transient=True):
        ok = i in found and code.verify(found[i], com)
        table.add_row(str(i), "ok" if ok else problems.get(i, "does not match the commitment"))
        if not ok:
            problems.setdefault(i, "bad")
    console.print(table)
    if problems:
        raise typer.Exit(1)


@app.command("repair")
def repair_cmd(folder: Folder,
               worker: Annotated[int, typer.Option(help="The worker to rebuild.")]) -> None:
    """Rebuild one worker's fragment from its peers' repair symbols (deletes nothing)."""
    code, com = _code(folder)
    found, _ = load_fragments(folder, com.n)
    helpers = [f for i, f in sorted(found.items()) if i != worker and code.verify(f, com)]
    syms = [code.helper_symbols(f, worker)
            for f in track(helpers[:code.k], description="helper symbols", console=console, transient=True)]
    try:
        frag = code.repair(worker, syms, com)
    except NotEnoughSymbols as e:
        console.print(f"[red]cannot repair worker {worker}: {e}[/red]")
        raise typer.Exit(1) from e
    frag.save(fragment_path(folder, worker))
    payload, wire = sum(s.nbytes for s in syms), sum(s.wire_bytes for s in syms)
    console.print(f"rebuilt worker {worker} from {len(syms)} helpers: read {payload:,} payload bytes "
                  f"({wire:,} with Merkle paths); full retrieval reads {com.data_len:,}")


@app.command("retrieve")
def retrieve_cmd(folder: Folder,
                 out: Annotated[Path, typer.Option(help="Where to write the data.", dir_okay=False)]) -> None:
    """Decode the original file from any k valid fragments."""
    code, com = _code(folder)
    found, _ = load_fragments(folder, com.n)
    try:
        data = code.retrieve(list(found.values()), com)
    except NotEnoughSymbols as e:
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(1) from e
    _io.write_atomic(out, data)
    console.print(f"wrote {len(data):,} bytes to {out}")


@app.command("inspect")
def inspect_cmd(folder: Folder) -> None:
    """Show the commitment and which fragment files are present."""
    _, com = _code(folder)
    found, problems = load_fragments(folder, com.n)
    console.print(f"n={com.n} t={com.t} k={com.n - com.t} data {com.data_len:,} bytes, "
                  f"block {com.block_size:,} bytes, hash {com.hash}, codec {com.codec}, "
                  f"root {com.root.hex()[:16]}…")
    console.print(f"fragments present: {sorted(found)}; problems: {problems or 'none'}")


@app.command("demo")
def demo_cmd(
    workdir: Annotated[Path, typer.Option(help="Scratch folder (wiped first).")]
    = Path("runs/ddp_resilience"),
    nproc: Annotated[int, typer.Option(help="Workers (torchrun --nproc_per_node); t = 1 needs >= 4.")] = 4,
    steps: Annotated[int, typer.Option(help="Training steps.")] = 40,
    every: Annotated[int, typer.Option(help="Checkpoint every this many steps.")] = 5,
    kill_step: Annotated[int, typer.Option(help="Step at which rank 2 is killed (not a checkpoint step).")]
    = 22,
) -> None:
    """DDP under torchrun (gloo, CPU): kill a worker with SIGKILL and wipe its store, let torchrun
    restart the group, repair the lost rank from its peers, finish training, and check the loss
    curve against an uninterrupted run bitwise; then restore once more while rank 1 serves
    corrupted symbols. About 1.5 min on 2 cores."""
    from ..experiments.ddp_resilience import run_demo

    console = Console()
    with console.status("running torchrun three times (reference, killed worker, lying rank)"):
        r = run_demo(workdir, nproc=nproc, steps=steps, every=every, kill_rank=2, kill_step=kill_step)
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
    t.add_row("loss curve equals uninterrupted run", "bitwise: yes" if r["bitwise_equal"] else "NO")
    cs = r["corrupt_scenario"]
    named = sorted(int(k) for k, v in cs["bad_helpers_seen"].items() if v == [1])
    t.add_row("lying rank 1 named and excluded by ranks", str(named))
    console.print(t)
    if not r["bitwise_equal"]:
        raise typer.Exit(1)
