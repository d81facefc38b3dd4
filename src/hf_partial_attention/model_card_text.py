"""The Markdown sections of this project's model cards: P and R, the cost, where the pattern came from, training,
and how to load the folder. `model_card.build_model_card` assembles them.

Imported by `model_card`; not part of the remote-code bundle.
"""

from __future__ import annotations

from typing import Any

from .cost import bucket_savings, score_cost, score_dim, score_terms
from .partial_places import head_count, own_patterns, r_trainable, tensor_names

__all__ = ["partial_section", "provenance_section", "training_section", "loading_section", "PLACEHOLDER",
           "UNTRAINED_WARNING"]

# Where the snippets load from when the card names no Hub repo; a user (or a test) puts the folder's path there.
PLACEHOLDER = "path/to/this/folder"
UNTRAINED_WARNING = ("The paper finds that a model converted without retraining performs poorly: fine-tune it "
                     "(`examples/pretrain_mlm.py`, `examples/finetune_mnli.py` or "
                     "`hf_partial_attention.training.PartialAttentionTrainer`) before use.")
_METHODS = {"greedy": "greedy P", "local_prior": "the k nearest keys with R from a stationary prior "
            "(`AttentionPattern.local`)", "exact": "every score exact (k = n)"}


def _exact_layers_phrase(layers: list[int], total: int) -> str:
    exact = [layer for layer in range(total) if layer not in layers]
    if exact == [total - 1]:
        return "the last layer stays exact, as in the paper"
    if not exact:
        return "every layer is partial; the paper keeps the last layer exact"
    return f"layers {exact} stay exact; the paper keeps only the last layer exact"


def _names(prefix: str, paths: tuple[str, str] | None) -> tuple[str, str]:
    """(pattern owner's path with a trailing dot, layer l's attention module path with ``{l}``): BERT's by default."""
    owner, layer = paths or ("encoder.", "encoder.layer.{l}.attention.self")
    return prefix + owner, prefix + layer


def _buckets_section(config, prefix: str, d_head: int, paths: tuple[str, str] | None = None) -> str:
    """The length buckets' table (empty for one bucket): each bucket's P and R names and its saving."""
    lengths = list(getattr(config, "partial_lengths", None) or [config.partial_seq_len])
    if len(lengths) == 1:
        return ""
    k, n = config.partial_k, config.partial_seq_len
    ks = list(getattr(config, "partial_lengths_k", None) or [min(k, b) for b in lengths])
    savings = bucket_savings(lengths, ks, d_head)
    owner, layer = _names(prefix, paths)

    def names(b: int) -> str:
        if ks[lengths.index(b)] == b and b != n:
            return "exact (k = b)"
        return _tensor_list(tensor_names(config, owner, layer, b))

    rows = "\n".join(f"| {b} | {kb} | {names(b)} | {100 * savings[b]:.1f} % |" for b, kb in zip(lengths, ks))
    return f"""- **Length buckets** {lengths}: each bucket b holds its own P (b, k_b) and R (b, b − k_b, k_b), fitted on
  inputs of that length; a sequence of T tokens runs the smallest bucket b ≥ T, chosen from its own attention mask, as
  if padded to b. Buckets with k_b = b run exact attention. Saving of QKᵀ per query and head in each bucket:

| bucket b | k_b | P and R | saving |
|---:|---:|---|---:|
{rows}
"""


def _tensor_list(names: dict[str, str]) -> str:
    """P, R and the bias by their full names (`partial_places.tensor_names`)."""
    return "; ".join(f"{'P' if kind == 'P' else 'R' if kind == 'R' else 'its bias'} `{name}`"
                     for kind, name in names.items())


