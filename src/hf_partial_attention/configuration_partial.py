"""The fields every partial-attention config adds to its source architecture's config, and their checks.

`PartialConfigMixin` is a dataclass mixin: ``class PartialBertConfig(PartialConfigMixin, BertConfig)`` (and the
configs of `configuration_partial_encoders`, one per architecture) get these fields, defaults and checks beside the
source's own. The fields are documented on `PartialBertConfig`. Part of the remote-code bundle (imports:
transformers and siblings only).
"""

from __future__ import annotations

from dataclasses import dataclass

RECONSTRUCTION_MODES = ("fixed", "common", "per_layer")
# One P and R for every partial layer (the paper's), each layer its own, or each head of each layer its own
# (`pattern_layers.LayerPatterns`).
GRANULARITIES = ("pooled", "layer", "head")
# The kernels (`attention_dispatch.kernel_function`: one module `attention_<name>.py` each), and the settings of
# `partial_implementation`: the kernels plus "auto". Named here, without importing a kernel, so a config is checked
# early.
KERNEL_NAMES = ("gather", "fused", "tiled", "triton")
PARTIAL_IMPLEMENTATIONS = ("auto", *KERNEL_NAMES)
# The layout of P and R in model.safetensors and of these fields; a checkpoint of a newer format is refused.
# 1: hf-partial-attention 0.1.x and 0.2.x (0.1.0 wrote no version: read as 1): one P and R, for n positions.
# 2: length buckets (`partial_lengths`): P and R per bucket, ``...partial_pattern_len{b}...`` beside n's.
# 3: a k per bucket (`partial_lengths_k`): bucket b's P is (b, k_b). Written only by a checkpoint whose partial
#    buckets differ in k (`required_format_version`), so that readers of format 2 keep reading every other one.
#    Checkpoints of architectures other than BERT (`configuration_partial_encoders`) start at format 2.
# 4: P and R per layer or per head (`partial_granularity`): ``...partial_pattern_layer{l}...``, with a leading head
#    dimension per head. Written only by such a checkpoint; a pooled one keeps the oldest format that holds it.
# 5: a k per layer (`partial_layers_k`, from `derive --saving`): layer l's P in bucket b is (b, k_lb). Written only by
#    a checkpoint whose layers differ in k.
CHECKPOINT_FORMAT_VERSION = 5
# Runtime settings: like `attn_implementation`, never written to (nor read from) config.json.
_NOT_SERIALIZED = ("partial_implementation",)


def check_implementation(name: str) -> None:
    """Raise a ValueError naming the choices unless ``name`` is ``"auto"`` or a kernel: the one check of the
    ``partial_implementation`` setting (config, `set_partial_implementation`, the kernel dispatch)."""
    if name not in PARTIAL_IMPLEMENTATIONS:
        raise ValueError(f"partial_implementation must be one of {PARTIAL_IMPLEMENTATIONS}, got {name!r}.")


