"""The trainer side of each weight transport, against a real embedded engine: after an update the
engine generates exactly what HF generates with the new weights, and reports the new version."""

from types import SimpleNamespace

import httpx
import pytest
import torch

from slime.backends.embedded_engine.launch import EmbeddedEngineProcess
from slime.backends.update_weight import bucket_named_tensors, make_weight_updater


def _greedy_hf(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    process = EmbeddedEngineProcess(tiny_model_dir, extra_args=["--max-running-requests", "4"], env={"OMP_NUM_THREADS": "1"})
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
                           hf_checkpoint=None, distributed_timeout_minutes=5, cpu_only=True)


@pytest.mark.parametrize("transport,colocate", [("nccl", True), ("nccl", False), ("disk", False)],
                         ids=["tensor", "distributed", "disk"])
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
    updater = make_weight_updater(args, [engine.url], [1], colocate=colocate)
    version = str(abs(hash(transport + str(colocate))) % 1000 + 1)
    try:
        updater.client.pause()
        sent = updater.update(bucket_named_tensors(new_state.items(), 200_000), version)
        updater.client.resume()
    finally:
        updater.close()
    assert sent == sum(t.numel() * t.element_size() for t in new_state.values())
    output, engine_version = _engine_greedy(engine.url, prompt, 8)
    assert output == expected
    assert engine_version == version
