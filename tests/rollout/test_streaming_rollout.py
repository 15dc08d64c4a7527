"""``slime.rollout.sglang_streaming_rollout.generate_streaming`` against the scripted stand-in engine (server-sent
events, cumulative or incremental chunks, dropped connections, error events, cancellation) and against the
embedded engine (the same tokens and log-probs as the non-streamed generator)."""

import asyncio

import pytest

from slime.rollout import sglang_streaming_rollout
from slime.rollout.sglang_rollout import GenerateState, generate
from slime.rollout.sglang_streaming_rollout import generate_streaming
from slime.utils.async_utils import run
from slime.utils.processing_utils import load_tokenizer
from slime.utils.types import Sample
from tests.rollout.stand_in_engine import Reply, StandInEngine
from tests.rollout.test_sglang_rollout import FINISH_CASES, PROMPT, make_args

TOKENS = list(range(30, 40))
LOGPROBS = [-0.1 * (i + 1) for i in range(len(TOKENS))]


@pytest.fixture(params=[False, True], ids=["cumulative", "incremental"])
def engine(request):
    holder = {"script": lambda payload: Reply(tokens=TOKENS, logprobs=LOGPROBS)}
    server = StandInEngine(lambda payload: holder["script"](payload), incremental=request.param).start()
    server.holder = holder
    yield server
    server.stop()


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"input": "x", "label": "y"}\n')
    return str(path)


def _params(args, **overrides):
    return {**GenerateState(args).sampling_params, "max_new_tokens": 16, **overrides}


@pytest.mark.parametrize("reply,status", FINISH_CASES)
def test_statuses_tokens_and_meta_match_the_non_streamed_generator(tiny_model_dir, prompt_file, engine, reply,
                                                                     status):
    """Every finish of the non-streamed generator's table, streamed: the same status, tokens, log-probs, text,
    weight versions and cache counters as :func:`generate` appends from the one-piece answer."""
    args = make_args(tiny_model_dir, prompt_file, engine)
    engine.holder["script"] = lambda payload: reply
    streamed = run(generate_streaming(args, Sample(prompt=PROMPT, index=0), dict(GenerateState(args).sampling_params)))
    assert engine.requests[-1]["stream"] is True
    plain = run(generate(args, Sample(prompt=PROMPT, index=0), dict(GenerateState(args).sampling_params)))
    assert "stream" not in engine.requests[-1]
    assert streamed.status == plain.status == status
    for field in ("tokens", "response", "response_length", "loss_mask", "rollout_log_probs", "weight_versions"):
        assert getattr(streamed, field) == getattr(plain, field), field
    assert streamed.prefix_cache_info.cached_tokens == plain.prefix_cache_info.cached_tokens
    if status == Sample.Status.FAILED:
        assert "input too long" in streamed.metadata["generate_error"]


def test_a_dropped_connection_keeps_its_tokens_and_resumes_for_the_rest(tiny_model_dir, prompt_file, engine):
    """The stand-in closes the connection after 4 streamed tokens; the sample keeps them (with their log-probs)
    and a second request, the prompt plus those 4 as input and 16 - 4 tokens of budget, finishes it."""
    args = make_args(tiny_model_dir, prompt_file, engine)
    prompt_ids = load_tokenizer(tiny_model_dir)(PROMPT, add_special_tokens=False)["input_ids"]

    def script(payload):
        done = len(payload["input_ids"]) - len(prompt_ids)
        if done == 0:
            return Reply(tokens=TOKENS, logprobs=LOGPROBS, drop_after=4)
        return Reply(tokens=TOKENS[done:], logprobs=[-9.0] * (len(TOKENS) - done))

    engine.holder["script"] = script
    sample = run(generate_streaming(args, Sample(prompt=PROMPT, index=0), _params(args)))
    first, second = engine.requests[-2:]
    assert second["input_ids"] == prompt_ids + TOKENS[:4]
    assert first["sampling_params"]["max_new_tokens"] == 16 and second["sampling_params"]["max_new_tokens"] == 12
    assert sample.status == Sample.Status.COMPLETED
    assert sample.tokens == prompt_ids + TOKENS and sample.loss_mask == [1] * len(TOKENS)
    assert sample.rollout_log_probs == pytest.approx(LOGPROBS[:4] + [-9.0] * 6)
    assert len(sample.weight_versions) == 2  # one per request, as a partial rollout's continuation


