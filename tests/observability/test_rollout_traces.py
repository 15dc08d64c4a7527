"""Traces recorded by the default rollout (docs/INTERFACES.md §3.6), against the scripted stand-in engine:
span tree per sample, engine attributes, rewards, filters, fan-out, partial-rollout attempts, and
the rollout debug dump carrying them."""

import json

import pytest
import torch

from slime.observability.rollout_data_utils import load_debug_rollout_data, save_debug_rollout_data
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sglang_rollout import generate_rollout
from slime.arguments import parse_args
from slime.utils.processing_utils import load_tokenizer
from slime.utils.types import Sample
from tests.rollout.stand_in_engine import Reply, StandInEngine

PD_META = {"pd_prefill_forward_duration": 0.004, "pd_decode_transfer_duration": 0.002,
           "pd_decode_forward_duration": 0.01, "pd_transfer_speed_gb_s": 3.0}


@pytest.fixture
def engine():
    holder = {"script": lambda payload: Reply(tokens=[5, 6, 7], extra_meta=PD_META)}
    server = StandInEngine(lambda payload: holder["script"](payload)).start()
    server.holder = holder
    yield server
    server.stop()


def make_args(model_dir, tmp_path, engine, *extra, rows=None):
    rows = rows or [{"input": f"what is {i} plus one", "label": "2"} for i in range(8)]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    args = parse_args([
        "--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", model_dir,
        "--prompt-data", str(path), "--input-key", "input", "--label-key", "label",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2",
        "--rollout-max-response-len", "8", "--sglang-server-concurrency", "4",
        "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", str(engine.port), *extra])  # fmt: skip
    args.rollout_engine_urls = [engine.url]
    return args


def span_tree(sample):
    """[(name, parent name, start attrs, end attrs)] of the sample's closed spans, in start order."""
    events = sample.trace["events"]
    starts = {e["span_id"]: e for e in events if e["type"] == "span_start"}
    ends = {e["span_id"]: e for e in events if e["type"] == "span_end"}
    assert set(starts) == set(ends), "every span that started also ended"
    return [(s["name"], starts[s["parent_span_id"]]["name"] if s.get("parent_span_id") in starts else None,
             s.get("attrs", {}), ends[sid].get("attrs", {})) for sid, s in starts.items()]


def test_default_rollout_span_tree(tiny_model_dir, tmp_path, engine):
    args = make_args(tiny_model_dir, tmp_path, engine, "--rm-type", "random", "--dynamic-sampling-filter-path",
                     "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback")
    out = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    samples = [s for group in out.samples for s in group]
    assert len(samples) == 4 and len({s.trace["trace_id"] for s in samples}) == 4
    for sample in samples:
        assert (sample.trace["sample_id"], sample.trace["group_id"]) == (sample.index, sample.group_index)
        tree = {name: (parent, start, end) for name, parent, start, end in span_tree(sample)}
        assert tree["generate_and_rm_group"][0] is None and tree["generate_and_rm_group"][1] == {"group_size": 2}
        assert tree["generate_and_rm"][0] == "generate_and_rm_group"
        assert tree["generate_and_rm"][2]["status"] == "completed"
        parent, start, end = tree["sglang_generate"]
        assert parent == "generate_and_rm" and start == {"max_new_tokens": 8, "batch_size": 2}  # the group in one request
        assert end["prompt_tokens"] == len(sample.tokens) - 3 and end["completion_tokens"] == 3
        assert end["finish_reason"] == "stop" and end["sglang_request_id"].startswith("req-")
        assert tree["sglang_pd_prefill"][0] == "sglang_generate" and tree["sglang_pd_decode"][0] == "sglang_generate"
        assert tree["pd_decode_forward"][0] == "sglang_pd_decode"
        assert tree["reward_model"][0] == "generate_and_rm" and tree["reward_model"][2] == {"reward": sample.reward}
        names = [e["name"] for e in sample.trace["events"] if e["type"] == "event"]
        assert "sglang_pd_summary" in names and "dynamic_filter" in names

    dump = save_debug_rollout_data(str(tmp_path / "dump" / "{rollout_id}.pt"), samples, rollout_id=0, evaluation=False)
    payload = torch.load(dump, weights_only=False)
    assert [d["trace"] for d in payload["samples"]] == [s.trace for s in samples]
    assert load_debug_rollout_data(str(tmp_path / "dump" / "{rollout_id}.pt"), rollout_id=0)[0].trace == samples[0].trace


def test_fan_out_samples_continue_the_slot_trace(tiny_model_dir, tmp_path, engine):
    args = make_args(tiny_model_dir, tmp_path, engine, "--custom-generate-function-path",
                     "tests.plugin_contracts.sample_plugins.generate.fanout_generate",
                     "--custom-rm-path", "tests.plugin_contracts.sample_plugins.reward.batched_reward")
    out = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    for group in out.samples:
        for first, second in group:
            assert first.trace["trace_id"] == second.trace["trace_id"] and first.trace is not second.trace
            for sample in (first, second):
                names = [name for name, *_ in span_tree(sample)]
                assert names.count("sglang_generate") == 1  # generated once, before the split
                assert {"generate_and_rm_group", "generate_and_rm", "group_reward_model"} <= set(names)


SLOW = [1, 2, 3, 4, 5, 6, 7]


def test_partial_rollout_retry_is_a_new_attempt(tiny_model_dir, tmp_path, engine):
    slow_ids = load_tokenizer(tiny_model_dir)("slow one", add_special_tokens=False)["input_ids"]

    def script(payload):
        ids = payload["input_ids"]
        if ids[: len(slow_ids)] == slow_ids:
            done = len(ids) - len(slow_ids)
            return Reply(tokens=SLOW[done:]) if done else Reply(tokens=SLOW, delay_s=0.15)
        return Reply(tokens=[20, 21, 22], delay_s=0.12)

    engine.holder["script"] = script
    args = make_args(tiny_model_dir, tmp_path, engine, "--rollout-batch-size", "1", "--n-samples-per-prompt", "1",
                     "--over-sampling-batch-size", "2", "--partial-rollout", "--rm-type", "random",
                     rows=[{"input": "fast one", "label": "x"}, {"input": "slow one", "label": "x"}])
    source = RolloutDataSourceWithBuffer(args)
    generate_rollout(args, 0, source)
    partial = source.buffer[0][0]
    assert partial.status == Sample.Status.ABORTED and partial.trace["attempt"] == 0
    sample = generate_rollout(args, 1, source).samples[0][0]
    assert sample.index == partial.index and sample.trace["attempt"] == 1
    events = sample.trace["events"]
    names = [e["name"] for e in events]
    assert names.index("recycled_for_partial_rollout") < names.index("attempt_start")
    generations = [(e["attempt"], (e.get("attrs") or {}).get("finish_reason"))
                   for e in events if e["name"] == "sglang_generate" and e["type"] == "span_end"]
    assert generations == [(0, "abort"), (1, "stop")]
