"""The training methods by name: one table, read by every command (``rankwise train``, ``sweep``,
``lm``, ``peft``, ``ckpt demo``), so that a name means the same wherever it is used.

A method of rankwise's own is a configuration of :class:`rankwise.AugmentedBUG`: the fields of
:class:`rankwise.Settings` it fixes (``buffer``, ``single_pass``, ``update_every``,
``moments``, …), its τ feedback, and whether it starts with a dense phase. What it leaves open
is the command's: the truncation level (a tolerance τ or a :class:`rankwise.Budget`), the update
rule and its rate, rank bounds, data parallelism. A baseline (dense training, a fixed
factorisation, GaLore, LoRA, …) is listed here with what it is, and each command trains it its
own way.

The table is plain data, importable without torch (the command line checks names before
importing it); :func:`settings` and :func:`build` import torch when called::

    from rankwise import methods
    opt = methods.build("sdlrt", model, 0.05, rankwise.Tolerance(0.1), momentum=0.9)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from torch import nn

    from .optim import AugmentedBUG, Budget, Settings, Tolerance

FEEDBACKS = ("seed", "two-sided")
# the Settings fields a method may fix (the others are the command's)
METHOD_FIELDS = ("buffer", "single_pass", "adaptive", "update_every", "moments", "core_lr_ratio")
OPEN = ("update_every",)  # of those, what a command may set where the method does not


@dataclass(frozen=True)
class Method:
    """What one name means.

    - `help`: one line, for the commands' help and the docs.
    - `settings`: the :class:`rankwise.Settings` fields the method fixes, from
      ``METHOD_FIELDS`` (unset ones keep ``Settings``' defaults unless the command sets them).
    - `feedback`: SDLRT's τ feedback, ``"seed"`` (the paper's τ ← ωτ while a layer's rank is
      below its initial rank; :class:`rankwise.SeedFeedback`), ``"two-sided"`` (also τ ← τ/ω
      above it; :class:`rankwise.TwoSidedFeedback`) or ``None``. It adjusts a tolerance: under
      a :class:`rankwise.Budget`, which sets the ranks itself, there is none.
    - `allocation`: the :class:`rankwise.Budget` allocation rule the method fixes (``None``:
      the command's).
    - `warm`: dense training first, then this method (the command decides how long and at
      which ranks the model is factorised).
    - `cap`: trained at the command's tolerance τ from its starting rank r, every rank capped
      at `cap` × r, where the command's other methods take a budget (``None``: as they do).
    - `rule`: the update rule the method fixes (``"muon"``: :class:`rankwise.Muon` with the
      command's `betas` and `eps` for its AdamW part; ``None``: the command's rule).
    - `baseline`: not a rankwise integrator; the command trains it its own way (`settings`,
      `feedback`, `allocation` and `cap` are then empty).
    """

    help: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    feedback: Literal["seed", "two-sided"] | None = None
    allocation: str | None = None
    warm: bool = False
    cap: int | None = None
    rule: Literal["muon"] | None = None
    baseline: bool = False

    def __post_init__(self) -> None:
        if unknown := sorted(set(self.settings) - set(METHOD_FIELDS)):
            raise ValueError(f"a method fixes only {', '.join(METHOD_FIELDS)}; got {unknown}")
        if self.feedback not in (None, *FEEDBACKS):
            raise ValueError(f"`feedback` must be None or one of {FEEDBACKS}; got {self.feedback!r}")
        if self.rule not in (None, "muon"):
            raise ValueError(f"`rule` must be None or 'muon'; got {self.rule!r}")
        if self.baseline and (self.settings or self.feedback or self.allocation or self.cap or self.rule):
            raise ValueError("a baseline is trained by its command: it fixes no integrator settings")
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))

    @property
    def buffer(self) -> bool:
        """Does the method keep SDLRT's compensation buffer?"""
        return bool(self.settings.get("buffer", False))


def _m(help: str, **kw: Any) -> Method:
    settings = {k: kw.pop(k) for k in METHOD_FIELDS if k in kw}
    return Method(help, settings, **kw)


REGISTRY: Mapping[str, Method] = MappingProxyType({
    # rankwise's integrators
    "dlrt": _m("DLRT: the rank-adaptive augmented basis-update & Galerkin integrator (rankwise.DLRT)."),
    "sdlrt": _m("SDLRT: DLRT with the compensation buffer and the paper's τ feedback τ ← ωτ "
                "(rankwise.SDLRT); under a budget, the buffer only.", buffer=True, feedback="seed"),
    "sdlrt-two-sided": _m("SDLRT with the two-sided τ feedback (also τ ← τ/ω while a rank is above its "
                          "start), which settles.", buffer=True, feedback="two-sided"),
    "sdlrt-buffer": _m("SDLRT's compensation buffer alone (no τ feedback).", buffer=True),
    "sdlrt-feedback": _m("SDLRT's τ feedback τ ← ωτ alone (no buffer).", feedback="seed"),
    "dlrt-2pass": _m("DLRT by classic two-pass BUG (a second forward and backward per step).",
                     single_pass=False),
    "dlrt-ue5": _m("DLRT augmenting every 5th step (the steps between move the cores S and the dense "
                   "parameters only).", update_every=5),
    "dlrt-ue20": _m("DLRT augmenting every 20th step.", update_every=20),
    "dlrt-fixedrank": _m("DLRT at fixed ranks: every layer keeps its starting rank.", adaptive=False),
    "dlrt-uniform": _m("DLRT with the budget allocated uniformly over the layers.", allocation="uniform"),
    "dlrt-reset": _m("DLRT with the rule's moments started afresh at every truncation (not rotated into "
                     "the new bases).", moments="reset"),
    "dlrt-reset-m": _m("DLRT with only the first moments started afresh at every truncation (Adam's second "
                       "moments rotated).", moments="reset_m"),
    "dlrt-reset-v": _m("DLRT with only Adam's second moments started afresh at every truncation (the first "
                       "moments rotated).", moments="reset_v"),
    "dlrt-reset-ue5": _m("dlrt-reset augmenting every 5th step.", moments="reset", update_every=5),
    "dlrt-reset-ue20": _m("dlrt-reset augmenting every 20th step.", moments="reset", update_every=20),
    "dlrt-muon": _m("DLRT with the Muon rule on the factors (orthogonalised momentum, rotated at a "
                    "truncation; AdamW on the rest).", moments="rotate", rule="muon"),
    "dlrt-muon-reset": _m("dlrt-muon with the momentum started afresh at every truncation.", moments="reset",
                          rule="muon"),
    "sdlrt-reset": _m("SDLRT with the rule's moments started afresh at every truncation.", buffer=True,
                      feedback="seed", moments="reset"),
    "sdlrt-muon-reset": _m("SDLRT with the Muon rule on the factors, its momentum started afresh at every "
                           "truncation (AdamW on the rest).", buffer=True, feedback="seed", moments="reset",
                           rule="muon"),
    "dlrt-core3": _m("DLRT with the core's rate 3× the bases'.", core_lr_ratio=3.0),
    "dlrt-core0.3": _m("DLRT with the core's rate 0.3× the bases'.", core_lr_ratio=0.3),
    "dlrt-warm": _m("Dense training first, then DLRT.", warm=True),
    "sdlrt-warm": _m("Dense training first, then SDLRT.", buffer=True, feedback="seed", warm=True),
    "dlrt-cap2r": _m("DLRT at a tolerance τ from rank r, every rank capped at 2r.", cap=2),
    "sdlrt-cap2r": _m("SDLRT at a tolerance τ from rank r, every rank capped at 2r.", buffer=True,
                      feedback="seed", cap=2),
    # baselines, each command's own
    "dense": _m("Dense training by the command's plain optimizer (SGD, Adam or AdamW).", baseline=True),
    "fixed": _m("A fixed factorisation U S Vᵀ at the starting ranks, trained by the plain optimizer.",
                baseline=True),
    "fixed-warm": _m("Dense training first, then a fixed factorisation of the trained weights.",
                     baseline=True, warm=True),
    "dense-svd": _m("Dense training, then the SVD to the target and fine-tuning of the factors.",
                    baseline=True),
    "galore": _m("GaLore: AdamW on the dense model with gradients projected to a low rank.", baseline=True),
    "cola": _m("CoLA: each projection as B·σ(A·x) (SiLU between two dense factors at a rank holding the "
               "compression's parameters), trained by the plain optimizer.", baseline=True),
    "muon": _m("Dense training with torch.optim.Muon on the projections' matrices (orthogonalised "
               "momentum) and AdamW on the rest.", baseline=True),
    "lora": _m("LoRA (the peft library).", baseline=True),
    "lora-2r": _m("LoRA at twice the rank.", baseline=True),
    "adalora": _m("AdaLoRA (the peft library).", baseline=True),
    "loraplus": _m("LoRA+ (LoRA with a larger rate for B).", baseline=True),
})

# each command's methods, in the order its help and default lists give them
COMMANDS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "train": ("dense", "dlrt", "sdlrt"),
    "sweep": ("dense", "dlrt", "sdlrt", "sdlrt-two-sided", "sdlrt-buffer", "sdlrt-feedback", "dlrt-2pass",
              "fixed", "dense-svd", "dlrt-warm", "sdlrt-warm", "dlrt-reset", "dlrt-muon", "dlrt-muon-reset",
              "dlrt-reset-m", "dlrt-reset-v", "sdlrt-reset", "sdlrt-muon-reset"),
    "lm": ("dense", "dlrt", "sdlrt", "fixed", "galore", "muon", "cola", "dlrt-ue5", "dlrt-ue20",
           "dlrt-fixedrank", "dlrt-uniform", "dlrt-reset", "dlrt-warm", "fixed-warm", "dlrt-core3",
           "dlrt-core0.3", "dlrt-reset-m", "dlrt-reset-v", "dlrt-reset-ue5", "dlrt-reset-ue20", "dlrt-muon",
           "dlrt-muon-reset"),
    "peft": ("lora", "lora-2r", "adalora", "loraplus", "dlrt", "sdlrt", "dlrt-cap2r", "sdlrt-cap2r",
             "sdlrt-reset", "sdlrt-muon-reset"),
    "ckpt": ("dense", "sdlrt", "dlrt"),
})

