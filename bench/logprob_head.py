"""The LM head's log-prob + entropy, forward and backward: the full ``[K, V]`` logits (the trainer's path
before the chunked head), and ``training.logprob_head`` on its torch path and on its fused Triton
path (``SLIME_LOGPROB_HEAD``) at several chunk sizes. Prints JSON.

    python bench/logprob_head.py                         # GPU: Qwen3-0.6B head (H 1024, V 151936), bf16, K 16384
    python bench/logprob_head.py --rows 512 --vocab 8192 --hidden 256 --dtype fp32   # CPU-sized (torch path only)
    python bench/logprob_head.py --out bench/results     # also write the results file

Metrics per variant (``full``, ``torch/chunk<N>``, ``triton/chunk<N>``): ``ms`` (median fwd+bwd of
the whole head: matmuls included), ``peak_gib`` (peak memory above the inputs, GPU only), and for the
chunked ones ``max_abs_diff_logp`` / ``max_abs_diff_entropy`` / ``max_rel_diff_grad_hidden`` against
the full path. ``speedup_triton_vs_torch/chunk<N>`` compares the two chunked paths.

The ``kernel/...`` metrics time only the per-chunk softmax work on one chunk of ready logits in the
benchmark's dtype (no matmuls), scaled to all K rows: the torch path's float32 passes and the Triton
kernels at each ``--triton-blocks`` setting (``BLOCK_V:num_warps``). Their bandwidth counts the bytes
of the logits each pass must move at least (forward reads the chunk once; backward reads it and
writes the gradient in place), against ``copy_tb_s``, a device-to-device copy measured in the same
run (read + write bytes), as ``hbm_fraction``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import write_result  # noqa: E402
from slime.backends.training import logprob_head  # noqa: E402
from slime.backends.training.logprob_head import HEAD_ENV, chunked_log_probs_and_entropy  # noqa: E402
from slime.algorithms import functional as algo  # noqa: E402


def full_path(hidden, weight, targets, temperature):
    logits = hidden @ weight.t()
    return algo.compute_log_probs(logits, targets, temperature), algo.compute_entropy(logits, temperature)


def run(fn, hidden, weight, targets, coef, device, repeats):
    times, peak, out = [], 0.0, None
    for i in range(repeats + 1):
        hidden.grad = weight.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        log_probs, entropy = fn(hidden, weight, targets)
        ((coef * log_probs).sum() + (coef * entropy).sum()).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = max(peak, (torch.cuda.max_memory_allocated() - base) / 2**30)
        if i > 0:  # the first run warms up (and compiles the Triton kernels)
            times.append((time.perf_counter() - start) * 1e3)
        out = (log_probs.detach().float(), entropy.detach().float(), hidden.grad.float().clone())
    return statistics.median(times), peak, out


def time_ms(fn, device, repeats) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on the GPU), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth_tb_s(device, repeats) -> float:
    """Device-to-device copy of 2 GiB, read + write bytes per second, in TB/s."""
    src = torch.empty(2**30, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e12


def kernel_metrics(bench, dtype, device, chunk_rows) -> dict:
    """The per-chunk softmax work alone on one ``[chunk_rows, V]`` chunk of logits, scaled to K rows."""
    rows, vocab, T = min(chunk_rows, bench.rows), bench.vocab, bench.temperature
    g = torch.Generator(device="cpu").manual_seed(1)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(device, dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g).to(device)
    g_lp, g_ent = torch.randn(rows, generator=g).to(device), torch.randn(rows, generator=g).to(device)
    scale = bench.rows / rows  # chunks per K rows
    pass_bytes = rows * vocab * logits.element_size()
    copy = copy_bandwidth_tb_s(device, bench.repeats) if device.type == "cuda" else None
    metrics = {"kernel/chunk_rows": rows, "kernel/copy_tb_s": copy}

    def record(name, fwd_ms, bwd_ms):
        metrics[f"kernel/{name}/fwd_ms"] = fwd_ms * scale
        metrics[f"kernel/{name}/bwd_ms"] = bwd_ms * scale
        for which, ms, moved in (("fwd", fwd_ms, pass_bytes), ("bwd", bwd_ms, 2 * pass_bytes)):
            tb_s = moved / (ms * 1e-3) / 1e12
            metrics[f"kernel/{name}/{which}_tb_s"] = tb_s
            if copy:
                metrics[f"kernel/{name}/{which}_hbm_fraction"] = tb_s / copy

    z = logits.float() / T
    lse, _, entropy, _ = logprob_head._torch_chunk_forward(z.clone(), targets, None)
    record("torch",
           time_ms(lambda: logprob_head._torch_chunk_forward(logits.float().div_(T), targets, None), device, bench.repeats),
           time_ms(lambda: logprob_head._torch_chunk_grad(logits.float().div_(T), targets, lse, entropy, g_lp, g_ent,
                                                          None, None, T).to(dtype), device, bench.repeats))
    from slime.backends.training import triton_logprob

    if not triton_logprob.available(device):
        metrics["kernel/triton"] = f"unavailable on {device.type}"
        return metrics
    # the backward overwrites its input: repeated calls on one scratch copy read the last call's
    # gradient as logits, which changes the values but not the work
    scratch = logits.clone()
    for setting in bench.triton_blocks.split(","):
        block_v, num_warps = (int(x) for x in setting.split(":"))
        kw = {"block_v": block_v, "num_warps": num_warps}
        fwd = time_ms(lambda kw=kw: triton_logprob.log_probs_and_entropy(logits, targets, T, **kw), device, bench.repeats)
        bwd = time_ms(lambda kw=kw: triton_logprob.grad_logits_(scratch, targets, lse, entropy, g_lp, g_ent, T, **kw),
                      device, bench.repeats)
        record(f"triton_{block_v}x{num_warps}", fwd, bwd)
    return metrics


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16384, help="K: predicted positions in the micro-batch")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--chunks", default="1024,2048,4096")
    parser.add_argument("--paths", default="torch,triton", help="chunked-head paths to run (triton: where it can)")
    parser.add_argument("--triton-blocks", default="2048:4,4096:8,8192:8,8192:16",
                        help="BLOCK_V:num_warps settings for the kernel-only timings")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-full", action="store_true", help="do not run the full-logits path (memory)")
    parser.add_argument("--skip-kernels", action="store_true", help="do not time the per-chunk kernels alone")
    parser.add_argument("--out", default=None)
    bench = parser.parse_args(argv)

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[bench.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(bench.rows, bench.hidden, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(bench.vocab, bench.hidden, generator=g) * 0.02 * 30).to(device, dtype).requires_grad_()
    targets = torch.randint(0, bench.vocab, (bench.rows,), generator=g).to(device)
    coef = torch.randn(bench.rows, generator=g).to(device)
    T = bench.temperature

    metrics: dict = {}
    reference = None
    if not bench.skip_full:
        ms, peak, reference = run(lambda h, w, t: full_path(h, w, t, T), hidden, weight, targets, coef, device, bench.repeats)
        metrics.update({"full/ms": ms, "full/peak_gib": peak})
    chunks = [int(c) for c in bench.chunks.split(",")]
    saved_env = os.environ.get(HEAD_ENV)
    try:
        for path in bench.paths.split(","):
            os.environ[HEAD_ENV] = path
            try:
                logprob_head.head_path(device)
            except RuntimeError as e:
                metrics[f"{path}/skipped"] = str(e).split(";")[0]
                continue
            for chunk in chunks:
                fn = lambda h, w, t, c=chunk: chunked_log_probs_and_entropy(h, w, t, T, c)  # noqa: E731
                ms, peak, out = run(fn, hidden, weight, targets, coef, device, bench.repeats)
                name = f"{path}/chunk{chunk}"
                metrics.update({f"{name}/ms": ms, f"{name}/peak_gib": peak})
                if reference is not None:
                    metrics[f"{name}/max_abs_diff_logp"] = float((out[0] - reference[0]).abs().max())
                    metrics[f"{name}/max_abs_diff_entropy"] = float((out[1] - reference[1]).abs().max())
                    metrics[f"{name}/max_rel_diff_grad_hidden"] = float(
                        (out[2] - reference[2]).abs().max() / reference[2].abs().max().clamp_min(1e-30))
    finally:
        if saved_env is None:
            os.environ.pop(HEAD_ENV, None)
        else:
            os.environ[HEAD_ENV] = saved_env
    for chunk in chunks:
        if f"torch/chunk{chunk}/ms" in metrics and f"triton/chunk{chunk}/ms" in metrics:
            metrics[f"speedup_triton_vs_torch/chunk{chunk}"] = metrics[f"torch/chunk{chunk}/ms"] / metrics[f"triton/chunk{chunk}/ms"]
    if not bench.skip_kernels:
        metrics.update(kernel_metrics(bench, dtype, device, logprob_head.DEFAULT_CHUNK_ROWS))
    config = {"rows": bench.rows, "hidden": bench.hidden, "vocab": bench.vocab, "dtype": str(dtype).split(".")[-1],
              "temperature": T, "repeats": bench.repeats, "device": device.type}
    write_result("logprob_head", config, metrics, bench.out)


if __name__ == "__main__":
    main()
