"""A dispersal in one folder: ``commitment.rwck`` plus ``worker{i}.rwck`` per worker.

(On a real cluster each worker keeps only its own file; one folder is the single-machine view
used by the command line and the tests.)"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from ._code2d import Commitment, Dispersal, Fragment

COMMITMENT_FILE = "commitment.rwck"


def fragment_path(folder: str | Path, index: int) -> Path:
    return Path(folder) / f"worker{index}.rwck"


def save_dispersal(folder: str | Path, dispersal: Dispersal, *,
                   progress: Callable[[Iterable[Fragment]], Iterable[Fragment]] = iter) -> None:
    """Write every fragment, then the commitment (each atomically): a folder with a
    commitment is complete. ``progress`` wraps the fragment loop (e.g. ``rich.progress.track``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for f in progress(dispersal.fragments):
        f.save(fragment_path(folder, f.index))
    dispersal.commitment.save(folder / COMMITMENT_FILE)


def load_commitment(folder: str | Path) -> Commitment:
    path = Path(folder) / COMMITMENT_FILE
    if not path.exists():
        raise FileNotFoundError(f"no {COMMITMENT_FILE} in {folder}")
    return Commitment.load(path)


def load_fragments(folder: str | Path, n: int) -> tuple[dict[int, Fragment], dict[int, str]]:
    """Readable fragments by worker index, and a reason for each worker that has none."""
    found: dict[int, Fragment] = {}
    problems: dict[int, str] = {}
    for i in range(n):
        path = fragment_path(folder, i)
        if not path.exists():
            problems[i] = "missing"
            continue
        try:
            f = Fragment.load(path)
        except ValueError as e:
            problems[i] = str(e)
            continue
        except OSError as e:  # unreadable (a folder, no permission): this worker is missing
            problems[i] = f"cannot read {path.name}: {e.strerror or e}"
            continue
        if f.index != i:
            problems[i] = f"file holds worker {f.index}'s fragment"
            continue
        found[i] = f
    return found, problems
