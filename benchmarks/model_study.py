"""The whole-model speed goals with enough rounds to decide them: `make bench-model`
(or `python benchmarks/model_study.py`).

`make bench` times each model comparison in 5 rounds. On a shared 2-core machine one round's ratio of two
5-second forwards moves by ±10 %, so 5 rounds cannot tell 0.96x from 0.98x: the same code met and missed the
n = 128 goals in two runs. This study times only the models the goals name (BertModel eager and SDPA, and
PartialBert with the "shared" pattern; and RobertaModel beside PartialRoberta at RoBERTa-base's shape), in many more
rounds (order rotated each round, each comparison in a fresh process as `make bench` does), and reports each goal's
median per-round ratio with a distribution-free 95 % interval for it: a goal is met or missed only where the interval
lies on one side of it.
Writes model_study.json and model_study.md under --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import INTERVAL_NOTE, goal_row, interval_text, model_goals, verdict_text
from run import FULL, QUICK, allocator_setting, machine, model_rows_in_a_fresh_process
from timing import command_line

MODELS = ["BertModel eager", "BertModel sdpa", "PartialBert shared"]  # what the goals compare
# The other architectures' rows (RoBERTa-base's shape): the same comparison, no goal of their own yet.
ARCH_MODELS = {"roberta": ["RobertaModel eager", "RobertaModel sdpa", "PartialRoberta shared"]}
ROUNDS = {"full": 15, "quick": 6}  # 15 rounds: the 4th lowest to the 4th highest ratio, a 96.5 % interval


def study(specs: list[dict], rounds: int, threads: int | None) -> list[dict]:
    rows = []
    for spec in tqdm(specs, desc="model comparisons"):
        models = ARCH_MODELS[spec["arch"]] if spec.get("arch", "bert") != "bert" else MODELS
        rows += model_rows_in_a_fresh_process({**spec, "models": models}, rounds, threads)
    return rows


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# Whole-model speed goals, decided by many rounds", "",
             f"Command: `{result['command']}`  ",
             (f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), "
              f"Python {m['python']}; allocator: {m['allocator']}.  "),
             ("Models: BertModel (eager, SDPA) and PartialBertModel converted from it (every layer but the last "
              "partial, the `shared` pattern, R fixed, `partial_implementation=\"auto\"`, SDPA in the exact last "
              "layer); likewise RobertaModel and PartialRobertaModel at RoBERTa-base's shape (the same mechanism, "
              "no goal of its own); random weights and token ids (speed does not depend on them). Each round runs "
              "every model once, back to back, in an order rotated round by round; each comparison runs in a fresh "
              "process."),
             "", INTERVAL_NOTE, "",
             "| goal | median ratio | interval for the median | goal | met |", "|---|---|---|---|---|"]
    for g in result["goals"]:
        lines.append(f"| {g['goal']} | {g['measured']:.3f}x | {interval_text(g)} | <= {g['bound']} | "
                     f"{verdict_text(g)} |")
    lines += ["", "| mode | B | n | k | model | median s | / eager | interval | rounds' range | / SDPA | interval |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["model"]:
        (lo, hi), (rlo, rhi), (slo, shi) = r["ratio_interval"], r["ratio_range"], r["sdpa_ratio_interval"]
        lines.append(f"| {r['mode']} | {r['b']} | {r['n']} | {r['k']} | {r['model']} | {r['s']:.3f} | "
                     f"{r['ratio']:.3f} | {lo:.3f}–{hi:.3f} | {rlo:.2f}–{rhi:.2f} | {r['sdpa_ratio']:.3f} | "
                     f"{slo:.3f}–{shi:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--quick", action="store_true", help="tiny models, for tests")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per comparison (default 15; --quick 6)")
    parser.add_argument("--threads", type=int, default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = args.rounds or ROUNDS["quick" if args.quick else "full"]
    if rounds < 1:
        raise ValueError(f"--rounds {rounds}: give at least 1 (15 for a 95 % interval that can decide)")
    specs = (QUICK if args.quick else FULL)["models"]
    result = {"command": command_line("model_study.py", argv),
              "machine": {**machine(), "allocator": allocator_setting()}, "rounds": rounds,
              "model": study(specs, rounds, args.threads)}
    result["goals"] = [goal_row(*goal) for goal in model_goals(result)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_study.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (out / "model_study.md").write_text(text)
    sys.stdout.write(text)
    return result


if __name__ == "__main__":
    main()
