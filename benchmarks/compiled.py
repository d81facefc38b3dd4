"""Compiled models: PartialBert against BertModel (eager and SDPA attention), each uncompiled and under torch.compile,
inference, with the compiled fast path (`attention_dispatch.compiled_attention`: W and the blocks of rows sharing P and
R read from the pattern module's cache, outside the graph) and without it (W built in the graph at every call, as
before).

    python benchmarks/compiled.py --out benchmarks/results

2 layers at BERT-base widths (hidden 768, 12 heads, intermediate 3072); PartialBert makes all layers but the last
partial, so with 2 layers layer 0 alone is partial. Per-query P (a random sorted P_i per query), R fixed
(``reconstruction="fixed"``), ``partial_implementation="auto"``. Under torch.inference_mode; every model timed in
paired, interleaved rounds in one process (order rotated each round); ratios are medians of per-round ratios.
Writes compiled.md and compiled.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from transformers import BertConfig, BertModel

from hf_partial_attention import AttentionPattern, PartialBertConfig, PartialBertModel
from hf_partial_attention.partial_pattern import PartialPattern

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import command_line, interleaved_times  # noqa: E402

WIDTHS = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, num_hidden_layers=2)
SHAPES = [{"b": 32, "n": 128, "k": 16}, {"b": 8, "n": 512, "k": 32}]
QUICK_WIDTHS = dict(hidden_size=32, num_attention_heads=4, intermediate_size=37, num_hidden_layers=2)
QUICK = [{"b": 2, "n": 16, "k": 4}]
# (numerator, denominator) of each reported ratio, by case name
RATIOS = {"compiled partial / compiled SDPA": ("partial, compiled", "sdpa, compiled"),
          "compiled partial / compiled eager": ("partial, compiled", "eager, compiled"),
          "uncompiled partial / uncompiled SDPA": ("partial", "sdpa"),
          "before: compiled partial / compiled SDPA": ("partial, compiled, before", "sdpa, compiled"),
          "compiled partial / compiled partial before": ("partial, compiled", "partial, compiled, before")}


def _per_query_pattern(n: int, k: int, seed: int = 0) -> AttentionPattern:
    g = torch.Generator().manual_seed(seed)
    indices = torch.sort(torch.argsort(torch.rand(n, n, generator=g), -1)[:, :k], -1).values  # (n, k)
    return AttentionPattern(indices, 0.1 * torch.randn(n, n - k, k, generator=g))


def models(shape: dict, widths: dict) -> dict[str, torch.nn.Module]:
    """BertModel (eager, SDPA) and PartialBert of one weight set; the second PartialBert has the compiled fast path
    off (``before``)."""
    n, k = shape["n"], shape["k"]
    common = dict(vocab_size=1000, max_position_embeddings=max(n, 512), hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, **widths)
    torch.manual_seed(0)
    eager = BertModel(BertConfig(**common, attn_implementation="eager"), add_pooling_layer=False).eval()
    sdpa = BertModel(BertConfig(**common, attn_implementation="sdpa"), add_pooling_layer=False).eval()
    sdpa.load_state_dict(eager.state_dict())
    out = {"eager": eager, "sdpa": sdpa}
    for name, fast in (("partial", True), ("partial, before", False)):
        config = PartialBertConfig(**common, partial_seq_len=n, partial_k=k, reconstruction="fixed",
                                   partial_implementation="auto", attn_implementation="sdpa")
        model = PartialBertModel(config, pattern=_per_query_pattern(n, k), add_pooling_layer=False).eval()
        model.load_state_dict(eager.state_dict(), strict=False)  # BERT's weights; P and R stay the pattern's
        for module in model.modules():
            if isinstance(module, PartialPattern):
                module.compiled_fast_path = fast
        out[name] = model
    return out


def case(shape: dict, widths: dict, repeats: int, backend: str) -> dict:
    b, n = shape["b"], shape["n"]
    ids = torch.randint(1, 1000, (b, n), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    torch._dynamo.reset()
    built = models(shape, widths)
    cases = {}
    for name, model in built.items():
        compiled = torch.compile(model, backend=backend, dynamic=False, fullgraph=True)
        if name != "partial, before":  # uncompiled, the fast path changes nothing
            cases[name] = lambda m=model: m(input_ids=ids, attention_mask=mask).last_hidden_state
        cases[name.replace("partial, before", "partial") + ", compiled" + (", before" if "before" in name else "")] = \
            lambda m=compiled: m(input_ids=ids, attention_mask=mask).last_hidden_state
    with torch.inference_mode():
        refs = {"bert": cases["sdpa"](), "partial": cases["partial"]()}  # compiled vs uncompiled, same weights
        check = {name: float((fn() - refs["partial" if "partial" in name else "bert"]).abs().max())
                 for name, fn in cases.items()}
        times = interleaved_times(cases, repeats, warmup=2)  # warm-up: compiles, fills W's cache
    ratios = {}
    for label, (num, den) in RATIOS.items():
        per_round = [a / b for a, b in zip(times[num], times[den])]
        ratios[label] = {"median": statistics.median(per_round), "range": [min(per_round), max(per_round)]}
    return {**shape, "ms": {name: 1000 * statistics.median(t) for name, t in times.items()},
            "round_s": times, "ratios": ratios, "max_abs_diff_to_uncompiled": check}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--backend", default=None, help="torch.compile backend (default inductor; eager at --quick)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and the eager backend, for tests")
    args = parser.parse_args(argv)
    backend = args.backend or ("eager" if args.quick else "inductor")
    shapes, widths = (QUICK, QUICK_WIDTHS) if args.quick else (SHAPES, WIDTHS)
    result = {"command": command_line("compiled.py", argv if argv is not None else sys.argv[1:]),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "backend": backend, "widths": widths,
              "rows": [case(shape, widths, args.repeats, backend) for shape in shapes]}
    lines = ["# Compiled models: PartialBert vs BertModel under torch.compile (inference)", "",
             f"Command: `{result['command']}`; torch {result['torch']}, {result['threads']} threads, backend "
             f"{backend}; {widths['num_hidden_layers']} layers (hidden {widths['hidden_size']}, "
             f"{widths['num_attention_heads']} heads, intermediate {widths['intermediate_size']}), layer 0 partial "
             "(all but the last), per-query P, R fixed, `auto` kernel, torch.inference_mode. Medians of "
             f"{args.repeats} interleaved rounds' ratios (lowest–highest round). `before`: the compiled fast path off "
             "(`PartialPattern.compiled_fast_path = False`: W built in the graph at every call).", "",
             "| B | n | k | " + " | ".join(RATIOS) + " |", "|---|---|---|" + "---|" * len(RATIOS)]
    for row in result["rows"]:
        cells = [f"{r['median']:.3f}x ({r['range'][0]:.2f}–{r['range'][1]:.2f})" for r in row["ratios"].values()]
        lines.append(f"| {row['b']} | {row['n']} | {row['k']} | " + " | ".join(cells) + " |")
    lines += ["", "Median ms per call:", "", "| B | n | k | " + " | ".join(result["rows"][0]["ms"]) + " |",
              "|---|---|---|" + "---|" * len(result["rows"][0]["ms"])]
    for row in result["rows"]:
        lines.append(f"| {row['b']} | {row['n']} | {row['k']} | " +
                     " | ".join(f"{ms:.1f}" for ms in row["ms"].values()) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compiled.json").write_text(json.dumps(result, indent=1))
    (out / "compiled.md").write_text("\n".join(lines) + "\n")
    sys.stdout.write("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