def _layers_k_section(config, d_head: int) -> str:
    """The k of each partial layer (``partial_layers_k``, from ``derive --saving``; empty when the layers share k)."""
    rows = getattr(config, "partial_layers_k", None)
    if not rows:
        return ""
    lengths = list(config.partial_lengths)
    saving = {layer: score_cost(lengths[-1], row[-1], d_head).saving for layer, row in zip(config.partial_layers, rows)}
    lines = "\n".join(f"| {layer} | " + " | ".join(str(k) for k in row) + f" | {100 * saving[layer]:.1f} % |"
                      for layer, row in zip(config.partial_layers, rows))
    return f"""- **A k per layer** (`partial_layers_k`, chosen by `derive --saving` to spend the QKᵀ budget \
where the greedy's
  error falls most); k = the largest of them above, each layer's P (n, k_l) and R (n, n − k_l, k_l):

| layer | {" | ".join(f"k at b = {b}" for b in lengths)} | saving at n |
|---:|{"---:|" * len(lengths)}---:|
{lines}
"""


def _d_phrase(config, d_head: int) -> str:
    terms = score_terms(config)
    if terms == 1:
        return str(d_head)
    return (f"{d_head} ({d_head // terms} per head times the score's {terms} terms: content and position, each "
            "computed at P)")


def partial_section(config, prefix: str, paths: tuple[str, str] | None = None) -> str:
    """P and R (names, shapes, R mode) and the attention cost of a partial config; ``paths``: where the model holds
    the pattern modules and layer l's attention (`_names`; BERT's layout by default)."""
    owner, layer_path = _names(prefix, paths)
    n, k = config.partial_seq_len, config.partial_k
    layers, total = list(config.partial_layers), config.num_hidden_layers
    d_head = score_dim(config)  # d_h, times the score's terms where it has several (DeBERTa-v2)
    cost = score_cost(n, k, d_head).per_query(n)  # one query row: k·d_h exact, (n−k)·k reconstructed
    layers_k = getattr(config, "partial_layers_k", None)
    # a k per layer: each layer's own saving (their mean in the partial layers)
    layer_savings = ([score_cost(n, row[-1], d_head).saving for row in layers_k] if layers_k
                     else [cost.saving] * len(layers))
    model_saving = sum(layer_savings) / total
    partial_saving = sum(layer_savings) / max(len(layers), 1)
    names = tensor_names(config, owner, layer_path)
    r_name = f"`{names['R']}`" + (f" (its bias `{names['bias']}`)" if "bias" in names else "")
    mode = {
        "fixed": f"fixed: a buffer {r_name}, never trained",
        "common": f"common: one trainable tensor {r_name} shared by all partial layers",
        "per_layer": f"per layer: a trainable tensor {r_name} for each partial layer l",
    }[config.reconstruction]
    bias = " plus a per-query bias b_i" if config.partial_use_bias else ""
    p_line = (f"`{names['P']}`, an int64 buffer of shape (n, k) = ({n}, {k}), shared by all\n"
              "  partial layers and heads; it never changes during training.")
    if own_patterns(config):  # each layer (or head) its own P and R (format 4)
        held = "trainable" if r_trainable(config) else "a fixed buffer"
        per_head = head_count(config) is not None
        lead = f"H = {head_count(config)}, " if per_head else ""
        dims = "(H, n, k)" if per_head else "(n, k)"
        mode = (f"each partial layer l its own, {r_name} ({held}"
                + ("; shape (H, n, n − k, k), one R per head" if per_head else "") + ")")
        whose = "each head's own covariance (`derive --granularity head`): every head" if per_head \
            else "that layer's own covariance (`derive --granularity layer`), shared by its heads"
        p_line = (f"`{names['P']}` for each partial layer l, an int64 buffer of shape "
                  f"{dims} = ({lead}{n}, {k}),\n  fitted on {whose}"
                  + (" has its own P" if per_head else "") + "; it never changes during training.")
    return f"""## Partial attention: P and R

In layers {layers} (of {total}; {_exact_layers_phrase(layers, total)}), query i computes the exact
pre-softmax scores `a_ij = q_i·k_j / sqrt(d_h)` only for the **k = {k}** keys j in its set **P_i** (of n = {n}
positions) and reconstructs the other n − k = {n - k} scores linearly, `a_(P̄_i) = R_i a_(P_i)`{bias}, before the
padding mask and the softmax.

- **P**: {p_line}
- **R**: shape (n, n − k, k) = ({n}, {n - k}, {k}); {mode}.
- Inputs must have at most n = {n} tokens; shorter inputs behave as if padded with zero scores.
{_buckets_section(config, prefix, d_head, paths)}{_layers_k_section(config, d_head)}
## Attention cost

Multiply-adds of the scores QKᵀ per query and head: exact part `k·d_h`, reconstruction `(n − k)·k`, dense
`n·d_h`, so

    saving = 1 − (k·d_h + (n − k)·k) / (n·d_h)

Here n = {n}, k = {k}, d_h = {_d_phrase(config, d_head)}: {cost.total} instead of {cost.dense}
multiply-adds, {_saving_phrase(cost.saving, layers_k, partial_saving)}, {100 * model_saving:.1f} % of
the model's QKᵀ over all {total} layers. Softmax and the product with V are unchanged; wall-clock gains depend
on the kernel.
"""


