"""The tool-use example's generate function inside one real rollout step (``generate_rollout``).

The engine serves the scripted tiny model (it has not learnt the weather task), so the episodes
are whatever it samples; what is checked is the plumbing a training step relies on: fan-out lists of
exact-token samples, one rollout id per episode, the example's reward on every segment.
"""

import json

import pytest

from examples.tool_use.task import build
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sglang_rollout import generate_rollout
from slime.utils.arguments import parse_args
from slime.utils.types import Sample

pytestmark = pytest.mark.timeout(300)


def test_one_rollout_step_of_the_example(engine, scripted_model_dir, tmp_path):
    pytest.importorskip("openai")
    data = build(tmp_path, num_train=4, num_eval=1, num_sft=1)
    host, port = engine.url.rsplit("//", 1)[1].split(":")
    args = parse_args([
        "--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", scripted_model_dir,
        "--prompt-data", data["train"], "--input-key", "messages", "--label-key", "label", "--tool-key", "tools",
        "--custom-generate-function-path", "examples.tool_use.generate.generate",
        "--custom-rm-path", "examples.tool_use.reward.reward", "--sglang-tool-call-parser", "qwen25",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "24",
        "--rollout-max-context-len", "480", "--num-rollout", "1", "--rollout-temperature", "1.0",
        "--sglang-router-ip", host, "--sglang-router-port", port,
    ])  # fmt: skip
    args.rollout_engine_urls = [engine.url]
    output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))

    assert len(output.samples) == 2
    for group in output.samples:
        assert len(group) == 2 and all(isinstance(episode, list) and episode for episode in group)
        for episode in group:
            assert len({s.rollout_id for s in episode}) == 1 and len({s.reward for s in episode}) == 1
            for sample in episode:
                assert sample.status == Sample.Status.COMPLETED and sample.reward in (0.0, 0.25, 0.5, 1.0)
                assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length > 0
                assert len(sample.tokens) <= 480 and sample.tokens[:len(sample.tokens) - sample.response_length]
                assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if not m)
                assert 1 <= sample.metadata["turns"] <= 3 and "final_answer" in sample.metadata
                json.dumps(sample.metadata)  # plain data, dumpable with the rollout
