"""End-to-end tests of the embedded engine over HTTP: one real server for the whole module.

The server runs with an API key (so every call below also exercises the bearer check) and a small
context length so that the bad-input cases are cheap to build.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time

import httpx
import pytest
import torch

from engine_test_utils import (TOOL_MESSAGES, TOOLS, copy_with_weights, hf_greedy, hf_logprobs, load_hf,
                               perturbed_state_dict, train_tool_call)
from slime.backends.embedded_engine.serving.launch import find_free_port, running_engine
from slime.backends.update_weight.wire_format import (flatten_tensors, init_custom_process_group,
                                                     serialize_for_engine, use_file_system_sharing)

pytestmark = pytest.mark.timeout(300)
API_KEY = "test-key"
CONTEXT = 512
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [100, 200, 300, 400, 500], [42]]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_engine(tiny_model_dir, api_key=API_KEY,
                        extra_args=["--context-length", str(CONTEXT), "--max-running-requests", "16"]) as proc:
        yield proc


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return load_hf(tiny_model_dir)


def generate(http, **body):
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def greedy(http, prompt, n=12, **extra):
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **extra.pop("sampling", {})}
    return generate(http, input_ids=prompt, sampling_params=sp, return_logprob=True, **extra)


def test_greedy_matches_hf_generate(http, hf_model):
    for prompt in PROMPTS:
        out = greedy(http, prompt, n=20)
        assert out["output_ids"] == hf_greedy(hf_model, prompt, 20)
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 20}
        assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 20
        assert meta["cached_tokens"] == 0 and meta["weight_version"] == "default" and meta["e2e_latency"] > 0
        assert [x[1] for x in meta["output_token_logprobs"]] == out["output_ids"]


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7, 1.5])
def test_logprobs_equal_hf_forward(http, hf_model, temperature):
    # top_k/top_p truncate the sampling distribution but never the reported log-prob.
    sampling = {"max_new_tokens": 16, "temperature": temperature, "top_k": 20, "top_p": 0.9, "ignore_eos": True}
    outs = generate(http, input_ids=PROMPTS[:3], sampling_params=sampling, return_logprob=True)
    for prompt, out in zip(PROMPTS, outs):
        got = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        want = hf_logprobs(hf_model, prompt, out["output_ids"], temperature)
        assert got == pytest.approx(want, abs=1e-4)


def test_a_group_of_one_prompt_shares_its_prefill(http, hf_model):
    """A batch of the same prompt (a GRPO group) is prefilled once: the other samples copy its cache
    rows, yet each samples on its own, and every token's log-prob is the model's."""
    prompt, n = PROMPTS[0] * 3, 6
    before = http.get("/get_server_info").json()["batch_stats"]
    sampling = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    outs = generate(http, input_ids=[prompt] * n, sampling_params=sampling, return_logprob=True)
    after = http.get("/get_server_info").json()["batch_stats"]
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompt)  # one prefill for six requests
    assert after["prefill_shared_rows"] - before["prefill_shared_rows"] == n - 1
    assert sorted(out["meta_info"]["cached_tokens"] for out in outs) == [0] + [len(prompt)] * (n - 1)
    assert len({tuple(out["output_ids"]) for out in outs}) > 1  # independent samples, not copies
    for out in outs:
        got = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(hf_logprobs(hf_model, prompt, out["output_ids"], 1.0), abs=1e-4)
    greedy_outs = generate(http, input_ids=[prompt] * 3, return_logprob=True,
                           sampling_params={**sampling, "temperature": 0})
    assert [out["output_ids"] for out in greedy_outs] == [hf_greedy(hf_model, prompt, 12)] * 3


def test_prompt_logprobs(http, hf_model):
    prompt = PROMPTS[2]
    out = generate(http, input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0},
                   return_logprob=True, logprob_start_len=0)
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt and entries[0][0] is None
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
    assert [e[0] for e in entries[1:]] == pytest.approx([float(logits[i - 1, prompt[i]]) for i in range(1, len(prompt))],
                                                        abs=1e-4)


def test_stop_token_and_stop_string(http, hf_model):
    prompt = PROMPTS[1]
    reference = hf_greedy(hf_model, prompt, 20)
    stop_id = reference[5]
    out = greedy(http, prompt, n=20, sampling={"stop_token_ids": [stop_id], "ignore_eos": False})
    cut = reference.index(stop_id) + 1
    assert out["output_ids"] == reference[:cut]  # the stop token is included in ids and logprobs
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert len(out["meta_info"]["output_token_logprobs"]) == cut

    full_text = greedy(http, prompt, n=20, sampling={"skip_special_tokens": False})["text"]
    stop = full_text[6:9]
    out = greedy(http, prompt, n=20, sampling={"stop": [stop], "skip_special_tokens": False})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full_text[: full_text.index(stop)]
    kept = greedy(http, prompt, n=20, sampling={"stop": stop, "no_stop_trim": True, "skip_special_tokens": False})
    assert kept["text"].endswith(stop) or stop in kept["text"]


def test_text_input_n_and_batch(http):
    outs = generate(http, text="hello world", sampling_params={"max_new_tokens": 5, "n": 3, "ignore_eos": True})
    assert isinstance(outs, list) and len(outs) == 3 and len({o["meta_info"]["id"] for o in outs}) == 3
    assert all(len(o["output_ids"]) == 5 for o in outs)
    batch = generate(http, input_ids=PROMPTS, rid="batch", sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert [o["meta_info"]["id"] for o in batch] == [f"batch_{i}" for i in range(len(PROMPTS))]
    # unknown top-level keys (the router adds some) are ignored
    out = generate(http, input_ids=[5], sampling_params={"max_new_tokens": 2}, background=False, model="x",
                   return_entropy=False, log_metrics=True)
    assert len(out["output_ids"]) <= 2


def test_stream(http):
    chunks = []
    with http.stream("POST", "/generate", json={"input_ids": [5, 6], "stream": True, "sampling_params": {
            "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    objs = [json.loads(c) for c in chunks[:-1]]
    assert [len(o["output_ids"]) for o in objs] == [1, 2, 3, 4, 5]
    assert objs[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(o["meta_info"]["finish_reason"] is None for o in objs[:-1])


def _start_long(http, rid, pool):
    body = {"input_ids": [5, 6, 7], "rid": rid, "return_logprob": True,
            "sampling_params": {"max_new_tokens": CONTEXT - 10, "temperature": 0, "ignore_eos": True}}
    return pool.submit(http.post, "/generate", json=body)


def _wait_running(http, count):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        load = http.get("/v1/loads", params={"include": "core"}).json()["loads"][0]
        if load["num_running_reqs"] >= count and load["num_used_tokens"] > 3 * count + 10:
            return
        time.sleep(0.01)
    raise AssertionError("requests did not start running")


def test_abort_by_rid_and_all(http):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        future = _start_long(http, "abort-me", pool)
        _wait_running(http, 1)
        assert http.post("/abort_request", json={"rid": "abort-me"}).status_code == 200
        out = future.result().json()
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(out["output_ids"]) < CONTEXT - 10
        assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])

        futures = [_start_long(http, f"all-{i}", pool) for i in range(3)]
        _wait_running(http, 3)
        assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
        for f in futures:
            assert f.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
    load = http.get("/v1/loads", params={"include": "core"}).json()["loads"][0]
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0


def test_concurrent_requests_interleave(http, hf_model):
    before = http.get("/get_server_info").json()["batch_stats"]
    lengths = [40, 5, 25, 10, 60, 15, 30, 8]
    with concurrent.futures.ThreadPoolExecutor(len(lengths)) as pool:
        futures = []
        for i, n in enumerate(lengths):
            futures.append(pool.submit(greedy, http, PROMPTS[i % len(PROMPTS)], n))
            time.sleep(0.01 * (i % 3))
        outs = [f.result() for f in futures]
    for i, (n, out) in enumerate(zip(lengths, outs)):
        assert out["output_ids"] == hf_greedy(hf_model, PROMPTS[i % len(PROMPTS)], n)
    after = http.get("/get_server_info").json()["batch_stats"]
    assert after["max_running_batch"] >= 3  # several requests decoded in one forward
    assert after["joins_while_decoding"] > before["joins_while_decoding"]  # joined a batch mid-generation


def test_answers_place_each_request_on_the_unix_clock(http):
    """SGLang's request_received_ts / request_finished_ts / response_sent_to_client_ts, in order, inside the
    client's own window, and consistent with the phase durations (what bench/engine_decode.py's timeline uses)."""
    sent = time.time()
    meta = greedy(http, PROMPTS[0], 30)["meta_info"]
    read = time.time()
    assert sent <= meta["request_received_ts"] < meta["request_finished_ts"] <= meta["response_sent_to_client_ts"] <= read
    # admission placed on the same clock lies between the engine's receipt and its finish (a wrong conversion of the
    # engine's monotonic stamps would put it seconds away), and the handler's latency covers the engine's span
    admitted = meta["request_finished_ts"] - meta["decode_duration"] - meta["prefill_duration"]
    assert meta["request_received_ts"] - 1e-3 <= admitted <= meta["request_finished_ts"]
    served = meta["request_finished_ts"] - meta["request_received_ts"]
    assert served <= meta["queue_time"] + meta["prefill_duration"] + meta["decode_duration"] + 1e-3


def test_pause_continue_flush_and_memory(http):
    assert http.post("/pause_generation", json={}).json()["status"] == "ok"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(greedy, http, [5], 3)
        time.sleep(0.3)
        assert not future.done()  # blocked while paused
        assert http.post("/continue_generation", json={}).json()["status"] == "ok"
        assert len(future.result()["output_ids"]) == 3
    response = http.get("/flush_cache")
    assert response.status_code == 200 and response.text.startswith("Cache flushed.")
    assert http.post("/release_memory_occupation", json={}).json() is None
    assert http.post("/resume_memory_occupation", json={"tags": ["weights"]}).json() is None
    assert http.post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}).json() is None
    assert len(greedy(http, [5], 3)["output_ids"]) == 3


def _in_flight(http, prompt, n):
    """A greedy request of ``n`` tokens running on the engine (returned as its future) once this returns."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(greedy, http, prompt, n)
    pool.shutdown(wait=False)
    deadline = time.monotonic() + 30
    while http.get("/get_load").json()[0]["num_reqs"] == 0:
        assert time.monotonic() < deadline and not future.done(), "the request never reached the engine"
        time.sleep(0.005)
    return future


