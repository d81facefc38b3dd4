"""A converted MiniLM that keeps its embeddings: ``python -m experiments recover`` (`make recover`) -> a k = 16
sentence-transformers checkpoint with length buckets, recovered by distillation from the exact model, and
``results/recovery/`` (recovery.json, recovery.md).

The steps (buckets, conversion, recovery, measurement on held-out documents, checkpoint) are listed in
`run_recover`'s docstring.
"""

from __future__ import annotations

import logging
import os
import shutil
import time

from hf_partial_attention.analysis.defaults import resolve_model
from hf_partial_attention.pattern_buckets import bucket_for

from .study import LENGTHS, embedding_metrics, fit_documents, held_out_inputs, run_inputs
from ..store import write_study

logger = logging.getLogger(__name__)

__all__ = ["run_recover", "DEFAULT_OBJECTIVE"]

DEFAULT_OBJECTIVE = "attention_transfer,distill_hidden,embedding"
KINDS = ("sentences", "paragraphs", "pairs")


def _buckets(out: str, model_path: str, model_id: str, k: int, buckets: str | None, fit_inputs: int | None,
             progress: bool, bucket_k: dict[int, int] | None = None) -> str:
    """The buckets file: ``buckets`` if given; else ``buckets_k{k}[_b{b}k{k_b}]`` of the lengths study's Fisher
    buckets or of ``out/buckets`` if there, derived (``bucket_k``) where their covariances are, else fitted."""
    from hf_partial_attention.analysis.derive import derive_lengths
    from hf_partial_attention.analysis.lengths import analyze_lengths, bucket_covariance_files, bucket_k_suffix

    if buckets:
        if not os.path.isfile(buckets):
            raise FileNotFoundError(f"--buckets {buckets!r} does not exist; leave it out to fit the buckets here.")
        if bucket_k:
            raise ValueError(f"--buckets {buckets!r} and --bucket-k {bucket_k}: the file's buckets have their k "
                             "already; give one of them.")
        return buckets
    name = f"buckets_k{k}{bucket_k_suffix(bucket_k)}.safetensors"
    folders = [os.path.join(out, "buckets"), os.path.join("runs", "lengths", "buckets_16_32_64_128_fisher")]
    for folder in folders:
        if os.path.isfile(os.path.join(folder, "patterns", name)):
            return os.path.join(folder, "patterns", name)
    folder = next((f for f in folders if bucket_covariance_files(f)), None)
    if folder is None:
        folder = folders[0]
        analyze_lengths(model_path, fit_documents(), folder, lengths=LENGTHS, kind="sentence", model_id=model_id,
                        max_inputs=fit_inputs, progress=progress)
    derive_lengths(folder, [k], objective="fisher", progress=progress, bucket_k=bucket_k)
    return os.path.join(folder, "patterns", name)


def _training_set(tokenizer, n: int, max_inputs: int | None):
    """The fit documents' sentences and paragraphs, each at its own length (at most n tokens), as a `Dataset`."""
    from datasets import Dataset

    texts = [t for doc in fit_documents() for t in doc]
    if max_inputs:
        texts = texts[:: max(1, len(texts) // max_inputs)][:max_inputs]
    enc = tokenizer(texts, truncation=True, max_length=n)
    return Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                              "length": [len(x) for x in enc["input_ids"]]})


def measure(original, models: dict, tokens: dict, lengths, batch_size: int = 16) -> list[dict]:
    """Per model, kind of input and length bucket: 1 − cos and pairwise Spearman against ``original``
    (`lengths.embedding_metrics`), and the overall mean 1 − cos of each kind (bucket ``"all"``)."""
    rows = []
    for kind, tk in tokens.items():
        bucket_of = [bucket_for(list(lengths), int(x)) for x in tk.lengths]
        groups = {b: [i for i, bb in enumerate(bucket_of) if bb == b] for b in lengths}
        groups["all"] = list(range(len(bucket_of)))
        for b, index in groups.items():
            if len(index) < 3:
                continue
            ref = run_inputs(original, tk, index, batch_size)
            for name, model in models.items():
                m = embedding_metrics(ref, run_inputs(model, tk, index, batch_size))
                m.pop("one_minus_cos_each")
                rows.append({"model": name, "inputs_kind": kind, "bucket": b,
                             "lengths": [int(tk.lengths[i]) for i in index], **m})
    return rows


