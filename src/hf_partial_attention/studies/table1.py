"""Table 1 of Bhojanapalli et al. (2021) on a real pretrained model: does converting an exactly trained model to
partial attention lose accuracy, and does training with partial attention built in recover it?

Protocol (every number is a flag of `StudyArguments`; ``hf-partial-attention table1 --help``):

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
`table1_report` turns the jobs into ``table1.md``, ``table1.json``, the verdicts and the arms' model cards.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from .store import JobStore
from .table1_data import load_study_data

logger = logging.getLogger(__name__)

__all__ = ["StudyArguments", "run_table1", "arm_names"]

# Arguments that do not change any result: changing them on resume is allowed.
_NOT_RESULTS = ("output_dir", "cards_dir", "threads", "run_dir", "progress")


@dataclass
class StudyArguments:
    output_dir: str = field(default="results/table1", metadata={"help": "table1.md / table1.json go here."})
    run_dir: str = field(default="runs/table1", metadata={"help": "Jobs, checkpoints (resumable; not committed)."})
    cards_dir: str = field(default="model_cards", metadata={"help": "Model cards go to <cards_dir>/table1-<arm>/."})
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "Exact BERT-family model to start from (default: the packaged all-MiniLM-L6-v2)."})
    pretrain_dataset_name: str | None = field(default=None, metadata={
        "help": "Hub text dataset for MLM (default: Python's own English prose, offline)."})
    pretrain_dataset_config_name: str | None = None
    pretrain_train_file: str | None = None
    task: str = field(default="next_sentence", metadata={"choices": ("next_sentence", "sentence_order", "mnli")})
    finetune_dataset_name: str = "nyu-mll/glue"
    finetune_dataset_config_name: str = "mnli"
    finetune_train_file: str | None = None
    finetune_validation_file: str | None = None
    train_every: int = field(default=3, metadata={
        "help": "Document i is a training document when i %% train_every == 0; the others are held out."})
    max_seq_length: int = 128
    ks: str = "8,16"
    modes: str = "fixed,common,per_layer"
    no_recovery_ks: str = field(default="8", metadata={
        "help": "k of the arms fine-tuned right after conversion (common R), without MLM recovery."})
    covariance: str = field(default="second_moment", metadata={"choices": ("second_moment", "centered")})
    covariance_windows: int = 256
    phase1_steps: int = 150
    phase1_learning_rate: float = field(default=5e-4, metadata={
        "help": "Peak lr of phase 1 (the MLM head is new: higher than the arms' --pretrain_learning_rate)."})
    arm_steps: int = 60
    pretrain_batch_size: int = 32
    pretrain_learning_rate: float = 1e-4
    reconstruction_learning_rate: float | None = None
    mlm_eval_windows: int = 256
    finetune_steps: int = 120
    finetune_batch_size: int = 32
    finetune_learning_rate: float = 1e-4
    finetune_seeds: str = "0,1,2"
    max_finetune_eval: int | None = field(default=2600, metadata={"help": "Held-out pairs (0: all)."})
    timing_batch_size: int = 32
    timing_repeats: int = 5
    seed: int = 0
    threads: int = field(default=0, metadata={"help": "torch threads (0: torch's default)."})
    bf16: bool = False
    progress: bool = True

    def __post_init__(self):
        for name in ("phase1_steps", "covariance_windows", "mlm_eval_windows"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
        if self.arm_steps < 1:  # phase 2 is the study: every fine-tuning arm starts from its checkpoint
            raise ValueError(f"arm_steps must be >= 1 (phase 2 trains each arm), got {self.arm_steps}.")
        if self.finetune_steps < 1 or not self.seeds:
            raise ValueError("Fine-tuning needs finetune_steps >= 1 and at least one seed in --finetune_seeds.")
        bad = [m for m in self.mode_list if m not in ("fixed", "common", "per_layer")]
        if bad:
            raise ValueError(f"--modes has {bad}; use fixed, common and/or per_layer.")
        if not set(self.no_recovery_k_list) <= set(self.k_list):
            raise ValueError(f"--no_recovery_ks {self.no_recovery_ks} must be among --ks {self.ks}.")

    @property
    def k_list(self) -> list[int]:
        return _ints(self.ks)

    @property
    def mode_list(self) -> list[str]:
        return [m for m in self.modes.split(",") if m]

    @property
    def no_recovery_k_list(self) -> list[int]:
        return _ints(self.no_recovery_ks)

    @property
    def seeds(self) -> list[int]:
        return _ints(self.finetune_seeds)

    def result_fields(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in _NOT_RESULTS}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def arm_names(a: StudyArguments) -> tuple[list[str], list[str]]:
    """(MLM arms: exact and one per k and mode, fine-tuning arms: those plus the no-recovery ones)."""
    mlm = ["exact"] + [f"k{k}_{m}" for k in a.k_list for m in a.mode_list]
    return mlm, mlm + [f"k{k}_converted" for k in a.no_recovery_k_list]


def _parse_arm(name: str) -> tuple[int | None, str]:
    if name == "exact":
        return None, "-"
    k, mode = name[1:].split("_", 1)
    return int(k), ("common" if mode == "converted" else mode)


def run_table1(a: StudyArguments, argv: list[str] | None = None) -> dict:
    """Run (or resume) the study and write its report; returns the report dict (see `table1_report`)."""
    from transformers import BertForMaskedLM

    from ..analysis import collect_covariance
    from ..analysis.selection import select_patterns
    from ..modeling_partial_bert import PartialBertForMaskedLM
    from ..pattern import AttentionPattern
    from .table1_report import write_report
    from .table1_steps import mlm_window_losses, train_mlm

    command = " ".join(["hf-partial-attention table1", *(shlex.quote(x) for x in (argv or []))])
    if a.threads:
        torch.set_num_threads(a.threads)
    store = JobStore(a.run_dir, a.result_fields())
    data = load_study_data(a)
    mlm_arms, ft_arms = arm_names(a)
    total = 3 + len(mlm_arms) + len(ft_arms) * len(a.seeds)
    bar = tqdm(total=total, desc="table1 jobs", disable=not a.progress)
    bar.update(sum(store.done(j) for j in _job_names(a)))
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

    for arm in mlm_arms:
        def mlm_arm(arm=arm):
            k, mode = _parse_arm(arm)
            result = {}
            if k is None:
                model = BertForMaskedLM.from_pretrained(phase1_dir)
            else:
                model = convert(k, mode)
                result["converted"] = mlm_window_losses(model, data.tokenizer, data.windows["validation"], a.seed)
            model, drift, losses = train_mlm(model, data.tokenizer, data.windows["train"], store.model_dir("tmp"),
                                             a.arm_steps, a.pretrain_batch_size, a.pretrain_learning_rate, a.seed,
                                             reconstruction_learning_rate=a.reconstruction_learning_rate, **shared)
            model.save_pretrained(store.model_dir(f"mlm_{arm}"))
            result.update(r_drift=drift, train_losses=losses,
                          **mlm_window_losses(model, data.tokenizer, data.windows["validation"], a.seed))
            return result

        job(f"mlm_{arm}", mlm_arm)

    for arm in ft_arms:
        for seed in a.seeds:
            job(f"ft_{arm}_s{seed}", lambda arm=arm, seed=seed: _finetune_arm(a, store, data, arm, seed, convert))
    job("timing", lambda: _timing(a, data, convert))
    bar.close()
    return write_report(a, store, data, command)


def _job_names(a: StudyArguments) -> list[str]:
    mlm_arms, ft_arms = arm_names(a)
    return (["phase1", "patterns", "timing"] + [f"mlm_{arm}" for arm in mlm_arms]
            + [f"ft_{arm}_s{s}" for arm in ft_arms for s in a.seeds])


def _finetune_arm(a, store, data, arm, seed, convert) -> dict:
    from transformers import BertForSequenceClassification

    from ..modeling_partial_bert import PartialBertForSequenceClassification
    from .table1_steps import finetune, seeded

    k, mode = _parse_arm(arm)
    labels = len(data.labels)
    if arm.endswith("_converted"):  # the phase-1 exact model converted, no MLM recovery
        build = lambda: convert(k, mode, PartialBertForSequenceClassification,  # noqa: E731
                                BertForSequenceClassification.from_pretrained(store.model_dir("phase1"),
                                                                              num_labels=labels))
    elif k is None:
        build = lambda: BertForSequenceClassification.from_pretrained(store.model_dir("mlm_exact"),  # noqa: E731
                                                                      num_labels=labels)
    else:
        build = lambda: PartialBertForSequenceClassification.from_pretrained(  # noqa: E731
            store.model_dir(f"mlm_{arm}"), num_labels=labels, partial_implementation="auto")
    model = seeded(seed, build)
    # MLM checkpoints have no pooler: every arm gets the start model's pretrained one (the same weights for all)
    model.bert.pooler.load_state_dict(data.pooler)
    out = store.model_dir(f"ft_{arm}_s{seed}")
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

    from ..partial_attention import resolve_implementation
    from .table1_steps import time_models

    models, kernels = {}, {}
    for impl in ("eager", "sdpa"):
        source = lambda: BertForMaskedLM.from_pretrained(data.model_path, attn_implementation=impl)  # noqa: E731
        models[f"exact/{impl}"] = source()
        for k in a.k_list:
            for mode in ("fixed", "common"):
                model = convert(k, mode, source=source())
                models[f"k{k}_{mode}/{impl}"] = model
    for name, model in models.items():
        if name.startswith("k"):
            layout = model.bert.encoder.partial_pattern.layout()
            kernels[name] = resolve_implementation("auto", layout, model.config.hidden_size
                                                   // model.config.num_attention_heads)
    ms = time_models(models, a.timing_batch_size, a.max_seq_length, a.timing_repeats,
                     data.tokenizer.vocab_size, a.seed)
    return {"ms": ms, "kernels": kernels, "batch": a.timing_batch_size, "n": a.max_seq_length,
            "repeats": a.timing_repeats, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": sys.version.split()[0]}
