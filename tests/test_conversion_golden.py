"""`from_bert` / `from_source` give the models an earlier commit's code gave (float64): checkpoints written at 1d3fce2,
before PartialBert was generated from the architecture table (tests/data/golden/make_conversion_golden.py), against
the same conversion by today's code, and loaded by it.

What holds on every CPU (issue 52; `make test-portable` runs this module under three ATen CPU capabilities): tensors
read from a file load bit for bit, and integer tensors (P) convert exactly. The float tensors a conversion computes
start from the source model's seeded random initialisation, whose normal draws go through vectorised log/cos kernels
that differ in their last bits between instruction sets (ATEN_CPU_CAPABILITY=default against AVX-512: ~1 float32 ulp),
so they, and the forward passes on them, compare within ``RTOL`` = 1e-5 relative (~100 float32 ulps; and 1e-5 of a
tensor's largest entry near zero)."""

import importlib.util
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import hf_partial_attention as hpa

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden")
_spec = importlib.util.spec_from_file_location("make_conversion_golden",
                                               os.path.join(GOLDEN, "make_conversion_golden.py"))
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)
_VERSIONS = ("transformers_version", "partial_plugin_version")
RTOL = 1e-5  # computed floats: the tolerance float32 initialisation keeps across CPUs (module docstring)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Integers equal; floats within ``RTOL`` (and ``RTOL`` of the largest entry), of the same dtype and shape."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if not want.is_floating_point():
        return torch.equal(got, want)
    return torch.allclose(got, want, rtol=RTOL, atol=RTOL * float(want.abs().max()) if want.numel() else 0.0)


@pytest.mark.parametrize("name", list(make.CASES))
def test_conversion_gives_the_earlier_codes_model(name, tmp_path):
    folder = os.path.join(GOLDEN, name)
    golden = load_file(os.path.join(folder, "model.safetensors"))
    model = make.convert(name)
    ours = model.state_dict()
    # tied tensors (the MLM decoder's, tied to the embeddings and the head's bias) are saved once
    assert set(golden) <= set(ours)
    saved_storage = {ours[key].data_ptr() for key in golden}
    extra = set(ours) - set(golden)
    assert all(ours[key].data_ptr() in saved_storage for key in extra), sorted(extra)
    for key, value in golden.items():
        assert _close(ours[key], value), key
    model.save_pretrained(tmp_path, write_model_card=False)
    saved, want = (json.loads(open(os.path.join(f, "config.json")).read()) for f in (tmp_path, folder))
    assert {k: v for k, v in saved.items() if k not in _VERSIONS} == \
        {k: v for k, v in want.items() if k not in _VERSIONS}


@pytest.mark.parametrize("name", list(make.CASES))
def test_the_earlier_codes_checkpoint_loads_bit_for_bit(name):
    folder = os.path.join(GOLDEN, name)
    partial_class = getattr(hpa, make.CASES[name][2])
    loaded = partial_class.from_pretrained(folder)
    assert type(loaded) is partial_class
    golden = load_file(os.path.join(folder, "model.safetensors"))
    state = loaded.state_dict()
    for key, value in golden.items():
        assert state[key].dtype == torch.float64 or not value.is_floating_point()
        assert torch.equal(value, state[key]), key
    ids = torch.tensor([[2, 5, 7, 11, 13, 17, 19, 23], [2, 4, 6, 8, 10, 1, 1, 1]])
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    with torch.no_grad():
        got, want = (m.eval()(input_ids=ids, attention_mask=mask)[0] for m in (loaded, make.convert(name)))
    assert _close(got, want)
