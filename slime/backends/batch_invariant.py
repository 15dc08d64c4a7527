"""Batch-invariant ops shared by the embedded engine and the FSDP trainer (``--true-on-policy``).

A row's result must not depend on which other rows share its call, how many there are, or where the
row sits: then the engine (requests joining and leaving each decode step, chunked prefill, a KV cache
of any length) and the trainer (packed micro-batches of any split, with or without autograd) compute
the same bits for the same token. Measured on this project's CPU build (MKL/oneDNN, AVX-512, fp32):

* ``torch.mm`` / ``F.linear``: a row's result changes with the number of rows (a 1-row call is a GEMV,
  others pick blockings by M) and with its position in the call. A GEMM of a *fixed* shape does not:
  :func:`linear` pads the rows to whole tiles of :data:`TILE_ROWS`, each ``[TILE_ROWS, K] x [K, N]`` (one
  batched GEMM; on the CPU in bf16 one ``mm`` per tile); the same bits for 1 or 2 threads.
* reductions (softmax sums, RMSNorm's mean; a GEMM's value for one row and column also changes with the
  number of columns, for attention the key length): :func:`tree_sum`, a halving sum over a power-of-two
  length made only of element-wise adds. Zero padding at the end leaves it unchanged (``x + 0 = x``).
* attention (:func:`attention`): the same fixed-shape GEMM idea with keys in blocks of :data:`BLOCK` aligned to
  absolute positions, the per-block results added as a :func:`tree_sum`; blocks a query does not see add
  exact zeros, so a query attending to 40 keys gets the same bits whether the keys sit in a 40-token trainer
  row or a 2048-token cache slot.
* backward: the tiled GEMM's and the attention's gradients are the plain GEMM's and softmax attention's
  (nothing compares gradients, and the exact forms' own backwards would cost several times their forward).
* element-wise ops: ``exp``, ``log``, ``rsqrt``, ``sin``/``cos`` give the same bits at any position;
  ``F.silu`` and ``sigmoid`` do not (their vector tails differ), so :func:`silu` is ``x / (1 + exp(-x))``.

bf16 (what a GPU runs): each op has one precision contract on both sides. GEMMs take and return the
model dtype (the GEMM accumulates in fp32 and rounds once); RMSNorm, the SiLU gate and attention compute
in fp32 from the bf16 inputs and round their output to bf16 once, as transformers' own RMSNorm does (in
bf16 arithmetic the CPU's ``rsqrt`` rounds its vector body and scalar tail differently); the log-softmax
and the entropy of the LM head run in fp32 on the bf16 logits. The rotary frequencies
(``inv_freq``) stay fp32 buffers: a model cast whole with ``.to(torch.bfloat16)`` rounds them, and every
rotated query and key moves (up to 0.004 in ``cos``/``sin`` on the tiny Qwen3), which
:func:`check_supported` refuses. FSDP2's mixed precision casts parameters only, and the engine's
``from_pretrained(dtype=...)`` load keeps them fp32 too.

Nothing here is CPU-only (``F.pad``, ``narrow``, ``bmm``, ``matmul``, element-wise ops); on CUDA the
fixed-tile GEMMs are expected to keep a row's bits for any row count (one cuBLAS shape per tile), which
``tests/backends/test_batch_invariant.py``'s GPU tests measure before the CUDA refusal in
:func:`check_supported` may go.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from slime.utils.exactness import verified_devices

ATTENTION_NAME = "slime_invariant"
#: rows of every GEMM call: one shape, so one kernel and one reduction order. None falls back to
#: ``F.linear`` (the tests' demonstration that exactness rests on the tiles: a 1-row decode step is a GEMV)
TILE_ROWS: int | None = 32
#: the dtypes whose precision contract (module docstring) is tested equal on both sides
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
SUPPORTED_MODELS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
RMSNORM_CLASSES = ("LlamaRMSNorm", "Qwen3RMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")
_registered = False


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` as a halving tree (zero-padded to a power of two): the same bits for any
    amount of trailing zero padding and any batch around it."""
    dim = dim % x.dim()
    n = x.shape[dim]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        pad = [0, 0] * (x.dim() - dim - 1) + [0, width - n]
        x = F.pad(x, pad)
    while width > 1:
        width //= 2
        x = x.narrow(dim, 0, width) + x.narrow(dim, width, width)
    return x.squeeze(dim)


