"""The configs of partial encoders other than BERT: ``PartialRobertaConfig``, ``PartialModernBertConfig``, ...

Each subclasses its source's config (`RobertaConfig`, ...) and `PartialConfigMixin`, so it has every field of the
source and the partial fields (documented on `PartialBertConfig`); its ``model_type`` names the source architecture.
One class per entry of `architectures.ARCHITECTURES` that the installed transformers has, named
``Partial<Prefix>Config`` with ``model_type = "partial_<source model_type>"``; `config_class_for` finds them.
PartialBert's config is `configuration_partial_bert.PartialBertConfig` (its entry of the same table).

Part of the remote-code bundle (imports: transformers and siblings only).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict

from .architectures import ARCHITECTURES, Architecture
from .configuration_partial import PartialConfigMixin

__all__ = ["config_class_for", "PARTIAL_CONFIG_CLASSES"]


_DOC = r"""
    Configuration of [`Partial%PREFIX%Model`] and its heads: every field of [`%PREFIX%Config`] plus the partial
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
        partial_granularity (`str`, defaults to `"pooled"`):
            `"pooled"`: one P (and, unless `reconstruction="per_layer"`, one R) for every partial layer, the paper's
            setting. `"layer"`: each partial layer has its own P and R (`LayerPatterns`, from `hf-partial-attention
            derive --granularity layer`), at the same k; R is then `"fixed"` or `"per_layer"` (trainable), and
            checkpoints are of format 4. `"head"`: each head of each partial layer its own P and R (from
            `derive --granularity head`), held per layer with a leading head dimension.
        partial_layers_k (`list[list[int]]`, *optional*):
            A k per layer (from `derive --saving`, which spends a QKᵀ budget where the greedy's error falls most):
            one list per layer of `partial_layers` (same order), each a k per bucket of `partial_lengths`; layer l's
            P in bucket b is (b, k_lb) (its heads share it). `partial_lengths_k` (and `partial_k`) are then each
            bucket's largest, and a bucket runs exactly in every layer or in none. Needs `partial_granularity`
            "layer" or "head"; checkpoints are of format 5. Defaults to `partial_lengths_k` in every layer.
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
            The Hub id (or path) of the %NAME% checkpoint this model was converted from (`from_source` records it);
            model cards list it as `base_model`.
        partial_format_version (`int`, defaults to `CHECKPOINT_FORMAT_VERSION`):
            Format of the checkpoint (names and shapes of P and R, these fields). Loading a newer format than this
            code reads is an error naming the fix (upgrade hf-partial-attention).
        partial_plugin_version (`str`, *optional*):
            The hf-partial-attention version that saved the checkpoint (written by `save_pretrained`).

    Examples:

    ```python
    >>> from hf_partial_attention import Partial%PREFIX%Config, Partial%PREFIX%Model
    >>> config = Partial%PREFIX%Config(partial_seq_len=128, partial_k=32, reconstruction="per_layer")
    >>> model = Partial%PREFIX%Model(config)
    ```"""

def file_module(arch: Architecture, kind: str) -> str:
    """The module name the ``kind`` (``"configuration"`` or ``"modeling"``) classes of ``arch`` are written under:
    a sibling of this module (in the package, or in a remote-code bundle)."""
    return f"{__name__.rsplit('.', 1)[0]}.{kind}_partial_{arch.files}"


def _config_class(arch: Architecture):
    name = f"Partial{arch.prefix}Config"
    doc = _DOC.replace("%PREFIX%", arch.prefix).replace("%NAME%", arch.display_name or arch.prefix)
    namespace = {"model_type": arch.partial_model_type, "__module__": file_module(arch, "configuration"),
                 "__qualname__": name, "__doc__": doc, **dict(arch.config_methods)}
    return strict(type(name, (PartialConfigMixin, arch.config_class()), namespace))


PARTIAL_CONFIG_CLASSES: dict[str, type] = {}
for _arch in ARCHITECTURES.values():
    if _arch.available():
        PARTIAL_CONFIG_CLASSES[_arch.model_type] = globals()[f"Partial{_arch.prefix}Config"] = _config_class(_arch)
        __all__.append(f"Partial{_arch.prefix}Config")


def config_class_for(model_type: str):
    """The partial config class of a source ``model_type`` (``PartialRobertaConfig`` for ``"roberta"``)."""
    return PARTIAL_CONFIG_CLASSES[model_type]
