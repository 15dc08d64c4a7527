"""Absorbed-weight decode for DeepSeek's multi-latent attention (the engine's MLA fast path).

The cache holds, per token and layer, the normalised latent ``c`` (``kv_lora_rank`` wide) and the
rotary key ``k_r`` (``qk_rope_head_dim``). transformers' reference attention expands the whole cached
latent through ``kv_b_proj`` at every decode step — ``L × H × (d_nope + d_v)`` values per layer, for
a cache of ``L`` tokens — before an ordinary attention. With ``kv_b_proj``'s weight split per head
into ``W_UK [H, d_nope, r]`` and ``W_UV [H, d_v, r]`` the same attention is, for one query token::

    q_lat  = q_nope · W_UK                       [B, H, r]   (absorb W_UK into the query)
    s      = (q_lat · cᵀ + q_rot · k_rᵀ) · scale + mask      [B, H, L]
    o_lat  = softmax(s) · c                      [B, H, r]
    o      = o_lat · W_UVᵀ                       [B, H, d_v] -> o_proj

so the step reads the compressed cache once and never materialises per-head keys or values
(the weight absorption of the DeepSeek-V2 paper's multi-head latent attention; SGLang's and vLLM's MLA decode). A speculative verify step (``T`` query
tokens a row, ``decode_forward`` with ``slot_decode``) runs the same with a ``T`` axis: query ``t``
masked to its own position, the cache read once for all ``T``. Prefill and training keep
transformers' path. :func:`install` switches every ``DeepseekV3Attention`` of a model
to it; ``--mla-decode expanded`` keeps the reference for comparison (the tests check they agree).
"""

from __future__ import annotations

import sys
import types

import torch

__all__ = ["install", "MLA_CLASSES"]

MLA_CLASSES = {"DeepseekV3Attention"}


def install(model: torch.nn.Module) -> int:
    """Give every MLA attention module of ``model`` the absorbed decode; returns how many."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in MLA_CLASSES and not getattr(module, "_slime_absorbed", False):
            module._slime_reference_forward = module.forward
            module.forward = types.MethodType(_forward, module)
            module._slime_absorbed = True
            count += 1
    return count


def _rotary(module):
    modeling = sys.modules[type(module).__module__]
    if module.config.rope_interleave:
        return modeling.apply_rotary_pos_emb_interleave
    return modeling.apply_rotary_pos_emb


def _forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, cache=None, **kwargs):
    batch, q_len = hidden_states.shape[:2]
    decode = q_len == 1 or kwargs.get("slot_decode", False)  # slot_decode: a verify step's T tokens a row
    if not decode or cache is None or self.training or attention_mask is None:
        return self._slime_reference_forward(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
    heads, nope, rope, v_dim, rank = (self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim,
                                      self.kv_lora_rank)
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q = q.view(batch, q_len, heads, nope + rope).transpose(1, 2)  # [B, H, T, d]
    q_nope, q_rot = torch.split(q, [nope, rope], dim=-1)
    latent, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
    latent = self.kv_a_layernorm(latent).view(batch, 1, q_len, rank)
    k_rot = k_rot.view(batch, 1, q_len, rope)
    cos, sin = position_embeddings
    q_rot, k_rot = _rotary(self)(q_rot, k_rot, cos, sin)
    latent, k_rot = cache.update(latent, k_rot, self.layer_idx, kwargs=kwargs)  # [B, 1, L, r], [B, 1, L, rope]
    weight = self.kv_b_proj.weight.view(heads, nope + v_dim, rank)
    w_uk, w_uv = weight[:, :nope], weight[:, nope:]
    q_lat = torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk)
    scores = torch.einsum("bhtr,blr->bhtl", q_lat, latent[:, 0]) + torch.einsum("bhtd,bld->bhtl", q_rot, k_rot[:, 0])
    scores = scores.float() * self.scaling + attention_mask.float()  # mask [B, 1, T, L]: token t up to its position
    probs = torch.softmax(scores, dim=-1).to(latent.dtype)
    out_lat = torch.einsum("bhtl,blr->bhtr", probs, latent[:, 0])
    out = torch.einsum("bhtr,hvr->bhtv", out_lat, w_uv).transpose(1, 2).reshape(batch, q_len, heads * v_dim)
    return self.o_proj(out), None
