"""The default rollout against a scripted stand-in engine: statuses, alignment, fan-out, dynamic
sampling, abort + partial rollout, evaluation, hooks and error messages."""

import asyncio
import json
import threading

import pytest

from slime.rollout import sglang_rollout
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.metrics import compute_eval_metrics, compute_rollout_metrics
from slime.rollout.sglang_rollout import GenerateState, generate, generate_and_rm, generate_rollout, get_model_url
from slime.arguments import parse_args
from slime.utils.async_utils import run
from slime.utils.processing_utils import load_tokenizer
from slime.utils.types import Sample
from tests.rollout.stand_in_engine import Reply, StandInEngine

PROMPT = "what is one plus one"


@pytest.fixture
def engine():
    holder = {"script": lambda payload: Reply(tokens=[5, 6, 7])}
    server = StandInEngine(lambda payload: holder["script"](payload)).start()
    server.holder = holder
    yield server
    server.stop()


def write_prompts(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def make_args(model_dir, prompt_path, engine, *extra):
    args = parse_args([
        "--train-backend", "fsdp", "--rollout-backend", "embedded",
        "--hf-checkpoint", model_dir, "--prompt-data", prompt_path, "--input-key", "input", "--label-key", "label",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2",
        "--rollout-max-response-len", "8", "--sglang-server-concurrency", "4",
        "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", str(engine.port), *extra,
    ])  # fmt: skip
    args.rollout_engine_urls = [engine.url]
    return args


@pytest.fixture
def prompt_file(tmp_path):
    return write_prompts(tmp_path / "p.jsonl", [{"input": f"{PROMPT} {i}", "label": "2"} for i in range(8)])


FINISH_CASES = [
    (Reply(tokens=[5, 6, 2]), Sample.Status.COMPLETED),
    (Reply(tokens=[5, 6], finish={"type": "stop", "matched": "</s>"}), Sample.Status.COMPLETED),
    (Reply(tokens=[5], finish={"type": "stop", "matched": "NaN happened"}), Sample.Status.COMPLETED),
    (Reply(tokens=list(range(3, 20))), Sample.Status.TRUNCATED),  # longer than max_new_tokens=8
    (Reply(tokens=[5, 6], finish={"type": "length", "length": 2}), Sample.Status.TRUNCATED),
    (Reply(tokens=[5], finish={"type": "abort", "message": "Aborted"}), Sample.Status.ABORTED),
    (Reply(tokens=[], finish={"type": "abort", "message": "Abort in waiting queue"}), Sample.Status.ABORTED),
    (Reply(tokens=[], http_status=400, error={"error": {"message": "input too long"}}), Sample.Status.FAILED),
]


@pytest.mark.parametrize("reply,status", FINISH_CASES)
def test_finish_reason_status_mapping(tiny_model_dir, prompt_file, engine, reply, status):
    args = make_args(tiny_model_dir, prompt_file, engine)
    engine.holder["script"] = lambda payload: reply
    sample = run(generate(args, Sample(prompt=PROMPT, index=0), dict(GenerateState(args).sampling_params)))
    assert sample.status == status
    assert sample.response_length == len(sample.loss_mask or []) == len(sample.rollout_log_probs or [])
    if status == Sample.Status.FAILED:
        assert "input too long" in sample.metadata["generate_error"]


def test_tokens_logprobs_masks_alignment_and_request(tiny_model_dir, prompt_file, engine):
    args = make_args(tiny_model_dir, prompt_file, engine, "--rollout-stop", "END", "--rollout-stop-token-ids", "2",
                     "--rollout-skip-special-tokens")  # fmt: skip
    engine.holder["script"] = lambda payload: Reply(tokens=[11, 12, 13], logprobs=[-0.5, -0.25, -0.125])
    prompt_ids = load_tokenizer(tiny_model_dir)(PROMPT, add_special_tokens=False)["input_ids"]
    sample = run(generate(args, Sample(prompt=PROMPT), dict(GenerateState(args).sampling_params)))
    assert sample.tokens == prompt_ids + [11, 12, 13]
    assert sample.response_length == 3 and sample.loss_mask == [1, 1, 1]
    assert sample.rollout_log_probs == [-0.5, -0.25, -0.125]
    assert sample.response == "lmn" and sample.weight_versions == ["7"]
    assert sample.prefix_cache_info.cached_tokens == 1
    request = engine.requests[-1]
    assert request["input_ids"] == prompt_ids and request["return_logprob"] is True
    assert request["sampling_params"] == {
        "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8, "stop": ["END"], "stop_token_ids": [2],
        "skip_special_tokens": True, "no_stop_trim": True, "spaces_between_special_tokens": False,
    }  # fmt: skip
    assert "x-smg-routing-key" not in {k.lower() for k in engine.headers[-1]}


def test_budget_context_and_routing_key(tiny_model_dir, prompt_file, engine):
    args = make_args(tiny_model_dir, prompt_file, engine, "--router-policy", "consistent_hashing",
                     "--rollout-max-context-len", "64")  # fmt: skip
    engine.holder["script"] = lambda payload: Reply(tokens=[9])
    partial = Sample(prompt=PROMPT, tokens=list(range(20)), response_length=5, loss_mask=[1] * 5,
                     rollout_log_probs=[-1.0] * 5, status=Sample.Status.ABORTED, session_id="sess-1")  # fmt: skip
    run(generate(args, partial, dict(GenerateState(args).sampling_params)))
    assert engine.requests[-1]["sampling_params"]["max_new_tokens"] == 3  # 8 - 5 already generated
    assert engine.headers[-1].get("X-SMG-Routing-Key") == "sess-1"
    assert partial.tokens[-1] == 9 and partial.response_length == 6 and partial.status == Sample.Status.COMPLETED
    full = Sample(prompt=PROMPT, tokens=list(range(70)))
    n_requests = len(engine.requests)
    assert run(generate(args, full, dict(GenerateState(args).sampling_params))).status == Sample.Status.TRUNCATED
    assert len(engine.requests) == n_requests  # no request when the budget is 0
    assert get_model_url(args, "default") == f"http://127.0.0.1:{engine.port}/generate"
    args.sglang_model_routers = {"teacher": ("10.0.0.1", 1234)}
    assert get_model_url(args, "teacher", "/health") == "http://10.0.0.1:1234/health"


def test_generate_rollout_groups_rewards_and_hooks(tiny_model_dir, prompt_file, engine):
    args = make_args(tiny_model_dir, prompt_file, engine, "--custom-rm-path",
                     "tests.plugin_contracts.sample_plugins.reward.reward",
                     "--rollout-sample-hook-path", "tests.plugin_contracts.sample_plugins.hooks.tag_sample",
                     "--rollout-sample-filter-path", "tests.plugin_contracts.sample_plugins.hooks.remove_odd",
                     "--rollout-all-samples-process-path", "tests.plugin_contracts.sample_plugins.hooks.record_all")  # fmt: skip
    engine.holder["script"] = lambda payload: Reply(tokens=[0, 0, 1])  # "aab"
    source = RolloutDataSourceWithBuffer(args)
    out = generate_rollout(args, 3, source)
    assert len(out.samples) == 2 and all(len(g) == 2 for g in out.samples)
    leaves = [s for g in out.samples for s in g]
    assert [s.index for s in leaves] == [0, 1, 2, 3]
    assert all(s.reward == 0.5 and s.status == Sample.Status.COMPLETED for s in leaves)
    assert all(s.metadata["hooked_rollout_id"] == 3 for s in leaves)  # sample hook saw the published step
    assert [s.remove_sample for s in leaves] == [False, True, False, True]
    assert args.recorded_all_groups == [0, 2]
    assert len({s.session_id for s in leaves}) == 4


def test_a_group_is_generated_by_one_batched_request(tiny_model_dir, prompt_file, engine):
    """The default generator sends each prompt group as one /generate with input_ids a list of lists
    (the engine prefills the group together); each sample still gets its own answer."""
    args = make_args(tiny_model_dir, prompt_file, engine, "--n-samples-per-prompt", "3",
                     "--rm-type", "random")  # fmt: skip
    calls = iter(range(100))
    engine.holder["script"] = lambda payload: Reply(tokens=[10 + next(calls), 3])
    out = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert len(engine.batches) == 2 and len(engine.requests) == 6  # 2 groups x 3 samples in 2 requests
    for body, group in zip(engine.batches, out.samples):
        prompt_ids = group[0].tokens[: len(group[0].tokens) - group[0].response_length]
        assert body["input_ids"] == [prompt_ids] * 3 and body["sampling_params"]["max_new_tokens"] == 8
        assert body["return_logprob"] is True
    firsts = [s.tokens[-2] for group in out.samples for s in group]
    assert sorted(firsts) == list(range(10, 16))  # every sample has its own scripted answer
    assert all(s.status == Sample.Status.COMPLETED and s.rollout_log_probs == [-0.01, -0.02]
               for group in out.samples for s in group)


@pytest.mark.parametrize("flags", [
    ("--router-policy", "consistent_hashing"),  # one routing key per sample
    ("--sglang-enable-deterministic-inference",),  # one sampling seed per slot
    ("--custom-generate-function-path", "tests.plugin_contracts.sample_plugins.generate.generate"),
])
def test_per_sample_requests_where_a_batch_cannot_express_the_slots(tiny_model_dir, prompt_file, engine, flags):
    args = make_args(tiny_model_dir, prompt_file, engine, "--rm-type", "random", *flags)
    out = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert len(out.samples) == 2 and not engine.batches


def test_batched_groups_respect_the_concurrency_bound(tiny_model_dir, prompt_file, engine):
    """--sglang-server-concurrency 4: groups of 2 take 2 permits each (never more than 4 samples in
    flight); a group of 6, larger than the bound, is sent sample by sample within it."""
    in_flight, peak = [0], [0]
    lock = threading.Lock()

    def script(payload):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        return Reply(tokens=[4, 5, 6], delay_s=0.02)

    original = engine._one

    async def counted(payload, headers):
        try:
            return await original(payload, headers)
        finally:
            with lock:
                in_flight[0] -= 1

    engine._one = counted
    engine.holder["script"] = script
    args = make_args(tiny_model_dir, prompt_file, engine, "--rollout-batch-size", "4", "--rm-type", "random")
    out = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert len(out.samples) == 4 and peak[0] == 4 and len(engine.batches) == 4
    args = make_args(tiny_model_dir, prompt_file, engine, "--rollout-batch-size", "2", "--n-samples-per-prompt", "6",
                     "--rm-type", "random")  # fmt: skip
    peak[0], batches = 0, len(engine.batches)
    out = generate_rollout(args, 1, RolloutDataSourceWithBuffer(args))
    assert [len(g) for g in out.samples] == [6, 6] and all(s.status == Sample.Status.COMPLETED
                                                           for g in out.samples for s in g)
    assert len(engine.batches) == batches and peak[0] == 4


def test_fan_out_groups_share_rollout_id(tiny_model_dir, prompt_file, engine):
    args = make_args(tiny_model_dir, prompt_file, engine, "--custom-generate-function-path",
                     "tests.plugin_contracts.sample_plugins.generate.fanout_generate",
                     "--custom-rm-path", "tests.plugin_contracts.sample_plugins.reward.batched_reward")  # fmt: skip
    out = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert len(out.samples) == 2
    for group in out.samples:
        assert len(group) == 2 and all(isinstance(slot, list) and len(slot) == 2 for slot in group)
        for slot in group:
            assert slot[0].rollout_id == slot[1].rollout_id == slot[0].index
            assert [s.metadata["segment"] for s in slot] == [0, 1]
            assert all(s.reward == 3.0 for s in slot)  # batched RM called with the fan-out list


KIND_ROWS = [{"input": f"q{i}", "label": "x", "metadata": {"kind": k}} for i, k in enumerate("ffmfmfmf")]


async def kind_reward(args, sample, **kwargs):
    if sample.metadata["kind"] == "m":
        return float(sample.index % 2)
    return 1.0


def test_dynamic_sampling_keeps_exactly_batch_and_resamples(tiny_model_dir, tmp_path, engine):
    path = write_prompts(tmp_path / "k.jsonl", KIND_ROWS)
    args = make_args(tiny_model_dir, path, engine, "--custom-rm-path", "tests.rollout.test_sglang_rollout.kind_reward",
                     "--dynamic-sampling-filter-path",
                     "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std")  # fmt: skip
    source = RolloutDataSourceWithBuffer(args)
    calls = []
    original = source.get_samples
    source.get_samples = lambda n: calls.append(n) or original(n)
    out = generate_rollout(args, 0, source)
    assert len(out.samples) == 2
    assert all(s.metadata["kind"] == "m" for g in out.samples for s in g)
    assert len(calls) >= 3 and set(calls) == {2}  # re-sampled in over-sampling batches
    assert out.metrics["rollout/dynamic_filter/drop_zero_std_1.0"] >= 3


def test_dynamic_sampling_fallback_keeps_when_insufficient(tiny_model_dir, tmp_path, engine):
    path = write_prompts(tmp_path / "k.jsonl", [{"input": "q", "label": "x", "metadata": {"kind": "f"}}] * 4)
    args = make_args(tiny_model_dir, path, engine, "--custom-rm-path", "tests.rollout.test_sglang_rollout.kind_reward",
                     "--dynamic-sampling-filter-path",
                     "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback")  # fmt: skip
    out = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert len(out.samples) == 2 and out.metrics is None


def test_dynamic_sampling_that_drops_everything_fails_clearly(tiny_model_dir, tmp_path, engine):
    path = write_prompts(tmp_path / "k.jsonl", [{"input": "q", "label": "x", "metadata": {"kind": "f"}}] * 4)
    args = make_args(tiny_model_dir, path, engine, "--custom-rm-path", "tests.rollout.test_sglang_rollout.kind_reward",
                     "--dynamic-sampling-filter-path",
                     "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std")  # fmt: skip
    from slime.rollout.step_checks import RunCannotLearn

    with pytest.raises(RunCannotLearn, match="kept 0 of 2 groups after drawing 40 prompt groups"):
        generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))


