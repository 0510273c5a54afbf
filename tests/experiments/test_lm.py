"""Byte-level language modelling pieces: tokenizer, BBC split by article, windows, the GPT,
and the training-memory count."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rankwise
from rankwise.data import load_bbc_text, random_windows
from rankwise.data._bytes import ByteTokenizer, sequential_windows
from rankwise.models import gpt


def test_tokenizer_round_trips_text():
    tok = ByteTokenizer()
    for text in ("", "plain ascii", "café – naïve £5 ✓ 日本語", "line\nbreaks\ttabs"):
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("ÿ✓") == [195, 191, 226, 156, 147] and tok.vocab_size == 257  # UTF-8 bytes
    stream = tok.stream(["ab", "ç"])
    assert stream.tolist() == [97, 98, 256, 195, 167, 256]
    assert tok.decode(stream.tolist()) == "ab\nç\n"
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        tok.decode([65, 300])


def test_bbc_split_is_by_article_and_complete():
    d = load_bbc_text()
    a = d.articles
    tr, va, te = (set(a[k]) for k in ("train", "val", "test"))
    assert not (tr & va or tr & te or va & te)
    assert sorted(a["train"] + a["val"] + a["test"]) == list(range(2225))
    texts, _, _ = rankwise.data.load_bbc_news()
    for split in ("train", "val", "test"):
        stream = getattr(d, split)
        expected = sum(len(texts[i].encode("utf-8")) + 1 for i in a[split])
        assert stream.numel() == expected and int((stream == 256).sum()) == len(a[split])
    assert load_bbc_text().articles == a  # deterministic


def test_windows():
    s = torch.arange(103)
    x, y = sequential_windows(s, 10)
    assert x.shape == y.shape == (10, 10)
    torch.testing.assert_close(y, x + 1)
    assert y.flatten().tolist() == list(range(1, 101))  # every target once
    g = torch.Generator().manual_seed(0)
    x, y = random_windows(s, 5, 8, g)
    assert x.shape == (5, 8)
    torch.testing.assert_close(y, x + 1)
    with pytest.raises(ValueError, match="shorter than one window"):
        random_windows(s[:5], 2, 8, g)


def test_gpt_is_causal_and_ties_its_output_to_the_embedding():
    torch.manual_seed(0)
    m = gpt(context=16, width=32, depth=2, heads=4).eval()
    x = torch.randint(0, 257, (2, 16))
    x2 = x.clone()
    x2[:, 9] = (x2[:, 9] + 1) % 257
    with torch.no_grad():
        a, b = m(x), m(x2)
    torch.testing.assert_close(a[:, :9], b[:, :9])  # outputs before the change are unchanged
    assert not torch.allclose(a[:, 9:], b[:, 9:])
    low = rankwise.to_low_rank(m, rank=4)
    names = {n for n, mod in low.named_modules() if isinstance(mod, rankwise.LowRankLinear)}
    projections = ("attn.q", "attn.k", "attn.v", "attn.o", "fc", "proj")
    assert names == {f"blocks.{i}.{p}" for i in range(2) for p in projections}
    with pytest.raises(ValueError, match="longer than the context"):
        m(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="multiple of `heads`"):
        gpt(width=30, heads=4)


def test_gpt_learns_text_well_below_its_unigram_entropy():
    tok = ByteTokenizer()
    s = tok.stream(["The quick brown fox jumps over the lazy dog. Pack my box with five dozen jugs."] * 40)
    p = torch.bincount(s, minlength=257).double() / s.numel()
    unigram = float(-(p[p > 0] * p[p > 0].log2()).sum())
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    m = gpt(context=32, width=64, depth=2, heads=2)
    opt = torch.optim.AdamW(m.parameters(), 3e-3)
    for _ in range(100):
        x, y = random_windows(s, 16, 32, g)
        loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, y = sequential_windows(s, 32)
    with torch.no_grad():
        bits = F.cross_entropy(m(x).flatten(0, 1), y.flatten()).item() / math.log(2)
    assert unigram > 4 and bits < 0.25 * unigram


def test_training_memory_equals_a_hand_count():
    lin = nn.Linear(3, 2)
    opt = torch.optim.Adam(lin.parameters())
    assert rankwise.training_memory(lin, opt) == rankwise.MemoryCount(32, 0, 0, 0)
    lin(torch.randn(4, 3)).sum().backward()
    opt.step()
    # weights and grads: (6 + 2) float32; Adam: two moments of each plus a float32 step per tensor
    assert rankwise.training_memory(lin, opt) == rankwise.MemoryCount(32, 32, 2 * 32 + 2 * 4, 0)

    torch.manual_seed(0)
    layer = rankwise.LowRankLinear(10, 6, 2, bias=False, dtype=torch.float64)
    opt = rankwise.SDLRT(layer, 0.1, tau=0.5, max_rank=2, momentum=0.9)
    x, y = torch.randn(5, 10, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    for _ in range(2):  # the second step finds a buffer from the first
        def closure():
            opt.zero_grad()
            loss = (layer(x) - y).square().sum()
            loss.backward()
            return loss
        opt.step(closure)
    closure()
    r, b = layer.rank, layer.U_buf.shape[1]
    count = rankwise.training_memory(layer, opt)
    assert count.weights == 8 * (10 * r + r * r + 6 * r)
    assert count.grads == 8 * (10 * r + r * r + 6 * r)  # G_L (10, r), S.grad, G_K (6, r)
    assert count.lowrank_buffers == 8 * (10 + 6) * b and b > 0
    moments = sum(st[k].numel() * st[k].element_size() for st in opt.state.values()
                  for k in ("m", "v") if isinstance(st.get(k), torch.Tensor))
    assert count.optimizer == moments > 0


TINY = dict(steps=3, batch=2, context=16, width=32, depth=1, heads=2, eval_every=2, eval_windows=4,
            final_windows=8)


def test_rank_for_is_the_largest_rank_within_the_share():
    from rankwise.experiments.lm.lm_compare import rank_for

    for m, n, c in ((256, 256, 0.5), (1024, 256, 0.75), (64, 64, 0.9), (8, 8, 0.99)):
        keep = (1 - c) * m * n
        brute = max([r for r in range(1, min(m, n) + 1) if r * r + r * (m + n) <= keep], default=1)
        assert rank_for(m, n, c) == brute


@pytest.mark.parametrize("method", ["dense", "dlrt", "sdlrt", "fixed", "galore"])
def test_every_method_trains_and_counts_its_memory(method):
    from rankwise.experiments.lm.lm_compare import LmRunSpec, run_one

    if method == "galore":
        pytest.importorskip("galore_torch", reason="galore-torch (the rankwise[lm] extra) is not installed")
    spec = LmRunSpec(method, 0.0 if method == "dense" else 0.5, **TINY)
    r = run_one(spec)
    assert 3 < r["val_bits"] < 10 and 3 < r["test_bits"] < 10 and len(r["curve"]) == 2
    mem = r["memory"]
    dense_weights = 4 * sum(p.numel() for p in gpt(context=16, width=32, depth=1, heads=2).parameters())
    assert mem["grads"] == mem["weights"]  # counted inside the step: every weight has its gradient
    if method in ("dense", "galore"):
        assert mem["weights"] == dense_weights
    else:  # (DLRT/SDLRT: G_K and G_L are the sizes of U and V)
        assert mem["weights"] < dense_weights and set(r["ranks"]) == set(r["info"]["start_ranks"])
    if method == "galore":  # projected moments: smaller than AdamW's two full moments
        assert 0 < mem["optimizer"] < 2 * dense_weights
    assert (mem["lowrank_buffers"] > 0) == (method == "sdlrt")


def test_study_chooses_on_validation_and_resumes(tmp_path):
    from rankwise.experiments.lm.lm_compare import study, summary_markdown

    res = study(["dense"], [], 2, tmp_path, grid=(1e-3, 1e-2), widen=1, fresh_process=False, **TINY)
    lrs = sorted(r["spec"]["lr"] for r in res.records if r["spec"]["seed"] == 0)
    (lr, edge), = res.chosen.values()
    best = min((r for r in res.records if r["spec"]["seed"] == 0), key=lambda r: r["val_bits"])
    assert lr == best["spec"]["lr"] and len(lrs) == 3  # one edge widening
    assert edge == (lr in (lrs[0], lrs[-1]))
    assert [r["spec"]["lr"] for r in res.records if r["spec"]["seed"] == 1] == [lr]
    assert "| dense |" in summary_markdown(res.records, res.chosen)
    from rankwise.experiments.lm.lm_compare import rates_markdown

    rates = rates_markdown(res.records, res.chosen)
    row = next(line for line in rates.splitlines() if line.startswith("| dense |"))
    assert row.count("|") == 3 + len(lrs) + 1 and f"| {lr:g}" in row  # a cell per rate tried, then the choice
    files = sorted(p.name for p in (tmp_path / "runs").iterdir())
    again = study(["dense"], [], 2, tmp_path, grid=(1e-3, 1e-2), widen=1, fresh_process=False, **TINY)
    assert again.chosen == res.chosen and sorted(p.name for p in (tmp_path / "runs").iterdir()) == files


def test_final_windows_are_evenly_spaced_through_the_split():
    from rankwise.experiments.lm.lm_compare import spaced

    x = torch.arange(100)[:, None].expand(100, 3)
    a, b = spaced(x, x + 1, 5)
    assert a[:, 0].tolist() == [0, 25, 50, 74, 99] and torch.equal(b, a + 1)
    assert torch.equal(spaced(x, x, 500)[0], x)


def test_study_can_choose_at_one_compression_and_reuse_the_rate(tmp_path):
    from rankwise.experiments.lm.lm_compare import study, summary_markdown

    res = study(["fixed"], [0.5, 0.75], 2, tmp_path, grid=(1e-3, 1e-2), widen=0, select_at=0.5,
                fresh_process=False, **TINY)
    at = lambda c, s: sorted(r["spec"]["lr"] for r in res.records  # noqa: E731
                             if r["spec"]["compression"] == c and r["spec"]["seed"] == s)
    lr, _ = res.chosen["fixed", 0.5]
    best = min((r for r in res.records if r["spec"]["compression"] == 0.5 and r["spec"]["seed"] == 0),
               key=lambda r: r["val_bits"])
    assert lr == best["spec"]["lr"] and at(0.5, 0) == [1e-3, 1e-2]
    assert res.chosen["fixed", 0.75] == res.chosen["fixed", 0.5]
    assert at(0.75, 0) == at(0.75, 1) == at(0.5, 1) == [lr]  # 0.75 only at the reused rate, both seeds
    assert f"| fixed | 0.75 | {lr:g} (as at 0.5) | 2 |" in summary_markdown(res.records, res.chosen, 0.5)
    with pytest.raises(ValueError, match="select_at"):
        study(["fixed"], [0.5], 1, tmp_path, select_at=0.75, fresh_process=False, **TINY)


def test_lm_command_refuses_bad_arguments_in_one_line(tmp_path):
    from rankwise.cli import main

    for args, what in ((["--compressions", "0.5,1.5"], "--compressions"), (["--width", "30"], "--heads"),
                       (["--methods", "dense,lora"], "--methods"), (["--grid", "0.1,x"], "--grid"),
                       (["--grid", "0.1,0.1"], "repeat"), (["--grid", "inf"], "inf"),
                       (["--select-at", "0.6"], "--select-at"), (["--schedule", "step"], "--schedule"),
                       (["--warmup", "1"], "--warmup"), (["--clip", "-1"], "--clip"),
                       (["--methods", "dlrt-warm", "--steps", "2", "--warm", "0.1"], "--warm")):
        assert main(["lm", *args, "--out", str(tmp_path / "o")]) == 2, what
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("method", ["dense", "dlrt"])
def test_a_diverging_rate_is_recorded_as_infinite_loss(method):
    from rankwise.experiments.lm.lm_compare import LmRunSpec, run_one

    r = run_one(LmRunSpec(method, 0.0 if method == "dense" else 0.5, lr=1e12, **{**TINY, "steps": 6}))
    assert r["val_bits"] == r["test_bits"] == float("inf")
    assert (r["failed"] is not None) == (method == "dlrt")


def test_the_schedule_warms_up_linearly_then_decays_by_a_cosine():
    from rankwise.experiments.lm.lm_compare import LmRunSpec

    spec = LmRunSpec("dense", steps=10, warmup=0.2, final_lr=0.1)
    f = [spec.lr_factor(s) for s in range(10)]
    assert f[:2] == [0.5, 1.0]
    for s in range(2, 10):  # t = (s − 2)/8 from 0 to 7/8
        want = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 8))
        assert abs(f[s] - want) < 1e-15
    assert spec.lr_factor(10) == pytest.approx(0.1)
    assert LmRunSpec("dense", schedule="constant").lr_factor(3) == 1.0
    for bad in (dict(schedule="linear"), dict(warmup=1.0), dict(final_lr=1.5), dict(clip=-1.0)):
        with pytest.raises(ValueError):
            LmRunSpec("dense", **bad)
    with pytest.raises(ValueError, match="dense for"):
        LmRunSpec("dlrt-warm", 0.5, steps=3, warm=0.1)


@pytest.mark.parametrize("method", ["dense", "dlrt"])
def test_clipping_reaches_every_method(method):
    """Clipped at a norm of 1e-12, Adam's steps are ~lr·1e-4 (eps dominates √v): the validation
    loss stays at the untrained model's within 1e-4 bits (unclipped, the same steps lower it)."""
    from rankwise.experiments.lm.lm_compare import LmRunSpec, run_one

    c = 0.0 if method == "dense" else 0.5
    kw = {**TINY, "steps": 8, "schedule": "constant"}
    clipped = run_one(LmRunSpec(method, c, lr=0.01, clip=1e-12, **kw))
    free = run_one(LmRunSpec(method, c, lr=0.01, **kw))
    start = clipped["curve"][0][1]
    assert abs(clipped["val_bits"] - run_one(LmRunSpec(method, c, lr=1e-12, **kw))["val_bits"]) < 1e-4
    assert free["val_bits"] < clipped["val_bits"] - 0.05 and start > 0


