"""The configuration of one training run (:func:`rankwise.experiments.train_run.train`); torch-free, so the
command line can build and check it before importing torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ._checks import check_training, check_unit_interval, is_int
from ._fields import setting
from .methods import COMMANDS

Method = Literal["dense", "dlrt", "sdlrt"]
METHODS: tuple[str, ...] = COMMANDS["train"]  # what each name means: rankwise.methods
FORMAT_VERSION = 1
# with a compression target: the share of the training steps over which the budget falls to it
# (the rest trains at the final ranks)
RAMP_SHARE = 0.9
BUILTIN_MODELS: tuple[str, ...] = ("lenet", "mlp", "vgg")  # rankwise.models registers these


@dataclass(frozen=True)
class TrainConfig:
    """One training run on the digits (1437 train / 360 test images, 10 classes).

    **Arguments:**
    - `method`: ``"dense"`` (``torch.optim.SGD``), ``"dlrt"`` (:class:`rankwise.DLRT`) or
      ``"sdlrt"`` (:class:`rankwise.SDLRT`: the buffer and the τ feedback τ ← ωτ), as
      :mod:`rankwise.methods` defines them; default ``"dlrt"``.
    - `model`: a name in :data:`rankwise.models.MODELS` (``"lenet"``, ``"mlp"``); default
      ``"lenet"``.
    - `tau`: relative truncation tolerance τ in [0, 1) of the low-rank methods; default 0.1.
    - `rank`: initial rank of every low-rank layer (clamped per layer); ``None`` (default)
      starts at full rank and lets the optimizer truncate.
    - `target`: instead of `tau`, the compression to reach (``rankwise.compression``'s ratio),
      by DLRT/SDLRT's global parameter budget over the first ``RAMP_SHARE`` (90 %) of the steps;
      default ``None`` (use `tau`).
    - `tau_min`: SDLRT's floor for its τ feedback (τ ← ωτ whenever a layer's rank is below its
      initial rank), in [0, tau]; default 0, the paper's rule. From a full-rank start the
      feedback fires on every step and τ quickly reaches `tau_min`: start SDLRT from a
      compressed `rank` (as the paper does) or set a floor.
    - `exclude`: module names (or name suffixes) kept dense, e.g. ``("fc2",)``; default none.
    - `epochs`: passes over the training set, ≥ 1; default 10.
    - `lr`: learning rate > 0; default 0.05.
    - `momentum`: SGD momentum in [0, 1); default 0.9 (all three methods).
    - `batch_size`: minibatch size ≥ 1; default 32.
    - `seed`: seeds the model initialisation, the shuffling and the train/test split.
    - `update_every`: DLRT/SDLRT augment and truncate every this many steps (the steps between
      move the cores S and the dense parameters only); default 1.
    - `out`: directory for the run records (created if missing); ``None`` writes nothing.
    - `checkpoint_every`, `checkpoint_dir`: a checkpoint every `checkpoint_every` steps, from
      which a restarted run resumes: one process writes ``checkpoint_dir/checkpoint.pt``;
      data-parallel runs (≥ 4 ranks) a 2-D coded checkpoint (:class:`rankwise.ckpt.CodedCheckpointer`,
      t = 1), each rank's fragment in ``checkpoint_dir/rank<i>`` (node-local), repairing a lost
      rank from its peers. Default: none.
    """

    method: Method = setting("dlrt", help="Training method: dense (SGD), dlrt or sdlrt.")
    model: str = setting("lenet", help="Reference model.")
    tau: float = setting(0.1, help="Relative truncation tolerance τ in [0, 1) of dlrt/sdlrt; default 0.1.")
    target: float | None = setting(None, help="Instead of --tau: the compression to reach (e.g. 0.9 keeps "
                                   "10 % of the parameters), by a global parameter budget.")
    rank: int | None = setting(None, help="Initial rank of every low-rank layer (default: full rank).")
    tau_min: float = setting(0.0, help="SDLRT only: floor of the τ feedback (default 0: the paper's rule).")
    exclude: tuple[str, ...] = ()
    epochs: int = setting(10, help="Passes over the training set.")
    lr: float = setting(0.05, help="Learning rate.")
    momentum: float = setting(0.9, help="SGD momentum in [0, 1).")
    batch_size: int = setting(32, help="Minibatch size.")
    seed: int = setting(0, help="Seed of initialisation, shuffling and split.")
    out: Path | None = setting(None, help="Folder for metrics.csv, TensorBoard events and final.json "
                               "(default: none). An earlier run's records there are replaced only with "
                               "--force.")
    update_every: int = setting(1, help="dlrt/sdlrt: augment and truncate every this many steps (the steps "
                                "between move the cores S and the dense parameters only).")
    checkpoint_every: int | None = setting(None, help="A checkpoint every this many steps, in "
                                           "--checkpoint-dir: one process writes checkpoint.pt; --nproc "
                                           ">= 4, a 2-D coded checkpoint (a lost rank repaired from its "
                                           "peers).")
    checkpoint_dir: Path | None = setting(None, help="Node-local folder for the checkpoints (rank<i>/ per "
                                          "process with --nproc); the same command rerun resumes from the "
                                          "newest checkpoint there.")

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"`method` must be one of {list(METHODS)}; got {self.method!r}")
        if self.model not in BUILTIN_MODELS:  # a user-registered model? (imports torch)
            from .models import MODELS

            if self.model not in MODELS:
                raise ValueError(f"`model` must be one of {sorted(MODELS)}; got {self.model!r}")
        check_unit_interval(self.tau, "tau")
        if self.target is not None:
            if not (isinstance(self.target, int | float) and 0 < self.target < 1):
                raise ValueError(f"`target` must be a compression in (0, 1), e.g. 0.9; got {self.target!r}")
            if self.method == "dense":
                raise ValueError("`target` needs a low-rank method (dlrt or sdlrt); dense compresses nothing")
        if self.rank is not None and (not is_int(self.rank) or self.rank < 1):
            raise ValueError(f"`rank` must be a positive int or None (full rank); got {self.rank!r}")
        if self.rank is not None and self.method == "dense":
            raise ValueError("`rank` needs a low-rank method (dlrt or sdlrt); dense trains full matrices")
        if self.tau_min and self.method != "sdlrt":
            raise ValueError(f"`tau_min` is a floor for SDLRT's τ feedback; method {self.method!r} has none "
                             f"(got {self.tau_min!r})")
        if self.target is not None and self.tau_min:
            raise ValueError(f"`tau_min` is a floor for SDLRT's τ feedback, and a `target` has no τ; got "
                             f"{self.tau_min!r}")
        if self.target is None and not 0.0 <= self.tau_min <= self.tau:
            raise ValueError(f"`tau_min` must be in [0, tau={self.tau}]; got {self.tau_min}")
        if isinstance(self.exclude, str) or not all(isinstance(e, str) for e in self.exclude):
            raise TypeError(f"`exclude` must be a tuple of module names; got {self.exclude!r}")
        check_training(epochs=self.epochs, lr=self.lr, momentum=self.momentum, batch_size=self.batch_size,
                       seed=self.seed)
        if not is_int(self.update_every) or self.update_every < 1:
            raise ValueError(f"`update_every` must be an int >= 1 (steps); got {self.update_every!r}")
        if self.update_every > 1 and self.method == "dense":
            raise ValueError("`update_every` needs a low-rank method (dlrt or sdlrt)")
        if self.out is not None and not isinstance(self.out, Path):
            raise TypeError(f"`out` must be a pathlib.Path or None; got {type(self.out).__name__}")
        if (self.checkpoint_every is None) != (self.checkpoint_dir is None):
            raise ValueError("give `checkpoint_every` and `checkpoint_dir` together (or neither)")
        every, where = self.checkpoint_every, self.checkpoint_dir
        if every is not None and (not is_int(every) or every < 1):
            raise ValueError(f"`checkpoint_every` must be an int >= 1 (steps); got {every!r}")
        if where is not None and not isinstance(where, Path):
            raise TypeError(f"`checkpoint_dir` must be a pathlib.Path; got {type(where).__name__}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """The inverse of :meth:`to_dict`."""
        d = dict(d, exclude=tuple(d.get("exclude", ())))
        for key in ("out", "checkpoint_dir"):
            if d.get(key) is not None:
                d[key] = Path(d[key])
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready plain types (``out`` as a string)."""
        d = dataclasses.asdict(self)
        d["out"] = None if self.out is None else str(self.out)
        d["checkpoint_dir"] = None if self.checkpoint_dir is None else str(self.checkpoint_dir)
        d["exclude"] = list(self.exclude)
        return d
