"""Every flag of Megatron-LM's model groups (its training arguments.py: transformer configuration,
network size, moe, mla, mixed precision, Transformer-Engine) parses in slime, and is either slime's own,
a TransformerConfig field handed to Megatron-Core when set, or refused at start with what is missing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime.arguments import get_parser, parse_args, refused_flag_defaults
from slime.utils.arguments_groups import megatron_lm_passthrough_dests
from slime.utils.megatron_lm_flags import MEGATRON_LM_FLAGS

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import megatron_cpu  # noqa: E402
from test_model_config import PRESETS, preset_args  # noqa: E402

BASE = ["--rollout-batch-size", "4", "--num-rollout", "2", "--train-backend", "fsdp", "--rollout-backend", "embedded"]
SCRIPT = """
import json, sys
sys.path.insert(0, "tools")
from gen_megatron_lm_flags import megatron_lm_model_flags
from slime.arguments import parse_args
from slime.backends.megatron_utils import model as mm, setup
flags = [list(f["strings"]) for f in megatron_lm_model_flags()]
args = parse_args(json.loads(sys.argv[1]))
config = mm.transformer_config(args, use_cpu_initialization=True)
presets = {}
for name, argv in json.loads(sys.argv[2]).items():  # each preset's Megatron-Core config (validated by its __post_init__)
    try:  # layers the Megatron backend does not build: refused by name, at parse or when the backend starts
        parsed = parse_args(argv)
        setup.refuse_unsupported(parsed)
    except (ValueError, NotImplementedError) as refused:
        presets[name] = ["refused", str(refused)]
        continue
    preset = mm.transformer_config(parsed, use_cpu_initialization=True)
    presets[name] = [type(preset).__name__, preset.num_layers, preset.num_moe_experts,
                     sum(preset.moe_layer_freq) if isinstance(preset.moe_layer_freq, list) else None,
                     getattr(preset, "beta_fast", None)]
# Kimi-K2's YaRN frequencies: Megatron-Core's MLA rotary built from the preset vs transformers' DeepSeek-V3 YaRN
sys.path.insert(0, "tests/backends/megatron_utils")
import megatron_cpu
megatron_cpu.patch_for_cpu()
import torch, transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
kimi = mm.transformer_config(parse_args(json.loads(sys.argv[2])["kimi-k2"]), use_cpu_initialization=True)
hf = transformers.DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=131072, rope_parameters=dict(
    rope_type="yarn", rope_theta=50000.0, factor=32.0, beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
    original_max_position_embeddings=4096))
hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
def megatron_freqs(beta_fast):
    rope = YarnRotaryEmbedding(kimi.qk_pos_emb_head_dim, rotary_base=kimi.rotary_base, scaling_factor=kimi.rotary_scaling_factor,
                               original_max_position_embeddings=kimi.original_max_position_embeddings,
                               beta_fast=beta_fast, beta_slow=kimi.beta_slow, mscale=kimi.mscale,
                               mscale_all_dim=kimi.mscale_all_dim, use_cpu_initialization=True)
    return rope.get_emb(2)[0][1, 0, 0, : kimi.qk_pos_emb_head_dim // 2]  # position 1: the frequencies themselves
yarn = {"preset": (megatron_freqs(kimi.beta_fast) - hf_inv_freq).abs().max().item(),
        "beta_fast_32": (megatron_freqs(32.0) - hf_inv_freq).abs().max().item()}
print(json.dumps({"yarn": yarn, "flags": flags, "init_method_std": config.init_method_std,
                  "moe_shared_expert_overlap": config.moe_shared_expert_overlap, "moe_z_loss_coeff": config.moe_z_loss_coeff,
                  "presets": presets}))
"""
DENSE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--ffn-hidden-size", "64",
         "--normalization", "RMSNorm", "--swiglu", "--train-backend", "megatron", "--init-method-std", "0.01",
         "--moe-shared-expert-overlap", "--moe-z-loss-coeff", "0.001"]


@pytest.fixture(scope="module")
def megatron_lm():
    path = megatron_cpu.pythonpath()
    if path is None:
        pytest.skip("Megatron-Core's code is not unpacked in .venv/megatron-core (bash scripts/setup-env.sh does it)")
    env = {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    megatron_base = [a for a in BASE if a not in ("--train-backend", "fsdp")] + ["--train-backend", "megatron"]
    presets = {p.stem: megatron_base + preset_args(p.stem) for p in PRESETS.glob("*.sh")}
    argv = [a for a in BASE if a not in ("--train-backend", "fsdp")] + DENSE
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(argv), json.dumps(presets)], cwd=megatron_cpu.ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_megatron_lm_model_flag_parses_and_is_passed_or_refused(megatron_lm):
    """slime's own flags are read where they take effect (tests/test_no_silent_flags.py); each flag it
    defines only for upstream scripts (slime/utils/megatron_lm_flags.py) is passed to Megatron-Core or refused."""
    parser, _ = get_parser(parse_sglang=False)
    actions = parser._option_string_actions
    table = {strings[0]: dest for strings, dest, *_ in MEGATRON_LM_FLAGS}
    passed = set(megatron_lm_passthrough_dests())
    refused_dests = {dest for dest, _ in refused_flag_defaults().items()}
    unparsed, unhandled, counts = [], [], {"slime": 0, "passed": 0, "refused": 0}
    for strings in megatron_lm["flags"]:
        if not all(s in actions for s in strings):
            unparsed.append(strings[0])
            continue
        dest = actions[strings[0]].dest
        if strings[0] not in table:
            counts["slime"] += 1
        elif dest in passed:
            counts["passed"] += 1
        elif dest in refused_dests or dest == "add_position_embedding":  # RoPE only: what slime always does
            counts["refused"] += 1
        else:
            unhandled.append(strings[0])
    assert not unparsed, f"Megatron-LM flags slime does not parse (python tools/gen_megatron_lm_flags.py): {unparsed}"
    assert not unhandled, f"defined for upstream scripts but neither passed to Megatron-Core nor refused: {unhandled}"
    assert len(megatron_lm["flags"]) > 250 and min(counts.values()) > 20, counts
    # the table holds nothing slime defines itself (the generator skips those)
    assert not {s for strings, *_ in MEGATRON_LM_FLAGS for s in strings} & {
        o for a in parser._actions if a.dest not in {d for _, d, *_ in MEGATRON_LM_FLAGS} for o in a.option_strings}


def test_a_passed_flag_reaches_megatron_cores_config(megatron_lm):
    assert megatron_lm["init_method_std"] == 0.01 and megatron_lm["moe_shared_expert_overlap"] is True
    assert megatron_lm["moe_z_loss_coeff"] == 0.001


def test_every_preset_builds_its_megatron_core_config(megatron_lm):
    """scripts/models/*.sh through slime's parser into Megatron-Core's (MLA)TransformerConfig, whose own
    checks pass (head and expert divisibility, the MoE layer pattern's length); no weights are built."""
    presets = megatron_lm["presets"]
    assert set(presets) == {p.stem for p in PRESETS.glob("*.sh")}
    assert presets["deepseek-v3"] == ["MLATransformerConfig", 61, 256, 58, 32.0]
    assert presets["kimi-k2"] == ["MLATransformerConfig", 61, 384, 60, 1.0]  # Kimi-K2's YaRN beta_fast reaches MLA
    assert presets["moonlight-16B-A3B"] == ["MLATransformerConfig", 27, 64, 26, 32.0]
    assert presets["glm4.5-355B-A32B"] == ["TransformerConfig", 92, 160, 89, None]
    assert presets["glm4.5-air"] == ["TransformerConfig", 46, 128, 45, None]
    assert presets["qwen3-30B-A3B"] == ["TransformerConfig", 48, 128, None, None]
    assert presets["glm4-9B"] == ["TransformerConfig", 40, None, None, None]  # GLM-4 dense: built (sandwich_norm.py)
    # Qwen3.5 / Qwen3-Next (gated-DeltaNet): refused, saying what to use instead
    refused = {name: message for name, (kind, *message) in presets.items() if kind == "refused"}
    assert set(refused) == {"qwen3.5-0.8B", "qwen3.5-4B", "qwen3.5-9B", "qwen3.5-27B", "qwen3.5-35B-A3B",
                            "qwen3-next-80B-A3B"}
    for name, (message,) in refused.items():
        assert "megatron does not support --use-gated-attention" in message and "--train-backend fsdp" in message, message


def test_kimi_k2_yarn_frequencies_equal_transformers(megatron_lm):
    """The Kimi-K2 preset's MLA rotary frequencies (Megatron-Core's YaRN, beta_fast 1 from --yarn-beta-fast)
    equal transformers' YaRN for its config; with DeepSeek-V3's beta_fast 32 (hard-wired before) they do not."""
    assert megatron_lm["yarn"]["preset"] < 1e-6 and megatron_lm["yarn"]["beta_fast_32"] > 1e-3, megatron_lm["yarn"]


def test_refused_and_backend_bound_flags_say_why():
    with pytest.raises(ValueError, match=r"--fp8-margin 1 is not implemented by slime \(FP8/FP4 training needs "
                                         r"Transformer Engine"):
        parse_args(BASE + ["--fp8-margin", "1"])
    with pytest.raises(ValueError, match="--mtp-standalone True is not implemented.*multi-token-prediction"):
        parse_args(BASE + ["--mtp-standalone"])
    with pytest.raises(ValueError, match="--softmax-type 'off-by-one' is not implemented.*away from the HF architecture"):
        parse_args(BASE + ["--softmax-type", "off-by-one"])
    with pytest.raises(ValueError, match="--account-for-embedding-in-pipeline-split True .*decoder-first/last"):
        parse_args(BASE + ["--account-for-embedding-in-pipeline-split"])
    with pytest.raises(ValueError, match="--init-method-std: Megatron-Core TransformerConfig fields, used only with "
                                         "--train-backend megatron"):
        parse_args(BASE + ["--init-method-std", "0.01"])
    args = parse_args(BASE + ["--no-position-embedding"])  # RoPE only: what slime always does
    assert args.add_position_embedding is False
