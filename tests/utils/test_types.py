import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from slime.utils.types import MultimodalTypes, ParamInfo, Sample

EXPECTED_FIELDS = [
    ("group_index", None), ("index", None), ("rollout_id", None), ("prompt", ""), ("tokens", []),
    ("multimodal_inputs", None), ("multimodal_train_inputs", None), ("multimodal_train_input_id", None),
    ("apply_chat_template_kwargs", {}), ("response", ""), ("response_length", 0), ("label", None),
    ("reward", None), ("loss_mask", None), ("weight_versions", []), ("rollout_log_probs", None),
    ("rollout_top_p_token_ids", None), ("rollout_top_p_token_offsets", None), ("rollout_routed_experts", None),
    ("remove_sample", False), ("teacher_log_probs", None), ("status", Sample.Status.PENDING), ("metadata", {}),
    ("generate_function_path", None), ("custom_rm_path", None), ("train_metadata", None), ("session_id", None),
    ("non_generation_time", 0.0),
]


def test_fields_in_declaration_order_with_defaults():
    names = [f.name for f in dataclasses.fields(Sample)]
    assert names == [n for n, _ in EXPECTED_FIELDS] + ["spec_info", "prefix_cache_info"]
    sample = Sample()
    for name, default in EXPECTED_FIELDS:
        assert getattr(sample, name) == default, name
    assert sample.spec_info == Sample.SpecInfo() and sample.prefix_cache_info == Sample.PrefixCacheInfo()
    # mutable defaults are not shared between instances
    other = Sample()
    other.tokens.append(1)
    other.metadata["x"] = 1
    assert sample.tokens == [] and sample.metadata == {}


def test_status_values():
    assert {s.name: s.value for s in Sample.Status} == {
        "PENDING": "pending", "COMPLETED": "completed", "TRUNCATED": "truncated", "ABORTED": "aborted", "FAILED": "failed",
    }


def test_unhashable_and_field_equality():
    with pytest.raises(TypeError):
        hash(Sample())
    assert Sample(index=1, tokens=[1, 2]) == Sample(index=1, tokens=[1, 2])


def test_dict_round_trip_keeps_fields_and_unknown_keys():
    sample = Sample(group_index=3, index=7, rollout_id=9, prompt=[{"role": "user", "content": "hi"}], tokens=[1, 2, 3],
                    response="x", response_length=1, label="4", reward={"score": 1.0}, loss_mask=[1],
                    rollout_log_probs=[-0.5], status=Sample.Status.TRUNCATED, metadata={"k": [1]}, session_id="s")
    sample.spec_info.spec_verify_ct = 2
    sample.prefix_cache_info.cached_tokens = 5
    sample.trace = {"version": 1, "events": []}
    sample.source = "gsm8k"
    data = sample.to_dict()
    assert data["status"] == "truncated" and data["spec_info"]["spec_verify_ct"] == 2
    assert data["trace"] == {"version": 1, "events": []}
    restored = Sample.from_dict(copy.deepcopy(data))
    assert restored == sample
    assert restored.trace == sample.trace and restored.source == "gsm8k"
    assert Sample.from_dict({"status": "completed"}).spec_info == Sample.SpecInfo()
    with pytest.raises(KeyError, match="status"):
        Sample.from_dict({"index": 1})


def test_get_reward_value_and_effective_length():
    assert Sample(reward=0.5).get_reward_value(SimpleNamespace(reward_key=None)) == 0.5
    assert Sample(reward={"score": 2.0}).get_reward_value(SimpleNamespace(reward_key="score")) == 2.0
    with pytest.raises(KeyError, match="acc"):
        Sample(reward={"score": 2.0}).get_reward_value(SimpleNamespace(reward_key="acc"))
    assert Sample(response_length=4).effective_response_length == 4
    assert Sample(response_length=4, loss_mask=[1, 0, 0, 1]).effective_response_length == 2


def test_info_classes():
    info = Sample.SpecInfo()
    info.add({"spec_accept_token_num": 3, "spec_draft_token_num": 4, "spec_verify_ct": 2, "completion_tokens": 6})
    assert info.spec_accept_rate == 0.75 and info.spec_accept_length == 3
    assert Sample.SpecInfo().spec_accept_rate == 0
    cache = Sample.PrefixCacheInfo()
    cache.add({"cached_tokens": 2, "prompt_tokens": 8})
    assert cache.prefix_cache_hit_rate == 0.25
    assert Sample.PrefixCacheInfo.from_dict(cache.to_dict()) == cache


def test_append_response_tokens_multi_turn():
    sample = Sample(tokens=[10, 11])
    sample.append_response_tokens(tokens=torch.tensor([1, 2]), log_probs=[-0.1, -0.2], text="ab")
    sample.append_response_tokens(tokens=[3], trainable=False, text="<obs>")
    meta = {"finish_reason": {"type": "length"}, "weight_version": "3", "cached_tokens": 1, "prompt_tokens": 4}
    sample.append_response_tokens(tokens=[4], log_probs=[-0.4], meta_info=meta, text="c")
    assert sample.tokens == [10, 11, 1, 2, 3, 4]
    assert sample.response_length == 4 and sample.response == "ab<obs>c"
    assert sample.loss_mask == [1, 1, 0, 1]
    assert sample.rollout_log_probs == pytest.approx([-0.1, -0.2, 0.0, -0.4])
    assert sample.status == Sample.Status.TRUNCATED and sample.weight_versions == ["3"]
    assert sample.prefix_cache_info.total_prompt_tokens == 4


