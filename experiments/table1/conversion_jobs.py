"""The conversion study's jobs (`study.run_table1` runs them in order, each once): what they share
(`ConversionStudy`: the arguments, the job store, the data, the fitted patterns and the models built from them) and
one function per kind of job: phase 1, P and R, R's learning rate, conversion, phase 2, fine-tuning and timing.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from . import steps
from ..store import JobStore
from .spec import BUCKET_OBJECTIVE, Arm, StudyArguments, layers_key
from .stats import mlm_loss

__all__ = ["ConversionStudy", "phase1", "fit_patterns", "select_rate", "converted", "phase2", "finetune_arm", "timing"]


class ConversionStudy:
    """What the jobs of one run share: the arguments, the job store, the data and the fitted patterns."""

    def __init__(self, a: StudyArguments, store: JobStore, data):
        self.a, self.store, self.data = a, store, data
        self.phase1_dir = store.model_dir("phase1")
        self._patterns: dict = {}

    def pattern(self, arm: Arm):
        """The arm's `PatternBuckets` (``buckets``) or zero-fill `AttentionPattern` of n (``zero_fill``); P and R per
        layer or head: `LayerPatterns` of buckets."""
        from hf_partial_attention.pattern import AttentionPattern
        from hf_partial_attention.pattern_buckets import PatternBuckets

        key = (arm.k, arm.lengths, arm.form)
        if key not in self._patterns:
            if arm.granularity != "pooled":
                from hf_partial_attention.pattern_layers import LayerPatterns

                self._patterns[key] = LayerPatterns.load(self.layers_path(arm))
            elif arm.lengths == "buckets":
                self._patterns[key] = PatternBuckets.load(self.buckets_path(arm.k))
            else:
                path = os.path.join(self.a.run_dir, f"pattern_k{arm.k}.safetensors")
                self._patterns[key] = AttentionPattern.load(path)
        return self._patterns[key]

    def buckets_path(self, k: int) -> str:
        return os.path.join(self.a.run_dir, "buckets", "patterns", f"buckets_k{k}.safetensors")

    def layers_path(self, arm: Arm) -> str:
        """P and R per layer or head of ``arm`` (`analysis.derive.derive_budget` on the per-head bucket analysis):
        the uniform k or a k per layer at k's saving."""
        tag = f"per_query_{BUCKET_OBJECTIVE}_{arm.granularity}" if BUCKET_OBJECTIVE != "paper" else \
            f"per_query_{arm.granularity}"
        return os.path.join(self.a.run_dir, "buckets_head", "patterns",
                            f"buckets_{tag}_savingk{arm.k}_{arm.budget_name}.safetensors")

    def exact_mlm(self):
        from transformers import BertForMaskedLM

        return BertForMaskedLM.from_pretrained(self.phase1_dir)

    def convert(self, arm: Arm, head=None, source=None):
        """The phase-1 model (or `source`) converted with the arm's pattern and R mode, the ``auto`` kernel."""
        from hf_partial_attention.modeling_partial_bert import PartialBertForMaskedLM

        head = head or PartialBertForMaskedLM
        model = head.from_bert(source if source is not None else self.exact_mlm(), self.pattern(arm),
                               reconstruction=arm.reconstruction)
        model.set_partial_implementation("auto")
        return model

    def evaluate(self, model) -> dict:
        """Test MLM losses per example: on the held-out windows and on the held-out pairs at their own lengths."""
        d, seed = self.data, self.a.seed
        return {"windows": steps.mlm_window_losses(model, d.tokenizer, d.windows["validation"], seed),
                "pairs": steps.mlm_window_losses(model, d.tokenizer, d.mlm_pairs, seed)}

    def recover(self, arm: Arm, model, reconstruction_learning_rate: float):
        """Phase 2 of `arm` on the training windows and training pairs (`data._recovery_inputs`): MLM, or the
        distill objective against the phase-1 model."""
        a = self.a
        objective = "mlm" if arm.recovery == "mlm" else a.distill_objective
        teacher = None if objective == "mlm" else self.exact_mlm().eval()
        # windows and the training pairs at their own lengths, batched by length: every bucket's R trains
        return steps.train_mlm(model, self.data.tokenizer, self.data.recovery_inputs, self.store.model_dir("tmp"),
                               a.arm_steps, a.pretrain_batch_size, a.pretrain_learning_rate, a.seed,
                               objective=objective, teacher=teacher, group_by_length=True,
                               reconstruction_learning_rate=reconstruction_learning_rate, bf16=a.bf16)


