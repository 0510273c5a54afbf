r"""The optimizer's settings, validated once and held once.

:class:`SGD`, :class:`Adam` and :class:`AdamW` are the update rules (with their hyperparameters' starting
values; the live values sit in ``param_groups`` so that torch's LR and momentum schedulers
work); :class:`Settings` holds every choice of an :class:`~rankwise.AugmentedBUG`:
truncation, feedback, buffer, rule and the integrator's switches. All are frozen dataclasses
that check their values on construction, and :meth:`Settings.to_dict` /
:meth:`Settings.from_dict` carry them through an optimizer's ``state_dict`` as plain data.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Literal

from ..._checks import check_choice
from ..._fields import fields_doc, setting
from ._policies import Budget, Feedback, SeedFeedback, Tolerance, TwoSidedFeedback, _real
from ._rules import Rule, adam, muon, sgd


def _nonnegative(name: str, value: object, what: str) -> None:
    if not (math.isfinite(v := _real(name, value, finite=False)) and v >= 0):
        raise ValueError(f"`{name}` must be a finite number >= 0 ({what}); got {value}")


@dataclass(frozen=True)
class SGD:
    """SGD with momentum μ in [0, 1) and L2 `weight_decay` (as ``torch.optim.SGD`` without
    dampening): ``m ← μ m + g + wd·p``, ``Δ = −lr·m``."""

    momentum: float = 0.0
    weight_decay: float = 0.0
    name: ClassVar[str] = "sgd"
    update: ClassVar[Rule] = staticmethod(sgd)

    def __post_init__(self) -> None:
        # torch.optim.SGD accepts any momentum >= 0, but m ← μ m + g (no dampening) is a
        # geometric series: the effective step lr/(1 − μ) is unbounded at μ = 1 and grows as
        # μᵗ for μ > 1, so training always diverges.
        if _real("momentum", self.momentum, finite=False) < 0:
            raise ValueError(f"`momentum` must be in [0, 1); got {self.momentum}: a negative μ flips the "
                             "sign of the remembered gradients at every step; use e.g. 0.9, or 0 for "
                             "plain SGD")
        if not self.momentum < 1:
            raise ValueError(
                f"`momentum` must be in [0, 1); got {self.momentum}: with momentum μ >= 1 the buffer "
                "m ← μ·m + g never forgets old gradients (μ = 1) or grows geometrically (μ > 1), so "
                "training diverges; use a value such as 0.9 or 0.99, or 0 for plain SGD")
        _nonnegative("weight_decay", self.weight_decay, "L2 coefficient; 0 switches it off")

    def hyper(self) -> dict[str, Any]:
        """The hyperparameters a param group holds (and a scheduler may change)."""
        return {"momentum": float(self.momentum), "weight_decay": float(self.weight_decay)}


@dataclass(frozen=True)
class Adam:
    """Adam with moment decay rates `betas` (each in [0, 1)), denominator term `eps` > 0 and
    `weight_decay`, as ``torch.optim.Adam``: L2 (``wd·p`` added to the gradient) or, with
    ``decoupled_weight_decay=True``, decoupled (``p ← p − lr·wd·p`` beside Adam's step, as
    ``torch.optim.AdamW``; on a low-rank layer applied to K = US, L = VSᵀ and S, so that
    the weight W = U S Vᵀ decays)."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False
    name: ClassVar[str] = "adam"
    update: ClassVar[Rule] = staticmethod(adam)

    def __post_init__(self) -> None:
        betas = self.betas
        if isinstance(betas, str | bytes) or not hasattr(betas, "__len__") or len(betas) != 2:
            raise TypeError(f"`betas` must be a pair (beta1, beta2) of Adam's moment decay rates; "
                            f"got {betas!r}")
        for i, b in enumerate(betas):
            if not 0 <= _real(f"betas[{i}]", b, finite=False) < 1:
                raise ValueError(f"`betas[{i}]` must be in [0, 1); got betas={tuple(betas)!r}; "
                                 "the default is (0.9, 0.999)")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        if not (math.isfinite(v := _real("eps", self.eps, finite=False)) and v > 0):
            raise ValueError(f"`eps` must be a finite number > 0 (Adam's denominator term, "
                             f"default 1e-8); got {self.eps}")
        _nonnegative("weight_decay", self.weight_decay, "0 switches it off")
        if not isinstance(self.decoupled_weight_decay, bool):
            raise TypeError("`decoupled_weight_decay` must be True or False; "
                            f"got {self.decoupled_weight_decay!r}")

    def hyper(self) -> dict[str, Any]:
        return {"betas": self.betas, "eps": float(self.eps), "weight_decay": float(self.weight_decay),
                "decoupled_weight_decay": self.decoupled_weight_decay}


