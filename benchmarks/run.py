"""Partial vs dense attention, wall-clock, on this machine: `make bench` (or `python benchmarks/run.py`).

Every ratio is measured side by side in one process (cases interleaved, median of repeats) against dense
eager attention at the same shapes. Writes results.json and results.md under --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mixed import mixed_length_rows  # noqa: E402
from cases import PATTERNS, AttentionInputs, base_models, mac_ratio, pattern_indices, peer_modules  # noqa: E402
from timing import (command_line, forward_and_backward, interleaved_medians, interleaved_times,  # noqa: E402
                    no_grad, paired_ratios, saved_bytes)

from hf_partial_attention.configuration_partial_bert import KERNEL_NAMES  # noqa: E402

logger = logging.getLogger("bench")

# The goals of issue 11 are read at these shapes (report.GOALS); ks include k >= d to show where the method loses.
FULL = {"shapes": [dict(b=32, h=12, n=128, d=64, ks=[16, 32, 64]), dict(b=8, h=12, n=512, d=64, ks=[32, 64])],
        "models": [dict(layers=12, hidden=768, heads=12, b=32, n=128, k=16, modes=["inference", "training step"]),
                   dict(layers=12, hidden=768, heads=12, b=8, n=512, k=32, modes=["inference"]),
                   # RoBERTa-base's shape, through the same mechanism (issue 33): PartialRoberta beside RobertaModel
                   dict(arch="roberta", layers=12, hidden=768, heads=12, b=32, n=128, k=16,
                        modes=["inference", "training step"])],
        # A batch of real-input lengths (issue 23): MiniLM's shape (d_h = 32), buckets as the demo's checkpoint.
        "mixed": [dict(layers=6, hidden=384, heads=12, b=32, n=128, k=16, lengths=[16, 32, 64, 128],
                       t_range=[10, 75], bucket_k={64: 24})],
        "repeats": 7, "model_repeats": 5}
QUICK = {"shapes": [dict(b=2, h=2, n=16, d=8, ks=[4, 8]), dict(b=1, h=2, n=32, d=8, ks=[4])],
         "models": [dict(layers=2, hidden=32, heads=4, b=2, n=16, k=4, modes=["inference", "training step"]),
                    dict(layers=2, hidden=32, heads=4, b=1, n=32, k=4, modes=["inference"]),
                    dict(arch="roberta", layers=2, hidden=32, heads=4, b=2, n=16, k=4,
                         modes=["inference", "training step"])],
         "mixed": [dict(layers=2, hidden=32, heads=4, b=4, n=32, k=4, lengths=[8, 16, 32], t_range=[3, 30],
                        bucket_k={16: 6})],
         "repeats": 2, "model_repeats": 1}
# The kernels timed on a CPU (triton: benchmarks/gpu.py); gather, the reference, only where small.
IMPLEMENTATIONS = tuple(impl for impl in KERNEL_NAMES if impl != "triton")
KERNELS = tuple(impl for impl in IMPLEMENTATIONS if impl != "gather")


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


def attention_rows(shape: dict, repeats: int, skip_gather_over: int) -> list[dict]:
    rows = []
    b, h, n, d = shape["b"], shape["h"], shape["n"], shape["d"]
    for k in tqdm(shape["ks"], desc=f"attention n={n}", leave=False):
        for mode in ("forward", "forward+backward"):
            grad = mode != "forward"
            inp = AttentionInputs(b, h, n, d, k, requires_grad=grad)
            fns, auto, indices = {"dense_eager": inp.dense_eager, "sdpa": inp.sdpa}, {}, {}
            for family in PATTERNS:
                idx = indices[family] = pattern_indices(family, n, k)
                auto[family] = inp.resolved(idx, family, grad)
                gather_ok = b * h * n * k * d <= skip_gather_over  # the reference: O(B·H·n·k·d) memory
                for impl in (IMPLEMENTATIONS if gather_ok else KERNELS):
                    if impl == "tiled" and grad:
                        continue  # inference only: under autograd a tiled call runs fused
                    fns[f"{impl}/{family}"] = inp.partial(impl, idx, family)
            mem = {name: saved_bytes(fn) for name, fn in fns.items()} if grad else {}
            run = {name: (forward_and_backward(fn, inp.tensors()) if grad else no_grad(fn)) for name, fn in fns.items()}
            med = interleaved_medians(run, repeats)
            for name, seconds in med.items():
                impl, _, family = name.partition("/")
                rows.append({"n": n, "b": b, "d": d, "k": k, "mode": mode, "case": name, "implementation": impl,
                             "pattern": family or "-", "ms": 1e3 * seconds, "ratio": seconds / med["dense_eager"],
                             "sdpa_ratio": seconds / med["sdpa"], "saved_MiB": mem.get(name, 0) / 2**20,
                             "auto": bool(family) and auto[family] == impl,
                             "mac_ratio": mac_ratio(n, d, k, impl, indices[family]) if family else 1.0})
    return rows


def breakdown(shape: dict, k: int, repeats: int) -> dict:
    """Forward time of each step, in units of one dense QKᵀ (the part the method replaces)."""
    b, h, n, d = shape["b"], shape["h"], shape["n"], shape["d"]
    inp = AttentionInputs(b, h, n, d, k, requires_grad=False)
    scores = inp.q @ inp.k.transpose(-1, -2)
    probs = scores.softmax(-1)
    cols = pattern_indices("columns", n, k)[0]
    exact = inp.q @ inp.k[:, :, cols].transpose(-1, -2)
    rows_first = exact.permute(2, 0, 1, 3).reshape(n, b * h, k)
    w = torch.randn(n, k, n)
    steps = {"dense QK^T": lambda: inp.q @ inp.k.transpose(-1, -2), "softmax": lambda: scores.softmax(-1),
             "P·V": lambda: probs @ inp.v,
             "exact part (shared columns GEMM)": lambda: inp.q @ inp.k[:, :, cols].transpose(-1, -2),
             "reconstruction ([I|R] batched matmul)": lambda: torch.bmm(rows_first, w),
             "dense eager total": inp.dense_eager}
    med = interleaved_medians({name: no_grad(fn) for name, fn in steps.items()}, repeats)
    unit = med["dense QK^T"]
    return {name: seconds / unit for name, seconds in med.items()}


def peer_rows(shape: dict, k: int, repeats: int) -> list[dict]:
    fns = peer_modules(shape["b"], shape["n"], shape["h"] * shape["d"], shape["h"], k)
    med = interleaved_medians({name: no_grad(fn) for name, fn in fns.items()}, repeats)
    return [{"n": shape["n"], "b": shape["b"], "k": k, "case": name, "ms": 1e3 * s, "ratio": s / med["bert_eager"]}
            for name, s in med.items()]


def model_rows(spec: dict, repeats: int) -> list[dict]:
    """BertModel (eager, SDPA) and PartialBertModel (auto) side by side: inference forward, and a training step
    (forward, backward of the mean squared last hidden state, AdamW step). ``spec["models"]``, when given, names
    the models to time (of `cases.base_models`; both BertModels are needed as baselines)."""
    arch = spec.get("arch", "bert")
    models = base_models(spec["layers"], spec["hidden"], spec["heads"], spec["n"], spec["k"], arch=arch)
    base_eager, base_sdpa = list(models)[:2]  # the source model, eager and SDPA: the baselines
    chosen = spec.get("models", list(models))
    if not {base_eager, base_sdpa} <= set(chosen) <= set(models):
        raise ValueError(f"spec['models'] = {chosen!r}: name models of {list(models)}, both {base_eager.split()[0]}s "
                         "included (they are the baselines)")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (spec["b"], spec["n"]), generator=g)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-5) for name, m in models.items()}

    def step(name):
        model = models[name]

        def run():
            model.train()
            opts[name].zero_grad(set_to_none=True)
            model(input_ids=ids).last_hidden_state.pow(2).mean().backward()
            opts[name].step()
        return run

    def infer(name):
        model = models[name]

        def run():
            model.eval()
            with torch.no_grad():
                model(input_ids=ids)
        return run

    rows = []
    for mode in spec["modes"]:
        make = step if mode == "training step" else infer
        names = [m for m in models if not (mode == "training step" and m.endswith(" per_query"))
                 and m in chosen]
        times = interleaved_times({name: make(name) for name in names}, repeats)
        for name in names:
            # Ratios round by round (each model timed right after the others), so that a slow round slows all.
            eager, sdpa = paired_ratios(times, name, base_eager), paired_ratios(times, name, base_sdpa)
            # round_s: each round's seconds, in round order (so any other estimator can be computed from the JSON)
            rows.append({"mode": mode, "model": name, "s": statistics.median(times[name]), "round_s": times[name],
                         "ratio": eager["median"], "ratio_range": [eager["low"], eager["high"]],
                         "ratio_interval": eager["interval"], "sdpa_ratio": sdpa["median"],
                         "sdpa_ratio_range": [sdpa["low"], sdpa["high"]], "sdpa_ratio_interval": sdpa["interval"],
                         "interval_coverage": eager["coverage"], "rounds": repeats,
                         "arch": arch, **{key: spec[key] for key in ("layers", "hidden", "heads", "b", "n", "k")}})
    return rows


# Whole-model rows run in a fresh process (`model_rows_in_a_fresh_process`). Only tests that check what the rows
# record, never their speed, turn it off (the ~10 s of imports a child pays, four times in `--quick`): the model
# study's test keeps the fresh processes.
FRESH_PROCESSES = True


def model_rows_in_a_fresh_process(spec: dict, repeats: int, threads: int | None = None) -> list[dict]:
    """`model_rows` in a child process (same environment, so the same allocator settings). A process that has run
    the attention cases before times whole models differently (BertModel eager at n = 512: 4.7 s there, in
    `make bench` at commit c793ca8, and 6.7 s in a fresh process in the committed results; SDPA 4.7 s and 5.4 s):
    a fresh process is what a user's job is. With `FRESH_PROCESSES` off (tests of the records), in this process."""
    if not FRESH_PROCESSES:
        return mixed_length_rows(spec, repeats) if "lengths" in spec else model_rows(spec, repeats)
    command = [sys.executable, str(Path(__file__).resolve()), "--model-spec", json.dumps(spec),
               "--model-repeats", str(repeats), *(["--threads", str(threads)] if threads else [])]
    done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# glibc returns freed blocks above its mmap threshold (at most 32 MiB by default) to the system, so a tensor that
