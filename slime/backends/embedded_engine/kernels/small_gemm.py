"""A Triton GEMM for the few-token linears of a decode step (``x [M, K] @ W[N, K]ᵀ``, M ≤ 16), for CUDA.

At decode batch sizes a linear layer reads its whole weight to produce a handful of rows, so its
time is the weight's bytes over the bandwidth it reaches. cuBLAS reaches little of it there: on an
H200 a Qwen3-0.6B decode step at 16 rows spends 5–6 µs on each of a layer's four GEMMs (4–13 MB of
weights, ~1.3 TB/s of the 4.8 TB/s) and a fifth kernel for the split-K reduction of the down
projection (``bench/results/decode_step-nvidia-h200-qwen3-0.6b-bf16-b16-p383.json``).
This kernel is laid out for that shape:

* one 16-row tile covers every row; program ``(column tile, k split)`` streams its
  ``BLOCK_N × K/SPLIT_K`` share of the weight in ``BLOCK_K`` steps (pipelined loads), so a launch
  has ~2 programs per SM whatever N is (:func:`plan`);
* split K: each program writes an fp32 partial and bumps its column tile's ticket; the last to
  arrive sums the partials in split order (the result does not depend on timing), applies the
  epilogue and resets the ticket (no clearing between launches: capturable in a CUDA graph) — the
  pattern of ``fp8_triton``'s split-K GEMM;
* prologue ``GATE``: the input is the fused ``[gate | up]`` projection's output ``[M, 2K]`` and the
  A tile is ``silu(gate) * up`` computed on load (rounded once to the activations' dtype, as
  ``fused_ops.silu_mul_packed`` does): the down projection without the SiLU kernel;
* epilogue: ``+ bias``, and ``+ residual`` (fp32 add, one rounding, as cuBLAS's ``addmm`` with
  beta = 1 does); ``out`` may be the residual itself (each element is read and then written by the
  same program).

fp32 weights multiply in full fp32 (``input_precision="ieee"``), so an fp32 engine stays exact to
rounding. :func:`linear` is the entry point; ``fused_ops.install`` routes the decoder's linears
(and the MLP's down projection with its SiLU gate and residual) through it for M ≤
:data:`MAX_ROWS` when :data:`ENABLED`.
"""

from __future__ import annotations

import os

import torch

from slime.backends.embedded_engine.tickets import Tickets

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

MAX_ROWS = 16  # one 16-row tile (the smallest tensor-core tile)
# fused_ops routes decoder linears here when True; SLIME_SMALL_M_GEMM=1 turns it on (``bench/decode_step.py --with
# small_m_gemm``). Off: slower than cuBLAS with these tiles at 16 rows of Qwen3-0.6B on the H200
# (docs/embedded_engine.md, "What the fusions buy"). The engine's GPU tests pass with it on.
ENABLED = os.environ.get("SLIME_SMALL_M_GEMM", "0") == "1"
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 128
PROGRAMS_PER_SM = 2


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _small_gemm_kernel(a_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, partial_ptr, ticket_ptr, M, N, K,
                           stride_am, stride_wn, stride_rm, stride_om,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           SPLIT_K: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
                           HAS_RESIDUAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        in_m = offs_m < M
        in_n = offs_n < N
        k_steps = tl.cdiv(K, BLOCK_K)
        per_split = tl.cdiv(k_steps, SPLIT_K)
        first = pid_k * per_split
        last = tl.minimum(first + per_split, k_steps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(first, last):
            k = kb * BLOCK_K + offs_k
            in_k = k < K
            a_mask = in_m[:, None] & in_k[None, :]
            if GATE:  # A = silu(gate) * up from the [gate | up] row, rounded once to the weight's dtype
                g = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :], mask=a_mask, other=0.0).to(tl.float32)
                u = tl.load(a_ptr + offs_m[:, None] * stride_am + K + k[None, :], mask=a_mask,
                            other=0.0).to(tl.float32)
                a = (g / (1.0 + tl.exp(-g)) * u).to(w_ptr.dtype.element_ty)
            else:
                a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :], mask=a_mask, other=0.0)
            w = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None], mask=in_k[:, None] & in_n[None, :], other=0.0)
            if UPCAST:  # Triton's interpreter multiplies 16-bit floats wrongly; bf16 products are exact in fp32
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, w, input_precision=PRECISION)
        out_mask = in_m[:, None] & in_n[None, :]
        if SPLIT_K > 1:
            # partial_ptr: fp32 [SPLIT_K, BLOCK_M, N]; ticket_ptr: one int32 per column tile, 0 on entry
            tile_offsets = offs_m[:, None] * N + offs_n[None, :]
            tl.store(partial_ptr + pid_k * BLOCK_M * N + tile_offsets, acc, mask=out_mask)
            tl.debug_barrier()  # every thread's partial written before the release below
            arrived = tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for split in range(SPLIT_K):  # in split order: the sum does not depend on who came last
                    acc += tl.load(partial_ptr + split * BLOCK_M * N + tile_offsets, mask=out_mask, other=0.0,
                                   cache_modifier=".cg")
                _epilogue(acc, bias_ptr, res_ptr, out_ptr, offs_m, offs_n, in_n, out_mask, stride_rm, stride_om,
                          HAS_BIAS, HAS_RESIDUAL)
                tl.atomic_xchg(ticket_ptr + pid_n, 0)
        else:
            _epilogue(acc, bias_ptr, res_ptr, out_ptr, offs_m, offs_n, in_n, out_mask, stride_rm, stride_om,
                      HAS_BIAS, HAS_RESIDUAL)

    @triton.jit
    def _epilogue(acc, bias_ptr, res_ptr, out_ptr, offs_m, offs_n, in_n, out_mask, stride_rm, stride_om,
                  HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        """``acc (+ bias) (+ residual)`` in fp32, stored once in the output's dtype."""
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=in_n, other=0.0).to(tl.float32)[None, :]
        if HAS_RESIDUAL:
            acc += tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=out_mask,
                           other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=out_mask)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter (tests): plan as for an H100/H200


