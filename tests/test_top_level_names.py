"""Every partial class the README's tables name imports from the package top level and is in `__all__`."""

import re
from pathlib import Path

import hf_partial_attention
from hf_partial_attention.architectures import ARCHITECTURES

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_class_the_readme_names_imports_from_the_top_level():
    names = set(re.findall(r"\bPartial[A-Z][A-Za-z]*(?:Model|Config|For[A-Za-z]+)\b", README.read_text()))
    assert "PartialRobertaModel" in names and "PartialDistilBertModel" in names  # the table is read
    for name in sorted(names):
        if name == "PartialAttentionTrainer":
            continue
        assert name in hf_partial_attention.__all__, name
        assert getattr(hf_partial_attention, name).__name__ == name


def test_every_architecture_has_its_config_and_heads_at_the_top_level():
    for arch in ARCHITECTURES.values():
        if arch.model_type == "gte" and not hasattr(hf_partial_attention, "PartialGteConfig"):
            continue  # a transformers without GTE: refused in one line, as the architecture tests check
        for suffix in ("Config", "Model", "ForMaskedLM"):
            name = f"Partial{arch.prefix}{suffix}"
            assert name in hf_partial_attention.__all__ and hasattr(hf_partial_attention, name), name
