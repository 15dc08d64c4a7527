"""Torch side of the engine: the Hugging Face model, its forward pass over the slot cache, weights.

One forward handles a group of rows that sit in consecutive cache slots. Each row brings ``n_i``
new tokens starting at absolute position ``start_i``; rows are left-padded to a common ``q_len`` so
that the last real token of every row is the last query position (``logits_to_keep=1`` then gives
exactly the logits we sample from, through the model's own head, soft-capping and scaling
included). The attention mask is built here as an additive 4-D float mask, which transformers
uses as-is for both the ``sdpa`` and ``eager`` attention implementations.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import inspect
import logging
import re
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from slime.backends import batch_invariant
from slime.backends.embedded_engine import linear_attention
from slime.backends.embedded_engine.kernels import attention
from slime.backends.embedded_engine.kernels import fused_projections
from slime.backends.embedded_engine.cuda_graphs import DecodeGraphs
from slime.backends.embedded_engine.kv_cache import (FP8_DTYPES, CacheShape, DecodeCacheView, SlotCacheView,
                                                     SlotKVCache, read_kv_scales, resolve_kv_cache_dtype)
from slime.backends.embedded_engine.memory_saver import MemorySaver
from slime.backends.embedded_engine.kernels.mla_decode import MLA_CLASSES
from slime.backends.embedded_engine.vision import VisionLanguage, is_vision_language

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class ForwardRow:
    """One row of a forward pass: ``tokens`` to feed, the first at absolute position ``start``."""

    tokens: list[int]
    start: int
    want_all_logits: bool = False  # prompt log-probs: keep the logits of every position of this row
    vision: Any = None  # vision.RequestVision of an image request (M-RoPE positions, image embeddings)


class ModelRunner:
    """Loads a causal LM + tokenizer from a local HF directory and runs forwards over the slot cache."""

    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "auto", num_slots: int = 64,
                 slot_capacity: int | None = None, mem_fraction_static: float | None = None,
                 max_total_tokens: int | None = None, cuda_graph: bool = True, cuda_graph_max_bs: int | None = None,
                 cuda_graph_bs: list[int] | None = None,
                 attention_backend: str | None = None, mla_decode: str = "absorbed",
                 quantization: str | None = None, fp8_gemm_backend: str = "auto", kv_cache_dtype: str = "auto",
                 routed_experts: bool = False, memory_saver: bool = False, weights_cpu_backup: bool = False,
                 true_on_policy: bool = False):
        from transformers import AutoTokenizer

        self.model_path = model_path
        self.device = torch.device(device)
        self.dtype = self._resolve_dtype(dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        #: --true-on-policy: the trainer's batch-invariant ops (batch_invariant.py) instead of the fused ones,
        #: so every sampled token's log-prob is the trainer's bit for bit
        self.true_on_policy = true_on_policy
        attn = batch_invariant.register() if true_on_policy else attention.register()
        self.model = load_model(model_path, dtype=self.dtype, attn_implementation=attn)
        self.model.to(self.device).eval()
        #: a vision-language model's images, M-RoPE positions and per-slot rotary offsets (vision.py)
        self.vision = (VisionLanguage(self.model, model_path, num_slots, self.device)
                       if is_vision_language(self.model.config) else None)
        if true_on_policy:
            flag = "--enable-deterministic-inference (slime: --deterministic-mode / --true-on-policy)"
            batch_invariant.check_supported(self.model, flag)
            if quantization is not None:
                raise ValueError(f"{flag}: quantized weights (--quantization {quantization}) are not batch-invariant")
        self.config = self.model.config
        _refuse_sliding_windows(self.model, model_path)
        #: gated-DeltaNet layers (Qwen3.5, Qwen3-Next): their per-request state lives in the slot cache
        self.linear_state = linear_attention.install(self.model)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.context_length = int(getattr(self.config, "max_position_embeddings", 4096))
        self._cache_kwarg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.weights_on_device = True
        # --true-on-policy: the batch-invariant attention (registered above) reads the cache through the generic
        # view; the flash-decoding kernel's raw cache reads would bypass it
        self.attention_backend = ("torch_native" if true_on_policy and attention_backend is None
                                  else self._resolve_attention_backend(attention_backend))
        if true_on_policy and self.attention_backend != "torch_native":
            raise ValueError(f"--attention-backend {self.attention_backend} with --enable-deterministic-inference: the "
                             "batch-invariant attention runs in place of the flash-decoding kernel; use "
                             "--attention-backend torch_native (the default under the flag)")
        # q/k/v and gate/up as one GEMM each (exact: the same dot products); under FP8 only where each part
        # is whole 128-row weight blocks (fp8.quantize_model then quantizes the fused weight)
        self.fused_projections = {} if true_on_policy else fused_projections.install(
            self.model, row_multiple=128 if quantization == "fp8" else 1)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the separate weights the fused ones replaced: free for the KV budget
        self.fused_ops = {}
        if true_on_policy:
            self.fused_ops = batch_invariant.install(self.model)
        elif self.attention_backend == "triton":  # the Triton path: fused norms, rotary and SiLU gate too
            from slime.backends.embedded_engine.kernels import fused_ops

            self.fused_ops = fused_ops.install(self.model)
        elif self.device.type == "cpu" and quantization is None:  # the same, as fewer torch ops (fp32)
            from slime.backends.embedded_engine.kernels import cpu_ops

            self.fused_ops = cpu_ops.install(self.model)
        if mla_decode not in ("absorbed", "expanded"):
            raise ValueError(f"--mla-decode {mla_decode!r}: choose absorbed or expanded")
        self.mla_layers = 0  # multi-latent attention layers decoding with absorbed weights
        if mla_decode == "absorbed" and not true_on_policy:
            from slime.backends.embedded_engine.kernels import mla_decode as mla

            self.mla_layers = mla.install(self.model)
        #: speculative verify steps run as T-token decode steps (can_verify); multi-latent attention takes
        #: them through its absorbed decode (mla_decode), so the expanded reference keeps the generic forward
        self.verify_decode = self.linear_state is None and not any(
            type(m).__name__ in MLA_CLASSES and not getattr(m, "_slime_absorbed", False) for m in self.model.modules())
        self.fp8 = self._quantize(quantization, fp8_gemm_backend)  # Fp8Weights, or None in the model dtype
        #: --enable-memory-saver on CUDA (memory_saver.py): weights and KV cache released and resumed at the
        #: same addresses, so a colocated engine keeps its CUDA graphs across training steps
        self.saver = None
        #: the parameters a release drops (no --enable-weights-cpu-backup), and of those, bytes not yet rewritten
        #: since the last resume by start address (unwritten_weights); FP8 weights are buffers, always backed up
        self._dropped_on_release: list[torch.Tensor] = []
        self._dropped_bytes: dict[int, int] = {}  # their start address -> bytes (fixed: resumes map in place)
        self._unwritten_starts: list[int] = []
        self._unwritten: dict[int, int] = {}
        if memory_saver and self.device.type == "cuda":
            self.saver = MemorySaver()
            keep = weights_cpu_backup or self.fp8 is not None
            self._dropped_on_release = self.saver.adopt([self.model], keep_parameters=keep)
            logger.info("memory saver: %.1f MB of parameters in pausable regions (%s)",
                        sum(p.numel() * p.element_size() for p in self.model.parameters()) / 2**20,
                        "content kept across releases" if keep else
                        "parameters rewritten by the weight push after each resume; buffers kept")
        self._mtp_adopted = False
        self.max_slots = num_slots
        self._geometry = self._cached_geometry()  # (heads, key width, value width) each layer caches
        self.kv_cache_dtype, self.kv_scales = self._resolve_kv_cache(kv_cache_dtype)
        self._plan_cache(slot_capacity, mem_fraction_static, max_total_tokens)
        self.kv_cache = self._new_cache(self._shape(self._initial_capacity()))
        logger.info("KV cache (%s): %d slots x %d tokens, %.1f MB (slots grow with the requests, up to %d tokens; "
                    "budget %s tokens)", self.kv_cache_dtype, self.kv_cache.shape.num_slots,
                    self.kv_cache.shape.slot_capacity, self.kv_cache.nbytes() / 2**20, self.context_length,
                    self.kv_token_budget or "unbounded")
        #: ``--enable-return-routed-experts``: each MoE layer's experts per cached token (routed_experts.py),
        #: laid out like the KV cache; the decode graphs capture its recording
        self.routed_experts = None
        if routed_experts:
            from slime.backends.embedded_engine.routed_experts import RoutedExperts

            shape = self.kv_cache.shape
            self.routed_experts = RoutedExperts(self.model, shape.num_slots, shape.slot_capacity, self.device)
        self.graphs = DecodeGraphs(self, enabled=cuda_graph and self.device.type == "cuda",
                                   max_batch=min(cuda_graph_max_bs or num_slots, num_slots), sizes=cuda_graph_bs)
        #: the model's own multi-token-prediction layer when it drafts (``--speculative-algorithm NEXTN``,
        #: ``mtp.MTPLayer``): its weights are the model's ``model.layers.{num_hidden_layers}.*`` and
        #: every weight update by those names reaches it
        self.mtp = None
        self.graphs.capture_ahead()  # every batch size's decode graph, before the first request (CUDA)

    def _resolve_dtype(self, dtype: str) -> torch.dtype:
        if dtype == "auto":
            return torch.bfloat16 if self.device.type == "cuda" else torch.float32
        if dtype not in DTYPES:
            raise ValueError(f"--dtype {dtype!r} is not supported; choose auto or one of {sorted(DTYPES)}")
        return DTYPES[dtype]

    def _quantize(self, quantization: str | None, gemm_backend: str):
        """``--quantization fp8`` / ``w8a8_fp8``: the decoder's linear layers become FP8, block-wise
        (``fp8/block.py``) or per channel (``fp8/channel.py``)."""
        if quantization is None:
            return None
        from slime.backends.embedded_engine.fp8 import block as fp8
        from slime.backends.embedded_engine.fp8 import install as fp8_install

        if quantization not in fp8.QUANTIZATIONS:
            raise ValueError(f"--quantization {quantization!r} is not supported by the embedded engine; choose "
                             f"{' or '.join(fp8.QUANTIZATIONS)} (or run SGLang for its other methods)")
        per_channel = quantization == "w8a8_fp8"
        if per_channel:
            from slime.backends.embedded_engine.fp8 import channel as fp8_channel

            backend = fp8_channel.resolve_backend(gemm_backend, self.device, self.dtype)
        else:
            backend = fp8.resolve_backend(gemm_backend, self.device)
        # the absorbed MLA decode reads kv_b_proj as a matrix every step: it stays in the model dtype
        weights = fp8_install.quantize_model(self.model, backend, keep=("kv_b_proj",) if self.mla_layers else (),
                                             per_channel=per_channel)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the replaced full-precision weights
            fp8_install.warm_up(weights)  # compile the Triton GEMMs of every token count now, not inside a rollout
        return weights

    def _resolve_kv_cache(self, name: str) -> tuple[torch.dtype, tuple[list[float], list[float]] | None]:
        """``--kv-cache-dtype``: the storage dtype and, for FP8, the checkpoint's per-layer k/v scales
        (None: 1.0 everywhere, as SGLang does without them)."""
        dtype = resolve_kv_cache_dtype(name, self.dtype)
        if dtype not in FP8_DTYPES:
            return dtype, None
        if self.mla_layers or any(type(m).__name__ == "DeepseekV3Attention" for m in self.model.modules()):
            raise ValueError(f"--kv-cache-dtype {name}: an FP8 cache of multi-latent attention (DeepSeek-V3's "
                             "compressed latent) is not implemented in the embedded engine; use --kv-cache-dtype "
                             "auto for this model")
        layers = getattr(self.config, "text_config", self.config).num_hidden_layers
        scales = read_kv_scales(self.model_path, layers)
        if scales is not None:
            logger.info("KV cache scales from the checkpoint: k %s, v %s", scales[0], scales[1])
        return dtype, scales

    def _new_cache(self, shape: CacheShape, allocate: bool = True) -> SlotKVCache:
        k_scales, v_scales = self.kv_scales or (None, None)
        return SlotKVCache(shape, self.kv_cache_dtype, self.device, allocate=allocate, compute_dtype=self.dtype,
                           k_scales=k_scales, v_scales=v_scales, saver=self.saver)

    def _resolve_attention_backend(self, requested: str | None) -> str:
        from slime.backends.embedded_engine.kernels import triton_attention

        if requested is None:
            return "triton" if triton_attention.available(self.device) else "torch_native"
        if requested == "triton" and not triton_attention.available(self.device):
            raise ValueError("--attention-backend triton needs --device cuda and the triton package; "
                             "use --attention-backend torch_native")
        if requested not in ("triton", "torch_native"):
            raise ValueError(f"--attention-backend {requested!r} is not supported; choose triton or torch_native")
        return requested

    # ------------------------------------------------------------------ the KV cache, sized by demand
    #: slots start this long and grow (to what the request needs, at least 1.25x, in steps of
    #: SLOT_GRANULARITY tokens, up to the context length) when a request needs more
    INITIAL_SLOT_CAPACITY = 512
    SLOT_GRANULARITY = 256
    #: without --context-length, how long a request that gives no max_new_tokens may grow
    OPEN_REQUEST_LENGTH = 4096
    #: device memory a growing cache leaves free for activations (prefill logits, sampling)
    GROWTH_RESERVE_BYTES = 2 << 30

    def _plan_cache(self, context_length: int | None, mem_fraction_static: float | None,
                    max_total_tokens: int | None) -> None:
        """The limits the cache lives within: the longest request (``context_length``), the KV token
        budget (from ``mem_fraction_static`` after the weights, and/or ``max_total_tokens``; None = no
        limit) and the length a request without ``max_new_tokens`` gets (``open_length``).

        The cache itself holds ``max_slots`` slots of what the requests so far needed, not the
        budget: a rollout of 128 x 272-token requests takes 128 x 512 tokens of KV whatever the
        model's context, which leaves a colocated trainer the rest of the device (docs/loop.md)."""
        model_context = self.context_length
        explicit = context_length is not None
        self.context_length = min(context_length or model_context, model_context)
        budget = max_total_tokens
        if self.device.type == "cuda" and mem_fraction_static:
            free, total = torch.cuda.mem_get_info(self.device)
            if self.linear_state is not None:  # every slot's linear-attention state comes out of the same budget
                free -= self.max_slots * self.linear_state.bytes_per_slot(self.dtype)
            tokens = kv_tokens_for_memory(free, total, mem_fraction_static, self._bytes_per_token())
            if tokens < min(self.context_length, self.INITIAL_SLOT_CAPACITY) or explicit and tokens < self.context_length:
                raise ValueError(f"--mem-fraction-static {mem_fraction_static} leaves room for {max(tokens, 0)} KV "
                                 f"tokens, fewer than one request of {self.context_length}; raise it or lower "
                                 "--context-length")
            budget = min(tokens, budget or tokens)
        if budget is not None and budget < self.context_length:
            if explicit:
                raise ValueError(f"--max-total-tokens {budget} is smaller than one request of --context-length "
                                 f"{self.context_length}; raise it or lower --context-length")
            self.context_length = budget  # a request must fit one slot
        self.kv_token_budget = budget
        self.open_length = self.context_length if explicit else min(self.context_length, self.OPEN_REQUEST_LENGTH)

    def _bytes_per_token(self) -> int:
        return self._shape(1, 1).bytes_per_token(self.kv_cache_dtype)

    def _initial_capacity(self) -> int:
        return min(self.context_length, self.INITIAL_SLOT_CAPACITY)

    def _shape(self, capacity: int, num_slots: int | None = None) -> CacheShape:
        """``num_slots`` (default: as many of ``max_slots`` as the budget allows) slots of ``capacity``."""
        text_config = getattr(self.config, "text_config", self.config)
        if num_slots is None:
            num_slots = self.max_slots
            if self.kv_token_budget is not None:
                num_slots = max(1, min(num_slots, self.kv_token_budget // capacity))
        kv_heads, key_dim, value_dim = self._geometry
        linear = self.linear_state
        kv_layers = None if linear is None else tuple(i for i in range(text_config.num_hidden_layers)
                                                      if i not in linear.layers)
        return CacheShape(num_layers=text_config.num_hidden_layers, num_kv_heads=kv_heads, head_dim=key_dim,
                          num_slots=num_slots, slot_capacity=capacity, value_dim=value_dim, kv_layers=kv_layers,
                          linear=linear)

    def grow_cache(self, need: int) -> bool:
        """Lengthen the slots so that a request of ``need`` tokens fits (capped at the context length);
        the cache must be empty (nothing running). Fewer slots
        may result when the budget, or on CUDA the free memory, cannot hold as many long slots.
        Returns whether the shape changed."""
        current = self.kv_cache.shape.slot_capacity
        if need <= current:
            return False
        if need > self.context_length:
            raise ValueError(f"a request of {need} tokens does not fit the context length {self.context_length}")
        step = self.SLOT_GRANULARITY  # at least 1.25x longer, so that a growing workload regrows rarely
        capacity = min(-(-max(need, current * 5 // 4) // step) * step, self.context_length)
        resident = self.kv_cache.allocated
        self.graphs.clear()  # captured against the old buffers
        self.kv_cache.release()
        shape = self._shape(capacity)
        if self.device.type == "cuda" and resident:
            free, _ = torch.cuda.mem_get_info(self.device)
            fits = int(max(free - self.GROWTH_RESERVE_BYTES, 0) // (shape.bytes_per_token(self.kv_cache_dtype) * capacity))
            if fits < shape.num_slots:
                logger.warning("growing the KV cache to %d-token slots: free device memory holds %d of %d slots",
                               capacity, max(fits, 1), shape.num_slots)
                shape = self._shape(capacity, max(1, fits))
        self.kv_cache = self._new_cache(shape, allocate=resident)
        if self.routed_experts is not None:
            self.routed_experts.resize(shape.num_slots, shape.slot_capacity)
        logger.info("KV cache grown for a %d-token request: %d slots x %d tokens, %.1f MB", need, shape.num_slots,
                    capacity, shape.num_slots * capacity * shape.bytes_per_token(self.kv_cache_dtype) / 2**20)
        self.graphs.capture_ahead()
        return True

    @torch.inference_mode()
    def _cached_geometry(self) -> tuple[int, int, int]:
        """(heads, key width, value width) of what every attention layer stores in its cache, read
        from one probe forward of a single token: the model's attention decides what it caches (a
        grouped-query layer its key/value heads, DeepSeek's MLA its compressed latent and rotary key),
        so reading it beats re-deriving it from each family's config."""
        shapes: dict[int, tuple[int, int, int]] = {}

        class _Recorder:
            is_compileable = False

            def update(self, key_states, value_states, layer_idx, *args, **kwargs):
                shapes[layer_idx] = (key_states.shape[1], key_states.shape[-1], value_states.shape[-1])
                return key_states, value_states

            def get_seq_length(self, *args, **kwargs):
                return 0

        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        mask = torch.zeros((1, 1, 1, 1), dtype=self.dtype, device=self.device)
        self.model(input_ids=ids, position_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1,
                   **{self._cache_kwarg: _Recorder()})
        geometries = set(shapes.values())
        layers = getattr(self.config, "text_config", self.config).num_hidden_layers
        layers -= len(self.linear_state.layers) if self.linear_state is not None else 0  # they cache no keys/values
        if len(shapes) != layers or len(geometries) != 1:
            raise ValueError(f"{type(self.model).__name__}: the engine's slot cache needs one key/value shape in "
                             f"every layer; the layers cached {shapes} ({len(shapes)} of {layers} layers)")
        return geometries.pop()

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, slots: list[int], rows: list[ForwardRow]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Run the model on ``rows`` (row i lives in cache slot ``slots[i]``); return fp32 last-token logits
        ``[rows, vocab]`` and, per row that asked for it, fp32 logits of all its new tokens ``[n_i, vocab]``."""
        input_ids, positions, mask, view = self.row_inputs(slots, rows, self.kv_cache)
        q_len = input_ids.shape[1]
        want_all = any(r.want_all_logits for r in rows)
        with self.prefill_attention(), self._recording_experts(view.write_slots, view.write_positions, view.token_index):
            if self.vision is not None:
                logits = self.vision.prefill(rows, slots, input_ids, positions, mask, {self._cache_kwarg: view},
                                             0 if want_all else 1)
            else:
                logits = self.model(input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=True,
                                    logits_to_keep=0 if want_all else 1, **{self._cache_kwarg: view}).logits
        logits = logits.float()
        all_logits = [logits[i, q_len - len(r.tokens):] if r.want_all_logits else None for i, r in enumerate(rows)]
        return logits[:, -1], all_logits

    def forward_with_hidden(self, slots: list[int], rows: list[ForwardRow]
                            ) -> tuple[torch.Tensor, list[torch.Tensor | None], list[torch.Tensor]]:
        """:meth:`forward`, plus each row's final hidden states ``[n_i, hidden]`` (after the model's final
        norm, what its head reads: the input of a multi-token-prediction layer, as in SGLang)."""
        captured = []
        handle = self.model.get_decoder().norm.register_forward_hook(lambda module, args, out: captured.append(out))
        try:
            last, all_logits = self.forward(slots, rows)
        finally:
            handle.remove()
        hidden = captured[-1]
        q_len = hidden.shape[1]
        return last, all_logits, [hidden[i, q_len - len(r.tokens):] for i, r in enumerate(rows)]

    def row_inputs(self, slots: list[int], rows: list[ForwardRow], cache: SlotKVCache
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, SlotCacheView]:
        """Device inputs of a forward over ``rows`` (left-padded to a common length) in ``cache``'s slots
        ``slots``: token ids and positions ``[rows, q]``, the additive mask and the cache view."""
        q_len = max(len(r.tokens) for r in rows)
        pads = [q_len - len(r.tokens) for r in rows]
        # Built as Python lists and converted once: per-row tensor ops dominate small decode steps.
        input_ids = torch.tensor([[0] * pad + r.tokens for pad, r in zip(pads, rows)], dtype=torch.long)
        positions = torch.tensor([[0] * pad + list(range(r.start, r.start + len(r.tokens))) for pad, r in zip(pads, rows)],
                                 dtype=torch.long)
        valid = torch.tensor([[False] * pad + [True] * len(r.tokens) for pad, r in zip(pads, rows)], dtype=torch.bool)
        # where each real token is (flat query index) and goes (slot, position): integer indices built
        # here, so the layers' cache writes need no device->host count of a boolean mask
        token_index = torch.tensor([i * q_len + pad + j for i, (pad, r) in enumerate(zip(pads, rows))
                                    for j in range(len(r.tokens))], dtype=torch.long)
        write_slots = torch.tensor([slot for slot, r in zip(slots, rows) for _ in r.tokens], dtype=torch.long)
        write_positions = torch.tensor([r.start + j for r in rows for j in range(len(r.tokens))], dtype=torch.long)
        kv_length = max(r.start + len(r.tokens) for r in rows)
        # from pinned memory on CUDA: a copy from pageable memory may wait for the kernels queued before it
        # (a draft model's or MTP layer's chained steps queue their forwards without reading the drafts)
        pin = self.device.type == "cuda"
        input_ids, positions, valid, token_index, write_slots, write_positions = (
            (t.pin_memory() if pin else t).to(self.device, non_blocking=True)
            for t in (input_ids, positions, valid, token_index, write_slots, write_positions))
        mask = self._attention_mask(positions, valid, kv_length)
        rows_meta = [(slot, r.start, len(r.tokens)) for slot, r in zip(slots, rows)]
        view = SlotCacheView(cache, slots, token_index, write_slots, write_positions, kv_length, rows_meta)
        return input_ids, positions, mask, view

    def prefill_attention(self):
        """SDPA kernels for prefill on CUDA: flash or memory-efficient, not cuDNN, which builds a plan
        for every new (rows, query length, key length) — 385 ms per new shape on an H200 for a 0.6B
        model, and a rollout's prefills rarely repeat a shape."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    @torch.inference_mode()
    def decode(self, tokens: list[int] | torch.Tensor, positions: list[int]) -> torch.Tensor:
        """One decode step of the running batch, which sits in slots ``0 .. B-1``: row i feeds
        ``tokens[i]`` (a host list, or ids on the device) at absolute position ``positions[i]``.
        Returns fp32 logits ``[B, vocab]``.

        On CUDA the step replays a CUDA graph captured for (batch bucket, KV-length bucket); the
        padding rows of a bucket use free slots (``B .. bucket-1``), whose contents nobody reads.
        """
        return self.graphs.run(tokens, positions)

    @torch.inference_mode()
    def decode_next(self, tokens: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """The decode step right after a graph step of the same rows, fed from the device (see
        :meth:`DecodeGraphs.run_next`): the engine launches it before reading the previous step's results."""
        return self.graphs.run_next(tokens, positions)

    def can_verify(self, starts: list[int], tokens: int) -> bool:
        """Whether a verify step of ``tokens`` tokens a row, the rows (the running batch, slots 0..B-1)
        starting at ``starts``, runs as a decode step (:meth:`verify`): a model whose attention takes
        it (GQA/MHA, and multi-latent attention through its absorbed decode; not ``--mla-decode
        expanded``) and every token,
        padding included, inside its slot (no write past a slot's capacity)."""
        return self.verify_decode and max(starts) + tokens <= self.kv_cache.shape.slot_capacity

    @torch.inference_mode()
    def verify(self, tokens: list[list[int]], starts: list[int], with_hidden: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A speculative verify step as a decode step of ``T`` tokens a row (:meth:`decode_forward`):
        row i (slot i) feeds ``tokens[i]`` (``T`` each, padding included) from position ``starts[i]``.
        Returns fp32 logits ``[B, T, vocab]`` and, ``with_hidden``, the final hidden states ``[B, T,
        hidden]``; on CUDA from a graph (:meth:`DecodeGraphs.run_verify`): read them before the next step."""
        return self.graphs.run_verify(tokens, starts, with_hidden)

    @property
    def kernel_attention(self) -> bool:
        """Whether decode and verify steps attend through the flash-decoding kernel (``--attention-backend triton``
        and heads it takes), which reads each row only to its own length: their CUDA graphs then do not depend on
        the rows' lengths (one per batch size, :class:`DecodeGraphs`)."""
        _, key_dim, value_dim = self._geometry
        return self.attention_backend == "triton" and attention.triton_kernel_fits(key_dim, value_dim)

    def decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_length: int,
                       out: torch.Tensor | None = None, hidden_out: torch.Tensor | None = None) -> torch.Tensor:
        """The decode forward on device tensors ``[B, T]`` (no host syncs: capturable): row b is slot b
        and feeds ``T`` tokens at ``positions[b]`` (consecutive; a verify step's last token and drafts, T
        = 1 in a decode step), each attending to its slot up to its own position. Returns fp32 logits
        ``[B, vocab]`` for ``T = 1``, else ``[B, T, vocab]``; they go to ``out`` when given (a CUDA graph's
        output buffer: the model-dtype logits are cast in that one copy, not copied twice). ``hidden_out``
        (``[B, T, hidden]``) receives the final hidden states (after the model's final norm, what a
        multi-token-prediction layer reads: :meth:`forward_with_hidden`)."""
        batch, tokens = input_ids.shape
        key_pos = torch.arange(kv_length, device=self.device).view(1, 1, 1, -1)
        mask = torch.zeros((batch, 1, tokens, kv_length), dtype=self.dtype, device=self.device)
        mask.masked_fill_(key_pos > positions.view(batch, 1, tokens, 1), torch.finfo(self.dtype).min)
        rows = torch.arange(batch, device=self.device)
        kernel = self.kernel_attention
        view = DecodeCacheView(self.kv_cache, rows, positions.reshape(-1), kv_length, raw=kernel, tokens=tokens)
        extra = {self._cache_kwarg: view}
        if tokens > 1:  # the attention's decode path for several tokens a row (not prefill's SDPA)
            extra["slot_decode"] = True
        if self.attention_backend == "triton":  # per-row lengths for the flash-decoding kernel
            extra["slot_lengths"] = positions[:, -1] + 1
        if kernel and self.kv_cache.quantized:  # it reads the stored FP8 rows and scales them itself
            extra["slot_kv_scales"] = (self.kv_cache.k_scales, self.kv_cache.v_scales)
        handle = None
        if hidden_out is not None:
            handle = self.model.get_decoder().norm.register_forward_hook(
                lambda module, args, output: hidden_out.copy_(output))
        try:
            with self._recording_experts(view.slots, view.positions):  # each token's slot and position
                rotary = positions if self.vision is None else self.vision.decode_positions(positions)
                logits = self.model(input_ids=input_ids, position_ids=rotary, attention_mask=mask, use_cache=True,
                                    logits_to_keep=1 if tokens == 1 else 0, **extra).logits
        finally:
            if handle is not None:
                handle.remove()
        logits = logits[:, -1] if tokens == 1 else logits
        return logits.float() if out is None else out.copy_(logits)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Move a request's per-slot state — its KV cache rows and, with ``--enable-return-routed-experts``,
        its routed experts — from slot ``src`` to ``dst`` (the scheduler compacting the running batch)."""
        self.kv_cache.move_slot(src, dst, length)
        if self.routed_experts is not None:
            self.routed_experts.move_slot(src, dst, length)
        if self.vision is not None:
            self.vision.move_slot(src, dst)

    def copy_slots(self, srcs: list[int], dsts: list[int], length: int) -> None:
        """Copy the first ``length`` positions of per-slot state from ``srcs`` to ``dsts`` (a shared prefill)."""
        self.kv_cache.copy_slots(srcs, dsts, length)
        if self.routed_experts is not None:
            self.routed_experts.copy_slots(srcs, dsts, length)
        if self.vision is not None:
            self.vision.copy_slots(srcs, dsts)

    def _recording_experts(self, slots: torch.Tensor, positions: torch.Tensor, token_index: torch.Tensor | None = None):
        """Around a forward: its routers' choices go to (slot, position) (nothing without the flag)."""
        if self.routed_experts is None:
            return contextlib.nullcontext()
        return self.routed_experts.writing(slots, positions, token_index)

    @contextlib.contextmanager
    def linear_state_kept(self, rows: int):
        """Around a CUDA graph capture, whose warm-up forwards run the step for real: the first ``rows`` slots'
        linear-attention states put back as they were, so that the replay advances them once (keys and values
        are rewritten to the same places; a recurrent state would move on with every run)."""
        buffers = self.kv_cache.state_buffers()
        saved = [buf[:rows].clone() for buf in buffers]
        try:
            yield
        finally:
            for buf, old in zip(buffers, saved):
                buf[:rows].copy_(old)

    @contextlib.contextmanager
    def capturable_experts(self):
        """Around a CUDA graph capture: MoE experts through ``batched_mm`` when the model's own
        ``grouped_mm`` would not capture. torch's grouped GEMM has a CUDA kernel for bfloat16 only; in
        any other dtype it falls back to a loop that copies the group offsets to the host, which a
        capture refuses (the fp32 engine on CUDA failed its first MoE decode graph that way).
        ``batched_mm`` (the token's expert weights gathered, one batched GEMM) has no host step; it is
        used only inside the decode/verify graphs, whose batches are small, and prefill keeps grouped_mm."""
        current = getattr(self.config, "_experts_implementation", None)
        if current != "grouped_mm" or self.dtype == torch.bfloat16 or not self.has_experts:
            yield
            return
        self.model.set_experts_implementation("batched_mm")
        try:
            yield
        finally:
            self.model.set_experts_implementation(current)

    @functools.cached_property
    def has_experts(self) -> bool:
        """Whether the model has MoE expert modules dispatching by ``config._experts_implementation``
        (classes under transformers' ``use_experts_implementation``, which sets ``has_gate``, ``has_bias``
        and ``is_transposed`` on them in every 5.x release; ``_is_expert_parallel`` came later, 5.17 lacks it)."""
        return any(all(hasattr(m, a) for a in ("has_gate", "has_bias", "is_transposed")) for m in self.model.modules())

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
        self._check_weights_mapped("updated")
        params = dict(self.model.named_parameters(remove_duplicate=False))
        params.update(dict(self.model.named_buffers(remove_duplicate=False)))
        count = 0
        for name, tensor in named_tensors:
            if self.mtp is not None and self.mtp.owns(name):  # model.layers.{L >= num_hidden_layers}.*
                count += self.mtp.load(name, tensor)
                continue
            if self.fp8 is not None and self.fp8.owns(name):  # quantized into its FP8 blocks
                self.fp8.load(name, tensor)
                count += 1
                continue
            target = self._named_tensor(params, name)
            if target is None:
                raise KeyError(f"weight {name!r} is not a parameter of {type(self.model).__name__} "
                               f"(e.g. {sorted(params)[:3]} ...); send HF parameter names")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r}: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            if self._unwritten:
                self._mark_written(target)
            count += 1
        return count

    def _mark_written(self, target: torch.Tensor) -> None:
        """Count ``target``'s bytes (a parameter, or a view into one: a fused projection's part, an expert)
        against the parameter whose memory holds it."""
        address = target.data_ptr()
        i = bisect.bisect_right(self._unwritten_starts, address) - 1
        if i < 0:
            return
        start = self._unwritten_starts[i]
        if start in self._unwritten and address < start + self._dropped_bytes[start]:
            self._unwritten[start] -= target.numel() * target.element_size()
            if self._unwritten[start] <= 0:
                del self._unwritten[start]

    @property
    def weights_ready(self) -> bool:
        return not self._unwritten

    @property
    def unwritten_weights(self) -> str | None:
        """Why the weights cannot be used (None when they can): released without a host backup and not all
        rewritten since the resume (a parameter counts once all its bytes were written)."""
        if not self._unwritten:
            return None
        names = [name for name, p in self.model.named_parameters() if p.data_ptr() in self._unwritten]
        return (f"the weights were released without a host backup and {len(self._unwritten)} parameter(s) were not "
                f"rewritten since the resume (e.g. {names[:3]}): send every weight after /resume_memory_occupation "
                "(the colocated update does), or start the engine with --enable-weights-cpu-backup")

    def load_from_disk(self, model_path: str) -> int:
        """Load a full HF checkpoint directory (same architecture) into the running model."""
        fresh = load_model(model_path, dtype=self.dtype)
        if type(fresh) is not type(self.model):
            raise ValueError(f"{model_path} holds a {type(fresh).__name__}, the server runs {type(self.model).__name__}")
        # transformers drops the MTP layer's weights: read them from the files (checked before anything loads).
        # A checkpoint without them (e.g. saved by transformers from the trainer, which does not train them)
        # leaves the MTP layer as it is: its drafts may go stale, the output stays the model's.
        mtp_tensors = self.mtp.read_checkpoint(model_path) if self.mtp is not None else None
        if self.mtp is not None and mtp_tensors is None:
            logger.warning("%s holds no MTP-layer tensors (%s*): the NEXTN draft layer keeps its weights",
                           model_path, self.mtp.prefix)
        count = self.load_named_tensors(fresh.state_dict().items())
        count += self.load_named_tensors((mtp_tensors or {}).items())
        self.model_path = model_path
        return count

    def get_weight(self, name: str) -> torch.Tensor:
        """A parameter or persistent buffer (e.g. DeepSeek's expert bias) by HF name; checkpoint-named
        experts read their slice of the fused expert parameters; FP8 weights read dequantized."""
        self._check_weights_mapped("read")
        if not self.weights_ready:
            raise RuntimeError(self.unwritten_weights)
        if self.mtp is not None and self.mtp.owns(name):
            return self.mtp.get(name)
        if self.fp8 is not None and self.fp8.owns(name):
            return self.fp8.dequantized(name)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        params.update(dict(self.model.named_buffers(remove_duplicate=False)))
        tensor = self._named_tensor(params, name)
        if tensor is None:
            raise KeyError(f"no parameter named {name!r}")
        return tensor

    def _named_tensor(self, params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
        """The tensor an HF name denotes: a parameter/buffer, or a view of the fused expert or fused
        projection parameter that holds it (``kernels/fused_projections.py``)."""
        tensor = params.get(name)
        if tensor is None:
            tensor = _fused_expert_slice(params, name)
        if tensor is None and any(self.fused_projections.values()):
            tensor = fused_projections.projection_slice(self.model, name)
        return tensor

    def weight_bytes(self) -> int:
        """Bytes of the served weights: the parameters (a tied embedding once) plus FP8 values and scales."""
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if self.mtp is not None:
            total += sum(p.numel() * p.element_size() for p in self.mtp.parameters())
        if self.fp8 is not None:
            modules = [*self.fp8.linears.values(), *self.fp8.experts.values()]
            total += sum(b.numel() * b.element_size() for m in modules for b in m.buffers())
        return total

    def _check_weights_mapped(self, what: str) -> None:
        if self.saver is not None and not self.weights_on_device:
            raise RuntimeError(f"the weights cannot be {what} while released (/release_memory_occupation): "
                               "resume them first (/resume_memory_occupation with tags ['weights'])")

    def release_weights(self) -> None:
        """GPU: free the weights' device memory, content kept on the host (with the memory saver at the same
        addresses, graphs kept; without it the weights move to host memory and the graphs go); CPU: nothing."""
        if self.saver is not None and self.weights_on_device:  # (the saver exists only on CUDA)
            if self.mtp is not None and not self._mtp_adopted:  # the NEXTN layer, added after start-up
                self.graphs.clear()
                self.saver.adopt([self.mtp], keep_parameters=True)
                self._mtp_adopted = True
            torch.cuda.synchronize()
            self.saver.pause_weights()
        elif self.device.type == "cuda" and self.weights_on_device:
            self.graphs.clear()  # they point at the parameters' device memory
            self.model.to("cpu", non_blocking=True)  # into pinned host memory, reused by the next release
            if self.mtp is not None:
                self.mtp.to("cpu", non_blocking=True)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self.weights_on_device = False

    def resume_weights(self) -> None:
        if self.saver is not None and not self.weights_on_device:
            self.saver.resume_weights()
            # what the release dropped must be rewritten before the next forward (unwritten_weights); the
            # parameters are views of one allocation, so they are told apart by their address ranges
            self._dropped_bytes = {p.data_ptr(): p.numel() * p.element_size() for p in self._dropped_on_release
                                   if p.numel()}
            self._unwritten_starts = sorted(self._dropped_bytes)
            self._unwritten = dict(self._dropped_bytes)
        elif self.device.type == "cuda" and not self.weights_on_device:
            self.graphs.clear()
            self.model.to(self.device, non_blocking=True)  # from the pinned copies
            if self.mtp is not None:
                self.mtp.to(self.device, non_blocking=True)
            torch.cuda.synchronize()
        self.weights_on_device = True


def load_model(model_path: str, **kwargs):
    """The checkpoint's causal LM; a vision-language checkpoint (a ``vision_config``) as its image-text model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    if is_vision_language(AutoConfig.from_pretrained(model_path)):
        return AutoModelForImageTextToText.from_pretrained(model_path, **kwargs)
    return AutoModelForCausalLM.from_pretrained(model_path, **kwargs)


def _refuse_sliding_windows(model: torch.nn.Module, model_path: str) -> None:
    """The engine's attention (its masks, the flash-decoding kernel, the slot cache) lets every token see every
    earlier one; a layer with a sliding window (Mistral, Gemma 2/3, GPT-OSS, Qwen2/3 with use_sliding_window) would
    be served wrong without a word, so such a checkpoint is refused at load."""
    windows = {name: module.sliding_window for name, module in model.named_modules()
               if name.endswith("self_attn") and getattr(module, "sliding_window", None)}
    if windows:
        first = next(iter(windows))
        raise ValueError(f"{model_path}: {len(windows)} attention layers use a sliding window ({first}: "
                         f"{windows[first]} tokens), which the embedded engine does not implement (it would attend "
                         "to every cached token); serve this model with --rollout-backend sglang")


def kv_tokens_for_memory(free: int, total: int, mem_fraction_static: float, bytes_per_token: int) -> int:
    """KV tokens ``--mem-fraction-static`` leaves after what is in use (weights, ...): the budget's bytes
    over one token's bytes in the cache's dtype, so an FP8 cache holds twice a bf16 one's tokens."""
    return int((total * mem_fraction_static - (total - free)) // bytes_per_token)


_CHECKPOINT_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _fused_expert_slice(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The part of a fused expert parameter that a checkpoint-named expert tensor fills: transformers 5
    keeps a layer's experts as ``experts.gate_up_proj [E, 2·I, H]`` (per expert ``[gate; up]``) and
    ``experts.down_proj [E, H, I]``, while checkpoints and SGLang name them ``experts.{e}.gate_proj.weight``
    etc. None when ``name`` is not such a tensor of this model."""
    match = _CHECKPOINT_EXPERT.match(name)
    if match is None:
        return None
    prefix, expert, kind = match.group(1), int(match.group(2)), match.group(3)
    if kind == "down_proj":
        fused = params.get(f"{prefix}.down_proj")
        return None if fused is None or expert >= fused.shape[0] else fused[expert]
    fused = params.get(f"{prefix}.gate_up_proj")
    if fused is None or expert >= fused.shape[0]:
        return None
    half = fused.shape[1] // 2
    return fused[expert, :half] if kind == "gate_proj" else fused[expert, half:]
