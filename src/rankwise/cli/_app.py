"""The ``rankwise`` command line: a thin typer app over the library.

Commands import what they need when they run, so ``rankwise --help`` and argument errors
answer without importing torch. :func:`main` turns every error into one line on stderr and a
non-zero exit; ``--debug`` (or ``RANKWISE_DEBUG=1``) shows the traceback instead.
"""

from __future__ import annotations

import contextlib
import enum
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from .. import __version__
from .._fields import help_of, options_named
from .._io import write_atomic
from ..train_config import METHODS as TRAIN_METHODS
from ..train_config import TrainConfig as TC
from ._common import (
    _HELD,
    MAX_WORKERS,
    Command,
    Force,
    UserError,
    check_new_file,
    check_output_dir,
    claim_output_dir,
    config_option,
    full_disk_cleaned,
    lock_output,
    new_app,
    num_threads,
    print_whole,
    release_outputs,
)

app = new_app(
    "rankwise: low-rank training that adapts its rank (DLRT / SDLRT), reversible low-rank ODE "
    "blocks, and 2-D coded checkpoints that survive a lost worker.\n\n"
    "train / demo: train a model on the bundled digits, dense or low-rank.  "
    "sweep: the compression study.  ode: the reversible ODE experiment.  "
    "peft: rank-adaptive adapters against LoRA on a pretrained transformer.  "
    "lm: a small GPT trained from scratch, dense against low-rank.  "
    "ckpt: encode, verify, repair and retrieve coded checkpoints; a torchrun demo.\n\n"
    "Errors are one line; add --debug (or set RANKWISE_DEBUG=1) for a traceback.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"rankwise {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show the full traceback when a command fails.")]
    = False,
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.",
                                          callback=_version, is_eager=True)] = False,
) -> None:
    """rankwise"""
    del debug, version  # read by main() before the command runs


Method = enum.Enum("Method", {m: m for m in TRAIN_METHODS}, type=str)  # rankwise train's, by name


class ModelName(str, enum.Enum):
    lenet = "lenet"
    mlp = "mlp"
    vgg = "vgg"


_THREADS_HELP = ("CPU threads for torch. The models are tiny, so one thread is about as fast as "
                 "several and is not slowed down by other busy processes.")
# what `train` writes into --out (claim_output_dir refuses to mix two runs), as regexes
RUN_OUTPUTS = (r"metrics\.csv", r"final\.json", r"events\.out\.tfevents\.\d+\..+", r"torchrun\.log",
               r"\.rankwise-run\.json", r"model\.pt")


