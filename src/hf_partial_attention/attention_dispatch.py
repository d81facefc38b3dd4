"""The per-call path of a partial model: the attention functions transformers calls (registered with its
``AttentionInterface`` as ``partial_<setting>`` and ``partial_exact``), each sequence's length bucket, P and R per
head, and which kernel runs (`kernel_for`, `auto_kernel`): ``gather`` (the reference, the only one that returns
the attention map), ``fused``, ``tiled`` (inference, rows sharing P and R) and ``triton`` (GPU), all with the
reference's numbers and gradients. Under ``torch.compile`` without autograd, ``fused`` and ``tiled`` run as one
custom op (`compiled_attention`). The rules, and the benchmarks behind ``auto``: docs/method.md#kernels.

Part of the remote-code bundle (imports: torch, transformers and siblings).
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Callable

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention_adapters import with_position_bias
from .attention_common import STATES, DerivedState, PartialTensors, PatternLayout, PatternStructure, needs_grad
from .attention_fused import all_heads_attention, fused_attention
from .attention_gather import gather_attention
from .attention_heads import heads_in_one_pass
from .attention_lengths import bucketed_attention, exact_attention
from .attention_tiled import tiled_attention
from .configuration_partial import KERNEL_NAMES, PARTIAL_IMPLEMENTATIONS, check_implementation
from .attention_layer import attention_weights_requested, is_partial, layer_tensors


__all__ = ["TILED_MIN_LENGTH", "COMPILED_PREFIX", "auto_kernel", "kernel_for", "kernel_function",
           "check_implementation", "applies_compiled", "compiled_attention", "partial_attention_forward",
           "attention_function_name", "EXACT_FUNCTION", "is_partial", "layer_tensors", "attention_weights_requested",
           "register_attention_functions"]

# The function name of the exact layers: the model's own `_attn_implementation`, or eager when maps are asked for.
EXACT_FUNCTION = "partial_exact"

# The shortest n at which `auto` runs `tiled` for rows sharing P and R (below it `fused` is as fast or faster).
TILED_MIN_LENGTH = 256


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def auto_kernel(layout: PatternLayout, device: torch.device | str, head_dim: int, training: bool,
                dropout: float = 0.0) -> str:
    """The kernel ``"auto"`` runs for this pattern on ``device`` (``training``: a backward follows; ``dropout``:
    the attention dropout in effect)."""
    if (torch.device(device).type == "cuda" and _triton_installed() and head_dim >= 16
            and head_dim & (head_dim - 1) == 0 and dropout == 0.0):
        return "triton"
    if (not training and layout.structure is PatternStructure.ROWS_SHARING_P_AND_R
            and layout.indices.shape[0] >= TILED_MIN_LENGTH):
        return "tiled"
    return "fused"


def kernel_for(implementation: str, partial: PartialTensors, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, *, need_weights: bool, dropout: float = 0.0,
               attention_mask: torch.Tensor | None = None, extra: torch.Tensor | None = None) -> str:
    """The kernel a call runs for the setting ``implementation`` (see the module docstring); ``attention_mask``: the
    call's mask, which may carry a trained position bias (MPNet's), whose gradient Triton does not compute;
    ``extra``: the score's terms other than q·k at P (DeBERTa's), which Triton does not take."""
    check_implementation(implementation)
    grad = needs_grad(query, key, value, partial.reconstruction, partial.bias, attention_mask, extra)
    if implementation == "triton" and needs_grad(attention_mask):
        raise ValueError("partial_implementation='triton' computes no gradient of the attention mask, which here "
                         "carries a trained position bias (MPNet's relative_attention_bias); use "
                         "partial_implementation='fused' (or 'auto', which does), or freeze the bias.")
    # A dynamic (symbolic) batch or length, as torch.export with dynamic_shapes traces it: the reference, whose
    # shapes follow the input's (the fast kernels' tile sizes would specialise the length to the example's).
    dynamic = torch.compiler.is_exporting() and any(isinstance(size, torch.SymInt) for size in query.shape[:3])
    if need_weights or dynamic or (grad and torch.compiler.is_exporting()):
        return "gather"
    name = implementation
    if name == "auto":
        name = auto_kernel(partial.layout, query.device, query.shape[-1], grad, dropout)
        name = "fused" if name == "triton" and (needs_grad(attention_mask) or extra is not None) else name
    name = "fused" if name == "tiled" and grad else name
    # Compiled with R frozen: the setting runs as one custom op that reads W and the blocks of rows sharing P and R
    # from the owner's state at run time (the compiled fast path, below); "auto" is resolved there, where they are
    # known.
    if name in ("fused", "tiled") and extra is None and applies_compiled(partial, grad, need_weights, dropout):
        return COMPILED_PREFIX + implementation
    return name


def kernel_function(name: str) -> Callable:
    """The attention function of a kernel (of `KERNEL_NAMES`), or of the compiled fast path (``compiled_<setting>``,
    as `kernel_for` names it)."""
    if name.startswith(COMPILED_PREFIX):
        return functools.partial(compiled_attention, name[len(COMPILED_PREFIX):])
    if name == "triton":  # imported at first use: it reads TRITON_INTERPRET and imports triton
        from .attention_triton import triton_attention

        return triton_attention
    functions = {"gather": gather_attention, "fused": fused_attention, "tiled": tiled_attention}
    if name not in functions:
        raise ValueError(f"implementation must be one of {KERNEL_NAMES}, got {name!r}.")
    return functions[name]


def partial_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    layout: PatternLayout,
    reconstruction: torch.Tensor,
    bias: torch.Tensor | None = None,
    scaling: float,
    dropout: float = 0.0,
    implementation: str = "gather",
    need_weights: bool = True,
    derived: DerivedState | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Partial attention outside a model (tests, benchmarks): the kernel ``implementation`` chooses
    (`kernel_for`) on this P and R.

    Args:
        query, key, value: ``(B, H, T, D)`` with T <= n.
        attention_mask: ``None``, bool ``(B|1, 1|H, T, T)`` (True = attend) or additive float of that shape.
        layout: P and the index tensors derived from it (`PatternLayout.from_indices`; pass R there too, or rows
            sharing P and R are not seen). reconstruction: R, ``(n, n−k, k)``. bias: ``(n, n−k)`` or None.
        need_weights: whether the caller uses the probabilities (then the reference kernel runs).
        derived: the state that keeps W of a frozen R across calls, as a model's pattern module does (one per P and
            R); None: W is built at every call.

    Returns:
        ``(output (B, T, H, D), probabilities (B, H, T, T) or None)``.
    """
    partial = PartialTensors(layout, reconstruction, bias, derived)
    name = kernel_for(implementation, partial, query, key, value, need_weights=need_weights,
                      dropout=dropout if module.training else 0.0, attention_mask=attention_mask)
    return kernel_function(name)(module, query, key, value, attention_mask, scaling, dropout, partial=partial)


