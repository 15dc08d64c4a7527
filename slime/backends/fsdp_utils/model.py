"""Models for the FSDP2 trainer: loading, sharding, and the packed (padding-free) forward.

Packing: the samples of a micro-batch are concatenated into one row ``[1, T]``; position ids restart
at 0 for every sample, and attention never crosses samples:

* ``flash_attention_2`` (GPU, when installed): transformers detects the packed layout from the
  position ids and runs varlen flash attention (no mask tensor);
* ``slime_varlen`` (GPU without ``flash_attn``): PyTorch's varlen flash attention over the samples'
  cumulative lengths (:mod:`slime.backends.training.varlen_attention`), no mask tensor;
* ``sdpa`` (CPU, and GPU without varlen attention): the samples are laid out as right-padded rows
  ``[n, S]`` instead (:func:`pad_samples`), with no mask at all: causal attention alone is exact,
  since a row's padding comes after its tokens and no real token attends to it, and SDPA runs its
  fused causal kernel. (A block-diagonal mask over one packed row costs T² per head: 64 samples of
  41 tokens made the CPU train step 3x slower than these rows.)
* ``eager``: an explicit block-diagonal causal mask ``[1, 1, T, T]`` over one packed row (the exact
  masked path; tested equal to per-sample forwards).

Gated-DeltaNet linear-attention layers (Qwen3.5, Qwen3-Next) see no attention mask: in a packed row they
get the samples' boundaries (``cu_seq_lens_q``) and restart at each (:mod:`slime.utils.linear_attention`);
right-padded rows need nothing.

Only the positions that predict response tokens go through the LM head (``logits_to_keep``), so
the vocabulary projection costs Σ response lengths, not T; and for log-probs and entropy the head
is replaced by the chunked one of :mod:`slime.backends.training.logprob_head` (no ``[K, V]``
float32 logits or gradient is ever held whole).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from slime.backends import batch_invariant
from slime.backends.training.logprob_head import chunked_log_probs_and_entropy
from slime.utils.linear_attention import install_packed_forward

__all__ = ["PackedBatch", "pack_samples", "pad_samples", "forward_log_probs", "forward_response_logits", "block_causal_mask", "CriticModel", "load_model", "shard_model", "resolve_attn_implementation"]


@dataclass
class PackedBatch:
    """One packed micro-batch.

    input_ids / position_ids: ``[1, T]`` int64; lengths: per-sample total lengths;
    response_lengths: per-sample response lengths; predict_positions: ``[K]`` positions whose
    logits predict the K = Σ response tokens; targets: ``[K]`` those tokens; cu_seqlens: ``[n+1]``.
    ``dummy`` marks a zero-weight placeholder micro-batch (a rank with no samples in it).
    ``padded``: the rows layout of :func:`pad_samples` (input_ids / position_ids ``[n, S]``;
    predict_positions index the flattened ``[n·S]``).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    lengths: list[int]
    response_lengths: list[int]
    predict_positions: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor
    dummy: bool = False
    padded: bool = False
    model_kwargs: dict = field(default_factory=dict)  # a vision-language model's image inputs (vision.attach)


def pack_samples(tokens: list[torch.Tensor], response_lengths: list[int], device, pad_token_id: int = 0) -> PackedBatch:
    """Concatenate samples; an empty list gives a one-token dummy batch."""
    if not tokens:
        one = torch.full((1, 1), pad_token_id, dtype=torch.long, device=device)
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return PackedBatch(one, torch.zeros_like(one), [1], [0], empty, empty,
                           torch.tensor([0, 1], dtype=torch.int32, device=device), dummy=True)
    lengths = [int(t.numel()) for t in tokens]
    input_ids = torch.cat([t.long() for t in tokens]).to(device)
    position_ids = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths]).to(device)
    predict, offset = [], 0
    for n, r in zip(lengths, response_lengths):
        if r > n - 1:
            raise ValueError(f"response_length {r} needs at least one prompt token before it (sample length {n})")
        predict.append(torch.arange(offset + n - r - 1, offset + n - 1, dtype=torch.long))
        offset += n
    predict_positions = torch.cat(predict).to(device)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return PackedBatch(
        input_ids[None], position_ids[None], lengths, [int(r) for r in response_lengths],
        predict_positions, input_ids[predict_positions + 1], cu.to(device),
    )