def plan(out_features: int, in_features: int, sms: int) -> int:
    """SPLIT_K for an ``N x K`` weight: about :data:`PROGRAMS_PER_SM` programs per SM over the column
    tiles, no split shorter than one K step, and no empty split."""
    tiles = triton.cdiv(out_features, BLOCK_N)
    k_steps = triton.cdiv(in_features, BLOCK_K)
    split = max(1, min(k_steps, round(PROGRAMS_PER_SM * sms / tiles)))
    return triton.cdiv(k_steps, triton.cdiv(k_steps, split))


_tickets = Tickets("small-M GEMM split-K tickets", minimum=1 << 14)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, out: torch.Tensor | None = None, gate: bool = False,
           split_k: int | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]ᵀ (+ bias) (+ residual)`` for at most :data:`MAX_ROWS` rows of ``x``;
    ``gate``: ``x`` is ``[..., 2K]`` holding ``[gate | up]`` and the product is ``silu(gate) * up @ Wᵀ``.
    ``out`` (``[..., N]``, may be ``residual``) receives the result. ``split_k`` overrides :func:`plan`."""
    out_features, in_features = weight.shape
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"small-M GEMM takes at most {MAX_ROWS} rows, got {m}")
    if x.shape[-1] != (2 * in_features if gate else in_features):
        raise ValueError(f"small-M GEMM: input width {x.shape[-1]} for a weight of {in_features} input features"
                         f"{' (gated: twice that expected)' if gate else ''}")
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if out is None:
        out = torch.empty((*lead, out_features), dtype=x.dtype, device=x.device)
    out_rows = out.view(-1, out_features)
    res_rows = residual.reshape(-1, out_features) if residual is not None else out_rows
    if res_rows.stride(-1) != 1 or out_rows.stride(-1) != 1:
        raise ValueError("small-M GEMM: residual and out need a contiguous last dimension")
    if m == 0:
        return out
    split = split_k or plan(out_features, in_features, _sm_count(x.device))
    tiles = triton.cdiv(out_features, BLOCK_N)
    partials = (torch.empty((split, BLOCK_M, out_features), dtype=torch.float32, device=x.device) if split > 1
                else out_rows)
    tickets = _tickets.get(x.device, tiles) if split > 1 else out_rows
    _small_gemm_kernel[(tiles, split)](
        rows, weight, bias if bias is not None else weight, res_rows, out_rows, partials, tickets, m, out_features,
        in_features, rows.stride(0), weight.stride(0), res_rows.stride(0), out_rows.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=split, GATE=gate, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",
        UPCAST=os.environ.get("TRITON_INTERPRET") == "1" and weight.dtype != torch.float32,
        num_warps=4, num_stages=4)
    return out
