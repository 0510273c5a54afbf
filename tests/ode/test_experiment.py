"""The matrix-memory ODE experiment: its gradients audit clean, and it runs end to end."""

import pytest
import torch
from torch import nn

from rankwise.experiments.ode_seq import FromInitialMemory, LayeredMemoryODE, OdeRunConfig, run
from rankwise.ode import FixedController, audit_gradients


def test_reversal_gradients_on_rank_deficient_float32_states():
    """The memory starts near zero and grows by rank-1 writes, so early cores are
    ill-conditioned: the reverse rebuilds the product but not the spans. The backward must
    notice (frame-aligned factor check) and replay, or the gradient is wrong (cosine ≈ 0)."""
    torch.manual_seed(0)
    model = LayeredMemoryODE(FixedController(16, 8), T=64, m=16, layers=2, depth_steps=4)
    g = torch.Generator().manual_seed(0)
    u = 2 * torch.rand(8, 64, generator=g) - 1
    y = torch.randint(0, 10, (8,), generator=g)

    cos = audit_gradients(FromInitialMemory(model, u), model.initial_state(8),
                          lambda logits: nn.functional.cross_entropy(logits, y))
    assert cos > 0.999
    assert model.blocks[0].last_stats["reloads"] > 0  # the ill-conditioned start was replayed


def test_run_end_to_end_tiny():
    calls = []
    r = run(OdeRunConfig(model="layered", controller="adaptive", c=4, layers=2, depth_steps=4, m=8, rank=4,
                         max_rank=8, batch_size=512, lr=3e-2), callback=lambda *a: calls.append(a))
    assert [(i, n) for i, n, _ in calls] == [(1, 3), (2, 3), (3, 3)]  # progress inside the run
    assert [loss for *_, loss in calls] == [t["loss"] for t in r["trace"]]
    assert 0.1 < r["test_acc"] <= 1 and r["grad_cosine"] > 0.98
    assert len(r["trace"]) == 3 and r["peak_tape_mib"] > 0
    assert r["trace"][-1]["checkpoints"] < r["trace"][0]["checkpoints"]  # carried C grew


@pytest.mark.parametrize(("field", "value"), [("layers", 0), ("rank", 0), ("rank", 9), ("depth_steps", 0),
                                              ("c", 0), ("epochs", 0), ("p", 9), ("window", 0),
                                              ("budget_states", 0), ("h", 0.0), ("model", "lstm"),
                                              ("controller", "magic"), ("budget_in", "kib"),
                                              ("validation", 1.0), ("validation", -0.1)])
def test_run_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=f"`{field}` must be"):
        OdeRunConfig(**{"m": 8, "max_rank": 8, "p": 4, field: value})


def test_loss_spikes_are_jumps_at_the_scale_of_the_training():
    from rankwise.experiments.ode_seq import _spikes

    start = [2.3] * 10
    assert _spikes(start + [0.01, 0.01, 0.03, 0.01] * 5) == 0  # 3× the median, but noise near 0
    assert _spikes(start + [0.01] * 10 + [0.5] + [0.01] * 10) == 1  # a real jump
    assert _spikes(start + [1.0] * 10 + [1.9, 1.95]) == 0  # under twice the median
    assert _spikes([1.0] * 5) == 0


def test_ode_cli_rejects_unknown_controller():
    from helpers import run_cli

    r = run_cli("ode", "--grid", "magic:8")
    assert r.exit_code == 2 and "--grid entries are" in r.stderr and "'magic:8'" in r.stderr


def _gated(controller, **kw):
    return OdeRunConfig(data="mnist1d", controller=controller, m=8, rank=3, p=4, batch_size=1000, lr=1e-2,
                        **kw)