def test_release_waits_for_the_requests_in_flight(http):
    """A release that arrives while the engine runs something (a health probe, a warm-up, a last request)
    waits for it, then releases: the request completes in full and the release answers 200 (refusing at once
    would kill a colocated run at its first offload)."""
    future = _in_flight(http, [7, 8, 9], 400)
    released = http.post("/release_memory_occupation", json={})
    try:
        assert released.status_code == 200 and released.json() is None, released.text
        # the engine finished the request before it released; its answer may still be on the way to the client
        # (a request that a release cut off would never finish: the engine queues it until the resume below)
        result = future.result(timeout=10)
    finally:  # resumed whatever happened, so that one failure here does not hang every later test of the module
        if released.status_code == 200:
            assert http.post("/resume_memory_occupation", json={}).json() is None
    assert len(result["output_ids"]) == 400 and result["meta_info"]["finish_reason"]["type"] == "length"
    # a request that outlives the release's wait: refused with what is running and what to do
    future = _in_flight(http, [7, 8, 9], 400)
    try:
        response = http.post("/release_memory_occupation", json={"timeout": 0})
    finally:  # the request finishes whatever the answer, so no later test sees it in flight
        result = future.result(timeout=120)
    assert response.status_code == 400, response.text
    # the request is scheduled or still queued, depending on how busy the machine is: either way it is named
    counts = re.search(r"for (\d+) running and (\d+) waiting request", response.json()["error"]["message"])
    assert counts and int(counts[1]) + int(counts[2]) == 1, response.text
    assert len(result["output_ids"]) == 400  # the refused release changed nothing
    assert http.post("/release_memory_occupation", json={"timeout": "soon"}).status_code == 400
    assert len(greedy(http, [5], 3)["output_ids"]) == 3


