"""The Megatron model flags upstream model scripts use (MLA, MoE routing, kernels, --spec): parsed,
passed into Megatron-Core's TransformerConfig where it implements them, refused by name otherwise."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime.backends.megatron_utils import model as mm
from slime.backends.megatron_utils.setup import refuse_unsupported
from slime.arguments import parse_args

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import megatron_cpu  # noqa: E402

# the Megatron backend's flags, parsed without Megatron-Core installed (--debug-rollout-only skips that check)
BASE = ["--rollout-batch-size", "4", "--num-rollout", "2", "--train-backend", "megatron", "--rollout-backend", "embedded",
        "--debug-rollout-only"]
MLA_MOE = ["--num-layers", "3", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
           "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--vocab-size", "256",
           "--multi-latent-attention", "--q-lora-rank", "48", "--kv-lora-rank", "32", "--qk-head-dim", "16",
           "--qk-pos-emb-head-dim", "8", "--v-head-dim", "24", "--rotary-scaling-factor", "40", "--mscale", "1.0",
           "--mscale-all-dim", "1.0", "--num-experts", "8", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
           "--moe-layer-freq", "[0]+[1]*2", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
           "--moe-router-bias-update-rate", "0.01", "--moe-router-topk-scaling-factor", "2.5",
           "--moe-router-num-groups", "4", "--moe-router-group-topk", "2", "--moe-router-dtype", "fp64",
           "--moe-token-drop-policy", "position", "--moe-expert-capacity-factor", "1.5",
           "--moe-shared-expert-intermediate-size", "32", "--no-rope-fusion", "--no-masked-softmax-fusion",
           "--no-gradient-accumulation-fusion", "--no-bias-swiglu-fusion", "--no-check-for-nan-in-loss-and-grad",
           "--deterministic-mode"]

CONFIG_SCRIPT = """
import json, os, sys
import torch.distributed as dist
from megatron.core import parallel_state
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
parallel_state.initialize_model_parallel(1, 1)
from slime.arguments import parse_args
from slime.backends.megatron_utils import model as mm
args = parse_args(json.loads(sys.argv[1]))
args.padded_vocab_size = 256
config = mm.transformer_config(args, use_cpu_initialization=True)
fields = ["multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
          "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim", "moe_router_score_function",
          "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_router_topk_scaling_factor",
          "moe_router_num_groups", "moe_router_group_topk", "moe_router_dtype", "moe_token_drop_policy",
          "moe_expert_capacity_factor", "moe_layer_freq", "apply_rope_fusion", "masked_softmax_fusion",
          "gradient_accumulation_fusion", "deterministic_mode", "rotary_interleaved"]
out = {f: getattr(config, f) for f in fields}
out["class"] = type(config).__name__
spec = mm._layer_spec(args, config, None)
out["attention"] = spec.layer_specs[0].submodules.self_attention.module.__name__
# --spec: a function (args, config, vp_stage) -> ModuleSpec replaces the layer spec
import my_spec
args = parse_args(json.loads(sys.argv[3]))
spec = mm._layer_spec(args, mm.transformer_config(args, use_cpu_initialization=True), None)
out["spec"] = [my_spec.CALLS, spec.submodules.self_attention.submodules.q_layernorm is not None]
print(json.dumps(out))
"""
SPEC_MODULE = """
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
CALLS = []
def build(args, config, vp_stage):
    CALLS.append(config.num_layers)
    return get_gpt_layer_local_spec(qk_layernorm=True)
