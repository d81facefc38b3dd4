"""Table 1 of Bhojanapalli et al. (2021) on a real pretrained model: does converting an exactly trained model to
partial attention lose accuracy, and does training with partial attention built in recover it?

Protocol (every number is a flag of `StudyArguments`; ``python -m experiments table1 --help``):

1. **Phase 1, exact.** The pretrained encoder (default: the real all-MiniLM-L6-v2, 6 layers, 12 heads,
   d_h = 32) gets an MLM head, and the whole model is trained with exact attention on the pretraining text.
2. **P and R** from that model's per-query pre-softmax score statistics, pooled over all layers and heads, on
   training windows: greedy P and optimal R for each k (the paper's protocol, `analysis.select_patterns`).
3. **Phase 2, one arm per (k, R mode)**, equal budgets, the same data order and masks: the phase-1 weights
   converted (P, R installed in all layers but the last) and trained with MLM for ``arm_steps``, R fixed, common
   or per layer; the exact arm continues the phase-1 model for as many steps. Each converted arm's held-out MLM
   loss is recorded before retraining (the paper's "performs poorly") and after.
4. **Fine-tuning** of every arm, and of converted models without MLM recovery (``no_recovery_ks``), on a
   sentence-pair task, several seeds; held-out accuracy per seed and per example.
5. **Cost**: each configuration's QKᵀ saving and its measured inference / training-step time beside the exact
   model (eager and SDPA) at the same shapes.

Every job's result is a JSON file under ``run_dir/jobs``: a killed run started again continues where it stopped.
`table1_report` turns the jobs into ``table1.md``, ``table1.json``, the verdicts and the arms' model cards; the
arms are `table1_spec.Arm` values, which both modules take from `table1_spec`.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import time

import torch
from tqdm.auto import tqdm

from .store import JobStore
from .table1_data import load_study_data
from .table1_report import write_report
from .table1_spec import COMMAND, Arm, StudyArguments, job_names

logger = logging.getLogger(__name__)

__all__ = ["StudyArguments", "run_table1"]


def run_table1(a: StudyArguments, argv: list[str] | None = None) -> dict:
    """Run (or resume) the study and write its report; returns the report dict (see `table1_report`)."""
    from transformers import BertForMaskedLM

    from hf_partial_attention.analysis import collect_covariance
    from hf_partial_attention.analysis.selection import select_patterns
    from hf_partial_attention.modeling_partial_bert import PartialBertForMaskedLM
    from hf_partial_attention.pattern import AttentionPattern

    from .table1_steps import mlm_window_losses, train_mlm

    command = " ".join([COMMAND, *(shlex.quote(x) for x in (argv or []))])
    if a.threads:
        torch.set_num_threads(a.threads)
    store = JobStore(a.run_dir, a.result_fields())
    data = load_study_data(a)
    arms = a.arms()
    jobs = job_names(a)
    bar = tqdm(total=len(jobs), desc="table1 jobs", disable=not a.progress)
    bar.update(sum(store.done(j) for j in jobs))
    n, shared = a.max_seq_length, dict(bf16=a.bf16)

    def job(name, fn):
        if not store.done(name):
            t0 = time.time()
            bar.set_postfix_str(name)
            result = fn()
            result["seconds"] = time.time() - t0
            store.save(name, result)
            logger.info("table1 job %s done in %.0f s", name, result["seconds"])
            bar.update(1)
        return store.load(name)

    phase1_dir = store.model_dir("phase1")

    def phase1():
        model = BertForMaskedLM.from_pretrained(data.model_path)
        losses = []
        if a.phase1_steps:
            model, _, losses = train_mlm(model, data.tokenizer, data.windows["train"], store.model_dir("tmp"),
                                         a.phase1_steps, a.pretrain_batch_size, a.phase1_learning_rate, a.seed,
                                         **shared)
        model.save_pretrained(phase1_dir)
        data.tokenizer.save_pretrained(phase1_dir)
        return {"train_losses": losses, **mlm_window_losses(model, data.tokenizer, data.windows["validation"], a.seed)}

    job("phase1", phase1)

    def patterns():
        model = BertForMaskedLM.from_pretrained(phase1_dir).eval()
        windows = data.windows["train"].shuffle(seed=a.seed)
        ids = torch.tensor(windows[: a.covariance_windows]["input_ids"])  # (S, n)
        centered = a.covariance == "centered"
        cov = collect_covariance(model, ids, data.tokenizer, seq_len=n, centered=centered, batch_size=32,
                                 distributed=False, progress=a.progress)
        found = select_patterns(cov, a.k_list, centered=centered, bias=centered)
        for k, pattern in found.items():
            pattern.save(os.path.join(a.run_dir, f"pattern_k{k}.safetensors"))
        return {"normalized_error": {str(k): p.normalized_error for k, p in found.items()},
                "windows": int(ids.shape[0])}

    job("patterns", patterns)
    pattern_of = {k: AttentionPattern.load(os.path.join(a.run_dir, f"pattern_k{k}.safetensors")) for k in a.k_list}

    def convert(k, mode, head=PartialBertForMaskedLM, source=None, **kw):
        source = source if source is not None else BertForMaskedLM.from_pretrained(phase1_dir)
        model = head.from_bert(source, pattern_of[k], reconstruction=mode, **kw)
        model.set_partial_implementation("auto")
        return model

    for arm in arms.mlm:
        def mlm_arm(arm=arm):
            result = {}
            if arm.is_exact:
                model = BertForMaskedLM.from_pretrained(phase1_dir)
            else:
                model = convert(arm.k, arm.reconstruction)
                result["converted"] = mlm_window_losses(model, data.tokenizer, data.windows["validation"], a.seed)
            model, drift, losses = train_mlm(model, data.tokenizer, data.windows["train"], store.model_dir("tmp"),
                                             a.arm_steps, a.pretrain_batch_size, a.pretrain_learning_rate, a.seed,
                                             reconstruction_learning_rate=a.reconstruction_learning_rate, **shared)
            model.save_pretrained(store.model_dir(f"mlm_{arm.name}"))
            result.update(r_drift=drift, train_losses=losses,
                          **mlm_window_losses(model, data.tokenizer, data.windows["validation"], a.seed))
            return result

        job(f"mlm_{arm.name}", mlm_arm)

    for arm in arms.finetune:
        for seed in a.seeds:
            job(f"ft_{arm.name}_s{seed}", lambda arm=arm, seed=seed: _finetune_arm(a, store, data, arm, seed, convert))
    job("timing", lambda: _timing(a, data, convert))
    bar.close()
    return write_report(a, store, data, command)


def _finetune_arm(a, store, data, arm: Arm, seed: int, convert) -> dict:
    from transformers import BertForSequenceClassification

    from hf_partial_attention.modeling_partial_bert import PartialBertForSequenceClassification

    from .table1_steps import finetune, seeded

    labels = len(data.labels)
    if not arm.recovery:  # the phase-1 exact model converted, no MLM recovery
        build = lambda: convert(arm.k, arm.reconstruction, PartialBertForSequenceClassification,  # noqa: E731
                                BertForSequenceClassification.from_pretrained(store.model_dir("phase1"),
                                                                              num_labels=labels))
    elif arm.is_exact:
        build = lambda: BertForSequenceClassification.from_pretrained(store.model_dir(f"mlm_{arm.name}"),  # noqa: E731
                                                                      num_labels=labels)
    else:
        build = lambda: PartialBertForSequenceClassification.from_pretrained(  # noqa: E731
            store.model_dir(f"mlm_{arm.name}"), num_labels=labels, partial_implementation="auto")
    model = seeded(seed, build)
    # MLM checkpoints have no pooler: every arm gets the start model's pretrained one (the same weights for all)
    model.bert.pooler.load_state_dict(data.pooler)
    out = store.model_dir(f"ft_{arm.name}_s{seed}")
    result = finetune(model, data.tokenizer, data.pairs["train"], data.pairs["validation"], out, a.finetune_steps,
                      a.finetune_batch_size, a.finetune_learning_rate, seed, bf16=a.bf16,
                      reconstruction_learning_rate=a.reconstruction_learning_rate)
    trainer = result.pop("trainer")
    if seed == a.seeds[0]:
        trainer.save_model(out)  # the model the arm's card describes
    return result


def _timing(a, data, convert) -> dict:
    """Inference and training-step time of the exact model (eager, SDPA) and of every k with frozen and trained
    R, with the exact last layer run by eager or by SDPA; `auto` picks the partial kernel."""
    from transformers import BertForMaskedLM

    from hf_partial_attention.attention_dispatch import auto_kernel

    from .table1_steps import time_models

    models, kernels = {}, {}
    for impl in ("eager", "sdpa"):
        source = lambda: BertForMaskedLM.from_pretrained(data.model_path, attn_implementation=impl)  # noqa: E731
        for arm in (Arm(), *(Arm(k, mode) for k in a.k_list for mode in ("fixed", "common"))):
            name = f"{arm.name}/{impl}"
            if arm.is_exact:
                models[name] = source()
                continue
            model = models[name] = convert(arm.k, arm.reconstruction, source=source())
            layout = model.bert.encoder.partial_pattern.layout()
            kernels[name] = auto_kernel(layout, model.device, model.config.hidden_size
                                        // model.config.num_attention_heads, training=False)
    ms = time_models(models, a.timing_batch_size, a.max_seq_length, a.timing_repeats,
                     data.tokenizer.vocab_size, a.seed)
    return {"ms": ms, "kernels": kernels, "batch": a.timing_batch_size, "n": a.max_seq_length,
            "repeats": a.timing_repeats, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": sys.version.split()[0]}
