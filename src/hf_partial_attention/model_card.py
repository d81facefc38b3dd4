"""Model cards for PartialBert checkpoints, built with `huggingface_hub.ModelCard`.

`PartialBertPreTrainedModel.save_pretrained` writes one (``README.md``) when the folder has none; ``convert``
writes one with the conversion's provenance; the training scripts rewrite it with evaluation results. A card's
front matter holds ``library_name``, ``tags``, ``pipeline_tag``, ``base_model`` (Hub ids only), ``datasets``,
``metrics`` and, with results, a ``model-index``; its body says what P and R are, k, the attention-cost saving and
its formula, where the pattern came from, the results, how it was trained (or that it was converted and not
retrained) and how to load the folder. Its sections' text is in `model_card_text`.

Imported by `hub` (card on save and push); not part of the remote-code bundle.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .architectures import UnsupportedModelError, architecture_for
from .model_card_text import PLACEHOLDER, loading_section, partial_section, provenance_section, training_section

logger = logging.getLogger(__name__)

__all__ = ["build_model_card", "write_model_card", "validate_card_metadata", "conversion_record", "CARD_TAGS",
           "SENTENCE_TRANSFORMERS_TAGS"]

# The tags of a partial model's card; the source architecture's model type goes third.
CARD_TAGS = ["partial-attention", "attention-reconstruction", "custom_code"]
# what sentence-transformers' own cards carry (sentence_transformers.base.model_card), plus transformers: the folder
# loads with AutoModel as well
SENTENCE_TRANSFORMERS_TAGS = ["sentence-transformers", "sentence-similarity", "feature-extraction", "transformers"]
PAPER = "Eigen Analysis of Self-Attention and its Reconstruction from Partial Computation"
ARXIV = "https://arxiv.org/abs/2106.08823"
_PIPELINES = {"MaskedLM": "fill-mask", "SequenceClassification": "text-classification",
              "TokenClassification": "token-classification", "QuestionAnswering": "question-answering"}
_AUTO = {"fill-mask": "AutoModelForMaskedLM", "text-classification": "AutoModelForSequenceClassification",
         "token-classification": "AutoModelForTokenClassification",
         "question-answering": "AutoModelForQuestionAnswering", "feature-extraction": "AutoModel",
         "sentence-similarity": "AutoModel"}
_REQUIRED = ("library_name", "tags", "pipeline_tag")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt")
# the pattern metadata (selection._fit_metadata, select_patterns, derive) a conversion record keeps
_RECORDED = {"scope": "scope", "method": "method", "family": "family", "objective": "objective",
             "covariance": "covariance", "num_sequences": "num_sequences", "layer": "layer", "head": "head",
             "normalized_error": "predicted_normalized_error",
             "heldout_normalized_error": "heldout_normalized_error", "heldout_windows": "heldout_windows"}


def conversion_record(pattern, pattern_path: str | os.PathLike, source_model: str,
                      command: str | None = None) -> dict[str, Any]:
    """What a card says of a converted checkpoint's pattern, from the pattern and its file's metadata.

    ``source_model`` names the model the pattern was derived on (a Hub id, or a folder's name: never a path of
    this machine). `convert` stores the record as ``config.partial_conversion``, so every later card of the
    checkpoint (a push, a trainer's) still says where P and R came from.
    """
    meta = pattern.metadata
    record = {"pattern_file": os.path.basename(os.fspath(pattern_path)), "seq_len": pattern.seq_len, "k": pattern.k,
              "source_model": source_model, "command": command}
    record.update({out: meta[key] for key, out in _RECORDED.items() if meta.get(key) is not None})
    return record


def _pipeline(model, sentence_transformers: bool) -> str:
    name = type(model).__name__
    if sentence_transformers and not any(name.endswith(f"For{suffix}") for suffix in _PIPELINES):
        return "sentence-similarity"
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


def _as_list(value: str | list[str] | None) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _base_line(hub_bases: list[str], local_bases: list[str], record: dict[str, Any] | None) -> str:
    """The body's sentence on the base model (the metadata holds Hub ids only)."""
    if hub_bases:
        links = ", ".join(f"[{b}](https://huggingface.co/{b})" for b in hub_bases)
        return f"Base model: {links}.\n"
    if local_bases:  # a path of the machine that wrote the card: its folder's name only
        names = ", ".join(f"`{os.path.basename(os.path.normpath(b))}`" for b in local_bases)
        return f"Base model: the local checkpoint {names}, which names no Hub repo (`base_model` is left out).\n"
    if record:
        source = f" (`{record['source_model']}`)" if record.get("source_model") else ""
        return (f"Base model: no Hub id is recorded for the source{source}, so `base_model` is left out of the "
                "metadata (`hf-partial-attention analyze --model-id <org/name>` records one).\n")
    return ""


def _display_name(model_type: str) -> str:
    """How the card names the source architecture of a (partial or source) model type: its table entry's
    `display_name`, else the source model type."""
    source_type = model_type.removeprefix("partial_")
    try:
        return architecture_for(model_type).display_name or source_type
    except UnsupportedModelError:
        return source_type


def _tensor_paths(model) -> tuple[str, str] | None:
    """Where ``model``'s base holds its pattern modules and layer l's attention (`model_card_text._names`), or None
    (BERT's layout) for a model without them."""
    if not hasattr(model, "_partial_owner"):
        return None
    base = model.base_model
    names = {id(module): name for name, module in base.named_modules()}
    owner = names[id(model._partial_owner())]
    layer_idx, attention = model._partial_arch.attention_modules(base)[0]
    layer = names[id(attention)].replace(f".{layer_idx}.", ".{l}.", 1)
    return (owner + "." if owner else ""), layer


def _title(model_name: str | None, config, bases: list[str], record: dict[str, Any] | None) -> str:
    """The model's own name: given, else the folder it was loaded from, else its source's with k."""
    if model_name:
        return model_name
    loaded = os.path.basename(os.path.normpath(str(getattr(config, "_name_or_path", "") or "")))
    if loaded and loaded != ".":
        return loaded
    source = (bases[0] if bases else (record or {}).get("source_model")) or ""
    if source and str(getattr(config, "model_type", "")).startswith("partial_"):
        return f"{os.path.basename(os.path.normpath(source))} with partial attention (k = {config.partial_k})"
    return "partial-bert"


_CITATION = f"""## Citation

```bibtex
@article{{bhojanapalli2021eigen,
  title   = {{{PAPER}}},
  author  = {{Bhojanapalli, Srinadh and others}},
  journal = {{arXiv preprint arXiv:2106.08823}},
  year    = {{2021}}
}}
```
"""


def _card_tags(config, partial: bool, pipeline: str, sentence_transformers: bool, tags: list[str] | None
               ) -> list[str]:
    """The card's tags: this project's (the source model type third) or a baseline's, the client's, the pipeline,
    the caller's; each once."""
    source_type = str(getattr(config, "model_type", "")).removeprefix("partial_")
    ours = [*CARD_TAGS[:2], source_type, *CARD_TAGS[2:]] if partial else [source_type, "partial-attention-baseline"]
    return list(dict.fromkeys([*ours, *(SENTENCE_TRANSFORMERS_TAGS if sentence_transformers else []), pipeline,
                               *(tags or [])]))


def _method_and_source(model, partial: bool, record: dict[str, Any] | None, pattern_source: str | None,
                       architecture: str) -> tuple[str, str]:
    """The card's method section (P, R and where they live) and where the pattern came from."""
    if not partial:
        method = (f"## Exact attention\n\nThis is an exact-attention {architecture}, the baseline of a "
                  "partial-attention comparison: every score is computed (k = n, no saving).\n")
        return method, pattern_source or "none (exact attention)"
    prefix = f"{model.base_model_prefix}." if model.base_model_prefix in model._modules else ""
    method = partial_section(model.config, prefix, _tensor_paths(model))
    return method, pattern_source or (provenance_section(record) if record else "not recorded")


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
    untrained_conversion: bool = False,
    sentence_transformers: bool = False,
    tokenizer_saved: bool | None = None,
) -> ModelCard:
    """A model card for a PartialBert (or, for baselines, a plain BERT) model.

    Args:
        model: the model; its config gives n, k, d_h, the partial layers, the R mode and, for a checkpoint written
            by ``convert``, the conversion record (``partial_conversion``, see `conversion_record`).
        model_name: the card's title and the model-index name (default: the folder it was loaded from, else
            "<source model> with partial attention (k = k)").
        base_model: Hub id(s) of the checkpoint it was converted or fine-tuned from (default: the config's
            ``partial_base_model``); local paths are named in the body only, by their folder's name.
        datasets: Hub ids of the training data (or short names of local data).
        pattern_source: where P and R came from (default: from the conversion record, else "not recorded").
        eval_results: `EvalResult` objects or their keyword dicts (``task_type``, ``dataset_type``,
            ``dataset_name``, ``metric_type``, ``metric_value``, optional ``dataset_config``, ``dataset_split``,
            ``metric_name``).
        training_details: a Markdown paragraph on how it was trained (data, steps, command); a trainer's card
            gives it, and the card then no longer calls the checkpoint an untrained conversion.
        repo_id: shown in the loading snippets (default: a placeholder path, ``path/to/this/folder``).
        untrained_conversion: the card is written by ``convert``, before any training: it says "converted, not
            retrained" (the paper finds such a model performs poorly).
        sentence_transformers: the folder also holds sentence-transformers modules: the card takes their library
            name, pipeline tag and tags, and a SentenceTransformer snippet.
        tokenizer_saved: whether the folder holds a tokenizer (None: unknown); when False the card says how to
            add one, since its snippets load it from the folder.
    """
    config = model.config
    record = getattr(config, "partial_conversion", None) or None
    if base_model is None:  # recorded by from_bert / convert
        base_model = getattr(config, "partial_base_model", None)
    bases = _as_list(base_model)
    local_bases = [b for b in bases if os.path.exists(b) or os.path.isabs(b)]
    hub_bases = [b for b in bases if b not in local_bases]  # the Hub's base_model must name Hub repos
    name = _title(model_name, config, hub_bases + local_bases, record)
    results = _eval_results(eval_results)
    data = _card_data(model, name, hub_bases, results, datasets=datasets, license=license, language=language,
                      tags=tags, sentence_transformers=sentence_transformers)
    body = _markdown(model, name, record, hub_bases, local_bases, results, pattern_source=pattern_source,
                     training_details=training_details, untrained_conversion=untrained_conversion, repo_id=repo_id,
                     sentence_transformers=sentence_transformers, tokenizer_saved=tokenizer_saved)
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")
    validate_card_metadata(card)
    return card