SLOW_TOKENS = [1, 2, 3, 4, 5, 6, 7]


def test_abort_and_partial_rollout_continue_next_step(tiny_model_dir, tmp_path, engine):
    path = write_prompts(tmp_path / "s.jsonl", [{"input": "fast one", "label": "x"}, {"input": "slow one", "label": "x"}])
    slow_ids = load_tokenizer(tiny_model_dir)("slow one", add_special_tokens=False)["input_ids"]

    def script(payload):
        ids = payload["input_ids"]
        if ids[: len(slow_ids)] == slow_ids:
            done = len(ids) - len(slow_ids)
            if done:  # continuation of the partial sample: finish at once
                return Reply(tokens=SLOW_TOKENS[done:], logprobs=[-2.0] * (len(SLOW_TOKENS) - done))
            return Reply(tokens=SLOW_TOKENS, logprobs=[-1.0] * len(SLOW_TOKENS), delay_s=0.15)
        return Reply(tokens=[20, 21, 22], delay_s=0.12)

    engine.holder["script"] = script
    for mask_offpolicy in (False, True):
        extra = ["--rollout-batch-size", "1", "--n-samples-per-prompt", "1", "--over-sampling-batch-size", "2",
                 "--partial-rollout", "--rm-type", "random"] + (["--mask-offpolicy-in-partial-rollout"] * mask_offpolicy)  # fmt: skip
        args = make_args(tiny_model_dir, path, engine, *extra)
        source = RolloutDataSourceWithBuffer(args)
        aborts_before = engine.abort_calls
        first = generate_rollout(args, 0, source)
        assert [s.tokens[-3:] for g in first.samples for s in g] == [[20, 21, 22]]
        assert engine.abort_calls > aborts_before
        assert source.get_buffer_length() == 1
        partial = source.buffer[0][0]
        earlier = partial.response_length
        assert partial.status == Sample.Status.ABORTED and 0 < earlier < len(SLOW_TOKENS)
        assert partial.metadata["start_rollout_id"] == 0 and partial.reward is None

        second = generate_rollout(args, 1, source)
        sample = second.samples[0][0]
        assert sample.index == partial.index and sample.status == Sample.Status.COMPLETED
        assert sample.tokens == slow_ids + SLOW_TOKENS  # earlier tokens kept, continuation appended
        assert sample.response_length == len(SLOW_TOKENS)
        assert sample.rollout_log_probs == [-1.0] * earlier + [-2.0] * (len(SLOW_TOKENS) - earlier)
        expected_mask = [0 if mask_offpolicy else 1] * earlier + [1] * (len(SLOW_TOKENS) - earlier)
        assert sample.loss_mask == expected_mask
        assert sample.metadata["start_rollout_id"] == 0 and sample.reward in (0, 1)
        assert len(sample.weight_versions) == 2