def pad_samples(tokens: list[torch.Tensor], response_lengths: list[int], device, pad_token_id: int = 0) -> PackedBatch:
    """The samples as right-padded rows ``[n, max length]`` (the ``sdpa`` layout); an empty list gives
    :func:`pack_samples`' dummy batch."""
    if not tokens:
        return pack_samples(tokens, response_lengths, device, pad_token_id)
    lengths = [int(t.numel()) for t in tokens]
    width = max(lengths)
    input_ids = torch.full((len(tokens), width), pad_token_id, dtype=torch.long)
    predict = []
    for row, (sample, n, r) in enumerate(zip(tokens, lengths, response_lengths)):
        if r > n - 1:
            raise ValueError(f"response_length {r} needs at least one prompt token before it (sample length {n})")
        input_ids[row, :n] = sample.long()
        predict.append(torch.arange(row * width + n - r - 1, row * width + n - 1, dtype=torch.long))
    predict_positions = torch.cat(predict)
    targets = input_ids.view(-1)[predict_positions + 1]
    position_ids = torch.arange(width, dtype=torch.long).expand(len(tokens), width)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    # built on the host, then copied without waiting for each copy
    ids, positions, predict_positions, targets = (t.to(device, non_blocking=True) for t in
                                                  (input_ids, position_ids.contiguous(), predict_positions, targets))
    return PackedBatch(ids, positions, lengths, [int(r) for r in response_lengths], predict_positions, targets,
                       cu.to(device), padded=True)


def block_causal_mask(lengths: list[int], device, attn_implementation: str, dtype=torch.float32) -> torch.Tensor:
    """``[1, 1, T, T]`` mask: token q attends to k iff same sample and k ≤ q. Bool (True = attend)
    for sdpa; additive float (0 / −inf-like) for eager."""
    sample_of = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    total = sample_of.numel()
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    allowed = causal & (sample_of[:, None] == sample_of[None, :])
    if attn_implementation == "eager":
        mask = torch.zeros(total, total, dtype=dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[None, None]
    return allowed[None, None]


def resolve_attn_implementation(requested: str, device_type: str) -> str:
    if requested == "slime_varlen":
        from slime.backends.training import varlen_attention

        if device_type != "cuda" or not varlen_attention.available():
            raise ValueError("--fsdp-attn-implementation slime_varlen needs CUDA and a PyTorch whose "
                             "torch.nn.attention.varlen (2.10+) passes its start-up gradient check (see the "
                             "warning above, if any); use auto or sdpa")
        return varlen_attention.register()
    if requested != "auto":
        return requested
    if device_type == "cuda":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
        from slime.backends.training import varlen_attention

        if varlen_attention.available():
            return varlen_attention.register()
    return "sdpa"


def model_inputs(packed: PackedBatch, attn_implementation: str, dtype=torch.float32,
                 sample_bounds: bool = False) -> dict:
    """The model's keyword inputs for ``packed``; ``sample_bounds``: the samples' cumulative lengths too, for
    a packed row through layers that carry a state along it (linear attention)."""
    inputs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "use_cache": False,
              **packed.model_kwargs}
    if attn_implementation == "slime_varlen" or (sample_bounds and not packed.padded):
        longest = max(packed.lengths) if packed.lengths else 1
        inputs.update(cu_seq_lens_q=packed.cu_seqlens, cu_seq_lens_k=packed.cu_seqlens,
                      max_length_q=longest, max_length_k=longest)
    elif packed.padded:
        if attn_implementation not in ("sdpa", batch_invariant.ATTENTION_NAME):
            raise ValueError(f"right-padded rows need attn_implementation 'sdpa' (causal, no mask), not {attn_implementation!r}")
    if not packed.padded and attn_implementation not in ("flash_attention_2", "slime_varlen"):
        inputs["attention_mask"] = block_causal_mask(packed.lengths, packed.input_ids.device, attn_implementation, dtype)
    return inputs


