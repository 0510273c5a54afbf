"""Resumable studies: one record per run in a folder, reused when its settings are unchanged.

A study is a list of run specs (frozen dataclasses, each with a unique ``key``). Run ``i``
stores its record, a JSON object holding at least ``"spec"`` (the settings as a dict), in
``folder/<key>.json``, written atomically by the worker that ran it, so an interrupted study
keeps every finished run and a later call runs only the rest.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Sequence
from dataclasses import MISSING, asdict, fields
from pathlib import Path
from typing import Any, TypeVar

from .._io import read_json, write_atomic
from ._pool import Report, map_runs

S = TypeVar("S")
Differences = dict[str, tuple[Any, Any]]
"""{setting: (stored value, value now)}; ``{"record": ("unreadable", why)}`` for a bad record."""
Compare = Callable[[S, dict[str, Any]], Differences]
Job = Callable[[S, Report | None], dict]
_KEY: Callable[[Any], str] = operator.attrgetter("key")


def field_differences(spec: Any, stored: dict[str, Any]) -> Differences:
    """{field: (stored value, this value)} for the dataclass fields of `spec` whose value in
    the stored settings `stored` (a record's ``"spec"``) differs, compared as JSON values (a
    tuple equals the list it is stored as). A field the record lacks counts as its default;
    stored entries that are no longer fields are ignored."""
    mine = json.loads(json.dumps(asdict(spec)))
    out: Differences = {}
    for f in fields(spec):
        if f.name in stored:
            theirs = stored[f.name]
        elif f.default is not MISSING:
            theirs = json.loads(json.dumps(f.default))
        elif f.default_factory is not MISSING:
            theirs = json.loads(json.dumps(f.default_factory()))
        else:
            theirs = "<missing>"
        if theirs != mine[f.name]:
            out[f.name] = (theirs, mine[f.name])
    return out


def _check_keys(specs: Sequence[S], key: Callable[[S], str]) -> list[str]:
    keys: list[str] = []
    seen: set[str] = set()
    for s in specs:
        k = key(s)
        if not isinstance(k, str) or not k or "/" in k or "\\" in k or k.startswith("."):
            raise ValueError(f"a run key must be a file name (non-empty, no '/', not starting with '.'); "
                             f"got {k!r} for {s!r}")
        if k in seen:
            raise ValueError(f"`specs` holds two runs with key {k!r}: both would be stored as {k}.json "
                             "and train the same run twice; drop the duplicate")
        seen.add(k)
        keys.append(k)
    return keys


def _scan(specs: Sequence[S], keys: list[str], folder: Path,
          differences: Compare[S]) -> tuple[dict[str, dict], dict[str, Differences]]:
    """(reusable records, conflicts), both by key, for the specs stored in `folder`."""
    stored: dict[str, dict] = {}
    conflicts: dict[str, Differences] = {}
    for s, k in zip(specs, keys, strict=True):
        p = folder / f"{k}.json"
        if not p.exists():
            continue
        try:
            record = read_json(p)
            spec = record.get("spec") if isinstance(record, dict) else None
            if not isinstance(spec, dict):
                raise ValueError("no run settings (\"spec\") in it")
            diff = differences(s, spec)
        except (OSError, ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
            diff = {"record": ("unreadable", f"{type(e).__name__}: {e}")}
        if diff:
            conflicts[k] = diff
        else:
            stored[k] = record
    return stored, conflicts


def stored_conflicts(specs: Sequence[S], folder: Path, *, key: Callable[[S], str] = _KEY,
                     differences: Compare[S] = field_differences) -> dict[str, Differences]:
    """{key: differences} for the records in `folder` whose key one of `specs` has but whose
    settings differ (``differences(spec, stored_spec) != {}``), or that cannot be read (not
    JSON, not an object with a ``"spec"`` object): ``{"record": ("unreadable", why)}``.
    Reads only; raises ``ValueError`` on duplicate or malformed keys."""
    return _scan(specs, _check_keys(specs, key), folder, differences)[1]


def _describe(folder: Path, conflicts: dict[str, Differences], hint: str) -> str:
    k, diff = next(iter(conflicts.items()))
    if "record" in diff:
        what = f"an unreadable record: {diff['record'][1]}"
    else:
        changes = ", ".join(f"{f} {a!r} there, {b!r} now" for f, (a, b) in diff.items())
        what = f"other settings ({changes})"
    more = f" (and {len(conflicts) - 1} more)" if len(conflicts) > 1 else ""
    return f"{folder} holds run {k}{more} with {what}; {hint}"


def _run_and_store(item: tuple[Job[Any], Any, str], report: Report | None) -> dict:
    """In the worker: run one spec and store its record atomically before returning it."""
    job, spec, path = item
    record = job(spec, report)
    if not isinstance(record, dict) or not isinstance(record.get("spec"), dict):
        raise TypeError(f"a study's job must return a dict with a \"spec\" dict (the run's settings); "
                        f"got {type(record).__name__} for {spec!r}")
    text = json.dumps(record)
    write_atomic(path, text.encode())
    return json.loads(text)  # as a later call reads it back (tuples as lists)


def stored_count(specs: Sequence[S], folder: Path, *, key: Callable[[S], str] = _KEY,
                 differences: Compare[S] = field_differences) -> int:
    """How many of `specs` :func:`run_resumable` would reuse from `folder` (stored with the same
    settings) instead of running them; reads the records, writes nothing."""
    if not folder.is_dir():
        return 0
    done, _ = _scan(specs, _check_keys(specs, key), folder, differences)
    return len(done)


def run_resumable(specs: Sequence[S], folder: Path, job: Job[S], *, key: Callable[[S], str] = _KEY,
                  differences: Compare[S] = field_differences,
                  jobs: int = 1, fresh_process: bool = True, overwrite: bool = False,
                  hint: str = "pass overwrite=True to replace them, or choose another folder",
                  before_start: Callable[[list[S]], None] | None = None,
                  on_done: Callable[[dict], None] | None = None,
                  on_progress: Callable[[str, int, int, str], None] | None = None) -> list[dict]:
    """Run every spec not already stored in `folder`, then return all records, in `specs` order.

    Before anything runs, every stored ``folder/<key>.json`` of a spec is read: one whose
    settings equal the spec's (``differences(spec, record["spec"]) == {}``) is reused, not
    rerun. One whose settings differ, or that is unreadable, raises ``FileExistsError`` naming
    its key and the differing settings (or why it is unreadable), unless `overwrite`, which
    reruns it and replaces the record. Records of keys not in `specs` are left alone.

    **Arguments:**
    - `specs`: the runs; their keys must be distinct file names (else ``ValueError``).
    - `folder`: where the records live; created if missing.
    - `job(spec, report) -> record`: a module-level function (it is pickled for worker
      processes). `record` is a JSON-ready dict with a ``"spec"`` dict, the settings that
      `differences` compares later (e.g. ``dataclasses.asdict(spec)``). `report(step, steps,
      info)` is ``None`` unless `on_progress` is given. The record is written atomically
      (:func:`rankwise._io.write_atomic`) in the worker as soon as the job returns.
    - `key(spec) -> str`: the record's file stem; default ``spec.key``.
    - `differences(spec, stored_spec) -> {setting: (stored, now)}`: empty when a stored record
      may stand for `spec`; default :func:`field_differences`.
    - `jobs`: runs at once, in worker processes.
    - `fresh_process`: each run in a fresh "spawn" process (peak memory per run); ``False``
      with ``jobs == 1`` runs here, in this process.
    - `hint`: the end of the ``FileExistsError`` message, saying how to go on.
    - `before_start(todo)`: called once, with the specs about to run, if any (e.g. to fill a
      cache the workers share).
    - `on_done(record)`, `on_progress(key, step, steps, info)`: called here, as runs finish and
      report.

    **Returns:** one record per spec, stored or new, in the order of `specs`, each as read back
    from its JSON (a new run's tuples come back as lists, as a resumed call would see them).
    """
    keys = _check_keys(specs, key)
    done, conflicts = _scan(specs, keys, folder, differences)
    if conflicts and not overwrite:
        raise FileExistsError(_describe(folder, conflicts, hint))
    folder.mkdir(parents=True, exist_ok=True)
    todo = [i for i, k in enumerate(keys) if k not in done]
    if todo:
        if before_start is not None:
            before_start([specs[i] for i in todo])

        def progress(j: int, step: int, steps: int, info: str) -> None:
            assert on_progress is not None
            on_progress(keys[todo[j]], step, steps, info)

        def finished(j: int, record: dict) -> None:
            done[keys[todo[j]]] = record
            if on_done is not None:
                on_done(record)

        map_runs(_run_and_store, [(job, specs[i], str(folder / f"{keys[i]}.json")) for i in todo],
                 jobs=jobs, processes=fresh_process or jobs > 1, fresh_process=fresh_process,
                 on_progress=progress if on_progress is not None else None, on_done=finished)
    return [done[k] for k in keys]
