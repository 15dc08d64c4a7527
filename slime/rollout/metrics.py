"""Rollout-manager-side metrics of a rollout step and of an evaluation (docs/INTERFACES.md §5.9).

``compute_rollout_metrics(args, samples, rollout_time)`` takes the flattened samples of one step:

* ``rollout/response_len/{mean,median,max,min}`` — effective response length (loss-mask sum)
* ``rollout/truncated_ratio``, ``rollout/aborted_ratio``, ``rollout/failed_ratio``
* ``rollout/raw_reward/{mean,std,max,min}`` — scalar rewards (``--reward-key`` applied)
* ``rollout/zero_std/count_<reward>`` — prompt groups (by ``group_index``) whose rewards are all
  equal, counted per shared reward value (not for ``ppo``)
* ``rollout/repetition_frac`` — share of responses whose tail repeats one chunk ≥ 4 times
* ``rollout/prefix_cache_hit_rate``, ``rollout/avg_cached_tokens_per_sample``
* ``rollout/spec_accept_rate`` (accepted / proposed draft tokens), ``rollout/spec_accept_length``
  (generated tokens per verify step), summed over the samples (speculative decoding only)
* ``rollout/top_p_kept_vocab_per_token`` — mean size of the engine's kept top-p set per generated
  token (``--rollout-top-p`` ≠ 1; ``remove_sample`` samples and empty tool-token spans excluded)
* ``perf/rollout_time``, ``perf/tokens_per_gpu_per_sec``, ``perf/effective_tokens_per_gpu_per_sec``,
  ``perf/longest_sample_tokens_per_sec``, ``perf/longest_effective_sample_tokens_per_sec``
  (the longest sample's tokens over the step time), ``perf/non_generation_time/{mean,max}``

Optional groups (docs/INTERFACES.md §5.9):

* ``--log-multi-turn``: ``multi_turn/raw_response_length/response_length_{mean,max,min,clip_ratio}``
  (all response tokens, tool observations included; clip ratio = share of samples that hit
  ``--rollout-max-response-len`` or were truncated), ``multi_turn/wo_obs_response_length/
  response_length_{mean,max,min}`` (model tokens only: the loss-mask sum) and
  ``multi_turn/multi_turn_metric/round_number_{mean,max,min}`` (``metadata["round_number"]`` when the
  rollout sets it, else the number of model turns: runs of 1s in the loss mask);
* ``--log-correct-samples``: ``rollout/correct_length/p{25,50,75,100}`` — percentiles (nearest rank)
  of the effective response length of correct samples (scalar reward exactly 1, as for pass@k) and
  ``rollout/correct_ratio``; the trainer adds ``rollout/correct_entropy``;
* ``--log-reward-category KEY``: ``rollout/error_cat/<value>`` — the share of the step's samples whose
  dict reward has ``reward[KEY] == value``.

``compute_eval_metrics(args, data)`` takes ``RolloutFnEvalOutput.data``: ``eval/<name>`` (mean reward),
``eval/<name>-truncated_ratio``, ``eval/<name>/response_len/{mean,max,min}`` and, with
``--log-passrate``, ``eval/<name>-pass@<k>`` for k = 1, 2, 4, ... ≤ n_samples_per_eval_prompt
(unbiased estimator 1 - C(n-c, k)/C(n, k); a reward of exactly 1 is a pass).
"""

from __future__ import annotations

import statistics
import logging
import math
from collections import defaultdict
from math import comb

from slime.utils.passthrough import sglang_value
from slime.utils.types import Sample

logger = logging.getLogger(__name__)


def _scalar_reward(args, sample: Sample, key_attr: str = "reward_key"):
    key = getattr(args, key_attr, None)
    reward = sample.reward
    if key and isinstance(reward, dict):
        reward = reward.get(key)
    return float(reward) if isinstance(reward, (int, float)) else None


def _stats(prefix: str, values: list[float], keys=("mean", "median", "max", "min")) -> dict:
    if not values:
        return {}
    funcs = {"mean": statistics.fmean, "median": statistics.median, "max": max, "min": min,
             "std": lambda v: statistics.pstdev(v) if len(v) > 1 else 0.0}  # fmt: skip
    return {f"{prefix}/{k}": float(funcs[k](values)) for k in keys}


