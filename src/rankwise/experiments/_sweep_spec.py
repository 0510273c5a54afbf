"""What a sweep run is, without torch: the methods, tasks and τ grid of ``rankwise sweep`` and
:class:`RunSpec` (one run), so that the command line can check its arguments at once."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from .._checks import check_training, check_unit_interval
from ..methods import COMMANDS, REGISTRY
from ..train_config import RAMP_SHARE

# the methods this command offers; what each name means: rankwise.methods. Its baselines:
# "fixed", a fixed factorisation at the target's ranks trained by the run's optimizer, and
# "dense-svd", dense training, the SVD to the target and fine-tuning of the factors. The *-warm
# methods train dense for `warm_epochs`, then run the integrator from full rank with the budget
# falling to the target over the rest (what dense-svd does in one cut).
METHODS: tuple[str, ...] = COMMANDS["sweep"]
# what `rankwise sweep` runs unless --methods says otherwise (the SDLRT study)
DEFAULT_METHODS: tuple[str, ...] = ("dense", "dlrt", "sdlrt", "sdlrt-two-sided", "sdlrt-buffer",
                                    "sdlrt-feedback")
# the methods that stay distinct with a compression target (a target replaces SDLRT's τ
# feedback, so sdlrt-two-sided and sdlrt-buffer would repeat sdlrt, sdlrt-feedback dlrt)
TARGET_METHODS: tuple[str, ...] = ("dense", "dlrt", "dlrt-2pass", "sdlrt", "fixed", "dense-svd", "dlrt-warm",
                                   "sdlrt-warm", "dlrt-reset", "dlrt-muon", "dlrt-muon-reset", "dlrt-reset-m",
                                   "dlrt-reset-v", "sdlrt-reset", "sdlrt-muon-reset")
TARGET_DEFAULT: tuple[str, ...] = ("dense", "dlrt", "sdlrt", "fixed", "dense-svd")  # --targets' study
PAPER_TAUS = (0.1, 0.2, 0.25, 0.3, 0.4)
# what a record's `version` says its settings meant: 2, the sweep's sdlrt was the two-sided
# feedback, the VGG has batch norm, the budget has an allocation rule and a ramp, baselines
# train with Adam; 3, a validation split, `optimizer` and `lr` for every method, dense-svd's
# fine-tuning inside `epochs`; 4, the names of rankwise.methods (sdlrt: the seed feedback;
# the two-sided one is sdlrt-two-sided)
SPEC_VERSION = 4
# rankwise.nn.ALLOCATION_RULES (a torch-free copy); "sensitivity" only while training
ALLOCATIONS = ("error-sqrt", "error", "energy", "uniform", "sensitivity")
OPTIMIZERS = ("sgd", "adam")  # SGD with `momentum`, or Adam


# the tasks of rankwise.experiments.sweep.TASKS (same order); those on files need --data-dir
TASK_NAMES: tuple[str, ...] = ("lenet-digits", "vgg-digits16", "mlp-mnist1d", "lenet-mnist", "vgg-cifar10",
                               "vgg-cifar100", "cnn-digits-pretrained", "mlp-digits")
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
    low-rank methods start from the truncated SVD of the same dense initialisation.
    ``optimizer`` / ``lr`` / ``momentum`` train every method (a baseline's factors, DLRT's K, L,
    S); ``val``: the share of the training split held out for validation (stratified, by the
    run's seed; the test split is never touched). With a target: ``alloc``, ``floor`` and
    ``freeze`` are the budget's allocation rule, rank floor and end phase at frozen ranks
    (:class:`rankwise.Budget`); ``warm_epochs``: the dense epochs of the ``*-warm`` methods;
    ``finetune_epochs``: dense-svd's fine-tuning epochs, inside ``epochs``. ``dt_every`` 0: no
    dense shadow (and no d_t)."""

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
    # what the settings mean: bumped when a method, task or default changes what it computes, so
    # that a record made before is not resumed as if it were this run (records without one: 1)
    version: int = SPEC_VERSION
    finetune_epochs: int = 2  # dense-svd: epochs of fine-tuning the factors after the SVD
    optimizer: str = "sgd"
    val: float = 0.15
    floor: float = 0.0
    freeze: bool = False
    warm_epochs: int = 2

    def __post_init__(self) -> None:
        if self.task not in TASK_NAMES:
            raise ValueError(f"task must be one of {list(TASK_NAMES)}; got {self.task!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}; got {self.method!r}")
        check_unit_interval(self.tau, "tau")
        check_training(epochs=self.epochs, batch_size=self.batch_size, lr=self.lr, momentum=self.momentum,
                       seed=self.seed)
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1; got {self.rank}")
        if self.dt_every < 0:
            raise ValueError(f"dt_every must be >= 0 (0: no dense shadow); got {self.dt_every}")
        if not 0 < self.omega < 1:
            raise ValueError(f"omega must be in (0, 1); got {self.omega}")
        if self.target is not None and not 0 < self.target < 1:
            raise ValueError(f"target must be in (0, 1); got {self.target}")
        if not 0 <= self.ramp <= 1:
            raise ValueError(f"ramp must be in [0, 1]; got {self.ramp}")
        if self.alloc not in ALLOCATIONS:
            raise ValueError(f"alloc must be one of {', '.join(ALLOCATIONS)}; got {self.alloc!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {self.optimizer!r}")
        if not 0 <= self.val < 1:
            raise ValueError(f"val must be in [0, 1) (the share of the training split held out); "
                             f"got {self.val}")
        if not 0 <= self.floor <= 1:
            raise ValueError(f"floor must be in [0, 1]; got {self.floor}")
        method, baseline = REGISTRY[self.method], _compressing_baseline(self.method)
        if self.target is not None and self.method not in TARGET_METHODS:
            raise ValueError(f"method {self.method} differs from another only in its τ feedback, which a "
                             f"target replaces; with targets use {', '.join(TARGET_METHODS)}")
        if (baseline or method.warm) and self.target is None:
            raise ValueError(f"method {self.method} trains to a compression target: give a target "
                             "(--targets)")
        if self.target is not None and self.alloc == "sensitivity" and baseline:
            raise ValueError(f"method {self.method} allocates its ranks once, before training, where no "
                             "loss gradient exists: alloc 'sensitivity' needs a training method")
        if self.method == "dense-svd" and not 1 <= self.finetune_epochs < self.epochs:
            raise ValueError(f"dense-svd fine-tunes inside `epochs` ({self.epochs}): finetune_epochs must be "
                             f"in [1, epochs); got {self.finetune_epochs}")
        if method.warm and not 1 <= self.warm_epochs < self.epochs:
            raise ValueError(f"{self.method} trains dense for warm_epochs inside `epochs` ({self.epochs}): "
                             f"warm_epochs must be in [1, epochs); got {self.warm_epochs}")
        if self.task in FILE_TASKS and not self.data_dir:
            raise ValueError(f"task {self.task} reads {FILE_TASKS[self.task]} files: give their folder "
                             "(data_dir / --data-dir)")

    def unused(self) -> set[str]:
        """The fields this run's method does not read (changing them changes nothing)."""
        method, baseline = REGISTRY[self.method], _compressing_baseline(self.method)
        out = set()
        if self.method == "dense" or baseline:
            out |= {"tau", "rank", "omega", "ramp", "dt_every"}
        if self.method != "dense-svd":
            out.add("finetune_epochs")
        if not method.warm:
            out.add("warm_epochs")
        if self.optimizer != "sgd":
            out.add("momentum")
        if self.method == "dense":
            out |= {"target", "alloc", "floor", "freeze"}
        elif self.target is not None:
            out.add("tau")
        else:
            out |= {"ramp", "alloc", "floor", "freeze"}
        if baseline:
            out |= {"floor", "freeze"}
        if method.feedback is None or self.target is not None:  # (a budget has no feedback)
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
    def label(self) -> str:
        """The method with its budget variant, e.g. ``dlrt``, ``fixed-uniform``,
        ``dlrt-sensitivity-floor0.5-freeze``: what a summary row compares."""
        return label(asdict(self))

    @property
    def key(self) -> str:
        opt = f"_{self.optimizer}-lr{self.lr:g}"
        if self.method == "dense":
            return f"{self.task}_{self.method}{opt}_s{self.seed}"
        level = f"_target{self.target:g}" if self.target is not None else f"_tau{self.tau:g}"
        return f"{self.task}_{self.label}{level}{opt}_s{self.seed}"


def _compressing_baseline(method: str) -> bool:
    """Is `method` a baseline that compresses to a target (fixed, dense-svd; not dense)?"""
    return REGISTRY[method].baseline and method != "dense"


def label(spec: dict[str, Any]) -> str:
    """:attr:`RunSpec.label` of a run record's spec."""
    out = spec["method"]
    if spec["method"] == "dense" or spec.get("target") is None:
        return out
    if spec.get("alloc", ALLOCATIONS[0]) != ALLOCATIONS[0]:
        out += f"-{spec['alloc']}"
    if spec.get("floor", 0.0) and not _compressing_baseline(spec["method"]):
        out += f"-floor{spec['floor']:g}"
    if spec.get("freeze") and not _compressing_baseline(spec["method"]):
        out += "-freeze"
    return out


def level(spec: dict[str, Any]) -> float | None:
    """What a run's compression was asked with (a run record's spec): its target if it had one,
    else its τ; ``None`` for dense."""
    if spec["method"] == "dense":
        return None
    return spec["tau"] if spec.get("target") is None else spec["target"]