@app.command("train", cls=Command)
def train_cmd(
    method: Annotated[Method, config_option(TC, "method")] = Method(TC.method),
    model: Annotated[ModelName, config_option(TC, "model")] = ModelName(TC.model),
    tau: Annotated[float | None, config_option(TC, "tau")] = None,  # (None: TC.tau, or not given)
    target: Annotated[float | None, config_option(TC, "target")] = TC.target,
    tau_min: Annotated[float, config_option(TC, "tau_min")] = TC.tau_min,
    rank: Annotated[int | None, config_option(TC, "rank")] = TC.rank,
    epochs: Annotated[int, config_option(TC, "epochs")] = TC.epochs,
    lr: Annotated[float, config_option(TC, "lr")] = TC.lr,
    momentum: Annotated[float, config_option(TC, "momentum")] = TC.momentum,
    batch_size: Annotated[int, config_option(TC, "batch_size")] = TC.batch_size,
    seed: Annotated[int, config_option(TC, "seed", min=0, max=2**32 - 1)] = TC.seed,
    update_every: Annotated[int, config_option(TC, "update_every", min=1)] = TC.update_every,
    out: Annotated[Path | None, config_option(TC, "out")] = TC.out,
    force: Force = False,
    threads: Annotated[int, typer.Option(help=_THREADS_HELP, min=1, max=MAX_WORKERS)] = 1,
    nproc: Annotated[int, typer.Option(help="Data-parallel processes (torchrun, gloo, one thread each): "
                                       "each trains on its shard of every batch.", min=1,
                                       max=MAX_WORKERS)] = 1,
    checkpoint_every: Annotated[int | None, typer.Option(
        "--checkpoint-every", min=1, help=help_of(TC, "checkpoint_every"))] = TC.checkpoint_every,
    checkpoint_dir: Annotated[Path | None, typer.Option(
        "--checkpoint-dir", help=help_of(TC, "checkpoint_dir"))] = TC.checkpoint_dir,
    max_restarts: Annotated[int, typer.Option(help="With --nproc: torchrun restarts the group after a "
                                              "failure this many times.", min=0)] = 0,
    device: Annotated[str, typer.Option(help="Where one process trains: cpu, cuda or cuda:N (--nproc runs "
                                        "on CPU processes).")] = "cpu",
) -> None:
    """Train one model on the bundled 8×8 digits and print a summary; with --out, the records
    and the trained model's state_dict (model.pt) are written there."""
    if target is not None and tau is not None:
        raise UserError(f"give --target or --tau, not both (got --target {target:g}, --tau {tau:g})")
    if method.value == "dense" and tau is not None:  # (the other rules are TrainConfig's: _config)
        raise UserError("--tau needs a low-rank method (dlrt or sdlrt); dense trains full matrices")
    if checkpoint_dir is not None and str(checkpoint_dir) in ("", "."):  # typer reads "" as "."
        raise UserError("--checkpoint-dir is empty or the current folder: give the checkpoint fragments a "
                        "folder of their own (rank<i>/ folders are made in it)")
    config = _config(TC, method=method.value, model=model.value, tau=TC.tau if tau is None else tau,
                     target=target, tau_min=tau_min, rank=rank, epochs=epochs, lr=lr, momentum=momentum,
                     batch_size=batch_size, seed=seed, out=out, update_every=update_every,
                     checkpoint_every=checkpoint_every,
                     checkpoint_dir=checkpoint_dir)
    if nproc > 1 and model.value == "vgg":
        raise UserError("--model vgg has batch norm, which data-parallel training (--nproc) does not support "
                        "yet (each rank's running statistics would drift apart); use lenet or mlp")
    if max_restarts and nproc == 1:
        raise UserError(f"--max-restarts restarts torchrun's worker group: it needs --nproc > 1 (got "
                        f"--max-restarts {max_restarts} with one process)")
    if checkpoint_every is not None and 1 < nproc < 4:
        raise UserError(f"--checkpoint-every needs --nproc >= 4 when data-parallel (coded checkpoints "
                        f"tolerate t = 1 lost process with n > 3t); got --nproc {nproc} (one process, "
                        "--nproc 1, writes plain checkpoints)")
    _check_device(device, nproc)
    if out is not None:  # one run at a time in --out: taken before anything in it is read
        lock_output(out)
    resumes = False
    if config.checkpoint_dir is not None:
        from ._train_dp import check_checkpoint_dir, resumes_out

        check_checkpoint_dir(config, nproc)
        resumes = resumes_out(config)  # --out holds this checkpointed run's own records (its mark)
    if out is not None:
        means = ("" if config.checkpoint_dir is None else "; with --checkpoint-dir the training itself "
                 "resumes from the newest checkpoint there, --force replaces only the records in --out")
        claim_output_dir(out, produced=RUN_OUTPUTS, force=force or resumes, what="training run",
                         force_means=means)
    if out is None:
        _train(config, nproc, threads, max_restarts, device)
        return
    with full_disk_cleaned(out, RUN_OUTPUTS):
        _train(config, nproc, threads, max_restarts, device)


def _check_device(device: str, nproc: int) -> None:
    """--device names a device this machine has (checked before any work)."""
    import re

    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise UserError(f"--device must be cpu, cuda or cuda:N; got {device!r}")
    if device == "cpu":
        return
    if nproc > 1:
        raise UserError(f"--device {device} trains one process; --nproc {nproc} runs data-parallel CPU "
                        "processes (gloo): leave one of them out")
    import torch

    if not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA device is available here (torch.cuda.is_available() "
                        "is False); use --device cpu")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise UserError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                        f"(cuda:0 … cuda:{torch.cuda.device_count() - 1})")