def attention_function_name(implementation: str) -> str:
    """The `AttentionInterface` name of a setting: ``"partial_fused"``, ``"partial_auto"`` and so on."""
    return "partial_" + implementation


# ------------------------------------------------------------------ the compiled fast path
# The compiled fast path: under ``torch.compile`` with R frozen, a partial layer's kernel runs as one opaque custom
# op, so that W = [I | R], P's layout and the blocks of rows sharing P and R come from the owner's `DerivedState`
# (computed once, outside the graph) instead of being rebuilt in the graph at every call.
#
#
# Why a custom op. A graph cannot branch on tensor values (the blocks of rows sharing P and R) nor keep a Python-side
# cache; a W kept as a tensor the graph reads would need someone to refresh it whenever R or P change in place
# between compiled calls, and a stale W is a silently wrong result. The op's implementation runs at run time, in
# eager mode, on the very tensors P and R of the model (graph inputs reach an opaque op as they are, or as views of
# them): it checks their storage and version counter against the state's stamps, as eager does, and rebuilds what
# changed (`set_pattern`, loading, an optimizer step, any in-place edit). Its output is a fresh tensor, never the
# cached W (Inductor may reuse an op's output buffer), and it introduces no graph break (``fullgraph=True`` holds).
#
# When it runs (`applies`): compiling but not exporting (an exported program keeps W built in its graph, as it must
# run without this process's caches), no autograd on q, k, v, R or the bias, no attention map asked for, no
# dropout in effect, and a pattern module that passed its state (`partial_pattern.PartialPattern.compiled_fast_path`).
# Under autograd (a trained R, or training other weights with R fixed) W stays built in the graph, differentiable.

# `attention_dispatch.kernel_for` names the compiled path "compiled_<setting>": the setting (auto, fused, tiled) is
# resolved at run time, where the blocks of rows sharing P and R are known ("auto" may then pick tiled).
COMPILED_PREFIX = "compiled_"

# One op per copy of the package (the remote-code bundle imports its own copy under another module name, with its own
# `STATES`): the canonical package's name, or one suffixed by that copy's package.
_PACKAGE = __name__.rpartition(".")[0]
_NAME = "frozen_attention" + ("" if _PACKAGE == "hf_partial_attention" else "_" + re.sub(r"\W", "_", _PACKAGE))
_SCHEMA = ("(Tensor query, Tensor key, Tensor value, Tensor? attention_mask, Tensor indices, Tensor reconstruction, "
           "Tensor? bias, float scaling, int state, str implementation) -> Tensor")

