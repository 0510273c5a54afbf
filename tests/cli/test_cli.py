"""The ``rankwise`` command line and the training loop behind it (rankwise.train)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import run_cli
from rankwise.experiments.train_run import Progress, train, write_json_atomic
from rankwise.train import TrainConfig

MLP_LAYERS = {"fc1": 64, "fc2": 500, "fc3": 10}  # name -> min(out, in), the largest rank


pytestmark = pytest.mark.usefixtures("one_thread")


def _invoke(*args: object):
    return run_cli(*args)


def _scalars(out: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("method", ["dense", "dlrt", "sdlrt"])
def test_train_writes_sane_records(tmp_path, method):
    out = tmp_path / "run"
    low_rank = () if method == "dense" else ("--rank", 8, "--tau", 0.1)
    result = _invoke("train", "--method", method, "--model", "mlp", "--epochs", 1, *low_rank, "--out", out)
    assert result.exit_code == 0, result.output
    assert "test accuracy" in result.output and "compression" in result.output

    final = json.loads((out / "final.json").read_text())
    assert final["config"]["method"] == method and final["config"]["epochs"] == 1
    assert 0.0 <= final["test_acc"] <= 1.0 and 0.0 <= final["train_acc"] <= 1.0
    assert final["wall_time"] > 0 and final["format_version"] == 1
    comp = final["compression"]
    assert comp["dense_params"] == 64 * 500 + 500 + 500 * 500 + 500 + 500 * 10 + 10
    assert comp["ratio"] == pytest.approx(1 - comp["stored_params"] / comp["dense_params"])
    if method == "dense":
        assert final["ranks"] == {} and comp["ratio"] == 0.0
    else:
        assert set(final["ranks"]) == set(MLP_LAYERS)
        assert all(2 <= r <= MLP_LAYERS[n] for n, r in final["ranks"].items())
        assert comp["ratio"] > 0.5  # rank ~8 of 500×500 stores a few percent of the weights
        assert (comp["buffer_params"] > 0) == (method == "sdlrt")

    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1
    row = rows[0]
    assert int(row["epoch"]) == 1 and float(row["train_loss"]) > 0
    assert float(row["test_acc"]) == pytest.approx(final["test_acc"])
    assert float(row["compression"]) == pytest.approx(comp["ratio"])
    assert {k[len("rank/"):]: int(v) for k, v in row.items() if k.startswith("rank/")} == final["ranks"]

    assert list(out.glob("events.out.tfevents.*"))
    scalars = _scalars(out)
    assert scalars["accuracy/test"] == [pytest.approx(final["test_acc"])]
    assert {"loss/train", "accuracy/train", "compression/ratio"} <= set(scalars)
    assert {t for t in scalars if t.startswith("rank/")} == {f"rank/{n}" for n in final["ranks"]}
    assert {t for t in scalars if t.startswith("tau/")} == {f"tau/{n}" for n in final["taus"]}
    for n, tau in final["taus"].items():  # the last epoch's τ is the final one
        assert scalars[f"tau/{n}"][-1] == pytest.approx(tau)
        assert float(row[f"tau/{n}"]) == pytest.approx(tau)
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_dense_training_learns():
    s = train(TrainConfig(method="dense", model="mlp", epochs=1))
    assert s["test_acc"] > 0.7  # chance is 0.1
    assert s["history"][0]["train_loss"] < 2.0  # ln 10 ≈ 2.30 at chance


def test_bad_method_is_a_clear_usage_error():
    result = _invoke("train", "--method", "bogus")
    assert result.exit_code == 2
    assert "--method" in result.output and "bogus" in result.output
    assert all(m in result.output for m in ("dense", "dlrt", "sdlrt"))


def test_bad_method_through_the_console_script():
    script = Path(sys.executable).with_name("rankwise")
    if not script.exists():
        pytest.skip("console script not installed (pip install -e .)")
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run([str(script), "train", "--method", "bogus"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert "Invalid value for '--method'" in proc.stderr and "'bogus'" in proc.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--tau", "1.5"], "--tau must be in [0, 1); got 1.5"),
    (["--epochs", "0"], "--epochs must be an int >= 1; got 0"),
    (["--rank", "0"], "--rank must be a positive int"),
    (["--method", "sdlrt", "--tau", "0.1", "--tau-min", "0.2"], "--tau-min must be in [0, tau=0.1]"),
    (["--momentum", "1.5"], "--momentum must be in [0, 1); got 1.5"),
])
def test_bad_values_name_the_argument(args, message):
    result = _invoke("train", *args)
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and result.stdout == ""  # one line, nothing else
    assert result.stderr.startswith("rankwise train: error: ") and message in result.stderr


def test_demo_prints_one_comparison_table(tmp_path):
    result = _invoke("demo", "--epochs", 1, "--out", tmp_path)
    assert result.exit_code == 0, result.output
    assert result.output.count("LeNet-5 on digits") == 1
    for method in ("dense", "DLRT", "SDLRT"):  # a table row: method │ test acc
        assert re.search(rf"{method} +│ +[01]\.\d{{4}}", result.stdout), result.stdout
    for method in ("dense", "dlrt", "sdlrt"):
        final = json.loads((tmp_path / method / "final.json").read_text())
        assert final["config"]["model"] == "lenet"
        if method != "dense":  # the demo's default: both low-rank methods at 90 % compression
            assert abs(final["compression"]["ratio"] - 0.9) <= 0.01
    r = run_cli("demo", "--epochs", 1, "--out", tmp_path / "tau", "--tau", 0.2)
    assert r.exit_code == 0 and "τ = 0.2" in r.stdout
    r = run_cli("demo", "--tau", 0.2, "--target", 0.9, "--out", tmp_path / "both")
    assert r.exit_code == 2 and "--target or --tau" in r.stderr and not (tmp_path / "both").exists()


# --------------------------------------------------------------------------- library loop
def test_train_config_validates_and_is_frozen():
    with pytest.raises(ValueError, match=r"`method` must be one of \['dense', 'dlrt', 'sdlrt'\]"):
        TrainConfig(method="adam")
    with pytest.raises(ValueError, match=r"`model` must be one of \['lenet', 'mlp', 'vgg'\]; got 'resnet'"):
        TrainConfig(model="resnet")
    with pytest.raises(ValueError, match="`lr` must be"):
        TrainConfig(lr=0.0)
    with pytest.raises(TypeError, match=r"`out` must be a pathlib\.Path"):
        TrainConfig(out="runs")
    config = TrainConfig()
    with pytest.raises(AttributeError):
        config.tau = 0.5


def test_train_is_deterministic_reports_progress_and_keeps_global_rng():
    config = TrainConfig(method="dlrt", model="mlp", epochs=2, rank=8, batch_size=128)
    events: list[Progress] = []
    state = torch.get_rng_state()
    a = train(config, callback=events.append)
    assert torch.equal(torch.get_rng_state(), state)
    b = train(config)
    strip = [{k: v for k, v in h.items() if k != "epoch_time"} for h in a["history"]]
    assert strip == [{k: v for k, v in h.items() if k != "epoch_time"} for h in b["history"]]
    steps = -(-1437 // 128)
    assert len(events) == 2 * steps
    assert [e.step for e in events[:steps]] == list(range(1, steps + 1))
    ends = [e for e in events if e.record is not None]
    assert [e.record.epoch for e in ends] == [1, 2] and all(e.step == steps for e in ends)
    assert ends[-1].ranks == a["ranks"]
    assert ends[-1].record.test_acc == a["history"][-1]["test_acc"]


def test_write_json_atomic_replaces_or_leaves_the_old_file(tmp_path):
    path = tmp_path / "final.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    with pytest.raises(ValueError):
        write_json_atomic(path, {"a": float("nan")})  # not valid JSON: refused
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["final.json"]


def test_train_with_a_compression_target(tmp_path):
    out = tmp_path / "t"
    r = _invoke("train", "--method", "sdlrt", "--model", "mlp", "--epochs", 2, "--rank", 64,
                "--target", 0.9, "--out", out)
    assert r.exit_code == 0, r
    final = json.loads((out / "final.json").read_text())
    assert abs(final["compression"]["ratio"] - 0.9) <= 0.01 and final["config"]["target"] == 0.9
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    stored = (1 - final["compression"]["ratio"]) * final["compression"]["dense_params"]
    assert float(rows[-1]["budget_params"]) >= stored - 1e-6  # the budget is logged, and kept
    for extra in (("--tau", 0.3), ("--tau-min", 0.05)):  # nothing given is silently unused
        bad = run_cli("train", "--method", "sdlrt", "--target", 0.9, *extra, "--out", tmp_path / "x")
        assert bad.exit_code == 2 and extra[0] in bad.stderr and not (tmp_path / "x").exists()
    bad = _invoke("train", "--method", "dense", "--target", 0.9)
    assert bad.exit_code == 2 and "--target needs a low-rank method" in bad.stderr
