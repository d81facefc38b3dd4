"""Table 1 as the paper ran it: BERT pretrained *from scratch* with partial attention built in, beside the exact
model, P alone, and the exact model converted (issue 41). ``python -m experiments table1-scratch`` (``make
table1-scratch``); the arms are `scratch_spec`'s, the held-out curve `scratch_curve`'s, the wall-time estimate
`scratch_budget`'s, the report `scratch_report`'s. The jobs (exact pretraining, P and R, the arms, fine-tuning,
cost) are listed in `_Study`'s docstring; each job's result is stored, so a killed run continues where it was.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import time

import torch
from transformers import set_seed

from . import steps
from .stats import mlm_loss
from .scratch_budget import estimate_seconds, measure_step_seconds
from .scratch_curve import HeldOutCurve
from .scratch_data import load_scratch_data
from .p_only import P_ONLY, install_p_only
from .runner import JobRunner
from ..store import JobStore
from .scratch_spec import COMMAND, ScratchArguments, ScratchArm

logger = logging.getLogger(__name__)

__all__ = ["run_table1_scratch", "ScratchArguments"]


class _Study:
    """One pretraining seed's jobs (``a.seed``: initial weights, data order, masks; ``a.run_dir``: its store). The
    held-out losses use ``eval_seed``'s masks, the same for every pretraining seed, so arms compare paired.

    1. **Exact** (job ``pretrain_exact``): a BERT with BERT-base's head width (d_h = 64) pretrained by MLM from
       scratch on the corpus's training windows through `build_model` and `PartialAttentionTrainer`, the held-out
       MLM loss recorded every ``eval_every`` steps (and the training time to that step).
    2. **P and R** (``patterns``) from that model's scores by the project's own analysis: `analyze` on training
       windows (second moment, the paper's) and `derive` (the pooled greedy, per k); per head, `analyze
       --granularity head` and `derive_budget` (a k per layer at k's saving).
    3. **Arms from scratch** (``pretrain_<arm>``): the same seed (so the same initial weights: `build_model`
       converts the exact class's own initialisation), data order, masks and steps, with P and R built in (every
       layer partial but the last) or P alone; ``convert`` and ``convert_train`` arms start from the exact model.
    4. **Fine-tuning** (``ft_<arm>_s<seed>``) on sentence order (3 classes) at the pairs' own lengths, several seeds.
    5. **Cost** (``timing``): the training step and inference time of the trained-in models beside the exact one
       (SDPA and eager), interleaved in one process.

    Every job's result is a JSON under ``run_dir/jobs``: a killed run started again continues with the job it was
    in."""

    def __init__(self, a: ScratchArguments, store: JobStore, data, eval_seed: int | None = None):
        self.a, self.store, self.data = a, store, data
        self.eval_seed = a.seed if eval_seed is None else eval_seed
        self.arms = {arm.name: arm for arm in a.arm_list()}

    # ------------------------------------------------------------------ models
    def pattern_path(self, arm: ScratchArm) -> str:
        if arm.kind == "head_budget":
            return os.path.join(self.a.run_dir, "analysis_head", "patterns",
                                f"per_query_head_savingk{arm.k}_budget.safetensors")
        return os.path.join(self.a.run_dir, "analysis", "patterns", f"per_query_k{arm.k}.safetensors")

    def partial_layers(self) -> list[int]:
        return list(range(self.a.num_hidden_layers - 1))  # every layer but the last, as the paper

    def new_model(self, arm: ScratchArm):
        """An arm's model before pretraining from scratch: the exact class's initialisation for the study's seed,
        converted with the arm's P and R (`build_model`), or P alone installed."""
        from hf_partial_attention.training import ModelArguments, build_model

        set_seed(self.a.seed)
        exact = arm.kind in ("exact", "p_only")
        args = ModelArguments(model_type="bert", config_overrides=self.a.config_overrides(),
                              attention="exact" if exact else "partial",
                              pattern=None if exact else self.pattern_path(arm),
                              reconstruction=None if exact else arm.reconstruction)
        model = build_model("masked_lm", args, self.data.tokenizer, max_seq_length=self.a.max_seq_length).model
        if arm.kind == "p_only":
            from hf_partial_attention.pattern import AttentionPattern

            install_p_only(model, AttentionPattern.load(self.pattern_path(arm)).indices, self.partial_layers())
        elif not exact:
            model.set_partial_implementation("auto")
        return model

    def converted(self, arm: ScratchArm, head=None, **kwargs):
        """The pretrained exact model converted with the arm's pooled P and R (its R mode)."""
        from hf_partial_attention.modeling_partial_bert import PartialBertForMaskedLM
        from hf_partial_attention.pattern import AttentionPattern

        model = (head or PartialBertForMaskedLM).from_bert(self.store.model_dir("exact"),
                                                           AttentionPattern.load(self.pattern_path(arm)),
                                                           reconstruction=arm.reconstruction, **kwargs)
        model.set_partial_implementation("auto")
        return model

    def test_losses(self, model) -> dict:
        return steps.mlm_window_losses(model, self.data.tokenizer, self.data.windows["test"], self.eval_seed)

    def validation_losses(self, model) -> dict | None:
        """MLM losses on the validation windows (None without a validation split)."""
        if "validation" not in self.data.windows:
            return None
        return steps.mlm_window_losses(model, self.data.tokenizer, self.data.windows["validation"], self.eval_seed)

    # ------------------------------------------------------------------ jobs
    def pretrain(self, arm: ScratchArm, r_lr: float | None = None, folder: str | None = None) -> dict:
        """Pretraining of a from-scratch arm, or the training of a ``convert_train`` arm; test (and validation)
        losses after. ``r_lr``: R's own learning rate (None: the body's); ``folder``: where the model is saved
        (default: the arm's model folder)."""
        a, data = self.a, self.data
        model = self.converted(arm) if arm.kind == "convert_train" else self.new_model(arm)
        count = a.convert_train_steps() if arm.kind == "convert_train" else a.pretrain_steps
        args = steps.train_args(self.store.model_dir("tmp"), count, a.pretrain_batch_size, a.pretrain_learning_rate,
                                a.seed, a.seed, mlm=True, reconstruction_learning_rate=r_lr)
        curve_windows = data.windows["test"].select(range(min(a.curve_windows, len(data.windows["test"]))))
        curve = HeldOutCurve(curve_windows, data.tokenizer, self.eval_seed, a.eval_every)
        from hf_partial_attention.training import MlmCollator, PartialAttentionTrainer

        collator = MlmCollator(data.tokenizer, a.mlm_probability, seed=a.seed)
        trainer = PartialAttentionTrainer(model=model, args=args, data_collator=collator,
                                          train_dataset=data.windows["train"], callbacks=[curve])
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0
        model = trainer.model
        folder = folder or self.store.model_dir(arm.name)
        model.save_pretrained(folder)
        data.tokenizer.save_pretrained(folder)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        stats = trainer.reconstruction_stats() if arm.reconstruction else {}
        drift = {k.split("/", 1)[1]: v for k, v in stats.items() if k.startswith("reconstruction_drift/")}
        return {"steps": count, "reconstruction_learning_rate": r_lr,
                "train_seconds": seconds - curve.eval_seconds, "curve": curve.points,
                "train_losses": losses, "r_drift": drift, "test": self.test_losses(model),
                "validation": self.validation_losses(model)}

    def patterns(self) -> dict:
        """Pooled P and R per k (`analyze` + `derive`), and per head at each head arm's saving (`derive_budget`)."""
        from hf_partial_attention.analysis.derive import derive_budget
        from hf_partial_attention.analysis.workflow import analyze, derive

        a, data = self.a, self.data
        windows = torch.tensor(data.windows["train"].shuffle(seed=a.seed)[: a.covariance_windows]["input_ids"])
        exact_dir = self.store.model_dir("exact")
        pooled_ks = sorted({arm.k for arm in self.arms.values() if arm.k and arm.kind != "head_budget"})
        head_ks = sorted({arm.k for arm in self.arms.values() if arm.kind == "head_budget"})
        out = {"windows": int(windows.shape[0]), "pooled": {}}
        if pooled_ks:  # none where every partial arm is a head budget (`--arms exact,k24_head_budget`)
            folder = os.path.join(a.run_dir, "analysis")
            analyze(exact_dir, windows, folder, tokenizer=data.tokenizer, seq_len=a.max_seq_length, heldout_every=0,
                    centered=False, batch_size=32, progress=a.progress, model_id=f"table1-scratch exact ({a.corpus})")
            derived = derive(folder, pooled_ks, evaluate=False, progress=a.progress)
            out["pooled"] = {str(r["k"]): r["predicted"] for r in derived["patterns"]}
        if head_ks:
            folder = os.path.join(a.run_dir, "analysis_head")
            analyze(exact_dir, windows, folder, tokenizer=data.tokenizer, seq_len=a.max_seq_length, heldout_every=0,
                    centered=False, granularity="head", batch_size=32, progress=a.progress,
                    model_id=f"table1-scratch exact ({a.corpus})")
            out["head"] = {str(k): {key: value for key, value in derive_budget(folder, f"k{k}", granularity="head")
                                    .items() if key in ("layers_k", "saving", "budget_layers")} for k in head_ks}
        return out

    def finetune(self, arm: ScratchArm, seed: int) -> dict:
        from transformers import BertForSequenceClassification

        from hf_partial_attention.modeling_partial_bert import PartialBertForSequenceClassification

        a, data = self.a, self.data
        labels = {"num_labels": len(data.labels)}
        folder = self.store.model_dir(arm.name)
        if arm.kind == "exact":
            build = lambda: BertForSequenceClassification.from_pretrained(folder, **labels)  # noqa: E731
        elif arm.kind == "p_only":
            build = lambda: BertForSequenceClassification.from_pretrained(  # noqa: E731
                folder, attn_implementation=P_ONLY, **labels)
        elif arm.kind == "convert":
            build = lambda: self.converted(arm, PartialBertForSequenceClassification, **labels)  # noqa: E731
        else:
            build = lambda: PartialBertForSequenceClassification.from_pretrained(  # noqa: E731
                folder, partial_implementation="auto", **labels)
        model = steps.seeded(seed, build)
        result = steps.finetune(model, data.tokenizer, data.pairs["train"], data.pairs["test"],
                                self.store.model_dir(f"ft_{arm.name}_s{seed}"), a.finetune_steps,
                                a.finetune_batch_size, a.finetune_learning_rate, seed)
        result.pop("trainer")
        return result

    def timing(self) -> dict:
        """Training-step and inference time at the study's size: the exact model (SDPA, eager) beside every
        trained-in arm's model, interleaved (`steps.time_models`)."""
        from transformers import BertForMaskedLM

        from hf_partial_attention.modeling_partial_bert import PartialBertForMaskedLM

        a = self.a
        models = {f"exact/{impl}": BertForMaskedLM.from_pretrained(self.store.model_dir("exact"),
                                                                   attn_implementation=impl)
                  for impl in ("sdpa", "eager")}
        for arm in self.arms.values():
            if arm.trained_in:
                models[arm.name] = PartialBertForMaskedLM.from_pretrained(self.store.model_dir(arm.name),
                                                                          partial_implementation="auto")
        ms = steps.time_models(models, a.timing_batch_size, a.max_seq_length, a.timing_repeats,
                               self.data.tokenizer.vocab_size, a.seed)
        return {"ms": ms, "batch": a.timing_batch_size, "n": a.max_seq_length, "repeats": a.timing_repeats,
                "threads": torch.get_num_threads(), "torch": torch.__version__}


def _chosen_r_lr(one: "_Study", first: "_Study", arm: ScratchArm, run_first) -> dict:
    """An arm with trained R at R's own learning rate, chosen among ``reconstruction_learning_rates`` by the
    validation MLM loss of the first pretraining seed's runs (jobs ``pretrain_<arm>_rlr<rate>``, each model in
    its own folder); the first seed's result is its run at the chosen rate (the model copied to the arm's folder),
    every other seed's is trained at that rate."""
    import shutil

    tried = {}
    for r_lr in first.a.reconstruction_lr_list():
        name = f"{arm.name}_rlr{r_lr:g}"
        tried[r_lr] = run_first(f"pretrain_{name}",
                                lambda r_lr=r_lr, name=name: first.pretrain(arm, r_lr, first.store.model_dir(name)))
    if any(not r.get("validation") for r in tried.values()):
        raise ValueError("reconstruction_learning_rates are chosen on the validation split: pass --validation_every.")
    best = min(tried, key=lambda r_lr: mlm_loss(tried[r_lr]["validation"]))
    choice = {"reconstruction_learning_rates": {f"{r:g}": mlm_loss(t["validation"]) for r, t in tried.items()}}
    if one is first:
        shutil.copytree(first.store.model_dir(f"{arm.name}_rlr{best:g}"), first.store.model_dir(arm.name),
                        dirs_exist_ok=True)
        return {**tried[best], **choice}
    return {**one.pretrain(arm, best), **choice}


def seed_studies(a: ScratchArguments, data) -> list["_Study"]:
    """One `_Study` per pretraining seed: the first in ``a.run_dir`` (the study's own seed), every other in
    ``<run_dir>/pretrain_seed<seed>`` with that seed; all on the same data and held-out masks."""
    studies = []
    for i, seed in enumerate(a.pretrain_seed_list()):
        sub = a if i == 0 else dataclasses.replace(a, seed=seed, pretrain_seeds="",  # this seed alone
                                                   run_dir=os.path.join(a.run_dir, f"pretrain_seed{seed}"))
        studies.append(_Study(sub, JobStore(sub.run_dir, sub.result_fields()), data, eval_seed=a.seed))
    return studies


def run_table1_scratch(a: ScratchArguments, argv: list[str] | None = None) -> dict:
    """Run (or resume) the study and write its report (`scratch_report.write_scratch_report`): every
    pretraining seed's jobs (`seed_studies`), the first seed's in full, the others' without the timing."""
    from .scratch_report import write_scratch_report

    command = " ".join([COMMAND, *(shlex.quote(x) for x in (argv or []))])
    if a.threads:
        torch.set_num_threads(a.threads)
    studies = seed_studies(a, load_scratch_data(a))
    study, store = studies[0], studies[0].store
    arms = list(study.arms.values())
    per_seed = ([f"pretrain_{arm.name}" for arm in arms if arm.kind != "convert"] + ["patterns"]
                + [f"convert_{arm.name}" for arm in arms if arm.kind == "convert"]
                + [f"ft_{arm.name}_s{seed}" for arm in arms for seed in a.seed_list()])
    job = JobRunner(store, "table1-scratch", len(per_seed) * len(studies) + 2,
                    sum(s.store.done(j) for s in studies for j in per_seed) + store.done("estimate")
                    + store.done("timing"), a.progress)
    estimate = job("estimate", lambda: {"step_seconds": (s := measure_step_seconds(study)),
                                        "estimate_seconds": estimate_seconds(a, s)})
    logger.warning("table1-scratch: estimated %.1f h for the whole study on this machine (%.2f s a pretraining "
                   "step); it resumes after a kill.", estimate["estimate_seconds"] / 3600, estimate["step_seconds"])
    def run_first(name, fn):
        return job(name, fn, store)

    for one in studies:
        def run(name, fn, one=one):
            return job(name, fn, one.store)

        run("pretrain_exact", lambda: one.pretrain(one.arms["exact"]))
        run("patterns", one.patterns)
        for arm in arms[1:]:
            if arm.kind == "convert":
                run(f"convert_{arm.name}", lambda arm=arm: {"test": one.test_losses(m := one.converted(arm)),
                                                             "validation": one.validation_losses(m)})
            elif arm.trains_r and a.reconstruction_lr_list():
                run(f"pretrain_{arm.name}", lambda arm=arm, one=one: _chosen_r_lr(one, studies[0], arm, run_first))
            else:
                run(f"pretrain_{arm.name}", lambda arm=arm: one.pretrain(arm))
        for arm in arms:
            for seed in a.seed_list():
                run(f"ft_{arm.name}_s{seed}", lambda arm=arm, seed=seed: one.finetune(arm, seed))
    job("timing", study.timing)
    job.close()
    return write_scratch_report(a, [one.store for one in studies], study.data, command)
