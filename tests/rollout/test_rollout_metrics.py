"""--log-multi-turn, --log-correct-samples and --log-reward-category on a known rollout step: the metric
values computed by hand from the samples below."""

import logging

from slime.rollout.metrics import compute_rollout_metrics
from slime.arguments import parse_args
from slime.utils.types import Sample


def _args(*extra):
    return parse_args(["--train-backend", "fsdp", "--rollout-backend", "embedded", "--debug-rollout-only",
                       "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
                       "--rollout-max-response-len", "8", *extra])


def _sample(index, mask, reward, status=Sample.Status.COMPLETED, **metadata):
    return Sample(index=index, group_index=index // 2, tokens=[1, 2] + [3] * len(mask), response_length=len(mask),
                  loss_mask=mask, reward=reward, status=status, metadata=dict(metadata))


def known_rollout():
    """Two agentic samples (model, tool observation, model), one plain, one cut at the length limit."""
    return [
        _sample(0, [1, 1, 0, 0, 0, 1], {"score": 1, "why": "ok"}),  # 2 model turns, 3 model tokens
        _sample(1, [1, 0, 0, 1, 0, 1, 1], {"score": 0, "why": "wrong_answer"}),  # 3 turns, 4 model tokens
        _sample(2, [1, 1], {"score": 1, "why": "ok"}, round_number=5),  # the rollout's own turn count wins
        _sample(3, [1] * 8, {"score": 0, "why": "no_answer"}, status=Sample.Status.TRUNCATED),
    ]


def test_multi_turn_metrics():
    metrics = compute_rollout_metrics(_args("--log-multi-turn", "--reward-key", "score"), known_rollout(), 1.0)
    prefix = "multi_turn/"
    assert metrics[prefix + "raw_response_length/response_length_mean"] == (6 + 7 + 2 + 8) / 4
    assert metrics[prefix + "raw_response_length/response_length_max"] == 8
    assert metrics[prefix + "raw_response_length/response_length_min"] == 2
    assert metrics[prefix + "raw_response_length/response_length_clip_ratio"] == 0.25
    assert metrics[prefix + "wo_obs_response_length/response_length_mean"] == (3 + 4 + 2 + 8) / 4
    assert metrics[prefix + "wo_obs_response_length/response_length_min"] == 2
    assert metrics[prefix + "multi_turn_metric/round_number_mean"] == (2 + 3 + 5 + 1) / 4
    assert metrics[prefix + "multi_turn_metric/round_number_max"] == 5
    assert metrics[prefix + "multi_turn_metric/round_number_min"] == 1
    assert not any(k.startswith(prefix) for k in compute_rollout_metrics(_args("--reward-key", "score"), known_rollout(), 1.0))


def test_correct_sample_metrics():
    metrics = compute_rollout_metrics(_args("--log-correct-samples", "--reward-key", "score"), known_rollout(), 1.0)
    assert metrics["rollout/correct_ratio"] == 0.5
    # correct samples' effective lengths: [2, 3] -> nearest-rank percentiles
    assert [metrics[f"rollout/correct_length/p{q}"] for q in (25, 50, 75, 100)] == [2.0, 2.0, 3.0, 3.0]
    none_correct = [_sample(0, [1, 1], 0.0), _sample(1, [1], 0.5)]
    metrics = compute_rollout_metrics(_args("--log-correct-samples"), none_correct, 1.0)
    assert metrics["rollout/correct_ratio"] == 0 and "rollout/correct_length/p50" not in metrics


def test_reward_category_metrics(caplog):
    metrics = compute_rollout_metrics(_args("--log-reward-category", "why", "--reward-key", "score"), known_rollout(), 1.0)
    categories = {k: v for k, v in metrics.items() if k.startswith("rollout/error_cat/")}
    assert categories == {"rollout/error_cat/ok": 0.5, "rollout/error_cat/wrong_answer": 0.25,
                          "rollout/error_cat/no_answer": 0.25}
    with caplog.at_level(logging.WARNING, logger="slime.rollout.metrics"):
        metrics = compute_rollout_metrics(_args("--log-reward-category", "reason", "--reward-key", "score"),
                                          known_rollout(), 1.0)
    assert not any(k.startswith("rollout/error_cat/") for k in metrics)
    assert "--log-reward-category 'reason'" in caplog.text  # a mistyped key is named, not silently empty



def test_spec_metrics_sum_the_engine_counters_over_samples():
    """Two samples' final meta_info as the embedded engine (or SGLang) sends it: 9 of 12 drafts accepted
    over 5 verify steps for 13 + 7 tokens; the metrics are ratios of the sums, not means of ratios."""
    args = _args("--sglang-speculative-algorithm", "NGRAM")
    samples = known_rollout()[:2]
    metas = [{"spec_num_correct_drafts": 8, "spec_num_proposed_drafts": 9, "spec_verify_ct": 3, "completion_tokens": 13},
             {"spec_num_correct_drafts": 1, "spec_num_proposed_drafts": 3, "spec_verify_ct": 2, "completion_tokens": 7}]
    for sample, meta in zip(samples, metas):
        sample.spec_info.add(meta)
    metrics = compute_rollout_metrics(args, samples, rollout_time=1.0)
    assert metrics["rollout/spec_accept_rate"] == 9 / 12
    assert metrics["rollout/spec_accept_length"] == 20 / 5
    assert "rollout/spec_accept_rate" not in compute_rollout_metrics(_args(), samples, rollout_time=1.0)