def test_an_error_event_marks_the_sample_failed_and_a_retryable_one_resumes(tiny_model_dir, prompt_file, engine):
    args = make_args(tiny_model_dir, prompt_file, engine)
    fatal = {"error": {"message": "grammar exploded", "type": "invalid_request_error", "code": 400,
                       "retryable": False}}
    engine.holder["script"] = lambda payload: Reply(tokens=TOKENS, error_after=3, error_event=fatal)
    sample = run(generate_streaming(args, Sample(prompt=PROMPT, index=0), _params(args)))
    assert sample.status == Sample.Status.FAILED and "grammar exploded" in sample.metadata["generate_error"]
    calls = []

    def script(payload):
        calls.append(payload)
        if len(calls) == 1:
            return Reply(tokens=TOKENS, error_after=3, error_event={"error": {**fatal["error"], "retryable": True}})
        return Reply(tokens=[7, 8])

    engine.holder["script"] = script
    sample = run(generate_streaming(args, Sample(prompt=PROMPT, index=0), _params(args)))
    assert sample.status == Sample.Status.COMPLETED and sample.tokens[-5:] == TOKENS[:3] + [7, 8]


def test_cancellation_keeps_the_partial_output_and_leaves_the_stream(tiny_model_dir, prompt_file, engine):
    """A cancelled call (a request-mode abort) appends what arrived, marks the sample ABORTED and closes the
    stream, which the server sees as a disconnect; the non-streamed generator would have nothing yet."""
    args = make_args(tiny_model_dir, prompt_file, engine)
    engine.holder["script"] = lambda payload: Reply(tokens=TOKENS, logprobs=LOGPROBS, delay_s=0.05)
    sample = Sample(prompt=PROMPT, index=0)

    async def cancel_midway():
        task = asyncio.create_task(generate_streaming(args, sample, _params(args)))
        await asyncio.sleep(0.28)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(cancel_midway())
    assert sample.status == Sample.Status.ABORTED and 1 <= sample.response_length < len(TOKENS)
    assert sample.tokens[-sample.response_length:] == TOKENS[:sample.response_length]
    assert sample.rollout_log_probs == pytest.approx(LOGPROBS[:sample.response_length])
    for _ in range(40):  # the stand-in notices at its next write
        if engine.disconnects:
            break
        run(asyncio.sleep(0.05))
    assert engine.disconnects == 1
    # the partial rollout continues from there
    engine.holder["script"] = lambda payload: Reply(tokens=[5])
    run(generate_streaming(args, sample, _params(args)))
    assert sample.status == Sample.Status.COMPLETED and sample.tokens[-1] == 5


def test_a_server_wide_abort_ends_the_stream_with_the_partial_output(tiny_model_dir, prompt_file, engine):
    """``/abort_request {"abort_all": true}`` (the rollout's abort of everything in flight) ends the stream with the
    final chunk the non-streamed call would get: finish_reason abort, the tokens so far; nothing is retried."""
    from slime.utils.http_utils import post

    args = make_args(tiny_model_dir, prompt_file, engine)
    engine.holder["script"] = lambda payload: Reply(tokens=TOKENS, logprobs=LOGPROBS, delay_s=0.05)
    sample = Sample(prompt=PROMPT, index=0)

    async def abort_midway():
        task = asyncio.create_task(generate_streaming(args, sample, _params(args)))
        await asyncio.sleep(0.2)
        await post(f"{engine.url}/abort_request", {"abort_all": True})
        return await task

    requests_before = len(engine.requests)
    run(abort_midway())
    assert len(engine.requests) == requests_before + 1 and engine.abort_calls == 1
    assert sample.status == Sample.Status.ABORTED and 1 <= sample.response_length < len(TOKENS)
    assert sample.tokens[-sample.response_length:] == TOKENS[:sample.response_length]
    assert sample.rollout_log_probs == pytest.approx(LOGPROBS[:sample.response_length])
    assert sample.weight_versions == ["7"]


