"""Whole-model timings of this checkout beside another commit's, interleaved: `python benchmarks/compare_commits.py
--base <commit>`.

Two runs of `model_study.py` made at different times cannot tell a 3 % change from the machine's drift (their 96 %
intervals overlap). Here the two trees alternate, process by process (each a fresh process of `run.py`'s one-model
comparison, as the study runs them: the base commit's code from a git worktree, this checkout's from ``src/``), so
that drift hits both alike; every process times the partial model beside the source model's eager and SDPA
attention in the same rounds. Reported per tree: the median of all per-round ratios (partial / eager, partial /
SDPA) with its distribution-free interval, and the per-round seconds. Writes compare_commits.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import command_line, median_interval

ROOT = Path(__file__).resolve().parent.parent
SPECS = {"n512": dict(layers=12, hidden=768, heads=12, b=8, n=512, k=32, modes=["inference"]),
         "n128": dict(layers=12, hidden=768, heads=12, b=32, n=128, k=16, modes=["inference", "training step"])}
MODELS = ["BertModel eager", "BertModel sdpa", "PartialBert shared"]


def one_process(tree: Path, spec: dict, rounds: int) -> list[dict]:
    """`run.py --model-spec` of ``tree`` (its own benchmarks/ and src/) in a fresh process: its rows."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    command = [sys.executable, str(tree / "benchmarks" / "run.py"), "--model-spec",
               json.dumps({**spec, "models": MODELS}), "--model-repeats", str(rounds)]
    done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, env=env, cwd=tree)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(rows: list[dict]) -> dict:
    """Per mode: every process's per-round ratios of the partial model, pooled."""
    out = {}
    for mode in sorted({r["mode"] for r in rows}):
        by = {m: [r for r in rows if r["mode"] == mode and r["model"] == m] for m in MODELS}
        entry = {}
        for base, key in (("BertModel eager", "eager"), ("BertModel sdpa", "sdpa")):
            ratios = [p / b for ps, bs in zip(by["PartialBert shared"], by[base])
                      for p, b in zip(ps["round_s"], bs["round_s"])]
            ci = median_interval(ratios)
            entry[key] = {"median": statistics.median(ratios), "interval": [ci["low"], ci["high"]],
                          "coverage": ci["coverage"], "rounds": len(ratios)}
        entry["partial_s"] = statistics.median(s for r in by["PartialBert shared"] for s in r["round_s"])
        out[mode] = entry
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare with (e.g. 5e49e7e)")
    parser.add_argument("--spec", choices=list(SPECS), default="n512")
    parser.add_argument("--processes", type=int, default=5, help="fresh processes per tree (alternating)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per process")
    parser.add_argument("--out", default="benchmarks/results/compare_commits")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    base_sha = subprocess.run(["git", "rev-parse", args.base], cwd=ROOT, check=True, stdout=subprocess.PIPE,
                              text=True).stdout.strip()
    head_sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, stdout=subprocess.PIPE,
                              text=True).stdout.strip()
    spec = SPECS[args.spec]
    rows: dict[str, list] = {"base": [], "head": []}
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base_tree), base_sha], cwd=ROOT, check=True)
        try:
            for i in range(args.processes):
                order = [("base", base_tree), ("head", ROOT)] if i % 2 == 0 else [("head", ROOT), ("base", base_tree)]
                for name, tree in order:
                    rows[name] += one_process(tree, spec, args.rounds)
                    print(f"process {i + 1}/{args.processes} {name} done", file=sys.stderr)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False)
    result = {"command": command_line("compare_commits.py", argv), "base": base_sha, "head": head_sha,
              "spec": spec, "processes": args.processes, "rounds_per_process": args.rounds,
              "summary": {name: summary(r) for name, r in rows.items()}, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"compare_{args.spec}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# PartialBert at {head_sha[:7]} beside {base_sha[:7]}, interleaved", "",
             f"Command: `{result['command']}`; spec {json.dumps(spec)}; {args.processes} fresh processes per tree, "
             f"alternating, {args.rounds} rounds each.", "",
             "| tree | mode | partial median s | / eager | interval | / SDPA | interval |",
             "|---|---|---|---|---|---|---|"]
    for name, sha in (("base", base_sha), ("head", head_sha)):
        for mode, e in result["summary"][name].items():
            lines.append(f"| {name} ({sha[:7]}) | {mode} | {e['partial_s']:.3f} | {e['eager']['median']:.3f} | "
                         f"{e['eager']['interval'][0]:.3f}–{e['eager']['interval'][1]:.3f} | "
                         f"{e['sdpa']['median']:.3f} | {e['sdpa']['interval'][0]:.3f}–{e['sdpa']['interval'][1]:.3f} |")
    (out / f"compare_{args.spec}.md").write_text("\n".join(lines) + "\n")
    sys.stdout.write("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
