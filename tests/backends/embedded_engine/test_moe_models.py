"""The embedded engine serves the MoE families of the headline runs: DeepSeek-V3 (multi-latent
attention over a compressed KV cache, sigmoid routing with expert bias and group-limited top-k,
shared experts, dense first layers) and GLM-4.5 (grouped-query attention with partial rotary, the
same router), on tiny random fp32 checkpoints, against transformers' own implementation: greedy
decoding token for token, the reported log-probs, and weight updates sent by checkpoint name."""

from __future__ import annotations

import httpx
import pytest
import torch

from engine_test_utils import hf_greedy, hf_logprobs, load_hf
from slime.backends.embedded_engine.serving.launch import running_engine
from slime.backends.update_weight.wire_format import serialize_for_engine, use_file_system_sharing

pytestmark = pytest.mark.timeout(300)
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [100, 200, 300, 400, 500, 17, 3, 250, 9], [42]]


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def model_dir(request):
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture(scope="module")
def http(model_dir):
    # with the routed-experts capture on: the other tests check that it changes nothing else
    extra = ["--context-length", "256", "--max-running-requests", "8", "--enable-return-routed-experts"]
    with running_engine(model_dir, extra_args=extra) as proc:
        with httpx.Client(base_url=proc.url, timeout=120) as client:
            yield client


def generate(http, **body):
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_slot_cache_holds_what_the_attention_caches(model_dir):
    from slime.backends.embedded_engine.model_runner import ModelRunner

    runner = ModelRunner(model_dir, num_slots=2, slot_capacity=64)
    shape, config = runner.kv_cache.shape, runner.config
    if config.model_type == "deepseek_v3":  # one latent "head": the kv_lora_rank latent and the rotary key
        assert (shape.num_kv_heads, shape.head_dim, shape.value_width) == (1, config.kv_lora_rank, config.qk_rope_head_dim)
    else:
        assert (shape.num_kv_heads, shape.head_dim, shape.value_width) == (config.num_key_value_heads,) + (config.head_dim,) * 2
    assert runner.kv_cache.nbytes() == 2 * 64 * shape.bytes_per_token(torch.float32)


