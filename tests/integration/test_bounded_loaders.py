"""Loaders and state that trust too much (issue 56, round 2): every read of a user-given file is
bounded, regular-file-only and inside its folder; a saved optimizer state is checked before it
is loaded; the write-protected weight view refuses in-place functionals; the data-parallel
replica check sees sign flips and names the rank that differs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from helpers import mse_closure
from rankwise import SDLRT
from rankwise.nn import LowRankLinear

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- optimizer state
def _trained():
    torch.manual_seed(0)
    model = nn.Sequential(LowRankLinear(8, 6, 2), nn.ReLU(), nn.Linear(6, 3))
    opt = SDLRT(model, 0.05, tau=0.3, optimizer="adam")
    closure = mse_closure(opt, model, torch.randn(10, 8), torch.randn(10, 3))
    opt.step(closure)
    return model, opt, closure


def _spoiled(sd: dict, index: int, key: str, value) -> dict:
    sd = copy.deepcopy(sd)
    sd["state"][index][key] = value
    return sd


@pytest.mark.parametrize(("index", "key", "value", "match"), [
    (0, "m", lambda t: t[:, 0].clone(), r"layer '0' has K moment 'm' of shape \(6,\) where its param"),
    (2, "v", lambda t: t[None].clone(), r"layer '0' has L moment 'v' of shape \(1, 8, 2\) where"),
    (1, "tau", lambda t: float("nan"), r"layer '0' has 'tau' = nan, not a number in \[0, 1\)"),
    (1, "tau", lambda t: 1.5, r"layer '0' has 'tau' = 1.5"),
    (1, "r_init", lambda t: -1, r"layer '0' has 'r_init' = -1, not a whole number"),
    (0, "step", lambda t: float("nan"), r"layer '0' has 'step' = nan"),
    (3, "step", lambda t: torch.tensor(float("nan")), r"parameter 3 has 'step' = nan"),
    (4, "m", lambda t: t.T.clone(), r"parameter 4 has moment 'm' of shape \(6, 3\) where its param"),
    (0, "v", lambda t: "zeros", r"K moment 'v' a str, not a floating-point tensor"),
])
def test_optimizer_state_that_no_optimizer_wrote_is_refused_naming_layer_and_key(index, key, value, match):
    model, opt, closure = _trained()
    sd = opt.state_dict()
    bad = _spoiled(sd, index, key, value(sd["state"][index].get(key)))
    fresh = SDLRT(model, 0.05, tau=0.3, optimizer="adam")
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(bad)
    fresh.load_state_dict(sd)  # the state as saved still loads, and trains on
    fresh.step(closure)


# --------------------------------------------------------------------------- from_pretrained's files
transformers = pytest.importorskip("transformers")  # the rankwise[peft] extra; make test installs it
transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny converted GPT-2 saved with save_pretrained (one block), an input, and the model."""
    import warnings

    from rankwise.nn import to_low_rank

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied lm_head left dense
        to_low_rank(model, rank=4)
    model.generation_config.max_length = 7  # beside the weights: generation_config.json
    folder = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(folder)
    x = torch.randint(0, 32, (1, 5))
    return folder, x, model


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _load(folder):
    from rankwise.nn import from_pretrained

    return from_pretrained(transformers.GPT2LMHeadModel, folder)


def _sharded(folder, shard_name, tmp_path):
    """`folder` as a sharded save whose index names `shard_name` for every tensor."""
    import json

    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map":
                                                                     dict.fromkeys(keys, shard_name)}))
    (folder / "model.safetensors").rename(tmp_path / "moved.safetensors")
    return tmp_path / "moved.safetensors"


