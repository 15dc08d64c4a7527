"""Conformance with SGLang 0.5.23's own code: slime's rollout, admin client and weight updaters
against SGLang's FastAPI app, request classes, payload deserializer and weight updater
(``sglang_front_end``; what is and is not SGLang's there is listed in its docstring)."""

from __future__ import annotations

import json
import sys

import pytest

from slime.backends.embedded_engine.serving.launch import ServerProcess

from sglang_env import REPO, run_module, subprocess_env

pytestmark = pytest.mark.timeout(600)


class FrontEndProcess(ServerProcess):
    health_path = "/health"

    def __init__(self, model_dir: str):
        super().__init__("127.0.0.1", None, env={**subprocess_env(), "HF_HUB_OFFLINE": "1"})
        self.model_dir = model_dir

    def command(self):
        return [sys.executable, "-m", "tests.backends.sglang_utils.sglang_front_end", "--port", str(self.port),
                "--model-path", self.model_dir, "--context-length", "64"]


@pytest.fixture(scope="module")
def conformance(tiny_model_dir, tmp_path_factory):
    server = FrontEndProcess(tiny_model_dir)
    server.start()
    try:
        server.wait_healthy(timeout=240)
        done = run_module("tests.backends.sglang_utils.front_end_client", json.dumps({
            "url": server.url, "model_dir": tiny_model_dir, "tmp_dir": str(tmp_path_factory.mktemp("front_end"))}))
        yield json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        server.stop()


def _requests(result, route):
    return [entry for entry in result["state"]["log"] if entry["route"] == route]


def test_server_info_from_sglangs_own_builder(conformance):
    assert conformance["external"] == {"gpu_counts": [1], "layout": {
        "tp_size": 1, "pp_size": 1, "dp_size": 1, "ep_size": 1, "disaggregation_mode": "null"}}


def test_generate_bodies_pass_sglangs_request_classes(conformance):
    generate = conformance["generate"]
    for label in ("base", "seeded"):
        assert generate[label]["status"] == "completed", generate[label]
        assert generate[label]["log_probs"] == [-0.125 * (i + 1) for i in range(generate[label]["response_length"])]
        assert generate[label]["weight_versions"] == ["default"]
    requests = [r for r in _requests(conformance, "/generate")  # less SGLang's own health probes
                if not str(r["fields"].get("rid") or "").startswith("HEALTH_CHECK")]
    params = [r["fields"]["sampling_params"] for r in requests]
    assert all(r["class"] == "GenerateReqInput" and r["fields"]["return_logprob"] is True for r in requests)
    assert params[0]["top_p"] == 0.9 and params[0]["top_k"] == 20 and params[0]["stop"] == ["###"]
    assert params[0]["stop_token_ids"] == [7] and params[0]["no_stop_trim"] is True
    assert params[1]["sampling_seed"] == 1234 and params[1]["min_new_tokens"] == 1
    # SGLang's own answer to a prompt past the context: 400 {"error": {"message"}} -> a FAILED sample
    assert generate["too_long"]["status"] == "failed"
    assert "longer than the model's context length" in generate["too_long"]["error"]


def test_admin_calls_pass_sglangs_request_classes(conformance):
    classes = {entry["route"]: entry["class"] for entry in conformance["state"]["log"]}
    assert classes["/pause_generation"] == "PauseGenerationReqInput"
    assert classes["/continue_generation"] == "ContinueGenerationReqInput"
    assert classes["/flush_cache"] == "FlushCacheReqInput"
    assert classes["/abort_request"] == "AbortReq"
    assert classes["/release_memory_occupation"] == "ReleaseMemoryOccupationReqInput"
    assert _requests(conformance, "/resume_memory_occupation")[0]["fields"]["tags"] == ["weights"]
    assert _requests(conformance, "/abort_request")[0]["fields"]["abort_all"] is True


EXPECTED = {"model.embed.weight": {"dtype": "float32", "shape": [2, 3], "values": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]},
            "lm_head.weight": {"dtype": "bfloat16", "shape": [4], "values": [0.5] * 4},
            "model.norm.weight": {"dtype": "float16", "shape": [2], "values": [1.0, -1.0]}}


def test_colocated_payload_rebuilt_by_sglangs_deserializer(conformance):
    weights = conformance["weights"]
    # slime's own metadata class is what SGLang's SafeUnpickler refuses (the bug this guards against)
    assert "Blocked unsafe global" in weights["embedded_dialect"]
    assert weights["tensor"].get("error") is None, weights["tensor"]
    assert weights["tensor"]["state"] == EXPECTED  # identical tensors out of FlattenedTensorBucket
    assert weights["tensor"]["sent"] == 6 * 4 + 4 * 2 + 2 * 2
    tensor_requests = _requests(conformance, "/update_weights_from_tensor")
    assert all(r["class"] == "UpdateWeightsFromTensorReqInput" and r["fields"]["load_format"] == "flattened_bucket"
               for r in tensor_requests)


def test_weight_updates_run_inside_sglangs_session(conformance):
    assert "must run between begin_weight_update() and end_weight_update()" in conformance["weights"]["outside_session"]
    routes = [e["route"] for e in conformance["state"]["log"] if "weight" in e["route"]]
    assert routes == [
        "/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update",  # embedded-dialect probe
        "/update_weights_from_tensor",  # outside a session: refused
        "/begin_weight_update", "/update_weights_from_tensor", "/update_weights_from_tensor", "/end_weight_update",
        "/init_weights_update_group",
        "/begin_weight_update", "/update_weights_from_distributed", "/update_weights_from_distributed",
        "/end_weight_update", "/destroy_weights_update_group",
        "/update_weights_from_disk",  # needs no session
        "/update_weights_from_disk",  # delta mode, fallen back to a full checkpoint (never /pull_weights)
    ]
    assert conformance["state"]["session_open"] is False


def test_broadcast_received_by_sglangs_weight_updater(conformance):
    distributed = conformance["weights"]["distributed"]
    assert distributed.get("error") is None, distributed
    assert distributed["state"] == EXPECTED  # FlattenedTensorBucket.empty + one gloo broadcast
    init = _requests(conformance, "/init_weights_update_group")[0]
    assert init["class"] == "InitWeightsUpdateGroupReqInput" and init["fields"]["backend"] == "gloo"
    update = _requests(conformance, "/update_weights_from_distributed")[0]["fields"]
    assert update["dtypes"] == ["float32"] and update["shapes"] == [[2, 3]] and update["weight_version"] == "6"
    assert _requests(conformance, "/destroy_weights_update_group")


def test_disk_update_body_passes_sglangs_request_class(conformance):
    request = _requests(conformance, "/update_weights_from_disk")[0]
    assert request["class"] == "UpdateWeightFromDiskReqInput"
    assert request["fields"]["model_path"].endswith("weight_v000007") and request["fields"]["weight_version"] == "7"
    assert conformance["state"]["log"]


def test_delta_disk_sync_falls_back_to_full_on_vanilla_sglang(conformance):
    delta = conformance["weights"]["delta_on_vanilla"]
    assert delta == {"delta_writer": False, "sent": 6 * 4 + 4 * 2 + 2 * 2}
    request = _requests(conformance, "/update_weights_from_disk")[1]["fields"]
    assert request["model_path"].endswith("weight_v000008") and request["weight_version"] == "8"
    assert not any(e["route"] == "/pull_weights" for e in conformance["state"]["log"])