def _saving_phrase(saving: float, layers_k, partial_saving: float) -> str:
    if not layers_k:
        return f"a saving of **{100 * saving:.1f} %** in each partial layer"
    return (f"a saving of {100 * saving:.1f} % at the largest k; at each layer's own k (table above) **"
            f"{100 * partial_saving:.1f} %** over the partial layers")


def _method(record: dict[str, Any]) -> str:
    method = record.get("method")
    if not method:
        return "a method the pattern file does not record"
    family = record.get("family")
    text = _METHODS.get(method) or (f"greedy P within the `{family}` family" if family else f"method `{method}`")
    if record.get("objective") and record["objective"] != "paper":
        text += f" (objective `{record['objective']}`)"
    return text


def _error(value: Any) -> str | None:
    return None if value is None else f"{float(value):.4f}"


def provenance_section(record: dict[str, Any]) -> str:
    """Where P and R came from, from a conversion record (`model_card.conversion_record`): the pattern file, its
    method, source model and data, its predicted and held-out errors, and the command that made the checkpoint."""
    n, k = record.get("seq_len"), record.get("k")
    fitted = record.get("covariance")
    where = (" pooled over all layers and heads" if record.get("layer") is None
             else f" of layer {record['layer']}" + ("" if record.get("head") is None else f", head {record['head']}"))
    sequences = record.get("num_sequences")
    data = (f"{sequences} windows of n = {n} tokens" if sequences is not None
            else "a number of windows the pattern file does not record")
    source = f"`{record['source_model']}`" if record.get("source_model") else "a model the pattern file does not name"
    fitted = {"centered": "covariance", "second_moment": "second moment"}.get(fitted, fitted)
    fit = (f", R at its optimum (eq. 7 of the paper) for the {fitted} of the per-query "
           f"pre-softmax scores of {source},{where}, over {data}" if fitted else f"; derived on {source}")
    predicted = _error(record.get("predicted_normalized_error"))
    heldout = _error(record.get("heldout_normalized_error"))
    windows = f" on {record['heldout_windows']} held-out windows" if heldout and record.get("heldout_windows") else ""
    rows = ["| normalized reconstruction error | value |", "|---|---|",
            f"| predicted from the covariance | {predicted or 'not recorded'} |",
            f"| held-out, measured by `derive`{windows} | {heldout or 'not measured'} |"]
    note = ("" if heldout or not predicted else
            "\nThe held-out error was not measured (`derive` found no held-out windows, or ran "
            "without evaluation): the predicted error, fitted on the same windows, can be far below it.\n")
    command = record.get("command")
    made = (f"Made with:\n\n    {command}\n" if command
            else "Made with `hf_partial_attention.analysis.workflow.convert` (no command line recorded).\n")
    other = record.get("converted_model")
    into = (f" The pattern was derived on {source} and installed in `{other}`, another model: the errors are "
            f"{source}'s." if other and record.get("source_model") and other != record["source_model"] else "")
    return (f"P and R are those of `{record.get('pattern_file', 'the pattern file')}` (k = {k}, n = {n}): "
            f"{_method(record)}{fit}.{into}\n\n" + "\n".join(rows) + "\n" + note + "\n" + made)


