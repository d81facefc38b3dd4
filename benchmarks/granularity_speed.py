"""Whole-model time of P and R per head beside one pooled P and R, and beside BERT eager and SDPA:
`python benchmarks/granularity_speed.py`.

P and R per head run each head by the kernel of its own P and R in inference (H kernel calls per layer instead of
one) and every head in one autograd node under autograd (`attention_fused.all_heads_attention`), with H times the W;
the question is what that costs. The models: `BertModel` (eager and SDPA) of MiniLM's shape (6 layers, hidden 384,
12 heads, d_h 32) with random weights, and PartialBert converted from it (layers 0–4 partial, R fixed, ``auto``):
pooled, and per head, with the local pattern of k keys around each query shifted by h positions for head h (a
different P per head; speed does not depend on R's values). BERT-base shape at n = 512 with ``--spec n512``
(``--modes inference``: a training step there takes minutes a round);
MiniLM's shape at n = 512, B = 4, k = 16 with ``--spec n512_minilm`` (both modes); MPNet-base's shape
(`MPNetModel`, its relative-position bias in every layer) at n = 128, B = 4, k = 32 with ``--spec mpnet_b4``
(inference), beside the same per-head model run head by head (``attention_heads``' one pass turned off: the path
before it), the setting of all-mpnet-base-v2's timing in results/mpnet/.
Each round runs every model once, in an order rotated round by round; ratios are medians of per-round ratios with
a distribution-free interval (`timing.median_interval`). Writes granularity_speed_<spec>.json / .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import BertConfig, BertModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import machine  # noqa: E402
from timing import command_line, median_interval  # noqa: E402

from hf_partial_attention import AttentionPattern, PartialBertModel  # noqa: E402
from hf_partial_attention.pattern_layers import LayerPatterns  # noqa: E402

SPECS = {"n128": dict(layers=6, hidden=384, heads=12, b=32, n=128, k=16),
         "n512": dict(layers=12, hidden=768, heads=12, b=8, n=512, k=32),
         # MiniLM's shape at n = 512 (k = 16 < d_h = 32 saves work): a training step in seconds, not minutes
         "n512_minilm": dict(layers=6, hidden=384, heads=12, b=4, n=512, k=16),
         "mpnet_b4": dict(layers=12, hidden=768, heads=12, b=4, n=128, k=32, arch="mpnet"),
         "tiny": dict(layers=2, hidden=64, heads=4, b=2, n=16, k=4),  # the tests'
         "mpnet_tiny": dict(layers=2, hidden=64, heads=4, b=2, n=16, k=4, arch="mpnet")}
MODES = ("inference", "training step")
# ratio key -> the model each model is divided by, round by round
BASELINES = {"vs_pooled": "PartialBert pooled", "vs_eager": "BertModel eager", "vs_sdpa": "BertModel sdpa"}


def shifted_local(n: int, k: int, shift: int) -> AttentionPattern:
    """The local pattern (k keys around each query, R from the stationary prior) with P moved ``shift`` keys to the
    right where it fits: another P per head, each row sorted and in range."""
    base = AttentionPattern.local(n, k)
    moved = (base.indices + shift).clamp(max=n - 1)
    rows = [sorted(set(r.tolist())) for r in moved]
    if any(len(r) < k for r in rows):  # clamped duplicates at the end: keep the base row there
        rows = [r if len(r) == k else b.tolist() for r, b in zip(rows, base.indices)]
    indices = torch.tensor(rows)
    return AttentionPattern(indices, base.reconstruction)


def mpnet_models(spec: dict) -> dict:
    """MPNet (eager: its attention has no SDPA form), partial pooled and per head, and per head head by head."""
    from transformers import MPNetConfig, MPNetModel

    import hf_partial_attention.attention_dispatch as dispatch
    from hf_partial_attention.modeling_partial_encoders import partial_from_source

    torch.manual_seed(0)
    source = MPNetModel(MPNetConfig(num_hidden_layers=spec["layers"], hidden_size=spec["hidden"],
                                    num_attention_heads=spec["heads"], intermediate_size=4 * spec["hidden"],
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    n, k, heads = spec["n"], spec["k"], spec["heads"]
    layers = range(spec["layers"] - 1)  # the paper's: the last layer exact
    per_head = LayerPatterns({layer: [shifted_local(n, k, h) for h in range(heads)] for layer in layers})
    pooled = LayerPatterns({layer: AttentionPattern.local(n, k) for layer in layers})
    one_pass = partial_from_source(source, per_head, reconstruction="fixed")

    class HeadByHead(torch.nn.Module):  # the same model, its per-head layers run each head by its own kernel
        def __init__(self):
            super().__init__()
            self.model = one_pass

        def forward(self, **batch):
            saved, dispatch.heads_in_one_pass = dispatch.heads_in_one_pass, lambda *a: False
            try:
                return self.model(**batch)
            finally:
                dispatch.heads_in_one_pass = saved

    return {"MPNetModel eager": source, "partial pooled": partial_from_source(source, pooled, reconstruction="fixed"),
            "partial per head": one_pass, "partial per head, head by head": HeadByHead()}


def models(spec: dict) -> dict:
    if spec.get("arch") == "mpnet":
        return mpnet_models(spec)
    torch.manual_seed(0)
    cfg = dict(num_hidden_layers=spec["layers"], hidden_size=spec["hidden"], num_attention_heads=spec["heads"],
               intermediate_size=4 * spec["hidden"], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               max_position_embeddings=max(512, spec["n"]))
    eager = BertModel(BertConfig(**cfg, attn_implementation="eager"))
    sdpa = BertModel(BertConfig(**cfg, attn_implementation="sdpa"))
    sdpa.load_state_dict(eager.state_dict())
    n, k, heads = spec["n"], spec["k"], spec["heads"]
    per_head = LayerPatterns({layer: [shifted_local(n, k, h) for h in range(heads)]
                              for layer in range(spec["layers"])})
    out = {"BertModel eager": eager, "BertModel sdpa": sdpa,
           "PartialBert pooled": PartialBertModel.from_bert(eager, AttentionPattern.local(n, k),
                                                            reconstruction="fixed", attn_implementation="sdpa"),
           "PartialBert per head": PartialBertModel.from_bert(eager, per_head, reconstruction="fixed",
                                                              attn_implementation="sdpa")}
    return out


def run(spec: dict, rounds: int, modes=MODES) -> dict:
    torch.manual_seed(1)
    ids = torch.randint(1000, 20000, (spec["b"], spec["n"]))
    mask = torch.ones_like(ids)
    named = models(spec)
    results = {}
    for mode in modes:
        def step(model):
            if mode == "inference":
                model.eval()
                with torch.no_grad():
                    model(input_ids=ids, attention_mask=mask)
            else:
                model.train()
                model(input_ids=ids, attention_mask=mask).last_hidden_state.square().mean().backward()
                model.zero_grad(set_to_none=True)
        for model in named.values():  # warm-up
            step(model)
        times = {name: [] for name in named}
        order = list(named)
        for r in range(rounds):
            for name in order[r % len(order):] + order[:r % len(order)]:
                start = time.perf_counter()
                step(named[name])
                times[name].append(time.perf_counter() - start)
        rows = {}
        for name in named:
            row = {"median_s": statistics.median(times[name]), "round_s": times[name]}
            for key, base in baselines(spec).items():
                ratios = [a / b for a, b in zip(times[name], times[base])]
                ci = median_interval(ratios)
                row[key] = {"median": statistics.median(ratios), "interval": [ci["low"], ci["high"]],
                                    "coverage": ci["coverage"]}
            rows[name] = row
        results[mode] = rows
    return results


def baselines(spec: dict) -> dict:
    """Ratio key -> the model each model is divided by (MPNet: pooled and eager, it has no SDPA)."""
    if spec.get("arch") == "mpnet":
        return {"vs_pooled": "partial pooled", "vs_eager": "MPNetModel eager"}
    return BASELINES


def markdown(result: dict) -> str:
    spec = result["spec"]
    keys = baselines(spec)
    lines = [f"# P and R per head beside pooled, {spec.get('arch', 'BERT')} eager"
             f"{'' if 'vs_sdpa' not in keys else ' and SDPA'} ({result['spec_name']})", "",
             f"Command: `{result['command']}`; {spec['layers']} layers, hidden {spec['hidden']}, "
             f"{spec['heads']} heads, B = {spec['b']}, n = {spec['n']}, k = {spec['k']}; {result['rounds']} rounds, "
             f"order rotated; {result['machine'].get('cpu', '')}, {result['machine'].get('torch_threads', '')} "
             "threads.", "",
             "| mode | model | median s | " + " | ".join(f"/ {key[3:].replace('sdpa', 'SDPA')} | interval"
                                                      for key in keys) + " |",
             "|---|---|---|" + "---|---|" * len(keys)]
    for mode, rows in result["results"].items():
        for name, row in rows.items():
            cells = [mode, name, f"{row['median_s']:.3f}"]
            for key in keys:
                r = row[key]
                cells += [f"{r['median']:.3f}", f"{r['interval'][0]:.3f}–{r['interval'][1]:.3f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", choices=list(SPECS), default="n128")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="benchmarks/results/granularity")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"command": command_line("granularity_speed.py", argv), "spec_name": args.spec, "spec": SPECS[args.spec],
              "rounds": args.rounds, "machine": machine(),
              "results": run(SPECS[args.spec], args.rounds, tuple(args.modes))}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"granularity_speed_{args.spec}.json").write_text(json.dumps(result, indent=1))
    (out / f"granularity_speed_{args.spec}.md").write_text(markdown(result))
    sys.stdout.write(markdown(result))
    return result


if __name__ == "__main__":
    main()
