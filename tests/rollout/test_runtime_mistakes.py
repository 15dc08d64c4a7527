"""Faults met while the run is going: a reward that hangs or is a plain ``def``, a step where every sample
failed, an engine that died, prompts longer than the context. Each asserts what the user sees."""

import asyncio
import json
import threading
import time
from argparse import Namespace

import pytest

from slime.rollout.step_checks import RunCannotLearn, check_step_can_learn
from slime.utils.types import Sample

HOOKS = "tests.rollout.test_runtime_mistakes"


async def hanging_reward(args, sample, **kwargs):
    await asyncio.sleep(3600)


RELEASE = threading.Event()  # set once the rewards were awaited: the blocked worker thread then returns


def slow_sync_reward(args, sample, **kwargs):
    if sample.index == 0:
        RELEASE.wait(30)
    return float(sample.index)


def raising_reward(args, sample, **kwargs):
    raise KeyError("label")


def _args(**overrides):
    values = dict(custom_rm_path=None, reward_timeout=None, reward_key=None, eval_reward_key=None, rm_type=None,
                  stop_on_failed_ratio=1.0, rollout_sample_filter_path=None)
    values.update(overrides)
    return Namespace(**values)


def _samples(n, status=Sample.Status.COMPLETED):
    return [Sample(index=i, prompt="p", tokens=[1, 2, 3], response_length=1, status=status, metadata={})
            for i in range(n)]


def _reward(args, samples):
    from slime.rollout.sglang_rollout import _reward_one

    async def go():
        RELEASE.clear()
        await asyncio.gather(*(_reward_one(args, s, evaluation=False) for s in samples))
        RELEASE.set()

    asyncio.run(go())


# ----------------------------------------------------------------------------- rewards

def test_reward_over_the_timeout_fails_its_sample_with_the_reason_and_the_rest_go_on():
    args = _args(custom_rm_path=f"{HOOKS}.slow_sync_reward", reward_timeout=1.0)
    samples = _samples(3)
    start = time.monotonic()
    _reward(args, samples)
    assert time.monotonic() - start < 10  # sample 0 alone would block for 30 s
    assert samples[0].status == Sample.Status.FAILED and samples[0].reward == 0.0
    assert "did not return within --reward-timeout 1 s" in samples[0].metadata["reward_error"]
    assert [s.reward for s in samples[1:]] == [1.0, 2.0] and samples[1].status == Sample.Status.COMPLETED


def test_hanging_async_reward_is_cut_by_the_timeout():
    args = _args(custom_rm_path=f"{HOOKS}.hanging_reward", reward_timeout=0.2)
    samples = _samples(2)
    start = time.monotonic()
    _reward(args, samples)
    assert time.monotonic() - start < 10 and all(s.status == Sample.Status.FAILED for s in samples)


def test_plain_def_reward_is_called():
    args = _args(custom_rm_path=f"{HOOKS}.slow_sync_reward")
    samples = _samples(3)[1:]  # sample 0 would wait for RELEASE
    _reward(args, samples)
    assert [s.reward for s in samples] == [1.0, 2.0] and all(s.status != Sample.Status.FAILED for s in samples)


# ----------------------------------------------------------------------------- steps that cannot learn

def test_a_step_where_every_reward_raised_stops_the_run_with_the_first_reason():
    args = _args(custom_rm_path=f"{HOOKS}.raising_reward")
    samples = _samples(4)
    _reward(args, samples)
    with pytest.raises(RunCannotLearn) as error:
        check_step_can_learn(args, samples, rollout_id=3)
    message = str(error.value)
    assert "rollout step 3: 4 of 4 samples FAILED (--stop-on-failed-ratio 1)" in message
    assert "First failure (sample 0): reward_error: KeyError: 'label'" in message


def test_a_step_with_some_failures_goes_on_unless_the_ratio_says_stop():
    samples = _samples(4)
    for sample in samples[:2]:
        sample.status = Sample.Status.FAILED
        sample.metadata["generate_error"] = "POST answered 400: prompt too long"
    check_step_can_learn(_args(), samples, rollout_id=0)  # 2 of 4 < 1.0
    with pytest.raises(RunCannotLearn, match="2 of 4 samples FAILED .*generate_error: POST answered 400"):
        check_step_can_learn(_args(stop_on_failed_ratio=0.5), samples, rollout_id=0)


def test_every_sample_removed_by_the_filter_says_so():
    samples = _samples(2)
    for sample in samples:
        sample.remove_sample = True
    with pytest.raises(RunCannotLearn, match="every one of 2 samples was marked remove_sample"):
        check_step_can_learn(_args(rollout_sample_filter_path="my.filter"), samples, rollout_id=1)


