"""Preallocated key/value cache: one fixed-size row ("slot") per running request.

Layout per layer: ``keys[layer]`` of shape ``[num_slots, num_kv_heads, slot_capacity, head_dim]`` and
``values[layer]`` of ``[num_slots, num_kv_heads, slot_capacity, value_dim]``. The model runner sizes
the slots by demand: they start short and are reallocated longer (while nothing runs) when a request
needs more. What a "key" and a "value" are is the model's choice (whatever its attention hands to
``Cache.update``): per-head keys and values for multi-head / grouped-query attention; for DeepSeek's
multi-latent attention one shared "head" holding the compressed latent (``kv_lora_rank`` wide) as
the key and the rotary key (``qk_rope_head_dim`` wide) as the value, which the layer expands itself. The running
batch always occupies slots ``0 .. batch_size-1`` contiguously, so a decode step reads the cache as
a *view* ``keys[layer][:batch_size, :, :max_len]`` (no gather); when a request leaves, the last
row is copied into its slot (one row copy, see :meth:`SlotKVCache.move_slot`).

Hybrid models (Qwen3.5, Qwen3-Next) cache keys/values only in their softmax-attention layers
(``CacheShape.kv_layers``; the other layers' buffers are empty); their gated-DeltaNet layers keep a
fixed-size state per slot instead (``CacheShape.linear``: the convolution's last inputs and the
delta-rule memory, :mod:`.linear_attention`), which moves and is copied with the slot.

Token accounting (``max_total_tokens``) is the scheduler's job; this module only holds memory.

Storage dtype (``--kv-cache-dtype``, SGLang's flag and names): the buffers' dtype is the single source of
truth. For FP8 (``fp8_e4m3`` = ``torch.float8_e4m3fn``, ``fp8_e5m2``) every write stores
``clamp(x / scale, ±max finite)`` in that dtype (:func:`quantize`: saturated, so an outlier becomes
±448 / ±57344, never inf or NaN) and every read is ``stored.to(compute dtype) * scale``
(:func:`dequantize`), with one ``k_scale`` and one ``v_scale`` per layer (1.0 unless the checkpoint
carries SGLang's ``self_attn.k_scale`` / ``v_scale``, :func:`read_kv_scales`). A token then takes
half the bytes of bf16, so the same memory budget holds twice the tokens.

:class:`SlotCacheView` adapts the buffers to the ``Cache.update`` call that Hugging Face attention
layers make: it writes the new keys/values of each row at that row's own positions and returns the
cache rows of the step, whose padded/unused positions the caller masks out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from slime.backends.embedded_engine.linear_attention import LinearStateShape

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the decode writes are two index_puts
    triton = None


#: ``--kv-cache-dtype`` values (SGLang's names) -> storage dtype; ``auto`` is the model's ``--dtype``
KV_CACHE_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: the CPU decode step's KV write as one ``index_copy_`` per buffer with a flat row index (False: two
#: ``index_put`` with the slot and position indices, as before; bench A/B switch)
CPU_INDEX_COPY = True


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype ``--kv-cache-dtype name`` asks for; ValueError naming the flag otherwise."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not supported by the embedded engine; choose auto, "
                         f"{', '.join(KV_CACHE_DTYPES)} (SGLang's fp4/mxfp8 caches are not implemented: "
                         "use --rollout-backend sglang for them)")
    return KV_CACHE_DTYPES[name]


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as stored in a cache of ``dtype``: FP8 multiplies by ``1 / scale`` (in fp32, as the Triton
    write kernels do, so every write path stores the same bits whatever the scale) and saturates to the
    format's finite range (torch's own cast overflows to inf for e5m2; for e4m3 it saturated on the CPU we
    tried, which nothing promises for other paths: clamping first makes every write path, Triton's
    included, agree); others just cast."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    x = x.float() if scale == 1.0 else x.float() * (1.0 / scale)
    return x.clamp(-limit, limit).to(dtype)


def dequantize(stored: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cached values in the compute ``dtype``: FP8 times ``scale``; anything else as it is."""
    if stored.dtype not in FP8_DTYPES:
        return stored
    out = stored.to(dtype)
    return out if scale == 1.0 else out * scale


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 buffer as ``uint8`` (same storage, same bits) for indexed reads and writes: torch's
    index/index_put kernels do not take FP8 on every device and version; others as they are."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def read_kv_scales(model_path: str, num_layers: int) -> tuple[list[float], list[float]] | None:
    """Per-layer ``(k_scales, v_scales)`` from an HF checkpoint's safetensors files, under the names SGLang
    loads: ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` (also ``...self_attn.k_proj.k_scale``,
    ModelOpt's spelling, and the deprecated ``...self_attn.kv_scale`` for both). None when the files
    hold none; a layer without its scale keeps 1.0."""
    import re
    from pathlib import Path

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    pattern = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:[kv]_proj\.)?(k_scale|v_scale|kv_scale)$")
    scales = {"k_scale": [1.0] * num_layers, "v_scale": [1.0] * num_layers}
    found = False
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                match = pattern.match(name)
                if match is None or int(match.group(1)) >= num_layers:
                    continue
                layer, kind = int(match.group(1)), match.group(2)
                value = float(f.get_tensor(name).float().reshape(-1)[0])
                if not value > 0 or value == float("inf"):
                    raise ValueError(f"{model_path}: KV cache scale {name} = {value}; it must be a positive number")
                for target in (("k_scale", "v_scale") if kind == "kv_scale" else (kind,)):
                    scales[target][layer] = value
                found = True
    return (scales["k_scale"], scales["v_scale"]) if found else None