def test_info_endpoints(http, server):
    info = http.get("/get_model_info").json()
    assert info["is_generation"] and info["architectures"] == ["Qwen3ForCausalLM"]
    assert http.get("/model_info").json() == info
    server_info = http.get("/server_info").json()
    assert server_info["tp_size"] == 1 and server_info["context_length"] == CONTEXT
    state = server_info["internal_states"][0]
    assert state["fused_projections"]["qkv"] == state["fused_projections"]["gate_up"] > 0  # every layer of Qwen3
    assert http.get("/version").json()["version"]
    assert "sglang:" in http.get("/metrics").text
    assert http.get("/get_load").json()[0]["num_reqs"] == 0
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # never authenticated


def test_api_key_required(server):
    assert httpx.get(server.url + "/get_model_info").status_code == 401
    assert httpx.post(server.url + "/generate", json={"input_ids": [1]},
                      headers={"Authorization": "Bearer wrong"}).status_code == 401


@pytest.mark.parametrize("body,status,field", [
    ("{not json", 400, "JSON"),
    ({"input_ids": [1], "sampling_params": {"tempreature": 0.5}}, 400, "did you mean 'temperature'"),
    ({"input_ids": [1], "sampling_params": "greedy"}, 400, "sampling_params must be an object"),
    ({"input_ids": [1], "sampling_params": [{"temperature": 0.5}]}, 400, "sampling_params must be an object"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"temperature": -0.5}}, 400, "temperature"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, 400, "top_k"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}, 400, "sampling_params.max_new_tokens must be an integer"),
    ({"input_ids": [1], "sampling_params": {"top_p": "0.9"}}, 400, "sampling_params.top_p must be a number"),
    ({"input_ids": []}, 400, "input_ids"),
    ({"text": ""}, 400, "input_ids"),
    ({"input_ids": [1, 10**6]}, 400, "input_ids"),
    ({"input_ids": [1] * CONTEXT}, 400, "context length"),
    ({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": CONTEXT}}, 400, "max_new_tokens"),
    ({"sampling_params": {}}, 400, "input_ids"),
])
def test_bad_input_gets_error_and_server_stays_up(http, body, status, field):
    if isinstance(body, str):
        response = http.post("/generate", content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post("/generate", json=body)
    assert response.status_code == status, response.text
    assert field in response.text
    assert len(greedy(http, [5], 2)["output_ids"]) == 2


# ---------------------------------------------------------------------------------------------- weights
@pytest.fixture(scope="module")
def new_weights(tiny_model_dir, tmp_path_factory):
    state = perturbed_state_dict(tiny_model_dir)
    new_dir = copy_with_weights(tiny_model_dir, tmp_path_factory.mktemp("ckpt") / "new", state)
    return state, new_dir, load_hf(new_dir)


def _assert_serves(http, model, version):
    for prompt in PROMPTS[:2]:
        out = greedy(http, prompt, 12)
        assert out["output_ids"] == hf_greedy(model, prompt, 12)
        assert out["meta_info"]["weight_version"] == version


def _restore(http, tiny_model_dir, hf_model):
    ok = http.post("/update_weights_from_disk", json={"model_path": tiny_model_dir, "weight_version": "base"})
    assert ok.json()["success"], ok.text
    _assert_serves(http, hf_model, "base")


@pytest.mark.parametrize("load_format", ["direct", "flattened_bucket"])
def test_update_weights_from_tensor(http, new_weights, tiny_model_dir, hf_model, load_format):
    use_file_system_sharing()
    state, _, new_model = new_weights
    named = [(k, v.clone().share_memory_()) for k, v in state.items()]
    payload = flatten_tensors(named) if load_format == "flattened_bucket" else named
    if load_format == "flattened_bucket":
        payload["flattened_tensor"].share_memory_()
    response = http.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [serialize_for_engine(payload)], "load_format": load_format,
        "weight_version": f"tensor-{load_format}"})
    assert response.json()["success"], response.text
    _assert_serves(http, new_model, f"tensor-{load_format}")
    _restore(http, tiny_model_dir, hf_model)