def _is_partial(config) -> bool:
    return str(getattr(config, "model_type", "")).startswith("partial_")


def _card_data(model, name: str, hub_bases: list[str], results: list[EvalResult], *, datasets, license, language,
               tags: list[str] | None, sentence_transformers: bool) -> ModelCardData:
    """The card's metadata (front matter): library, tags, pipeline, Hub base model, datasets, metrics, results."""
    config = model.config
    pipeline = _pipeline(model, sentence_transformers)
    return ModelCardData(
        library_name="sentence-transformers" if sentence_transformers else "transformers",
        tags=_card_tags(config, _is_partial(config), pipeline, sentence_transformers, tags), pipeline_tag=pipeline,
        base_model=(hub_bases[0] if len(hub_bases) == 1 else hub_bases) or None, datasets=datasets,
        metrics=sorted({r.metric_type for r in results}) or None, license=license, language=language,
        model_name=name, eval_results=results or None,
    )


def _markdown(model, name: str, record: dict[str, Any] | None, hub_bases: list[str], local_bases: list[str],
              results: list[EvalResult], *, pattern_source: str | None, training_details: str | None,
              untrained_conversion: bool, repo_id: str | None, sentence_transformers: bool,
              tokenizer_saved: bool | None) -> str:
    """The card's Markdown below its metadata: each section of `_body` written for this model."""
    config = model.config
    partial = _is_partial(config)
    pipeline = _pipeline(model, sentence_transformers)
    architecture = _display_name(str(getattr(config, "model_type", "")))
    method, source = _method_and_source(model, partial, record, pattern_source, architecture)
    base_name = f"`{hub_bases[0]}`" if hub_bases else (f"`{record['source_model']}`" if record and
                                                       record.get("source_model") else "the source model")
    sections = {
        "status": ("\n**Converted, not retrained**: see Training below before using it.\n"
                   if untrained_conversion and not training_details else ""),
        "base": _base_line(hub_bases, local_bases, record), "method": method, "source": source,
        "results": _results_table(results),
        "training": training_section(training_details, record if partial else None, untrained_conversion, base_name),
        "loading": loading_section(_AUTO[pipeline], repo_id or PLACEHOLDER, hub=repo_id is not None,
                                   sentence_transformers=sentence_transformers, tokenizer_saved=tokenizer_saved,
                                   tokenizer_hint=hub_bases[0] if hub_bases else None)}
    return _body(name, architecture, partial, sections)


