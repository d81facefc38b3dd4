"""Configuration of PartialBert: a BERT whose self-attention computes only k scores per query.

`PartialBertConfig` is generated from BERT's entry of `architectures.ARCHITECTURES` like every other partial config
(`configuration_partial_encoders`, where its fields are documented); it is written under this file's name, which
PartialBert checkpoints' ``auto_map`` names since 0.1.

This file is copied next to a saved checkpoint (``save_pretrained``) so that the model loads with
``trust_remote_code=True`` where the plugin is not installed: it may import only from ``transformers``,
``torch`` and sibling files of this package with ``from .x import y``.
"""

from __future__ import annotations

from .configuration_partial import (CHECKPOINT_FORMAT_VERSION, KERNEL_NAMES, PARTIAL_IMPLEMENTATIONS,
                                    RECONSTRUCTION_MODES)
from .configuration_partial_encoders import PartialBertConfig

__all__ = ["PartialBertConfig", "RECONSTRUCTION_MODES", "KERNEL_NAMES", "PARTIAL_IMPLEMENTATIONS",
           "CHECKPOINT_FORMAT_VERSION"]