# The kernels read ``module.training`` (dropout): the op runs only without dropout.
_EVAL = nn.Module().eval()


def _run(query, key, value, attention_mask, indices, reconstruction, bias, scaling, state, implementation):
    """The op's implementation, eager: the state's layout (blocks sharing P and R included) and W, then the kernel's
    own no-grad path; ``(B, H, T, D)`` q, k, v -> ``(B, T, H, Dv)``."""
    derived = STATES.get(state)
    derived = DerivedState() if derived is None else derived  # a state gone (its model freed): built for this call
    with torch.no_grad():
        layout = derived.layout(indices, reconstruction)
        partial = PartialTensors(layout, reconstruction, bias, derived)
        name = (auto_kernel(layout, query.device, query.shape[-1], False) if implementation == "auto"
                else implementation)
        return kernel_function(name)(_EVAL, query, key, value, attention_mask, scaling, 0.0, partial=partial)[0]


def _fake(query, key, value, attention_mask, indices, reconstruction, bias, scaling, state, implementation):
    b, h, t, _ = query.shape
    return value.new_empty(b, t, h, value.shape[-1])  # (B, T, H, Dv), contiguous like every kernel's output


def _define():
    namespace = getattr(torch.ops, "hf_partial_attention")
    if hasattr(namespace, _NAME):  # this module imported again (importlib.reload): the op exists
        return getattr(namespace, _NAME).default
    op = torch.library.custom_op(f"hf_partial_attention::{_NAME}", _run, mutates_args=(), schema=_SCHEMA)
    op.register_fake(_fake)
    return op


_frozen_attention = _define()


def applies_compiled(partial: PartialTensors, grad: bool, need_weights: bool, dropout: float) -> bool:
    """Whether a call runs the compiled fast path (see the module docstring); ``grad``: autograd records the call,
    ``dropout``: the attention dropout in effect."""
    return (torch.compiler.is_compiling() and not torch.compiler.is_exporting() and partial.derived is not None
            and not grad and not need_weights and dropout == 0.0)


def compiled_attention(implementation: str, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None = None,
                       dropout: float = 0.0, *, partial: PartialTensors, **kwargs
                       ) -> tuple[torch.Tensor, None]:
    """Partial attention by the setting ``implementation`` (auto, fused or tiled) as one custom op, in transformers'
    calling convention (arguments as `attention_gather.gather_attention`): ``(output (B, T, H, D), None)``."""
    scaling = module.scaling if scaling is None else scaling
    if needs_grad(query, key, value, partial.reconstruction, partial.bias, attention_mask):
        raise ValueError("the compiled fast path runs without autograd only")
    out = _frozen_attention(query, key, value, attention_mask, partial.layout.indices, partial.reconstruction,
                            partial.bias, float(scaling), partial.derived.key, implementation)
    return out, None  # (B, T, H, Dv)


# ------------------------------------------------------------------ the attention functions transformers calls
def _terms_per_head(score_terms, query, key, tensors: list[PartialTensors]) -> torch.Tensor | None:
    """The score's terms beyond q·k (DeBERTa-v2's) at each head's own P, ``(B, H, T, k)``; None without them."""
    if score_terms is None:
        return None
    return torch.cat([score_terms.at(query[:, h:h + 1], key[:, h:h + 1], t.layout.indices, slice(h, h + 1))
                      for h, t in enumerate(tensors)], dim=1)


def _per_head(implementation, module, query, key, value, attention_mask, scaling, dropout, need_weights,
              tensors: list[PartialTensors], score_terms, run_kernel):
    """A bucket with P and R per head (``tensors``, one per head). Where the fused kernel would run (not for the map,
    the reference, tiled or Triton settings, the compiled fast path, nor under export): every head at once, in one
    autograd node with a hand-written backward, or without autograd in one pass (per-query P), where one kernel call
    per head would pay H times for every step (`attention_fused.all_heads_attention`). Otherwise each head by
    ``run_kernel`` on its own slice of q, k, v."""
    extra = _terms_per_head(score_terms, query, key, tensors)
    in_effect = dropout if module.training else 0.0
    grad = needs_grad(query, key, value, attention_mask, extra, *(t.reconstruction for t in tensors),
                      *(t.bias for t in tensors))
    if (grad or heads_in_one_pass(tensors, in_effect)) and \
            kernel_for(implementation, tensors[0], query, key, value, need_weights=need_weights, dropout=in_effect,
                       attention_mask=attention_mask, extra=extra) == "fused":
        return all_heads_attention(module, query, key, value, attention_mask, scaling, in_effect, tensors, extra)
    outs, maps = [], []
    for h, head_tensors in enumerate(tensors):
        mask = (attention_mask if attention_mask is None or attention_mask.shape[1] == 1
                else attention_mask[:, h:h + 1])  # (B|1, 1, T, T)
        out, probs = run_kernel(head_tensors, query[:, h:h + 1], key[:, h:h + 1], value[:, h:h + 1], mask,
                                slice(h, h + 1))
        outs.append(out)  # (B, T, 1, D)
        maps.append(probs)  # (B, 1, T, T) or None
    return torch.cat(outs, dim=2), None if maps[0] is None else torch.cat(maps, dim=1)  # (B, T, H, D)