@pytest.mark.parametrize("method", ["dlrt-fixedrank", "dlrt-uniform", "dlrt-reset", "dlrt-warm",
                                    "fixed-warm", "dlrt-core3"])
def test_every_ablation_trains(method):
    from rankwise.experiments.lm.lm_compare import LmRunSpec, run_one

    r = run_one(LmRunSpec(method, 0.5, **{**TINY, "steps": 6, "warm": 0.5}))
    assert 3 < r["val_bits"] < 10
    assert set(r["ranks"]) == set(r["info"]["start_ranks"])  # every projection factored at the end
    dense_weights = 4 * sum(p.numel() for p in gpt(context=16, width=32, depth=1, heads=2).parameters())
    if method.endswith("-warm"):  # the dense phase is the peak; the end holds the factors
        assert r["memory"]["weights"] == dense_weights > r["memory_end"]["weights"]
    if method == "dlrt-fixedrank":
        assert r["ranks"] == r["info"]["start_ranks"]


def test_the_command_knows_every_method():
    from rankwise.cli._lm import METHODS as COMMAND
    from rankwise.experiments.lm.lm_compare import METHODS

    assert COMMAND == METHODS


def test_spectra_analysis_compares_allocations_at_equal_parameters():
    """The allocation spends no more than the uniform ranks' parameters; a projection of exact
    rank 2 gets no more than rank 2 and no error; the energy-weighted error equals one computed
    from the truncated weights themselves."""
    from rankwise.experiments.lm.lm_spectra import analyse

    torch.manual_seed(0)
    model = gpt(context=16, width=32, depth=1, heads=2)
    q = next(m for n, m in model.named_modules() if n.endswith("q"))
    with torch.no_grad():
        q.weight.copy_(torch.randn(32, 2) @ torch.randn(2, 32))
    res = analyse(model, 0.5, rule="error")
    assert res["used"] <= res["budget"]
    row = next(r for n, r in res["rows"].items() if n.endswith("q"))
    assert row["allocated"] <= 2 < row["uniform"] and row["err_allocated"] < 1e-6
    err = total = 0.0
    for n, m in model.named_modules():
        if n in res["rows"]:
            W = m.weight.detach().double()
            U, s, Vh = torch.linalg.svd(W)
            r = res["rows"][n]["uniform"]
            err += float((W - U[:, :r] @ torch.diag(s[:r]) @ Vh[:r]).square().sum())
            total += float(W.square().sum())
    assert abs(res["total_uniform"] - (err / total) ** 0.5) < 1e-9