def training_section(training_details: str | None, record: dict[str, Any] | None, untrained_conversion: bool,
                     base: str) -> str:
    """The Training section: what the trainer wrote, else the state of a conversion (see `build_model_card`)."""
    if training_details:
        return training_details
    if untrained_conversion:
        return ("No training: **converted, not retrained.** `hf-partial-attention convert` kept every weight of "
                f"{base} and installed P and R; nothing was trained since. {UNTRAINED_WARNING}")
    if record:
        return ("Not recorded. This checkpoint comes from a conversion (see where the pattern came from); unless it "
                f"was trained since, it is an untrained conversion. {UNTRAINED_WARNING}")
    return "Not recorded."


def _usage(auto: str) -> str:
    if auto == "AutoModelForMaskedLM":
        return ('inputs = tokenizer("Partial attention [MASK] most scores.", return_tensors="pt")\n'
                "logits = model(**inputs).logits  # (batch, tokens, vocabulary)")
    return ('inputs = tokenizer("Partial attention reconstructs most scores.", return_tensors="pt")\n'
            "outputs = model(**inputs)")


def loading_section(auto: str, where: str, *, hub: bool, sentence_transformers: bool, tokenizer_saved: bool | None,
                    tokenizer_hint: str | None) -> str:
    """How to load: snippets that run as printed on the folder (with the plugin, without it, sentence-transformers).

    Without the plugin the tokenizer also needs ``trust_remote_code=True``: ``AutoTokenizer`` reads ``config.json``,
    whose ``partial_bert`` config is remote code, and would otherwise ask on stdin."""
    pin = ', revision="<commit sha>"' if hub else ""
    usage = _usage(auto)
    blocks = []
    if sentence_transformers:
        blocks.append(f"""With sentence-transformers (with or without the plugin; pooling and normalisation of the
source are in this folder, and inputs are truncated to n tokens):

```python
from sentence_transformers import SentenceTransformer

model = SentenceTransformer("{where}", trust_remote_code=True{pin})
embeddings = model.encode(["Partial attention reconstructs most scores."])
```
""")
    blocks.append(f"""With the plugin installed (`pip install hf-partial-attention`):

```python
import hf_partial_attention  # registers `partial_bert` with the Auto classes
from transformers import {auto}, AutoTokenizer

model = {auto}.from_pretrained("{where}")
tokenizer = AutoTokenizer.from_pretrained("{where}")
{usage}
```

Without the plugin, the modeling code saved next to the weights runs (read it first{'; pin a revision' if hub else ''});
the tokenizer needs `trust_remote_code=True` too, as it reads the model's config:

```python
from transformers import {auto}, AutoTokenizer

model = {auto}.from_pretrained("{where}", trust_remote_code=True{pin})
tokenizer = AutoTokenizer.from_pretrained("{where}", trust_remote_code=True{pin})
{usage}
```
""")
    if tokenizer_saved is False:
        fix = (f'`AutoTokenizer.from_pretrained("{tokenizer_hint}").save_pretrained("{where}")`' if tokenizer_hint
               else f'`tokenizer.save_pretrained("{where}")` with the tokenizer the model was made with')
        blocks.insert(0, "When this card was written the folder held no tokenizer, and the snippets below load one "
                         f"from it: if it still holds none, save one beside the weights first, {fix}.\n")
    if auto == "AutoModelForMaskedLM":
        # transformers prints this report on every such load; the weights it names are the head's, not P or R
        blocks.append("Loading this folder with `AutoModel` instead (the bare encoder, for hidden states) prints a "
                      "load report with the masked-LM head's weights `cls.*` UNEXPECTED and `pooler.*` MISSING. "
                      "That is expected: the bare model has no such head and a masked-LM checkpoint has no pooler "
                      "(its `pooler_output` is untrained; use `last_hidden_state`). P and R load either way.\n")
    return "\n".join(blocks)