def test_partial_rollout_off_drops_aborted(tiny_model_dir, tmp_path, engine):
    path = write_prompts(tmp_path / "s.jsonl", [{"input": "a", "label": "x"}, {"input": "b", "label": "x"}])
    engine.holder["script"] = lambda p: Reply(tokens=[1, 2, 3], delay_s=0.3 if len(engine.requests) % 2 == 0 else 0)
    args = make_args(tiny_model_dir, path, engine, "--rollout-batch-size", "1", "--n-samples-per-prompt", "1",
                     "--over-sampling-batch-size", "2", "--rm-type", "random")  # fmt: skip
    source = RolloutDataSourceWithBuffer(args)
    out = generate_rollout(args, 0, source)
    assert len(out.samples) == 1 and source.get_buffer_length() == 0


async def failing_reward(args, sample, **kwargs):
    raise RuntimeError("judge exploded")


def test_reward_failure_marks_sample_failed(tiny_model_dir, prompt_file, engine, caplog):
    args = make_args(tiny_model_dir, prompt_file, engine, "--custom-rm-path",
                     "tests.rollout.test_sglang_rollout.failing_reward")  # fmt: skip
    out = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    leaves = [s for g in out.samples for s in g]
    assert all(s.status == Sample.Status.FAILED and s.reward == 0.0 for s in leaves)
    assert leaves[0].metadata["reward_error"] == "RuntimeError: judge exploded"
    assert "judge exploded" in caplog.text


