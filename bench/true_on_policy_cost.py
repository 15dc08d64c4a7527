"""CPU cost of ``--true-on-policy``: the embedded engine's rollout and the FSDP trainer's log-prob forward
and backward, each with its default ops and with the batch-invariant ones (``slime/backends/batch_invariant.py``).

    python -m bench.true_on_policy_cost [--requests 64] [--new-tokens 8] [--repeats 3] [--dtype bfloat16]

Prints the best of ``--repeats`` for each side in wall and process-CPU seconds (CPU seconds are the
steadier figure on a shared machine). The tiny Qwen3 of ``slime.utils.tiny_model``, in fp32 or bf16 (``--dtype``:
the engine in that dtype, the trainer's parameters cast to it with fp32 buffers, as FSDP2's mixed precision does).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def _engine_seconds(model_dir: str, prompts: list[list[int]], new_tokens: int, invariant: bool,
                    dtype: str) -> tuple[float, float]:
    from slime.backends.embedded_engine.engine import Engine
    from slime.backends.embedded_engine.io_struct import GenerateRequest, SamplingParams
    from slime.backends.embedded_engine.model_runner import ModelRunner

    runner = ModelRunner(model_dir, device="cpu", dtype=dtype, num_slots=len(prompts), slot_capacity=128,
                         true_on_policy=invariant)
    engine = Engine(runner, seed=0)
    wall, cpu = time.perf_counter(), time.process_time()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, sampling_seed=i)
        engine.add_request(GenerateRequest(rid=str(i), input_ids=prompt, params=params), lambda s, f: None)
    while engine.scheduler.has_work():
        engine.step()
    return time.perf_counter() - wall, time.process_time() - cpu


def _trainer_seconds(model_dir: str, prompts: list[list[int]], new_tokens: int, invariant: bool,
                     dtype: str) -> tuple[float, float]:
    from slime.backends import batch_invariant
    from slime.backends.fsdp_utils.model import forward_log_probs, load_model, pad_samples

    attn = batch_invariant.register() if invariant else "sdpa"
    model = load_model(model_dir, "actor", attn, 0)
    for param in model.parameters():  # parameters in the compute dtype, buffers (rotary frequencies) in fp32
        param.data = param.data.to(getattr(torch, dtype))
    if invariant:
        batch_invariant.install(model)
    model.train()
    tokens = [torch.tensor(p + [7] * new_tokens) for p in prompts]
    packed = pad_samples(tokens, [new_tokens] * len(prompts), "cpu")
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():  # pi_old
        forward_log_probs(model, packed, attn, 1.0, 2048, exact=invariant)
    log_probs, _ = forward_log_probs(model, packed, attn, 1.0, 2048, exact=invariant)
    log_probs.sum().backward()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    from slime.utils.tiny_model import build_tiny_model

    model_dir = str(build_tiny_model(tempfile.mkdtemp(), size="tiny", seed=0))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab - 1, (args.prompt_len,), generator=generator).tolist()
               for _ in range(args.requests)]
    for name, measure in (("engine rollout", _engine_seconds), ("trainer pi_old + fwd/bwd", _trainer_seconds)):
        results = {}
        for invariant in (False, True):
            runs = [measure(model_dir, prompts, args.new_tokens, invariant, args.dtype) for _ in range(args.repeats)]
            results[invariant] = (min(r[0] for r in runs), min(r[1] for r in runs))
        (w0, c0), (w1, c1) = results[False], results[True]
        print(f"{name} ({args.dtype}): default {w0:.3f} s wall / {c0:.3f} s cpu; batch-invariant {w1:.3f} s / {c1:.3f} s "
              f"(x{w1 / w0:.2f} wall, x{c1 / c0:.2f} cpu)")


if __name__ == "__main__":
    main()
