"""What a ``rankwise peft`` run is, without torch: the methods, the data settings and
:class:`PeftRunSpec`, so that the command line checks its arguments at once."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from ... import _fields  # (called as _fields.setting: this spec has a field named `setting`)
from ..._checks import check_training
from ...methods import COMMANDS, REGISTRY

# Every method at LoRA r10's trainable parameters (r = PeftRunSpec.rank), unless its name says
# otherwise: LoRA; LoRA at 2r; AdaLoRA with the final budget of LoRA at r (target_r = r, from
# init_r = 1.5 r, PEFT's default ratio 12 → 8); LoRA+; DLRT and SDLRT adapters holding the
# trainable parameters of LoRA at r (AdapterConfig.budget "lora:r", SDLRT's buffer counted).
# The *-cap2r methods (rankwise.methods' `cap`): τ = 0.02 from rank r, capped at 2r (up to 2×
# LoRA r's parameters, SDLRT 4× with its buffer).
METHODS = COMMANDS["peft"]  # what each name means: rankwise.methods
PEFT_METHODS = tuple(m for m in METHODS if REGISTRY[m].baseline)  # through the peft library
BUDGET_METHODS = tuple(m for m in METHODS if not REGISTRY[m].baseline and REGISTRY[m].cap is None)
SETTINGS = {"full": None, "100": 100, "25": 25}  # training articles (None: the whole training split)
STEPS = {"full": 200, "100": 150, "25": 150}  # default optimizer steps per setting
OPTIMIZERS = ("adam", "sgd")  # Adam (AdamW without weight decay for PEFT's methods); SGD, momentum 0.9
VERSION = 2  # records of version 1: dlrt and sdlrt were the capped methods, no optimizer field


@dataclass(frozen=True)
class PeftRunSpec:
    method: str = "sdlrt"
    setting: str = "100"
    seed: int = 0
    optimizer: str = "adam"
    lr: float = 1e-3
    steps: int = 150
    batch_size: int = _fields.setting(16, help="Articles per step.")
    max_len: int = _fields.setting(128, help="Tokens per article (truncated).")
    rank: int = _fields.setting(10, help="LoRA's rank r, whose trainable parameters every method gets.")
    tau: float = 0.02  # the *-cap2r methods' truncation tolerance
    version: int = VERSION

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}; got {self.method!r}")
        if self.setting not in SETTINGS:
            raise ValueError(f"setting must be one of {list(SETTINGS)}; got {self.setting!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}; got {self.optimizer!r}")
        check_training(steps=self.steps, batch_size=self.batch_size, lr=self.lr, seed=self.seed)
        if SETTINGS[self.setting] is not None and self.batch_size > SETTINGS[self.setting]:
            raise ValueError(f"`batch_size` {self.batch_size} is larger than the {self.setting} training "
                             "articles of this setting")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"`rank` must be an int >= 1; got {self.rank!r}")

    @property
    def key(self) -> str:
        return f"{self.method}_{self.setting}_{self.optimizer}-lr{self.lr:g}_s{self.seed}"

    @property
    def budget(self) -> str | None:
        """The DLRT/SDLRT adapters' ``AdapterConfig.budget`` (``None``: a capped method or PEFT's)."""
        return f"lora:{self.rank}" if self.method in BUDGET_METHODS else None

    def differences(self, stored: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """{field: (stored value, this value)} where the stored spec `stored` (a run record's
        ``"spec"``) differs; a field the record predates counts as its default, and a record
        without ``version`` is of version 1 (before equal budgets)."""
        mine = asdict(self)
        theirs = {f.name: stored.get(f.name, 1 if f.name == "version" else f.default) for f in fields(self)}
        return {k: (theirs[k], mine[k]) for k in mine if theirs[k] != mine[k]}
