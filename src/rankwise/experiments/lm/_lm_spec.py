"""The settings of one `rankwise lm` run (:class:`LmRunSpec`) and the methods' names; torch-free,
so that the command line takes its options and checks from them before importing torch."""

from __future__ import annotations

import dataclasses
import math

from ..._fields import setting
from ...methods import COMMANDS, REGISTRY

METHODS = COMMANDS["lm"]  # what each name means: rankwise.methods
ABLATIONS = METHODS[METHODS.index("dlrt-fixedrank"):]  # the variants of the ablation table (docs/lm.md)
DENSE = ("dense", "muon")  # the methods that train the dense model (no compression)
LOWRANK = tuple(m for m in METHODS if m not in DENSE)  # the methods that take a compression
SCHEDULES = ("cosine", "constant")
MODELS = ("gpt", "llama")
GRID = (1e-3, 3e-3, 1e-2)  # the default learning rates to choose from on validation
ADAM = {"eps": 1e-8, "weight_decay": 0.0}  # the same Adam for every method (no decay: DLRT's rule has none)
VERSION = 2  # 2: schedule, clip, warm


@dataclasses.dataclass(frozen=True)
class LmRunSpec:
    """One training run. ``compression`` is 0 for ``dense``."""

    method: str
    compression: float = 0.0
    lr: float = 3e-3
    seed: int = 0
    steps: int = setting(600, help="Optimizer steps per run.")
    batch: int = setting(16, flag="--batch-size", help="Windows per step.")
    context: int = setting(128, help="Tokens per window.")
    width: int = setting(256, help="Model width.")
    depth: int = setting(4, help="Transformer blocks.")
    heads: int = setting(4, help="Attention heads (divides the width).")
    eval_every: int = 50
    eval_windows: int = 64  # validation windows for the curve
    final_windows: int = setting(0, help="Windows of validation and of test for the final losses (0: every "
                                         "window).")
    schedule: str = setting("cosine", help="Learning-rate schedule for every method: cosine (linear "
                                           "warm-up, then cosine decay) or constant.")
    warmup: float = setting(0.1, help="Share of the steps in the warm-up (cosine).")
    final_lr: float = setting(0.1, help="The cosine ends at this share of the rate.")
    clip: float = setting(0.0, help="Clip every method's gradient norm at this value (0: no clipping; "
                                    "DLRT/SDLRT: the norm of what the integrator reads).")
    warm: float = setting(0.2, help="Share of the steps the *-warm methods train dense.")
    model: str = setting("gpt", help="The model: gpt (GPT-2 style: LayerNorm, learned positions, GELU MLP, "
                                     "tied head) or llama (RMSNorm, rotary positions, SwiGLU MLP, untied "
                                     "head, left dense).")
    version: int = VERSION

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"`method` must be one of {', '.join(METHODS)}; got {self.method!r}")
        if self.method in DENSE and self.compression != 0:
            raise ValueError(f"the {self.method} method trains the dense model: it takes no compression")
        if self.method not in DENSE and not 0 < self.compression < 1:
            raise ValueError(f"`compression` must be in (0, 1) for {self.method}; got {self.compression!r}")
        f = self.final_windows
        if isinstance(f, bool) or not isinstance(f, int) or f < 0:
            raise ValueError(f"`final_windows` must be an int >= 0; got {self.final_windows!r}")
        for name in ("steps", "batch", "context", "width", "depth", "heads", "eval_every", "eval_windows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"`{name}` must be a positive int; got {v!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"`lr` must be a positive number; got {self.lr!r}")
        if self.model not in MODELS:
            raise ValueError(f"`model` must be one of {', '.join(MODELS)}; got {self.model!r}")
        if self.model == "llama" and self.heads and (self.width // self.heads) % 2:
            raise ValueError(f"`model` llama turns pairs of coordinates (rotary positions): the head size "
                             f"`width` / `heads` = {self.width}/{self.heads} must be even")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"`schedule` must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}")
        for name in ("warmup", "warm"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and 0 <= v < 1):
                raise ValueError(f"`{name}` must be in [0, 1); got {v!r}")
        if not (isinstance(self.final_lr, int | float) and 0 <= self.final_lr <= 1):
            raise ValueError(f"`final_lr` must be in [0, 1]; got {self.final_lr!r}")
        if not (isinstance(self.clip, int | float) and math.isfinite(self.clip) and self.clip >= 0):
            raise ValueError(f"`clip` must be a number >= 0 (0: no clipping); got {self.clip!r}")
        if REGISTRY[self.method].warm and not 1 <= round(self.warm * self.steps) < self.steps:
            raise ValueError(f"{self.method} trains dense for `warm` × steps ({self.warm} × {self.steps}), "
                             "which must be at least one step and fewer than all")

    def lr_factor(self, step: int) -> float:
        """The schedule's multiple of `lr` for step `step` (0-based)."""
        if self.schedule == "constant":
            return 1.0
        w = round(self.warmup * self.steps)
        if step < w:
            return (step + 1) / w
        t = min(1.0, (step - w) / max(1, self.steps - w))
        return self.final_lr + (1 - self.final_lr) * 0.5 * (1 + math.cos(math.pi * t))

    @property
    def key(self) -> str:
        c = f"_c{self.compression:g}" if self.method not in DENSE else ""
        m = "" if self.model == "gpt" else f"{self.model}_"
        return f"{m}{self.method}{c}_lr{self.lr:g}_s{self.seed}"
