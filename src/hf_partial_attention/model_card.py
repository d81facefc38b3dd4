"""Model cards for PartialBert checkpoints, built with `huggingface_hub.ModelCard`.

`PartialBertPreTrainedModel.save_pretrained` writes one (``README.md``) when the folder has none; the training
scripts rewrite it with evaluation results. A card's front matter holds ``library_name``, ``tags``,
``pipeline_tag``, ``base_model``, ``datasets``, ``metrics`` and, with results, a ``model-index``; its body says
what P and R are, k, the attention-cost saving and its formula, where the pattern came from, the results and
how to load the model.

Imported by `hub` (card on save and push); not part of the remote-code bundle.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .cost import score_cost

logger = logging.getLogger(__name__)

__all__ = ["build_model_card", "write_model_card", "validate_card_metadata", "CARD_TAGS"]

CARD_TAGS = ["partial-attention", "attention-reconstruction", "bert", "custom_code"]
PAPER = "Eigen Analysis of Self-Attention and its Reconstruction from Partial Computation"
ARXIV = "https://arxiv.org/abs/2106.08823"
_PIPELINES = {"MaskedLM": "fill-mask", "SequenceClassification": "text-classification",
              "TokenClassification": "token-classification", "QuestionAnswering": "question-answering"}
_AUTO = {"fill-mask": "AutoModelForMaskedLM", "text-classification": "AutoModelForSequenceClassification",
         "token-classification": "AutoModelForTokenClassification",
         "question-answering": "AutoModelForQuestionAnswering", "feature-extraction": "AutoModel"}
_REQUIRED = ("library_name", "tags", "pipeline_tag")


def _pipeline(model) -> str:
    name = type(model).__name__
    return next((tag for suffix, tag in _PIPELINES.items() if name.endswith(f"For{suffix}")), "feature-extraction")


def _eval_results(results: list[Any] | None) -> list[EvalResult]:
    out = []
    for item in results or []:
        out.append(item if isinstance(item, EvalResult) else EvalResult(**item))
    return out


def _results_table(results: list[EvalResult]) -> str:
    if not results:
        return "Not evaluated yet."
    rows = ["| task | dataset | split | metric | value |", "|---|---|---|---|---|"]
    for r in results:
        name = r.dataset_name + (f" ({r.dataset_config})" if r.dataset_config else "")
        value = f"{r.metric_value:.4f}" if isinstance(r.metric_value, float) else str(r.metric_value)
        metric = r.metric_name or r.metric_type
        rows.append(f"| {r.task_type} | {name} | {r.dataset_split or ''} | {metric} | {value} |")
    return "\n".join(rows)


def _exact_layers_phrase(layers: list[int], total: int) -> str:
    exact = [layer for layer in range(total) if layer not in layers]
    if exact == [total - 1]:
        return "the last layer stays exact, as in the paper"
    if not exact:
        return "every layer is partial; the paper keeps the last layer exact"
    return f"layers {exact} stay exact; the paper keeps only the last layer exact"


def _partial_section(config, prefix: str) -> str:
    n, k = config.partial_seq_len, config.partial_k
    layers, total = list(config.partial_layers), config.num_hidden_layers
    d_head = config.hidden_size // config.num_attention_heads
    cost = score_cost(n, k, d_head).per_query(n)  # one query row: k·d_h exact, (n−k)·k reconstructed
    model_saving = cost.saving * len(layers) / total
    mode = {
        "fixed": f"fixed: a buffer `{prefix}encoder.partial_pattern.reconstruction`, never trained",
        "common": f"common: one trainable tensor `{prefix}encoder.partial_pattern.reconstruction` shared by all "
                  "partial layers",
        "per_layer": f"per layer: a trainable tensor `{prefix}encoder.layer.{{l}}.attention.self.reconstruction` "
                     "for each partial layer l",
    }[config.reconstruction]
    bias = " plus a per-query bias b_i" if config.partial_use_bias else ""
    return f"""## Partial attention: P and R

In layers {layers} (of {total}; {_exact_layers_phrase(layers, total)}), query i computes the exact
pre-softmax scores `a_ij = q_i·k_j / sqrt(d_h)` only for the **k = {k}** keys j in its set **P_i** (of n = {n}
positions) and reconstructs the other n − k = {n - k} scores linearly, `a_(P̄_i) = R_i a_(P_i)`{bias}, before the
padding mask and the softmax.

- **P**: `{prefix}encoder.partial_pattern.indices`, an int64 buffer of shape (n, k) = ({n}, {k}), shared by all
  partial layers and heads; it never changes during training.
- **R**: shape (n, n − k, k) = ({n}, {n - k}, {k}); {mode}.
- Inputs must have at most n = {n} tokens; shorter inputs behave as if padded with zero scores.

## Attention cost

Multiply-adds of the scores QKᵀ per query and head: exact part `k·d_h`, reconstruction `(n − k)·k`, dense
`n·d_h`, so

    saving = 1 − (k·d_h + (n − k)·k) / (n·d_h)