def _body(name: str, architecture: str, partial: bool, sections: dict[str, str]) -> str:
    """The card's Markdown below its metadata, from the sections `build_model_card` wrote."""
    return f"""
# {name}

A {architecture}{' with **partial attention**' if partial else ''} made with `hf-partial-attention`, a HuggingFace
Transformers plugin implementing Bhojanapalli et al. (2021), *{PAPER}* ({ARXIV}).
{sections["status"]}
{sections["base"]}
{sections["method"]}
## Where the pattern came from

{sections["source"]}

## Evaluation results

{sections["results"]}

## Training

{sections["training"]}

## How to load

{sections["loading"]}
{_CITATION}"""


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
    """Write ``README.md`` into `save_directory` (kept if it exists, unless `overwrite`); returns its path or None.

    Unless given, ``sentence_transformers`` and ``tokenizer_saved`` (`build_model_card`) are read from the folder:
    sentence-transformers modules (``modules.json``) and tokenizer files there."""
    folder = os.fspath(save_directory)
    path = os.path.join(folder, "README.md")
    if os.path.exists(path) and not overwrite:
        logger.info("%s exists: model card not written (pass overwrite=True to replace it).", path)
        return None
    card_kwargs.setdefault("sentence_transformers", os.path.isfile(os.path.join(folder, "modules.json")))
    card_kwargs.setdefault("tokenizer_saved", any(os.path.isfile(os.path.join(folder, f)) for f in _TOKENIZER_FILES))
    build_model_card(model, **card_kwargs).save(path)
    return path