def _above_dense(console, summary: dict) -> None:
    """One line when a low-rank run ends storing more than the dense model would."""
    comp, cfg = summary["compression"], summary["config"]
    if cfg["method"] != "dense" and comp["ratio"] < 0:
        level = f"τ = {cfg['tau']:g}" if cfg.get("target") is None else f"target {cfg['target']:g}"
        console.print(f"[yellow]warning: {cfg['method'].upper()} ended storing "
                      f"{comp['stored_params'] / comp['dense_params']:.2f}× the dense model's parameters at "
                      f"{level} (its ranks stayed high): a larger --tau or a --target below 1 compresses"
                      "[/yellow]")


def _train(config, nproc: int, threads: int, max_restarts: int, device: str = "cpu") -> None:
    """The training run of ``train`` (its arguments checked and --out claimed)."""
    from rich.console import Console

    from ..experiments.train_run import train
    from ._train_view import progress, summary_table

    console = Console()
    if nproc > 1:
        import tempfile

        from ._train_dp import claim_checkpoint_dir, mark_out, run

        if config.checkpoint_dir is not None:
            mark_out(config, claim_checkpoint_dir(config, nproc))
        with tempfile.TemporaryDirectory() as tmp, console.status(f"training on {nproc} processes"):
            try:
                summary = run(config, nproc, Path(tmp), max_restarts=max_restarts)
            except RuntimeError as e:
                raise UserError(str(e), 1) from None
        print_whole(console, summary_table(summary))
        _above_dense(console, summary)
        return
    if config.checkpoint_dir is not None:  # (its manifest: a rerun with other settings is refused)
        from ._train_dp import claim_checkpoint_dir, mark_out

        mark_out(config, claim_checkpoint_dir(config, nproc))
    with num_threads(threads), progress(console) as bar:
        try:
            summary = train(config, callback=bar(config.method), device=device, save_model=True)
        except FloatingPointError as e:  # the low-rank step refuses a non-finite loss or gradient
            kept = f"; the records up to there are in {config.out}" if config.out is not None else ""
            raise UserError(f"training diverged at --lr {config.lr:g} ({str(e).split(';')[0]}): try a "
                            f"lower --lr{kept}", 1) from None
    print_whole(console, summary_table(summary))
    _above_dense(console, summary)


@app.command("demo", cls=Command)
def demo_cmd(
    out: Annotated[Path, typer.Option(help="Folder for the three runs' records (dense/, dlrt/, sdlrt/).")]
    = Path("runs/demo"),
    epochs: Annotated[int, typer.Option(help="Epochs per method.")] = 20,
    target: Annotated[float | None, typer.Option(
        help="Compression both low-rank methods reach (a global parameter budget); default 0.9.")] = None,
    tau: Annotated[float | None, typer.Option(
        help="Instead of --target: the truncation tolerance τ of DLRT and SDLRT.")] = None,
    rank: Annotated[int, typer.Option(help="Initial rank of every low-rank layer.")] = 32,
    seed: Annotated[int, typer.Option(help="Seed shared by the three runs.", min=0, max=2**32 - 1)] = 0,
    force: Force = False,
    threads: Annotated[int, typer.Option(help=_THREADS_HELP, min=1, max=MAX_WORKERS)] = 1,
    markdown: Annotated[Path | None, typer.Option(
        help="Also write the table as Markdown to this file (used by `make docs-figures`).")] = None,
) -> None:
    """Dense SGD vs DLRT vs SDLRT: LeNet-5 on the digits at 90 % compression, one comparison table.

    Both low-rank methods start from the same compressed initialisation (every layer at
    `rank`, as in the SDLRT paper) and reach the same compression --target (or truncate at the
    same --tau)."""
    if tau is not None and target is not None:
        raise UserError(f"give --target or --tau, not both (got --target {target:g}, --tau {tau:g})")
    level = {"tau": tau} if tau is not None else {"target": 0.9 if target is None else target}
    configs = [_config(TC, method=m, model="lenet", rank=None if m == "dense" else rank,
                       epochs=epochs, seed=seed, out=out / m, **({} if m == "dense" else level))
               for m in ("dense", "dlrt", "sdlrt")]
    if markdown is not None:  # replaced only if it is a table this command wrote (--force is for runs)
        if markdown.is_file() and not _is_demo_table(markdown):
            raise UserError(f"--markdown {markdown} exists and is not a table `rankwise demo` wrote; choose "
                            "another path", 1)
        check_new_file(markdown, force=True, option="--markdown")
    lock_output(out)  # one command at a time in --out (released when it ends)
    old = [check_output_dir(c.out, produced=RUN_OUTPUTS, force=force, what="demo run") for c in configs]
    for c, checked in zip(configs, old, strict=True):  # all checked before any is touched
        claim_output_dir(c.out, produced=RUN_OUTPUTS, force=force, checked=checked)
    from rich.console import Console

    from ..experiments.train_run import train
    from ._train_view import comparison_markdown, comparison_table, progress

    console = Console()
    summaries = []
    with num_threads(threads), progress(console) as bar, \
            full_disk_cleaned(out, RUN_OUTPUTS, also=[c.out for c in configs]):  # (every run's records)
        for config in configs:
            summaries.append(train(config, callback=bar(config.method), save_model=True))
    console.print(comparison_table(summaries, epochs=epochs, rank=rank, **level))
    console.print(f"Run records (metrics.csv, final.json, TensorBoard, model.pt): {out}/{{dense,dlrt,sdlrt}}")
    for s in summaries:
        _above_dense(console, s)
    if markdown is not None:
        write_atomic(markdown, comparison_markdown(summaries).encode())