def phase1(study: ConversionStudy) -> dict:
    """The start model with a new MLM head trained with exact attention; its loss on the selection split."""
    from transformers import BertForMaskedLM

    a, data = study.a, study.data
    model = BertForMaskedLM.from_pretrained(data.model_path)
    record = {"train_losses": [], "train_seconds": 0.0}
    if a.phase1_steps:
        model, record = steps.train_mlm(model, data.tokenizer, data.windows["train"], study.store.model_dir("tmp"),
                                        a.phase1_steps, a.phase1_batch_size, a.phase1_learning_rate, a.seed,
                                        bf16=a.bf16)
    model.save_pretrained(study.phase1_dir)
    data.tokenizer.save_pretrained(study.phase1_dir)
    return {"train_losses": record["train_losses"], "train_seconds": record["train_seconds"],
            "selection": steps.mlm_window_losses(model, data.tokenizer, data.windows["selection"], a.seed)}


def fit_patterns(study: ConversionStudy) -> dict:
    """Zero-fill patterns from training windows (`select_patterns`), length buckets from the training documents'
    sentences and paragraphs at their own lengths (`analyze_lengths` + `derive_lengths`), per k."""
    from transformers import BertForMaskedLM

    from hf_partial_attention.analysis import collect_covariance
    from hf_partial_attention.analysis.derive import derive_lengths
    from hf_partial_attention.analysis.lengths import analyze_lengths
    from hf_partial_attention.analysis.selection import select_patterns
    from hf_partial_attention.pattern_buckets import PatternBuckets

    a, data, n = study.a, study.data, study.a.max_seq_length
    model = BertForMaskedLM.from_pretrained(study.phase1_dir).eval()
    windows = data.windows["train"].shuffle(seed=a.seed)
    ids = torch.tensor(windows[: a.covariance_windows]["input_ids"])  # (S, n)
    centered = a.covariance == "centered"
    t0 = time.perf_counter()
    cov = collect_covariance(model, ids, data.tokenizer, seq_len=n, centered=centered, batch_size=32,
                             distributed=False, progress=a.progress)
    found = select_patterns(cov, a.k_list, centered=centered, bias=centered)
    for k, pattern in found.items():
        pattern.save(os.path.join(a.run_dir, f"pattern_k{k}.safetensors"))
    windows_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    folder = os.path.join(a.run_dir, "buckets")
    fit = analyze_lengths(study.phase1_dir, data.fit_documents, folder, lengths=a.length_list, kind="sentence",
                          heldout_every=0, max_inputs=a.bucket_fit_inputs, centered=centered,
                          model_id=data.model_id, progress=a.progress)
    derive_lengths(folder, a.k_list, objective=BUCKET_OBJECTIVE, evaluate=False, progress=a.progress)
    layers = _layer_patterns(study, centered)
    buckets = {}
    for k in a.k_list:
        b = PatternBuckets.load(study.buckets_path(k))
        if b.seq_len != n:
            raise ValueError(f"The bucket fit of k={k} has no input of n={n} tokens (buckets {b.lengths}); give it "
                             f"more inputs (--bucket_fit_inputs, now {a.bucket_fit_inputs}) or end --lengths lower.")
        buckets[str(k)] = {"lengths": b.lengths, "exact_lengths": b.exact_lengths,
                           "normalized_error": {str(length): p.normalized_error for length, p in b.patterns.items()}}
    return {"normalized_error": {str(k): p.normalized_error for k, p in found.items()}, "windows": int(ids.shape[0]),
            "layers": layers,
            "windows_seconds": windows_seconds, "buckets": buckets, "bucket_objective": BUCKET_OBJECTIVE,
            "bucket_fit": {"inputs": fit["fit_inputs"], "skipped": fit["skipped"],
                           "per_bucket": {str(r["length"]): r["fit_inputs"] for r in fit["buckets"]},
                           "seconds": time.perf_counter() - t0}}