def test_replay_data_comes_with_the_final_chunk_only(tiny_model_dir, prompt_file, engine):
    """With top-p replay asked for, a finished stream carries the replay data of the final chunk; an interrupted
    one cannot keep tokens without theirs, so its partial output is dropped and the resumed request redoes it."""
    args = make_args(tiny_model_dir, prompt_file, engine, "--rollout-top-p", "0.9")
    params = _params(args)
    assert params["custom_params"] == {"return_top_p_token_ids": True}
    prompt_len = len(load_tokenizer(tiny_model_dir)(PROMPT, add_special_tokens=False)["input_ids"])
    replay = {"top_p_token_ids": "AQAAAAIAAAA=", "top_p_token_offsets": "AAAAAAEAAAACAAAA"}  # [1, 2]; [0, 1, 2]

    calls = []

    def script(payload):
        calls.append(len(payload["input_ids"]))
        if len(calls) == 1:
            return Reply(tokens=TOKENS, drop_after=4)
        return Reply(tokens=[11, 12], extra_meta=replay)

    engine.holder["script"] = script
    if engine.incremental:  # the final chunk would carry only its own slice of the replay data
        with pytest.raises(ValueError, match="incremental streaming chunks"):
            run(generate_streaming(args, Sample(prompt=PROMPT, index=0), params))
        return
    sample = run(generate_streaming(args, Sample(prompt=PROMPT, index=0), params))
    assert calls == [prompt_len, prompt_len]  # the 4 dropped tokens are generated again
    assert sample.status == Sample.Status.COMPLETED and sample.response_length == 2
    assert list(sample.rollout_top_p_token_offsets) == [0, 1, 2] and list(sample.rollout_top_p_token_ids) == [1, 2]


def test_gives_up_after_the_retry_budget_keeping_what_arrived(tiny_model_dir, prompt_file, engine, monkeypatch):
    monkeypatch.setattr(sglang_streaming_rollout, "RETRIES", 3)
    monkeypatch.setattr(sglang_streaming_rollout.asyncio, "sleep", _no_sleep)
    args = make_args(tiny_model_dir, prompt_file, engine)
    engine.holder["script"] = lambda payload: Reply(tokens=TOKENS, drop_after=2)
    sample = Sample(prompt=PROMPT, index=0)
    with pytest.raises(sglang_streaming_rollout.HTTPRequestError, match=r"\(stream\) failed 3 times"):
        run(generate_streaming(args, sample, _params(args)))
    assert sample.status == Sample.Status.ABORTED and sample.response_length == 6  # 2 a request, kept


async def _no_sleep(seconds):
    return None


def test_events_that_arrive_in_pieces_are_joined(tiny_model_dir, prompt_file):
    """Each event written in two pieces 10 ms apart (the cut inside its JSON): the same sample as whole events."""
    server = StandInEngine(lambda payload: Reply(tokens=TOKENS, logprobs=LOGPROBS), split_events=True).start()
    try:
        args = make_args(tiny_model_dir, prompt_file, server)
        sample = run(generate_streaming(args, Sample(prompt=PROMPT, index=0), _params(args)))
    finally:
        server.stop()
    assert sample.status == Sample.Status.COMPLETED and sample.tokens[-len(TOKENS):] == TOKENS
    assert sample.rollout_log_probs == pytest.approx(LOGPROBS)


def test_a_chunk_neither_cumulative_nor_incremental_is_refused():
    streamed = sglang_streaming_rollout.StreamedOutput()
    streamed.add({"text": "a", "output_ids": [1], "meta_info": {"completion_tokens": 1,
                                                                 "output_token_logprobs": [[-0.1, 1, None]]}})
    with pytest.raises(ValueError, match="neither cumulative nor incremental"):
        streamed.add({"text": "b", "output_ids": [2], "meta_info": {"completion_tokens": 5,
                                                                     "output_token_logprobs": [[-0.2, 2, None]]}})


@pytest.mark.slow
def test_the_embedded_engine_streams_what_it_answers_in_one_piece(tiny_model_dir, prompt_file):
    """Greedy on the real embedded engine (SSE from its server): streamed and non-streamed calls give the same
    tokens and log-probs."""
    from slime.backends.embedded_engine.serving.launch import running_engine
    from slime.arguments import parse_args

    with running_engine(tiny_model_dir, extra_args=["--context-length", "256"]) as proc:
        host, port = proc.url.removeprefix("http://").split(":")
        args = parse_args(["--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint",
                           tiny_model_dir, "--prompt-data", prompt_file, "--input-key", "input", "--label-key",
                           "label", "--rollout-batch-size", "1", "--num-rollout", "1",
                           "--rollout-max-response-len", "12",
                           "--sglang-router-ip", host, "--sglang-router-port", port])
        params = {**GenerateState(args).sampling_params, "temperature": 0.0}  # greedy: one answer to compare
        streamed = run(generate_streaming(args, Sample(prompt=PROMPT, index=0), params))
        plain = run(generate(args, Sample(prompt=PROMPT, index=0), params))
    assert streamed.response_length == plain.response_length > 0
    assert streamed.tokens == plain.tokens and streamed.status == plain.status
    assert streamed.rollout_log_probs == pytest.approx(plain.rollout_log_probs, abs=1e-5)