# large costs fresh, zeroed pages on every call (dense attention's n×n scores: 25 MiB at B = 32, n = 128; 100 MiB
# at B = 8, n = 512). "reuse" keeps freed blocks for reuse, as jemalloc/tcmalloc-style allocators do.
ALLOCATORS = {"default": {}, "reuse": {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296"}}


def allocator_setting() -> str:
    """Which `ALLOCATORS` setting this process runs under (from its environment)."""
    for name, env in ALLOCATORS.items():
        if env and all(os.environ.get(key) == value for key, value in env.items()):
            return name
    return "default"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, for tests")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--allocator", choices=tuple(ALLOCATORS), default="default",
                        help="glibc malloc settings to run under (reuse: a child process with freed blocks kept)")
    parser.add_argument("--only-mixed", action="store_true",
                        help="only the mixed-length whole-model rows (benchmarks/mixed.py) -> mixed.json / mixed.md")
    parser.add_argument("--model-spec", default=None, help=argparse.SUPPRESS)  # internal: one model comparison
    parser.add_argument("--model-repeats", type=int, default=None, help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.model_spec:  # the child of `model_rows_in_a_fresh_process`: rows as JSON on stdout
        if args.threads:
            torch.set_num_threads(args.threads)
        spec = json.loads(args.model_spec)
        rows = (mixed_length_rows(spec, args.model_repeats) if "lengths" in spec
                else model_rows(spec, args.model_repeats))
        sys.stdout.write(json.dumps(rows) + "\n")
        return {}
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    suffix = "" if args.allocator == "default" else f"_{args.allocator}"
    out = Path(args.out)
    if allocator_setting() != args.allocator:  # malloc reads its settings at start: run in a child process
        env = {key: value for key, value in os.environ.items() if key not in ALLOCATORS["reuse"]}
        subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv],
                       env={**env, **ALLOCATORS[args.allocator]}, check=True)
        return json.loads((out / f"results{suffix}.json").read_text())
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = QUICK if args.quick else FULL
    repeats = args.repeats or spec["repeats"]
    if args.only_mixed:
        from report import mixed_markdown  # noqa: E402  (sibling module)

        rows = []
        for model_spec in spec["mixed"]:
            rows += model_rows_in_a_fresh_process(model_spec, args.repeats or spec["model_repeats"], args.threads)
        mixed = {"command": command_line("run.py", argv), "machine": machine(), "mixed": rows}
        out.mkdir(parents=True, exist_ok=True)
        (out / f"mixed{suffix}.json").write_text(json.dumps(mixed, indent=1))
        (out / f"mixed{suffix}.md").write_text(mixed_markdown(mixed))
        sys.stdout.write(mixed_markdown(mixed))
        return mixed
    result = {"command": command_line("run.py", argv), "machine": {**machine(), "allocator": args.allocator,
              "allocator_env": ALLOCATORS[args.allocator]}, "attention": [], "breakdown": {}, "peers": [], "model": []}
    for shape in spec["shapes"]:
        # gather, the reference kernel (O(B·H·n·k·d) memory), only at --quick shapes
        result["attention"] += attention_rows(shape, repeats, skip_gather_over=2**16)
        k_mid = shape["ks"][len(shape["ks"]) // 2]
        result["breakdown"][f"n={shape['n']},k={k_mid}"] = breakdown(shape, k_mid, repeats)
        result["peers"] += peer_rows(shape, k_mid, repeats)
    for model_spec in spec["models"]:
        result["model"] += model_rows_in_a_fresh_process(model_spec, spec["model_repeats"], args.threads)
    result["mixed"] = []
    for model_spec in spec["mixed"]:  # mixed_length_rows, in a fresh process as the other whole-model rows
        result["mixed"] += model_rows_in_a_fresh_process(model_spec, spec["model_repeats"], args.threads)
    from report import goal_rows, markdown, rule_misses  # noqa: E402  (sibling module)

    result["goals"] = goal_rows(result)
    result["rule_misses"] = rule_misses(result["attention"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"results{suffix}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (out / f"results{suffix}.md").write_text(text)
    sys.stdout.write(text)
    return result


if __name__ == "__main__":
    main()