async def reward_failing_on_sample_2(args, sample, **kwargs):
    if sample.index == 2:
        raise ValueError("unparsable answer")
    return 1.0


def test_reward_failing_on_one_sample_fails_only_that_sample(tiny_model_dir, prompt_file, engine, caplog):
    """As docs/customization.md says: that sample becomes FAILED with reward 0 and the error in its
    metadata, the log names it, its group keeps all its samples, and the step trains on all of them
    (FAILED is trained like COMPLETED), the failed one with reward 0 in its group's normalisation."""
    from slime.backends.training.train_data import convert_samples_to_train_data

    args = make_args(tiny_model_dir, prompt_file, engine, "--custom-rm-path",
                     "tests.rollout.test_sglang_rollout.reward_failing_on_sample_2")  # fmt: skip
    out = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert [len(group) for group in out.samples] == [2, 2]
    leaves = sorted((s for g in out.samples for s in g), key=lambda s: s.index)
    assert [s.index for s in leaves] == [0, 1, 2, 3]
    failed = [s for s in leaves if s.status == Sample.Status.FAILED]
    assert [s.index for s in failed] == [2] and failed[0].reward == 0.0
    assert failed[0].metadata["reward_error"] == "ValueError: unparsable answer"
    assert all(s.reward == 1.0 and s.status == Sample.Status.COMPLETED for s in leaves if s.index != 2)
    assert "reward failed for sample(s) [2] of group(s) [1]" in caplog.text and "unparsable answer" in caplog.text
    data = convert_samples_to_train_data(args, leaves)
    assert data["sample_indices"] == [0, 1, 2, 3] and data["raw_reward"] == [1.0, 1.0, 0.0, 1.0]
    assert data["rewards"][2] < 0 < data["rewards"][3]  # group 1 normalised with the failed sample in it