@dataclass(frozen=True)
class CacheShape:
    """Geometry of the cache buffers (one entry per attention layer)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int  # width of a cached key
    num_slots: int
    slot_capacity: int  # tokens one request can hold (prompt + output), <= context length
    value_dim: int | None = None  # width of a cached value (None: head_dim)
    kv_layers: tuple[int, ...] | None = None  # the layers that cache keys/values (None: all)
    linear: LinearStateShape | None = None  # per-slot state of the linear-attention layers

    @property
    def value_width(self) -> int:
        return self.head_dim if self.value_dim is None else self.value_dim

    @property
    def cached_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers)) if self.kv_layers is None else self.kv_layers

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        width = self.head_dim + self.value_width
        return len(self.cached_layers) * self.num_kv_heads * width * dtype.itemsize


class SlotKVCache:
    """The preallocated buffers. ``release()``/``allocate()`` free and restore them (memory saver).

    ``dtype`` is what the buffers store; ``compute_dtype`` (default: ``dtype``) what reads hand the
    attention; ``k_scales`` / ``v_scales`` (one per layer, default 1.0) what FP8 values are multiplied by."""

    def __init__(self, shape: CacheShape, dtype: torch.dtype, device: torch.device, allocate: bool = True,
                 compute_dtype: torch.dtype | None = None, k_scales: list[float] | None = None,
                 v_scales: list[float] | None = None, saver=None):
        self.shape = shape
        #: memory_saver.MemorySaver (--enable-memory-saver): release() unmaps the buffers' device memory and
        #: allocate() maps it back at the same addresses, so CUDA graphs captured against them stay valid
        self.saver = saver
        self.tag = saver.new_kv_tag() if saver is not None else None
        self.paused = False
        self.dtype = dtype
        self.compute_dtype = compute_dtype or dtype
        self.quantized = dtype in FP8_DTYPES
        self.k_scales = list(k_scales) if k_scales is not None else [1.0] * shape.num_layers
        self.v_scales = list(v_scales) if v_scales is not None else [1.0] * shape.num_layers
        if len(self.k_scales) != shape.num_layers or len(self.v_scales) != shape.num_layers:
            raise ValueError(f"KV cache scales: {len(self.k_scales)}/{len(self.v_scales)} given for "
                             f"{shape.num_layers} layers")
        self.device = device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        #: per layer (None for softmax-attention layers): the linear-attention state of each slot
        self.conv_states: list[torch.Tensor | None] = []
        self.recurrent_states: list[torch.Tensor | None] = []
        self._flats: list[torch.Tensor] = []  # under the memory saver: the allocations every buffer views
        if allocate:
            self.allocate()

    @property
    def allocated(self) -> bool:
        return bool(self.keys) and not self.paused

    def allocate(self) -> None:
        if self.allocated:
            return
        if self.paused:  # the same addresses, fresh memory: zeroed as a new cache is
            self.saver.resume(self.tag)
            self.paused = False
            for flat in self._flats:
                flat.zero_()
            return
        s = self.shape
        keys = (s.num_slots, s.num_kv_heads, s.slot_capacity, s.head_dim)
        values = (s.num_slots, s.num_kv_heads, s.slot_capacity, s.value_width)
        cached = set(s.cached_layers)
        linear = s.linear
        conv = (s.num_slots, linear.conv_dim, linear.conv_width) if linear else None
        recurrent = (s.num_slots, linear.value_heads, linear.key_dim, linear.value_dim) if linear else None
        state_layers = set(linear.layers) if linear else set()
        layers = s.num_layers
        key_sizes = [math.prod(keys) if i in cached else 0 for i in range(layers)]
        value_sizes = [math.prod(values) if i in cached else 0 for i in range(layers)]
        conv_sizes = [math.prod(conv) if i in state_layers else 0 for i in range(layers)]
        recurrent_sizes = [math.prod(recurrent) if i in state_layers else 0 for i in range(layers)]
        kv_parts = self._allocate(key_sizes + value_sizes, self.dtype)
        conv_parts = self._allocate(conv_sizes, self.compute_dtype)  # not FP8: the convolution reads them as they are
        recurrent_parts = self._allocate(recurrent_sizes, torch.float32)  # the delta rule's fp32 memory
        empty_keys, empty_values = (s.num_slots, s.num_kv_heads, 0, s.head_dim), (s.num_slots, s.num_kv_heads, 0, s.value_width)
        self.keys = [kv_parts[i].view(keys if i in cached else empty_keys) for i in range(layers)]
        self.values = [kv_parts[layers + i].view(values if i in cached else empty_values) for i in range(layers)]
        self.conv_states = [conv_parts[i].view(conv) if i in state_layers else None for i in range(layers)]
        self.recurrent_states = [recurrent_parts[i].view(recurrent) if i in state_layers else None for i in range(layers)]

    def _allocate(self, sizes: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
        """Zeroed buffers of ``sizes`` elements: views of one allocation under the memory saver (a release and a
        resume unmap / map it in one call, and the resume zeroes it with one kernel), plain tensors otherwise."""
        if self.saver is None or not sum(sizes):
            return [torch.zeros(n, dtype=dtype, device=self.device) for n in sizes]
        with self.saver.region(self.tag, keep_content=False):
            flat = torch.zeros(sum(sizes), dtype=dtype, device=self.device)
        self._flats.append(flat)
        return list(torch.split(flat, sizes))

    def state_buffers(self) -> list[torch.Tensor]:
        """The linear-attention layers' per-slot states (conv and recurrent buffers, ``[slots, ...]`` each)."""
        return [t for t in self.conv_states + self.recurrent_states if t is not None]

    def read(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of layer ``layer``'s buffers as the attention computes with them (FP8: dequantized copies)."""
        if not self.quantized:
            return keys, values
        return (dequantize(keys, self.compute_dtype, self.k_scales[layer]),
                dequantize(values, self.compute_dtype, self.v_scales[layer]))

    def release(self) -> None:
        if self.saver is not None and self.keys:
            if not self.paused:
                self.saver.pause(self.tag)  # the device memory is free; the tensors keep their addresses
                self.paused = True
            return
        self.keys, self.values, self.conv_states, self.recurrent_states = [], [], [], []
        if self.device.type == "cuda":
            # Hand the freed blocks back to the driver, or other processes (and mem_get_info) never see them.
            torch.cuda.empty_cache()

    def nbytes(self) -> int:
        """Device bytes the buffers hold now (0 while released)."""
        if self.paused:
            return 0
        return sum(t.numel() * t.element_size() for t in self.keys + self.values + self.state_buffers())

    def copy_slots(self, srcs: list[int], dsts: list[int], length: int) -> None:
        """Copy the first ``length`` positions of each slot ``srcs[i]`` into ``dsts[i]`` (one indexed
        copy per buffer: requests sharing a prompt take the prefilled one's keys and values)."""
        if not srcs or length == 0:
            return
        src = torch.tensor(srcs, dtype=torch.long, device=self.device)
        dst = torch.tensor(dsts, dtype=torch.long, device=self.device)
        for buf in self.keys + self.values:
            data = as_bytes(buf)
            data[dst, :, :length] = data[src, :, :length]
        for buf in self.state_buffers():  # a linear-attention state is the whole prefix's, whatever its length
            buf[dst] = buf[src]

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst`` (batch compaction)."""
        if src == dst or length == 0:
            return
        for buf in self.keys + self.values:
            buf[dst, :, :length].copy_(buf[src, :, :length])
        for buf in self.state_buffers():
            buf[dst].copy_(buf[src])


class SlotCacheView:
    """What one forward pass sees: the cache slots ``slots`` (row i of the batch is ``slots[i]``).

    The rows are left-padded to a common query length ``q``; ``token_index`` (1-D, into the
    flattened ``[rows * q]`` query positions) picks the real tokens, and ``write_slots`` /
    ``write_positions`` (one per real token) say where each one's key and value go. All three are
    integer tensors the caller builds on the host, so that no layer waits for the device to count
    a boolean mask. ``kv_length`` is how many cache positions the attention reads. Consecutive
    slots (the decode batch) are read as a view; other sets are gathered.
    """

    #: a prefill forward: linear-attention layers run row by row (linear_attention.py)
    decode_rows = None

    def __init__(self, cache: SlotKVCache, slots: list[int], token_index: torch.Tensor, write_slots: torch.Tensor,
                 write_positions: torch.Tensor, kv_length: int, rows_meta: list[tuple[int, int, int]] | None = None):
        self.cache = cache
        #: (slot, first position, new tokens) of each row, on the host: what the linear-attention layers read
        self.rows_meta = rows_meta
        self.kv_length = kv_length
        contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        self.read_rows = (slice(slots[0], slots[0] + len(slots)) if contiguous
                          else torch.tensor(slots, dtype=torch.long, device=token_index.device))
        self.token_index = token_index
        self.write_slots = write_slots
        self.write_positions = write_positions
        self.is_compileable = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store the step's keys/values ([rows, heads, q, dim]) and return the cache rows to attend to."""
        cache = self.cache
        for new, buf, scale in ((key_states, cache.keys[layer_idx], cache.k_scales[layer_idx]),
                                (value_states, cache.values[layer_idx], cache.v_scales[layer_idx])):
            rows, heads, q_len, dim = new.shape
            # [rows, heads, q, dim] -> [rows * q, heads, dim] -> real tokens [n, heads, dim]
            tokens = new.transpose(1, 2).reshape(rows * q_len, heads, dim).index_select(0, self.token_index)
            as_bytes(buf)[self.write_slots, :, self.write_positions] = as_bytes(quantize(tokens, buf.dtype, scale))
        keys, values = cache.keys[layer_idx], cache.values[layer_idx]
        return cache.read(layer_idx, as_bytes(keys)[self.read_rows, :, : self.kv_length].view(keys.dtype),
                          as_bytes(values)[self.read_rows, :, : self.kv_length].view(values.dtype))

    def get_seq_length(self, *args, **kwargs) -> int:  # only used when position_ids are not given
        return 0

    def linear_state(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv [slots, conv_dim, kernel - 1], recurrent [slots, Hv, Dk, Dv])`` of a linear-attention layer."""
        return self.cache.conv_states[layer_idx], self.cache.recurrent_states[layer_idx]


if triton is not None:

    @triton.jit
    def _decode_write_kernel(key_ptr, value_ptr, keys_ptr, values_ptr, slots_ptr, positions_ptr,
                             sk_b, sk_h, sv_b, sv_h, sks_slot, sks_h, sks_pos, svs_slot, svs_h, svs_pos,
                             key_dim, value_dim, k_inv_scale, v_inv_scale, limit, KEY_BLOCK: tl.constexpr,
                             VALUE_BLOCK: tl.constexpr, SATURATE: tl.constexpr):
        # program (row, head): key [row, head, :] -> keys[slot, head, position, :], and the value likewise;
        # an FP8 cache (SATURATE) stores clamp(x / scale, ±limit)
        row = tl.program_id(0)
        head = tl.program_id(1)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        position = tl.load(positions_ptr + row).to(tl.int64)
        offs_k = tl.arange(0, KEY_BLOCK)
        key = tl.load(key_ptr + row * sk_b + head * sk_h + offs_k, mask=offs_k < key_dim)
        if SATURATE:
            key = tl.clamp(key.to(tl.float32) * k_inv_scale, -limit, limit)
        tl.store(keys_ptr + slot * sks_slot + head * sks_h + position * sks_pos + offs_k,
                 key.to(keys_ptr.dtype.element_ty), mask=offs_k < key_dim)
        offs_v = tl.arange(0, VALUE_BLOCK)
        value = tl.load(value_ptr + row * sv_b + head * sv_h + offs_v, mask=offs_v < value_dim)
        if SATURATE:
            value = tl.clamp(value.to(tl.float32) * v_inv_scale, -limit, limit)
        tl.store(values_ptr + slot * svs_slot + head * svs_h + position * svs_pos + offs_v,
                 value.to(values_ptr.dtype.element_ty), mask=offs_v < value_dim)


def write_decode_kv(keys: torch.Tensor, values: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    slots: torch.Tensor, positions: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """One Triton launch: ``key [B, heads, Dk]`` / ``value [B, heads, Dv]`` (last dim contiguous) into
    ``keys[slots[i], :, positions[i]]`` / ``values[...]`` of the cache buffers, cast to their dtype
    (FP8: divided by the scale and saturated, as :func:`quantize`). Equals
    ``keys[slots, :, positions] = quantize(key, keys.dtype, k_scale)`` (the torch path, two ``index_put``)."""
    batch, heads, key_dim = key.shape
    value_dim = value.shape[-1]
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _decode_write_kernel[(batch, heads)](
        key, value, keys, values, slots, positions, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        key_dim, value_dim, 1.0 / k_scale, 1.0 / v_scale, torch.finfo(keys.dtype).max,
        KEY_BLOCK=triton.next_power_of_2(key_dim), VALUE_BLOCK=triton.next_power_of_2(value_dim),
        SATURATE=keys.dtype in FP8_DTYPES, num_warps=1)


class DecodeCacheView:
    """One decode step over the running batch in slots ``0 .. B-1``: row i writes its ``tokens`` new
    keys/values (1 in a decode step, ``k + 1`` in a verify step) at ``positions[i * tokens + t]`` and
    reads the first ``kv_length`` positions of its slot.

    Unlike :class:`SlotCacheView` there is no boolean indexing (which waits for the device to count
    the selected elements): the writes use fixed-size index tensors, so the whole step runs without a
    host sync and can be captured in a CUDA graph. On CUDA with Triton they are one kernel per layer
    (:func:`write_decode_kv`, keys and values together); elsewhere two ``index_put``.

    Reads of an FP8 cache are dequantized copies (:meth:`SlotKVCache.read`) unless ``raw``: then the
    stored FP8 rows are returned as views, for the flash-decoding kernel, which dequantizes as it loads.
    """

    def __init__(self, cache: SlotKVCache, rows: torch.Tensor, positions: torch.Tensor, kv_length: int,
                 raw: bool = False, tokens: int = 1):
        self.cache = cache
        self.rows = rows  # [B] slot of each row (0..B-1)
        self.positions = positions  # [B * tokens] absolute position of each new token, row by row
        self.kv_length = kv_length
        self.batch = int(rows.shape[0])
        self.tokens = tokens
        # [B * tokens] the slot of each new token (the rows themselves for one token a row; an expand,
        # not repeat_interleave, which may count its output on the host: no sync inside a CUDA graph)
        self.slots = rows if tokens == 1 else rows.view(-1, 1).expand(-1, tokens).reshape(-1)
        if positions.numel() != self.batch * tokens:
            raise ValueError(f"DecodeCacheView: {positions.numel()} positions for {self.batch} rows of {tokens} tokens")
        self.raw = raw
        self.is_compileable = False
        self._rows = None  # ((heads, capacity), flat row index) for the CPU's writes: _flat_rows
        #: linear-attention layers update the states of slots 0..B-1 in place (one token a row)
        self.decode_rows = self.batch

    def linear_state(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tokens != 1:
            raise NotImplementedError("a multi-token decode step (speculative verify) over linear-attention layers: "
                                      "their state cannot be rolled back past rejected drafts")
        return self.cache.conv_states[layer_idx], self.cache.recurrent_states[layer_idx]

    def fused_write_target(self, layer_idx: int):
        """``(keys, values, slots, positions, k_scale, v_scale)`` for a kernel that writes this step's
        keys and values itself (fused_ops.qk_norm_rope, storing as :func:`write_decode_kv` does; one slot
        and position per token), then reads them with :meth:`read`; None off CUDA."""
        cache = self.cache
        keys, values = cache.keys[layer_idx], cache.values[layer_idx]
        if triton is None or not keys.is_cuda:
            return None
        return keys, values, self.slots, self.positions, cache.k_scales[layer_idx], cache.v_scales[layer_idx]

    def read(self, layer_idx: int):
        """The running batch's cache rows of ``layer_idx`` (after a fused write), as :meth:`update` returns them."""
        keys = self.cache.keys[layer_idx][: self.batch, :, : self.kv_length]
        values = self.cache.values[layer_idx][: self.batch, :, : self.kv_length]
        return (keys, values) if self.raw else self.cache.read(layer_idx, keys, values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        cache = self.cache
        keys, values = cache.keys[layer_idx], cache.values[layer_idx]
        k_scale, v_scale = cache.k_scales[layer_idx], cache.v_scales[layer_idx]
        # [B, heads, T, dim] -> [B * T, heads, dim] (row by row) written at (slot, :, position)
        if self.tokens == 1:
            key, value = key_states[:, :, 0], value_states[:, :, 0]
        else:
            key = key_states.transpose(1, 2).reshape(self.batch * self.tokens, *key_states.shape[1:2], -1)
            value = value_states.transpose(1, 2).reshape(self.batch * self.tokens, *value_states.shape[1:2], -1)
        if triton is not None and keys.is_cuda:
            write_decode_kv(keys, values, key, value, self.slots, self.positions, k_scale, v_scale)
        elif CPU_INDEX_COPY and not keys.is_cuda and keys.is_contiguous() and values.is_contiguous():
            # the CPU: each (token, head) is one row of the buffer seen as [slots * heads * capacity, dim],
            # so both writes are one index_copy_ each with one flat index (built once a step, not per layer)
            rows = self._flat_rows(keys)
            as_bytes(keys).view(-1, keys.shape[-1]).index_copy_(
                0, rows, as_bytes(quantize(key, keys.dtype, k_scale)).reshape(-1, keys.shape[-1]))
            as_bytes(values).view(-1, values.shape[-1]).index_copy_(
                0, rows, as_bytes(quantize(value, values.dtype, v_scale)).reshape(-1, values.shape[-1]))
        else:
            as_bytes(keys)[self.slots, :, self.positions] = as_bytes(quantize(key, keys.dtype, k_scale))
            as_bytes(values)[self.slots, :, self.positions] = as_bytes(quantize(value, values.dtype, v_scale))
        keys, values = keys[: self.batch, :, : self.kv_length], values[: self.batch, :, : self.kv_length]
        return (keys, values) if self.raw else cache.read(layer_idx, keys, values)

    def _flat_rows(self, buffer: torch.Tensor) -> torch.Tensor:
        """``[tokens * heads]``: row ``(slot * heads + head) * capacity + position`` of each new (token, head)
        in a contiguous ``[slots, heads, capacity, dim]`` buffer viewed as ``[-1, dim]`` (token-major, as
        the written ``[tokens, heads, dim]`` rows are); the same for every layer of the step."""
        _, heads, capacity, _ = buffer.shape
        if self._rows is None or self._rows[0] != (heads, capacity):
            head = torch.arange(heads, device=buffer.device)
            rows = ((self.slots * heads).view(-1, 1) + head) * capacity + self.positions.view(-1, 1)
            self._rows = ((heads, capacity), rows.reshape(-1))
        return self._rows[1]

    def get_seq_length(self, *args, **kwargs) -> int:
        return 0