def _sample_bounds(model: nn.Module) -> bool:
    return bool(getattr(model, "linear_attention_layers", 0))


def forward_response_logits(model: nn.Module, packed: PackedBatch, attn_implementation: str, full: bool = False):
    """Logits ``[K, V]`` at the positions predicting response tokens (``[T, V]`` with ``full``).

    With no response token (a dummy micro-batch) one row is still computed, so the caller can
    build a zero loss ``logits.sum() * 0`` whose backward reaches every parameter (FSDP collectives
    stay matched across ranks); check ``packed.predict_positions.numel()`` before using it.
    """
    if full:
        if packed.padded:
            raise ValueError("full-position logits need the packed layout (pack_samples), not padded rows")
        keep = 0
    elif packed.predict_positions.numel() == 0:
        keep = torch.zeros(1, dtype=torch.long, device=packed.input_ids.device)
    else:
        keep = packed.predict_positions
    out = model(**model_inputs(packed, attn_implementation, sample_bounds=_sample_bounds(model)), logits_to_keep=keep)
    return out.logits[0] if hasattr(out, "logits") else out[0]


def forward_log_probs(model: nn.Module, packed: PackedBatch, attn_implementation: str, temperature: float,
                      chunk_rows: int, nucleus=None, entropy_grad: bool = False,
                      exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (log π(target), entropy) ``[K]`` float32 of a packed micro-batch, computed by
    :func:`~slime.backends.training.logprob_head.chunked_log_probs_and_entropy` from the final
    hidden states and the LM-head weight without materialising the ``[K, V]`` logits.

    The chunked head runs *inside* the model's forward (it stands in for ``lm_head.forward`` for
    this call), so under FSDP2 it sees the unsharded weight of the root group exactly as
    ``lm_head`` would (tied embeddings included) and its weight gradient reaches FSDP's
    reduce-scatter. A dummy micro-batch computes one row so its zero loss reaches every parameter.
    ``exact`` (``--true-on-policy``): the head of :mod:`slime.backends.batch_invariant`, the engine's.
    """
    head = model.get_output_embeddings()
    if head is None or not isinstance(head, nn.Linear):
        raise ValueError(f"{type(model).__name__} has no nn.Linear output embedding (lm_head) for the chunked log-prob head")
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError("final_logit_softcapping models are not supported by the chunked log-prob head")
    dummy = packed.predict_positions.numel() == 0
    keep = torch.zeros(1, dtype=torch.long, device=packed.input_ids.device) if dummy else packed.predict_positions
    targets = packed.input_ids[0, :1] if dummy else packed.targets
    if packed.padded:
        keep = 0  # every position reaches the head below, which keeps the predicting ones of the flattened rows

    def chunked_head(hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1])[packed.predict_positions] if packed.padded else hidden[0]
        if exact:
            log_probs, entropy = batch_invariant.log_probs_and_entropy(rows, head.weight, head.bias, targets,
                                                                       temperature, entropy_grad)
            return torch.stack([log_probs[None], entropy[None]], dim=-1)
        log_probs, entropy = chunked_log_probs_and_entropy(
            rows, head.weight, targets, temperature, chunk_rows, bias=head.bias,
            nucleus=None if dummy else nucleus, entropy_grad=entropy_grad,
        )
        return torch.stack([log_probs[None], entropy[None]], dim=-1)  # [1, K, 2], not a view (FSDP hooks it)

    head.forward = chunked_head  # an instance attribute shadows nn.Linear.forward for this call only
    try:
        out = model(**model_inputs(packed, attn_implementation, sample_bounds=_sample_bounds(model)), logits_to_keep=keep)
    finally:
        del head.forward
    pair = (out.logits if hasattr(out, "logits") else out[0])[0]
    return pair[:, 0], pair[:, 1]


class CriticModel(nn.Module):
    """A causal-LM backbone with a scalar value head: V at position p estimates the return of the
    token at p + 1 (the same positions that predict response tokens). Values are not temperature-scaled."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.model = backbone
        self.value_head = nn.Linear(hidden_size, 1, bias=True)

    def forward(self, input_ids, position_ids, attention_mask=None, use_cache=False, logits_to_keep=None, **kwargs):
        hidden = self.model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False, **kwargs
        ).last_hidden_state
        if isinstance(logits_to_keep, torch.Tensor):  # positions of the flattened rows (one row when packed)
            hidden = hidden.reshape(1, -1, hidden.shape[-1])[:, logits_to_keep]
        return self.value_head(hidden).squeeze(-1).clone()  # FSDP2 output hooks must not see a view


