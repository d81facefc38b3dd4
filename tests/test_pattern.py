"""AttentionPattern: construction, validation, save/load."""

import pytest
import torch
from safetensors.torch import save_file

from hf_partial_attention import AttentionPattern


def make(n=6, k=2, bias=False):
    idx = torch.stack([torch.tensor(sorted({i, (i + 1) % n})) for i in range(n)])
    r = torch.randn(n, n - k, k)
    return AttentionPattern(idx, r, torch.randn(n, n - k) if bias else None, metadata={"source_model": "x"})


def test_exact_pattern_has_nothing_to_reconstruct():
    p = AttentionPattern.exact(5)
    assert p.k == 5 and p.seq_len == 5 and p.reconstruction.shape == (5, 0, 5)
    assert p.complement.shape == (5, 0)


def test_local_pattern_is_the_band_with_its_ar1_reconstruction():
    p = AttentionPattern.local(6, 3, correlation=0.5)
    assert p.indices.tolist() == [[0, 1, 2], [0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5], [3, 4, 5]]
    assert p.metadata == {"method": "local_prior", "correlation": 0.5}
    # row 3 keeps keys 2, 3, 4; under the AR(1) prior key 0 is predicted from key 2 alone: 0.5² · a_2
    assert p.complement[3].tolist() == [0, 1, 5]
    torch.testing.assert_close(p.reconstruction[3], torch.tensor([[0.25, 0, 0], [0.5, 0, 0], [0, 0, 0.5]]),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("bias", [False, True])
def test_save_load_round_trip(tmp_path, bias):
    p = make(bias=bias)
    p.metadata["normalized_error"] = 0.125
    p.save(tmp_path / "p.safetensors")
    q = AttentionPattern.load(tmp_path / "p.safetensors")
    assert torch.equal(p.indices, q.indices) and torch.equal(p.reconstruction, q.reconstruction)
    assert (q.bias is None) == (not bias) and (not bias or torch.equal(p.bias, q.bias))
    assert q.metadata == p.metadata and q.normalized_error == 0.125 and q.scope == "per_query"


def test_whole_scope_round_trip(tmp_path):
    p = AttentionPattern(torch.tensor([0, 5, 15]), torch.zeros(13, 3), scope="whole", seq_len=4)
    p.save(tmp_path / "w.safetensors")
    q = AttentionPattern.load(tmp_path / "w.safetensors")
    assert q.scope == "whole" and q.seq_len == 4 and q.size == 16


def test_indices_are_stored_as_int64():
    p = AttentionPattern(torch.tensor([[0], [1]], dtype=torch.int32), torch.zeros(2, 1, 1))
    assert p.indices.dtype == torch.int64


@pytest.mark.parametrize(
    "indices, recon, bias, error, match",
    [
        ([[0, 0], [0, 1], [1, 2]], (3, 1, 2), None, ValueError, "duplicates"),
        ([[0, 3], [0, 1], [1, 2]], (3, 1, 2), None, ValueError, r"\[0, 3\)"),
        ([[-1, 0], [0, 1], [1, 2]], (3, 1, 2), None, ValueError, r"\[0, 3\)"),
        ([[1, 0], [0, 1], [1, 2]], (3, 1, 2), None, ValueError, "sorted"),
        ([[0, 1], [0, 1], [1, 2]], (3, 2, 2), None, ValueError, "reconstruction must have shape"),
        ([[0, 1], [0, 1], [1, 2]], (3, 1, 2), (3, 2), ValueError, "bias must have shape"),
        ([0, 1, 2], (3, 1, 2), None, ValueError, r"\(n, k\)"),
    ],
)
def test_invalid_patterns(indices, recon, bias, error, match):
    with pytest.raises(error, match=match):
        AttentionPattern(torch.tensor(indices), torch.zeros(recon), None if bias is None else torch.zeros(bias))


def test_nan_and_inf_are_rejected():
    idx = torch.tensor([[0], [1]])
    with pytest.raises(ValueError, match="NaN or Inf"):
        AttentionPattern(idx, torch.tensor([[[float("nan")]], [[0.0]]]))
    with pytest.raises(ValueError, match="bias contains NaN or Inf"):
        AttentionPattern(idx, torch.zeros(2, 1, 1), torch.tensor([[float("inf")], [0.0]]))


def test_type_errors():
    with pytest.raises(TypeError, match="indices must be an integer tensor"):
        AttentionPattern(torch.zeros(2, 1), torch.zeros(2, 1, 1))
    with pytest.raises(TypeError, match="reconstruction must be a torch.Tensor"):
        AttentionPattern(torch.zeros(2, 1, dtype=torch.long), [[0.0]])
    with pytest.raises(ValueError, match="scope"):
        AttentionPattern(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, 1), scope="global")
    with pytest.raises(ValueError, match="seq_len is required"):
        AttentionPattern(torch.tensor([0]), torch.zeros(3, 1), scope="whole")