def _has_repetition(text: str, min_repeats: int = 4) -> bool:
    tail = text[-400:]
    for size in range(1, min(50, len(tail) // min_repeats) + 1):
        chunk = tail[-size:]
        if chunk.strip() and tail.endswith(chunk * min_repeats):
            return True
    return False


def _top_p_kept_vocab_per_token(samples: list[Sample]) -> float | None:
    """Mean size of the engine's kept top-p set over generated positions (non-empty spans) of the
    samples that carry one, ``remove_sample`` ones excluded; None when no sample has top-p data."""
    kept = positions = 0
    for s in samples:
        offsets = s.rollout_top_p_token_offsets
        if offsets is None or s.remove_sample:
            continue
        offsets = offsets.tolist() if hasattr(offsets, "tolist") else list(offsets)
        spans = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
        kept += sum(spans)
        positions += sum(1 for n in spans if n > 0)
    return kept / positions if positions else None


def _num_rollout_gpus(args) -> int:
    gpus = args.rollout_num_gpus
    if gpus:
        return int(gpus)
    from slime.rollout.sglang_rollout import get_num_engines

    return get_num_engines(args) * int(args.rollout_num_gpus_per_engine or 1)


def compute_rollout_metrics(args, samples: list[Sample], rollout_time: float) -> dict:
    """Metrics of one rollout step from its flattened samples and its wall time in seconds."""
    if not samples:
        return {"perf/rollout_time": rollout_time}
    metrics: dict = {}
    effective = [s.effective_response_length for s in samples]
    metrics.update(_stats("rollout/response_len", effective))
    n = len(samples)
    metrics["rollout/truncated_ratio"] = sum(s.status == Sample.Status.TRUNCATED for s in samples) / n
    metrics["rollout/aborted_ratio"] = sum(s.status == Sample.Status.ABORTED for s in samples) / n
    metrics["rollout/failed_ratio"] = sum(s.status == Sample.Status.FAILED for s in samples) / n

    rewards = [r for r in (_scalar_reward(args, s) for s in samples) if r is not None]
    metrics.update(_stats("rollout/raw_reward", rewards, keys=("mean", "std", "max", "min")))

    if args.advantage_estimator != "ppo":
        groups: dict = defaultdict(list)
        for s in samples:
            if s.group_index is not None:
                groups[s.group_index].append(_scalar_reward(args, s))
        for values in groups.values():
            if len(values) > 1 and None not in values and len(set(values)) == 1:
                key = f"rollout/zero_std/count_{values[0]:g}"
                metrics[key] = metrics.get(key, 0) + 1

    metrics["rollout/repetition_frac"] = sum(_has_repetition(s.response or "") for s in samples) / n
    total_prompt = sum(s.prefix_cache_info.total_prompt_tokens for s in samples)
    metrics["rollout/prefix_cache_hit_rate"] = (
        sum(s.prefix_cache_info.cached_tokens for s in samples) / total_prompt if total_prompt else 0.0
    )
    metrics["rollout/avg_cached_tokens_per_sample"] = sum(s.prefix_cache_info.cached_tokens for s in samples) / n
    if sglang_value(args, "sglang_speculative_algorithm"):
        metrics.update(spec_metrics(samples))

    kept_vocab = _top_p_kept_vocab_per_token(samples)
    if kept_vocab is not None:
        metrics["rollout/top_p_kept_vocab_per_token"] = kept_vocab

    if args.log_multi_turn:
        metrics.update(multi_turn_metrics(args, samples))
    if args.log_correct_samples:
        metrics.update(correct_sample_metrics(args, samples))
    if args.log_reward_category:
        metrics.update(reward_category_metrics(args, samples))

    metrics["perf/rollout_time"] = rollout_time
    if rollout_time > 0:
        gpus = max(1, _num_rollout_gpus(args))
        metrics["perf/tokens_per_gpu_per_sec"] = sum(s.response_length for s in samples) / rollout_time / gpus
        metrics["perf/effective_tokens_per_gpu_per_sec"] = sum(effective) / rollout_time / gpus
        metrics["perf/longest_sample_tokens_per_sec"] = max(s.response_length for s in samples) / rollout_time
        metrics["perf/longest_effective_sample_tokens_per_sec"] = max(effective) / rollout_time
    non_generation = [s.non_generation_time for s in samples]
    if any(non_generation):
        metrics.update(_stats("perf/non_generation_time", non_generation, keys=("mean", "max")))
    return metrics


def spec_metrics(samples: list[Sample]) -> dict:
    """Speculative decoding over the step's samples: accepted / proposed draft tokens, and generated
    tokens per verify step (target forward), both summed over the samples before dividing, so that
    long samples weigh by their tokens and a sample that never speculated does not count as 0."""
    infos = [s.spec_info for s in samples]
    proposed = sum(i.spec_draft_token_num for i in infos)
    verify = sum(i.spec_verify_ct for i in infos)
    return {"rollout/spec_accept_rate": sum(i.spec_accept_token_num for i in infos) / proposed if proposed else 0.0,
            "rollout/spec_accept_length": sum(i.completion_token_num for i in infos) / verify if verify else 0.0}


def model_turns(sample: Sample) -> int:
    """Model turns of a (multi-turn) sample: ``metadata["round_number"]`` when the rollout sets it,
    else the runs of 1s in its loss mask (tool observations between turns are masked out)."""
    if sample.metadata.get("round_number") is not None:
        return int(sample.metadata["round_number"])
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


def multi_turn_metrics(args, samples: list[Sample]) -> dict:
    """``--log-multi-turn``: response lengths with and without observations, model turns per sample."""
    raw = [s.response_length for s in samples]
    limit = args.rollout_max_response_len
    clipped = [s.status == Sample.Status.TRUNCATED or (limit is not None and s.response_length >= limit) for s in samples]
    metrics = {f"multi_turn/raw_response_length/response_length_{k}": v for k, v in
               (("mean", statistics.fmean(raw)), ("max", max(raw)), ("min", min(raw)))}
    metrics["multi_turn/raw_response_length/response_length_clip_ratio"] = sum(clipped) / len(samples)
    model_only = [s.effective_response_length for s in samples]
    metrics.update({f"multi_turn/wo_obs_response_length/response_length_{k}": v for k, v in
                    (("mean", statistics.fmean(model_only)), ("max", max(model_only)), ("min", min(model_only)))})
    rounds = [model_turns(s) for s in samples]
    metrics.update({f"multi_turn/multi_turn_metric/round_number_{k}": v for k, v in
                    (("mean", statistics.fmean(rounds)), ("max", max(rounds)), ("min", min(rounds)))})
    return {k: float(v) for k, v in metrics.items()}


def is_correct(args, sample: Sample) -> bool:
    """A correct sample: scalar reward (``--reward-key`` applied) exactly 1, the pass of pass@k."""
    return _scalar_reward(args, sample) == 1


def correct_sample_metrics(args, samples: list[Sample]) -> dict:
    """``--log-correct-samples``: how long the correct responses are (nearest-rank percentiles)."""
    lengths = sorted(s.effective_response_length for s in samples if is_correct(args, s))
    metrics = {"rollout/correct_ratio": len(lengths) / len(samples)}
    if lengths:
        for q in (25, 50, 75, 100):
            metrics[f"rollout/correct_length/p{q}"] = float(lengths[max(math.ceil(q / 100 * len(lengths)), 1) - 1])
    return metrics


def reward_category_metrics(args, samples: list[Sample]) -> dict:
    """``--log-reward-category KEY``: share of samples per value of ``reward[KEY]`` (dict rewards)."""
    key = args.log_reward_category
    counts: dict[str, int] = defaultdict(int)
    for s in samples:
        if isinstance(s.reward, dict) and key in s.reward:
            counts[str(s.reward[key])] += 1
    if not counts:
        logger.warning("--log-reward-category %r: no sample of this step has a dict reward with that key "
                       "(reward of the first sample: %r)", key, samples[0].reward)
    return {f"rollout/error_cat/{category}": n / len(samples) for category, n in sorted(counts.items())}


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k estimator (Chen et al. 2021)."""
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - comb(num_samples - num_correct, k) / comb(num_samples, k)


def compute_eval_metrics(args, data: dict) -> dict:
    """``eval/<name>...`` metrics of every dataset in an evaluation's ``data`` dict."""
    metrics: dict = {}
    for name, result in data.items():
        rewards = [float(r) for r in result["rewards"]]
        if not rewards:
            continue
        metrics[f"eval/{name}"] = statistics.fmean(rewards)
        truncated = result.get("truncated") or []
        if truncated:
            metrics[f"eval/{name}-truncated_ratio"] = sum(map(bool, truncated)) / len(truncated)
        samples = result.get("samples") or []
        if samples:
            lengths = [s.effective_response_length for s in samples]
            metrics.update(_stats(f"eval/{name}/response_len", lengths, keys=("mean", "max", "min")))
        if args.log_passrate and samples:
            by_prompt: dict = defaultdict(list)
            for sample, reward in zip(samples, rewards):
                by_prompt[sample.group_index].append(reward == 1)
            n = min(len(v) for v in by_prompt.values())
            k = 1
            while k <= n:
                metrics[f"eval/{name}-pass@{k}"] = statistics.fmean(
                    pass_at_k(len(v), sum(v), k) for v in by_prompt.values()
                )
                k *= 2
    return metrics