def test_a_step_with_no_samples_says_every_prompt_was_filtered():
    with pytest.raises(RunCannotLearn, match="produced no samples: every prompt was filtered out"):
        check_step_can_learn(_args(), [], rollout_id=0)


# ----------------------------------------------------------------------------- a dead engine

def test_dead_engine_is_named_with_the_flag_that_would_have_restarted_it():
    from slime.rollout.engine_control import EngineDead, raise_if_engines_dead
    from slime.utils.process import find_free_port

    url = f"http://127.0.0.1:{find_free_port()}"  # nothing listens there: a dead engine
    start = time.monotonic()
    with pytest.raises(EngineDead) as error:
        asyncio.run(raise_if_engines_dead(Namespace(rollout_engine_urls=[url]), RuntimeError("HTTP 503")))
    assert time.monotonic() - start < 5
    assert url in str(error.value) and "--use-fault-tolerance" in str(error.value) and "HTTP 503" in str(error.value)


def test_dead_engine_found_after_a_failed_weight_push_is_named_too():
    from slime.rollout.engine_control import EngineDead, raise_if_engines_dead_sync
    from slime.utils.process import find_free_port

    url = f"http://127.0.0.1:{find_free_port()}"
    with pytest.raises(EngineDead, match=f"rollout engine\\(s\\) {url} .*--use-fault-tolerance.*ConnectionRefusedError"):
        raise_if_engines_dead_sync([url], ConnectionRefusedError("[Errno 111] Connection refused"))


def test_live_engine_is_not_reported_dead():
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        from slime.rollout.engine_control import raise_if_engines_dead

        url = f"http://127.0.0.1:{server.server_address[1]}"
        asyncio.run(raise_if_engines_dead(Namespace(rollout_engine_urls=[url]), RuntimeError("HTTP 503")))
    finally:
        server.shutdown()


# ----------------------------------------------------------------------------- over-long prompts

def test_over_long_prompts_are_dropped_with_a_count(tiny_model_dir, tmp_path, caplog):
    from slime.rollout.data_source import RolloutDataSource

    config = json.load(open(f"{tiny_model_dir}/config.json"))
    long_prompt = "word " * (config["max_position_embeddings"] + 10)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"input": p}) + "\n" for p in ["short", long_prompt, "also short"]))
    args = Namespace(prompt_data=str(path), hf_checkpoint=tiny_model_dir, rollout_global_dataset=True,
                     rollout_max_prompt_len=None, input_key="input", label_key=None, tool_key=None,
                     metadata_key="metadata", multimodal_keys=None, rollout_seed=1, apply_chat_template=False,
                     apply_chat_template_kwargs=None, rollout_shuffle=False)
    source = RolloutDataSource(args)
    assert [s.prompt for s in source.dataset.samples] == ["short", "also short"]
    assert f"dropped 1 prompts longer than {config['max_position_embeddings'] - 1} tokens" in caplog.text


def test_every_prompt_too_long_is_an_error_naming_the_file(tiny_model_dir, tmp_path):
    from slime.utils.data import Dataset
    from slime.utils.processing_utils import load_tokenizer

    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"input": "word " * 50}) + "\n")
    with pytest.raises(ValueError, match=f"{path}: every prompt \\(1\\) is longer than 8 tokens"):
        Dataset(str(path), load_tokenizer(tiny_model_dir), None, 8)


def test_a_sample_the_engine_refused_does_not_break_the_training_data():
    """A FAILED sample with no response has no rollout_log_probs: the step's data gets [] for it, not the
    misleading "set on the first sample but missing" error."""
    from slime.backends.training.train_data import convert_samples_to_train_data

    ok = Sample(index=0, prompt="p", tokens=[1, 2, 3], response_length=2, reward=1.0, rollout_log_probs=[-0.1, -0.2],
                status=Sample.Status.COMPLETED, metadata={})
    refused = Sample(index=1, prompt="p", tokens=[1, 2], response_length=0, reward=0.0, status=Sample.Status.FAILED,
                     metadata={"generate_error": "prompt too long"})
    args = Namespace(custom_convert_samples_to_train_data_path=None, custom_reward_post_process_path=None,
                     advantage_estimator="grpo", rewards_normalization=False, n_samples_per_prompt=1,
                     grpo_std_normalization=False, reward_key=None)
    data = convert_samples_to_train_data(args, [refused, ok])
    assert data["rollout_log_probs"] == [[], [-0.1, -0.2]]