def test_gated_runs_under_a_budget_and_as_the_autograd_baseline():
    """The budget run's measured peak stays under its budget; the baseline counts its graph."""
    budget = run(_gated("budget", budget_states=4))
    state = 4 * 1000 * (2 * 8 * 3 + 3 * 3)  # bytes of one float32 state of a 1000-sequence batch
    assert 0 < budget["peak_mib"] * 2**20 <= 4 * state
    assert budget["mean_recomputed"] > 0  # 40 steps in 3 spare slots: something was recomputed...
    assert budget["mean_replays"] == 0  # ...only where a replay was cheaper than the reverse
    assert budget["grad_cosine"] > 0.999
    base = run(_gated("autograd"))
    assert base["mean_checkpoints"] == 0 and base["peak_mib"] > 10 * budget["peak_mib"]
    # the same model and seed: the two losses start equal (reversal changes no forward value)
    assert base["trace"][0]["loss"] == pytest.approx(budget["trace"][0]["loss"], rel=1e-6)


@pytest.mark.parametrize(("args", "says"), [
    (("--grid", "budget:8-16"), "a budget controller has no CMAX"),
    (("--grid", "autograd:8"), "autograd takes no C"),
    (("--model", "lstm"), "--model must be 'gated' or 'layered'"),
    (("--grid", "gru:64:r4"), "the GRU has no rank"),
    (("--recurrence", "dense"), "--recurrence must be one of 'kron', 'full'"),
])
def test_ode_cli_names_bad_entries(args, says, tmp_path):
    from helpers import run_cli

    r = run_cli("ode", *args, "--out", str(tmp_path / "out"))
    assert r.exit_code == 2 and says in r.stderr and not (tmp_path / "out").exists()


def test_the_gru_baseline_trains_by_the_same_protocol(monkeypatch):
    """`controller="gru"`: torch.nn.GRU on the same data, optimizer and schedule; its memory
    is the bytes its graph saves; no reversal, so no audit (None)."""

    from rankwise.experiments import ode_seq

    full = ode_seq.load_sequences
    monkeypatch.setattr(ode_seq, "load_sequences",
                        lambda data, seed: tuple(t[:1024] for t in full(data, seed)))
    r = run(OdeRunConfig(data="digits", controller="gru", gru_hidden=32, epochs=4, lr=1e-2, seed=0))
    assert r["name"] == "GRU h=32" and r["grad_cosine"] is None and r["mean_checkpoints"] == 0
    assert r["peak_mib"] > 0.5  # 64 steps × 64 sequences × gates and states, saved
    losses = [t["loss"] for t in r["trace"]]
    assert sum(losses[-3:]) / 3 < 0.85 * sum(losses[:3]) / 3, losses  # it learns (2.3 -> about 1.8)
    model = ode_seq.build_model(OdeRunConfig(controller="gru", gru_hidden=32), 64)
    u = torch.randn(5, 64)
    h = torch.zeros(1, 5, 32)  # the head reads the GRU's last hidden state, computed here by hand
    for t in range(64):
        h = model.gru(u[:, t:t + 1, None], h)[1]
    torch.testing.assert_close(model(u), model.head(h[0]))


def test_the_summary_names_a_metric_a_run_does_not_have():
    """Several GRU seeds have no audit (NaN each): the table says so instead of failing."""
    from rankwise.experiments._stats import mean_std

    nan = float("nan")
    assert mean_std([nan, nan, nan], "{:.3f}") == "—"
    assert mean_std([0.5, nan], "{:.3f}") == "—"
    assert mean_std([0.5, 0.7], "{:.2f}") == "0.60 ± 0.14"
    assert mean_std([0.5], "{:.2f}") == "0.50"