@dataclass(frozen=True)
class AdamW(Adam):
    """:class:`Adam` with decoupled weight decay, as ``torch.optim.AdamW`` (and with its default
    ``weight_decay=1e-2``): ``p ← p − lr·wd·p`` beside Adam's step of the plain gradient."""

    weight_decay: float = 1e-2
    decoupled_weight_decay: bool = True
    name: ClassVar[str] = "adamw"


MOMENTS = ("auto", "rotate", "reset", "reset_m", "reset_v")
# what moments="auto" means under each rule, chosen on the comparison in docs/lm.md: Muon's momentum
# restarted at every truncation (ahead on the LLaMA-style LM and the digits MLP); Adam's rotated
# (a reset gained little on the LM and lost on the digits MLP); SGD's rotated (a reset at every
# step switches off the momentum asked for)
AUTO_MOMENTS = {"sgd": "rotate", "adam": "rotate", "adamw": "rotate", "muon": "reset"}


@dataclass(frozen=True)
class Muon:
    """Muon on the factors (``torch.optim.Muon``'s rule, :func:`._rules.muon`): Nesterov
    `momentum` μ in [0, 1), the step orthogonalised by `ns_steps` Newton–Schulz iterations, its
    rate scaled by 0.2·√max(m, n) of the layer's m×n weight (so that U S Vᵀ moves as far, in
    spectral norm, as Muon moves a dense weight, at AdamW's update RMS) for K = US, L = VSᵀ and S
    alike; decoupled `weight_decay`. Every other parameter (embeddings, norms, heads, biases)
    takes AdamW with `betas` and `eps`, as Muon's recipe does, at the same rate."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    name: ClassVar[str] = "muon"
    update: ClassVar[Rule] = staticmethod(muon)

    def __post_init__(self) -> None:
        if not 0 <= _real("momentum", self.momentum, finite=False) < 1:
            raise ValueError(f"`momentum` must be in [0, 1) (Muon's default 0.95); got {self.momentum}")
        if not isinstance(self.nesterov, bool):
            raise TypeError(f"`nesterov` must be True or False; got {self.nesterov!r}")
        steps = self.ns_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps < 100:
            raise ValueError(f"`ns_steps` must be an int in [1, 100) (Newton–Schulz iterations, default 5); "
                             f"got {self.ns_steps!r}")
        adam = Adam(self.betas, self.eps, self.weight_decay)  # the dense parameters' AdamW, checked
        object.__setattr__(self, "betas", adam.betas)

    def hyper(self) -> dict[str, Any]:
        return {"momentum": float(self.momentum), "nesterov": self.nesterov, "ns_steps": self.ns_steps,
                "betas": self.betas, "eps": float(self.eps), "weight_decay": float(self.weight_decay),
                "decoupled_weight_decay": True}


Rules = SGD | Adam | Muon
RULES: dict[str, type[SGD] | type[Adam] | type[Muon]] = {"sgd": SGD, "adam": Adam, "adamw": AdamW,
                                                          "muon": Muon}


def rule_from(optimizer: str = "sgd", *, momentum: float | None = None, weight_decay: float | None = None,
              betas: tuple[float, float] | None = None, eps: float | None = None,
              decoupled_weight_decay: bool | None = None) -> SGD | Adam:
    """The rule object for the presets' keyword arguments (``optimizer="adam"``, ``betas=...``).
    Every value is checked; those of the other rule (a non-zero ``momentum`` under Adam,
    ``betas`` or ``eps`` under SGD) are refused: they would be silently unused, as torch's
    optimizers refuse an argument they do not take. `weight_decay` defaults
    to the rule's own (torch's: 0, and 1e-2 for ``"adamw"``); `decoupled_weight_decay` is
    Adam's (``torch.optim.Adam(decoupled_weight_decay=True)`` is AdamW) and refused under
    SGD, which has no such form in torch."""
    if not isinstance(optimizer, str):
        raise TypeError(f"`optimizer` must be the name of an update rule, one of {sorted(RULES)}; "
                        f"got {optimizer!r} ({type(optimizer).__name__}); DLRT/SDLRT apply the "
                        "rule themselves, so pass e.g. optimizer='adam', not torch.optim.Adam")
    if optimizer not in RULES:
        raise ValueError(f"`optimizer` must be one of {sorted(RULES)}; got {optimizer!r} "
                         "(names are lower case)")
    cls = RULES[optimizer]
    wd = {} if weight_decay is None else {"weight_decay": weight_decay}
    Adam(**{k: v for k, v in (("betas", betas), ("eps", eps)) if v is not None})  # a wrong value first
    if momentum is not None and optimizer != "muon":
        SGD(momentum)
    unused = [k for k, v in (("betas", betas), ("eps", eps)) if v is not None] if optimizer == "sgd" else \
        (["momentum"] if optimizer in ("adam", "adamw") and momentum not in (None, 0, 0.0) else [])
    if unused:
        theirs = "Adam's (optimizer='adam' or 'adamw')" if optimizer == "sgd" else "SGD's (optimizer='sgd')"
        raise ValueError(f"{' and '.join(f'`{k}`' for k in unused)} {'are' if len(unused) > 1 else 'is'} "
                         f"{theirs}, but the rule is {optimizer!r}: it would be unused; choose the rule it "
                         "belongs to, or leave it out")
    betas = (0.9, 0.999) if betas is None else betas
    eps = 1e-8 if eps is None else eps
    if optimizer == "muon":
        if decoupled_weight_decay is False:
            raise ValueError("Muon's weight decay is decoupled (as torch.optim.Muon's): leave "
                             "`decoupled_weight_decay` unset")
        return Muon(**({} if momentum is None else {"momentum": momentum}), betas=betas, eps=eps, **wd)
    momentum = 0.0 if momentum is None else momentum
    if optimizer == "sgd":
        if decoupled_weight_decay:
            raise ValueError("`decoupled_weight_decay` is Adam's (torch.optim.SGD has none): use "
                             "optimizer='adamw', or weight_decay= alone for SGD's L2 decay")
        return SGD(momentum, **wd)
    dec = {} if decoupled_weight_decay is None else {"decoupled_weight_decay": decoupled_weight_decay}
    return cls(betas, eps, **wd, **dec)


_POLICIES: dict[str, type] = {c.__name__: c for c in (Tolerance, Budget, SeedFeedback, TwoSidedFeedback)}


def _policy_dict(policy: object) -> dict[str, Any] | None:
    if policy is None:
        return None
    if type(policy).__name__ in _POLICIES and type(policy) is _POLICIES[type(policy).__name__]:
        return {"kind": type(policy).__name__, **asdict(policy)}  # type: ignore[call-overload]
    return {"kind": "custom", "repr": repr(policy)}  # a Feedback of the user's own


def _policy(d: dict[str, Any] | None) -> Any:
    if d is None:
        return None
    if d.get("kind") not in _POLICIES:
        raise ValueError(f"cannot rebuild the policy {d.get('repr', d)!r}: only rankwise's own policies "
                         f"({', '.join(_POLICIES)}) are recorded by value; pass it again")
    return _POLICIES[d["kind"]](**{k: v for k, v in d.items() if k != "kind"})


@dataclass(frozen=True)
class Settings:
    """Every choice of an :class:`~rankwise.AugmentedBUG`, validated once; each field's help is
    its one documentation (the optimizers' docstrings list them: :func:`settings_doc`).

    **Arguments:**
    """

    truncation: Tolerance | Budget = setting(help=(
        ":class:`Tolerance` (τ per layer: the discarded tail ‖σ_tail‖ ≤ τ‖σ‖) or :class:`Budget` (a "
        "compression target, ranks allocated model-wide)."))
    feedback: Feedback | None = setting(None, help=(
        "``None``, :class:`SeedFeedback` (SDLRT's τ ← ωτ while a layer's rank is below its initial "
        "rank) or :class:`TwoSidedFeedback` (also τ ← τ/ω above it), or your own :class:`Feedback`: "
        "adjusts each layer's τ after every truncation; only with a Tolerance."))
    buffer: bool = setting(False, help=(
        "SDLRT's compensation buffer: the augmented bases also span the last truncation's next "
        "discarded directions, ``Ū = orth[U0, ΔK, U_buf]``."))
    rule: Rules = setting(default_factory=SGD, help=(
        ":class:`SGD` (``momentum``, ``weight_decay``), :class:`Adam` (``betas``, ``eps``, "
        "``weight_decay``, ``decoupled_weight_decay``) or :class:`AdamW`, applied to K = US, L = VSᵀ, S "
        "and every other trainable parameter, or :class:`Muon` (orthogonalised momentum on K, L and S, "
        "AdamW on the rest); its values start the param groups, where torch's "
        "schedulers may change them."))
    single_pass: bool = setting(True, help=(
        "one closure call per step, the gradient projected onto the augmented bases; "
        "``False``: classic two-pass BUG (the closure is called twice)."))
    min_rank: int = setting(2, help="the smallest rank a truncation keeps.")
    max_rank: int | None = setting(None, help="the largest rank (also capped per layer by its shape).")
    adaptive: bool = setting(True, help="``False`` keeps each layer's rank fixed (fixed-rank BUG).")
    update_every: int = setting(1, help=(
        "augment and truncate every N-th step; in between only the cores S and the dense "
        "parameters take plain steps (a much cheaper backward)."))
    on_nonfinite: Literal["raise", "skip"] = setting("raise", help=(
        "``\"raise\"`` a ``FloatingPointError`` on a NaN/inf loss or gradient, or ``\"skip\"`` the step "
        "with a warning; weights are never overwritten with NaN."))
    data_parallel: Literal["replicated", "sharded"] = setting("sharded", help=(
        "with a `process_group`: ``\"sharded\"`` (each layer integrated by one rank, its owner, which "
        "sends the result to the others) or ``\"replicated\"`` (every rank integrates every layer)."))
    check_every: int = setting(1, help=(
        "with a `process_group`: compare the replicas' hashes every N-th augmentation (0: never); a "
        "rank that drifted raises ``RuntimeError`` naming it."))
    moments: Literal["auto", "rotate", "reset", "reset_m", "reset_v"] = setting("auto", help=(
        "``\"auto\"`` (the default): ``\"reset\"`` under :class:`Muon`, ``\"rotate\"`` under "
        ":class:`Adam` and :class:`SGD`, the better of the two for each rule in docs/lm.md's comparison; "
        "``\"rotate\"`` carries the rule's K, L and S moments into the new bases at every "
        "truncation (:func:`._rules.transport`); ``\"reset\"`` starts them afresh, with Adam's step "
        "count; ``\"reset_m\"`` / ``\"reset_v\"`` restart only the first / second moment "
        "(its bias correction counted from the restart) and rotate the other."))
    core_lr_ratio: float = setting(1.0, help="the core S's rate as a multiple of the bases' K and L rate.")

    def __post_init__(self) -> None:
        if not isinstance(self.truncation, Tolerance | Budget):
            raise TypeError(f"`truncation` must be rankwise.Tolerance(tau) or rankwise.Budget(target); "
                            f"got {self.truncation!r}")
        if self.feedback is not None and not isinstance(self.feedback, Feedback):
            raise TypeError(f"`feedback` must be None, rankwise.SeedFeedback(...) or "
                            f"rankwise.TwoSidedFeedback(...); got {self.feedback!r}")
        if not isinstance(self.rule, Rules):
            raise TypeError(f"`rule` must be rankwise.SGD(momentum=...), rankwise.Adam(betas=..., eps=...) "
                            f"rankwise.AdamW(...) or rankwise.Muon(...); got {self.rule!r}")
        for name in ("buffer", "single_pass", "adaptive"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}` must be True or False; got {getattr(self, name)!r}")
        if self.budgeted and self.feedback is not None:
            raise ValueError("a feedback adjusts τ, and a Budget has none: it sets every rank itself; "
                             "pass feedback=None with a Budget")
        if self.budgeted and not self.adaptive:
            raise ValueError("a compression target (Budget) needs adaptive=True: the budget sets the ranks")
        if self.feedback is not None and not self.feedback.tau_min <= self.tau:
            raise ValueError(f"`tau_min` must be in [0, tau={self.tau}]; got {self.feedback.tau_min}")
        for name, least in (("update_every", 1), ("min_rank", 1), ("check_every", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"`{name}` must be an int >= {least}; got {v!r}")
        cap = self.max_rank
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < self.min_rank):
            raise ValueError(f"need 1 <= min_rank <= max_rank; got {self.min_rank}, {self.max_rank}")
        check_choice(self.on_nonfinite, ("raise", "skip"), "on_nonfinite")
        if not (isinstance(self.core_lr_ratio, int | float) and not isinstance(self.core_lr_ratio, bool)
                and math.isfinite(self.core_lr_ratio) and self.core_lr_ratio > 0):
            raise ValueError(f"`core_lr_ratio` must be a finite number > 0; got {self.core_lr_ratio!r}")
        check_choice(self.moments, MOMENTS, "moments")
        check_choice(self.data_parallel, ("replicated", "sharded"), "data_parallel")

    @property
    def budgeted(self) -> bool:
        """Does a :class:`Budget` set the ranks (rather than a tolerance τ)?"""
        return isinstance(self.truncation, Budget)

    @property
    def moments_used(self) -> str:
        """`moments`, with ``"auto"`` resolved for the rule (:data:`AUTO_MOMENTS`)."""
        return AUTO_MOMENTS[self.rule.name] if self.moments == "auto" else self.moments

    @property
    def tau(self) -> float:
        """The initial tolerance (0 under a Budget, which has none)."""
        return 0.0 if self.budgeted else self.truncation.tau

    def policies(self) -> str:
        """The policies as text (how a state saved before :class:`Settings` recorded them)."""
        return f"{self.truncation!r}, feedback={self.feedback!r}, buffer={self.buffer}"

    def to_dict(self) -> dict[str, Any]:
        """Plain data (str, numbers, bools, None, tuples, dicts) for a ``state_dict``."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["truncation"] = _policy_dict(self.truncation)
        out["feedback"] = _policy_dict(self.feedback)
        out["rule"] = {"kind": self.rule.name, **asdict(self.rule)}
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Settings:
        """Inverse of :meth:`to_dict` (a custom Feedback cannot be rebuilt: ``ValueError``)."""
        d = dict(d)
        rule = dict(d.pop("rule"))
        kind = rule.pop("kind")
        if kind not in RULES:
            raise ValueError(f"unknown update rule {kind!r} in saved settings; "
                             f"expected one of {sorted(RULES)}")
        if "betas" in rule:
            rule["betas"] = tuple(rule["betas"])
        return cls(truncation=_policy(d.pop("truncation")), feedback=_policy(d.pop("feedback")),
                   rule=RULES[kind](**rule), **d)


RULE_ARGS = ("optimizer", "momentum", "weight_decay", "betas", "eps", "decoupled_weight_decay")


def pop_rule(kwargs: dict[str, Any]) -> Rules:
    """Take the update rule out of keyword arguments (in place): `rule`, or the presets'
    ``optimizer=`` (``"sgd"``, ``"adam"``, ``"adamw"``), ``momentum=``, ``weight_decay=``,
    ``betas=``, ``eps=``, ``decoupled_weight_decay=`` (checked here, :func:`rule_from`), or
    the default ``SGD()``."""
    legacy = {k: kwargs.pop(k) for k in RULE_ARGS if k in kwargs}
    rule = kwargs.pop("rule", None)
    if legacy and rule is not None:
        raise TypeError(f"give `rule` or the rule's keyword arguments "
                        f"({', '.join(sorted(legacy))}), not both")
    return rule if rule is not None else rule_from(**legacy)


def settings_from(kwargs: dict[str, Any]) -> Settings:
    """:class:`Settings` from an optimizer's keyword arguments (its fields; instead of `rule`,
    optionally the presets' rule arguments, :func:`pop_rule`); unknown names are refused."""
    kwargs = dict(kwargs)
    rule = pop_rule(kwargs)
    names = {f.name for f in fields(Settings)}
    if unknown := sorted(set(kwargs) - names):
        raise TypeError(f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}; the settings are "
                        f"{', '.join(sorted(names))} (or, instead of rule, {', '.join(RULE_ARGS)})")
    if "truncation" not in kwargs:
        raise TypeError("missing `truncation`: rankwise.Tolerance(tau) or rankwise.Budget(target)")
    return Settings(rule=rule, **kwargs)


def settings_doc(names=None) -> str:
    """The :class:`Settings` fields' helps as a docstring's list (`names`: only these)."""
    return fields_doc(Settings, names)


Settings.__doc__ = Settings.__doc__.rstrip() + "\n" + settings_doc() + "\n"