def test_greedy_and_logprobs_equal_hf(http, model_dir):
    hf = load_hf(model_dir)
    # the prompts of a batch decode together (different lengths: left padding, one slot each)
    outs = generate(http, input_ids=PROMPTS, return_logprob=True,
                    sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
    for prompt, out in zip(PROMPTS, outs):
        assert out["output_ids"] == hf_greedy(hf, prompt, 16), prompt
        got = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(hf_logprobs(hf, prompt, out["output_ids"], 1.0), abs=1e-4)
    sampled = generate(http, input_ids=PROMPTS[:2], return_logprob=True,
                       sampling_params={"max_new_tokens": 12, "temperature": 0.8, "ignore_eos": True})
    for prompt, out in zip(PROMPTS, sampled):
        got = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(hf_logprobs(hf, prompt, out["output_ids"], 0.8), abs=1e-4)


def test_weight_update_by_checkpoint_names(http, model_dir, tmp_path):
    """The trainer side may send experts as checkpoint tensors (``experts.{e}.gate_proj.weight``, as
    Megatron's export and SGLang name them) or as transformers' fused 3-D parameters: both land."""
    from safetensors.torch import load_file

    hf = load_hf(model_dir)
    checkpoint = load_file(f"{model_dir}/model.safetensors")  # checkpoint names
    generator = torch.Generator().manual_seed(3)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in checkpoint.items()}
    assert any(".experts.0.gate_proj.weight" in k for k in new)
    hf.load_state_dict(load_hf_state(hf, new))
    use_file_system_sharing()
    named = [(k, v.clone().share_memory_()) for k, v in new.items()]
    response = http.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [serialize_for_engine(named)], "weight_version": "moe-1"})
    assert response.json()["success"], response.text
    for prompt in PROMPTS[:3]:
        out = generate(http, input_ids=prompt, sampling_params={"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert out["output_ids"] == hf_greedy(hf, prompt, 12)
        assert out["meta_info"]["weight_version"] == "moe-1"
    # the fused spelling (what the FSDP trainer's state dict holds) restores the original weights
    original = load_hf(model_dir)
    fused = [(k, v.clone().share_memory_()) for k, v in original.state_dict().items()]
    assert http.post("/update_weights_from_tensor", json={"serialized_named_tensors": [serialize_for_engine(fused)],
                                                          "weight_version": "base"}).json()["success"]
    out = generate(http, input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert out["output_ids"] == hf_greedy(original, PROMPTS[0], 12)


def load_hf_state(model, checkpoint: dict) -> dict:
    """``checkpoint`` (checkpoint names) as ``model``'s state dict (fused experts)."""
    from slime.backends.embedded_engine.model_runner import _fused_expert_slice

    state = {k: v.clone() for k, v in model.state_dict().items()}
    for name, tensor in checkpoint.items():
        target = state.get(name)
        if target is None:
            target = _fused_expert_slice(state, name)
        target.copy_(tensor)
    return state


def test_absorbed_mla_decode_equals_the_expanded_reference(tiny_deepseek_v3_dir):
    """The engine's MLA decode (kv_b_proj absorbed into query and output, attention over the
    compressed latent) against transformers' expanded path, step by step on a batch of rows of
    different lengths, after a prefill (which both run the reference way)."""
    from slime.backends.embedded_engine.model_runner import ForwardRow, ModelRunner

    runners = {mode: ModelRunner(tiny_deepseek_v3_dir, num_slots=4, slot_capacity=64, mla_decode=mode)
               for mode in ("absorbed", "expanded")}
    assert runners["absorbed"].mla_layers == 4 and runners["expanded"].mla_layers == 0
    prompts = PROMPTS[:3]
    logits = {}
    for mode, runner in runners.items():
        last, _ = runner.forward([0, 1, 2], [ForwardRow(p, 0) for p in prompts])
        tokens, positions, steps = last.argmax(-1).tolist(), [len(p) for p in prompts], []
        for _ in range(6):
            out = runner.decode(tokens, positions)
            steps.append(out)
            tokens, positions = out.argmax(-1).tolist(), [p + 1 for p in positions]
        logits[mode] = torch.stack(steps)
    torch.testing.assert_close(logits["absorbed"], logits["expanded"], atol=1e-5, rtol=1e-5)
    assert logits["absorbed"].std() > 0.1  # real logits, not a degenerate constant



def test_routed_experts_wire_format_round_trips_through_the_rollout_decoder(http, model_dir):
    """meta_info.routed_experts is SGLang's base64 little-endian int32 [seqlen - 1 - start, layers, top-k]:
    the rollout's decoder (Sample) reads back the experts transformers' forward picks; requests that do
    not ask get no field; routed_experts_start_len outside [0, prompt] is a 400 (SGLang's messages)."""
    import base64
    from types import SimpleNamespace

    import numpy as np

    from slime.utils.types import Sample
    from test_routed_experts import hf_routed_experts

    hf = load_hf(model_dir)
    args = SimpleNamespace(num_layers=hf.config.num_hidden_layers, moe_router_topk=hf.config.num_experts_per_tok)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    body = {"input_ids": prompt, "return_logprob": True, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}}
    out = generate(http, **body)
    tail = generate(http, **body, routed_experts_start_len=7)
    plain = generate(http, **{**body, "return_routed_experts": False})
    too_far = http.post("/generate", json={**body, "routed_experts_start_len": 8})
    negative = http.post("/generate", json={**body, "routed_experts_start_len": -1})
    assert http.get("/get_server_info").json()["enable_return_routed_experts"] is True
    assert "routed_experts" not in plain["meta_info"]
    assert too_far.status_code == 400 and "higher than the number of input tokens" in too_far.text
    assert negative.status_code == 400 and "lower than 0" in negative.text
    tokens = prompt + out["output_ids"]
    raw = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype="<i4")
    assert raw.size == (len(tokens) - 1) * args.num_layers * args.moe_router_topk
    sample = Sample(tokens=list(prompt))  # what slime's generator does with the engine's answer
    sample.append_response_tokens(args, tokens=out["output_ids"], log_probs=[0.0] * len(out["output_ids"]),
                                  trainable=True, meta_info=out["meta_info"])
    np.testing.assert_array_equal(np.sort(np.asarray(sample.rollout_routed_experts), axis=-1),
                                  hf_routed_experts(hf, tokens))
    tail_rows = np.frombuffer(base64.b64decode(tail["meta_info"]["routed_experts"]), dtype="<i4")
    np.testing.assert_array_equal(np.sort(tail_rows.reshape(-1, args.num_layers, args.moe_router_topk), axis=-1),
                                  hf_routed_experts(hf, prompt + tail["output_ids"])[7:])
