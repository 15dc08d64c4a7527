"""Gated-DeltaNet linear attention (Qwen3.5, Qwen3-Next) over the engine's per-request state slots.

A linear-attention layer keeps no key/value per token: each request carries a fixed-size state, the
last ``kernel - 1`` inputs of the depthwise causal convolution (``conv [slots, conv_dim, kernel - 1]``,
model dtype) and the delta-rule memory (``recurrent [slots, value_heads, key_dim, value_dim]``, fp32),
held by :class:`~.kv_cache.SlotKVCache` beside the key/value buffers of the softmax-attention layers
and moved, copied and freed with the request's slot.

:func:`install` replaces the forward of each gated-DeltaNet module with :func:`slot_forward`:

* a prefill or chunked-prefill forward (:class:`~.kv_cache.SlotCacheView`, rows left-padded) runs each
  row on its own real tokens: the convolution over ``[state | tokens]`` and the chunked delta rule from
  the row's state, both zero when the row starts at position 0 (a new, retracted or re-prefilled
  request: whatever a freed slot held is never read), then writes the row's new state back;
* a decode step (:class:`~.kv_cache.DecodeCacheView`, row b in slot b, one token a row) updates the
  first ``B`` slots in place with fixed shapes and no host sync, so it can be captured in a CUDA graph.

The arithmetic is transformers' own (its modeling module's ``torch_chunk_gated_delta_rule``,
``torch_recurrent_gated_delta_rule`` and ``causal_conv1d_update``), so the engine's log-probs are the
Hugging Face model's. Without a slot view (the engine's probe forward) the module's own forward runs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slime.utils.linear_attention import gated_delta_nets, override_forward


@dataclass(frozen=True)
class LinearStateShape:
    """Per-request state of the linear-attention layers (the same geometry in each of ``layers``)."""

    layers: tuple[int, ...]  # indices of the linear-attention decoder layers
    conv_dim: int  # channels of the causal convolution (queries, keys and values together)
    conv_width: int  # inputs it remembers: kernel size - 1
    value_heads: int
    key_dim: int
    value_dim: int

    def bytes_per_slot(self, conv_dtype: torch.dtype) -> int:
        recurrent = self.value_heads * self.key_dim * self.value_dim * torch.float32.itemsize
        return len(self.layers) * (self.conv_dim * self.conv_width * conv_dtype.itemsize + recurrent)


def install(model: torch.nn.Module) -> LinearStateShape | None:
    """Route every gated-DeltaNet module of ``model`` through :func:`slot_forward`; the state they need
    per request (None for a model without linear attention)."""
    modules = gated_delta_nets(model)
    if not modules:
        return None
    for module in modules:
        module._slime_modeling = importlib.import_module(type(module).__module__)
        override_forward(module, slot_forward)
    first = modules[0]
    return LinearStateShape(layers=tuple(m.layer_idx for m in modules), conv_dim=first.conv_dim,
                            conv_width=first.conv_kernel_size - 1, value_heads=first.num_v_heads,
                            key_dim=first.head_k_dim, value_dim=first.head_v_dim)


def _projections(module, hidden_states: torch.Tensor):
    """``(mixed_qkv [B, S, conv_dim], z [B, S, Hv, Dv], b [B, S, Hv], a [B, S, Hv])`` of either layout:
    Qwen3.5's separate projections or Qwen3-Next's grouped ``in_proj_qkvz`` / ``in_proj_ba``."""
    batch, seq, _ = hidden_states.shape
    if hasattr(module, "in_proj_qkvz"):
        query, key, value, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden_states),
                                                                         module.in_proj_ba(hidden_states))
        mixed_qkv = torch.cat([x.reshape(batch, seq, -1) for x in (query, key, value)], dim=-1)
        return mixed_qkv, z, b, a
    z = module.in_proj_z(hidden_states).reshape(batch, seq, -1, module.head_v_dim)
    return module.in_proj_qkv(hidden_states), z, module.in_proj_b(hidden_states), module.in_proj_a(hidden_states)


def _split_heads(module, mixed_qkv: torch.Tensor):
    batch, seq, _ = mixed_qkv.shape
    query, key, value = torch.split(mixed_qkv, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    return (query.reshape(batch, seq, -1, module.head_k_dim), key.reshape(batch, seq, -1, module.head_k_dim),
            value.reshape(batch, seq, -1, module.head_v_dim))


def _decay(module, a: torch.Tensor) -> torch.Tensor:
    return -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)


def slot_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """The gated-DeltaNet layer over the engine's state slots (the module's own forward without them)."""
    states = getattr(cache, "linear_state", None)
    if states is None:
        kwargs.pop("cache_params", None)
        return type(self).base_forward(self, hidden_states, cache=None, attention_mask=attention_mask)
    conv_state, recurrent_state = states(self.layer_idx)
    mixed_qkv, z, b, a = _projections(self, hidden_states)
    if getattr(cache, "decode_rows", None) is not None:
        core = _decode(self, cache.decode_rows, mixed_qkv, b, a, conv_state, recurrent_state)
    else:
        core = _prefill(self, cache, mixed_qkv, b, a, conv_state, recurrent_state)
    batch, seq = hidden_states.shape[:2]
    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(batch, seq, -1))


def _decode(module, rows: int, mixed_qkv, b, a, conv_state, recurrent_state) -> torch.Tensor:
    """One token for each of rows 0..B-1 (slots 0..B-1): both states updated in place."""
    modeling = module._slime_modeling
    weight = module.conv1d.weight.squeeze(1)
    mixed_qkv = modeling.causal_conv1d_update(mixed_qkv.transpose(1, 2), conv_state[:rows], weight,
                                              module.conv1d.bias, activation=module.activation).transpose(1, 2)
    query, key, value = _split_heads(module, mixed_qkv)
    out, state = modeling.torch_recurrent_gated_delta_rule(
        query, key, value, g=_decay(module, a), beta=b.sigmoid(), initial_state=recurrent_state[:rows],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    recurrent_state[:rows].copy_(state)
    return out


def _prefill(module, view, mixed_qkv, b, a, conv_state, recurrent_state) -> torch.Tensor:
    """Each row's real tokens (the last ``n_i`` of the left-padded row) from its slot's state, or from zero
    when it starts at position 0; padding positions give zeros."""
    modeling = module._slime_modeling
    batch, q_len, _ = mixed_qkv.shape
    out = mixed_qkv.new_zeros(batch, q_len, module.num_v_heads, module.head_v_dim)
    weight = module.conv1d.weight  # [conv_dim, 1, kernel]
    act = modeling.ACT2FN[module.activation]
    for row, (slot, start, length) in enumerate(view.rows_meta):
        tokens = mixed_qkv[row, q_len - length:].transpose(0, 1)  # [conv_dim, n]
        previous = conv_state[slot] if start > 0 else torch.zeros_like(conv_state[slot])
        window = torch.cat([previous.to(tokens.dtype), tokens], dim=-1)
        conv_out = act(F.conv1d(window.unsqueeze(0), weight, module.conv1d.bias, groups=module.conv_dim))
        conv_state[slot].copy_(window[:, window.shape[-1] - conv_state.shape[-1]:])
        query, key, value = _split_heads(module, conv_out.transpose(1, 2).to(mixed_qkv.dtype))
        initial = recurrent_state[slot:slot + 1] if start > 0 else None
        rows = slice(q_len - length, q_len)
        core, state = modeling.torch_chunk_gated_delta_rule(
            query, key, value, g=_decay(module, a[row:row + 1, rows]), beta=b[row:row + 1, rows].sigmoid(),
            initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
        recurrent_state[slot].copy_(state[0])
        out[row, rows] = core[0]
    return out