def test_remote_reward_model_that_times_out_fails_its_samples_not_the_run(tiny_model_dir, prompt_file, engine,
                                                                         monkeypatch, caplog):
    """--rm-url pointing at a server that accepts connections and never answers: each attempt times
    out, the retries run out, every sample is FAILED (reward 0) with the URL and the timeout in its
    reward_error, each group is whole, and the rollout returns."""
    import socket

    from slime.rollout.rm_hub import remote as remote_rm_module

    monkeypatch.setattr(remote_rm_module, "REQUEST_TIMEOUT_S", 0.2)
    monkeypatch.setattr(remote_rm_module, "BACKOFF_BASE_S", 0.001)
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)
        url = f"http://127.0.0.1:{hung.getsockname()[1]}/rm"
        args = make_args(tiny_model_dir, prompt_file, engine, "--rm-type", "remote_rm", "--rm-url", url)
        out = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert [len(group) for group in out.samples] == [2, 2]
    for sample in (s for g in out.samples for s in g):
        assert sample.status == Sample.Status.FAILED and sample.reward == 0.0
        error = sample.metadata["reward_error"]
        assert error.startswith(f"RemoteRewardError: remote reward model {url} failed after 10 attempts") and "Timeout" in error
    assert "reward failed for sample(s)" in caplog.text