# old names the commands refuse, each with the name of the same method
RENAMED: Mapping[str, str] = MappingProxyType({"sdlrt-seed": "sdlrt"})


def renamed(names: list[str] | tuple[str, ...]) -> str:
    """A hint for an error message naming unknown `names`: the names to use instead of the
    renamed ones among them ("" when none is)."""
    hints = [f"{n} is called {RENAMED[n]}" for n in names if n in RENAMED]
    return f" ({'; '.join(hints)})" if hints else ""


def get(name: str) -> Method:
    """The method called `name`; ``ValueError`` naming the methods otherwise."""
    if name in REGISTRY:
        return REGISTRY[name]
    raise ValueError(f"no method {name!r}{renamed([name])}; the methods are {', '.join(REGISTRY)}")


def _integrator(name: str) -> Method:
    method = get(name)
    if method.baseline:
        raise ValueError(f"{name} is a baseline, not a rankwise integrator: its command trains it")
    return method


def settings(name: str, truncation: Tolerance | Budget, *, omega: float = 0.8, tau_min: float = 0.0,
             **kwargs: Any) -> Settings:
    """The :class:`rankwise.Settings` of method `name` at `truncation`.

    `omega`, `tau_min`: the τ feedback's factor and floor (used by a method with a feedback,
    under a tolerance). `kwargs`: the rule (``rule=`` or the presets' ``optimizer=``,
    ``momentum=``, ``betas=``, …) and the Settings fields the method leaves open (``min_rank``,
    ``max_rank``, ``on_nonfinite``, ``data_parallel``, …, and ``update_every`` unless the method
    fixes another value); the others of ``METHOD_FIELDS`` and the feedback are the method's.

    A method with a `feedback` has none under a :class:`rankwise.Budget`; one with an
    `allocation` replaces the budget's; a fixed-rank one (``adaptive=False``) keeps its ranks
    whatever the truncation asks, and is given ``Tolerance(0.0)``."""
    from .optim import Budget, SeedFeedback, Tolerance, TwoSidedFeedback
    from .optim.rules._settings import pop_rule, rule_from, settings_from

    method = _integrator(name)
    for key in (*METHOD_FIELDS, "feedback"):
        if key not in kwargs:
            continue
        if key not in OPEN:
            raise TypeError(f"method {name} decides `{key}` (give the method that has the {key} you want)")
        if key in method.settings and kwargs[key] != method.settings[key]:
            raise ValueError(f"method {name} sets {key}={method.settings[key]!r}; got {key}={kwargs[key]!r}")
    if not isinstance(truncation, Tolerance | Budget):
        raise TypeError(f"`truncation` must be rankwise.Tolerance(tau) or rankwise.Budget(...); "
                        f"got {truncation!r}")
    if isinstance(truncation, Budget) and method.allocation is not None:
        truncation = dataclasses.replace(truncation, allocation=method.allocation)
    if not method.settings.get("adaptive", True):
        truncation = Tolerance(0.0)
    feedback = None
    if method.feedback is not None and isinstance(truncation, Tolerance):
        kind = SeedFeedback if method.feedback == "seed" else TwoSidedFeedback
        feedback = kind(omega=omega, tau_min=tau_min)
    if method.rule is not None:  # the method's rule, with the command's Adam part
        kwargs = dict(kwargs)
        given = pop_rule(kwargs)
        adam = {k: getattr(given, k) for k in ("betas", "eps") if hasattr(given, k)}
        kwargs["rule"] = rule_from(method.rule, **adam, weight_decay=given.weight_decay)
    return settings_from({**kwargs, **method.settings, "truncation": truncation, "feedback": feedback})


def build(name: str, model: nn.Module, lr: float, truncation: Tolerance | Budget, *, omega: float = 0.8,
          tau_min: float = 0.0, process_group=None, param_groups: list[dict] | None = None,
          **kwargs: Any) -> AugmentedBUG:
    """The :class:`rankwise.AugmentedBUG` of method `name` for `model` (arguments as in
    :func:`settings`; `process_group` and `param_groups` as the optimizer takes them)."""
    from .optim import AugmentedBUG

    return AugmentedBUG(model, lr, settings(name, truncation, omega=omega, tau_min=tau_min, **kwargs),
                        process_group=process_group, param_groups=param_groups)