@pytest.mark.parametrize("finish,status", [("stop", "COMPLETED"), ("length", "TRUNCATED"), ("abort", "ABORTED"), ("weird", "PENDING")])
def test_finish_reason_mapping(finish, status):
    sample = Sample()
    sample.append_response_tokens(tokens=[1], log_probs=[-1.0], meta_info={"finish_reason": {"type": finish}})
    assert sample.status == Sample.Status[status]


def test_append_response_tokens_errors():
    with pytest.raises(ValueError, match="log_probs has 1 entries but tokens has 2"):
        Sample().append_response_tokens(tokens=[1, 2], log_probs=[0.0])
    with pytest.raises(ValueError, match="need log_probs"):
        Sample().append_response_tokens(tokens=[1])
    with pytest.raises(ValueError, match="must not carry log_probs"):
        Sample().append_response_tokens(tokens=[1], log_probs=[0.0], trainable=False)
    legacy = Sample(tokens=[1, 2], response_length=1)
    with pytest.raises(ValueError, match="no rollout_log_probs"):
        legacy.append_response_tokens(tokens=[3], log_probs=[0.0])


def test_top_p_replay_merge():
    import base64

    import numpy as np

    sample = Sample()
    ids = base64.b64encode(np.array([5, 6, 7], dtype="<i4").tobytes()).decode()
    sample.append_response_tokens(tokens=[5, 7], log_probs=[-1, -1],
                                  meta_info={"top_p_token_ids": ids, "top_p_token_offsets": [0, 2, 3]})
    sample.append_response_tokens(tokens=[9], trainable=False)
    assert sample.rollout_top_p_token_ids == [5, 6, 7]
    assert sample.rollout_top_p_token_offsets == [0, 2, 3, 3]
    with pytest.raises(ValueError, match="top-p offsets"):
        Sample().append_response_tokens(tokens=[1], log_probs=[0], meta_info={"top_p_token_ids": [1], "top_p_token_offsets": [0, 2]})


def test_other_public_types():
    info = ParamInfo("w", torch.float32, torch.Size([2]), {}, 8, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.name = "x"
    assert MultimodalTypes.get("image") == ("image", "<image>")
    assert MultimodalTypes.get("smell") is None
    assert [t.name for t in MultimodalTypes.all()] == ["image", "video", "audio"]


def test_rollout_output_containers():
    from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput, call_rollout_fn

    def fn(args, rollout_id, data_source, evaluation=False):
        return {"x": {"rewards": [], "truncated": [], "samples": []}} if evaluation else [[Sample()]]

    train = call_rollout_fn(fn, None, 0, None, evaluation=False)
    assert isinstance(train, RolloutFnTrainOutput) and train.metrics is None and len(train.samples) == 1
    assert isinstance(call_rollout_fn(fn, None, 0, None, evaluation=True), RolloutFnEvalOutput)


def test_append_with_only_meta_info_updates_the_terminal_info_and_nothing_else():
    from slime.utils.types import Sample

    sample = Sample(prompt="p", tokens=[1, 2, 3], index=0)
    before = (list(sample.tokens), sample.response, sample.response_length, sample.loss_mask,
              sample.rollout_log_probs, sample.rollout_top_p_token_offsets)
    sample.append_response_tokens(meta_info={"finish_reason": {"type": "stop"}, "weight_version": "3"})
    assert (list(sample.tokens), sample.response, sample.response_length, sample.loss_mask,
            sample.rollout_log_probs, sample.rollout_top_p_token_offsets) == before
    assert sample.status == Sample.Status.COMPLETED and sample.weight_versions == ["3"]
    # with a response already there, its mask and log-probs are untouched too
    sample = Sample(prompt="p", tokens=[1, 2], index=0)
    sample.append_response_tokens(tokens=[5, 6], log_probs=[-0.5, -0.25], meta_info={"finish_reason": {"type": "abort"}})
    sample.append_response_tokens(meta_info={"finish_reason": {"type": "length", "length": 2}})
    assert sample.tokens == [1, 2, 5, 6] and sample.loss_mask == [1, 1] and sample.rollout_log_probs == [-0.5, -0.25]
    assert sample.status == Sample.Status.TRUNCATED


def test_routed_experts_layout_from_the_hf_checkpoint_under_fsdp(tiny_deepseek_v3_dir):
    """Without Megatron's --num-layers (the FSDP backend) the engine's routed_experts rows are laid
    out by the checkpoint's config: num_hidden_layers x num_experts_per_tok; a wrong size is refused."""
    import base64
    from types import SimpleNamespace

    import numpy as np

    from slime.utils.types import Sample

    args = SimpleNamespace(num_layers=None, moe_router_topk=2, hf_checkpoint=tiny_deepseek_v3_dir)
    experts = np.arange(4 * 4 * 2, dtype="<i4").reshape(4, 4, 2) % 8  # 3 prompt + 2 response tokens - 1; 4 layers, top-2
    meta = {"finish_reason": {"type": "length"}, "routed_experts": base64.b64encode(experts.tobytes()).decode()}
    sample = Sample(index=0, tokens=[1, 2, 3])
    sample.append_response_tokens(args, tokens=[4, 5], log_probs=[0.0, 0.0], trainable=True, meta_info=meta)
    assert np.array_equal(np.asarray(sample.rollout_routed_experts), experts)
    bad = Sample(index=1, tokens=[1, 2])
    with pytest.raises(ValueError, match=r"holds 32 ids, expected \[len\(tokens\) - 1 - start = 3, layers = 4, top-k = 2\]"):
        bad.append_response_tokens(args, tokens=[4, 5], log_probs=[0.0, 0.0], trainable=True, meta_info=meta)