def _render(result: dict) -> str:
    lines = [f"# {result['model']} at k = {result['k']}: converted vs recovered by distillation", "",
             f"Command (wall time {result['total_seconds'] / 60:.1f} min; recovery {result['train_seconds']:.0f} s, "
             f"{result['steps']} steps):", "", "```", result["command"], "```", "",
             f"- Buckets {result['lengths']} (P and R per length, `{result['buckets_source']}`), per-layer R, "
             f"partial in layers {result['partial_layers']}.",
             f"- Recovery: `{result['objective']}` against the exact model, {result['train_inputs']} sentences and "
             f"paragraphs of the demo text (pydoc_data.topics) at their own lengths, batch {result['batch_size']}, lr "
             f"{result['learning_rate']:g}, R's lr {result['reconstruction_learning_rate']:g}, trained: "
             f"{result['trainable']}; R drift "
             f"{result['r_drift']:.3f} (mean ‖R − R₀‖/‖R₀‖).",
             "- Held out: prose of installed packages' descriptions (never seen in fitting or recovery); 1 − cos: mean "
             "over inputs of 1 − cosine of the mean-pooled embedding to the original model's; Spearman: of all "
             "pairwise cosine similarities against the original's.", "",
             "| inputs | bucket (T) | inputs | converted 1 − cos | recovered 1 − cos | converted Spearman | "
             "recovered Spearman |", "|---|---|---|---|---|---|---|"]
    by = {(r["model"], r["inputs_kind"], r["bucket"]): r for r in result["rows"]}
    for kind in KINDS:
        for b in [*result["lengths"], "all"]:
            c, r = by.get(("converted", kind, b)), by.get(("recovered", kind, b))
            if c is None or r is None:
                continue
            lo = "all" if b == "all" else f"{min(c['lengths'])}–{max(c['lengths'])}"
            sp = lambda x: "–" if x["spearman"] is None else f"{x['spearman']:.3f}"  # noqa: E731
            lines.append(f"| {kind} | {b} ({lo}) | {c['inputs']} | {c['one_minus_cos']:.4f} | "
                         f"{r['one_minus_cos']:.4f} | {sp(c)} | {sp(r)} |")
    goals = result["goals"]
    lines += ["", "## Goals (issue 24: 1 − cos ≤ 0.01 and Spearman ≥ 0.98 at every bucket)", "",
              f"- 1 − cos ≤ 0.01 at every bucket: **{'met' if goals['cos'] else 'not met'}** "
              f"(worst {goals['worst_cos']:.4f}).",
              f"- Spearman ≥ 0.98 at every bucket: **{'met' if goals['spearman'] else 'not met'}** "
              f"(worst {goals['worst_spearman']:.3f}).", ""]
    return "\n".join(lines)


def _goals(rows) -> dict:
    rec = [r for r in rows if r["model"] == "recovered" and r["bucket"] != "all"]
    worst_cos = max(r["one_minus_cos"] for r in rec)
    worst_sp = min(r["spearman"] for r in rec if r["spearman"] is not None)
    return {"cos": worst_cos <= 0.01, "spearman": worst_sp >= 0.98, "worst_cos": worst_cos,
            "worst_spearman": worst_sp}


def _card(model, folder: str, result: dict, model_id: str) -> None:
    from hf_partial_attention.model_card import write_model_card

    by = {(r["model"], r["inputs_kind"], r["bucket"]): r for r in result["rows"]}
    evals = []
    for name in ("converted", "recovered"):
        r = by[(name, "sentences", "all")]
        for metric, value in (("1 - cosine to the original embeddings", r["one_minus_cos"]),
                              ("Spearman of pairwise similarities with the original", r["spearman"])):
            evals.append({"task_type": "sentence-similarity", "dataset_type": "held-out-package-descriptions",
                          "dataset_name": "installed packages' descriptions, sentences (held out)",
                          "metric_type": "agreement_with_base_model",
                          "metric_name": f"{metric} ({name})", "metric_value": round(float(value), 4)})
    details = (f"Recovered by distillation from the exact {f'`{model_id}`' if model_id else 'source model'} with "
               f"`hf_partial_attention.training.PartialAttentionTrainer` (`recovery_objective={result['objective']}`), "
               f"{result['steps']} steps, batch {result['batch_size']}, on {result['train_inputs']} sentences and "
               f"paragraphs of CPython's `pydoc_data.topics` at their own lengths. Command: `{result['command']}`.\n\n"
               + _render(result).split("\n", 2)[2])
    base = model_id.split("/")[-1] if model_id else "model"  # a folder that records no Hub id: no name to reuse
    write_model_card(model, folder, overwrite=True, model_name=f"{base}-partial-k{result['k']}",
                     base_model=model_id, training_details=details, eval_results=evals, sentence_transformers=True)