def _layer_patterns(study: ConversionStudy, centered: bool) -> dict:
    """For arms with P and R per layer or head: one covariance per (layer, head) per bucket on the same inputs as the
    pooled buckets, and each arm's uniform and budgeted sets (`derive_budget`, the buckets' objective)."""
    from hf_partial_attention.analysis.derive import derive_budget
    from hf_partial_attention.analysis.lengths import analyze_lengths

    a, data = study.a, study.data
    wanted = sorted({(arm.k, arm.granularity, arm.exact_layers) for arm in a.arms().finetune
                     if arm.granularity != "pooled"})
    if not wanted:
        return {}
    folder = os.path.join(a.run_dir, "buckets_head")
    analyze_lengths(study.phase1_dir, data.fit_documents, folder, lengths=a.length_list, kind="sentence",
                    heldout_every=0, max_inputs=a.bucket_fit_inputs, centered=centered, model_id=data.model_id,
                    progress=a.progress, granularity="head")
    out = {}
    for k, granularity, exact in wanted:
        result = derive_budget(folder, f"k{k}", granularity=granularity, objective=BUCKET_OBJECTIVE,
                               exact_layers=exact or None)
        out[layers_key(k, granularity, exact)] = {"layers_k": result["layers_k"], "buckets": result["buckets"]}
    return out


def select_rate(study: ConversionStudy) -> dict:
    """R's learning rate: the selection arm trained per candidate, scored on the selection split only."""
    a, data = study.a, study.data
    arm, rates = a.selection_arm, a.learning_rate_list
    if arm is None:  # one candidate (StudyArguments checks it): nothing to choose
        return {"arm": None, "candidates": [], "chosen": rates[0], "chosen_index": 0}
    rows = []
    for i, rate in enumerate(rates):
        model, record = study.recover(arm, study.convert(arm), rate)
        model.save_pretrained(study.store.model_dir(f"rlr_{i}"))
        selection = steps.mlm_window_losses(model, data.tokenizer, data.windows["selection"], a.seed)
        rows.append({"reconstruction_learning_rate": rate, "selection": selection,
                     "selection_loss": mlm_loss(selection), **record})
    best = min(range(len(rows)), key=lambda i: rows[i]["selection_loss"])
    return {"arm": arm.name, "candidates": rows, "chosen": rates[best], "chosen_index": best,
            "selection_windows": len(data.windows["selection"])}


def converted(study: ConversionStudy, arm: Arm, with_zero_fill: bool) -> dict:
    """An arm without recovery: its converted test losses (the same weights for every R mode of its k), and for
    the first such arm of each k also the zero-fill conversion's (the gap decomposition's step (ii))."""
    result = {"converted": study.evaluate(study.convert(arm))}
    if with_zero_fill:
        # zero fill is one pooled P and R of n (the decomposition's step (ii)), whatever the arm's own form
        zero_fill = arm.twin(lengths="zero_fill", granularity="pooled", budget=False, exact_layers=())
        result["zero_fill_converted"] = study.evaluate(study.convert(zero_fill))
    return result