def _partial_function(implementation: str) -> Callable:
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, need_weights=None,
                  partial: PartialTensors | None = None, score_terms=None, **kwargs):
        """Partial attention of one layer: q, k, v ``(B, H, T, D)`` -> ``(output (B, T, H, D), maps or None)``; each
        sequence in its length bucket, a bucket with k_b = b exactly. ``score_terms``: the score's terms beyond
        q·k (DeBERTa-v2's position terms, `attention_adapters.DisentangledTerms`): computed at P only, and R
        reconstructs the rest from their sum."""
        if partial is None and not is_partial(module):
            raise TypeError(
                f"attention {attention_function_name(implementation)!r} runs only in the partial layers of a "
                f"partial model (got {type(module).__name__}); set attn_implementation to 'sdpa' or 'eager'.")
        config = module.config
        scaling = module.scaling if scaling is None else scaling
        if need_weights is None:
            need_weights = attention_weights_requested(config, kwargs)

        def run_kernel(tensors, query, key, value, attention_mask, heads=slice(None)):
            extra = None if score_terms is None else score_terms.at(query, key, tensors.layout.indices, heads)
            name = kernel_for(implementation, tensors, query, key, value, need_weights=need_weights,
                              dropout=dropout if module.training else 0.0, attention_mask=attention_mask, extra=extra)
            return kernel_function(name)(module, query, key, value, attention_mask, scaling, dropout,
                                         partial=tensors, **({} if extra is None else {"extra": extra}))

        def run_bucket(length, query, key, value, attention_mask, tensors=partial):
            if length in config.exact_lengths:  # b <= k: every score is exact
                if score_terms is not None:  # every term of every score, in the additive mask
                    attention_mask = with_position_bias(attention_mask, score_terms.full(query, key), query.dtype)
                return exact_attention(module, query, key, value, attention_mask, scaling, dropout, need_weights)
            tensors = layer_tensors(module, length) if tensors is None else tensors  # P, R: read once, passed down
            if not isinstance(tensors, list):
                return run_kernel(tensors, query, key, value, attention_mask)
            return _per_head(implementation, module, query, key, value, attention_mask, scaling, dropout,
                             need_weights, tensors, score_terms, run_kernel)

        if partial is not None or len(config.partial_lengths) == 1:  # one bucket: n's P and R for every input
            return run_bucket(config.partial_seq_len, query, key, value, attention_mask)
        return bucketed_attention(module, query, key, value, attention_mask, config.partial_lengths, run_bucket,
                                  need_weights)

    attention.__name__ = f"{attention_function_name(implementation)}_attention_forward"
    return attention


def _exact_function(module, query, key, value, attention_mask, scaling=None, dropout=0.0, need_weights=None,
                    score_terms=None, **kwargs):
    """An exact layer of a partial model: the model's ``_attn_implementation``; eager when the map is asked for
    (``need_weights``, where the caller says so: an adapted module, `attention_adapters`). ``score_terms``: the
    score's terms beyond q·k (DeBERTa-v2's), added in full through the mask."""
    chosen = module.config._partial_base._attn_implementation or "sdpa"
    if score_terms is not None:
        attention_mask = with_position_bias(attention_mask, score_terms.full(query, key), query.dtype)
    if need_weights is None:
        need_weights = attention_weights_requested(module.config, kwargs)
    if chosen == "eager" or need_weights:
        return exact_attention(module, query, key, value, attention_mask, scaling, dropout, need_weights=True)
    return ALL_ATTENTION_FUNCTIONS[chosen](module, query, key, value, attention_mask, scaling=scaling,
                                          dropout=dropout, **kwargs)


def register_attention_functions() -> None:
    """Register every setting (``partial_<kernel>``, ``partial_auto``) and the exact layers' function with
    transformers' `AttentionInterface`, each with a mask builder so that a mask is never silently dropped; safe to
    call more than once."""
    for name in PARTIAL_IMPLEMENTATIONS:  # every kernel, and "auto"
        AttentionInterface.register(attention_function_name(name), _partial_function(name))
        AttentionMaskInterface.register(attention_function_name(name), sdpa_mask)
    AttentionInterface.register(EXACT_FUNCTION, _exact_function)
    AttentionMaskInterface.register(EXACT_FUNCTION, sdpa_mask)


register_attention_functions()