def _distill(out: str, student, original, tokenizer, train, *, objective: str, steps: int, batch_size: int,
             learning_rate: float, reconstruction_learning_rate: float, seed: int, trainable: str,
             progress: bool):
    """The recovery: ``student`` trained against the exact ``original`` with ``objective`` on ``train``, resumed from
    the last checkpoint under ``out``/trainer if there is one; returns (the trainer, its training seconds)."""
    from transformers import DataCollatorWithPadding

    from hf_partial_attention.training import PartialAttentionTrainer, PartialAttentionTrainingArguments

    args = PartialAttentionTrainingArguments(
        output_dir=os.path.join(out, "trainer"), max_steps=steps, per_device_train_batch_size=batch_size,
        learning_rate=learning_rate, reconstruction_learning_rate=reconstruction_learning_rate,
        warmup_steps=steps // 20, lr_scheduler_type="cosine", weight_decay=0.01, logging_steps=max(1, steps // 30),
        save_steps=max(1, steps // 6), save_total_limit=1, group_by_length=True, seed=seed, use_cpu=True,
        report_to="none", dataloader_num_workers=0, disable_tqdm=not progress, recovery_objective=objective,
        attention_transfer_parameters=None if trainable == "all" else trainable)
    trainer = PartialAttentionTrainer(model=student, args=args, train_dataset=train,
                                      data_collator=DataCollatorWithPadding(tokenizer), teacher_model=original)
    t = time.perf_counter()
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    trainer.train(resume_from_checkpoint=last)
    return trainer, time.perf_counter() - t


def run_recover(out: str = "runs/recover", results: str = "results/recovery", model: str | None = None, *,
                k: int = 16, buckets: str | None = None, objective: str = DEFAULT_OBJECTIVE, steps: int = 300,
                batch_size: int = 32, learning_rate: float = 1e-4, reconstruction_learning_rate: float = 3e-3,
                train_inputs: int | None = None, fit_inputs: int | None = None, max_heldout: int = 600,
                seed: int = 0, trainable: str = "query_key", progress: bool = True,
                command: str | None = None, bucket_k: dict[int, int] | None = None) -> dict:
    """Buckets, conversion, recovery, measurement, checkpoint; returns the result.

    1. **Buckets.** P and R per length bucket (16, 32, 64, 128; greedy with the Fisher objective) fitted on the demo
       text's sentences and paragraphs at their own lengths (`analysis.lengths`), reused from ``--buckets`` or the
       lengths study's run folder when there.
    2. **Conversion** (`workflow.convert`, per-layer R): the unrecovered checkpoint, ``<out>/converted``.
    3. **Recovery** with `PartialAttentionTrainer`: the exact MiniLM is the teacher; the objective (default
       ``attention_transfer,distill_hidden,embedding``) on the demo text's sentences and paragraphs at their own
       lengths, batched by length; R at its own learning rate. Resumable (``<out>/trainer`` checkpoints).
    4. **Measure** on documents the fit and the recovery never saw (installed packages' descriptions,
       `lengths.held_out_documents`): per length bucket, the mean 1 − cos of the mean-pooled embeddings to the
       original model's and the Spearman correlation of all pairwise similarities with the original's, for the
       converted and the recovered model, on sentences, paragraphs and adjacent-sentence pairs.
    5. **Checkpoint** ``<out>/recovered``: weights, tokenizer, sentence-transformers modules and a card with
       ``base_model``, the numbers and the command.
    """
    from transformers import AutoTokenizer, BertModel

    from hf_partial_attention.analysis.workflow import convert
    from hf_partial_attention.modeling_partial_bert import PartialBertModel
    from hf_partial_attention.sentence_folder import write_sentence_transformers_files

    start = time.perf_counter()
    model_path, model_id = resolve_model(model)
    buckets_path = _buckets(out, model_path, model_id, k, buckets, fit_inputs, progress, bucket_k)
    converted_dir, recovered_dir = os.path.join(out, "converted"), os.path.join(out, "recovered")
    convert(buckets_path, converted_dir, model_path, reconstruction="per_layer", command=command)
    tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    original = BertModel.from_pretrained(model_path, add_pooling_layer=False).eval()
    student = PartialBertModel.from_pretrained(converted_dir, add_pooling_layer=False)
    n = student.config.partial_seq_len
    lengths = list(student.config.partial_lengths)
    train = _training_set(tokenizer, n, train_inputs)
    trainer, train_seconds = _distill(out, student, original, tokenizer, train, objective=objective, steps=steps,
                                      batch_size=batch_size, learning_rate=learning_rate,
                                      reconstruction_learning_rate=reconstruction_learning_rate, seed=seed,
                                      trainable=trainable, progress=progress)
    drift = trainer.reconstruction_stats().get("reconstruction_drift/mean", 0.0)
    student.eval()
    converted_model = PartialBertModel.from_pretrained(converted_dir, add_pooling_layer=False).eval()
    tokens, _ = held_out_inputs(tokenizer, max_heldout, 0, n)
    rows = measure(original, {"converted": converted_model, "recovered": student}, tokens, lengths)
    result = {"command": command or "python -m experiments recover", "model": model_id, "k": k,
              "lengths": lengths, "partial_layers": list(student.config.partial_layers),
              "buckets_source": os.path.basename(buckets_path), "objective": objective, "steps": steps,
              "batch_size": batch_size, "learning_rate": learning_rate,
              "reconstruction_learning_rate": reconstruction_learning_rate, "train_inputs": len(train),
              "trainable": trainable,
              "r_drift": drift, "train_seconds": train_seconds, "rows": rows,
              "log_history": [h for h in trainer.state.log_history if "loss" in h]}
    result["goals"] = _goals(rows)
    result["total_seconds"] = time.perf_counter() - start
    if os.path.isdir(recovered_dir):
        shutil.rmtree(recovered_dir)
    student.save_pretrained(recovered_dir)
    tokenizer.save_pretrained(recovered_dir)
    write_sentence_transformers_files(converted_dir, recovered_dir, n)
    _card(student, recovered_dir, result, model_id)
    write_study(results, "recovery", result, _render(result))
    return result