def test_a_fifo_named_in_the_index_is_refused_not_waited_on(saved, tmp_path):
    import os

    folder = _copy(saved[0], tmp_path / "m")
    _sharded(folder, "model-00001.safetensors", tmp_path)
    os.mkfifo(folder / "model-00001.safetensors")
    with pytest.raises(ValueError, match=r"model-00001\.safetensors is a FIFO, not a regular file"):
        _load(folder)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "link"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(saved, tmp_path, how):
    folder = _copy(saved[0], tmp_path / "m")
    (tmp_path / "elsewhere").mkdir()
    outside = tmp_path / "elsewhere" / "x.safetensors"
    name = {"dotdot": "../elsewhere/x.safetensors", "absolute": str(outside), "link": "x.safetensors"}[how]
    _sharded(folder, name, tmp_path).rename(outside)  # a good file, but outside
    if how == "link":
        (folder / "x.safetensors").symlink_to(outside)
    match = r"is a link to .* outside the folder" if how == "link" else r"is not a file name inside"
    with pytest.raises(ValueError, match=match):
        _load(folder)


def test_a_link_inside_the_folder_and_a_sharded_save_still_load(saved, tmp_path):
    folder = _copy(saved[0], tmp_path / "m")
    (folder / "sub").mkdir()
    _sharded(folder, "model-00001.safetensors", tmp_path).rename(folder / "sub" / "real.safetensors")
    (folder / "model-00001.safetensors").symlink_to("sub/real.safetensors")
    torch.testing.assert_close(_load(folder)(saved[1]).logits, saved[2](saved[1]).logits, rtol=0, atol=0)


@pytest.mark.parametrize("how", ["huge", "nested"])
def test_an_oversized_or_deeply_nested_index_is_refused_in_one_line(saved, tmp_path, how):
    folder = _copy(saved[0], tmp_path / "m")
    _sharded(folder, "model-00001.safetensors", tmp_path)
    index = folder / "model.safetensors.index.json"
    if how == "huge":
        with open(index, "wb") as f:
            f.truncate(256 << 20)  # sparse: nothing is written
        match = r"is 268,435,456 bytes, more than the 16,777,216 it can hold"
    else:
        index.write_text("[" * (1 << 20))
        match = r"nested too deep"
    with pytest.raises(ValueError, match=match):
        _load(folder)


