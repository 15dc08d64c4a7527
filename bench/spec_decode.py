"""Speculative decoding in the embedded engine: output tokens/s with and without it, and acceptance.

    python bench/spec_decode.py --model tiny --num-requests 8 --max-new-tokens 64                 # CPU check
    python bench/spec_decode.py --model tiny-deepseek-v3 --engines off,nextn --mtp exact \\
        --num-requests 8 --max-new-tokens 64                                                     # CPU, NEXTN
    python bench/spec_decode.py --model qwen3-0.6b --num-requests 32 --prompt-len 256 \\
        --max-new-tokens 256 --out                                                               # H200
    python bench/spec_decode.py --model deepseek-v3-1b --engines off,nextn --mtp exact \\
        --num-requests 32 --prompt-len 256 --max-new-tokens 256 --out                            # H200, NEXTN

Engines (one server each, started in turn on the same checkpoint, same flags otherwise):

* ``off``: no speculation (on CUDA the decode loop runs ahead with CUDA graphs);
* ``ngram``: ``--speculative-algorithm NGRAM --speculative-num-draft-tokens K+1`` (``--ngram-drafts K``);
* ``standalone``: ``--speculative-algorithm STANDALONE`` with a draft made of the target's first
  ``--draft-layers`` decoder layers (its embeddings, final norm and head), ``--draft-steps`` drafts.
* ``ngram-eager``, ``standalone-eager``, ``nextn-eager``: the same engines with
  ``SLIME_SPEC_VERIFY_DECODE=0``: verify steps through the generic (eager, prefill-style) forward
  instead of the T-token decode step and its CUDA graphs (the A/B of the verify step);
* ``ngram-adaptive``, ``standalone-adaptive``, ``nextn-adaptive``: the same engines with
  ``--speculative-adaptive`` (SGLang's default config: the drafts a step per batch size, none from 64 rows);
* ``nextn``: ``--speculative-algorithm NEXTN --speculative-num-steps --nextn-steps``, the model's own
  MTP layer (DeepSeek-V3 architectures: ``--model deepseek-v3-1b``, or a ``--model-path`` checkpoint
  that carries its MTP layer). With ``--model``, one is written into the checkpoint before any engine
  runs: ``--mtp random`` (random weights: drafts are nearly all rejected, the overhead case) or
  ``--mtp exact`` (``mtp.make_markov_checkpoint``: every layer's attention and MLP output zeroed, so
  the target's next token depends on the current one only, and an MTP layer that predicts it exactly:
  every engine then serves that target, whose forwards cost what the random one's do, and NEXTN
  accepts nearly every draft: the upper bound of its speed-up at ``--nextn-steps`` drafts).

Workloads (``--model`` builds random weights, so there is no text to copy; the two stand in for it):

* ``repetitive``: greedy decoding. A random-weight model falls into loops within a few tokens, so
  prompt lookup finds what comes next: the stand-in for copy/edit workloads, whose answers repeat
  their prompt. The measured acceptance is reported, so the speed-up can be read against it.
* ``sampling``: temperature 1 over the full vocabulary: little to look up, the overhead case.

Every request asks for ``--max-new-tokens`` with ``ignore_eos``. Per engine and workload (best of
``--repeats``): ``output_tokens_per_s``, ``speedup_vs_off``, and from the server's counters over the
burst ``verify_forwards``, ``decode_steps``, ``accept_rate`` (accepted / proposed drafts) and
``tokens_per_row_step`` (generated tokens per request and decode step). ``--out`` writes ``bench/results/spec_decode-<machine>-<model>-b<requests>[-<engines>].json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_result  # noqa: E402
from bench.engine_decode import ARCHITECTURES, build_checkpoint, make_workload, server_info  # noqa: E402

WORKLOADS = {"repetitive": 0.0, "sampling": 1.0}  # name -> temperature
COUNTERS = ("decode_steps", "spec_verify_forwards", "spec_verify_decode_steps", "spec_proposed_drafts", "spec_accepted_drafts", "decode_rows",
            "decode_seconds", "generated_tokens")


def build_layer_draft(target_path: str, layers: int, out_dir: str) -> str:
    """A draft checkpoint: the target's embeddings, first ``layers`` decoder layers, final norm and head."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.bfloat16)
    config = target.config
    if layers >= config.num_hidden_layers:
        raise SystemExit(f"--draft-layers {layers}: the target has only {config.num_hidden_layers} layers")
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    draft = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    missing = draft.load_state_dict(target.state_dict(), strict=False).missing_keys
    if missing:
        raise RuntimeError(f"draft weights not found in the target: {missing[:3]}")
    draft.generation_config = target.generation_config
    draft.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(target_path).save_pretrained(out_dir)
    return out_dir