@pytest.mark.parametrize("flattened", [False, True])
def test_update_weights_from_distributed_gloo(http, new_weights, tiny_model_dir, hf_model, flattened):
    import torch.distributed as dist

    state, _, new_model = new_weights
    port, group_name = find_free_port(), f"test-{flattened}"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        init = pool.submit(http.post, "/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": group_name, "backend": "gloo"})
        group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, group_name)
        assert init.result().json()["success"]
        names = list(state)
        body = {"names": names, "dtypes": [str(state[n].dtype).replace("torch.", "") for n in names],
                "shapes": [list(state[n].shape) for n in names], "group_name": group_name,
                "weight_version": f"dist-{flattened}", "load_format": "flattened_bucket" if flattened else None}
        # flattened: two updates, the second received into the engine's buffer of the first (other weights first)
        for sent in ([{n: t * 0.5 for n, t in state.items()}, state] if flattened else [state]):
            update = pool.submit(http.post, "/update_weights_from_distributed", json=body)
            if flattened:
                dist.broadcast(flatten_tensors([(n, sent[n]) for n in names])["flattened_tensor"], src=0, group=group)
            else:
                for n in names:
                    dist.broadcast(sent[n].contiguous(), src=0, group=group)
            assert update.result().json()["success"]
    _assert_serves(http, new_model, f"dist-{flattened}")
    assert http.post("/destroy_weights_update_group", json={"group_name": group_name}).json()["success"]
    dist.destroy_process_group(group)
    _restore(http, tiny_model_dir, hf_model)