def test_group_rm(tiny_model_dir, prompt_file, engine):
    args = make_args(tiny_model_dir, prompt_file, engine, "--group-rm", "--custom-rm-path",
                     "tests.plugin_contracts.sample_plugins.reward.batched_reward")  # fmt: skip
    out = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert all(s.reward == 3.0 for g in out.samples for s in g)


def test_request_abort_mode(tiny_model_dir, tmp_path, engine):
    path = write_prompts(tmp_path / "s.jsonl", [{"input": "a", "label": "x"}, {"input": "b", "label": "x"}])
    args = make_args(tiny_model_dir, path, engine, "--rollout-batch-size", "1", "--n-samples-per-prompt", "1",
                     "--over-sampling-batch-size", "2", "--rm-type", "random", "--partial-rollout",
                     "--custom-generate-function-path", "tests.plugin_contracts.sample_plugins.hooks.request_mode_generate")  # fmt: skip
    source = RolloutDataSourceWithBuffer(args)
    out = generate_rollout(args, 0, source)
    assert len(out.samples) == 1
    assert source.buffer[0][0].status == Sample.Status.ABORTED  # cancelled, not server-aborted


def test_eval_rollout_several_datasets(tiny_model_dir, tmp_path, engine):
    a = write_prompts(tmp_path / "a.jsonl", [{"input": "x", "label": "aab"}, {"input": "y", "label": "zzz"}])
    b = write_prompts(tmp_path / "b.jsonl", [{"input": "z", "label": "aab"}])
    engine.holder["script"] = lambda payload: Reply(tokens=[0, 0, 1])
    args = make_args(tiny_model_dir, a, engine, "--eval-prompt-data", "first", a, "second", b,
                     "--n-samples-per-eval-prompt", "3", "--rm-type", "f1", "--log-passrate",
                     "--eval-max-response-len", "2")  # fmt: skip
    out = generate_rollout(args, 0, None, evaluation=True)
    assert set(out.data) == {"first", "second"}
    first = out.data["first"]
    assert len(first["rewards"]) == len(first["truncated"]) == len(first["samples"]) == 6
    assert [s.index for s in first["samples"]] == list(range(6))
    assert all(first["truncated"])  # eval max response len 2 < 3 scripted tokens
    assert engine.requests[-1]["sampling_params"]["max_new_tokens"] == 2
    assert len(engine.batches) == 3 and len(engine.requests) == 9  # each prompt's 3 samples in one request
    metrics = compute_eval_metrics(args, out.data)
    assert metrics["eval/first-truncated_ratio"] == 1.0 and "eval/second-pass@2" in metrics


