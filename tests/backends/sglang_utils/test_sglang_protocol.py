"""slime against SGLang's HTTP protocol: two stand-in SGLang servers (exact response shapes of
SGLANG_PROTOCOL.md) as external engines behind the real smg router, driven through the default
rollout, a gloo weight update, pause/continue and the documented error shapes."""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx
import pytest
import torch

from slime.backends.embedded_engine.serving.launch import ServerProcess
from slime.backends.router import running_router
from slime.backends.sglang_utils.external import describe_external_engines
from slime.backends.sglang_utils.router_launch import register_workers
from slime.backends.update_weight.base import EngineClient
from slime.backends.update_weight.distributed import DistributedWeightUpdater
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sglang_rollout import GenerateState, generate, generate_rollout
from slime.arguments import parse_args
from slime.utils.async_utils import run
from slime.utils.processing_utils import load_tokenizer
from slime.utils.types import Sample

from real_sglang import REPO

pytestmark = pytest.mark.timeout(300)


class StandInProcess(ServerProcess):
    def command(self):
        return [sys.executable, "-m", "tests.backends.sglang_utils.sglang_stand_in", "--port", str(self.port),
                "--context-length", "64"]


@pytest.fixture(scope="module")
def engines():
    servers = [StandInProcess("127.0.0.1", None, env={"PYTHONPATH": str(REPO)}) for _ in range(2)]
    for server in servers:
        server.start()
    try:
        for server in servers:
            server.wait_healthy(timeout=120)
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def router(engines):
    with running_router("round_robin") as router:
        register_workers(router.url, [{"url": e.url, "worker_type": "regular"} for e in engines])  # POST /workers
        for engine in engines:
            router._wait_worker(engine.url, present=True, timeout=60)
        yield router


def make_args(model_dir, tmp_path, engines, router):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"what is {i} plus {i}", "label": str(2 * i)}) + "\n" for i in range(8)))
    args = parse_args([
        "--train-backend", "fsdp", "--hf-checkpoint", model_dir, "--prompt-data", str(prompts),
        "--rollout-external-engine-addrs", *[f"127.0.0.1:{e.port}" for e in engines],
        "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", str(router.port),
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "1",
        "--rollout-max-response-len", "16", "--rm-type", "math", "--cpu-only", "--sglang-speculative-algorithm", "EAGLE",
    ])  # fmt: skip
    args.rollout_engine_urls = [e.url for e in engines]
    return args


def test_external_engines_read_from_server_info(engines):
    urls, gpu_counts, layout = describe_external_engines([f"127.0.0.1:{e.port}" for e in engines])
    assert urls == [e.url for e in engines] and gpu_counts == [1, 1]
    assert layout == {"tp_size": 1, "pp_size": 1, "dp_size": 1, "ep_size": 1, "disaggregation_mode": "null"}
    with pytest.raises(RuntimeError, match="127.0.0.1:1 is not reachable"):
        describe_external_engines(["127.0.0.1:1"])


def test_default_rollout_through_the_real_router(tiny_model_dir, tmp_path, engines, router):
    args = make_args(tiny_model_dir, tmp_path, engines, router)
    assert args.rollout_external and args.rollout_backend == "sglang"  # external engines need no local SGLang
    out = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    samples = [s for group in out.samples for s in group]
    assert len(samples) == 8 and all(s.status == Sample.Status.COMPLETED for s in samples)
    tokenizer = load_tokenizer(tiny_model_dir)
    for sample in samples:
        prompt_ids = sample.tokens[:len(sample.tokens) - sample.response_length]
        last = prompt_ids[-1]
        assert sample.tokens[-sample.response_length:] == [(last + i) % 50 + 3 for i in range(1, 5)] + [2]
        assert sample.rollout_log_probs == [-0.125 * (i + 1) for i in range(5)]
        assert sample.weight_versions[-1] == "default"
        # spec-decoding counters arrive under SGLang's current names (spec_num_correct_drafts / proposed)
        assert sample.spec_info.spec_accept_rate == pytest.approx(2 / 5)
    assert tokenizer is not None


def test_error_shapes_reach_the_sample(tiny_model_dir, tmp_path, engines, router):
    args = make_args(tiny_model_dir, tmp_path, engines, router)
    params = dict(GenerateState(args).sampling_params)
    long_prompt = " ".join(["plus"] * 200)  # longer than the stand-in's 64-token context: 400 {"error": {"message"}}
    sample = run(generate(args, Sample(prompt=long_prompt, index=0), params))
    assert sample.status == Sample.Status.FAILED
    assert "longer than the model's context length" in sample.metadata["generate_error"]
    # SGLang answers an unknown sampling_params key with a plain-text 500
    response = httpx.post(engines[0].url + "/generate", json={"input_ids": [5], "sampling_params": {"bogus": 1}})
    assert response.status_code == 500 and response.headers["content-type"].startswith("text/plain")


def test_pause_health_and_distributed_weight_update(tiny_model_dir, tmp_path, engines, router):
    args = make_args(tiny_model_dir, tmp_path, engines, router)
    client = EngineClient([e.url for e in engines])
    client.pause()  # POST /pause_generation, then /flush_cache (plain-text answer)
    try:
        # paused and idle: the health probe fails; a new /generate waits for /continue_generation
        assert httpx.get(engines[0].url + "/health_generate", timeout=10).status_code == 503
        result = {}
        body = {"input_ids": [7, 8], "sampling_params": {"max_new_tokens": 8}, "return_logprob": True}
        waiter = threading.Thread(target=lambda: result.update(httpx.post(router.url + "/generate", json=body,
                                                                          timeout=60).json()))
        waiter.start()
        time.sleep(1.0)
        assert waiter.is_alive(), "generation ran while the engines were paused"
        buckets = [[("model.embed.weight", torch.arange(6, dtype=torch.float32).reshape(2, 3))],
                   [("lm_head.weight", torch.full((4,), 0.5, dtype=torch.bfloat16)),
                    ("model.norm.weight", torch.tensor([1.0, -1.0], dtype=torch.float16))]]
        updater = DistributedWeightUpdater(args, [e.url for e in engines], [1, 1])
        try:
            sent = updater.update(buckets, weight_version="3")  # gloo: trainer rank 0, engines ranks 1 and 2
        finally:
            updater.close()
        assert sent == 6 * 4 + 4 * 2 + 2 * 2
    finally:
        client.resume()
    waiter.join(30)
    assert result["meta_info"]["weight_version"] == "3"  # the request ran after the update
    for engine in engines:
        state = httpx.get(engine.url + "/stand_in/weights").json()
        assert state["weights"] == {"model.embed.weight": [0, 1, 2, 3, 4, 5], "lm_head.weight": [0.5] * 4,
                                    "model.norm.weight": [1.0, -1.0]}
        # SGLang 0.5.23 loads broadcast weights only inside a begin/end weight-update session
        assert state["calls"] == ["init_weights_update_group", "begin_weight_update", "update_weights_from_distributed",
                                  "update_weights_from_distributed", "end_weight_update"]
        assert httpx.get(engine.url + "/get_weight_version").json() == {"weight_version": "3"}
        assert httpx.get(engine.url + "/model_info").json()["weight_version"] == "3"