@dataclass(kw_only=True, repr=False)
class PartialConfigMixin:
    """The partial-attention fields (see `PartialBertConfig` for each) and their checks, for any source config."""

    partial_seq_len: int = 128
    partial_k: int = 32
    partial_lengths: list[int] | None = None
    partial_lengths_k: list[int] | None = None
    reconstruction: str = "common"
    partial_layers: list[int] | None = None
    partial_granularity: str = "pooled"
    partial_layers_k: list[list[int]] | None = None
    partial_use_bias: bool = False
    partial_tie_shared_rows: bool = False
    partial_default_correlation: float = 0.9
    partial_implementation: str = "auto"
    partial_base_model: str | None = None
    partial_format_version: int = CHECKPOINT_FORMAT_VERSION
    partial_plugin_version: str | None = None

    def default_partial_layers(self) -> list[int]:
        """The layers made partial when ``partial_layers`` is not given: every layer but the last (the paper keeps
        the last layer exact; a 1-layer model has no "all but last", so it stays exact)."""
        return list(range(max(self.num_hidden_layers - 1, 0)))

    def shared_layer_groups(self) -> list[list[int]] | None:
        """Groups of layers that run one attention module (ALBERT); None where every layer has its own."""
        return None

    def _check_shared_modules(self) -> None:
        groups = self.shared_layer_groups()
        if not groups:
            return
        if self.partial_granularity != "pooled" and self.partial_layers:
            raise ValueError(
                f"partial_granularity={self.partial_granularity!r} is not available for {self.model_type}: its layers "
                f"{groups} share one attention module each, which runs one P; use partial_granularity='pooled'.")
        if self.reconstruction == "per_layer" and self.partial_layers:
            raise ValueError(
                f"reconstruction='per_layer' is not available for {self.model_type}: its layers {groups} share one "
                "attention module each, which cannot hold one R per layer; use reconstruction='common' or 'fixed'.")
        chosen = set(self.partial_layers)
        split = [g for g in groups if chosen & set(g) and not set(g) <= chosen]
        if split:
            raise ValueError(
                f"partial_layers={self.partial_layers} splits layers that share one attention module ({split}) in "
                f"{self.model_type}: make every layer of a group partial or none of them, e.g. partial_layers="
                f"{sorted(set().union(*[set(g) for g in groups if chosen & set(g)]))}.")

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.partial_layers is None:
            # The paper keeps the last layer exact; a 1-layer model has no "all but last", so keep it exact.
            self.partial_layers = self.default_partial_layers()
        else:
            self.partial_layers = sorted({int(layer) for layer in self.partial_layers})
        if self.partial_lengths is None:
            self.partial_lengths = [self.partial_seq_len]
        if self.partial_lengths_k is None and isinstance(self.partial_lengths, (list, tuple)):
            self.partial_lengths_k = [min(self.partial_k, b) if isinstance(b, int) else b for b in self.partial_lengths]
        self._check_partial_fields()

    def _check_partial_fields(self) -> None:
        if self.partial_format_version > CHECKPOINT_FORMAT_VERSION:
            raise ValueError(
                f"partial_format_version={self.partial_format_version}: this checkpoint was written by "
                f"hf-partial-attention {self.partial_plugin_version or '(newer)'}, whose format this version "
                f"(format {CHECKPOINT_FORMAT_VERSION}) cannot read. Upgrade: pip install -U hf-partial-attention "
                "(or load with trust_remote_code=True, which runs the code saved with the checkpoint)."
            )
        n, k = self.partial_seq_len, self.partial_k
        if n < 1:
            raise ValueError(f"partial_seq_len must be >= 1, got {n}; set it to the sequence length of P and R.")
        positions = getattr(self, "max_position_embeddings", None)
        if positions is not None and n > positions:
            raise ValueError(
                f"partial_seq_len={n} exceeds max_position_embeddings={positions}; "
                "use a pattern for at most max_position_embeddings positions."
            )
        if not 1 <= k <= n:
            raise ValueError(f"partial_k must be in [1, partial_seq_len={n}], got {k}.")
        self._check_lengths()
        if self.reconstruction not in RECONSTRUCTION_MODES:
            raise ValueError(
                f"reconstruction must be one of {RECONSTRUCTION_MODES}, got {self.reconstruction!r}."
            )
        if self.partial_granularity not in GRANULARITIES:
            raise ValueError(f"partial_granularity must be one of {GRANULARITIES}, got {self.partial_granularity!r}.")
        if self.partial_granularity != "pooled" and self.reconstruction == "common":
            raise ValueError(
                f"reconstruction='common' (one R for every layer) has no meaning with partial_granularity="
                f"{self.partial_granularity!r}: each layer has its own P, and an R maps the scores of its own P; use "
                "reconstruction='per_layer' (each layer's R trainable) or 'fixed'.")
        self._check_implementation()
        self._check_layers_k()
        bad = [layer for layer in self.partial_layers if not 0 <= layer < self.num_hidden_layers]
        if bad:
            raise ValueError(
                f"partial_layers {bad} are out of range for num_hidden_layers={self.num_hidden_layers}; "
                f"use indices in [0, {self.num_hidden_layers - 1}]."
            )
        if not 0.0 <= self.partial_default_correlation < 1.0:
            raise ValueError(
                f"partial_default_correlation must be in [0, 1), got {self.partial_default_correlation}."
            )
        decoder, cross = getattr(self, "is_decoder", False), getattr(self, "add_cross_attention", False)
        if decoder or cross:
            raise ValueError(
                f"{type(self).__name__} is an encoder: is_decoder and add_cross_attention must be False "
                f"(got is_decoder={decoder}, add_cross_attention={cross})."
            )
        self._check_shared_modules()

    def _check_lengths(self) -> None:
        lengths = self.partial_lengths
        if (not isinstance(lengths, (list, tuple)) or not lengths
                or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in lengths)):
            raise ValueError(f"partial_lengths must be a non-empty list of positive ints (bucket lengths), got "
                             f"{lengths!r}.")
        if list(lengths) != sorted(set(lengths)):
            raise ValueError(f"partial_lengths must be increasing with no repeats, got {list(lengths)}; pass "
                             f"{sorted(set(lengths))}.")
        if lengths[-1] != self.partial_seq_len:
            raise ValueError(f"partial_lengths={list(lengths)} must end with partial_seq_len={self.partial_seq_len} "
                             "(the longest bucket is n); add it or set partial_seq_len to the longest bucket.")
        self.partial_lengths = list(lengths)
        ks = self.partial_lengths_k
        if (not isinstance(ks, (list, tuple)) or len(ks) != len(lengths)
                or not all(isinstance(k, int) and not isinstance(k, bool) for k in ks)):
            raise ValueError(f"partial_lengths_k must be a list of ints, one k per bucket of partial_lengths="
                             f"{list(lengths)}, got {ks!r}; omit it for partial_k in every bucket.")
        bad = [(b, k) for b, k in zip(lengths, ks) if not 1 <= k <= b]
        if bad:
            raise ValueError(f"partial_lengths_k={list(ks)}: bucket b's k must be in [1, b], got (b, k) = {bad}; give "
                             "k = b for a bucket that runs exactly.")
        if ks[-1] != self.partial_k:
            raise ValueError(f"partial_lengths_k={list(ks)} must end with partial_k={self.partial_k} (n's k); set "
                             "partial_k to the longest bucket's k.")
        self.partial_lengths_k = list(ks)

    def _check_layers_k(self) -> None:
        rows = self.partial_layers_k
        if rows is None:
            return
        if self.partial_granularity == "pooled":
            raise ValueError("partial_layers_k (a k per layer) needs a P per layer: set partial_granularity='layer' or "
                             "'head' (one pooled P has one k), or drop partial_layers_k.")
        lengths, layers = self.partial_lengths, self.partial_layers
        if (not isinstance(rows, (list, tuple)) or len(rows) != len(layers) or not all(
                isinstance(row, (list, tuple)) and len(row) == len(lengths)
                and all(isinstance(k, int) and not isinstance(k, bool) for k in row) for row in rows)):
            raise ValueError(f"partial_layers_k must hold one list per layer of partial_layers={layers}, each a k per "
                             f"bucket of partial_lengths={lengths}, got {rows!r}.")
        for layer, row in zip(layers, rows):
            for b, k, top in zip(lengths, row, self.partial_lengths_k):
                if (top == b) != (k == b) or not 1 <= k <= top:
                    raise ValueError(
                        f"partial_layers_k: layer {layer} has k = {k} in bucket {b}; each layer's k must be in [1, "
                        f"partial_lengths_k's {top}] (partial_lengths_k holds the largest k of each bucket), and b "
                        "exactly in a bucket that runs exactly (k_b = b) in partial_lengths_k, only there.")
        tops = [max(column) for column in zip(*rows)]
        if tops != list(self.partial_lengths_k):
            raise ValueError(f"partial_lengths_k={self.partial_lengths_k} must be each bucket's largest k of "
                             f"partial_layers_k ({tops}); set partial_lengths_k={tops} and partial_k={tops[-1]}.")
        self.partial_layers_k = [list(row) for row in rows]

    def bucket_k(self, length: int | None = None, layer: int | None = None) -> int:
        """k of bucket ``length`` (default n): the exact scores per query of its P; of ``layer`` when the layers
        have a k each (``partial_layers_k``; the bucket's largest otherwise)."""
        index = len(self.partial_lengths) - 1 if length is None else self.partial_lengths.index(length)
        if self.partial_layers_k is not None and layer is not None and layer in self.partial_layers:
            return self.partial_layers_k[self.partial_layers.index(layer)][index]
        if length is None or length == self.partial_seq_len:
            return self.partial_k
        return self.partial_lengths_k[index]

    @property
    def partial_buckets(self) -> list[int]:
        """The buckets below n that hold their own P and R (k_b < b); the others run exactly."""
        return [b for b, k in zip(self.partial_lengths[:-1], self.partial_lengths_k) if k < b]

    @property
    def exact_lengths(self) -> list[int]:
        """The buckets below n with k_b = b, which run exact attention."""
        return [b for b, k in zip(self.partial_lengths[:-1], self.partial_lengths_k) if k == b]

    @property
    def required_format_version(self) -> int:
        """The oldest checkpoint format that holds these fields: 5 for a k per layer, 4 for P and R per layer, 3
        when partial buckets differ in k, else 2."""
        if self.partial_layers_k is not None:
            return 5
        if self.partial_granularity != "pooled":
            return 4
        return 3 if len({self.bucket_k(b) for b in (*self.partial_buckets, None)}) > 1 else 2

    def _check_implementation(self) -> None:
        check_implementation(self.partial_implementation)

    def validate_partial_attention(self):
        """Re-checked by `save_pretrained` (strict dataclass validators)."""
        self._check_partial_fields()

    def _remove_keys_not_serialized(self, d: dict) -> None:
        super()._remove_keys_not_serialized(d)
        for key in _NOT_SERIALIZED:
            d.pop(key, None)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        # Checkpoints written by 0.1.0 stored partial_implementation; the machine that loads them chooses it
        # (kwargs, e.g. from_pretrained(..., partial_implementation="gather"), still apply).
        config_dict = {key: value for key, value in config_dict.items() if key not in _NOT_SERIALIZED}
        if "partial_seq_len" in config_dict:  # a saved partial config; 0.1.0 wrote no format version: format 1
            config_dict.setdefault("partial_format_version", 1)
        result = super().from_dict(config_dict, **kwargs)
        # from_dict sets keyword overrides after __init__ validated the fields: check the one a loader may pass
        # (`from_pretrained(folder, partial_implementation=...)`), or a typo would surface only in the first forward.
        (result[0] if isinstance(result, tuple) else result)._check_implementation()
        return result


__all__ = ["PartialConfigMixin", "RECONSTRUCTION_MODES", "KERNEL_NAMES", "PARTIAL_IMPLEMENTATIONS",
           "CHECKPOINT_FORMAT_VERSION", "check_implementation"]
