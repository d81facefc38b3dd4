"""Configuration of PartialBert: a BERT whose self-attention computes only k scores per query.

This file is copied next to a saved checkpoint (``save_pretrained``) so that the model loads with
``trust_remote_code=True`` where the plugin is not installed: it may import only from ``transformers``,
``torch`` and sibling files of this package with ``from .x import y``.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import BertConfig

RECONSTRUCTION_MODES = ("fixed", "common", "per_layer")
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
CHECKPOINT_FORMAT_VERSION = 3
# Runtime settings: like `attn_implementation`, never written to (nor read from) config.json.
_NOT_SERIALIZED = ("partial_implementation",)


@strict
class PartialBertConfig(BertConfig):
    r"""
    Configuration of [`PartialBertModel`] and its heads: every field of [`BertConfig`] plus the partial
    attention of Bhojanapalli et al. (2021), "Eigen Analysis of Self-Attention and its Reconstruction from
    Partial Computation".

    In each layer listed in `partial_layers`, query i computes exact scores only with the `partial_k` keys
    P_i (a fixed index set) and reconstructs the other `partial_seq_len - partial_k` scores linearly,
    `a_{P̄_i} = R_i a_{P_i} (+ b_i)`, before mask, softmax and the product with V.

    Args:
        partial_seq_len (`int`, defaults to 128):
            n, the sequence length P and R are defined for (absolute positions 0..n-1). Shorter inputs work;
            longer inputs raise a `ValueError`.
        partial_lengths (`list[int]`, *optional*):
            The length buckets: each holds its own P and R, fitted on inputs of that length, and a sequence of T tokens
            runs the smallest bucket b >= T (chosen from its own attention mask), as if padded to b with keys scoring
            zero. Buckets with b <= their k (`partial_lengths_k`) run exactly. The largest must be `partial_seq_len`;
            defaults to `[partial_seq_len]` (one bucket: every input runs n's P and R, the behaviour of format 1).
        partial_k (`int`, defaults to 32):
            k, the number of exactly computed scores per query (1 <= k <= n): n's, and every bucket's unless
            `partial_lengths_k` says otherwise.
        partial_lengths_k (`list[int]`, *optional*):
            The k of each bucket of `partial_lengths` (same order), for a bucket whose inputs need more (or fewer) exact
            scores than n's. The last must be `partial_k`. A bucket with k_b = b runs exactly. Defaults to
            `min(partial_k, b)` for every bucket b.
        reconstruction (`str`, defaults to `"common"`):
            How R is held: `"fixed"` (a buffer, never trained), `"common"` (one trainable tensor shared by
            all partial layers) or `"per_layer"` (one trainable tensor per partial layer).
        partial_layers (`list[int]`, *optional*):
            Layers that use partial attention. Defaults to every layer but the last (the paper's setting).
        partial_use_bias (`bool`, defaults to `False`):
            Add a per-query bias b_i (n x (n-k)) to the reconstructed scores (centred fit of R).
        partial_tie_shared_rows (`bool`, defaults to `False`):
            When a trainable R is shared by blocks of rows (the `shared_blocks` family), train it tied: each row
            of a block receives the block's summed gradient, so the rows stay equal (and the fast kernels apply)
            under any elementwise optimizer. Off, every row gets its own gradient and the blocks drift apart.
        partial_default_correlation (`float`, defaults to 0.9):
            For a model built from a config alone (no pattern given), P_i is the k keys nearest to query i
            and R the optimal reconstruction under the prior covariance `rho**|j - j'|` with this rho.
        partial_implementation (`str`, defaults to `"auto"`):
            Kernel of the partial layers, a run-time setting like `attn_implementation`: not saved in config.json
            (a value found there is ignored), set it with `from_pretrained(..., partial_implementation=...)` or
            `model.set_partial_implementation(...)`. `"gather"` (only the k scores per query, assembled by
            scatter; the reference), `"fused"` (one GEMM per block of rows sharing keys when the pattern has that
            structure, then full rows by one batched matmul with [I | R]; no scatter), `"tiled"` (inference in
            cache-sized tiles of rows, fast when blocks of rows share P and R: the `shared_blocks` family),
            `"triton"` (GPU) or `"auto"` (`triton` on CUDA when triton is installed, `tiled` for rows sharing P
            and R in inference at n >= 256, else `fused`: `attention_dispatch.auto_kernel`). A call that asks for
            the attention maps runs `"gather"`, whatever the setting.
            All give the same numbers and gradients.
        partial_base_model (`str`, *optional*):
            The Hub id (or path) of the BERT checkpoint this model was converted from (`from_bert` records it);
            model cards list it as `base_model`.
        partial_format_version (`int`, defaults to `CHECKPOINT_FORMAT_VERSION`):
            Format of the checkpoint (names and shapes of P and R, these fields). Loading a newer format than this
            code reads is an error naming the fix (upgrade hf-partial-attention).
        partial_plugin_version (`str`, *optional*):
            The hf-partial-attention version that saved the checkpoint (written by `save_pretrained`).

    Examples:

    ```python
    >>> from hf_partial_attention import PartialBertConfig, PartialBertModel
    >>> config = PartialBertConfig(partial_seq_len=128, partial_k=32, reconstruction="per_layer")
    >>> model = PartialBertModel(config)
    ```"""

    model_type = "partial_bert"

    partial_seq_len: int = 128
    partial_k: int = 32
    partial_lengths: list[int] | None = None
    partial_lengths_k: list[int] | None = None
    reconstruction: str = "common"
    partial_layers: list[int] | None = None
    partial_use_bias: bool = False
    partial_tie_shared_rows: bool = False
    partial_default_correlation: float = 0.9
    partial_implementation: str = "auto"
    partial_base_model: str | None = None
    partial_format_version: int = CHECKPOINT_FORMAT_VERSION
    partial_plugin_version: str | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.partial_layers is None:
            # The paper keeps the last layer exact; a 1-layer model has no "all but last", so keep it exact.
            self.partial_layers = list(range(max(self.num_hidden_layers - 1, 0)))
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
        if n > self.max_position_embeddings:
            raise ValueError(
                f"partial_seq_len={n} exceeds max_position_embeddings={self.max_position_embeddings}; "
                "use a pattern for at most max_position_embeddings positions."
            )
        if not 1 <= k <= n:
            raise ValueError(f"partial_k must be in [1, partial_seq_len={n}], got {k}.")
        self._check_lengths()
        if self.reconstruction not in RECONSTRUCTION_MODES:
            raise ValueError(
                f"reconstruction must be one of {RECONSTRUCTION_MODES}, got {self.reconstruction!r}."
            )
        self._check_implementation()
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
        if self.is_decoder or self.add_cross_attention:
            raise ValueError(
                "PartialBert is an encoder: is_decoder and add_cross_attention must be False "
                f"(got is_decoder={self.is_decoder}, add_cross_attention={self.add_cross_attention})."
            )

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

    def bucket_k(self, length: int | None = None) -> int:
        """k of bucket ``length`` (default n): the exact scores per query of its P."""
        if length is None or length == self.partial_seq_len:
            return self.partial_k
        return self.partial_lengths_k[self.partial_lengths.index(length)]

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
        """The oldest checkpoint format that holds these fields: 3 when partial buckets differ in k, else 2."""
        return 3 if len({self.bucket_k(b) for b in (*self.partial_buckets, None)}) > 1 else 2

    def _check_implementation(self) -> None:
        if self.partial_implementation not in PARTIAL_IMPLEMENTATIONS:
            raise ValueError(
                f"partial_implementation must be one of {PARTIAL_IMPLEMENTATIONS}, got {self.partial_implementation!r}."
            )

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
        if "partial_seq_len" in config_dict:  # a saved PartialBert config; 0.1.0 wrote no format version: format 1
            config_dict.setdefault("partial_format_version", 1)
        result = super().from_dict(config_dict, **kwargs)
        # from_dict sets keyword overrides after __init__ validated the fields: check the one a loader may pass
        # (`from_pretrained(folder, partial_implementation=...)`), or a typo would surface only in the first forward.
        (result[0] if isinstance(result, tuple) else result)._check_implementation()
        return result


__all__ = ["PartialBertConfig", "RECONSTRUCTION_MODES", "KERNEL_NAMES", "PARTIAL_IMPLEMENTATIONS",
           "CHECKPOINT_FORMAT_VERSION"]