def test_load_rejects_foreign_files(tmp_path):
    save_file({"x": torch.zeros(1)}, str(tmp_path / "f.safetensors"))
    with pytest.raises(ValueError, match="not a pattern file"):
        AttentionPattern.load(tmp_path / "f.safetensors")
    with pytest.raises(FileNotFoundError):
        AttentionPattern.load(tmp_path / "missing.safetensors")


FIX = "written by `hf-partial-attention derive`"  # every load error says what a right file is


def test_load_names_the_file_and_the_fix_for_files_that_are_not_patterns(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_text("not a safetensors file at all")  # its first 8 bytes read as a huge header length
    with pytest.raises(ValueError) as err:
        AttentionPattern.load(junk)
    message = str(err.value)
    assert str(junk) in message and "not a safetensors file" in message and FIX in message
    assert "SafetensorError" not in type(err.value).__name__
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="not a safetensors file"):
        AttentionPattern.load(tmp_path / "empty.safetensors")
    with pytest.raises(FileNotFoundError, match=r"found a folder.*" + FIX.replace("`", ".")):
        AttentionPattern.load(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"missing\.safetensors' \(found nothing\)"):
        AttentionPattern.load(tmp_path / "missing.safetensors")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "f.safetensors"))
    with pytest.raises(ValueError, match=r"but not a pattern file .*" + FIX.replace("`", ".")):
        AttentionPattern.load(tmp_path / "f.safetensors")


def test_load_names_the_file_of_a_damaged_pattern(tmp_path):
    import json

    header = {"format_version": "1", "scope": "per_query", "seq_len": 6, "k": 2, "metadata": {}}
    meta = {"hf_partial_attention": json.dumps(header)}
    save_file({"indices": make().indices}, str(tmp_path / "no_r.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match=r"no_r\.safetensors' is a damaged pattern file: it lacks \['reconstruction"):
        AttentionPattern.load(tmp_path / "no_r.safetensors")
    p = make()
    narrow = p.reconstruction[:, :1].contiguous()  # R (6, 1, 2) for P (6, 2): the constructor's check, file named
    save_file({"indices": p.indices, "reconstruction": narrow}, str(tmp_path / "bad.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match=r"bad\.safetensors' holds an invalid pattern: reconstruction must have shape"):
        AttentionPattern.load(tmp_path / "bad.safetensors")


def test_load_checks_the_format_version(tmp_path):
    import json

    from safetensors import safe_open

    make().save(tmp_path / "p.safetensors")
    with safe_open(str(tmp_path / "p.safetensors"), framework="pt") as f:
        header = json.loads(f.metadata()["hf_partial_attention"])
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    assert header["format_version"] == "1"
    header["format_version"] = "2"  # written by a newer version
    save_file(tensors, str(tmp_path / "new.safetensors"), metadata={"hf_partial_attention": json.dumps(header)})
    with pytest.raises(ValueError, match="format version 2; this version of hf-partial-attention reads version 1"):
        AttentionPattern.load(tmp_path / "new.safetensors")


def test_repr_shows_the_heldout_error_beside_the_predicted_one():
    p = make()
    assert repr(p).endswith("bias=False)") and p.heldout_error is None
    p.metadata.update(normalized_error=0.094, heldout_normalized_error=0.375)
    assert p.heldout_error == 0.375
    assert repr(p) == ("AttentionPattern(scope='per_query', seq_len=6, k=2, bias=False, "
                       "normalized_error=0.094 (held-out 0.375))")