def phase2(study: ConversionStudy, arm: Arm, rlr: dict) -> dict:
    """Phase 2 of a recovered arm (or of the exact one): test losses before (converted) and after."""
    from hf_partial_attention.modeling_partial_bert import PartialBertForMaskedLM

    result = {}
    if arm.is_exact:
        model = study.exact_mlm()
    else:
        model = study.convert(arm)
        result["converted"] = study.evaluate(model)
    if rlr["arm"] == arm.name:  # the selection trained this very arm with the chosen rate: reuse its model
        chosen = rlr["candidates"][rlr["chosen_index"]]
        model = PartialBertForMaskedLM.from_pretrained(study.store.model_dir(f"rlr_{rlr['chosen_index']}"),
                                                       partial_implementation="auto")
        record = {k: v for k, v in chosen.items() if k not in ("selection", "selection_loss")}
        result["reused_from"] = f"rlr (candidate {rlr['chosen_index']})"
    else:
        model, record = study.recover(arm, model, rlr["chosen"])
    model.save_pretrained(study.store.model_dir(f"mlm_{arm.name}"))
    result.update(record, reconstruction_learning_rate=rlr["chosen"], batch=study.a.pretrain_batch_size,
                  recovered=study.evaluate(model))
    return result


def finetune_arm(study: ConversionStudy, arm: Arm, seed: int, reconstruction_learning_rate: float) -> dict:
    from transformers import BertForSequenceClassification

    from hf_partial_attention.modeling_partial_bert import PartialBertForSequenceClassification

    a, store, data = study.a, study.store, study.data
    labels = len(data.labels)
    if arm.is_exact:
        build = lambda: BertForSequenceClassification.from_pretrained(store.model_dir(f"mlm_{arm.name}"),  # noqa: E731
                                                                      num_labels=labels)
    elif not arm.trains:  # the phase-1 exact model converted, no recovery
        build = lambda: study.convert(arm, PartialBertForSequenceClassification,  # noqa: E731
                                      BertForSequenceClassification.from_pretrained(study.phase1_dir,
                                                                                    num_labels=labels))
    else:
        build = lambda: PartialBertForSequenceClassification.from_pretrained(  # noqa: E731
            store.model_dir(f"mlm_{arm.name}"), num_labels=labels, partial_implementation="auto")
    model = steps.seeded(seed, build)
    # MLM checkpoints have no pooler: every arm gets the start model's pretrained one (the same weights for all)
    model.bert.pooler.load_state_dict(data.pooler)
    out = store.model_dir(f"ft_{arm.name}_s{seed}")
    result = steps.finetune(model, data.tokenizer, data.pairs["train"], data.pairs["validation"], out,
                            a.finetune_steps, a.finetune_batch_size, a.finetune_learning_rate, seed, bf16=a.bf16,
                            reconstruction_learning_rate=reconstruction_learning_rate)
    trainer = result.pop("trainer")
    result["partial_lengths"] = None if arm.is_exact else list(model.config.partial_lengths)
    if seed == a.seeds[0]:
        trainer.save_model(out)  # the model the arm's card describes
    return result


def timing(study: ConversionStudy) -> dict:
    """Inference and training-step time at n of the exact model (eager, SDPA) and of every k with frozen and
    trained R (buckets: at n every input runs n's bucket), with the exact last layer run by eager or by SDPA;
    `auto` picks the partial kernel."""
    from transformers import BertForMaskedLM

    from hf_partial_attention.attention_dispatch import auto_kernel

    a, data = study.a, study.data
    models, kernels = {}, {}
    for impl in ("eager", "sdpa"):
        source = lambda: BertForMaskedLM.from_pretrained(data.model_path, attn_implementation=impl)  # noqa: E731
        models[f"exact/{impl}"] = source()
        for k in a.k_list:
            for mode in ("fixed", "common"):
                name = f"k{k}_{mode}/{impl}"
                model = models[name] = study.convert(Arm(k, mode), source=source())
                layout = model.bert.encoder.partial_pattern.layout()
                kernels[name] = auto_kernel(layout, model.device, model.config.hidden_size
                                            // model.config.num_attention_heads, training=False)
    ms = steps.time_models(models, a.timing_batch_size, a.max_seq_length, a.timing_repeats,
                           data.tokenizer.vocab_size, a.seed)
    return {"ms": ms, "kernels": kernels, "batch": a.timing_batch_size, "n": a.max_seq_length,
            "repeats": a.timing_repeats, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": sys.version.split()[0]}