def load_model(path: str, role: str, attn_implementation: str, seed: int) -> nn.Module:
    """The HF model at ``path`` in float32 (actor: CausalLM; critic: backbone + value head).
    A critic checkpoint directory written by :meth:`save_hf` carries ``value_head.safetensors``."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

    from slime.utils.multimodal import is_vision_language

    torch.manual_seed(seed)
    if attn_implementation == "slime_varlen":
        from slime.backends.training import varlen_attention

        varlen_attention.register()
    config = AutoConfig.from_pretrained(path)
    if role == "actor" and is_vision_language(config):
        from slime.backends.fsdp_utils import vision

        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32,
                                                            attn_implementation=attn_implementation)
        vision.install_forward(model)
        model.linear_attention_layers = install_packed_forward(model)  # Qwen3.5's language model
        return model
    if role == "actor":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
        model.linear_attention_layers = install_packed_forward(model)  # packed samples' boundaries honoured
        return model
    if is_vision_language(config):
        raise ValueError(f"{path}: a PPO critic on a vision-language model is not supported; use a critic-free "
                         "estimator (e.g. --advantage-estimator grpo)")
    backbone = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
    critic = CriticModel(backbone, config.hidden_size)
    nn.init.normal_(critic.value_head.weight, std=0.02)
    nn.init.zeros_(critic.value_head.bias)
    head = os.path.join(path, "value_head.safetensors")
    if os.path.exists(head):
        from safetensors.torch import load_file

        critic.value_head.load_state_dict(load_file(head))
    critic.linear_attention_layers = install_packed_forward(critic)
    return critic


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    inner = model.model if hasattr(model, "model") else model
    inner = inner.model if hasattr(inner, "model") and hasattr(inner.model, "layers") else inner
    inner = inner.language_model if hasattr(inner, "language_model") else inner  # vision-language models
    if not hasattr(inner, "layers"):
        raise ValueError(f"cannot find decoder layers in {type(model).__name__}: expected .model.layers")
    return list(inner.layers)


def shard_model(model: nn.Module, mesh, mixed_precision: bool, reshard_after_forward: bool = True,
                compile_layers: bool = False) -> nn.Module:
    """FSDP2: ``fully_shard`` every decoder layer, then the root (embeddings, norm, head; tied
    weights stay in the root group). bf16 parameters with fp32 gradient reduction when
    ``mixed_precision``. ``compile_layers`` (``--fsdp-compile``) compiles each decoder layer in place
    first (``torch.compile``, dynamic shapes: packed micro-batches vary in length), which fuses the
    norms, rotary embeddings, activations and residual adds that dominate small models."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        if compile_layers:
            layer.compile(dynamic=True)  # in place: parameter names (checkpoints, HF export) unchanged
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model