Here n = {n}, k = {k}, d_h = {d_head}: {cost.total} instead of {cost.dense}
multiply-adds, a saving of **{100 * cost.saving:.1f} %** in each partial layer, {100 * model_saving:.1f} % of
the model's QKᵀ over all {total} layers. Softmax and the product with V are unchanged; wall-clock gains depend
on the kernel.
"""


def build_model_card(
    model,
    *,
    model_name: str | None = None,
    base_model: str | list[str] | None = None,
    datasets: str | list[str] | None = None,
    pattern_source: str | None = None,
    eval_results: list[EvalResult | dict[str, Any]] | None = None,
    training_details: str | None = None,
    license: str | None = None,
    language: str | list[str] | None = "en",
    tags: list[str] | None = None,
    repo_id: str | None = None,
) -> ModelCard:
    """A model card for a PartialBert (or, for baselines, a plain BERT) model.

    Args:
        model: the model; its config gives n, k, d_h, the partial layers and the R mode.
        model_name: the card's title and the model-index name (default: the config's ``_name_or_path``).
        base_model: Hub id(s) of the checkpoint it was converted or fine-tuned from (default: the config's
            ``partial_base_model``, set by `from_bert`); local paths are named in the body only.
        datasets: Hub ids of the training data (or short names of local data).
        pattern_source: where P and R came from (a pattern file and its derivation, "the checkpoint", ...).
        eval_results: `EvalResult` objects or their keyword dicts (``task_type``, ``dataset_type``,
            ``dataset_name``, ``metric_type``, ``metric_value``, optional ``dataset_config``, ``dataset_split``,
            ``metric_name``).
        training_details: a Markdown paragraph on how it was trained (data, steps, command).
        repo_id: shown in the loading snippet (default: a placeholder path).
    """
    config = model.config
    if base_model is None:  # recorded by from_bert
        base_model = getattr(config, "partial_base_model", None)
    local_bases = [b for b in ([base_model] if isinstance(base_model, str) else base_model or []) if os.path.exists(b)]
    if local_bases:  # the Hub's base_model must name Hub repos: local folders go to the body only
        base_model = [b for b in ([base_model] if isinstance(base_model, str) else base_model) if b not in local_bases]
        base_model = base_model or None
        training_details = (training_details or "") + f" Started from the local checkpoint(s) {local_bases}."
    name = model_name or os.path.basename(str(getattr(config, "_name_or_path", "") or "").rstrip("/")) or "partial-bert"
    pipeline = _pipeline(model)
    results = _eval_results(eval_results)
    partial = getattr(config, "model_type", None) == "partial_bert"
    card_tags = list(dict.fromkeys([*(CARD_TAGS if partial else ["bert", "partial-attention-baseline"]),
                                    pipeline, *(tags or [])]))
    data = ModelCardData(
        library_name="transformers", tags=card_tags, pipeline_tag=pipeline, base_model=base_model,
        datasets=datasets, metrics=sorted({r.metric_type for r in results}) or None, license=license,
        language=language, model_name=name, eval_results=results or None,
    )
    if partial:
        prefix = f"{model.base_model_prefix}." if model.base_model_prefix in model._modules else ""
        method = _partial_section(config, prefix)
        source = pattern_source or "not recorded"
    else:
        method = ("## Exact attention\n\nThis is an exact-attention BERT, the baseline of a partial-attention "
                  "comparison: every score is computed (k = n, no saving).\n")
        source = pattern_source or "none (exact attention)"
    auto = _AUTO[pipeline]
    where = repo_id or "path/to/this/folder"
    body = f"""
# {name}

A BERT{' with **partial attention**' if partial else ''} made with `hf-partial-attention`, a HuggingFace
Transformers plugin implementing Bhojanapalli et al. (2021), *{PAPER}* ({ARXIV}).

{method}
## Where the pattern came from

{source}

## Evaluation results

{_results_table(results)}

## Training

{training_details or 'Not recorded.'}

## How to load

```python
import hf_partial_attention  # registers `partial_bert` with the Auto classes
from transformers import {auto}, AutoTokenizer

model = {auto}.from_pretrained("{where}")
tokenizer = AutoTokenizer.from_pretrained("{where}")
```

Without the plugin installed, the modeling code saved next to the weights loads it:
`{auto}.from_pretrained("{where}", trust_remote_code=True)`.

## Citation

```bibtex
@article{{bhojanapalli2021eigen,
  title   = {{{PAPER}}},
  author  = {{Bhojanapalli, Srinadh and others}},
  journal = {{arXiv preprint arXiv:2106.08823}},
  year    = {{2021}}
}}
```
"""
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")
    validate_card_metadata(card)
    return card


def validate_card_metadata(card: ModelCard) -> None:
    """Offline checks of a card's front matter (``ModelCard.validate`` needs the Hub).

    Re-parses the metadata strictly (a malformed ``model-index`` raises) and checks the fields this project
    always writes. Raises ``ValueError`` naming the field.
    """
    meta = card.data.to_dict()
    for key in _REQUIRED:
        if not meta.get(key):
            raise ValueError(f"Model card metadata lacks {key!r}; it has {sorted(meta)}.")
    if not isinstance(meta["tags"], list) or not all(isinstance(t, str) for t in meta["tags"]):
        raise ValueError(f"Model card 'tags' must be a list of strings, got {meta['tags']!r}.")
    for key in ("base_model", "datasets"):
        value = meta.get(key)
        if value is not None and not (isinstance(value, str) or (isinstance(value, list)
                                                                 and all(isinstance(v, str) for v in value))):
            raise ValueError(f"Model card {key!r} must be a string or a list of strings, got {value!r}.")
    try:
        ModelCardData(**meta, ignore_metadata_errors=False)
    except Exception as err:  # noqa: BLE001 - report any parsing failure as invalid metadata
        raise ValueError(f"Model card metadata does not parse: {err}") from err


def write_model_card(model, save_directory: str | os.PathLike, overwrite: bool = False, **card_kwargs) -> str | None:
    """Write ``README.md`` into `save_directory` (kept if it exists, unless `overwrite`); returns its path or None."""
    path = os.path.join(os.fspath(save_directory), "README.md")
    if os.path.exists(path) and not overwrite:
        logger.info("%s exists: model card not written (pass overwrite=True to replace it).", path)
        return None
    build_model_card(model, **card_kwargs).save(path)
    return path