def _is_demo_table(path: Path) -> bool:
    from ._train_view import TABLE_HEADER

    with open(path, encoding="utf-8", errors="replace") as f:
        return f.readline().rstrip("\n") == TABLE_HEADER


def _register() -> None:
    from ._ckpt import app as ckpt_app
    from ._lm import lm_cmd
    from ._ode import ode_cmd
    from ._peft import peft_cmd
    from ._sweep import sweep_cmd

    app.command("sweep", cls=Command)(sweep_cmd)
    app.command("ode", cls=Command)(ode_cmd)
    app.command("peft", cls=Command)(peft_cmd)
    app.command("lm", cls=Command)(lm_cmd)
    app.add_typer(ckpt_app, name="ckpt")


_register()


# --------------------------------------------------------------------------- entry point
_USER_ERRORS = (UserError, ValueError, FileNotFoundError, FileExistsError, NotADirectoryError,
                IsADirectoryError, PermissionError)


def _debug(args: list[str]) -> bool:
    return os.environ.get("RANKWISE_DEBUG", "") not in ("", "0") or "--debug" in args


def _command_path(args: list[str]) -> str:
    """``rankwise ckpt repair`` from the arguments (the words before the first option)."""
    words = ["rankwise"]
    for a in args:
        if a.startswith("-") or len(words) == 3:
            break
        words.append(a)
        if a != "ckpt":
            break
    return " ".join(words)


def main(argv: list[str] | None = None) -> int:
    """Run the command line on `argv` (default ``sys.argv[1:]``) and return the exit status.

    A user's mistake (a bad option value, a missing or existing file, a refused overwrite)
    prints ``rankwise <command>: error: <what, with the value, and what to do>`` on stderr and
    returns 2 (bad arguments) or 1; any other failure prints one line naming the exception
    and how to see its traceback, and returns 1. With ``--debug`` or ``RANKWISE_DEBUG=1``
    the exception propagates with its traceback."""
    from .._extras import quiet_optional_logs

    quiet_optional_logs()
    args = sys.argv[1:] if argv is None else [str(a) for a in argv]
    rc = 1
    try:
        with _sigterm_ends_cleanly(), _full_disk_in_threads_said_once():
            rc = _main(args)
        return rc
    finally:  # (rc stays 1 when --debug lets an exception through)
        release_outputs(failed=rc != 0)


_TERMINATED: list[bool] = []  # set when SIGTERM arrived during this command


