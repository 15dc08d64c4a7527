"""The trainer side of each weight transport, against a real embedded engine: after an update the
engine generates exactly what HF generates with the new weights, and reports the new version."""

import os
from types import SimpleNamespace

import httpx
import pytest
import torch

from slime.backends.embedded_engine.serving.launch import EmbeddedEngineProcess
from slime.backends.update_weight import bucket_named_tensors, make_weight_updater
from slime.backends.update_weight.base import cpu_engines_on_this_host
from slime.backends.update_weight.distributed import DistributedWeightUpdater
from slime.backends.update_weight.tensor import TensorWeightUpdater


def _greedy_hf(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def pre_read_log(tmp_path_factory):
    return tmp_path_factory.mktemp("pre_read") / "calls.txt"


@pytest.fixture(scope="module")
def engine(tiny_model_dir, pre_read_log):
    here = os.path.dirname(os.path.abspath(__file__))
    env = {"OMP_NUM_THREADS": "1", "PRE_READ_LOG": str(pre_read_log),
           "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    process = EmbeddedEngineProcess(tiny_model_dir, env=env, extra_args=[
        "--max-running-requests", "4", "--custom-pull-weights-pre-read-hook", "test_transports.record_pre_read"])
    process.start()
    try:
        process.wait_healthy(120)
        yield process
    finally:
        process.stop()


def _engine_greedy(url, prompt, n):
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    response = httpx.post(url + "/generate", json=body, timeout=60).json()
    return response["output_ids"], response["meta_info"]["weight_version"]


def _args(tmp_path, transport):
    return SimpleNamespace(update_weight_transport=transport, update_weight_mode="full", update_weight_disk_dir=str(tmp_path),
                           update_weight_disk_keep_files=False, custom_update_weight_post_write_path=None,
                           hf_checkpoint=None, distributed_timeout_minutes=5, cpu_only=True, rollout_backend="embedded")


@pytest.mark.parametrize("transport,colocate", [("nccl", True), ("nccl", False), ("broadcast", False), ("disk", False)],
                         ids=["tensor", "shared-memory", "distributed", "disk"])
def test_transport_updates_engine(engine, tiny_model_dir, tmp_path, transport, colocate):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    gen = torch.Generator().manual_seed(hash(transport + str(colocate)) % 1000)
    new_state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()
                 if k != "lm_head.weight"}  # tied to the embedding
    model.load_state_dict(new_state, strict=False)
    prompt = [1, 315, 207, 25, 26, 19, 27, 28]
    expected = _greedy_hf(model, prompt, 8)
    args = _args(tmp_path, transport)
    args.hf_checkpoint = tiny_model_dir
    if transport == "broadcast":  # the gloo broadcast itself (a local CPU engine gets shared memory by default)
        args.update_weight_transport = "nccl"
        updater = DistributedWeightUpdater(args, [engine.url], [1])
    else:
        updater = make_weight_updater(args, [engine.url], [1], colocate=colocate)
    if transport == "nccl":  # colocated, or a CPU engine on this machine: shared memory either way
        assert isinstance(updater, TensorWeightUpdater)
    version = str(abs(hash(transport + str(colocate))) % 1000 + 1)
    try:
        for _ in range(2):  # the second update reuses the send and receive buffers of the first
            updater.client.pause()
            sent = updater.update(bucket_named_tensors(new_state.items(), 200_000), version)
            updater.client.resume()
    finally:
        updater.close()
    assert sent == sum(t.numel() * t.element_size() for t in new_state.values())
    output, engine_version = _engine_greedy(engine.url, prompt, 8)
    assert output == expected
    assert engine_version == version


def test_disk_delta_updates_engine_through_pull_weights(engine, tiny_model_dir, tmp_path, pre_read_log):
    """Delta mode: the engine pulls each version into its local checkpoint and loads it; a corrupt
    version is refused with a 400 that names the tensor, and the engine keeps serving the last one."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    args = _args(tmp_path / "published", "disk")
    vars(args).update(update_weight_mode="delta", hf_checkpoint=tiny_model_dir, update_weight_delta_encoding="xor",
                update_weight_delta_checksum="xxh3-128", update_weight_local_checkpoint_dir=str(tmp_path / "local"))
    updater = make_weight_updater(args, [engine.url], [1], colocate=False)
    prompt = [1, 315, 207, 25, 26, 19, 27, 28]
    gen = torch.Generator().manual_seed(7)
    try:
        for version in ("1", "2"):
            state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
            model.load_state_dict(state, strict=False)
            updater.client.pause()
            updater.update(bucket_named_tensors(state.items(), 200_000), version)
            updater.client.resume()
            assert _engine_greedy(engine.url, prompt, 8) == (_greedy_hf(model, prompt, 8), version)
        # version 3 gets a byte flipped between writing and reading (by the post-write hook)
        args.custom_update_weight_post_write_path = f"{__name__}.corrupt_last_payload"
        updater.client.pause()
        with pytest.raises(RuntimeError, match=r"/pull_weights failed with 400: .*version 3: .*tensor model\."):
            updater.update(bucket_named_tensors(state.items(), 200_000), "3")
        updater.client.resume()
    finally:
        updater.close()
    assert _engine_greedy(engine.url, prompt, 8)[1] == "2"
    published = str(tmp_path / "published")
    assert pre_read_log.read_text().splitlines() == [f"{published} {v}" for v in (1, 2, 3)]  # the engine's read hook


def corrupt_last_payload(args, version_dir, engine_urls):
    shard = os.path.join(version_dir, "model-00001.safetensors")
    with open(shard, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def record_pre_read(source_dir, target_version):
    """The engine's --custom-pull-weights-pre-read-hook in these tests (runs in the engine process)."""
    with open(os.environ["PRE_READ_LOG"], "a") as f:
        f.write(f"{source_dir} {target_version}\n")


def test_shared_memory_only_for_embedded_cpu_engines_on_this_machine(engine, tmp_path, monkeypatch):
    args = _args(tmp_path, "nccl")
    assert cpu_engines_on_this_host(args, [engine.url])
    port = engine.url.rsplit(":", 1)[1]
    assert not cpu_engines_on_this_host(args, [f"http://10.1.2.3:{port}"])  # another machine: broadcast
    assert not cpu_engines_on_this_host(args, [])
    import slime.backends.update_weight.base as base

    real_get = httpx.get

    def reports(**fields):
        def get(url, **kwargs):
            response = real_get(url, **kwargs)
            return httpx.Response(200, json={**response.json(), **fields})
        return get

    monkeypatch.setattr(base.httpx, "get", reports(device="cuda"))  # a GPU engine
    assert not cpu_engines_on_this_host(args, [engine.url])
    monkeypatch.setattr(base.httpx, "get", reports(engine="sglang"))  # SGLang keeps the broadcast
    assert not cpu_engines_on_this_host(args, [engine.url])
    updater = make_weight_updater(args, [engine.url], [1], colocate=False)
    assert isinstance(updater, DistributedWeightUpdater)
    updater.close()
