"""What every ``rankwise`` command shares: the one-line user error, output-folder ownership
(refuse, or ``--force``), progress bars, and typer classes that render ``--help`` cleanly.

Nothing here imports torch: ``rankwise --help`` and argument errors must answer at once.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

from .._io import read_json

# --threads / --jobs beyond this are almost surely a typo: oversubscribing the cores only slows
# a run down (2000 threads made a 3 s training run take 51 s)
MAX_WORKERS = max(4, 4 * (os.cpu_count() or 1))


class UserError(Exception):
    """A mistake of the user's (a bad value, a missing file, an output that exists): the
    command line prints ``rankwise <command>: error: <message>`` as one line and exits with
    `exit_code` (2 for bad arguments, as click's usage errors; 1 for a refused action)."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# --------------------------------------------------------------------------- --help rendering
class _FlagMetavar:
    """typer ≥ 0.2x shows every flag, ``--help`` included, with a ``<bool>`` type although a
    flag takes no value; an empty metavar shows nothing instead."""

    def get_help_option(self, ctx):  # type: ignore[no-untyped-def]
        opt = super().get_help_option(ctx)  # type: ignore[misc]
        if opt is not None:
            opt.metavar = ""
        return opt

    def get_params(self, ctx):  # type: ignore[no-untyped-def]
        params = super().get_params(ctx)  # type: ignore[misc]
        for p in params:
            if getattr(p, "is_flag", False) and getattr(p, "metavar", None) is None:
                p.metavar = ""
        return params


class Command(_FlagMetavar, TyperCommand):
    """A typer command whose flags show no ``<bool>`` type in ``--help``."""


class Group(_FlagMetavar, TyperGroup):
    """A typer group whose flags show no ``<bool>`` type in ``--help``; commands are listed in
    the order they were added."""

    def list_commands(self, ctx):  # type: ignore[no-untyped-def]
        return list(self.commands)


def new_app(help: str) -> typer.Typer:
    """A typer app with rankwise's conventions (no completion, help on no arguments)."""
    return typer.Typer(cls=Group, add_completion=False, no_args_is_help=True, help=help,
                       pretty_exceptions_enable=False, rich_markup_mode="markdown")


def config_option(cls: type, name: str, **kw: Any) -> Any:
    """The typer option of config `cls`'s field `name`: its flag and help as the config declares
    them (:func:`rankwise._fields.setting`); `kw` adds typer's own (``min=``, …). The default is
    the config's too: ``= TrainConfig.epochs``."""
    from .._fields import flag_of, help_of

    return typer.Option(flag_of(cls, name), help=help_of(cls, name), **kw)


Force = Annotated[bool, typer.Option("--force", help="Replace what an earlier run left in the output "
                                     "(only the files this command writes).")]
Jobs = Annotated[int, typer.Option(help="Runs in parallel processes (one thread each).", min=1,
                                    max=MAX_WORKERS)]


# --------------------------------------------------------------------------- outputs
def _nearest_existing(path: Path) -> Path:
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path(".")


def unwritable_folder(folder: Path) -> str | None:
    """Why new files cannot be made in `folder` (or, if it does not exist yet, its nearest
    existing parent), or None when they can: a file is created there and removed."""
    import tempfile

    target = _nearest_existing(folder)
    if not target.is_dir():
        return f"{target} is not a folder"
    try:
        with tempfile.TemporaryFile(dir=target):
            pass
    except OSError as e:
        return f"{target} is not writable ({e.strerror})"
    return None


def _check_writable(folder: Path, option: str) -> None:
    """`folder` (or, if it does not exist yet, its nearest existing parent) accepts new files."""
    import tempfile

    target = _nearest_existing(folder)
    if not target.is_dir():
        raise UserError(f"{option} {folder}: {target} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=target):
            pass
    except OSError as e:
        raise UserError(f"{option} {folder}: cannot write in {target} ({e.strerror}); choose another "
                        f"{option}", 1) from e


def check_new_file(path: Path, *, force: bool, option: str = "--out") -> None:
    """`path` may be written: its folder exists and is writable, it is not a folder or a device,
    and it does not exist unless `force`. Raises :class:`UserError` naming `option`."""
    if str(path) in ("", "."):
        raise UserError(f"{option} is '.' or empty; give the path of a file to write")
    if path.is_dir():
        raise UserError(f"{option} {path} is a folder; give the path of a file to write")
    if path.exists() and not path.is_file():
        raise UserError(f"{option} {path} exists and is not a regular file (a device, a pipe?); "
                        "give the path of a file to write")
    if not path.parent.is_dir():
        what = "is not a folder" if path.parent.exists() else "does not exist; create it first"
        raise UserError(f"{option} {path}: {path.parent} {what}")
    if path.exists() and not force:
        raise UserError(f"{option} {path} exists; pass --force to overwrite it, or choose another path", 1)
    _check_writable(path.parent, option)


def earlier_outputs(folder: Path, produced: Sequence[str]) -> list[Path]:
    """The entries of `folder` whose names fully match one of the regular expressions
    `produced` (what a run of the command writes there, and so would replace)."""
    if not folder.is_dir():
        return []
    patterns = [re.compile(p) for p in produced]
    return sorted(p for p in folder.iterdir() if any(rx.fullmatch(p.name) for rx in patterns))


RECORD_FIELDS = {"context": "rankwise lm", "task": "rankwise sweep", "setting": "rankwise peft",
                 "controller": "rankwise ode"}  # a field only that command's run records have


def _records(folder: Path) -> list[tuple[Path, dict]]:
    """The run records in ``folder/runs/``: ``*.json`` objects with a ``"spec"`` object."""
    out = []
    for p in sorted((folder / "runs").glob("*.json")) if (folder / "runs").is_dir() else []:
        try:
            record = read_json(p)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("spec"), dict):
            out.append((p, record["spec"]))
    return out


def resumes_records(folder: Path, field: str, option: str = "--out") -> bool:
    """Does ``folder/runs/`` hold this command's run records (their ``spec`` has `field`, see
    :data:`RECORD_FIELDS`), so that the folder is resumed? One holding another command's records
    is refused (exit 1): a run would mix its own with them, and ``--force`` never deletes them."""
    ours = False
    for p, spec in _records(folder):
        if field not in spec:
            who = next((cmd for f, cmd in RECORD_FIELDS.items() if f in spec), "another command")
            raise UserError(f"{option} {folder} holds run records of {who} (runs/{p.name}); this command "
                            f"would mix its own with them: choose another {option}", 1)
        ours = True
    return ours


def _named_folder(folder: Path, option: str) -> None:
    """`folder` names a folder of its own (not '' or '.', not a file), else a UserError."""
    if str(folder) in ("", "."):
        raise UserError(f"{option} is '.' or empty; give a named folder, e.g. ./out")
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{option} {folder} is a file; give a folder")


def check_output_dir(folder: Path, *, produced: Sequence[str], force: bool, option: str = "--out",
                     what: str = "run", ours: Callable[[Path], bool] | None = None,
                     force_means: str = "", records: str | None = None) -> list[Path]:
    """Can `folder` take the outputs whose names match the regular expressions `produced`? It
    is (or can become) a writable folder, and holds no earlier such outputs unless `force`;
    an entry with such a name that `ours` says this command did not write is refused even with
    `force`; `force_means` is appended to the refusal (what ``--force`` does for this command).
    A resumable command names the field its run records have (`records`, see
    :data:`RECORD_FIELDS`): a folder with such records is resumed (as if `force`), one with
    another command's records is refused.
    Returns the earlier outputs (what :func:`claim_output_dir` deletes); changes
    nothing."""
    _named_folder(folder, option)
    if records is not None:
        force = resumes_records(folder, records, option) or force
    old = earlier_outputs(folder, produced)
    foreign = [p for p in old if ours is not None and not ours(p)]
    if foreign:
        raise UserError(f"{option} {folder} holds {foreign[0].name}, which this command did not write; "
                        f"choose another {option}", 1)
    if old and not force:
        names = ", ".join(p.name for p in old[:4]) + (" …" if len(old) > 4 else "")
        raise UserError(f"{option} {folder} already holds files a {what} writes ({names}), from an earlier "
                        f"run or not; pass --force to replace them, or choose another {option}"
                        + force_means, 1)
    _check_writable(folder, option)
    return old


LOCK_FILE = ".rankwise.lock"


_HELD: list[tuple[Path, Any, bool]] = []  # (folder, its open lock file, created by this command)


class _FolderLock:
    """An open folder whose descriptor holds the ``flock`` (closing it releases the lock)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def lock_output(folder: Path, option: str = "--out", *, lock_file: bool = True) -> None:
    """Hold an exclusive lock on `folder` (``.rankwise.lock`` in it, ``flock``) until the command
    ends (:func:`release_outputs`, called by ``main``): a second command writing to the same
    folder at the same time is refused in one line instead of both succeeding with one's records
    replaced. Call it after the arguments are checked and before the folder is examined.
    Without `lock_file` the folder itself is locked (``flock`` on its descriptor) and nothing is
    added to it (a coded checkpoint's folder holds exactly its fragments and commitment)."""
    import fcntl

    _named_folder(folder, option)
    created, existing = not folder.exists(), _nearest_existing(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if lock_file:
            # never through a link planted as the lock file (its target would be created), and
            # only a regular file (a FIFO or a device is refused)
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            fd = os.open(folder / LOCK_FILE, flags, 0o644)
        else:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        if created:  # (the folders it made, empty: a refused run leaves nothing)
            top = next((p for p in (folder, *folder.parents) if p.parent == existing), folder)
            if top.is_dir() and _holds_nothing(top):
                shutil.rmtree(top, ignore_errors=True)
        if e.errno == errno.ELOOP:
            raise UserError(f"{option} {folder}: {LOCK_FILE} in it is a symbolic link; remove it", 1) from e
        raise _unwritable(folder, option, e, existed=not created) from e
    if lock_file and not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"{option} {folder}: {LOCK_FILE} in it is not a regular file; remove it", 1)
    handle: Any = os.fdopen(fd, "a+") if lock_file else _FolderLock(fd)
    _HELD.append((folder, handle, created))
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UserError(f"{option} {folder} is in use by another rankwise command running now; wait for "
                        f"it or choose another {option}", 1) from None


def _holds_nothing(folder: Path) -> bool:
    """Does `folder` hold only the lock file and (nested) empty folders?"""
    return all(p.name == LOCK_FILE if p.is_file() or p.is_symlink() else p.is_dir() and _holds_nothing(p)
               for p in folder.iterdir())


def release_outputs(failed: bool) -> None:
    """Release the locks of :func:`lock_output`; a folder the failed command created is removed
    again when it holds nothing but the lock file and empty folders (a refused first run leaves
    nothing behind)."""
    while _HELD:
        folder, handle, created = _HELD.pop()
        handle.close()
        if failed and created and folder.is_dir() and _holds_nothing(folder):
            shutil.rmtree(folder, ignore_errors=True)


def claim_output_dir(folder: Path, *, produced: Sequence[str], force: bool, option: str = "--out",
                     what: str = "run", checked: list[Path] | None = None,
                     ours: Callable[[Path], bool] | None = None, force_means: str = "",
                     records: str | None = None) -> None:
    """Make `folder` ready for a command that writes the files or folders whose names match the
    regular expressions `produced`: create it if missing; if an earlier run left such outputs there,
    refuse (exit 1) unless `force`, and with `force` delete exactly those (nothing else in the
    folder is touched). Call it after every other argument check and before any work; a
    command with several output folders calls :func:`check_output_dir` on all of them first
    and passes each result as `checked`."""
    old = checked if checked is not None else check_output_dir(
        folder, produced=produced, force=force, option=option, what=what, ours=ours, force_means=force_means,
        records=records)
    for p in old:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(folder, option, e, existed=folder.is_dir()) from e


def _unwritable(folder: Path, option: str, e: OSError, existed: bool) -> UserError:
    """The refusal of a `folder` this command cannot create, or (`existed`) cannot write in."""
    if existed:
        return UserError(f"{option} {folder} is not writable ({e.strerror}); make it writable or choose "
                         f"another {option}", 1)
    return UserError(f"{option} {folder}: cannot create it ({e.strerror}); choose another {option}", 1)


FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


@contextmanager
def full_disk_cleaned(folder: Path, produced: Sequence[str], option: str = "--out",
                      also: Sequence[Path] = ()) -> Iterator[None]:
    """A full disk (``ENOSPC``, or a quota: ``EDQUOT``) while the command writes into `folder`
    ends it in one line (exit 1), after removing what this run wrote there (the entries whose
    names match the regular expressions `produced`, and atomic writes' ``.*.tmp`` files), so
    that the rerun, once there is space, is not refused for an earlier run's files. Enter it
    after :func:`claim_output_dir`, which removed an earlier run's such entries. `also`: more
    folders this run writes such entries into (e.g. one per run), cleaned alike."""
    try:
        yield
    except OSError as e:
        if e.errno not in FULL_DISK:
            raise
        import gc

        gc.collect()  # (open writers of the failed run, e.g. TensorBoard's, close their files)
        temporary = r"\..+\.[0-9a-f]+\.tmp"  # (write_atomic's)
        for p in [p for f in (folder, *also) for p in earlier_outputs(f, (*produced, temporary))]:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        where = e.filename if e.filename is not None else folder
        raise UserError(f"no space left on device writing {where} ({e.strerror or 'disk full'}); what this "
                        f"run wrote in {option} {folder} was removed: free some space or choose another "
                        f"{option}, then rerun", 1) from None


def given(ctx: Any, name: str) -> bool:
    """Did the user give the parameter `name` (on the command line or through its environment
    variable), rather than leaving its default?"""
    source = ctx.get_parameter_source(name)  # (typer's vendored click's ParameterSource: by name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def refuse_unused(ctx: Any, unused: dict[str, str]) -> None:
    """`unused` maps a parameter name to why the chosen mode ignores it; the first one the
    user gave is refused in one line (an option that changes nothing would mislead)."""
    for name, why in unused.items():
        if given(ctx, name):
            flag = "--" + name.replace("_", "-")
            raise UserError(f"{flag} is ignored here: {why} (leave {flag} out)")


def require_dir(path: Path, option: str) -> None:
    """`path` is an existing folder, else a :class:`UserError` naming `option`."""
    if str(path) == "":
        raise UserError(f"{option} is empty; give a folder")
    if not path.exists():
        raise UserError(f"{option} {path} does not exist")
    if not path.is_dir():
        raise UserError(f"{option} {path} is not a folder")


def check_range(option: str, value: float, lo: float | None = None, hi: float | None = None, *,
                lo_open: bool = False, hi_open: bool = True) -> None:
    """``lo ≤ value < hi`` (bounds optional; open or closed as given), else a UserError."""
    bad = ((lo is not None and (value <= lo if lo_open else value < lo))
           or (hi is not None and (value >= hi if hi_open else value > hi))
           or value != value)  # NaN
    if bad:
        left = "" if lo is None else ("(" if lo_open else "[") + f"{lo:g}"
        right = "" if hi is None else f"{hi:g}" + (")" if hi_open else "]")
        if lo is not None and hi is not None:
            rng = f"in {left}, {right}"
        elif lo is not None:
            rng = f"{'>' if lo_open else '>='} {lo:g}"
        else:
            rng = f"{'<' if hi_open else '<='} {hi:g}"
        raise UserError(f"{option} must be {rng}; got {value:g}")


def print_whole(console, table) -> None:
    """Print a results table whole: at its natural width when the console is narrower (80
    columns, or a pipe), so that no cell is cut to "0.7…" (a terminal wraps the long lines
    instead; a pipe or a file gets them as they are)."""
    from rich.measure import Measurement

    need = Measurement.get(console, console.options.update_width(10_000), table).maximum
    width = console.width
    console.width = max(width, need)
    try:
        console.print(table)
    finally:
        console.width = width


# --------------------------------------------------------------------------- running
@contextmanager
def num_threads(n: int) -> Iterator[None]:
    """Run with ``torch.set_num_threads(n)``, restoring the previous count afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def progress_columns() -> tuple[Any, ...]:
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

    return (TextColumn("{task.description}"), BarColumn(bar_width=16),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn())


def no_repeats(items: list, text: str, option: str, keys: list | None = None) -> None:
    """A comma list that names one value twice (equal `keys`, default the items themselves)
    would run or report the same thing twice: a UserError naming the repeated items."""
    keys = items if keys is None else keys
    twice = [str(x) for i, x in enumerate(items) if keys[i] in keys[:i]]
    if twice:
        raise UserError(f"{option} names {', '.join(twice)} twice ({text}); give each once")


@contextmanager
def run_bars(console: Any, describe: Callable[[dict], str],
             form: Callable[[int, int, str], str] = lambda step, total, info: info,
             ) -> Iterator[tuple[Callable, Callable]]:
    """Progress bars for a study's runs: yields ``(on_progress(key, step, total, info),
    on_done(record))``; a run's bar appears with its first report and gives way, when the run
    is done, to the line ``describe(record)``. `form(step, total, info)`: the text beside a bar.
    Where the console is not a terminal (output to a file or a pipe: rich draws no bars there),
    a run prints a line each tenth of its steps instead, so that a log shows runs advancing."""
    from rich.progress import Progress

    with Progress(*progress_columns(), console=console) as prog:
        bars: dict[str, Any] = {}
        tenths: dict[str, int] = {}

        def on_progress(key: str, step: int, total: int, info: str) -> None:
            if not console.is_terminal:
                tenth = 10 * step // total if total > 0 else 0
                if tenth > tenths.get(key, 0) and step < total:
                    prog.console.print(f"{key}: step {step}/{total} {info}".rstrip())
                tenths[key] = max(tenth, tenths.get(key, 0))
                return
            if key not in bars:
                bars[key] = prog.add_task(key, total=total, info="")
            prog.update(bars[key], completed=step, total=total, info=form(step, total, info))

        def on_done(record: dict) -> None:
            tenths.pop(record["key"], None)
            if record["key"] in bars:
                prog.remove_task(bars.pop(record["key"]))
            prog.console.print(describe(record))

        yield on_progress, on_done
