"""rankwise sweep: end to end on a tiny configuration, resumability, the file loaders. (d_t = 0 for
the truncated SVD of the shadow: tests/nn/test_metrics.py.)"""

from __future__ import annotations

import gzip
import json
import pickle
import struct
from dataclasses import asdict

import numpy as np
import pytest
import torch

from helpers import run_cli
from rankwise.data import load_cifar, load_mnist, read_idx
from rankwise.experiments._sweep_spec import TASK_LR, RunSpec

TINY = ["sweep", "--tasks", "lenet-digits", "--methods", "dense,sdlrt", "--taus", "0.2,0.4",
        "--seeds", "1", "--epochs", "1"]


def test_sweep_end_to_end_and_resume(tmp_path):
    out = tmp_path / "sw"
    r = run_cli(*TINY, "--out", out)
    assert r.exit_code == 0, r.output
    assert "3 runs in the tables (3 trained by this call" in r.output
    for name in ("runs.csv", "summary.md", "acc_vs_compression.png", "rank_vs_step.png", "dt_vs_step.png"):
        assert (out / name).stat().st_size > 0
    rows = (out / "runs.csv").read_text().splitlines()
    assert len(rows) == 4 and rows[0].startswith("key,task,method,tau")
    assert "| lenet-digits | sdlrt | 0.2 | 1 |" in (out / "summary.md").read_text()
    before = (out / "runs" / "lenet-digits_sdlrt_tau0.4_sgd-lr0.05_s0.json").read_bytes()

    r = run_cli(*TINY, "--out", out)  # resumed: nothing recomputed
    assert r.exit_code == 0 and "3 runs in the tables (0 trained by this call" in r.output
    (out / "runs" / "lenet-digits_sdlrt_tau0.2_sgd-lr0.05_s0.json").unlink()
    r = run_cli(*TINY, "--out", out)  # only the missing run
    assert r.exit_code == 0 and "3 runs in the tables (1 trained by this call" in r.output
    assert (out / "runs" / "lenet-digits_sdlrt_tau0.4_sgd-lr0.05_s0.json").read_bytes() == before

    # the same keys with other settings: refused before anything runs, then replaced with --force
    r = run_cli(*TINY, "--epochs", "2", "--out", out)
    assert r.exit_code == 1 and "with other settings (epochs 1 there, 2 now)" in r.output, r
    assert "--force" in r.stderr and r.stderr.count("\n") == 1
    assert (out / "runs" / "lenet-digits_sdlrt_tau0.4_sgd-lr0.05_s0.json").read_bytes() == before
    r = run_cli(*TINY, "--epochs", "2", "--out", out, "--force")
    assert r.exit_code == 0 and "3 runs in the tables (3 trained by this call" in r.output, r
    stored = json.loads((out / "runs" / "lenet-digits_sdlrt_tau0.4_sgd-lr0.05_s0.json").read_text())
    assert stored["spec"]["epochs"] == 2


def test_sweep_rejects_unknown_names():
    r = run_cli("sweep", "--methods", "sgd")
    assert r.exit_code == 2 and "--methods must be a comma-separated list from" in r.stderr
    assert "got sgd" in r.stderr


