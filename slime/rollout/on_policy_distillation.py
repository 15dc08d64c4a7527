"""On-policy distillation with a teacher served by a second engine (``--use-opd --opd-type sglang``).

The student samples responses as usual; each finished sample's full token sequence (prompt +
response) is scored by the teacher — an SGLang-protocol ``/generate`` at ``--rm-url`` (an SGLang
server or slime's embedded engine) asked for no new tokens and the log-prob of every input token.
The trainer then shapes every response token's advantage with the per-token reverse KL estimate
(Agarwal et al. 2024, "On-Policy Distillation of Language Models"):

    A_t ← A_t − λ · (log π_old(y_t) − log π_teacher(y_t)),    λ = --opd-kl-coef

(``slime.algorithms.functional.apply_opd``; the difference is logged as ``train/opd_reverse_kl``). With the
zero task reward below, the policy-gradient loss with these advantages is the REINFORCE estimator
of λ · KL(π ‖ π_teacher) over the student's own samples.

Wiring::

    --use-opd --opd-type sglang --rm-url http://TEACHER/generate
    --custom-rm-path slime.rollout.on_policy_distillation.reward_func
    --custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards

``reward_func`` stores the teacher's raw answer as the sample's reward; ``post_process_rewards``
moves the response's teacher log-probs to ``sample.teacher_log_probs`` and returns zero rewards.
Teacher and student must share a tokenizer (the teacher scores the student's token ids).
"""

from __future__ import annotations

from slime.utils.http_utils import post
from slime.utils.types import Sample

__all__ = ["reward_func", "post_process_rewards", "teacher_payload"]


def teacher_payload(args, sample: Sample) -> dict:
    """The teacher request: the whole sequence as input, no new tokens, every input token's log-prob."""
    payload = {
        "input_ids": list(sample.tokens),
        "sampling_params": {"temperature": args.rollout_temperature, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    images = (sample.multimodal_inputs or {}).get("images")
    if images:
        payload["image_data"] = images
    return payload


async def reward_func(args, sample: Sample, **kwargs) -> dict:
    """``--custom-rm-path``: the teacher's raw ``/generate`` answer for the sample (stored as its reward)."""
    if not args.rm_url:
        raise ValueError("on_policy_distillation.reward_func needs --rm-url: the teacher's /generate URL "
                         "(e.g. http://127.0.0.1:30001/generate)")
    if not sample.tokens:
        raise ValueError(f"sample {sample.index} has no tokens to score with the teacher")
    return await post(args.rm_url, teacher_payload(args, sample))


def _teacher_response_log_probs(sample: Sample, answer) -> list[float]:
    if not isinstance(answer, dict) or "meta_info" not in answer:
        raise ValueError(f"sample {sample.index}: the reward is not a teacher /generate answer (a dict with "
                         f"meta_info); use --custom-rm-path slime.rollout.on_policy_distillation.reward_func")
    entries = answer["meta_info"].get("input_token_logprobs") or []
    log_probs = [float(entry[0]) for entry in entries[1:]]  # the first token has no log-prob (null)
    if len(log_probs) != len(sample.tokens) - 1:
        raise ValueError(f"sample {sample.index}: the teacher returned {len(log_probs) + 1} input log-probs for "
                         f"{len(sample.tokens)} tokens (logprob_start_len=0 expected)")
    if sample.response_length == 0:
        return []
    return log_probs[-sample.response_length:]


def post_process_rewards(args, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """``--custom-reward-post-process-path``: teacher log-probs to ``sample.teacher_log_probs``; zero rewards."""
    if args.reward_key:
        raise ValueError(f"on_policy_distillation.post_process_rewards reads the teacher's whole answer as the reward; "
                         f"unset --reward-key (got {args.reward_key!r})")
    for sample in samples:
        sample.teacher_log_probs = _teacher_response_log_probs(sample, sample.get_reward_value(args))
    zeros = [0.0] * len(samples)
    return zeros, list(zeros)
