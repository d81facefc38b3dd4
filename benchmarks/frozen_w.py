"""Frozen R: the fused kernel's W = [I | R] built once and reused, against rebuilding it on every call.

    python benchmarks/frozen_w.py --out benchmarks/results

Shared-columns pattern (one key set for every query), fixed R, no autograd; dense eager attention and SDPA at the
same shapes, timed interleaved in one process (medians). Writes frozen_w.md and frozen_w.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

from hf_partial_attention.attention_common import DerivedState, PartialTensors, PatternLayout
from hf_partial_attention.attention_fused import fused_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import command_line, interleaved_medians  # noqa: E402

SHAPES = [{"b": 32, "n": 128, "k": 16}, {"b": 8, "n": 512, "k": 32}]
QUICK = [{"b": 2, "n": 32, "k": 4}]


def rows(shape: dict, repeats: int, heads: int = 12, d: int = 64) -> dict:
    b, n, k = shape["b"], shape["n"], shape["k"]
    gen = torch.Generator().manual_seed(0)
    q, key, v = (torch.randn(b, heads, n, d, generator=gen) for _ in range(3))
    layout = PatternLayout.from_indices(torch.sort(torch.randperm(n, generator=gen)[:k]).values.expand(n, k).clone())
    r = 0.1 * torch.randn(n, n - k, k, generator=gen)
    module = nn.Module().eval()

    def fused(derived):  # the owner's cache of W (a model's pattern module holds one), or none: built every call
        return lambda: fused_attention(module, q, key, v, None, d ** -0.5,
                                       partial=PartialTensors(layout, r, None, derived))[0]

    cases = {
        "dense_eager": lambda: torch.softmax(q @ key.transpose(-1, -2) * d ** -0.5, -1) @ v,
        "sdpa": lambda: nn.functional.scaled_dot_product_attention(q, key, v),
        "fused, W cached": fused(DerivedState()),
        "fused, W rebuilt": fused(None),
    }
    with torch.no_grad():
        med = interleaved_medians(cases, repeats)
    return {**shape, "ms": {name: 1000 * s for name, s in med.items()}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, for tests")
    args = parser.parse_args(argv)
    result = {"command": command_line("frozen_w.py", argv if argv is not None else sys.argv[1:]),
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "rows": [rows(shape, args.repeats) for shape in (QUICK if args.quick else SHAPES)]}
    lines = ["# Frozen R: W = [I | R] cached vs rebuilt (fused kernel, shared columns, no autograd)", "",
             f"Command: `{result['command']}`; torch {result['torch']}, {result['threads']} threads; medians of "
             f"{args.repeats} interleaved repeats; ratios to dense eager attention (H = 12, d = 64).", "",
             "| B | n | k | eager ms | SDPA | fused, W rebuilt | fused, W cached |", "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        ms = row["ms"]
        ratio = {name: ms[name] / ms["dense_eager"] for name in ms}
        lines.append(f"| {row['b']} | {row['n']} | {row['k']} | {ms['dense_eager']:.1f} | {ratio['sdpa']:.2f}x | "
                     f"{ratio['fused, W rebuilt']:.2f}x | {ratio['fused, W cached']:.2f}x |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "frozen_w.json").write_text(json.dumps(result, indent=1))
    (out / "frozen_w.md").write_text("\n".join(lines) + "\n")
    sys.stdout.write("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
