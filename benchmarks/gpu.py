#!/usr/bin/env python
"""GPU timings of the fused Triton partial-attention kernel against SDPA (flash) and eager attention.

BERT-base shapes (H = 12, d = 64), bf16, n ∈ {128, 512, 1024}, k ∈ {16, 32}, a block-structured P (rows in
blocks of 64 share their keys) and a per-query P; forward (R frozen: W built once, as in inference) and
forward + backward (R trained: W rebuilt from R inside the timed step, gradients to Q, K, V and R). Also: the
memory autograd keeps for the backward, and achieved TFLOP/s (the multiply-adds each method needs, ×2, over
its time) against the chip's dense bf16 matrix rate. Before timing, the kernel is checked against the
reference kernel at one shape in float32.

Runs from the working tree with nothing installed but torch and triton (as on the project's lent H200):

    PYTHONPATH=src python3 benchmarks/gpu.py --out benchmarks/results

``--dry-run`` runs every step at tiny shapes on CPU under Triton's interpreter (the tests do), so the script
cannot rot without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported

import torch  # noqa: E402

from hf_partial_attention.attention_common import PatternLayout, reconstruction_matrix  # noqa: E402
from hf_partial_attention.attention_dispatch import partial_attention_forward  # noqa: E402
from hf_partial_attention.attention_triton import triton_partial_attention  # noqa: E402

# Dense bf16 tensor-core peak (TFLOP/s, no sparsity) by device name, for the achieved-rate column.
MATRIX_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def matrix_rate(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((rate for key, rate in MATRIX_TFLOPS.items() if key in name), None)


def pattern(n: int, k: int, family: str, gen: torch.Generator) -> torch.Tensor:
    """P ``(n, k)``: a per-query random key set, or one key set per block of 64 rows."""
    if family == "blocks":
        rows = min(64, n)
        return torch.cat([torch.sort(torch.randperm(n, generator=gen)[:k]).values.expand(rows, k)
                          for _ in range(n // rows)])
    return torch.sort(torch.argsort(torch.rand(n, n, generator=gen), -1)[:, :k], -1).values


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def saved_bytes(fn, device) -> int | None:
    """Memory held after a forward with autograd (what the backward will need), beyond the inputs."""
    if device.type != "cuda":
        return None
    sync(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    sync(device)
    held = torch.cuda.memory_allocated(device) - before
    del out
    return held


def eager(q, k, v, scale):
    return torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v


def sdpa(q, k, v, scale):
    if q.device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)


def check(device) -> float:
    """Largest |triton − reference| at one shape in float32 (outputs), with a padding mask."""
    gen = torch.Generator().manual_seed(0)
    n, k, d = 64, 16, 64
    layout = PatternLayout.from_indices(pattern(n, k, "per_query", gen).to(device))
    q, key, v = (torch.randn(2, 2, n, d, generator=gen).to(device) for _ in range(3))
    r = (torch.randn(n, n - k, k, generator=gen) * 0.3).to(device)
    mask = torch.ones(2, 1, n, n, dtype=torch.bool, device=device)
    mask[1, ..., 50:] = False

    class Layer(torch.nn.Module):
        pass

    layer = Layer().eval()
    outs = [partial_attention_forward(layer, q, key, v, mask, layout=layout, reconstruction=r, scaling=d ** -0.5,
                                      implementation=impl, need_weights=False)[0] for impl in ("gather", "triton")]
    return float((outs[0] - outs[1]).abs().max())


def run(args) -> dict:
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    heads, d = (2, 16) if args.dry_run else (12, 64)
    shapes = [(32, 1)] if args.dry_run else [(128, 64), (512, 32), (1024, 8)]  # (n, B)
    ks = (8,) if args.dry_run else (16, 32)
    repeats = 1 if args.dry_run else args.repeats
    gen = torch.Generator().manual_seed(0)
    error = check(device)
    rate = matrix_rate(device)
    rows = []
    for n, batch in shapes:
        q, key, v = (torch.randn(batch, heads, n, d, generator=gen).to(device, dtype) for _ in range(3))
        scale = d ** -0.5
        dense_flop = 4 * batch * heads * n * n * d  # QKᵀ and P·V, 2 flop per multiply-add
        base = {}
        for name, fn in (("eager", eager), ("sdpa", sdpa)):
            leaves = [x.detach().requires_grad_() for x in (q, key, v)]
            with torch.no_grad():
                fwd = median_ms(lambda fn=fn: fn(q, key, v, scale), device, repeats)
            both = median_ms(lambda fn=fn, leaves=leaves: fn(*leaves, scale).sum().backward(), device, repeats)
            held = saved_bytes(lambda fn=fn, leaves=leaves: fn(*leaves, scale), device)
            base[name] = {"forward_ms": fwd, "train_ms": both, "saved_bytes": held}
            rows.append({"n": n, "batch": batch, "k": None, "family": None, "method": name, **base[name],
                         "tflops_forward": dense_flop / fwd / 1e9, "flop_forward": dense_flop})
        for k in ks:
            for family in ("blocks", "per_query"):
                layout = PatternLayout.from_indices(pattern(n, k, family, gen).to(device))
                r = (torch.randn(n, n - k, k, generator=gen) * 0.3).to(device)
                w = reconstruction_matrix(layout, r)  # frozen R: built once
                with torch.no_grad():
                    fwd = median_ms(lambda: triton_partial_attention(q, key, v, w, None, None, None, layout.indices,
                                                                     scale), device, repeats)
                leaves = [x.detach().requires_grad_() for x in (q, key, v)]
                r_leaf = r.clone().requires_grad_()

                def step(leaves=leaves, r_leaf=r_leaf, layout=layout):
                    w_step = reconstruction_matrix(layout, r_leaf)  # trained R: W from R inside the step
                    triton_partial_attention(*leaves, w_step, None, None, None, layout.indices, scale).sum().backward()

                both = median_ms(step, device, repeats)
                held = saved_bytes(lambda leaves=leaves, layout=layout, w=w: triton_partial_attention(
                    *leaves, w.detach().requires_grad_(), None, None, None, layout.indices, scale), device)
                flop = 2 * batch * heads * n * (k * d + n * k + n * d)  # exact part, reconstruction, P·V
                rows.append({"n": n, "batch": batch, "k": k, "family": family, "method": "triton",
                             "forward_ms": fwd, "train_ms": both, "saved_bytes": held,
                             "tflops_forward": flop / fwd / 1e9, "flop_forward": flop,
                             "forward_vs_sdpa": fwd / base["sdpa"]["forward_ms"],
                             "train_vs_sdpa": both / base["sdpa"]["train_ms"],
                             "forward_vs_eager": fwd / base["eager"]["forward_ms"],
                             "saved_vs_eager": (held / base["eager"]["saved_bytes"]) if held is not None else None})
    return {"command": " ".join(["python3 benchmarks/gpu.py", *sys.argv[1:]]),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "dtype": str(dtype).replace("torch.", ""), "heads": heads, "head_dim": d, "torch": torch.__version__,
            "triton": __import__("triton").__version__, "python": sys.version.split()[0],
            "interpreter": args.dry_run, "matrix_tflops": rate, "check_max_abs_error": error, "rows": rows}


def render(result: dict) -> str:
    rate = result["matrix_tflops"]
    lines = [f"# Triton partial attention on {result['device']}", "",
             f"`{result['command']}`: {result['dtype']}, H = {result['heads']}, d = {result['head_dim']}; torch "
             f"{result['torch']}, triton {result['triton']}"
             f"{' (interpreter, dry run)' if result['interpreter'] else ''}."
             f" Kernel vs reference (float32, padding mask): max |Δ| = {result['check_max_abs_error']:.2e}.", "",
             "| n | B | k | P | method | forward ms | fwd+bwd ms | fwd / SDPA | fwd+bwd / SDPA | fwd / eager | "
             "saved for bwd / eager | TFLOP/s (fwd) | % of matrix peak |", "|" + "---|" * 13]
    f = lambda v, p=2: "–" if v is None else f"{v:.{p}f}"  # noqa: E731
    for r in result["rows"]:
        lines.append(f"| {r['n']} | {r['batch']} | {r['k'] or '–'} | {r['family'] or '–'} | {r['method']} | "
                     f"{r['forward_ms']:.3f} | {r['train_ms']:.3f} | {f(r.get('forward_vs_sdpa'))} | "
                     f"{f(r.get('train_vs_sdpa'))} | {f(r.get('forward_vs_eager'))} | {f(r.get('saved_vs_eager'))} | "
                     f"{r['tflops_forward']:.1f} | {f(100 * r['tflops_forward'] / rate if rate else None, 1)} |")
    lines += ["", "TFLOP/s: 2 × the multiply-adds each method needs (dense: QKᵀ and P·V; partial: k·d + n·k + n·d "
              "per query) over its forward time. Forward: R frozen (W built once); fwd+bwd: W rebuilt from a "
              "trained R inside the step.", ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="gpu.md and gpu.json go here")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    args = parser.parse_args(argv)
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--dry-run needs TRITON_INTERPRET=1 before triton kernels are defined.")
    result = run(args)
    os.makedirs(args.out, exist_ok=True)
    stem = "gpu_dry_run" if args.dry_run else "gpu"
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write(render(result))
    return result


if __name__ == "__main__":
    main()