@contextlib.contextmanager
def _sigterm_ends_cleanly():
    """SIGTERM (``kill``, a scheduler's stop) ends the command as Ctrl-C does: worker pools are
    ended, locks released, and one line says so (``main`` returns 143), instead of dying without
    a word and leaving the pool's semaphores behind. Only in the main thread (elsewhere Python
    has no signal handlers); the previous handler is restored afterwards."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum, frame):  # type: ignore[no-untyped-def]
        if _TERMINATED:  # a second one while the first is being handled: let that finish
            return
        _TERMINATED.append(True)
        raise KeyboardInterrupt

    _TERMINATED.clear()
    before = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


@contextlib.contextmanager
def _full_disk_in_threads_said_once():
    """A full disk met by a helper thread (TensorBoard's writer) printed its traceback ("Exception
    in thread …") before the command's own one line: such a thread's ``ENOSPC``/``EDQUOT`` is
    left to the command, which meets it again when it next writes or closes the records."""
    import threading

    from ._common import FULL_DISK

    before = threading.excepthook

    def hook(args):  # type: ignore[no-untyped-def]
        if isinstance(args.exc_value, OSError) and args.exc_value.errno in FULL_DISK:
            return
        before(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = before


def _interrupted(args: list[str]) -> int:
    """The one line of an interrupted command (Ctrl-C: 130; SIGTERM: 143)."""
    if not _TERMINATED:
        _error("rankwise: interrupted")
        return 130
    kept = "".join(f"; what it finished so far is in {folder}" for folder, _, _ in _HELD[:1])
    _error(f"{_command_path(args)}: interrupted by SIGTERM{kept} (rerun the same command to resume or "
           "redo it)")
    return 143


def _main(args: list[str]) -> int:
    command = typer.main.get_command(app)
    try:
        rc = command.main(args=args, prog_name="rankwise", standalone_mode=False)
        if rc == 130:  # typer turns Ctrl-C (KeyboardInterrupt) into a silent exit status 130
            return _interrupted(args)
        return rc if isinstance(rc, int) else 0
    except typer.TyperException as e:  # click's usage errors (typer vendors click)
        if type(e).__name__ == "NoArgsIsHelpError":  # the help was printed already
            return e.exit_code
        ctx = getattr(e, "ctx", None)
        where = ctx.command_path if ctx is not None else _command_path(args)
        message = e.format_message().replace("Value error, ", "")
        given = _given(args, getattr(e, "param", None))
        if given is not None and repr(given) not in message and f" {given}" not in message:
            message = message.rstrip(".") + f"; got {given}"
        _error(f"{where}: error: {message} (see '{where} --help')")
        return e.exit_code
    except typer.Abort:
        _error("rankwise: aborted")
        return 130
    except KeyboardInterrupt:
        if _debug(args):
            raise
        return _interrupted(args)
    except _USER_ERRORS as e:
        if _debug(args):
            raise
        code = e.exit_code if isinstance(e, UserError) else (2 if isinstance(e, ValueError) else 1)
        _error(f"{_command_path(args)}: error: {_one_line(e)}")
        return code
    except Exception as e:
        if _debug(args):
            raise
        _error(f"{_command_path(args)}: internal error: {type(e).__name__}: {_one_line(e)} "
               "(rerun as `rankwise --debug …` or with RANKWISE_DEBUG=1 for the traceback, and please "
               "report it)")
        return 1


def _given(args: list[str], param: Any) -> str | None:
    """The value the user gave for option `param` (the last occurrence), if any."""
    opts = getattr(param, "opts", None) or []
    value = None
    for i, a in enumerate(args):
        for o in opts:
            if a == o and i + 1 < len(args):
                value = args[i + 1]
            elif a.startswith(o + "="):
                value = a[len(o) + 1:]
    return value


def _one_line(e: BaseException) -> str:
    text = str(e)
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        text = f"{e.filename}: {e.strerror}"
    return " ".join(text.split()) or type(e).__name__


def _error(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _config(cls: type, **kwargs: Any):
    """``cls(**kwargs)``; its validation errors name fields (`` `tau` ``): say options (--tau)."""
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise UserError(options_named(str(e), cls)) from e