def test_rollout_metrics():
    args = parse_args(["--train-backend", "fsdp", "--rollout-backend", "embedded", "--rollout-batch-size", "2",
                       "--num-rollout", "1"])  # fmt: skip
    samples = [
        Sample(group_index=0, index=0, response_length=4, loss_mask=[1, 1, 0, 0], reward=1.0,
               status=Sample.Status.TRUNCATED, response="abababababab"),
        Sample(group_index=0, index=1, response_length=2, reward=1.0, status=Sample.Status.COMPLETED),
        Sample(group_index=1, index=2, response_length=6, reward=0.0, status=Sample.Status.COMPLETED),
        Sample(group_index=1, index=3, response_length=8, reward=1.0, status=Sample.Status.COMPLETED),
    ]  # fmt: skip
    m = compute_rollout_metrics(args, samples, rollout_time=2.0)
    assert m["rollout/response_len/mean"] == 4.5 and m["rollout/response_len/max"] == 8
    assert m["rollout/truncated_ratio"] == 0.25 and m["rollout/zero_std/count_1"] == 1
    assert m["rollout/raw_reward/mean"] == 0.75 and m["rollout/repetition_frac"] == 0.25
    assert m["perf/rollout_time"] == 2.0 and m["perf/longest_sample_tokens_per_sec"] == 4.0
    assert m["perf/tokens_per_gpu_per_sec"] == 20 / 2.0


def test_bad_inputs(tiny_model_dir, prompt_file, engine):
    args = make_args(tiny_model_dir, prompt_file, engine)
    params = dict(GenerateState(args).sampling_params)
    with pytest.raises(ValueError, match="accepts PENDING or ABORTED samples; sample 4 is Status.COMPLETED"):
        run(generate(args, Sample(index=4, status=Sample.Status.COMPLETED), params))
    engine.holder["script"] = lambda payload: Reply(tokens=[3], omit_logprobs=True)
    with pytest.raises(ValueError, match="without meta_info.output_token_logprobs"):
        run(generate(args, Sample(prompt="x"), params))
    args.rollout_sample_hook_path = ["tests.plugin_contracts.sample_plugins.hooks.bad_hook"]
    with pytest.raises(TypeError, match="returned int; expected Sample or None"):
        run(sglang_rollout.apply_rollout_sample_hooks(args, Sample()))
    with pytest.raises(ValueError, match="evaluation needs eval datasets"):
        run(sglang_rollout.eval_rollout(args, 0))
    args.rollout_global_dataset = False
    with pytest.raises(ValueError, match="needs the global dataset"):
        generate_rollout(args, 0, None)
    args.sglang_router_ip = None
    with pytest.raises(ValueError, match="needs the router address"):
        get_model_url(args, "default")
    source = RolloutDataSourceWithBuffer(make_args(tiny_model_dir, prompt_file, engine))
    with pytest.raises(ValueError, match="n_samples_per_prompt=2 samples, got 1"):
        source.add_samples([[Sample()]])
    with pytest.raises(TypeError, match="list of prompt groups"):
        source.add_samples([Sample()])
    assert asyncio.iscoroutinefunction(generate_and_rm)