def _idx(arr: np.ndarray, code: int) -> bytes:
    head = struct.pack(">BBBB", 0, 0, code, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return head + arr.tobytes()


def test_mnist_idx_loader(tmp_path):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 5), ("t10k", 3)):
        x = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        y = rng.integers(0, 10, n, dtype=np.uint8)
        (tmp_path / f"{prefix}-images-idx3-ubyte").write_bytes(_idx(x, 0x08))
        with gzip.open(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", "wb") as f:
            f.write(_idx(y, 0x08))
    tr, te = load_mnist(tmp_path)
    assert tr.tensors[0].shape == (5, 1, 28, 28) and te.tensors[1].shape == (3,)
    raw = read_idx(tmp_path / "train-images-idx3-ubyte")
    assert torch.equal(tr.tensors[0][:, 0], torch.from_numpy(raw.astype(np.float32) / 255))
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01" + b"\0" * 8)
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(_idx(np.zeros(4, np.uint8), 0x08)[:-1])
    with pytest.raises(ValueError, match="header says"):
        read_idx(tmp_path / "short")


@pytest.mark.parametrize("classes", [10, 100])
def test_cifar_pickle_loader(tmp_path, classes):
    rng = np.random.default_rng(1)
    key = b"labels" if classes == 10 else b"fine_labels"
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"] if classes == 10 else ["train", "test"]
    for name in names:
        batch = {b"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8), key: [1, classes - 1]}
        with open(tmp_path / name, "wb") as f:
            pickle.dump(batch, f)
    tr, te = load_cifar(tmp_path, classes)
    assert tr.tensors[0].shape == (2 * (len(names) - 1), 3, 32, 32) and te.tensors[0].shape == (2, 3, 32, 32)
    assert tr.tensors[1].tolist()[:2] == [1, classes - 1] and float(tr.tensors[0].max()) <= 1.0
    (tmp_path / names[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=names[-1]):
        load_cifar(tmp_path, classes)


def test_equal_compression_interpolates_the_reference_curve():
    from rankwise.experiments.sweep_report import equal_compression_markdown

    def r(method, tau, comp, acc, seed=0):
        return {"spec": {"task": "t", "method": method, "tau": tau, "seed": seed},
                "compression": comp, "test_acc": acc}

    rs = [r("dlrt", 0.1, 0.5, 0.9), r("dlrt", 0.3, 0.9, 0.5), r("sdlrt", 0.2, 0.7, 0.8),
          r("sdlrt", 0.4, 0.95, 0.3)]
    md = equal_compression_markdown(rs)
    assert "| t | sdlrt | 0.2 | 0.700 | 0.8000 ± 0.0000 | 0.7000 | +0.1000 |" in md
    assert "outside [0.500, 0.900]" in md


def test_sweep_with_targets_lands_on_them(tmp_path):
    """DLRT / SDLRT with a budget and the two baselines, all at one target."""
    out = tmp_path / "t"
    methods = ("dlrt", "sdlrt", "fixed", "dense-svd")
    r = run_cli("sweep", "--tasks", "mlp-mnist1d", "--methods", ",".join(methods), "--targets", "0.9",
                "--seeds", "1", "--epochs", "2", "--finetune-epochs", "1", "--out", out)
    assert r.exit_code == 0, r
    for method in methods:
        lr = TASK_LR.get("mlp-mnist1d", 0.05)
        rec = json.loads((out / "runs" / f"mlp-mnist1d_{method}_target0.9_sgd-lr{lr:g}_s0.json").read_text())
        assert abs(rec["compression"] - 0.9) <= 0.01 and rec["spec"]["target"] == 0.9
        assert rec["ranks"] and not rec["diverged"]
    assert "| mlp-mnist1d | dlrt | 0.9 | 1 |" in (out / "summary.md").read_text()
    for png in ("acc_vs_target.png", "ranks_per_layer.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = run_cli("sweep", "--targets", "1.2")
    assert r.exit_code == 2 and "--targets: every target must be in (0, 1); got 1.2" in r.stderr
    r = run_cli("sweep", "--methods", "fixed", "--tasks", "lenet-digits")
    assert r.exit_code == 2 and "give a target" in r.stderr


def test_stored_runs_conflict_only_on_settings_their_method_uses():
    dense = RunSpec(task="lenet-digits", method="dense", tau=0.0, rank=32)
    assert dense.differences({**asdict(dense), "rank": 16, "omega": 0.5}) == {}  # dense reads neither
    assert dense.differences({**asdict(dense), "epochs": 3}) == {"epochs": (3, 5)}
    dlrt = RunSpec(method="dlrt", target=0.9)
    assert dlrt.differences({**asdict(dlrt), "tau": 0.4, "omega": 0.5}) == {}
    assert dlrt.differences({**asdict(dlrt), "ramp": 0.3}) == {"ramp": (0.3, 0.9)}
    assert dlrt.differences({**asdict(dlrt), "alloc": "energy"}) == {"alloc": ("energy", "error-sqrt")}
    sdlrt = RunSpec(method="sdlrt", target=0.9)
    assert sdlrt.differences({**asdict(sdlrt), "omega": 0.5}) == {}  # a budget has no τ feedback
    assert RunSpec(method="sdlrt", tau=0.2).differences({**asdict(sdlrt), "target": None, "omega": 0.5,
                                                        "tau": 0.2}) == {"omega": (0.5, 0.8)}
    with pytest.raises(ValueError, match="only in its τ feedback"):
        RunSpec(method="sdlrt-two-sided", target=0.9)
    with pytest.raises(ValueError, match="alloc"):
        RunSpec(method="dlrt", target=0.9, alloc="sqrt")


def test_validation_split_is_stratified_and_disjoint_from_training():
    from rankwise.experiments.sweep import _split_validation

    y = torch.arange(400) % 5
    x = torch.arange(400, dtype=torch.float32)[:, None]  # each row names its index
    xtr, ytr, xva, yva = _split_validation(x, y, 0.15, seed=3)
    tr, va = set(xtr[:, 0].long().tolist()), set(xva[:, 0].long().tolist())
    assert not tr & va and tr | va == set(range(400))
    assert torch.equal(ytr, y[xtr[:, 0].long()]) and torch.equal(yva, y[xva[:, 0].long()])
    assert torch.bincount(yva).tolist() == [12] * 5  # 15 % of each class
    again = _split_validation(x, y, 0.15, seed=3)[2]
    assert torch.equal(again, xva) and not torch.equal(_split_validation(x, y, 0.15, seed=4)[2], xva)


def test_every_method_trains_the_same_steps_dense_svd_fine_tuning_included():
    from rankwise.experiments.sweep import run_one

    common = dict(task="lenet-digits", seed=0, epochs=2, dt_every=0)
    dense = run_one(RunSpec(method="dense", **common))
    cut = run_one(RunSpec(method="dense-svd", target=0.9, finetune_epochs=1, **common))
    warm = run_one(RunSpec(method="dlrt-warm", target=0.9, warm_epochs=1, **common))
    assert dense["steps"] == cut["steps"] == warm["steps"] > 0
    assert abs(cut["compression"] - 0.9) <= 0.01 and cut["ranks"]
    assert warm["ranks"] and 0.0 < warm["val_acc"] <= 1.0
    with pytest.raises(ValueError, match="finetune_epochs must be in"):
        RunSpec(method="dense-svd", target=0.9, finetune_epochs=2, **common)


def test_sweep_selects_each_method_on_validation(tmp_path):
    out = tmp_path / "sel"
    r = run_cli("sweep", "--tasks", "lenet-digits", "--methods", "dense,fixed:uniform", "--targets", "0.9",
                "--select", "0.9", "--grid", "sgd:0.03,0.1", "--widen", "0", "--seeds", "1",
                "--epochs", "1", "--out", out)  # (--dt-every would be refused: no method here traces d_t)
    assert r.exit_code == 0, r
    # no d_t is traced for these methods: final_d_t is absent, not 0; the last line counts
    # the runs the tables hold and those this call trained
    import csv

    records = [json.loads(f.read_text()) for f in (out / "runs").glob("*.json")]
    assert records and all(rec["final_d_t"] is None for rec in records)
    assert {row["final_d_t"] for row in csv.DictReader((out / "runs.csv").open())} == {""}
    assert "2 runs in the tables (4 trained by this call, the selection grid's included)" in \
        " ".join(r.stdout.split()), r.stdout
    sel = (out / "selection.md").read_text()
    assert "| lenet-digits | dense |" in sel and "| lenet-digits | fixed-uniform |" in sel
    # 2 grid points for each of the two methods, on seed 0: 4 runs, and the chosen ones are reused
    assert len(list((out / "runs").glob("*.json"))) == 4
    summary = (out / "summary.md").read_text()
    assert "| lenet-digits | fixed-uniform | 0.9 | 1 |" in summary
    assert "sgd 0.03" in summary or "sgd 0.1" in summary
    r = run_cli("sweep", "--methods", "dlrt,dlrt", "--targets", "0.9")
    assert r.exit_code == 2 and "names dlrt twice" in r.stderr
    r = run_cli("sweep", "--methods", "dlrt", "--targets", "0.9", "--select", "0.8")
    assert r.exit_code == 2 and "must be one of the compression --targets" in r.stderr
    r = run_cli("sweep", "--methods", "dlrt:bogus", "--targets", "0.9")
    assert r.exit_code == 2 and "is none of the allocations" in r.stderr


def test_versus_baselines_picks_on_validation_and_reports_test():
    from rankwise.experiments.sweep_report import versus_baselines_markdown

    def r(method, label, val, test, seed, target=0.9):
        return {"spec": {"task": "t", "method": method, "target": target, "seed": seed}, "label": label,
                "val_acc": val, "test_acc": test}

    rs = [r("dlrt", "dlrt", 0.90, 0.80, 0), r("dlrt", "dlrt", 0.90, 0.82, 1),  # best val, worse test
          r("dlrt", "dlrt-uniform", 0.85, 0.99, 0), r("dlrt", "dlrt-uniform", 0.85, 0.99, 1),
          r("fixed", "fixed-uniform", 0.88, 0.70, 0), r("fixed", "fixed-uniform", 0.88, 0.72, 1),
          r("dense-svd", "dense-svd", 0.80, 0.95, 0), r("dense", "dense", 0.99, 0.99, 0, None),
          # a rankwise variant, not a baseline (it was counted as one before issue 48's table)
          r("dlrt-muon-reset", "dlrt-muon-reset", 0.89, 0.5, 0)]
    md = versus_baselines_markdown(rs)
    # rankwise: dlrt by validation (not dlrt-uniform's better test); baseline: fixed-uniform
    assert ("| t | 0.9 | dlrt | 0.8100 ± 0.0141 | fixed-uniform | 0.7100 ± 0.0141 | +0.1000 | yes | yes |"
            in md), md
    assert md.count("\n") == 3
