"""FP8 on a whole model: :func:`quantize_model` swaps the decoder's linear layers and fused experts for
block-wise (``block.py``) or per-channel (``channel.py``) FP8 ones, and :func:`warm_up` compiles every Triton
GEMM launch they can take before the engine serves. The one FP8 module that knows both recipes."""

from __future__ import annotations

import logging

import torch
from torch import nn

from slime.backends.embedded_engine.fp8.block import Fp8Experts, Fp8Linear, Fp8Weights, fp8_linear, gemm_path

logger = logging.getLogger(__name__)


def _is_fused_experts(module: nn.Module) -> bool:
    """transformers' ``[gate; up]``-concatenated, untransposed, bias-free expert layout (other layouts
    stay in the model dtype)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not getattr(module, "is_concatenated", True) or getattr(module, "is_transposed", False):
        return False
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]
            and hasattr(module, "act_fn") and not getattr(module, "has_bias", False))


WARM_UP_MAX_ROWS = 4096  # token counts whose Triton launches fp8.warm_up compiles before serving


@torch.no_grad()
def warm_up(weights: Fp8Weights, max_rows: int = WARM_UP_MAX_ROWS) -> tuple[int, float]:
    """Compile, before the engine serves, every Triton GEMM launch the FP8 linears and routed experts of
    ``weights`` can take for 1..``max_rows`` tokens: one GEMM on zeros per distinct :func:`fp8_triton.launch_key`
    (tiles and TMA; the token count is not specialized on), so no decode step or prefill stalls on a
    first-use compile (~1 s each) — the engine captures CUDA graphs lazily per batch bucket, and a
    bucket whose tiles were new used to compile inside the rollout. Also allocates the split-K
    counters. Where the Triton kernels run (CUDA; the CPU only under Triton's interpreter, where the
    engine does not call it).
    Returns (launches compiled or loaded from Triton's cache, seconds)."""
    import time

    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton
    from slime.backends.embedded_engine.fp8.channel import ChannelFp8Experts, fallback_backend

    start = time.perf_counter()
    seen: set[tuple] = set()
    shapes = {}  # one matrix per (shape, dtype, backend, device): the launches depend on nothing else
    matrices = [(module.weight_fp8, module.weight_scale_inv, module.dtype, module.backend)
                for module in weights.linears.values() if isinstance(module, Fp8Linear)]
    per_channel = [module for module in weights.linears.values()
                   if not isinstance(module, Fp8Linear) and module.backend != "dequant"]
    if per_channel:  # one call compiles the token quantizer for every token count (and starts the row-wise GEMM)
        module = per_channel[0]
        module(torch.zeros((1, module.in_features), dtype=module.dtype, device=module.weight_fp8.device))
        seen.add(("w8a8_fp8",))
    # the per-channel Triton GEMM: the two-kernel launches, in the kernel's PER_CHANNEL mode
    def channel_path(backend: str, device: torch.device) -> str:  # cublas: its other calls' path
        return fallback_backend(device) if backend == "cublas" else backend

    matrices += [(module.weight_fp8, module.weight_scale, module.dtype, "channel_triton")
                 for module in per_channel if channel_path(module.backend, module.weight_fp8.device) == "triton"]
    for module in weights.experts.values():  # every expert's matrices share a shape
        if isinstance(module, ChannelFp8Experts):  # per channel: only the Triton GEMM has launches to compile
            triton_gemm = channel_path(module.backend, module.matrix("gate", 0)[0].device) == "triton"
            backend = "channel_triton" if triton_gemm else "dequant"
        else:
            backend = module.backend
        matrices += [(*module.matrix(kind, 0), module.dtype, backend) for kind in ("gate", "up", "down")]
    for values, scales, dtype, backend in matrices:
        shapes.setdefault((*values.shape, dtype, backend, str(values.device)), (values, scales, dtype, backend))
    for values, scales, dtype, backend in shapes.values():
        if backend == "dequant" or not fp8_triton.available(values.device):
            continue
        out_features, in_features = values.shape
        tma = fp8_triton.tma_usable_for(values)
        for rows in range(1, max_rows + 1):
            if backend == "channel_triton":
                key = ("channel", out_features, in_features, dtype,
                       *fp8_triton.launch_key("two_kernel", rows, out_features, in_features, values.device, tma))
                if key not in seen:
                    seen.add(key)
                    _warm_up_channel_gemm(values, scales, dtype, rows)
                continue
            path = gemm_path(backend, rows, out_features, in_features, values.device)
            if path == "cublas":
                key = (path, out_features, in_features, dtype)  # no Triton tiles: the quantizer and cuBLASLt
            else:
                launch = fp8_triton.launch_key(path, rows, out_features, in_features, values.device, tma)
                key = (out_features, in_features, dtype, *launch)
            if key in seen:
                continue
            seen.add(key)
            zeros = torch.zeros((rows, in_features), dtype=dtype, device=values.device)
            fp8_linear(zeros, values, scales, None, backend)
            if path == "two_kernel":  # and its epilogue-add variant (fused_ops: the MLP's residual in the down GEMM)
                fp8_linear(zeros, values, scales, None, backend,
                           accumulate_into=torch.zeros((rows, out_features), dtype=dtype, device=values.device))
    if seen and torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if seen:
        logger.info("fp8: warmed up %d GEMM launches (shapes x tiles) for 1-%d tokens in %.1f s", len(seen),
                    max_rows, seconds)
    return len(seen), seconds


def _warm_up_channel_gemm(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, rows: int) -> None:
    """One per-channel Triton GEMM of ``rows`` tokens on zeros, and its epilogue-add variant (``fused_ops``: the
    MLP's residual in the down GEMM)."""
    from slime.backends.embedded_engine.fp8.channel import channel_linear

    zeros = torch.zeros((rows, values.shape[1]), dtype=dtype, device=values.device)
    channel_linear(zeros, values, scales, None, "triton")
    channel_linear(zeros, values, scales, None, "triton",
                   accumulate_into=torch.zeros((rows, values.shape[0]), dtype=dtype, device=values.device))


@torch.no_grad()
def quantize_model(model: nn.Module, backend: str, keep: tuple[str, ...] = (), per_channel: bool = False) -> Fp8Weights:
    """Replace the decoder's linear layers and fused experts of ``model`` with FP8 ones, in place: 128 x 128
    blocks (``--quantization fp8``), or one scale per output channel (``per_channel``: ``--quantization
    w8a8_fp8``, ``channel.py``; ``backend`` is then one of its backends). ``keep``: module-name suffixes
    left in the model dtype (besides routers, embeddings and the head)."""
    from slime.backends.embedded_engine.fp8.channel import ChannelFp8Experts, ChannelFp8Linear

    linears, experts = {}, {}
    for name, module in list(model.named_modules()):
        if ".layers." not in f".{name}." or (keep and name.endswith(keep)):
            continue
        parent_name, _, leaf = name.rpartition(".")
        if isinstance(module, nn.Linear):
            if leaf == "gate":  # the MoE router: its logits pick the experts, kept exact
                continue
            replacement = linears[name] = (ChannelFp8Linear if per_channel else Fp8Linear)(module, backend)
        elif _is_fused_experts(module):
            replacement = experts[name] = (ChannelFp8Experts if per_channel else Fp8Experts)(module, backend)
        else:
            continue
        setattr(model.get_submodule(parent_name), leaf, replacement)
    method = "w8a8_fp8" if per_channel else "fp8"
    if not linears:
        raise ValueError(f"--quantization {method}: {type(model).__name__} has no nn.Linear inside its decoder "
                         "layers to quantize")
    logger.info("%s: %d linear layers and %d expert groups quantized (%s, %s GEMM)", method, len(linears),
                len(experts), "one scale per output channel" if per_channel else "128x128 blocks", backend)
    return Fp8Weights(linears, experts)
