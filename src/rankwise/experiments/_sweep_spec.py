"""What a sweep run is, without torch: the methods, tasks and τ grid of ``rankwise sweep`` and
:class:`RunSpec` (one run), so that the command line can check its arguments at once."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from .._checks import check_training, check_unit_interval
from ..train_config import RAMP_SHARE

METHODS: dict[str, dict[str, Any] | None] = {
    "dense": None,
    "dlrt": {},
    "sdlrt": {"buffer": True, "feedback": "two-sided"},  # the τ feedback that converges
    "sdlrt-seed": {"buffer": True, "feedback": "seed"},  # the paper's τ ← ωτ
    "sdlrt-buffer": {"buffer": True, "feedback": False},
    "sdlrt-feedback": {"buffer": False, "feedback": True},
    "dlrt-2pass": {"single_pass": False},  # classic two-pass BUG (a second forward/backward)
    # baselines a user might pick instead (need a target): a fixed factorisation at the target's
    # ranks trained by Adam; dense training (SGD), SVD to the target, Adam fine-tuning of the
    # factors. Adam, because plain SGD at the sweep's lr trains factor pairs badly (a one-off
    # trial, LeNet at 90 % at DLRT's final ranks, 3 seeds: 0.66 with SGD at lr 0.05 and
    # momentum 0.9, 0.97 with Adam at lr 3e-3)
    "fixed": {"baseline": "fixed"},
    "dense-svd": {"baseline": "dense-svd"},
}
# what `rankwise sweep` runs unless --methods says otherwise (the SDLRT study)
DEFAULT_METHODS: tuple[str, ...] = ("dense", "dlrt", "sdlrt-seed", "sdlrt", "sdlrt-buffer", "sdlrt-feedback")
# the methods that stay distinct with a compression target (a target replaces SDLRT's τ
# feedback, so sdlrt-seed and sdlrt-buffer would repeat sdlrt, sdlrt-feedback dlrt)
TARGET_METHODS: tuple[str, ...] = ("dense", "dlrt", "dlrt-2pass", "sdlrt", "fixed", "dense-svd")
TARGET_DEFAULT: tuple[str, ...] = ("dense", "dlrt", "sdlrt", "fixed", "dense-svd")  # --targets' study
PAPER_TAUS = (0.1, 0.2, 0.25, 0.3, 0.4)
# 2 (2026-11-30): sdlrt = two-sided feedback (was the seed's), the VGG has batch norm, the
# budget's allocation rule and ramp, baselines trained with Adam
SPEC_VERSION = 2
ALLOCATIONS = ("error-sqrt", "error", "energy", "uniform")  # rankwise.lowrank._budget.RULES (torch-free copy)


# the tasks of rankwise.experiments.sweep.TASKS (same order); those on files need --data-dir
TASK_NAMES: tuple[str, ...] = ("lenet-digits", "vgg-digits16", "mlp-mnist1d", "lenet-mnist", "vgg-cifar10",
                               "vgg-cifar100", "cnn-digits-pretrained")
FILE_TASKS: dict[str, str] = {"lenet-mnist": "mnist", "vgg-cifar10": "cifar10", "vgg-cifar100": "cifar100"}


# learning rates other than `rankwise sweep`'s default 0.05. (The VGG tasks needed 0.02 before
# their VGG had batch norm; with it dense vgg-digits16 reaches 0.993 ± 0.004 at 0.05, 3 seeds.)
# cnn-digits-pretrained fine-tunes pretrained weights: dense (10 epochs, 2 seeds) reached
# 0.993 ± 0.002 at 0.01 against 0.990 ± 0.002 at 0.05
TASK_LR: dict[str, float] = {"cnn-digits-pretrained": 0.01}
# initial ranks of the low-rank layers other than the default 32 (clamped per layer): a
# pretrained model starts at full rank (256 ≥ min(out, in) of each of its layers), so every
# method starts from the pretrained function and the compression target's ramp, not the
# initial truncation, decides what is cut
TASK_RANK: dict[str, int] = {"cnn-digits-pretrained": 256}


@dataclass(frozen=True)
class RunSpec:
    """One run. ``rank``: initial rank of every low-rank layer (clamped per layer); all
    low-rank methods start from the truncated SVD of the same dense initialisation."""

    task: str = "lenet-digits"
    method: str = "sdlrt"
    tau: float = 0.2
    seed: int = 0
    epochs: int = 5
    rank: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    batch_size: int = 64
    omega: float = 0.8
    dt_every: int = 5
    data_dir: str | None = None
    target: float | None = None  # a compression target (global budget) instead of τ
    ramp: float = RAMP_SHARE  # with a target: the share of the training steps over which it is reached
    alloc: str = ALLOCATIONS[0]  # with a target: the budget's allocation rule (rankwise.Budget.allocation)
    factor_lr: float = 3e-3  # fixed, dense-svd: Adam's learning rate for the factors
    # what the settings mean: bumped when a method, task or default changes what it computes, so
    # that a record made before is not resumed as if it were this run (records without one: 1)
    version: int = SPEC_VERSION
    finetune_epochs: int = 2  # dense-svd: epochs of fine-tuning the factors after the SVD

    def __post_init__(self) -> None:
        if self.task not in TASK_NAMES:
            raise ValueError(f"task must be one of {list(TASK_NAMES)}; got {self.task!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}; got {self.method!r}")
        check_unit_interval(self.tau, "tau")
        check_training(epochs=self.epochs, batch_size=self.batch_size, lr=self.lr, momentum=self.momentum,
                       seed=self.seed)
        for name in ("rank", "dt_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if not 0 < self.omega < 1:
            raise ValueError(f"omega must be in (0, 1); got {self.omega}")
        if self.target is not None and not 0 < self.target < 1:
            raise ValueError(f"target must be in (0, 1); got {self.target}")
        if not self.factor_lr > 0:
            raise ValueError(f"factor_lr must be > 0; got {self.factor_lr}")
        if not 0 <= self.ramp <= 1:
            raise ValueError(f"ramp must be in [0, 1]; got {self.ramp}")
        if self.alloc not in ALLOCATIONS:
            raise ValueError(f"alloc must be one of {', '.join(ALLOCATIONS)}; got {self.alloc!r}")
        if self.target is not None and self.method not in TARGET_METHODS:
            raise ValueError(f"method {self.method} differs from another only in its τ feedback, which a "
                             f"target replaces; with targets use {', '.join(TARGET_METHODS)}")
        if (METHODS[self.method] or {}).get("baseline") and self.target is None:
            raise ValueError(f"method {self.method} is a baseline at a compression target: give a target "
                             "(--targets)")
        if self.task in FILE_TASKS and not self.data_dir:
            raise ValueError(f"task {self.task} reads {FILE_TASKS[self.task]} files: give their folder "
                             "(data_dir / --data-dir)")

    def unused(self) -> set[str]:
        """The fields this run's method does not read (changing them changes nothing)."""
        baseline = (METHODS[self.method] or {}).get("baseline")
        out = set()
        if self.method == "dense" or baseline:
            out |= {"tau", "rank", "omega", "ramp", "dt_every"}
        if self.method != "dense-svd":
            out.add("finetune_epochs")
        if not baseline:
            out.add("factor_lr")
        if self.method == "fixed":  # trains the factors with Adam at factor_lr only
            out |= {"lr", "momentum"}
        if self.method == "dense":
            out |= {"target", "alloc"}
        elif self.target is not None:
            out.add("tau")
        else:
            out |= {"ramp", "alloc"}
        if not self.method.startswith("sdlrt") or self.target is not None:  # (a budget has no feedback)
            out.add("omega")
        return out

    def differences(self, other: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """{field: (stored value, this value)} for the fields this run uses where the stored
        spec `other` (a dict, as in a run record) differs from this one; a field the record
        predates counts as its default."""
        mine, unused = asdict(self), self.unused()
        theirs = {f.name: other.get(f.name, 1 if f.name == "version" else f.default) for f in fields(self)}
        return {f.name: (theirs[f.name], mine[f.name]) for f in fields(self)
                if f.name not in unused and theirs[f.name] != mine[f.name]}

    @property
    def key(self) -> str:
        if self.method == "dense":
            return f"{self.task}_{self.method}_s{self.seed}"
        level = f"_target{self.target:g}" if self.target is not None else f"_tau{self.tau:g}"
        return f"{self.task}_{self.method}{level}_s{self.seed}"


def level(spec: dict[str, Any]) -> float | None:
    """What a run's compression was asked with (a run record's spec): its target if it had one,
    else its τ; ``None`` for dense."""
    if spec["method"] == "dense":
        return None
    return spec["tau"] if spec.get("target") is None else spec["target"]
