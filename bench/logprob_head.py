"""The LM head's log-prob + entropy, forward and backward: full ``[K, V]`` logits (the trainer's path
before the chunked head) against ``fsdp_utils.logprob_head`` at several chunk sizes. Prints JSON.

    python bench/logprob_head.py                         # GPU: Qwen3-0.6B head (H 1024, V 151936), bf16, K 12288
    python bench/logprob_head.py --rows 512 --vocab 8192 --hidden 256 --dtype fp32   # CPU-sized
    python bench/logprob_head.py --out bench/results     # also write the results file

Metrics per variant (``full``, ``chunk<N>``): ``ms`` (median fwd+bwd), ``peak_gib`` (peak memory above
the inputs, GPU only), and for the chunked ones ``max_abs_diff_logp`` / ``max_abs_diff_entropy`` /
``max_rel_diff_grad_hidden`` against the full path. ``speedup_best`` = full ms / best chunked ms.
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
from slime.backends.fsdp_utils.logprob_head import chunked_log_probs_and_entropy  # noqa: E402
from slime.utils import ppo_utils  # noqa: E402


def full_path(hidden, weight, targets, temperature):
    logits = hidden @ weight.t()
    return ppo_utils.compute_log_probs(logits, targets, temperature), ppo_utils.compute_entropy(logits, temperature)


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
        if i > 0:  # the first run warms up
            times.append((time.perf_counter() - start) * 1e3)
        out = (log_probs.detach().float(), entropy.detach().float(), hidden.grad.float().clone())
    return statistics.median(times), peak, out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=12288, help="K: predicted positions in the micro-batch")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--chunks", default="1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-full", action="store_true", help="do not run the full-logits path (memory)")
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
    best = None
    for chunk in (int(c) for c in bench.chunks.split(",")):
        fn = lambda h, w, t, c=chunk: chunked_log_probs_and_entropy(h, w, t, T, c)  # noqa: E731
        ms, peak, out = run(fn, hidden, weight, targets, coef, device, bench.repeats)
        metrics.update({f"chunk{chunk}/ms": ms, f"chunk{chunk}/peak_gib": peak})
        if reference is not None:
            metrics[f"chunk{chunk}/max_abs_diff_logp"] = float((out[0] - reference[0]).abs().max())
            metrics[f"chunk{chunk}/max_abs_diff_entropy"] = float((out[1] - reference[1]).abs().max())
            metrics[f"chunk{chunk}/max_rel_diff_grad_hidden"] = float(
                (out[2] - reference[2]).abs().max() / reference[2].abs().max().clamp_min(1e-30))
        best = ms if best is None else min(best, ms)
    if "full/ms" in metrics and best:
        metrics["speedup_best"] = metrics["full/ms"] / best
    config = {"rows": bench.rows, "hidden": bench.hidden, "vocab": bench.vocab, "dtype": str(dtype).split(".")[-1],
              "temperature": T, "repeats": bench.repeats, "device": device.type}
    write_result("logprob_head", config, metrics, bench.out)


if __name__ == "__main__":
    main()
