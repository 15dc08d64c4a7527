"""Cost of ``--true-on-policy``: the embedded engine's rollout and the FSDP trainer's log-prob forward and
backward, each with its default ops and with the batch-invariant ones (``slime/backends/batch_invariant.py``).

    python -m bench.true_on_policy_cost [--requests 64] [--new-tokens 8] [--repeats 3] [--dtype bfloat16]
    python -m bench.true_on_policy_cost --model smollm2-135m --dtype bfloat16 --requests 32 --new-tokens 64 --out
    python -m bench.true_on_policy_cost --model qwen3-0.6b --device cuda --dtype bfloat16 --requests 128 --new-tokens 256 --out

Prints the best of ``--repeats`` for each side in wall and process-CPU seconds (CPU seconds are the
steadier figure on a shared machine). ``--model``: the tiny Qwen3 of ``slime.utils.tiny_model`` (default),
SmolLM2-135M-Instruct (pretrained, ``slime.utils.gguf_model``) or a public architecture of
``bench/engine_decode.py`` with random weights; in fp32 or bf16 (``--dtype``: the engine in that dtype, the
trainer's parameters cast to it with fp32 buffers, as FSDP2's mixed precision does). ``--device cuda`` times the
same on a GPU (the engine with its CUDA graphs either way); the flag itself still refuses CUDA, so there the
figure is what exactness would cost, not a claim that it holds.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _since(wall: float, cpu: float, device: str) -> tuple[float, float]:
    """Wall and process-CPU seconds since ``wall`` / ``cpu``, the device's queued work included."""
    _sync(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def _free(device: str) -> None:
    if device == "cuda":  # the next measurement starts from an empty cache allocator
        torch.cuda.empty_cache()


def _engine_seconds(model_dir: str, prompts: list[list[int]], new_tokens: int, invariant: bool,
                    dtype: str, device: str) -> tuple[float, float]:
    from slime.backends.embedded_engine.engine import Engine
    from slime.backends.embedded_engine.io_struct import GenerateRequest, SamplingParams
    from slime.backends.embedded_engine.model_runner import ModelRunner

    capacity = max(len(p) for p in prompts) + new_tokens + 1
    runner = ModelRunner(model_dir, device=device, dtype=dtype, num_slots=len(prompts), slot_capacity=capacity,
                         true_on_policy=invariant)
    engine = Engine(runner, seed=0)
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, sampling_seed=i)
        engine.add_request(GenerateRequest(rid=str(i), input_ids=prompt, params=params), lambda s, f: None)
    while engine.scheduler.has_work():
        engine.step()
    seconds = _since(wall, cpu, device)
    del engine, runner
    _free(device)
    return seconds


def _trainer_seconds(model_dir: str, prompts: list[list[int]], new_tokens: int, invariant: bool,
                     dtype: str, device: str) -> tuple[float, float]:
    from slime.backends import batch_invariant
    from slime.backends.fsdp_utils.model import forward_log_probs, load_model, pad_samples

    attn = batch_invariant.register() if invariant else "sdpa"
    model = load_model(model_dir, "actor", attn, 0)
    for param in model.parameters():  # parameters in the compute dtype, buffers (rotary frequencies) in fp32
        param.data = param.data.to(getattr(torch, dtype))
    if invariant:
        batch_invariant.install(model)
    model.to(device).train()
    tokens = [torch.tensor(p + [7] * new_tokens) for p in prompts]
    packed = pad_samples(tokens, [new_tokens] * len(prompts), device)
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():  # pi_old
        forward_log_probs(model, packed, attn, 1.0, 2048, exact=invariant)
    log_probs, _ = forward_log_probs(model, packed, attn, 1.0, 2048, exact=invariant)
    log_probs.sum().backward()
    seconds = _since(wall, cpu, device)
    del model, log_probs
    _free(device)
    return seconds


def _model_dir(model: str, model_path: str | None) -> str:
    if model_path:
        return model_path
    if model == "tiny":
        from slime.utils.tiny_model import build_tiny_model

        return str(build_tiny_model(tempfile.mkdtemp(), size="tiny", seed=0))
    if model == "smollm2-135m":
        from slime.utils.gguf_model import smollm2_hf_dir

        return smollm2_hf_dir()
    from bench.engine_decode import build_checkpoint

    return build_checkpoint(model, tempfile.mkdtemp(prefix=f"bench-{model}-"))


def main() -> None:
    from bench.engine_decode import ARCHITECTURES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "smollm2-135m", *ARCHITECTURES],
                        help="tiny (the tiny Qwen3), smollm2-135m (pretrained) or a public architecture (random weights)")
    parser.add_argument("--model-path", default=None, help="an existing HF directory instead of --model")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--out", nargs="?", const="bench/results", default=None,
                        help="write the result JSON into this folder (default bench/results) or to this .json path")
    args = parser.parse_args()
    from slime.utils.exactness import VERIFY_ENV

    if args.device == "cuda":  # a cost figure only: exactness on CUDA is what the flag's refusal waits for
        os.environ[VERIFY_ENV] = "cuda"
    model_dir = _model_dir(args.model, args.model_path)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab - 1, (args.prompt_len,), generator=generator).tolist()
               for _ in range(args.requests)]
    metrics = {}
    for key, name, measure in (("engine", "engine rollout", _engine_seconds),
                               ("trainer", "trainer pi_old + fwd/bwd", _trainer_seconds)):
        results = {}
        for invariant in (False, True):
            runs = [measure(model_dir, prompts, args.new_tokens, invariant, args.dtype, args.device)
                    for _ in range(args.repeats)]
            results[invariant] = (min(r[0] for r in runs), min(r[1] for r in runs))
        (w0, c0), (w1, c1) = results[False], results[True]
        print(f"{name} ({args.dtype}): default {w0:.3f} s wall / {c0:.3f} s cpu; batch-invariant {w1:.3f} s / {c1:.3f} s "
              f"(x{w1 / w0:.2f} wall, x{c1 / c0:.2f} cpu)", flush=True)
        metrics.update({f"{key}_default_s": round(w0, 4), f"{key}_invariant_s": round(w1, 4),
                        f"{key}_cost_ratio": round(w1 / w0, 3), f"{key}_cpu_cost_ratio": round(c1 / c0, 3)})
    total = (metrics["engine_invariant_s"] + metrics["trainer_invariant_s"]) / (
        metrics["engine_default_s"] + metrics["trainer_default_s"])
    metrics["rollout_plus_train_cost_ratio"] = round(total, 3)
    if args.out:
        from bench.common import write_result

        weights = ("given checkpoint" if args.model_path else "pretrained" if args.model == "smollm2-135m"
                   else "tiny" if args.model == "tiny" else "random")
        config = {"model": args.model_path or args.model, "weights": weights, "device": args.device,
                  "dtype": args.dtype, "requests": args.requests, "prompt_len": args.prompt_len,
                  "new_tokens": args.new_tokens, "repeats": args.repeats,
                  "exact_on_this_device": args.device == "cpu"}
        write_result("true_on_policy_cost", config, metrics, args.out, echo=False)


if __name__ == "__main__":
    main()