def _tiled_matmul(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rows [M, K] @ weight.T`` as whole ``[TILE_ROWS, K] x [K, N]`` GEMMs, one shape for every tile. On
    CUDA one strided-batched GEMM reads the weight once for all tiles (stride 0); the CPU's batched GEMM copies
    an expanded weight per tile and its bf16 path is slow, so there the tiles run one ``mm`` each."""
    count, inner = rows.shape
    tiles = -(-max(count, 1) // TILE_ROWS)
    padded = F.pad(rows, (0, 0, 0, tiles * TILE_ROWS - count)).view(tiles, TILE_ROWS, inner)
    if rows.device.type == "cpu" and rows.dtype != torch.float32:
        right = weight.t()
        out = torch.cat([torch.mm(tile, right) for tile in padded.unbind(0)])
    else:
        out = torch.bmm(padded, weight.t().unsqueeze(0).expand(tiles, -1, -1)).reshape(tiles * TILE_ROWS, -1)
    return out[:count]


class _TiledLinear(torch.autograd.Function):
    """The forward in fixed tiles; the backward as any linear layer's (its gradients are compared with
    nothing, so they take the fast GEMMs: the input's ``grad @ W``, the weight's ``grad.T @ x``)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        out = _tiled_matmul(rows, weight)
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight = ctx.saved_tensors
        grad_rows = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ rows if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_rows, grad_weight, grad_bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with every row computed in a ``[TILE_ROWS, K]`` tile of the same GEMM shape."""
    if TILE_ROWS is None:
        return F.linear(x, weight, bias)
    shape = x.shape
    out = _TiledLinear.apply(x.reshape(-1, shape[-1]), weight, bias)
    return out.reshape(*shape[:-1], weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x²) + eps) * weight`` over the last dimension, the mean as a :func:`tree_sum`;
    computed in fp32, rounded to ``x``'s dtype, then scaled by ``weight`` (transformers' order)."""
    wide = x.float()
    variance = tree_sum(wide * wide) / x.shape[-1]
    out = (wide * torch.rsqrt(variance + eps).unsqueeze(-1)).to(x.dtype)
    return out if weight is None else out * weight


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x / (1 + exp(-x))`` in fp32, rounded to ``x``'s dtype."""
    wide = x.float()
    return (wide / (1 + torch.exp(-wide))).to(x.dtype)