def _rewrite(folder, change):
    """Rewrite `folder`'s model.safetensors with `change` applied to its tensors (a dict)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    change(state)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_zero_byte_factors_declaring_a_huge_rank_are_refused_before_allocating(saved, tmp_path):
    folder = _copy(saved[0], tmp_path / "m")
    layer = "transformer.h.0.mlp.c_fc"  # 64 × 16

    def huge(state):
        state[f"{layer}.S"] = torch.empty(2**31, 0)  # zero bytes, rank 2^31
        state[f"{layer}.U"] = torch.empty(64, 0)
        state[f"{layer}.V"] = torch.empty(16, 0)
    _rewrite(folder, huge)
    with pytest.raises(ValueError, match=rf"layer '{layer}' \(64×16\) has saved factors U \(64, 0\), "
                                         r"S \(2147483648, 0\).*1 <= r <= 16"):
        _load(folder)


def test_sdlrt_buffers_of_two_widths_are_refused(saved, tmp_path):
    folder = _copy(saved[0], tmp_path / "m")
    layer = "transformer.h.0.mlp.c_fc"

    def widths(state):
        state[f"{layer}.U_buf"], state[f"{layer}.V_buf"] = torch.zeros(64, 2), torch.zeros(16, 3)
    _rewrite(folder, widths)
    with pytest.raises(ValueError, match=r"U_buf' \(64, 2\) and .*V_buf' \(16, 3\) must be \(out, b\) and"):
        _load(folder)


def test_a_safetensors_header_declaring_more_bytes_than_it_holds_is_refused(saved, tmp_path):
    import json
    import struct

    folder = _copy(saved[0], tmp_path / "m")
    header = json.dumps({"transformer.h.0.mlp.c_fc.S": {"dtype": "F32", "shape": [1 << 20, 1 << 20],
                                                        "data_offsets": [0, 16]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(ValueError, match=r"declares shape \(1048576, 1048576\) \(4,398,046,511,104 bytes\) "
                                         r"but holds 16 bytes"):
        _load(folder)


def test_a_config_with_a_huge_vocabulary_is_compared_before_anything_is_built(saved, tmp_path):
    import json

    folder = _copy(saved[0], tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["vocab_size"] = 2**27  # an 8 GiB embedding at 16 features
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'transformer.wte.weight' is saved with shape \(32, 16\) but the "
                                         r"model its config builds has \(134217728, 16\)"):
        _load(folder)


def test_from_pretrained_restores_what_hf_restores_beside_the_weights(saved):
    folder, x, model = saved
    again = _load(folder)
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder)  # what HF's own loader restores
    assert again.generation_config.max_length == hf.generation_config.max_length == 7
    assert again.name_or_path == again.config.name_or_path == hf.name_or_path == str(folder)
    assert not again.training and not hf.training
    assert again.lm_head.weight is again.transformer.wte.weight
    torch.testing.assert_close(again(x).logits, model(x).logits, rtol=0, atol=0)


def test_from_pretrained_runs_no_svd_and_initialises_only_meta_tensors(saved, monkeypatch):
    def meta_only(fn, what):  # (a layer built on meta runs its constructor's SVD on meta: free)
        def run(t, *a, **k):
            assert t.is_meta, f"{what} ran on a real tensor while loading"
            return fn(t, *a, **k)
        return run

    monkeypatch.setattr(torch.linalg, "svd", meta_only(torch.linalg.svd, "an SVD"))
    monkeypatch.setattr(torch.linalg, "svdvals", meta_only(torch.linalg.svdvals, "an SVD"))
    monkeypatch.setattr(torch.nn.init, "normal_", meta_only(torch.nn.init.normal_, "an initialisation"))
    folder, x, model = saved
    expected = model(x).logits
    torch.testing.assert_close(_load(folder)(x).logits, expected, rtol=0, atol=0)


# --------------------------------------------------------------------------- the weight view
@pytest.mark.parametrize("call", [
    lambda F, w: F.relu(w, inplace=True),
    lambda F, w: F.leaky_relu(w, 0.1, inplace=True),
    lambda F, w: F.dropout(w, 0.5, training=True, inplace=True),
    lambda F, w: F.hardtanh(w, inplace=True),
    lambda F, w: F.hardtanh_(w),
    lambda F, w: F.elu_(w),
    lambda F, w: F.threshold(w, 0.0, 1.0, inplace=True),
    lambda F, w: F.silu(w, inplace=True),
])
def test_inplace_functionals_on_the_weight_view_are_refused(call):
    import torch.nn.functional as F

    layer = LowRankLinear(6, 5, 2)
    before = layer.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"computed on every read, so writing into it .* would be lost"):
        call(F, layer.weight)
    torch.testing.assert_close(layer.weight.detach(), before, rtol=0, atol=0)
    assert torch.equal(F.relu(layer.weight), before.relu())  # out of place: as on a plain tensor


# --------------------------------------------------------------------------- the replica check
def test_the_replica_fingerprint_sees_sign_flipped_singular_pairs():
    """Flipping the signs of an even number of singular pairs (u_i, v_i → −u_i, −v_i) leaves the
    layer's function as it is but not its factors: the replicas differ. Each flipped float64
    moves its word by 2^63, so a weighted sum of words cancels in pairs; the mixed sum does not."""
    from rankwise.optim.parallel._dp import device_fingerprints

    torch.manual_seed(0)
    U, S, V = torch.randn(6, 4, dtype=torch.float64), torch.diag(torch.rand(4, dtype=torch.float64)), \
        torch.randn(5, 4, dtype=torch.float64)
    ref = device_fingerprints([[U, S, V]], U.device)
    for flipped in ([0, 1], [0, 1, 2, 3], [1]):
        sign = torch.ones(4, dtype=torch.float64)
        sign[flipped] = -1
        got = device_fingerprints([[U * sign, S, V * sign]], U.device)
        assert got != ref, flipped
    x = torch.zeros(4, dtype=torch.float64)  # two entries' words swapped: seen too
    x[0], x[1] = 1.0, 2.0
    assert device_fingerprints([[x]], x.device) != device_fingerprints([[x[[1, 0, 2, 3]]]], x.device)


@pytest.mark.parametrize(("rows", "match"), [
    ([[1, 2], [9, 2], [1, 2]], r"rank 1 holds other factors than the other 2 ranks in layer 'a'"),
    ([[9, 2], [1, 2], [1, 2]], r"rank 0 holds other factors than the other 2 ranks in layer 'a'"),
    ([[1, 2], [1, 9]], r"ranks 0 / 1 hold different factors \(no majority tells which drifted\) in layer"),
    ([[1, 2], [1, 2], [1, 9], [1, 9]], r"ranks 0, 1 / 2, 3 hold different factors"),
])
def test_a_diverged_replica_is_the_one_the_majority_disowns(rows, match):
    from rankwise.optim.parallel._dp import PendingCheck

    check = PendingCheck(["a", "b"], torch.tensor(rows), "at step 3")
    with pytest.raises(RuntimeError, match=r"replicas diverged at step 3: " + match):
        check.raise_if_diverged(None)
    PendingCheck(["a", "b"], torch.tensor([rows[0]] * 3), "at step 3").raise_if_diverged(None)  # all agree


# --------------------------------------------------------------------------- what peers send
def test_plain_data_between_ranks_round_trips_without_pickle():
    from rankwise.optim.parallel._shard import decode, encode

    value = {"a": ("__tensor__", 0, (3, 2), "float32"), 3: [1.5, float("inf"), None, True, "x"],
             "s": {"spectra": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
                   "empty": torch.empty(0, 4)},
             "flags": torch.tensor([True, False]), "z": torch.tensor([1 + 2j])}
    back = decode(encode(value))
    assert back.keys() == value.keys() and back["a"] == value["a"] and isinstance(back["a"][2], tuple)
    assert back[3][:1] == [1.5] and back[3][2:] == [None, True, "x"]
    for k in ("spectra", "empty"):
        assert torch.equal(back["s"][k], value["s"][k]) and back["s"][k].dtype == value["s"][k].dtype
    assert torch.equal(back["flags"], value["flags"]) and torch.equal(back["z"], value["z"])
    with pytest.raises(TypeError, match="cannot send a object"):
        encode({"x": object()})


@pytest.mark.parametrize("payload", [
    b"\x80\x04\x95",  # a pickle's opening: never unpickled
    (6).to_bytes(8, "little") + b'{"v":1',  # a header past the end
    (20).to_bytes(8, "little") + b'{"v":1,"t":[["f",[]]]}',
    (5).to_bytes(8, "little") + b"[" * 5,
])
def test_a_peers_malformed_message_is_refused_naming_it(payload):
    from rankwise.optim.parallel._shard import decode

    with pytest.raises(ValueError, match=r"rank 3 sent a message that is not rankwise's exchange format"):
        decode(payload, "rank 3")


def test_data_parallel_exchanges_unpickle_nothing(tmp_path, monkeypatch):
    """A sharded, budgeted DLRT in a one-rank gloo group: construction, the owners' share and the
    budget's gathered spectra travel as tensors (the pickling collectives are never called)."""
    import torch.distributed as dist

    import rankwise

    def pickled(*a, **k):
        raise AssertionError("a pickling collective was called")

    for fn in ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"):
        monkeypatch.setattr(dist, fn, pickled)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(LowRankLinear(8, 6, 3), nn.ReLU(), LowRankLinear(6, 4, 3))
        opt = rankwise.DLRT(model, 0.1, target=0.5, process_group=dist.group.WORLD, data_parallel="sharded")
        X, Y = torch.randn(16, 8), torch.randn(16, 4)
        for _ in range(2):
            opt.zero_grad()
            ((model(X) - Y) ** 2).mean().backward()
            opt.step()
        assert opt.owners() == {"0": 0, "2": 0}
    finally:
        dist.destroy_process_group()
