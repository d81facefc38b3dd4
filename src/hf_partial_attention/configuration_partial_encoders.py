"""The configs of partial encoders other than BERT: ``PartialRobertaConfig``, ``PartialModernBertConfig``, ...

Each subclasses its source's config (`RobertaConfig`, ...) and `PartialConfigMixin`, so it has every field of the
source and the partial fields (documented on `PartialBertConfig`); its ``model_type`` names the source architecture.
One class per entry of `architectures.ARCHITECTURES` that the installed transformers has, named ``Partial<Prefix>Config``
with ``model_type = "partial_<source model_type>"``; `config_class_for` finds them. PartialBert's config is
`configuration_partial_bert.PartialBertConfig` (its entry of the same table).

Part of the remote-code bundle (imports: transformers and siblings only).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict

from .architectures import ARCHITECTURES, Architecture
from .configuration_partial import PartialConfigMixin

__all__ = ["config_class_for", "PARTIAL_CONFIG_CLASSES"]


def _albert_groups(self) -> list[list[int]]:
    per_group = self.num_hidden_layers / self.num_hidden_groups
    groups: dict[int, list[int]] = {}
    for layer in range(self.num_hidden_layers):
        groups.setdefault(int(layer / per_group), []).append(layer)
    return list(groups.values())


def _albert_default_layers(self) -> list[int]:
    # One module serves every layer of its group, so "all but the last layer" is not possible with one group: every
    # layer is partial (the paper's last exact layer does not exist in ALBERT).
    return list(range(self.num_hidden_layers))


def _modernbert_default_layers(self) -> list[int]:
    # The global (full-attention) layers but the last: a local layer scores only its window already, and the paper
    # keeps the last layer exact.
    types = getattr(self, "layer_types", None) or ["full_attention"] * self.num_hidden_layers
    return [i for i, kind in enumerate(types) if kind == "full_attention" and i < self.num_hidden_layers - 1]


_OVERRIDES = {
    "albert": {"shared_layer_groups": _albert_groups, "default_partial_layers": _albert_default_layers},
    "modernbert": {"default_partial_layers": _modernbert_default_layers},
}


def _config_class(arch: Architecture):
    name = f"Partial{arch.prefix}Config"
    namespace = {"model_type": arch.partial_model_type, "__module__": __name__, "__qualname__": name,
                 "__doc__": f"`{arch.prefix}Config` with partial attention (fields: see `PartialBertConfig`).",
                 **_OVERRIDES.get(arch.model_type, {})}
    return strict(type(name, (PartialConfigMixin, arch.config_class()), namespace))


PARTIAL_CONFIG_CLASSES: dict[str, type] = {}
for _arch in ARCHITECTURES.values():
    if _arch.model_type != "bert" and _arch.available():
        PARTIAL_CONFIG_CLASSES[_arch.model_type] = globals()[f"Partial{_arch.prefix}Config"] = _config_class(_arch)
        __all__.append(f"Partial{_arch.prefix}Config")


def config_class_for(model_type: str):
    """The partial config class of a source ``model_type`` (PartialBertConfig for ``"bert"``)."""
    if model_type == "bert":
        from .configuration_partial_bert import PartialBertConfig

        return PartialBertConfig
    return PARTIAL_CONFIG_CLASSES[model_type]
