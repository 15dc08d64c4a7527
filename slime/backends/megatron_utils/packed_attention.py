"""Packed (thd) micro-batches without Transformer Engine: a core attention for Megatron-Core's local
layer spec that attends within each sample of a packed row.

Megatron-Core's local ``DotProductAttention`` refuses packed sequences, so without Transformer
Engine the trainer used to pad every micro-batch to ``[n, L_max]`` (about a quarter of the tokens of
a typical RL batch were padding). :class:`PackedCoreAttention` replaces it in the local spec
(:func:`use_packed_core_attention`): padded inputs go through ``DotProductAttention`` unchanged;
a packed row ``[1, T]`` with :class:`LocalPackedSeqParams` is attended

* on CUDA, by PyTorch's varlen flash attention (``torch.nn.attention.varlen``, as the FSDP
  backend's ``varlen_attention.py``), causal within each sample, in the autocast dtype;
* elsewhere (the CPU tests, fp32, dropout or options flash does not have), exactly by
  ``DotProductAttention`` on each sample alone.

Rotary embeddings: Megatron's own thd RoPE without Transformer Engine loops over the samples with a
host sync per layer. :class:`LocalPackedSeqParams` therefore leaves ``cu_seqlens_q/kv`` unset (so
the attention applies RoPE in its vectorised per-token form) and :func:`per_token_rotary` makes the
model's rotary table return each packed token's own position (``position_ids``, restarting at 0 in
every sample) — the same angles the padded layout uses.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

__all__ = ["LocalPackedSeqParams", "PackedCoreAttention", "per_token_rotary", "supports_packing",
           "use_packed_core_attention", "replace_core_attention"]


@dataclasses.dataclass
class LocalPackedSeqParams(PackedSeqParams):
    """``qkv_format="thd"`` with the sample boundaries kept where only :class:`PackedCoreAttention`
    reads them: ``sample_cu_seqlens`` (int32 ``[n + 1]`` on the device), ``sample_lengths`` (host
    ints), and ``max_seqlen_q/kv`` (the longest sample, which sizes the rotary table)."""

    sample_cu_seqlens: torch.Tensor | None = None
    sample_lengths: list[int] | None = None
    cp: object | None = None  # context_parallel.CPLayout: this rank's chunks under context parallelism


class PackedCoreAttention(DotProductAttention):
    """``DotProductAttention`` that also takes a packed row (see the module docstring), and attends
    across context-parallel ranks (:mod:`.context_parallel`)."""

    def __init__(self, config, *args, **kwargs):
        # DotProductAttention refuses context parallelism (only Transformer Engine's does it); this
        # class does it for packed rows itself
        context_parallel_size = config.context_parallel_size
        config.context_parallel_size = 1
        try:
            super().__init__(config, *args, **kwargs)
        finally:
            config.context_parallel_size = context_parallel_size

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if self.config.context_parallel_size > 1 and getattr(packed_seq_params, "cp", None) is None:
            raise ValueError("under context parallelism every micro-batch must be packed with its CP layout "
                             "(slime.backends.megatron_utils.forward.micro_batch_inputs(..., cp_size=, cp_rank=))")
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, None)
        if not isinstance(packed_seq_params, LocalPackedSeqParams):
            raise ValueError(f"{type(self).__name__} takes packed rows described by LocalPackedSeqParams "
                             f"(slime.backends.megatron_utils.model.micro_batch_inputs), got {type(packed_seq_params).__name__}")
        dtype = self._flash_dtype(query)
        if packed_seq_params.cp is not None:
            from slime.backends.megatron_utils import context_parallel

            return context_parallel.attention(query, key, value, packed_seq_params.cp, self._unscaled_softmax_scale(), dtype)
        if dtype is not None:
            return self._varlen(query, key, value, packed_seq_params, dtype)
        return self._per_sample(query, key, value, attn_mask_type, attention_bias, packed_seq_params)

    def _flash_dtype(self, query: torch.Tensor) -> torch.dtype | None:
        """The dtype flash attention runs in here, or None where it does not apply."""
        from slime.backends.training import varlen_attention

        if not query.is_cuda or not varlen_attention.available():
            return None
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else query.dtype
        dropout = self.attention_dropout.p if self.training else 0.0
        vanilla = self.config.softmax_type == "vanilla" and self.scale_mask_softmax.window_size is None
        return dtype if dtype in (torch.bfloat16, torch.float16) and dropout == 0.0 and vanilla else None

    def _varlen(self, query, key, value, params: LocalPackedSeqParams, dtype) -> torch.Tensor:
        from slime.backends.training.varlen_attention import varlen_attention_forward

        scale = self._unscaled_softmax_scale()
        as_heads_first = lambda t: t.to(dtype).transpose(0, 1).unsqueeze(0)  # [T, h, d] -> [1, h, T, d]
        out, _ = varlen_attention_forward(self, as_heads_first(query), as_heads_first(key), as_heads_first(value), None,
                                          scaling=scale, cu_seq_lens_q=params.sample_cu_seqlens,
                                          cu_seq_lens_k=params.sample_cu_seqlens,
                                          max_length_q=params.max_seqlen_q, max_length_k=params.max_seqlen_kv)
        return out[0].reshape(out.shape[1], 1, -1)  # [T, 1, h·d]

    def _unscaled_softmax_scale(self) -> float:
        # DotProductAttention divides its scale by the layer number when it scales its softmax by it
        return self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)

    def _per_sample(self, query, key, value, attn_mask_type, attention_bias, params: LocalPackedSeqParams) -> torch.Tensor:
        outputs, start = [], 0
        for length in params.sample_lengths:
            piece = lambda t: t[start: start + length].unsqueeze(1)  # [n, 1, heads, d]: one sample, b = 1
            outputs.append(super().forward(piece(query), piece(key), piece(value), None, attn_mask_type, attention_bias, None))
            start += length
        return torch.cat(outputs, dim=0)  # [T, 1, h·d]


def use_packed_core_attention(spec):
    """``spec`` (a layer or block spec of the local layer spec) with every ``DotProductAttention``
    replaced by :class:`PackedCoreAttention`; the spec itself is not modified."""
    return replace_core_attention(spec, PackedCoreAttention)


def replace_core_attention(spec, replacement):
    """``spec`` with every ``DotProductAttention`` replaced by ``replacement`` (a copy; ``spec`` is kept)."""
    if spec is DotProductAttention:
        return replacement
    if isinstance(spec, (list, tuple)):
        return type(spec)(replace_core_attention(s, replacement) for s in spec)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changed = {}
        for f in dataclasses.fields(spec):
            value = getattr(spec, f.name)
            swapped = replace_core_attention(value, replacement)
            if swapped is not value:
                changed[f.name] = swapped
        if changed:
            spec = copy.copy(spec)
            for name, value in changed.items():
                setattr(spec, name, value)
    return spec


def supports_packing(gpt: torch.nn.Module) -> bool:
    """Whether ``gpt`` (a GPTModel of the local spec) can take :class:`LocalPackedSeqParams`: every
    core attention is a :class:`PackedCoreAttention` and positions come from a plain RoPE table."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    attentions = [m for name, m in gpt.named_modules() if name.endswith("core_attention")]
    return (bool(attentions) and all(isinstance(m, PackedCoreAttention) for m in attentions)
            and getattr(gpt, "position_embedding_type", None) == "rope"
            and type(getattr(gpt, "rotary_pos_emb", None)) is RotaryEmbedding
            and not getattr(gpt.config, "multi_latent_attention", False)
            # Megatron-Core's interleaved rotate-half (GLM-4) indexes [s, b, h, d]; a packed row's q/k are [t, h, d]
            and not getattr(gpt.config, "rotary_interleaved", False))


@contextlib.contextmanager
def per_token_rotary(gpt: torch.nn.Module, position_ids: torch.Tensor):
    """Within the block, ``gpt.rotary_pos_emb(...)`` returns the rotary angles of each packed token
    at its own position, ``[T, 1, d]`` (broadcast over the heads of ``[T, heads, d]``), instead of
    the table of positions ``0 … max_len − 1``."""
    rotary = gpt.rotary_pos_emb
    table_of = type(rotary).forward
    positions = position_ids.reshape(-1)

    def per_token(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        # packed_seq=True: the whole table (Megatron would otherwise cut it per context-parallel rank)
        table = table_of(rotary, max_seq_len, offset, packed_seq=True, cp_group=cp_group)  # [S, 1, 1, d]
        return table.reshape(table.shape[0], 1, table.shape[-1])[positions]

    rotary.forward = per_token
    try:
        yield
    finally:
        del rotary.forward