def test_ode_cli_resumes_from_its_run_records(tmp_path, monkeypatch):
    """`rankwise ode` stores one record per run (experiments._resume): a second call reuses it,
    a changed setting is refused before anything runs, --force replaces it."""
    import json

    from helpers import run_cli
    from rankwise.experiments import ode_seq

    full = ode_seq.load_sequences

    def small(data, seed):  # the real sequences, few of them: a run takes a second
        utr, ytr, ute, yte = full(data, seed)
        return utr[:96], ytr[:96], ute[:32], yte[:32]

    monkeypatch.setattr(ode_seq, "load_sequences", small)
    out = tmp_path / "ode"
    args = ("ode", "--data", "mnist1d", "--grid", "fixed:8:r2", "--out", out)
    r = run_cli(*args)
    assert r.exit_code == 0, r.output
    assert "…" not in r.stdout, r.stdout  # issue 41: every cell whole at 80 columns or in a pipe
    assert "fixed C=8 r=2 s0: test acc" in r.stdout  # a run's line as it ends, also where no bar is drawn
    record = out / "runs" / "mnist1d_gated_fixed_C8_r2_s0.json"
    before = record.read_bytes()
    assert json.loads(before)["spec"]["rank"] == 2 and (out / "results.json").exists()
    calls = []
    monkeypatch.setattr(ode_seq, "run", lambda *a, **k: calls.append(a))
    assert run_cli(*args).exit_code == 0 and not calls and record.read_bytes() == before  # reused
    r = run_cli(*args, "--epochs", "2")
    assert r.exit_code == 1 and "epochs 1 there, 2 now" in r.stderr and "--force" in r.stderr
    assert record.read_bytes() == before and not calls
    r = run_cli("ode", "--grid", "fixed:8,fixed:8", "--out", tmp_path / "twice")
    assert r.exit_code == 2 and "--grid names fixed:8 twice" in r.stderr


def test_validation_holds_out_the_end_of_the_training_set():
    from rankwise.experiments.ode_seq import split_validation

    u, y = torch.arange(20.0).reshape(10, 2), torch.arange(10)
    ut, yt = torch.zeros(3, 2), torch.zeros(3)
    assert split_validation(u, y, ut, yt, 0.0) == (u, y, ut, yt)
    tr_u, tr_y, va_u, va_y = split_validation(u, y, ut, yt, 0.2)
    assert torch.equal(tr_u, u[:8]) and torch.equal(va_u, u[8:]) and torch.equal(va_y, y[8:])
    assert torch.equal(tr_y, y[:8])
    with pytest.raises(ValueError, match="leaves 10 to train on and 0 to validate on"):
        split_validation(u, y, ut, yt, 0.01)


def test_ode_cli_scores_a_validation_split_without_reading_the_test_set(tmp_path, monkeypatch):
    """--validation: trains on the first part of the training set and reports val acc on the
    rest; the test sequences are never scored (here they are poisoned: NaN)."""
    import json

    from helpers import run_cli
    from rankwise.experiments import ode_seq

    full = ode_seq.load_sequences

    def small(data, seed):
        utr, ytr, ute, yte = full(data, seed)
        return utr[:100], ytr[:100], torch.full_like(ute[:32], float("nan")), yte[:32]

    monkeypatch.setattr(ode_seq, "load_sequences", small)
    out = tmp_path / "ode"
    r = run_cli("ode", "--data", "mnist1d", "--grid", "fixed:8:r2", "--validation", "0.25", "--out", out)
    assert r.exit_code == 0, r.output
    assert "validation 0.25 of train" in " ".join(r.stdout.split())  # the table's title (maybe wrapped)
    def strict(constant):  # NaN / Infinity are not JSON
        raise AssertionError(f"the record holds {constant}")

    rec = json.loads((out / "runs" / "mnist1d_gated_fixed_C8_r2_validation_0.25_s0.json").read_text(),
                     parse_constant=strict)
    assert rec["test_acc"] is None and 0 <= rec["val_acc"] <= 1 and rec["spec"]["validation"] == 0.25
    assert len(rec["trace"]) == 2  # 75 sequences to train on: two batches of 64
    r = run_cli("ode", "--validation", "1.5", "--out", tmp_path / "bad")
    assert r.exit_code == 2 and "--validation must be in [0, 1)" in r.stderr
