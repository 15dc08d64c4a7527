"""slime's GRPO loop and TRL's ``GRPOTrainer`` side by side: same model directory, prompts, sample
counts, response length and reward, each side in its own process, in one run.

    python bench/e2e_grpo.py --model small --prompts 8 --max-new-tokens 16 --steps 6 --out          # 2-core CPU
    python bench/e2e_grpo.py --model qwen3-0.6b --prompts 16 --max-new-tokens 256 --colocate --out  # one H200
    python bench/e2e_grpo.py --model qwen3-0.6b --side slime --colocate --slime-extra --no-offload-train

Workload: ``--prompts`` prompts of the tiny arithmetic task (chat template applied on both sides) ×
``--n-samples`` samples each, temperature 1, up to ``--max-new-tokens`` new tokens, one optimizer
step per rollout, no KL and no reference model (both frameworks' defaults). The reward is the fraction
of even token ids in the response (``tests/ray/loop_plugins.even_token_fraction_reward`` on slime's
side, the same rule over TRL's ``completion_ids``): no trained model needed and it costs nothing, so
the step time is generation + training. ``--model`` is ``tiny``/``small`` (slime.utils.tiny_model;
``small`` is the 4.9M-parameter Qwen3 of hidden 256, 6 layers and the tiny tokenizer's 591-token vocabulary) or ``qwen3-0.6b`` /
``qwen3-1.7b`` (the public architectures with random bf16 weights, bench/engine_decode.py).

slime runs ``train.py`` with the README's flags (``--train-backend fsdp --rollout-backend embedded``,
one training rank, one engine, micro-batches packed by tokens: ``--use-dynamic-batch-size
--max-tokens-per-gpu 16384``; ``--colocate`` adds the README's colocated mode) plus ``--slime-extra``. TRL runs ``GRPOTrainer`` with its defaults (HF ``generate``; bf16 on CUDA) and
``per_device_train_batch_size × gradient_accumulation_steps`` = prompts × samples, so one generation
feeds exactly one optimizer step; ``--trl-grad-accum`` splits it when one micro-batch does not fit.

Metrics per side (``slime/``, ``trl/``): steady ``step_time`` (mean of the steps after the first
``--warmup`` ones), its split ``rollout_time`` / ``train_time`` / ``update_weights_time`` (TRL: the
time inside ``_generate``, the rest of the step, and 0 — TRL shares the weights in one process),
``response_len_mean``, ``step_time_min/max``, and for slime the engine's own account of its rollout
time (``engine_busy_fraction``, ``engine_decode_time``, ``engine_prefill_time``, ``engine_decode_steps``,
``engine_prefill_forwards``), colocated offloading's phases while it is on (``offload_rollout_time``,
``onload_train_time``, ``release_train_cache_time``, ``begin_offload_train_time``, ``onload_rollout_weights_time``,
``offload_train_time``, ``onload_rollout_kv_time``) and the weight push's (``push_gather_time``, ``push_admin_time``,
``push_pack_time``, ``push_load_time``, ``push_session_time``: docs/INTERFACES.md's ``perf/update_weights_*``),
the train/rollout mismatch over all steps (``train_rollout_logprob_abs_diff``; with ``--slime-extra --use-tis`` also
``tis``, ``tis_clipfrac``, ``tis_abs``; ``ppo_kl``, ``pg_clipfrac``: e.g. an FP8 rollout A/B, ``--slime-extra
--sglang-quantization fp8 [--use-tis]``); and ``speedup_vs_trl`` = TRL step time / slime step time.

``engine_alone/`` is the reference for slime's rollout: the embedded engine by itself (its own
process, the same device, the same launch flags as the loop's engine) given each step's requests as
slime's default rollout sends them (one batched ``/generate`` per prompt group, the same sampling
parameters), straight from an HTTP client — no router, rollout code, rewards or trainer.
``rollout_time`` is a step's wall time from the first request to the last answer, and
``slime/rollout_over_engine_alone`` = slime's rollout time / that (1.0 would be no overhead over the engine), with the
engine's own account of those steps (``engine_busy_fraction``, ``engine_decode_time``, ... as for slime).
``--side both`` runs all three; ``--side engine`` only the reference. ``--out`` writes
``bench/results/e2e_grpo-<machine>-<model>-<variant>[-<tag>].json`` (bench/common.py ``result_name``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from statistics import mean

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import machine_name, result_name, write_result  # noqa: E402

REWARD_PATH = "loop_plugins.even_token_fraction_reward"


def steady(values: list[float], warmup: int) -> list[float]:
    if len(values) <= warmup:
        raise RuntimeError(f"only {len(values)} steps recorded, need more than --warmup {warmup}")
    return values[warmup:]


# ---------------------------------------------------------------- slime side


def slime_flags(args, model_dir: str, data: dict, run_dir: str) -> list[str]:
    flags = ["--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", model_dir,
             "--prompt-data", data["train"], "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
             "--custom-rm-path", REWARD_PATH, "--rollout-batch-size", str(args.prompts),
             "--n-samples-per-prompt", str(args.n_samples), "--rollout-max-response-len", str(args.max_new_tokens),
             "--rollout-temperature", "1.0", "--num-rollout", str(args.steps), "--num-steps-per-rollout", "1",
             "--lr", "1e-6", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--run-dir", run_dir,
             "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(args.max_tokens_per_gpu)]
    if args.colocate:
        flags.append("--colocate")
    return flags + args.slime_extra


def run_slime(args, model_dir: str, data: dict, root: str) -> dict:
    run_dir = os.path.join(root, "slime-run")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests", "ray"), os.environ.get("PYTHONPATH", "")]),
               TOKENIZERS_PARALLELISM="false", RAY_ENABLE_UV_RUN_RUNTIME_ENV="0")
    command = [sys.executable, os.path.join(REPO, "train.py"), *slime_flags(args, model_dir, data, run_dir)]
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=None if args.verbose else subprocess.DEVNULL)
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    perf = [r for r in records if r["kind"] == "perf" and "perf/step_time" in r]
    rollouts = [r for r in records if r["kind"] == "rollout" and "rollout/response_len/mean" in r]
    trains = [r for r in records if r["kind"] == "train"]
    metrics = {}
    for key in ("step_time", "rollout_time", "train_time", "update_weights_time"):
        values = steady([r.get(f"perf/{key}", 0.0) for r in perf], args.warmup)
        metrics[key] = mean(values)
        if key == "step_time":
            metrics["step_time_min"], metrics["step_time_max"] = min(values), max(values)
    for key in ("offload_rollout_time", "onload_train_time", "release_train_cache_time", "begin_offload_train_time",
                "onload_rollout_weights_time", "offload_train_time", "onload_rollout_kv_time"):  # colocated offloading's phases (present while it is on)
        values = [r[f"perf/{key}"] for r in perf if f"perf/{key}" in r]
        if len(values) > args.warmup:
            metrics[key] = mean(steady(values, args.warmup))
    pushes = [r for r in records if r["kind"] == "perf" and "perf/update_weights_gather_time" in r]
    for key in ("gather", "admin", "pack", "load", "session"):  # the weight push's phases (train_actor, tensor.py)
        values = [r[f"perf/update_weights_{key}_time"] for r in pushes if f"perf/update_weights_{key}_time" in r]
        if len(values) > args.warmup:
            metrics[f"push_{key}_time"] = mean(steady(values, args.warmup))
    metrics["response_len_mean"] = mean(steady([r["rollout/response_len/mean"] for r in rollouts], args.warmup))
    for key in ("engine_busy_fraction", "engine_decode_time", "engine_prefill_time", "engine_decode_steps",
                "engine_prefill_forwards"):  # the engine's own account
        values = [r[f"perf/{key}"] for r in rollouts if f"perf/{key}" in r]
        if len(values) > args.warmup:
            metrics[key] = mean(steady(values, args.warmup))
    metrics["steps"] = len(perf)
    metrics["process_wall_time"] = wall
    # the train/rollout mismatch and, with --use-tis, what the importance weights did (low-precision rollout A/B)
    for key in ("train_rollout_logprob_abs_diff", "tis", "tis_clipfrac", "tis_abs", "ppo_kl", "pg_clipfrac"):
        values = [r[f"train/{key}"] for r in trains if f"train/{key}" in r]
        if values:
            metrics[key] = mean(values)
    return metrics


# ---------------------------------------------------------------- TRL side (runs in its own process)


def trl_worker(spec: dict) -> None:
    """Train with TRL's GRPOTrainer and write per-step timings to ``spec['result']``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in open(spec["train"])][: spec["prompts"] * spec["steps"]]
    while len(rows) < spec["prompts"] * spec["steps"]:  # repeat the task's prompts when there are too few
        rows += rows[: spec["prompts"] * spec["steps"] - len(rows)]
    dataset = Dataset.from_list([{"prompt": row["prompt"]} for row in rows])  # chat messages: TRL applies the template

    def even_token_fraction(prompts, completions, completion_ids, **kwargs):
        return [sum(token % 2 == 0 and token < 10_000 for token in ids) / len(ids) if len(ids) else 0.0
                for ids in completion_ids]

    cuda = torch.cuda.is_available()
    samples = spec["prompts"] * spec["n_samples"]
    accum = spec["grad_accum"]
    if samples % accum:
        raise ValueError(f"--trl-grad-accum {accum} must divide prompts × samples = {samples}")
    config = GRPOConfig(
        output_dir=os.path.join(spec["root"], "trl-out"), per_device_train_batch_size=samples // accum,
        gradient_accumulation_steps=accum, num_generations=spec["n_samples"], max_completion_length=spec["max_new_tokens"],
        temperature=1.0, learning_rate=1e-6, max_steps=spec["steps"], logging_steps=1, save_strategy="no", report_to=[],
        bf16=cuda, use_cpu=not cuda, seed=1, shuffle_dataset=False, dataloader_num_workers=0, **spec["trl_kwargs"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    tokenizer.padding_side = "left"

    class TimedGRPOTrainer(GRPOTrainer):
        generate_seconds = 0.0

        def _generate(self, prompts):
            start = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                if cuda:
                    torch.cuda.synchronize()
                TimedGRPOTrainer.generate_seconds += time.perf_counter() - start

    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            TimedGRPOTrainer.generate_seconds = 0.0
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            total = time.perf_counter() - self.start
            steps.append({"step_time": total, "rollout_time": TimedGRPOTrainer.generate_seconds,
                          "train_time": total - TimedGRPOTrainer.generate_seconds})

    trainer = TimedGRPOTrainer(model=model, reward_funcs=even_token_fraction, args=config, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.train()
    lengths = [entry["completions/mean_length"] for entry in trainer.state.log_history if "completions/mean_length" in entry]
    with open(spec["result"], "w") as f:
        json.dump({"steps": steps, "response_lengths": lengths}, f)


def run_trl(args, model_dir: str, data: dict, root: str) -> dict:
    spec = {"root": root, "model_dir": model_dir, "train": data["train"], "prompts": args.prompts, "n_samples": args.n_samples,
            "max_new_tokens": args.max_new_tokens, "steps": args.steps, "grad_accum": args.trl_grad_accum,
            "trl_kwargs": json.loads(args.trl_kwargs), "result": os.path.join(root, "trl-result.json")}
    spec_path = os.path.join(root, "trl-spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    start = time.perf_counter()
    subprocess.run([sys.executable, os.path.abspath(__file__), "--trl-worker", spec_path], check=True,
                   env=dict(os.environ, TOKENIZERS_PARALLELISM="false"), stdout=None if args.verbose else subprocess.DEVNULL)
    wall = time.perf_counter() - start
    result = json.load(open(spec["result"]))
    metrics = {}
    for key in ("step_time", "rollout_time", "train_time"):
        values = steady([step[key] for step in result["steps"]], args.warmup)
        metrics[key] = mean(values)
        if key == "step_time":
            metrics["step_time_min"], metrics["step_time_max"] = min(values), max(values)
    metrics["update_weights_time"] = 0.0
    metrics["response_len_mean"] = mean(steady(result["response_lengths"], args.warmup))
    metrics["steps"] = len(result["steps"])
    metrics["process_wall_time"] = wall
    return metrics


# ---------------------------------------------------------------- the engine alone on the same requests


def run_engine_alone(args, model_dir: str, data: dict) -> dict:
    """Each step's prompt groups sent straight to one embedded engine, as slime's default rollout sends
    them; steady wall time per step and the mean response length."""
    import asyncio

    import torch
    from transformers import AutoTokenizer

    from slime.utils import http_utils

    from slime.backends.embedded_engine.serving.launch import running_engine
    from slime.rollout.engine_control import engine_counters, engine_time_metrics

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in open(data["train"])]
    samples = args.prompts * args.n_samples
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # the loop's engine flags (slime.ray.engine_actor.embedded_engine_argv with the bench's arguments)
    extra = ["--device", device, "--max-running-requests", str(max(64, samples))]
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": args.max_new_tokens}

    def prompt_ids(row) -> list[int]:
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        return [int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)]  # a BatchEncoding in transformers 5

    async def one_step(url: str, prompts: list[list[int]]) -> tuple[float, list[int]]:
        async def group(ids):  # through slime's own HTTP client, as the rollout's requests go
            body = {"input_ids": [ids] * args.n_samples, "sampling_params": params, "return_logprob": True}
            return await http_utils.post(url + "/generate", body, max_retries=1)

        start = time.perf_counter()
        outs = await asyncio.gather(*[group(ids) for ids in prompts])
        return time.perf_counter() - start, [len(o["output_ids"]) for out in outs for o in out]

    async def all_steps(url: str) -> tuple[list[float], list[int], list[dict]]:
        try:
            times, lengths, accounts = [], [], []
            for step in range(args.steps):
                prompts = [prompt_ids(rows[(step * args.prompts + i) % len(rows)]) for i in range(args.prompts)]
                before = engine_counters([url])
                seconds, step_lengths = await one_step(url, prompts)
                accounts.append(engine_time_metrics(before, engine_counters([url]), seconds, 1))
                times.append(seconds)
                lengths += step_lengths
            return times, lengths, accounts
        finally:
            await http_utils.close_client()

    with running_engine(model_dir, timeout=900, extra_args=extra) as engine:
        times, lengths, accounts = asyncio.run(all_steps(engine.url))
    metrics = {"rollout_time": mean(steady(times, args.warmup)), "response_len_mean": mean(lengths), "steps": len(times)}
    for key in ("engine_busy_fraction", "engine_decode_time", "engine_prefill_time", "engine_decode_steps",
                "engine_prefill_forwards"):  # the engine's own account, as the loop reports it
        values = [account[f"perf/{key}"] for account in accounts if f"perf/{key}" in account]
        if len(values) > args.warmup:
            metrics[key] = mean(steady(values, args.warmup))
    return metrics


# ---------------------------------------------------------------- driver


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--trl-worker":
        trl_worker(json.load(open(sys.argv[2])))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="tiny | small | qwen3-0.6b | qwen3-1.7b | qwen3-4b (bench/engine_decode.py ARCHITECTURES)")
    parser.add_argument("--model-path", default=None,
                        help="an existing HF directory of --model (e.g. one build_checkpoint made before: saves its "
                             "build on every run); the run's data is still built fresh")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n-samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the steady figures")
    parser.add_argument("--side", choices=("both", "slime", "trl", "engine"), default="both",
                        help="both: slime, TRL and the engine alone (the rollout's reference)")
    parser.add_argument("--colocate", action="store_true", help="slime's --colocate (the README's one-GPU mode)")
    parser.add_argument("--max-tokens-per-gpu", type=int, default=16384, help="slime's micro-batch token budget (README flags)")
    parser.add_argument("--trl-grad-accum", type=int, default=1)
    parser.add_argument("--trl-kwargs", default="{}", help="more GRPOConfig fields, as JSON")
    parser.add_argument("--tag", default="", help="a variant the flags do not name (e.g. an environment variable), added to the file name")
    parser.add_argument("--verbose", action="store_true", help="show both sides' output")
    parser.add_argument("--out", action="store_true")
    parser.add_argument("--slime-extra", nargs=argparse.REMAINDER, default=[], help="more train.py flags (last)")
    args = parser.parse_args()

    from bench.engine_decode import build_checkpoint
    from slime.utils.tiny_task import build_task_data

    with tempfile.TemporaryDirectory() as root:
        model_dir = args.model_path or build_checkpoint(args.model, os.path.join(root, "model"))
        data = build_task_data(os.path.join(root, "data"), num_train=max(256, args.prompts * args.steps), num_eval=8, num_sft=8)
        metrics: dict[str, float] = {}
        sides = ("slime", "trl", "engine") if args.side == "both" else (args.side,)
        for side in sides:
            if side == "engine":
                metrics.update({f"engine_alone/{key}": value for key, value in run_engine_alone(args, model_dir, data).items()})
                continue
            side_metrics = (run_slime if side == "slime" else run_trl)(args, model_dir, data, root)
            metrics.update({f"{side}/{key}": value for key, value in side_metrics.items()})
        if args.side == "both":
            metrics["speedup_vs_trl"] = metrics["trl/step_time"] / metrics["slime/step_time"]
            metrics["slime/rollout_over_engine_alone"] = metrics["slime/rollout_time"] / metrics["engine_alone/rollout_time"]
    config = {"model": args.model, "model_path": args.model_path, "max_tokens_per_gpu": args.max_tokens_per_gpu, "prompts": args.prompts, "n_samples_per_prompt": args.n_samples,
              "max_new_tokens": args.max_new_tokens, "steps": args.steps, "warmup": args.warmup, "colocate": args.colocate,
              "slime_extra": args.slime_extra, "trl_grad_accum": args.trl_grad_accum, "trl_kwargs": json.loads(args.trl_kwargs)}
    if "trl" in (args.side, "both"):
        import trl

        config["trl_version"] = trl.__version__
    config["side"] = args.side
    out = None
    if args.out:
        name = result_name("e2e_grpo", machine_name(), config) + (f"-{args.tag}" if args.tag else "") + ".json"
        out = os.path.join(REPO, "bench", "results", name)
    write_result("e2e_grpo", config, metrics, out)


if __name__ == "__main__":
    main()
