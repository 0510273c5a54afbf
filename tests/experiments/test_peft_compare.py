"""``rankwise peft``'s protocol: equal trainable parameters and scale, configurations chosen on
validation, one resume skeleton; the tables; a tiny end-to-end command."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest

from helpers import run_cli
from rankwise.experiments._select import Choice
from rankwise.experiments.peft import peft_compare as pc
from rankwise.experiments.peft._peft_spec import METHODS, PeftRunSpec


def rec(method, lr, seed, val, test, t=1.0, *, optimizer="adam", setting="100", steps=150, **extra):
    spec = PeftRunSpec(method=method, setting=setting, seed=seed, lr=lr, optimizer=optimizer, steps=steps,
                       **extra)
    return {"spec": dataclasses.asdict(spec), "key": spec.key, "val_acc": val, "test_acc": test,
            "step_seconds": t, "trainable_params": 100, "trainable_params_max": 120, "ranks": {"q": 10},
            "peak_rss_mib": 300.0 + 100 * t, "train_articles": 100}


# ------------------------------------------------------------------------- the tables
def test_summary_reports_the_chosen_configuration_and_its_edge():
    rs = [rec("lora", 1e-3, s, 0.8, 0.70) for s in (0, 1)]
    rs += [rec("lora", 3e-3, s, 0.9, 0.60) for s in (0, 1)]
    rs += [rec("dlrt", 1e-3, s, 0.95, 0.9 + 0.02 * s, 1.5) for s in (0, 1)]
    rs += [rec("dlrt", 3e-4, 0, 0.99, 0.99, 1.5)]  # a grid run of the selection: not the choice
    choices = {"lora": Choice("adam", 1e-3, 0.8, "low", ()), "dlrt": Choice("adam", 1e-3, 0.95, "", ())}
    md = pc.summary_markdown(rs, choices, "100")
    # the choice, not the best validation accuracy among the runs, and not test accuracy
    assert ("| 100 | 150 | lora | adam 0.001 | on val, 100 s0 | low | 2 | 0.800 ± 0.000 | 0.700 ± 0.000 "
            "| 120 |") in md
    assert ("| 100 | 150 | dlrt | adam 0.001 | on val, 100 s0 | no | 2 | 0.950 ± 0.000 | 0.910 ± 0.014 "
            "| 120 |") in md
    assert md.rstrip().endswith("| 1.50 | 450 |")  # step time against LoRA's, then peak memory
    # without a choice: the configuration with the best mean validation accuracy of those run
    md = pc.summary_markdown(rs)
    assert "| 100 | 150 | lora | adam 0.003 | best val of runs |  | 2 | 0.900 ± 0.000 |" in md
    assert "| 100 | 150 | dlrt | adam 0.0003 | best val of runs |  | 1 | 0.990 | 0.990 |" in md  # (one seed)


def test_study_collects_earlier_commands_runs_of_this_protocol_and_plots(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    records = [rec("lora", 1e-3, 0, 0.9, 0.8, setting="full", steps=200), rec("dlrt", 1e-3, 4, 0.9, 0.81,
                                                                              setting="25"),
               rec("dlrt", 1e-3, 0, 0.9, 0.82, setting="25", max_len=64),  # another study: other length
               rec("sdlrt", 1e-3, 0, 0.9, 0.83, setting="25")]
    del records[3]["spec"]["version"]  # the protocol before issue 24
    for i, r in enumerate(records):
        (runs / f"r{i}.json").write_text(json.dumps(r))
    (runs / "broken.json").write_text("{")
    got = pc.study_records(tmp_path, PeftRunSpec(method="sdlrt", setting="100", seed=2, lr=0.1, steps=5))
    kinds = sorted((r["spec"]["setting"], r["spec"]["method"]) for r in got)
    assert kinds == [("25", "dlrt"), ("full", "lora")]
    md = pc.summary_markdown(got)
    assert "| full | 200 | lora |" in md and "| 25 | 150 | dlrt |" in md
    png = pc.plot(got, tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------- resuming
def test_compare_refuses_other_settings_a_corrupt_record_and_the_old_protocol(tmp_path):
    spec = PeftRunSpec(method="lora", setting="25", steps=3, batch_size=4, max_len=16)
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / f"{spec.key}.json").write_text(json.dumps(rec("lora", 1e-3, 0, 0.9, 0.8, setting="25", steps=4,
                                                          batch_size=4, max_len=16)))
    with pytest.raises(FileExistsError, match=r"other settings \(steps 4 there, 3 now\).*--force"):
        pc.compare([spec], tmp_path)
    (runs / f"{spec.key}.json").write_text("{not json")
    with pytest.raises(FileExistsError, match="unreadable record"):
        pc.compare([spec], tmp_path)
    old = rec("lora", 1e-3, 0, 0.9, 0.8)
    del old["spec"]["version"]
    del old["spec"]["optimizer"]
    (runs / f"{spec.key}.json").unlink()
    (runs / "lora_100_lr0.001_s0.json").write_text(json.dumps(old))
    with pytest.raises(FileExistsError, match=r"1 run records of the protocol before equal budgets"):
        pc.compare([spec], tmp_path)
    # an old record at the same key conflicts by itself: version 1 there
    assert PeftRunSpec(method="lora").differences(old["spec"])["version"] == (1, 2)
    stored = rec("lora", 1e-3, 0, 0.9, 0.8, setting="25", steps=3, batch_size=4, max_len=16)
    (runs / "lora_100_lr0.001_s0.json").unlink()
    (runs / f"{spec.key}.json").write_text(json.dumps(stored))
    assert pc.compare([spec], tmp_path) == [stored]  # equal settings: reused, nothing runs


def test_study_chooses_on_seed_0_of_one_setting_and_reuses_the_choice(tmp_path, monkeypatch):
    calls = []

    def fake_compare(specs, out, **kw):  # validation accuracy peaks at 3e-3 for lora, at 1 for dlrt
        calls.append(list(specs))
        best = {"lora": 3e-3, "dlrt": 1.0}
        return [{"spec": dataclasses.asdict(s), "key": s.key,
                 "val_acc": 1 - abs(math.log10(s.lr / best[s.method]))} for s in specs]

    monkeypatch.setattr(pc, "compare", fake_compare)
    got = pc.study(["lora", "dlrt"], ["100", "25"], 2, tmp_path, select="25",
                   grid={"adam": (1e-3, 3e-3, 1e-2)}, widen=2, steps={"25": 7}, batch_size=4, max_len=16)
    assert got.choices["lora"] == Choice("adam", 3e-3, 1.0, "", got.choices["lora"].tried)
    dlrt = got.choices["dlrt"]  # widened twice (ratio 10/3), still at the high edge: said so
    assert (dlrt.lr, dlrt.at_edge) == (0.111, "high")
    assert [lr for _, lr, _ in dlrt.tried][-2:] == [0.0333, 0.111]
    assert all(s.setting == "25" and s.seed == 0 and s.steps == 7 for batch in calls[:-1] for s in batch)
    final = calls[-1]
    assert len(final) == 2 * 2 * 2
    assert {(s.method, s.lr) for s in final} == {("lora", 3e-3), ("dlrt", 0.111)}
    assert {(s.setting, s.steps) for s in final} == {("100", 150), ("25", 7)}
    with pytest.raises(ValueError, match="selection setting 'full' must be one of the settings"):
        pc.study(["lora"], ["100"], 1, tmp_path, select="full")


# ------------------------------------------------------------------------- the methods, on MiniLM
@pytest.fixture(scope="module")
def built():
    pytest.importorskip("peft")
    try:
        pc.model_path()
    except ImportError as e:
        pytest.skip(str(e))
    import torch

    torch.set_num_threads(1)
    return {m: pc._build(PeftRunSpec(method=m, steps=20), total_steps=20) for m in METHODS}


def test_every_method_has_scale_one_and_the_budgeted_ones_train_no_more_than_lora(built):
    from rankwise.peft import adapter_budget, adapters, trainable_parameters

    lora_model = built["lora"][0]
    scaled = [m for m in lora_model.modules() if isinstance(getattr(m, "scaling", None), dict)]
    assert len(scaled) == 18 and all(m.scaling["default"] == 1.0 for m in scaled)  # lora_alpha = r
    ada = built["adalora"][0]
    scales = [m.scaling["default"] / float(m.ranknum["default"]) for m in ada.modules()
              if hasattr(m, "ranknum")]
    assert scales and all(s == pytest.approx(1.0) for s in scales)  # AdaLoRA: lora_alpha / init_r
    lora = trainable_parameters(lora_model)[0]
    head = 384 * 5 + 5
    assert lora == 18 * 10 * (384 + 384) + head  # 6 layers × q, k, v at rank 10, and the head
    for method in ("dlrt", "sdlrt", "dlrt-cap2r", "sdlrt-cap2r", "sdlrt-reset", "sdlrt-muon-reset"):
        model, opt, _ = built[method]
        assert all(m.alpha == 1.0 for _, m in adapters(model))
        frozen = [p for n, p in model.named_parameters() if ".base." in n or n.startswith("bert.embeddings")]
        assert frozen and not any(p.requires_grad or opt.state.get(p) for p in frozen)  # held, never stepped
    for method in ("dlrt", "sdlrt", "sdlrt-reset", "sdlrt-muon-reset"):
        model = built[method][0]
        assert adapter_budget(model) == lora - head
        assert trainable_parameters(model)[0] <= lora
    assert {m.rank for _, m in adapters(built["dlrt"][0])} == {9}  # 10·768 budget ≥ 9·768 + 81
    assert {m.rank for _, m in adapters(built["sdlrt"][0])} == {4}  # 2·4·768 + 16 (buffer counted)
    assert {m.rank for _, m in adapters(built["dlrt-cap2r"][0])} == {10}
    reset, muon = built["sdlrt-reset"][1].settings, built["sdlrt-muon-reset"][1].settings
    assert reset.buffer and reset.moments == "reset" and type(reset.rule).__name__ == "Adam"
    assert muon.buffer and muon.moments == "reset" and type(muon.rule).__name__ == "Muon"


def test_adalora_trains_with_peft_s_own_orthogonality_regulariser(built):
    import torch
    import torch.nn.functional as F

    model = built["adalora"][0]
    model.eval()  # (no dropout: one forward gives PEFT's loss and the logits it came from)
    ids = torch.randint(1000, 2000, (2, 16), generator=torch.Generator().manual_seed(0))
    y = torch.tensor([1, 3])
    with torch.no_grad():
        out = model.base_model(input_ids=ids, labels=y)  # AdaLoraModel.forward adds the term
        ours = pc._loss_fn(model, "adalora")(out.logits, y)
        plain = F.cross_entropy(out.logits, y)
    assert float(out.loss - plain) > 0.1  # the regulariser is there and not small at init
    assert float(ours) == pytest.approx(float(out.loss), rel=1e-6)
    assert pc._loss_fn(built["lora"][0], "lora") is F.cross_entropy


# ------------------------------------------------------------------------- the command
def test_peft_command_checks_its_arguments(tmp_path):
    from helpers import one_line_error as _one_line_error

    out = ["--out", tmp_path / "o"]
    msg = _one_line_error(run_cli("peft", "--settings", "25", *out), "peft")
    assert "--select 100 must be one of --settings (25)" in msg
    msg = _one_line_error(run_cli("peft", "--lr", "0.1", *out), "peft")
    assert "leave --optimizer and --lr out" in msg
    msg = _one_line_error(run_cli("peft", "--grid", "adam:0.1", *out), "peft")
    assert "--grid" in msg and "at least two" in msg
    msg = _one_line_error(run_cli("peft", "--grid", "rmsprop:0.1,0.2", *out), "peft")
    assert "families must be from adam, sgd" in msg
    msg = _one_line_error(run_cli("peft", "--select", "none", "--grid", "adam:0.1,0.2", *out), "peft")
    assert "--grid applies to --select" in msg
    msg = _one_line_error(run_cli("peft", "--methods", "lora,lora", *out), "peft")
    assert "twice" in msg
    msg = _one_line_error(run_cli("peft", "--settings", "25", "--select", "25", "--batch-size", "32", *out),
                          "peft")
    assert "--batch-size 32 is larger than the 25 training articles" in msg
    assert not (tmp_path / "o").exists()


def test_peft_command_end_to_end_tiny(tmp_path):
    try:
        pc.model_path()
    except ImportError as e:
        pytest.skip(str(e))
    out = tmp_path / "peft"
    args = ["peft", "--methods", "lora,dlrt", "--settings", "25", "--select", "25", "--seeds", "1",
            "--steps", "2", "--batch-size", "4", "--max-len", "8", "--grid", "adam:0.001,0.01",
            "--widen", "0", "--out", out]
    r = run_cli(*args)
    assert r.exit_code == 0, r
    selection = (out / "selection.md").read_text()
    summary = (out / "summary.md").read_text()
    assert sorted(p.name for p in (out / "runs").iterdir()) == sorted(
        f"{m}_25_adam-lr{lr}_s0.json" for m in ("lora", "dlrt") for lr in ("0.001", "0.01"))
    for method in ("lora", "dlrt"):
        row = re.search(rf"^\| 25 \| {method} \| adam \| (\S+) \| \S+ \| (low|high) \| adam 0.001: \S+, "
                        r"adam 0.01: \S+ \|$", selection, re.M)
        assert row, selection  # a two-value grid: the winner sits at an edge
        lr, edge = row.groups()
        assert re.search(rf"^\| 25 \| 2 \| {method} \| adam {lr} \| on val, 25 s0 \| {edge} \| 1 \| ",
                         summary, re.M), summary
    budgeted = json.loads(next((out / "runs").glob("dlrt_*")).read_text())
    lora = json.loads(next((out / "runs").glob("lora_*")).read_text())
    assert budgeted["trainable_params_max"] <= lora["trainable_params"]  # equal budgets, at every step
    assert budgeted["adapter_budget"] == 18 * 10 * 768 and budgeted["steps"] == 2
    again = run_cli(*args)  # resumed: nothing runs again
    assert again.exit_code == 0 and "2 runs now, 4 in the study" in again.stdout
    r = run_cli(*args[:-4], "--widen", "0", "--max-len", "9", "--out", out)  # other settings, same keys
    assert r.exit_code == 1 and r.stderr.count("\n") == 1
    assert "other settings (max_len 8 there, 9 now)" in r.stderr