def test_update_weights_from_disk_and_get_weights(http, new_weights, tiny_model_dir, hf_model):
    state, new_dir, new_model = new_weights
    response = http.post("/update_weights_from_disk", json={"model_path": str(new_dir), "weight_version": "7"})
    assert response.json()["success"] and "Weight version updated to 7" in response.json()["message"]
    _assert_serves(http, new_model, "7")
    assert http.get("/get_weight_version").json() == {"weight_version": "7"}
    got = http.post("/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 5}).json()
    assert got == pytest.approx(state["model.norm.weight"][:5].tolist(), abs=1e-6)
    bad = http.post("/update_weights_from_disk", json={"model_path": "/nonexistent"})
    assert bad.status_code == 400 and not bad.json()["success"]
    _restore(http, tiny_model_dir, hf_model)


# ---------------------------------------------------------------------------------------------- OpenAI
@pytest.mark.timeout(900)  # trains the tiny model to emit a tool call first: minutes on a busy 2-core machine
def test_chat_completion_parses_tool_call(http, tiny_model_dir, tmp_path_factory, hf_model):
    trained = copy_with_weights(tiny_model_dir, tmp_path_factory.mktemp("tool") / "m", train_tool_call(tiny_model_dir))
    assert http.post("/update_weights_from_disk", json={"model_path": str(trained)}).json()["success"]
    response = http.post("/v1/chat/completions", json={
        "messages": TOOL_MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 64, "logprobs": True,
        "return_meta_info": True})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert len(choice["logprobs"]["content"]) == len(choice["meta_info"]["output_token_logprobs"])
    completion = http.post("/v1/completions", json={"prompt": "What is", "max_tokens": 4, "temperature": 0,
                                                    "n": 2, "logprobs": 0, "ignore_eos": True}).json()
    assert len(completion["choices"]) == 2 and len(completion["choices"][0]["logprobs"]["token_logprobs"]) == 4
    _restore(http, tiny_model_dir, hf_model)


def test_refuses_public_bind_without_api_key():
    from slime.backends.embedded_engine.config import parse_args

    with pytest.raises(SystemExit, match="api-key"):
        parse_args(["--model-path", "x", "--host", "0.0.0.0"])
    assert parse_args(["--model-path", "x", "--host", "0.0.0.0", "--api-key", "k"]).api_key == "k"
    assert parse_args(["--model-path", "x", "--host", "127.0.0.3"]).host == "127.0.0.3"  # loopback: a local Ray node's IP
    with pytest.raises(SystemExit, match="api-key"):
        parse_args(["--model-path", "x", "--host", "128.0.0.1"])
