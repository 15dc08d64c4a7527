"""slime's own clients, run against SGLang's HTTP front end (``sglang_front_end``), with SGLang importable.

The trainer side of a colocated update builds its payload from SGLang's classes, so it needs SGLang
on the path as a GPU trainer has it; this module is therefore run in a subprocess
(``sglang_env.run_module``). It reads ``{"url", "model_dir", "tmp_dir"}`` on stdin, drives the
default rollout's ``generate``, the admin client, the tensor, broadcast and disk weight updaters
and the external-engine probe, and prints one JSON line of what each returned or raised.
"""

from __future__ import annotations

import json
import os
import sys

from tests.backends.sglang_utils.sglang_env import prepare_imports

BUCKETS = [[("model.embed.weight", [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], "float32")],
           [("lm_head.weight", [0.5, 0.5, 0.5, 0.5], "bfloat16"), ("model.norm.weight", [1.0, -1.0], "float16")]]


def buckets():
    import torch

    return [[(name, torch.tensor(values, dtype=getattr(torch, dtype))) for name, values, dtype in bucket]
            for bucket in BUCKETS]


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def main() -> None:
    request = json.loads(sys.stdin.read())
    prepare_imports()
    import httpx

    from slime.backends.sglang_utils.external import describe_external_engines
    from slime.backends.update_weight.base import EngineClient
    from slime.backends.update_weight.disk import DiskWeightUpdater
    from slime.backends.update_weight.distributed import DistributedWeightUpdater
    from slime.backends.update_weight.tensor import TensorWeightUpdater
    from slime.backends.update_weight.wire_format import flatten_tensors, serialize_for_engine, use_file_system_sharing
    from slime.rollout.sglang_rollout import GenerateState, generate
    from slime.arguments import parse_args
    from slime.utils.async_utils import run
    from slime.utils.types import Sample

    use_file_system_sharing()  # CPU payloads are shared-memory files the server opens by name
    url, port = request["url"], request["url"].rsplit(":", 1)[1]
    prompts = os.path.join(request["tmp_dir"], "prompts.jsonl")
    with open(prompts, "w") as f:
        f.write(json.dumps({"input": "what is 1 plus 1", "label": "2"}) + "\n")
    argv = ["--train-backend", "fsdp", "--hf-checkpoint", request["model_dir"], "--prompt-data", prompts,
            "--rollout-external-engine-addrs", f"127.0.0.1:{port}", "--sglang-router-ip", "127.0.0.1",
            "--sglang-router-port", port, "--rollout-batch-size", "1", "--n-samples-per-prompt", "1",
            "--num-rollout", "1", "--rollout-max-response-len", "16", "--rm-type", "math", "--cpu-only",
            "--rollout-top-p", "0.9", "--rollout-top-k", "20", "--rollout-stop", "###",
            "--rollout-stop-token-ids", "7", "--update-weight-disk-dir", os.path.join(request["tmp_dir"], "disk")]
    args = parse_args(argv)
    args.rollout_engine_urls = [url]
    out: dict = {}

    _, counts, layout = describe_external_engines([f"127.0.0.1:{port}"])
    out["external"] = {"gpu_counts": counts, "layout": layout}

    params = dict(GenerateState(args).sampling_params)
    samples = {}
    for label, extra in {"base": {}, "seeded": {"sampling_seed": 1234, "repetition_penalty": 1.1,
                                                "min_new_tokens": 1}}.items():
        sample = run(generate(args, Sample(prompt="what is 1 plus 1", index=0), {**params, **extra}))
        samples[label] = {"status": sample.status.value, "response_length": sample.response_length,
                          "log_probs": sample.rollout_log_probs, "weight_versions": sample.weight_versions,
                          "error": sample.metadata.get("generate_error")}
    long_prompt = Sample(prompt=" ".join(["plus"] * 200), index=1)  # past the 64-token context
    sample = run(generate(args, long_prompt, params))
    samples["too_long"] = {"status": sample.status.value, "error": sample.metadata.get("generate_error")}
    out["generate"] = samples

    client = EngineClient([url])
    client.pause()
    client.resume()
    client.post(url, "/abort_request", {"abort_all": True})
    client.post(url, "/release_memory_occupation", {})
    client.post(url, "/resume_memory_occupation", {"tags": ["weights"]})

    results = {}
    # a payload in the embedded engine's dialect (slime's own metadata class), sent to SGLang anyway
    flat = flatten_tensors(buckets()[0])
    with client.weight_update_session():
        try:
            client.post(url, "/update_weights_from_tensor", {
                "serialized_named_tensors": [serialize_for_engine(flat)], "load_format": "flattened_bucket",
                "flush_cache": False})
            results["embedded_dialect"] = "accepted"
        except RuntimeError as e:
            results["embedded_dialect"] = _error(e)
    try:  # outside a session
        client.post(url, "/update_weights_from_tensor", {
            "serialized_named_tensors": [serialize_for_engine(flat, for_sglang=True)], "load_format": "flattened_bucket"})
        results["outside_session"] = "accepted"
    except RuntimeError as e:
        results["outside_session"] = _error(e)

    for label, make, version in (("tensor", lambda: TensorWeightUpdater(args, [url], [1]), "5"),
                                 ("distributed", lambda: DistributedWeightUpdater(args, [url], [1]), "6")):
        updater = make()
        try:
            results[label] = {"sent": updater.update(buckets(), weight_version=version),
                              "state": httpx.get(url + "/probe/state").json()["loaded"]}
        except Exception as e:
            results[label] = {"error": _error(e)}
        finally:
            updater.close()
        httpx.post(url + "/probe/clear")
    disk = DiskWeightUpdater(args, [url])
    try:
        results["disk"] = {"sent": disk.update(buckets(), weight_version="7")}
    finally:
        disk.close()
    delta_args = parse_args(argv + ["--update-weight-transport", "disk", "--update-weight-mode", "delta",
                                    "--update-weight-local-checkpoint-dir", os.path.join(request["tmp_dir"], "local")])
    delta = DiskWeightUpdater(delta_args, [url])  # vanilla SGLang lacks /pull_weights: full checkpoints instead
    try:
        results["delta_on_vanilla"] = {"delta_writer": delta.delta_writer is not None,
                                       "sent": delta.update(buckets(), weight_version="8")}
    finally:
        delta.close()
    out["weights"] = results
    out["state"] = httpx.get(url + "/probe/state").json()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
