"""What a ``rankwise peft`` run is, without torch: the methods, the data settings and
:class:`PeftRunSpec`, so that the command line checks its arguments at once."""

from __future__ import annotations

from dataclasses import dataclass

from .._checks import check_training

METHODS = ("lora", "lora-2r", "adalora", "loraplus", "dlrt", "sdlrt", "sdlrt-taumin")
SETTINGS = {"full": None, "100": 100, "25": 25}  # training articles (None: the whole training split)


@dataclass(frozen=True)
class PeftRunSpec:
    method: str = "sdlrt"
    setting: str = "100"
    seed: int = 0
    lr: float = 1e-3
    steps: int = 100
    batch_size: int = 16
    max_len: int = 64
    rank: int = 10
    tau: float = 0.02
    max_rank: int = 20  # DLRT/SDLRT adapters: a cap (from a zero start with τ = 0.02 the ranks
    # double at every augmentation: 209–323 after 10 steps without one, docs/peft.md)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}; got {self.method!r}")
        if self.setting not in SETTINGS:
            raise ValueError(f"setting must be one of {list(SETTINGS)}; got {self.setting!r}")
        check_training(steps=self.steps, batch_size=self.batch_size, lr=self.lr, seed=self.seed)
        if SETTINGS[self.setting] is not None and self.batch_size > SETTINGS[self.setting]:
            raise ValueError(f"`batch_size` {self.batch_size} is larger than the {self.setting} training "
                             "articles of this setting")

    @property
    def key(self) -> str:
        return f"{self.method}_{self.setting}_lr{self.lr:g}_s{self.seed}"