"""
SPEC_SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--ffn-hidden-size", "64",
              "--spec", "my_spec", "build"]


def test_upstream_megatron_flags_parse_with_their_values():
    args = parse_args(BASE + MLA_MOE)
    assert args.multi_latent_attention and (args.q_lora_rank, args.kv_lora_rank) == (48, 32)
    assert (args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim) == (16, 8, 24)
    assert args.rotary_scaling_factor == 40 and args.mscale_all_dim == 1.0
    assert args.moe_router_enable_expert_bias and args.moe_router_topk_scaling_factor == 2.5
    assert (args.moe_router_num_groups, args.moe_router_group_topk, args.moe_router_dtype) == (4, 2, "fp64")
    assert args.moe_token_drop_policy == "position" and args.moe_layer_freq == [0, 1, 1]
    assert args.apply_rope_fusion is False and args.check_for_nan_in_loss_and_grad is False and args.deterministic_mode


def test_megatron_core_gets_the_mla_and_router_flags_and_the_spec(tmp_path):
    path = megatron_cpu.pythonpath()
    if path is None:
        pytest.skip("Megatron-Core's code is not unpacked in .venv/megatron-core (bash scripts/setup-env.sh does it)")
    (tmp_path / "my_spec.py").write_text(SPEC_MODULE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, str(tmp_path)]), "CUDA_VISIBLE_DEVICES": ""}
    argv = [json.dumps(BASE + MLA_MOE), str(mm._free_port()), json.dumps(BASE + SPEC_SHAPE)]
    proc = subprocess.run([sys.executable, "-c", CONFIG_SCRIPT, *argv], cwd=megatron_cpu.ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    config = json.loads(proc.stdout.strip().splitlines()[-1])
    assert config.pop("class") == "MLATransformerConfig" and config.pop("attention") == "MLASelfAttention"
    assert config.pop("spec") == [[2], True]  # the --spec function was called with the config, its spec used
    assert config == {
        "multi_latent_attention": True, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_head_dim": 16,
        "qk_pos_emb_head_dim": 8, "v_head_dim": 24, "rope_type": "yarn", "rotary_scaling_factor": 40.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 0.01, "moe_router_topk_scaling_factor": 2.5, "moe_router_num_groups": 4,
        "moe_router_group_topk": 2, "moe_router_dtype": "fp64", "moe_token_drop_policy": "position",
        "moe_expert_capacity_factor": 1.5, "moe_layer_freq": [0, 1, 1], "apply_rope_fusion": False,
        "masked_softmax_fusion": False, "gradient_accumulation_fusion": False, "deterministic_mode": True,
        "rotary_interleaved": False}


def test_flags_that_need_missing_libraries_are_refused_by_name():
    if not mm.have_transformer_engine():
        args = parse_args(BASE + ["--moe-permute-fusion"])
        args.__dict__.update(megatron_config_path=None)
        with pytest.raises(NotImplementedError, match="--moe-permute-fusion without Transformer Engine"):
            refuse_unsupported(args)
    if not mm.have_deepep():
        with pytest.raises(ValueError, match="--moe-enable-deepep needs CUDA GPUs and the deep_ep package"):
            parse_args([a if a != "fsdp" else "megatron" for a in BASE] + ["--moe-enable-deepep"])
    with pytest.raises(ValueError, match="--fp8-format 'e4m3' is not implemented.*Transformer Engine"):
        parse_args(BASE + ["--fp8-format", "e4m3"])
    args = parse_args(BASE + ["--multi-latent-attention", "--rotary-interleaved"])
    with pytest.raises(NotImplementedError, match="--rotary-interleaved with --multi-latent-attention"):
        refuse_unsupported(args)


def test_contradicting_model_flags_fail_at_parse():
    with pytest.raises(ValueError, match="--moe-router-group-topk 2 needs --moe-router-num-groups"):
        parse_args(BASE + ["--moe-router-group-topk", "2"])
    with pytest.raises(ValueError, match="--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"):
        parse_args(BASE + ["--moe-router-enable-expert-bias"])
    with pytest.raises(ValueError, match="pass --multi-latent-attention too"):
        parse_args(BASE + ["--q-lora-rank", "16"])
    with pytest.raises(ValueError, match="--rotary-scaling-factor 8.0 and --rope-scaling-factor 4.0"):
        parse_args(BASE + ["--use-rope-scaling", "--rotary-scaling-factor", "8", "--rope-scaling-factor", "4"])
    # upstream's Llama 3.1 spelling: --rotary-scaling-factor is the Llama factor without MLA
    args = parse_args(BASE + ["--use-rope-scaling", "--rotary-scaling-factor", "16"])
    assert mm.llama_rope_scaling_factor(args) == 16.0


def test_glm4_and_qwen35_layer_flags_parse_and_the_backend_says_what_it_builds():
    """Upstream's GLM-4 (--post-self-attn-layernorm / --post-mlp-layernorm, built: sandwich_norm.py), Qwen3.5
    (--use-gated-attention, gated-DeltaNet, zero-centred norms), GLM-5 (DSA) and MiMo (--mtp-num-layers) flags
    parse; what the Megatron backend does not build it refuses when it starts, naming what is missing; --train-backend
    fsdp (shape from config.json) refuses the model flags at parse."""
    args = parse_args(BASE + ["--post-self-attn-layernorm", "--post-mlp-layernorm", "--enable-experimental"])
    assert args.post_self_attn_layernorm and args.post_mlp_layernorm and args.enable_experimental
    refuse_unsupported(args)
    with pytest.raises(NotImplementedError, match="--post-self-attn-layernorm without --post-mlp-layernorm"):
        refuse_unsupported(parse_args(BASE + ["--post-self-attn-layernorm"]))
    args = parse_args(BASE + ["--use-gated-attention", "--apply-layernorm-1p", "--experimental-attention-variant",
                              "gated_delta_net", "--linear-num-value-heads", "32"])
    with pytest.raises(NotImplementedError, match="--use-gated-attention / --experimental-attention-variant / "
                                                  "--apply-layernorm-1p / --linear-num-value-heads .*gated-DeltaNet.*"
                                                  "--train-backend fsdp"):
        refuse_unsupported(args)
    # GLM-5's DSA and MiMo's multi-token prediction: parse, refused at start with what is missing
    with pytest.raises(NotImplementedError, match="--experimental-attention-variant dsa .*no HF weight mapping"):
        refuse_unsupported(parse_args(BASE + ["--experimental-attention-variant", "dsa"]))
    with pytest.raises(NotImplementedError, match="--mtp-num-layers 1 .*the HF weight mapping has none"):
        refuse_unsupported(parse_args(BASE + ["--mtp-num-layers", "1"]))
    fsdp = [a if a != "megatron" else "fsdp" for a in BASE]
    for flag in ("--use-gated-attention", "--post-mlp-layernorm", "--enable-experimental", "--apply-layernorm-1p"):
        with pytest.raises(ValueError, match=f"--train-backend fsdp does not read {flag} True"):
            parse_args(fsdp + [flag])


def test_vision_language_flags_are_refused():
    for extra in (["--multimodal-keys", '{"image": "images"}'], ["--freeze-vision-tower"]):
        args = parse_args(BASE + extra)
        args.__dict__.update(megatron_config_path=None)
        with pytest.raises(NotImplementedError, match="vision-language models train with --train-backend fsdp"):
            refuse_unsupported(args)


@pytest.mark.parametrize("plugin", [["--custom-model-provider-path", "slime_plugins.models.qwen3_5_vl.model_provider"],
                                    ["--spec", "slime_plugins.models.qwen3_5", "get_qwen3_5_spec"],
                                    ["--spec", "slime_plugins.models.qwen3_5_vl.get_spec"],
                                    ["--custom-model-provider-path", "qwen3_5_vl_provider.model_provider"]])
def test_upstream_model_plugins_are_refused_naming_fsdp(plugin):
    """An upstream Qwen3.5 (vision-language) script: its preset and a model plugin that is not here (in upstream's
    plugin package, or any missing module beside the preset's flags). Start-up refuses it with what trains the
    model here, instead of a bare import error."""
    from slime.preflight import UserError, check_model_plugins, preflight
    from tests.backends.megatron_utils.test_model_config import preset_args

    args = parse_args(BASE + preset_args("qwen3.5-0.8B") + plugin)
    with pytest.raises(UserError, match=rf"^{plugin[0]} {plugin[1]}.*no such module here.*vision tower.*"
                                        r"--train-backend fsdp.*--multimodal-keys"):
        preflight(args)
    # a provider of the user's own module goes on to the hook check (signature, import errors of its own)
    provider = ["--custom-model-provider-path", "tests.backends.megatron_utils.megatron_hooks.provider"]
    check_model_plugins(parse_args(BASE + preset_args("qwen3.5-0.8B") + provider))
    # a missing module of a model this backend builds: the hook check's own message
    check_model_plugins(parse_args(BASE + ["--custom-model-provider-path", "my_providers.gpt"]))
