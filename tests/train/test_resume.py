"""rankwise.experiments._resume: the resume skeleton the studies share (trivial jobs, no training)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import pytest

from rankwise.experiments import _resume
from rankwise.experiments._resume import field_differences, run_resumable, stored_conflicts


@dataclass(frozen=True)
class Spec:
    name: str
    lr: float = 0.1
    sizes: tuple[int, ...] = (1, 2)

    @property
    def key(self) -> str:
        return f"run_{self.name}"


CALLS: list[Spec] = []


def _job(spec: Spec, report=None) -> dict:
    CALLS.append(spec)
    if report is not None:
        report(1, 1, "half")
    return dict(spec=asdict(spec), key=spec.key, value=len(CALLS))


def _run(specs, folder, **kw):
    return run_resumable(specs, folder, _job, fresh_process=False, **kw)


@pytest.fixture(autouse=True)
def _calls():
    CALLS.clear()


def test_runs_stores_and_reuses_equal_records(tmp_path):
    specs = [Spec("a"), Spec("b")]
    done, progress = [], []
    first = _run(specs, tmp_path / "runs", on_done=done.append, on_progress=lambda *a: progress.append(a))
    assert [r["key"] for r in first] == ["run_a", "run_b"] and len(CALLS) == 2
    assert done == first and progress == [("run_a", 1, 1, "half"), ("run_b", 1, 1, "half")]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["run_a.json", "run_b.json"]
    assert json.loads((tmp_path / "runs" / "run_a.json").read_text()) == first[0]
    assert first[0]["spec"]["sizes"] == [1, 2]  # as stored, so a resumed call returns the same
    # the same specs again, one more, in another order: only the new one runs
    started = []
    again = _run([Spec("c"), *specs], tmp_path / "runs", before_start=started.append)
    assert [Spec("a"), Spec("b"), Spec("c")] == CALLS and started == [[Spec("c")]]
    assert again[1:] == first and again[0]["key"] == "run_c"
    # nothing left to run: before_start is not called
    _run(specs, tmp_path / "runs", before_start=started.append)
    assert len(CALLS) == 3 and len(started) == 1


def test_changed_setting_is_refused_before_anything_runs_unless_overwrite(tmp_path):
    _run([Spec("a"), Spec("b")], tmp_path)
    changed = [Spec("z"), Spec("a", lr=0.2), Spec("b")]
    msg = r"holds run run_a with other settings \(lr 0\.1 there, 0\.2 now\); pass overwrite=True"
    with pytest.raises(FileExistsError, match=msg):
        _run(changed, tmp_path)
    assert len(CALLS) == 2 and not (tmp_path / "run_z.json").exists()  # nothing ran
    assert stored_conflicts(changed, tmp_path) == {"run_a": {"lr": (0.1, 0.2)}}
    with pytest.raises(FileExistsError, match=r"; rerun with --force$"):
        _run(changed, tmp_path, hint="rerun with --force")
    out = _run(changed, tmp_path, overwrite=True)
    assert CALLS[2:] == [Spec("z"), Spec("a", lr=0.2)]  # b is reused, a rerun
    assert json.loads((tmp_path / "run_a.json").read_text())["spec"]["lr"] == 0.2 == out[1]["spec"]["lr"]


@pytest.mark.parametrize("text,why", [("{not json", "not valid JSON"), ("[1, 2]", "no run settings"),
                                      ('{"key": "run_a"}', "no run settings"),
                                      ('{"spec": 3}', "no run settings")])
def test_unreadable_record_is_refused_naming_it_and_replaced_with_overwrite(tmp_path, text, why):
    (tmp_path / "run_a.json").write_text(text)
    with pytest.raises(FileExistsError, match=f"holds run run_a with an unreadable record: .*{why}"):
        _run([Spec("b"), Spec("a")], tmp_path)
    assert CALLS == []
    assert stored_conflicts([Spec("a")], tmp_path)["run_a"]["record"][0] == "unreadable"
    _run([Spec("b"), Spec("a")], tmp_path, overwrite=True)
    assert [Spec("b"), Spec("a")] == CALLS
    assert field_differences(Spec("a"), json.loads((tmp_path / "run_a.json").read_text())["spec"]) == {}


def test_several_conflicts_are_counted(tmp_path):
    _run([Spec("a"), Spec("b")], tmp_path)
    with pytest.raises(FileExistsError, match=r"run run_a \(and 1 more\) with other settings"):
        _run([Spec("a", lr=1.0), Spec("b", lr=1.0)], tmp_path)


def test_duplicate_and_malformed_keys_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"two runs with key 'run_a'.*train the same run twice"):
        _run([Spec("a"), Spec("b"), Spec("a", lr=0.5)], tmp_path)
    with pytest.raises(ValueError, match=r"two runs with key 'run_a'"):
        stored_conflicts([Spec("a"), Spec("a")], tmp_path)
    for bad in ("x/y", "", ".hidden"):
        with pytest.raises(ValueError, match="a run key must be a file name"):
            _run([Spec("a")], tmp_path, key=lambda s, bad=bad: bad)
    assert CALLS == [] and list(tmp_path.iterdir()) == []


def test_records_are_written_atomically(tmp_path, monkeypatch):
    writes = []
    real = _resume.write_atomic

    def spy(path, data):
        writes.append(path)
        real(path, data)

    monkeypatch.setattr(_resume, "write_atomic", spy)
    _run([Spec("a"), Spec("b")], tmp_path)
    assert writes == [str(tmp_path / "run_a.json"), str(tmp_path / "run_b.json")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run_a.json", "run_b.json"]  # no temporary files

    def broken(spec, report=None):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):  # a failed run stores nothing
        run_resumable([Spec("c")], tmp_path, broken, fresh_process=False)
    assert not (tmp_path / "run_c.json").exists()
    with pytest.raises(TypeError, match=r"must return a dict with a \"spec\" dict"):
        run_resumable([Spec("c")], tmp_path, lambda s, r: {"key": s.key}, fresh_process=False)
    assert not (tmp_path / "run_c.json").exists()


def test_field_differences_compare_json_values_and_defaults():
    s = Spec("a", lr=0.2)
    stored = json.loads(json.dumps(asdict(s)))  # the tuple comes back as a list
    assert field_differences(s, stored) == {}
    assert field_differences(s, {"name": "a", "lr": 0.2}) == {}  # a field the record predates: its default
    assert field_differences(s, {**stored, "gone": 1, "sizes": [3]}) == {"sizes": ([3], [1, 2])}
    assert field_differences(s, {"lr": 0.2}) == {"name": ("<missing>", "a")}


def _pid_job(spec: Spec, report=None) -> dict:
    import os

    return dict(spec=asdict(spec), pid=os.getpid())


def test_worker_processes_store_their_records(tmp_path):
    import os

    out = run_resumable([Spec("a"), Spec("b")], tmp_path, _pid_job, jobs=2)
    assert all(r["pid"] != os.getpid() for r in out)
    assert [json.loads((tmp_path / f"run_{n}.json").read_text()) for n in "ab"] == out
    assert run_resumable([Spec("a"), Spec("b")], tmp_path, _pid_job, jobs=2) == out  # reused, not rerun
