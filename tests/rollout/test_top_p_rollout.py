"""``--rollout-top-p`` ≠ 1 end to end on the tiny model: the default rollout asks the embedded
engine for its kept nucleus, the samples carry it (fields 17-18), the train data carries it, and
the FSDP trainer renormalises its log-probs over it.

What must match what (docs/SGLANG_PROTOCOL.md §2.4): the engine's ``output_token_logprobs`` are the
full-vocabulary log-softmax at the sampled token, *before* top-p renormalisation; the trainer's
log-probs are renormalised over the nucleus S. So, against an independent HF forward:

* engine log-prob  = log p_t                       (full vocabulary)
* trainer log-prob = log p_t − log Σ_{v∈S} p_v     (= the log-prob of the distribution actually sampled)
* S is the nucleus of p at 0.7: the smallest top set whose mass reaches 0.7, and it holds the sampled token.
"""

import json

import pytest
import torch

from slime.backends.embedded_engine.serving.launch import running_engine
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.metrics import compute_rollout_metrics
from slime.rollout.sglang_rollout import generate_rollout
from slime.arguments import parse_args
from slime.backends.training.train_data import convert_samples_to_train_data, split_train_data_by_dp

pytestmark = [pytest.mark.timeout(300)]

TOP_P, TEMPERATURE = 0.7, 0.9


def _spans(sample):
    ids, offsets = list(sample.rollout_top_p_token_ids), list(sample.rollout_top_p_token_offsets)
    return [ids[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def test_top_p_nucleus_from_engine_to_trainer(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from slime.backends.training.worker import TrainWorker
    from tests.backends.fsdp_utils.fsdp_test_utils import ensure_single_rank_group

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"count {i} to", "label": str(i)}) for i in range(4)) + "\n")
    with running_engine(tiny_model_dir, extra_args=["--context-length", "256"]) as engine:
        args = parse_args([
            "--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", tiny_model_dir,
            "--prompt-data", str(prompts), "--input-key", "prompt", "--label-key", "label",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
            "--rollout-max-response-len", "12", "--rollout-temperature", str(TEMPERATURE),
            "--rollout-top-p", str(TOP_P), "--rm-type", "random", "--num-steps-per-rollout", "1",
            "--sglang-router-ip", engine.host, "--sglang-router-port", str(engine.port), "--seed", "0",
        ])  # fmt: skip
        args.rollout_engine_urls = [engine.url]
        output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    samples = [s for group in output.samples for s in group]
    assert len(samples) == 4

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    expected_trainer, positions, kept_total = [], 0, 0
    for sample in samples:
        spans = _spans(sample)
        assert len(spans) == sample.response_length > 0
        tokens = torch.tensor(sample.tokens)
        with torch.no_grad():
            logits = reference(tokens[None]).logits[0].double()
        prompt_len = len(sample.tokens) - sample.response_length
        log_p = torch.log_softmax(logits[prompt_len - 1 : -1] / TEMPERATURE, dim=-1)
        renormalised = []
        for k, (span, token) in enumerate(zip(spans, sample.tokens[prompt_len:])):
            p = log_p[k].exp()
            assert token in span
            mass = float(p[span].sum())
            smallest = float(p[span].min())
            assert mass >= TOP_P - 1e-5 and mass - smallest < TOP_P + 1e-5, (k, mass, smallest)
            assert sorted(span) == sorted(int(v) for v in torch.argsort(p, descending=True)[: len(span)])
            assert sample.rollout_log_probs[k] == pytest.approx(float(log_p[k, token]), abs=1e-4)
            renormalised.append(float(log_p[k, token]) - torch.log(torch.tensor(mass)).item())
            positions, kept_total = positions + 1, kept_total + len(span)
        expected_trainer.append(torch.tensor(renormalised))
    metrics = compute_rollout_metrics(args, samples, rollout_time=1.0)
    assert metrics["rollout/top_p_kept_vocab_per_token"] == pytest.approx(kept_total / positions)
    # the top ⌈0.7·V⌉ tokens always hold ≥ 70% of the mass, so a nucleus is never larger
    assert 1.0 <= metrics["rollout/top_p_kept_vocab_per_token"] <= TOP_P * reference.config.vocab_size + 1

    ensure_single_rank_group()
    data = split_train_data_by_dp(args, convert_samples_to_train_data(args, samples), 1)[0]
    assert all(t.dtype == torch.int32 for t in data.rollout_top_p_token_ids)
    worker = TrainWorker(args)
    worker.init()
    computed = worker.compute_log_probs(data)["log_probs"]
    for got, want, engine_lp in zip(computed, expected_trainer, data.rollout_log_probs):
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=0)
        assert bool((got >= engine_lp - 1e-4).all())  # renormalising over S only raises log-probs
    metrics = worker.train(0, data)
    assert metrics["train/ppo_kl"] == 0.0 and metrics["train/pg_clipfrac"] == 0.0
    # |log π_old − log μ| = the mean −log(nucleus mass): the engine's log-probs are not renormalised
    assert metrics["train/train_rollout_logprob_abs_diff"] > 1e-3

    broken = data.replace(rollout_top_p_token_offsets=[o[:-1] for o in data.rollout_top_p_token_offsets])
    with pytest.raises(ValueError, match="rollout_top_p_token_offsets must have response_length"):
        worker.compute_log_probs(broken)
    with pytest.raises(ValueError, match="--rollout-top-p != 1 needs rollout_top_p_token_ids"):
        worker.compute_log_probs(data.replace(rollout_top_p_token_ids=None, rollout_top_p_token_offsets=None))
