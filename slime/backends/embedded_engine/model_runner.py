"""Torch side of the engine: the Hugging Face model, its forward pass over the slot cache, weights.

One forward handles a group of rows that sit in consecutive cache slots. Each row brings ``n_i``
new tokens starting at absolute position ``start_i``; rows are left-padded to a common ``q_len`` so
that the last real token of every row is the last query position (``logits_to_keep=1`` then gives
exactly the logits we sample from, through the model's own head, soft-capping and scaling
included). The attention mask is built here as an additive 4-D float mask, which transformers
uses as-is for both the ``sdpa`` and ``eager`` attention implementations.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Iterable

import torch

from slime.backends.embedded_engine.kv_cache import CacheShape, SlotCacheView, SlotKVCache

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class ForwardRow:
    """One row of a forward pass: ``tokens`` to feed, the first at absolute position ``start``."""

    tokens: list[int]
    start: int
    want_all_logits: bool = False  # prompt log-probs: keep the logits of every position of this row


class ModelRunner:
    """Loads a causal LM + tokenizer from a local HF directory and runs forwards over the slot cache."""

    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "auto", num_slots: int = 64,
                 slot_capacity: int | None = None, mem_fraction_static: float | None = None,
                 max_total_tokens: int | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = model_path
        self.device = torch.device(device)
        self.dtype = self._resolve_dtype(dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype, attn_implementation="sdpa")
        self.model.to(self.device).eval()
        self.config = self.model.config
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.context_length = int(getattr(self.config, "max_position_embeddings", 4096))
        self._cache_kwarg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.weights_on_device = True
        shape = self._cache_shape(num_slots, slot_capacity or self.context_length, mem_fraction_static, max_total_tokens)
        self.kv_cache = SlotKVCache(shape, self.dtype, self.device)
        self.context_length = shape.slot_capacity  # a request (prompt + output) must fit one slot
        logger.info("KV cache: %d slots x %d tokens, %.1f MB", shape.num_slots, shape.slot_capacity,
                    self.kv_cache.nbytes() / 2**20)

    def _resolve_dtype(self, dtype: str) -> torch.dtype:
        if dtype == "auto":
            return torch.bfloat16 if self.device.type == "cuda" else torch.float32
        if dtype not in DTYPES:
            raise ValueError(f"--dtype {dtype!r} is not supported; choose auto or one of {sorted(DTYPES)}")
        return DTYPES[dtype]

    def _cache_shape(self, num_slots: int, slot_capacity: int, mem_fraction_static: float | None,
                     max_total_tokens: int | None) -> CacheShape:
        text_config = getattr(self.config, "text_config", self.config)
        heads = text_config.num_attention_heads
        shape = CacheShape(
            num_layers=text_config.num_hidden_layers,
            num_kv_heads=getattr(text_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(text_config, "head_dim", None) or text_config.hidden_size // heads,
            num_slots=num_slots, slot_capacity=min(slot_capacity, self.context_length))
        if self.device.type == "cuda" and mem_fraction_static:
            # Size the cache from what is left of the static fraction after the weights.
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * mem_fraction_static - (total - free)
            tokens = int(budget // shape.bytes_per_token(self.dtype))
            if tokens < shape.slot_capacity:
                raise ValueError(f"--mem-fraction-static {mem_fraction_static} leaves room for {tokens} KV tokens, "
                                 f"fewer than one request of {shape.slot_capacity}; raise it or lower --context-length")
            max_total_tokens = min(tokens, max_total_tokens or tokens)
        if max_total_tokens:
            # Fixed-size slots: the budget decides how many requests can hold a slot at once.
            slots = min(num_slots, max_total_tokens // shape.slot_capacity)
            if slots < 1:
                raise ValueError(f"--max-total-tokens {max_total_tokens} is smaller than one slot of "
                                 f"{shape.slot_capacity} tokens; raise it or lower --context-length")
            shape = CacheShape(shape.num_layers, shape.num_kv_heads, shape.head_dim, slots, shape.slot_capacity)
        return shape

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, slots: list[int], rows: list[ForwardRow]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Run the model on ``rows`` (row i lives in cache slot ``slots[i]``); return fp32 last-token logits
        ``[rows, vocab]`` and, per row that asked for it, fp32 logits of all its new tokens ``[n_i, vocab]``."""
        q_len = max(len(r.tokens) for r in rows)
        pads = [q_len - len(r.tokens) for r in rows]
        # Built as Python lists and converted once: per-row tensor ops dominate small decode steps.
        input_ids = torch.tensor([[0] * pad + r.tokens for pad, r in zip(pads, rows)], dtype=torch.long)
        positions = torch.tensor([[0] * pad + list(range(r.start, r.start + len(r.tokens))) for pad, r in zip(pads, rows)],
                                 dtype=torch.long)
        valid = torch.tensor([[False] * pad + [True] * len(r.tokens) for pad, r in zip(pads, rows)], dtype=torch.bool)
        kv_length = max(r.start + len(r.tokens) for r in rows)
        input_ids, positions, valid = (t.to(self.device) for t in (input_ids, positions, valid))
        mask = self._attention_mask(positions, valid, kv_length)
        view = SlotCacheView(self.kv_cache, slots, valid, positions[valid], kv_length)
        want_all = any(r.want_all_logits for r in rows)
        out = self.model(input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=True,
                         logits_to_keep=0 if want_all else 1, **{self._cache_kwarg: view})
        logits = out.logits.float()
        all_logits = [logits[i, q_len - len(r.tokens):] if r.want_all_logits else None for i, r in enumerate(rows)]
        return logits[:, -1], all_logits

    def _attention_mask(self, positions: torch.Tensor, valid: torch.Tensor, kv_length: int) -> torch.Tensor:
        """Additive mask [rows, 1, q, kv]: query at absolute position p sees cache positions <= p;
        padding queries see position 0 only (their output is discarded)."""
        key_pos = torch.arange(kv_length, device=positions.device)
        query_pos = torch.where(valid, positions, torch.zeros_like(positions))
        allowed = key_pos.view(1, 1, -1) <= query_pos.unsqueeze(-1)
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=positions.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask.unsqueeze(1)

    # ------------------------------------------------------------------ weights
    @torch.inference_mode()
    def load_named_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into the model's parameters/buffers; return how many were loaded."""
        # remove_duplicate=False: tied weights (lm_head / embed_tokens) are reachable under both names
        params = dict(self.model.named_parameters(remove_duplicate=False))
        params.update(dict(self.model.named_buffers(remove_duplicate=False)))
        count = 0
        for name, tensor in named_tensors:
            target = params.get(name)
            if target is None:
                raise KeyError(f"weight {name!r} is not a parameter of {type(self.model).__name__} "
                               f"(e.g. {sorted(params)[:3]} ...); send HF parameter names")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r}: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            count += 1
        return count

    def load_from_disk(self, model_path: str) -> int:
        """Load a full HF checkpoint directory (same architecture) into the running model."""
        from transformers import AutoModelForCausalLM

        fresh = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        if type(fresh) is not type(self.model):
            raise ValueError(f"{model_path} holds a {type(fresh).__name__}, the server runs {type(self.model).__name__}")
        count = self.load_named_tensors(fresh.state_dict().items())
        self.model_path = model_path
        return count

    def get_weight(self, name: str) -> torch.Tensor:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        if name not in params:
            raise KeyError(f"no parameter named {name!r}")
        return params[name]

    def release_weights(self) -> None:
        """GPU: move the weights to host memory (content kept); CPU: nothing to free."""
        if self.device.type == "cuda" and self.weights_on_device:
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self.weights_on_device = False

    def resume_weights(self) -> None:
        if self.device.type == "cuda" and not self.weights_on_device:
            self.model.to(self.device)
        self.weights_on_device = True