def log_softmax(x: torch.Tensor, temperature: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Row-wise log-softmax of ``x / temperature`` over the last dimension in fp32: ``y - (max + log Σ exp(y -
    max))``. ``temperature``: a number, or fp32 per row (``[rows, 1]``). A number is divided as a device
    tensor too: CUDA divides by a host number as a product with its reciprocal, an ulp away at times."""
    if not isinstance(temperature, torch.Tensor):
        temperature = torch.full((1,) * x.dim(), temperature, dtype=torch.float32, device=x.device)
    x = x.float() / temperature
    top = x.amax(dim=-1, keepdim=True)
    return x - (top + torch.log(tree_sum(torch.exp(x - top))).unsqueeze(-1))


def log_probs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          targets: torch.Tensor, temperature: float, entropy_grad: bool = True
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's LM head: ``(log π(target), entropy)`` ``[K]`` fp32 of ``log_softmax(logits / T)``, the
    logits ``linear(hidden)`` in the model dtype, then fp32: the engine's sampler's log-prob
    (``sampler.exact_log_probs`` of the engine's logits) bit for bit."""
    logprobs = log_softmax(linear(hidden, weight, bias), temperature)
    chosen = logprobs.gather(1, targets.long().unsqueeze(1)).squeeze(1)
    source = logprobs if entropy_grad else logprobs.detach()
    entropy = -(torch.exp(source) * source).sum(dim=-1)
    return chosen, entropy


#: attention's GEMM tiles: ``BLOCK`` query rows by ``BLOCK`` keys, key blocks aligned to absolute positions (a
#: key sits in the same column of the same block in a trainer row and in a cache slot)
BLOCK = 32
#: floats of one chunk of query tiles' scores and operand copies (bounds the memory of long trainer rows)
_CHUNK_FLOATS = 1 << 26


def _block_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """``query [B, H, Q, D]`` over ``key [B, Hkv, L, D]`` / ``value [B, Hkv, L, Dv]`` where ``visible
    [B or 1, 1, Q, L]`` (bool) -> ``[B, Q, H, Dv]`` in ``query``'s dtype, in fp32. The dot products are
    ``[BLOCK, D] x [D, BLOCK]`` GEMMs (a tile of query rows, padded, against one block of keys); the softmax sum
    is a :func:`tree_sum`; the weighted sum of values is one ``[BLOCK, BLOCK] x [BLOCK, Dv]`` GEMM per key block,
    the blocks added as a :func:`tree_sum`. Every GEMM has one shape whatever the number of queries and keys,
    and blocks past a query's last visible key add exact zeros (their values are zeroed where no query sees
    them: a cache slot may hold anything there), so a query's output has the same bits in a trainer row, a
    prefill chunk or a decode step over a longer cache."""
    dtype = query.dtype
    batch, heads, queries, dim = query.shape
    kv_heads, length, value_dim = key.shape[1], key.shape[2], value.shape[-1]
    groups = heads // kv_heads
    blocks = -(-length // BLOCK)
    padded = blocks * BLOCK
    rows = groups * queries  # a key/value head's query rows: (group, query)
    tiles = -(-rows // BLOCK)
    q = F.pad(query.float().reshape(batch, kv_heads, rows, dim), (0, 0, 0, tiles * BLOCK - rows))
    q = q.view(batch, kv_heads, tiles, 1, BLOCK, dim)
    k = F.pad(key.float(), (0, 0, 0, padded - length)).view(batch, kv_heads, 1, blocks, BLOCK, dim).transpose(-1, -2)
    show = F.pad(visible, (0, padded - length)).reshape(visible.shape[0], 1, 1, queries, padded)
    seen = show.any(dim=-2).reshape(visible.shape[0], 1, blocks, BLOCK, 1)  # keys some query sees
    v = F.pad(value.float(), (0, 0, 0, padded - length)).view(batch, kv_heads, blocks, BLOCK, value_dim)
    v = v.masked_fill(~seen, 0.0).unsqueeze(2)
    step = max(1, _CHUNK_FLOATS // (BLOCK * padded * (2 + dim // BLOCK + value_dim // BLOCK)))
    out = []
    for start in range(0, tiles, step):  # chunks of query tiles: the same GEMMs, less memory at once
        stop = min(tiles, start + step)
        scores = torch.matmul(q[:, :, start:stop], k)  # [B, Hkv, tiles, blocks, BLOCK, BLOCK]
        scores = scores.permute(0, 1, 2, 4, 3, 5).reshape(batch, kv_heads, (stop - start) * BLOCK, padded) * scale
        first, last = start * BLOCK, min(rows, stop * BLOCK)
        scores = scores[:, :, :last - first]
        index = torch.arange(first, last, device=query.device)
        mask = show[..., index % queries, :].reshape(visible.shape[0], 1, last - first, padded)
        scores = scores.masked_fill(~mask, float("-inf"))
        top = scores.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # a query that sees nothing: output 0
        weights = torch.exp(scores - top)
        probs = weights / tree_sum(weights).unsqueeze(-1)
        probs = F.pad(probs, (0, 0, 0, (stop - start) * BLOCK - (last - first)))
        probs = probs.view(batch, kv_heads, stop - start, BLOCK, blocks, BLOCK).transpose(3, 4)
        partial = torch.matmul(probs, v)  # [B, Hkv, tiles, blocks, BLOCK, Dv]
        out.append(tree_sum(partial, dim=3).reshape(batch, kv_heads, (stop - start) * BLOCK, value_dim))
    out = torch.cat(out, dim=2)[:, :, :rows]
    return out.reshape(batch, heads, queries, value_dim).transpose(1, 2).to(dtype)


def _plain_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """The same function as :func:`_block_attention` with GEMMs and torch's softmax (not batch-invariant):
    what the backward differentiates."""
    groups = query.shape[1] // key.shape[1]
    key = key.float().repeat_interleave(groups, dim=1)
    value = value.float().repeat_interleave(groups, dim=1)
    scores = (query.float() @ key.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query that sees nothing: output 0
    return (probs @ value).transpose(1, 2).to(query.dtype)


class _Attention(torch.autograd.Function):
    """The forward of :func:`_block_attention`; the backward of :func:`_plain_attention` (recomputed): the
    gradients are compared with nothing, and the trees' backward would cost several times their forward."""

    @staticmethod
    def forward(ctx, query, key, value, visible, scale):
        ctx.save_for_backward(query, key, value, visible)
        ctx.scale = scale
        return _block_attention(query, key, value, visible, scale)

    @staticmethod
    def backward(ctx, grad):
        query, key, value, visible = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need) for t, need in zip((query, key, value), ctx.needs_input_grad)]
        with torch.enable_grad():
            out = _plain_attention(*inputs, visible, ctx.scale)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (*(next(grads) if t.requires_grad else None for t in inputs), None, None)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
              scale: float) -> torch.Tensor:
    """``query [B, H, Q, D]`` over ``key [B, Hkv, L, D]`` / ``value [B, Hkv, L, Dv]`` where ``visible
    [B or 1, 1, Q, L]`` (bool) -> ``[B, Q, H, Dv]`` in ``query``'s dtype, by :func:`_block_attention`; under
    autograd its backward is the GEMM attention's."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return _Attention.apply(query, key, value, visible, scale)
    return _block_attention(query, key, value, visible, scale)


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface (``attn_implementation="slime_invariant"``): the
    engine passes an additive mask over its cache (0 = visible), the trainer's padded rows none (causal)."""
    queries, length = query.shape[2], key.shape[2]
    if attention_mask is None:
        visible = (torch.arange(length, device=query.device).view(1, -1)
                   <= torch.arange(queries, device=query.device).view(-1, 1) + (length - queries))[None, None]
    elif attention_mask.dtype == torch.bool:
        visible = attention_mask[..., :length]
    else:
        visible = attention_mask[..., :length] == 0
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return attention(query, key, value, visible, scale), None


def register() -> str:
    """Make ``attn_implementation="slime_invariant"`` known to transformers (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(ATTENTION_NAME, attention_forward)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        _registered = True
    return ATTENTION_NAME


class _SiLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu(x)


def _linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def _rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, self.weight, self.variance_epsilon)


@functools.lru_cache(maxsize=None)
def _invariant_class(cls: type, forward) -> type:
    """``cls`` with ``forward`` swapped in, under the same name (checks by class name still match). A class,
    not an instance attribute: transformers' ``train()`` resets instance ``forward``s of hub-kernel layers."""
    return type(cls.__name__, (cls,), {"forward": forward, "_slime_batch_invariant": True})


def _swap(module: nn.Module, forward) -> None:
    if not getattr(module, "_slime_batch_invariant", False):
        module.__class__ = _invariant_class(type(module), forward)


def check_supported(model: nn.Module, flag: str, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> None:
    """Refuse what the ops cannot make exact yet: other architectures, dtypes other than fp32 and bf16,
    devices other than the CPU, rotary frequencies rounded below fp32. ``dtype`` / ``device``: what the
    model will compute in and on (the trainer checks before FSDP casts and moves it; default: its
    parameters'). ``flag``: what asked for them, for the message."""
    name = type(model).__name__
    if name not in SUPPORTED_MODELS:
        raise ValueError(f"{flag}: {name} is not supported (batch-invariant forwards exist for "
                         f"{', '.join(SUPPORTED_MODELS)}); drop the flag and correct the mismatch with TIS/MIS")
    first = next(model.parameters())
    dtype = first.dtype if dtype is None else dtype
    device = torch.device(first.device if device is None else device)
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{flag}: exact in fp32 and bf16 only (got {dtype}); use --embedded-engine-dtype "
                         "bfloat16 with --fsdp-mixed-precision bf16, or fp32 on both sides")
    if device.type not in verified_devices():
        raise ValueError(f"{flag}: exact on the CPU only today (got {device.type}): the same ops on CUDA await the "
                         "GPU run of tests/backends/test_batch_invariant.py (-m gpu); on a GPU use TIS/MIS "
                         "(--use-tis) instead")
    rounded = [(n, b.dtype) for n, b in model.named_buffers() if n.endswith("inv_freq") and b.dtype != torch.float32]
    if rounded:
        raise ValueError(f"{flag}: the rotary frequencies {rounded[0][0]} are {rounded[0][1]}, not float32: a "
                         "model cast whole (.to(torch.bfloat16)) rounds them and moves every rotated "
                         "query and key; load in the compute dtype (from_pretrained(dtype=...)) or cast only the "
                         "parameters, as FSDP's mixed precision does")


def install(model: nn.Module) -> dict:
    """Swap the batch-invariant ops into ``model`` (every ``nn.Linear`` including the LM head, RMSNorm,
    the SiLU gate); the attention comes from loading with ``attn_implementation=register()``.
    Returns how many modules of each kind were swapped."""
    counts = {"linear": 0, "rmsnorm": 0, "silu": 0}
    for module in list(model.modules()):
        if isinstance(module, nn.Linear):
            _swap(module, _linear_forward)
            counts["linear"] += 1
        elif type(module).__name__ in RMSNORM_CLASSES:
            _swap(module, _rms_norm_forward)
            counts["rmsnorm"] += 1
        if hasattr(module, "act_fn") and hasattr(module, "down_proj"):
            if getattr(getattr(module, "config", None), "hidden_act", "silu") not in ("silu", "swish"):
                raise ValueError(f"batch-invariant ops: activation {module.config.hidden_act!r} has no "
                                 "batch-invariant form")
            module.act_fn = _SiLU()
            counts["silu"] += 1
    return counts
