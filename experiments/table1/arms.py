"""The Table-1 study's arms (`Arm`), as the flags spell them (`parse_arm`) and as a study lists them (`study_arms`).

An arm's `name` (``exact``, ``k16_common_mlm``, ``k8_fixed_none``, ``k16_common_distill_zerofill``) is only an output,
the key of its job files under ``run_dir/jobs`` and of its row in ``table1.json``; nothing parses it back. Arms
spelled on the command line (``--zero_fill_control``, ``--rlr_arm``) are ``k:mode:recovery[:form]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from hf_partial_attention.configuration_partial_bert import RECONSTRUCTION_MODES

__all__ = ["Arm", "layers_key", "StudyArms", "study_arms", "parse_arm", "RECOVERIES", "LENGTH_MODES",
           "GRANULARITY_FORMS"]

# Phase 2 of an arm: none (converted and fine-tuned at once), MLM, or attention transfer + distillation from the
# exact phase-1 model (`--distill_objective`).
RECOVERIES = ("none", "mlm", "distill")
# How a partial arm treats inputs shorter than n: P and R per length bucket, or n's P and R with zero scores for the
# missing keys (one bucket: the paper's fixed-window pattern).
LENGTH_MODES = ("buckets", "zero_fill")
# P and R of a partial arm: one for every layer and head (the paper's), per layer or per head (issue 34).
GRANULARITY_FORMS = ("pooled", "layer", "head")

@dataclass(frozen=True)
class Arm:
    """One arm of the study.

    Attributes:
        k: exact scores per query of the partial layers; None for the exact model.
        reconstruction: R of the converted model (one of `RECONSTRUCTION_MODES`); None for the exact model.
        recovery: phase 2 before fine-tuning, one of `RECOVERIES`: ``none`` (the phase-1 exact model converted and
            fine-tuned at once: the paper's "performs poorly"), ``mlm`` or ``distill``. The exact arm continues
            MLM for as many steps (``mlm``).
        lengths: ``buckets`` (P and R per length bucket) or ``zero_fill`` (n's P and R for every length); the
            exact arm has no pattern and keeps the default.
        granularity: ``pooled`` (one P and R for every layer and head, the paper's), ``layer`` or ``head`` (each
            its own, issue 34; with buckets, R fixed or per_layer).
        budget: each layer its own k at k's saving in every bucket (`analysis.budget`, ``derive --saving k<k>``).
        exact_layers: with ``budget``, layers left exact at the same saving (``derive --exact-layers``): each pays
            dense attention's cost out of the budget, the other partial layers share the rest.
    """

    k: int | None = None
    reconstruction: str | None = None
    recovery: str = "mlm"
    lengths: str = "buckets"
    granularity: str = "pooled"
    budget: bool = False
    exact_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.exact_layers and not self.budget:
            raise ValueError(f"Arm(exact_layers={self.exact_layers}) leaves layers exact within a budget: set "
                             "budget=True (form '<granularity>_exact<l>').")
        if self.granularity not in GRANULARITY_FORMS:
            raise ValueError(f"Arm(granularity={self.granularity!r}): use one of {GRANULARITY_FORMS}.")
        if self.granularity != "pooled" or self.budget:
            if self.k is None or self.lengths != "buckets":
                raise ValueError(f"Arm(granularity={self.granularity!r}, budget={self.budget}) is a partial arm with "
                                 "length buckets: give k and keep lengths='buckets'.")
            if self.reconstruction == "common":
                raise ValueError("Arm(reconstruction='common') has no meaning with P per layer or head (one R "
                                 "would map every layer's own P): use fixed or per_layer.")
            if self.budget and self.granularity == "pooled":
                raise ValueError("Arm(budget=True) gives each layer its own k: it needs granularity 'layer' or "
                                 "'head'.")
        if (self.k is None) != (self.reconstruction is None):
            raise ValueError(f"Arm(k={self.k!r}, reconstruction={self.reconstruction!r}): give both (a partial "
                             "arm) or neither (the exact arm).")
        if self.recovery not in RECOVERIES:
            raise ValueError(f"Arm(recovery={self.recovery!r}): use one of {RECOVERIES}.")
        if self.lengths not in LENGTH_MODES:
            raise ValueError(f"Arm(lengths={self.lengths!r}): use one of {LENGTH_MODES}.")
        if self.k is None:
            if self.recovery != "mlm":
                raise ValueError(f"Arm(recovery={self.recovery!r}) needs a k: the exact arm continues MLM "
                                 "(recovery='mlm'); a model without recovery or distilled is a converted one, "
                                 "Arm(k=K, reconstruction='common', recovery=...).")
            if self.lengths != "buckets":
                raise ValueError(f"Arm(lengths={self.lengths!r}) needs a k: the exact arm has no pattern; leave "
                                 "lengths at its default.")
            return
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"Arm(k={self.k!r}): k must be an int >= 1 (exact scores per query).")
        if self.reconstruction not in RECONSTRUCTION_MODES:
            raise ValueError(f"Arm(reconstruction={self.reconstruction!r}): use one of {RECONSTRUCTION_MODES}.")

    @property
    def is_exact(self) -> bool:
        return self.k is None

    @property
    def trains(self) -> bool:
        """Whether the arm has a phase-2 job (``mlm_<name>``): every arm but those with recovery ``none``."""
        return self.recovery != "none"

    @property
    def trains_r(self) -> bool:
        """Whether R is a parameter (``common`` / ``per_layer``)."""
        return self.reconstruction in ("common", "per_layer")

    @property
    def name(self) -> str:
        """The key of the arm's jobs and report row: ``exact`` or ``k<k>_<reconstruction>_<recovery>``, with
        ``_zerofill`` for the zero-fill arm."""
        if self.k is None:
            return "exact"
        return (f"k{self.k}_{self.reconstruction}_{self.recovery}"
                + ("_zerofill" if self.lengths == "zero_fill" else "")
                + ("" if self.granularity == "pooled" else f"_{self.granularity}") + self._budget_suffix)

    @property
    def _budget_suffix(self) -> str:
        """``_budget``, ``_exact4`` (a budget with layer 4 exact; ``_exact1and4``) or nothing (one k)."""
        if self.exact_layers:
            return "_exact" + "and".join(map(str, self.exact_layers))
        return "_budget" if self.budget else ""

    @property
    def budget_name(self) -> str:
        """The suffix of `derive_budget`'s file for the arm: ``budget``, ``exact4``, ... (``uniform`` for one k)."""
        return self._budget_suffix.removeprefix("_") or "uniform"

    @property
    def form(self) -> str:
        """P and R as the report shows them: ``pooled``, ``head``, ``head_budget``, ..."""
        return self.granularity + self._budget_suffix

    @property
    def mode(self) -> str:
        """R as the report's table shows it (``-`` for the exact arm)."""
        return self.reconstruction or "-"

    def twin(self, **changes) -> Arm:
        """The arm with some fields changed (``twin(lengths="buckets")``: the zero-fill arm's buckets twin)."""
        return replace(self, **changes)


def layers_key(k: int, granularity: str, exact_layers=()) -> str:
    """The key of an arm's per-layer ks in the study's patterns record: ``k16_head``, ``k16_head_exact4``."""
    return f"k{k}_{granularity}" + ("_exact" + "and".join(map(str, exact_layers)) if exact_layers else "")


def parse_arm(text: str, field_name: str, lengths: str = "buckets") -> Arm:
    """``"16:common:distill"`` (k, R mode, recovery) or ``"16:per_layer:distill:head_budget"`` (and P and R's form:
    ``pooled``, ``layer``, ``head``, with ``_budget`` for a k per layer) as an `Arm`; a ValueError naming
    ``field_name`` otherwise."""
    parts = text.split(":")
    try:
        if len(parts) not in (3, 4):
            raise ValueError("three or four fields")
        form = parts[3] if len(parts) == 4 else "pooled"
        match = re.fullmatch(r"([a-z]+)(?:_(budget)|_exact(\d+(?:and\d+)*))?", form)
        if match is None:
            raise ValueError(f"form {form!r}")
        exact = tuple(int(layer) for layer in match[3].split("and")) if match[3] else ()
        return Arm(int(parts[0]), parts[1], parts[2], lengths, match[1], bool(match[2] or exact), exact)
    except ValueError as err:
        raise ValueError(f"--{field_name} {text!r} is not an arm k:mode:recovery[:form] ({err}); write e.g. "
                         f"'16:common:distill' or '16:per_layer:distill:head_budget' (mode in {RECONSTRUCTION_MODES}, "
                         f"recovery in {RECOVERIES}, form in {GRANULARITY_FORMS} with an optional _budget or "
                         "_exact<l>)."
                         ) from err


@dataclass(frozen=True)
class StudyArms:
    """The arms of one study, in the order of the report's rows: `finetune` (every arm), `mlm` (those with a
    phase-2 job: exact and every arm with recovery mlm or distill) and `converted` (recovery none: a ``conv_``
    job, converted losses only)."""

    finetune: tuple[Arm, ...]

    @property
    def mlm(self) -> tuple[Arm, ...]:
        return tuple(arm for arm in self.finetune if arm.trains)

    @property
    def converted(self) -> tuple[Arm, ...]:
        return tuple(arm for arm in self.finetune if not arm.trains)

    def by_name(self) -> dict[str, Arm]:
        """Every arm by its `name` (names are unique: `study_arms` checks it)."""
        return {arm.name: arm for arm in self.finetune}


def study_arms(ks, modes, recoveries=RECOVERIES, zero_fill_control: Arm | None = None, extra=()) -> StudyArms:
    """The exact arm; per k, per recovery, per R mode one arm with length buckets; the ``extra`` arms (P and R per
    layer or head: ``--granularity_arms``); then the zero-fill control."""
    arms = [Arm(), *(Arm(k, mode, recovery) for k in ks for recovery in recoveries for mode in modes), *extra]
    if zero_fill_control is not None:
        if zero_fill_control.twin(lengths="buckets") not in arms:
            raise ValueError(f"--zero_fill_control {zero_fill_control.name}: its buckets twin "
                             f"{zero_fill_control.twin(lengths='buckets').name} is not an arm of the study; pick k "
                             "from --ks, a mode from --modes and a recovery from --recoveries, or pass ''.")
        arms.append(zero_fill_control.twin(lengths="zero_fill"))
    names = [arm.name for arm in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"The study's arms {names} repeat a name; list each k once in --ks, each mode once in "
                         "--modes and each recovery once in --recoveries.")
    return StudyArms(tuple(arms))