async def burst(url: str, prompts, max_new_tokens: int, temperature: float) -> float:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        async def one(prompt):
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens,
                                                             "temperature": temperature, "ignore_eos": True}}
            response = await client.post(url + "/generate", json=body)
            response.raise_for_status()
            return len(response.json()["output_ids"])

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        elapsed = time.perf_counter() - start
    assert counts == [max_new_tokens] * len(prompts), "engine returned fewer tokens than asked"
    return sum(counts) / elapsed


def measure(engine_name: str, model_path: str, engine_args: list[str], prompts, args, env: dict | None = None) -> dict:
    from slime.backends.embedded_engine.serving.launch import EmbeddedEngineProcess

    context = max(512, max(len(p) for p in prompts) + args.max_new_tokens + 16)
    engine = EmbeddedEngineProcess(model_path, env=env, extra_args=[
        "--device", args.device, "--max-running-requests", str(len(prompts)), "--context-length", str(context),
        *engine_args, *shlex.split(args.engine_args)])
    engine.start()
    results = {}
    try:
        engine.wait_healthy(timeout=900)
        for name, temperature in WORKLOADS.items():
            # warm-up: the whole workload once, unmeasured — it captures the CUDA graphs of every (batch,
            # KV-length[, T]) bucket the measured bursts use (a short warm-up left those captures in them)
            asyncio.run(burst(engine.url, prompts, args.max_new_tokens, temperature))
            best = None
            for _ in range(args.repeats):
                before = server_info(engine.url)["batch_stats"]
                tps = asyncio.run(burst(engine.url, prompts, args.max_new_tokens, temperature))
                after = server_info(engine.url)["batch_stats"]
                delta = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
                if best is None or tps > best[0]:
                    best = (tps, delta)
            tps, delta = best
            proposed = delta["spec_proposed_drafts"]
            results[name] = {"output_tokens_per_s": tps, "decode_steps": delta["decode_steps"],
                             "verify_forwards": delta["spec_verify_forwards"],
                             "verify_decode_steps": delta["spec_verify_decode_steps"], "proposed_drafts": proposed,
                             "accepted_drafts": delta["spec_accepted_drafts"],
                             "accept_rate": delta["spec_accepted_drafts"] / proposed if proposed else None,
                             # per request and decode step (the first token, from prefill, included)
                             "tokens_per_row_step": delta["generated_tokens"] / max(delta["decode_rows"], 1),
                             "decode_seconds": delta["decode_seconds"]}
        if args.profile_dir:  # one more repetitive burst under the engine's torch profiler (CPU + GPU, stacks)
            import httpx

            body = {"output_dir": os.path.abspath(args.profile_dir), "num_steps": args.profile_steps,
                    "activities": ["CPU", "GPU"], "with_stack": True, "profile_id": engine_name}  # <engine>-TP-0.trace.json
            httpx.post(engine.url + "/start_profile", json=body, timeout=60).raise_for_status()
            asyncio.run(burst(engine.url, prompts, args.max_new_tokens, WORKLOADS["repetitive"]))
    finally:
        engine.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "small", "tiny-deepseek-v3", *ARCHITECTURES])
    parser.add_argument("--model-path", default=None, help="an existing HF directory instead of --model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=None, help="every prompt this long (default: 8-64)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--ngram-drafts", type=int, default=4, help="NGRAM drafts per step")
    parser.add_argument("--draft-layers", type=int, default=2, help="STANDALONE draft: the target's first N layers")
    parser.add_argument("--draft-steps", type=int, default=3, help="STANDALONE drafts per step")
    parser.add_argument("--nextn-steps", type=int, default=3, help="NEXTN drafts per step (MTP layer chained)")
    parser.add_argument("--mtp", default="random", choices=["random", "exact"],
                        help="with --model and the nextn engine: the MTP layer written into the checkpoint")
    parser.add_argument("--engines", default="off,ngram,standalone")
    parser.add_argument("--engine-args", default="", help="extra flags for every engine")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile-dir", default=None,
                        help="after the measured bursts, profile --profile-steps engine steps of one more repetitive "
                             "burst per engine into this folder (<engine>-TP-0.trace.json: Chrome traces with Python "
                             "stacks; tools/summarize_profile.py reads them)")
    parser.add_argument("--profile-steps", type=int, default=40)
    parser.add_argument("--out", nargs="?", const=str(ROOT / "bench" / "results"), default=None)
    args = parser.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    tmp = tempfile.mkdtemp(prefix="bench-spec-")
    try:
        wanted = args.engines.split(",")
        if args.model_path:
            model_path = args.model_path
        elif args.model == "tiny-deepseek-v3":  # the tests' DeepSeek-V3 (MLA + MoE, ~1.4M parameters): a CPU check
            from slime.utils.tiny_model import build_tiny_model

            model_path = str(build_tiny_model(tmp + "/target", arch="deepseek_v3"))
        else:
            model_path = build_checkpoint(args.model, tmp + "/target")
        if "nextn" in wanted and not args.model_path:
            from slime.backends.embedded_engine.speculative.mtp import add_mtp_layer, make_markov_checkpoint

            if "deepseek" not in args.model:
                raise SystemExit(f"--engines nextn needs a DeepSeek-V3 architecture (--model deepseek-v3-1b), "
                                 f"not --model {args.model}")
            make_markov_checkpoint(model_path, "exact") if args.mtp == "exact" else add_mtp_layer(model_path, seed=1)
        vocab = min(AutoConfig.from_pretrained(model_path).vocab_size, len(AutoTokenizer.from_pretrained(model_path)))
        prompts, _ = make_workload(args.num_requests, vocab, args.seed, args.prompt_len, args.max_new_tokens)
        engines = {"off": [],
                   "ngram": ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(args.ngram_drafts + 1)]}
        engines["nextn"] = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(args.nextn_steps)]
        if "standalone" in wanted or "standalone-eager" in wanted:
            draft = build_layer_draft(model_path, args.draft_layers, tmp + "/draft")
            engines["standalone"] = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", draft,
                                     "--speculative-num-steps", str(args.draft_steps)]
        for name in list(engines):  # the A/B: verify steps through the generic forward, as before the verify step
            engines[f"{name}-eager"] = engines[name]
            if name != "off":  # the drafts a step chosen per batch size from the drafts accepted (SGLang's defaults)
                engines[f"{name}-adaptive"] = engines[name] + ["--speculative-adaptive"]
        unknown = set(wanted) - set(engines)
        if unknown:
            raise SystemExit(f"--engines: unknown {sorted(unknown)}; choose from off, ngram, standalone, nextn "
                             "(or ngram-eager etc.: verify steps through the generic forward; ngram-adaptive etc.: "
                             "with --speculative-adaptive)")
        results = {name: measure(name, model_path, engines[name], prompts, args,
                                 env={"SLIME_SPEC_VERIFY_DECODE": "0"} if name.endswith("-eager") else None)
                   for name in wanted}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if "off" in results:
        for name, per_workload in results.items():
            for workload, row in per_workload.items():
                row["speedup_vs_off"] = row["output_tokens_per_s"] / results["off"][workload]["output_tokens_per_s"]
    config = {"model": args.model_path or args.model, "device": args.device, "num_requests": args.num_requests,
              "prompt_len": args.prompt_len or "8-64", "max_new_tokens": args.max_new_tokens,
              "ngram_drafts": args.ngram_drafts, "draft_layers": args.draft_layers, "draft_steps": args.draft_steps,
              "nextn_steps": args.nextn_steps, "mtp": args.mtp if "nextn" in args.engines.split(",") else None,
              "engines": args.engines.split(","),
              "workloads": WORKLOADS, "engine_args": args.engine_args, "repeats": args.repeats,
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None}
    write_result("spec_decode", config, results, args.out)


if __name__ == "__main__":
    main()
