"""The terms of a recovery objective and their weights: ``--recovery_objective`` / ``--recovery_weights`` parsed into
a `RecoveryObjective` (`parse_recovery_objective`), whose docstring describes the terms.
`recovery` re-exports every name.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RECOVERY_TERMS", "RecoveryObjective", "parse_recovery_objective"]

RECOVERY_TERMS = ("mlm", "attention_transfer", "distill_kl", "distill_hidden", "embedding")
_ALIASES = {"distill": ("distill_kl", "distill_hidden")}


@dataclass(frozen=True)
class RecoveryObjective:
    """Terms of the recovery loss and their weights (`parse_recovery_objective`); the loss is their weighted sum.

    The terms (``--recovery_objective``, comma-separated; the teacher is the frozen exact model):

    - ``mlm``: the model's own loss (masked-language modelling with the batch's labels), no teacher.
    - ``attention_transfer``: layer-local. Each partial layer's attention output (the context vectors before the
      output projection, (B, T, H·D)) on the **teacher's** input to that layer, matched to the teacher's attention
      output by MSE over the real (unpadded) tokens, averaged over the partial layers. One teacher pass gives every
      layer's input and target, so all layers train at once and an error in one layer does not reach the next
      (LoLCATs, Hedgehog). What trains is `attention_transfer_parameters`: R (and bias), also the query/key
      weights, or what the caller left trainable (LoRA adapters from peft).
    - ``distill_kl``: end to end, KL(teacher ‖ student) of the MLM distributions (temperature τ, scaled by τ²) at
      every real token; needs MLM heads.
    - ``distill_hidden``: end to end, MSE of every layer's hidden states (embeddings and each layer's output) over
      the real tokens, averaged over layers.
    - ``distill``: ``distill_kl`` (where the model has an MLM head) plus ``distill_hidden``.
    - ``embedding``: the sentence embedding, mean of the last hidden states over real tokens and L2-normalised (what
      ``sentence-transformers/all-MiniLM-L6-v2`` computes), matched by squared distance summed over the embedding:
      ``‖e_s − e_t‖² = 2 (1 − cos)``, so the term is twice the mean cosine distance to the teacher's embedding (the
      quantity a retrieval user sees; sentence-transformers' ``MSELoss`` on normalised embeddings, times the
      width).
    """

    weights: dict[str, float]

    @property
    def terms(self) -> tuple[str, ...]:
        return tuple(self.weights)

    @property
    def needs_teacher(self) -> bool:
        return any(term != "mlm" for term in self.weights)

    @property
    def is_model_loss(self) -> bool:
        """Only the model's own loss (``mlm``): the trainer's plain path, nothing added."""
        return self.terms == ("mlm",)


def parse_recovery_objective(objective: str, weights: str | None = None, has_mlm_head: bool = True
                             ) -> RecoveryObjective:
    """``"attention_transfer,distill"`` → the terms and weights (``weights``: comma-separated floats, one per term
    as written, aliases counting once; default 1 each). ``distill`` drops its KL term for models without an MLM
    head.

    Raises:
        ValueError: on an unknown or repeated term, a weight list of the wrong length, or a negative weight.
    """
    written = [t.strip() for t in objective.split(",") if t.strip()]
    if not written:
        raise ValueError(f"recovery_objective={objective!r} names no term; use one or more of "
                         f"{(*RECOVERY_TERMS, *_ALIASES)}, comma-separated.")
    values = [1.0] * len(written)
    if weights not in (None, ""):
        try:
            values = [float(w) for w in weights.split(",")]
        except ValueError as err:
            raise ValueError(f"recovery_weights must be comma-separated numbers, got {weights!r}.") from err
        if len(values) != len(written):
            raise ValueError(f"recovery_weights={weights!r} has {len(values)} values for the {len(written)} terms of "
                             f"recovery_objective={objective!r}; give one per term.")
    out: dict[str, float] = {}
    for term, weight in zip(written, values):
        if weight < 0:
            raise ValueError(f"recovery_weights: the weight of {term!r} is {weight}; weights must be >= 0.")
        expanded = _ALIASES.get(term, (term,))
        for name in expanded:
            if name not in RECOVERY_TERMS:
                raise ValueError(f"recovery_objective has the unknown term {term!r}; use one or more of "
                                 f"{(*RECOVERY_TERMS, *_ALIASES)}, comma-separated.")
            if name == "distill_kl" and term == "distill" and not has_mlm_head:
                continue  # the alias means "what the model has": hidden states only without an MLM head
            if name in out:
                raise ValueError(f"recovery_objective={objective!r} lists {name!r} twice.")
            out[name] = weight
    if "distill_kl" in out and not has_mlm_head:
        raise ValueError("recovery_objective has distill_kl, which needs an MLM head (*ForMaskedLM: "
                         "BertForMaskedLM, PartialRobertaForMaskedLM, ...); use distill_hidden or embedding for this "
                         "model.")
    return RecoveryObjective(out)
