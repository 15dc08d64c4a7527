"""Model-shape flags (Megatron spelling) <-> the Hugging Face config at ``--hf-checkpoint``.

The seed's ``scripts/models/*.sh`` presets spell a model's shape as Megatron flags
(``--num-layers``, ``--hidden-size``, ``--rotary-base`` ...). A preset that does not match the
checkpoint trains a different network than the one the engine serves, and nothing fails until the
log-probs disagree; :func:`hf_validate_args` turns that into an error at start-up that names every
mismatching field. :func:`model_args_from_hf_config` is the other direction: the flags a preset
would set, read from a config (used when no preset is given, and to write presets).

Pure Python: reads ``config.json`` as a dict; no Megatron or transformers import.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["load_hf_config", "rope_theta", "model_args_from_hf_config", "hf_validate_args", "fill_model_args",
           "MODEL_SHAPE_FLAGS"]

#: argparse destinations of the shape flags a preset sets (filled from the HF config when unset).
MODEL_SHAPE_FLAGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
    "num_query_groups", "kv_channels", "rotary_base", "normalization", "norm_epsilon", "swiglu",
    "disable_bias_linear", "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights", "vocab_size",
    "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_shared_expert_intermediate_size",
    "moe_router_pre_softmax", "moe_shared_expert_gate", "moe_layer_freq", "use_rope_scaling", "rope_scaling_factor",
    "rotary_percent", "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
    "moe_router_num_groups", "moe_router_group_topk", "multi_latent_attention", "q_lora_rank", "kv_lora_rank",
    "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rotary_scaling_factor", "mscale", "mscale_all_dim", "rope_type",
    "rotary_interleaved", "use_gated_attention", "apply_layernorm_1p", "experimental_attention_variant",
    "linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "post_self_attn_layernorm", "post_mlp_layernorm",
)

#: families whose MoE is DeepSeek-V3's: sigmoid scores, a per-expert bias for the choice only, group-limited
#: top-k, routed_scaling_factor, shared experts of n_shared_experts x moe_intermediate_size, dense first layers
SIGMOID_MOE_TYPES = ("deepseek_v3", "kimi_k2", "glm4_moe")
#: configs of DeepSeek-V3's architecture (Kimi-K2's config.json names its own model_type, with the same fields)
MLA_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
#: hybrid families: gated-DeltaNet linear attention beside gated softmax attention, zero-centred RMSNorm weights
#: (weight + 1), a sigmoid-gated shared expert in the MoE variants
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
#: GLM-4 dense: RMSNorm on the attention and MLP outputs too, interleaved partial rotary
SANDWICH_NORM_MODEL_TYPES = ("glm4",)
_HYBRID_NOT_BUILT = ("Qwen3.5 / Qwen3-Next layers (gated attention, gated-DeltaNet linear attention, zero-centred "
                     "norms) are not built by the Megatron backend; train them with --train-backend fsdp, which builds "
                     "the model from --hf-checkpoint's config.json (drop MODEL_ARGS)")
#: model_type -> what the Megatron backend lacks for it, and what to use instead
NOT_BUILT_BY_MEGATRON = {model_type: _HYBRID_NOT_BUILT for model_type in HYBRID_MODEL_TYPES}


def load_hf_config(path: str) -> dict:
    """``config.json`` of an HF checkpoint directory as a dict (error names the path)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"--hf-checkpoint {path!r} has no config.json")
    with open(config_path) as f:
        return json.load(f)


def rope_theta(config: dict) -> float | None:
    """``rope_theta`` at the top level (transformers 4) or inside ``rope_parameters`` (transformers 5)."""
    if config.get("rope_theta") is not None:
        return float(config["rope_theta"])
    params = config.get("rope_parameters") or {}
    return float(params["rope_theta"]) if params.get("rope_theta") is not None else None


def _rope_scaling(config: dict) -> dict | None:
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    return scaling if kind == "llama3" else None


def text_config(config: dict) -> dict:
    """The language model's fields of a config: a multimodal config's ``text_config`` (Qwen3.5) merged over its
    top level, under the top-level ``model_type``; a text-only config as it is."""
    if not isinstance(config.get("text_config"), dict):
        return config
    return {**config, **config["text_config"], "model_type": config.get("model_type")}


def linear_attention_pattern(config: dict) -> list[int] | None:
    """Per layer 1 for gated-DeltaNet linear attention, 0 for softmax attention (None: no linear layers)."""
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None and config.get("model_type") in HYBRID_MODEL_TYPES:
        interval = int(config.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if not types or "linear_attention" not in types:
        return None
    return [int(t == "linear_attention") for t in types]


def expand_layer_pattern(freq, num_layers: int) -> list[int]:
    """Megatron's ``--linear-attention-freq`` as a per-layer list: N means every N-th layer is softmax attention."""
    if isinstance(freq, int):
        return [int((i + 1) % freq != 0) for i in range(num_layers)]
    return list(freq)


def _num_experts(config: dict) -> int:
    return int(config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0)


def _is_moe(config: dict) -> bool:
    return (str(config.get("model_type")).endswith("_moe") or config.get("model_type") in SIGMOID_MOE_TYPES
            or config.get("model_type") == "qwen3_next")


def _rope_parameters(config: dict) -> dict:
    return config.get("rope_scaling") or config.get("rope_parameters") or {}


def _mla_args(config: dict) -> dict[str, Any]:
    """MLA shape flags of a DeepSeek-V3-family config (Megatron's qk_head_dim excludes the rotary part)."""
    rope = _rope_parameters(config)
    yarn = (rope.get("rope_type") or rope.get("type")) == "yarn"
    return {
        "multi_latent_attention": True,
        "q_lora_rank": int(config["q_lora_rank"]) if config.get("q_lora_rank") else None,
        "kv_lora_rank": int(config["kv_lora_rank"]), "qk_head_dim": int(config["qk_nope_head_dim"]),
        "qk_pos_emb_head_dim": int(config["qk_rope_head_dim"]), "v_head_dim": int(config["v_head_dim"]),
        "rope_type": "yarn" if yarn else "rope",
        "rotary_scaling_factor": float(rope.get("factor", 1.0)) if yarn else 1.0,
        "mscale": float(rope.get("mscale", 1.0)) if yarn else 1.0,
        "mscale_all_dim": float(rope.get("mscale_all_dim", 0.0)) if yarn else 0.0,
        "yarn_beta_fast": float(rope.get("beta_fast", 32.0)) if yarn else 32.0,
        "yarn_beta_slow": float(rope.get("beta_slow", 1.0)) if yarn else 1.0,
        "yarn_original_max_position_embeddings": int(rope.get("original_max_position_embeddings") or 4096) if yarn else 4096,
    }


def model_args_from_hf_config(config: dict) -> dict[str, Any]:
    """The Megatron shape flags (argparse destinations) that describe ``config``."""
    config = text_config(config)
    model_type = config.get("model_type")
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    experts = _num_experts(config) if _is_moe(config) else 0
    sigmoid_moe = model_type in SIGMOID_MOE_TYPES
    shared = (int(config.get("n_shared_experts") or 0) * int(config.get("moe_intermediate_size") or 0) if sigmoid_moe
              else int(config.get("shared_expert_intermediate_size") or 0))
    rope = _rope_parameters(config)
    out: dict[str, Any] = {
        "num_layers": int(config["num_hidden_layers"]),
        "hidden_size": int(config["hidden_size"]),
        "ffn_hidden_size": int(config.get("intermediate_size") or config["moe_intermediate_size"]),
        "num_attention_heads": heads,
        "group_query_attention": kv_heads != heads,
        "num_query_groups": kv_heads,
        "kv_channels": int(config.get("head_dim") or int(config["hidden_size"]) // heads),
        "rotary_base": rope_theta(config) or 10000.0,
        "normalization": "RMSNorm",
        "norm_epsilon": float(config.get("rms_norm_eps", 1e-6)),
        "swiglu": config.get("hidden_act", "silu") == "silu",
        "disable_bias_linear": True,
        "add_qkv_bias": model_type in ("qwen2", "qwen2_moe") or bool(config.get("attention_bias", False)),
        "qk_layernorm": model_type in ("qwen3", "qwen3_moe", *HYBRID_MODEL_TYPES) or bool(config.get("use_qk_norm", False)),
        "untie_embeddings_and_output_weights": not bool(config.get("tie_word_embeddings", False)),
        "vocab_size": int(config["vocab_size"]),
        "rotary_interleaved": model_type in SANDWICH_NORM_MODEL_TYPES,
        "use_gated_attention": model_type in HYBRID_MODEL_TYPES,
        "apply_layernorm_1p": model_type in HYBRID_MODEL_TYPES,
        "post_self_attn_layernorm": model_type in SANDWICH_NORM_MODEL_TYPES,
        "post_mlp_layernorm": model_type in SANDWICH_NORM_MODEL_TYPES,
        "experimental_attention_variant": None, "linear_attention_freq": None, "linear_conv_kernel_dim": None,
        "linear_key_head_dim": None, "linear_value_head_dim": None, "linear_num_key_heads": None,
        "linear_num_value_heads": None,
        "num_experts": experts or None,
        "moe_ffn_hidden_size": int(config["moe_intermediate_size"]) if experts else None,
        "moe_router_topk": int(config.get("num_experts_per_tok", 2)) if experts else 2,
        "moe_shared_expert_intermediate_size": shared or None,
        # top-k of a full softmax without renormalisation (norm_topk_prob false) is Megatron's pre-softmax router
        "moe_router_pre_softmax": bool(experts) and not sigmoid_moe and not bool(config.get("norm_topk_prob", False)),
        "moe_router_score_function": "sigmoid" if sigmoid_moe else "softmax",
        "moe_router_enable_expert_bias": sigmoid_moe,
        "moe_router_topk_scaling_factor": float(config.get("routed_scaling_factor", 1.0)) if sigmoid_moe else None,
        "moe_router_num_groups": int(config["n_group"]) if sigmoid_moe and (config.get("n_group") or 1) > 1 else None,
        "moe_router_group_topk": int(config["topk_group"]) if sigmoid_moe and (config.get("n_group") or 1) > 1 else None,
        "rotary_percent": float(config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0),
        "multi_latent_attention": False, "q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128,
        "qk_pos_emb_head_dim": 64, "v_head_dim": 128, "rotary_scaling_factor": 1.0, "mscale": 1.0,
        "mscale_all_dim": 0.0, "rope_type": None, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0,
        "yarn_original_max_position_embeddings": 4096,
        "moe_shared_expert_gate": (model_type in ("qwen2_moe", "qwen3_next", "qwen3_5_moe")
                                   and bool(config.get("shared_expert_intermediate_size"))),
        "moe_layer_freq": 1,
        "use_rope_scaling": _rope_scaling(config) is not None,
        "rope_scaling_factor": float(_rope_scaling(config)["factor"]) if _rope_scaling(config) else 8.0,
    }
    pattern = linear_attention_pattern(config)
    if pattern is not None:
        regular = next((n for n in range(2, len(pattern) + 1) if pattern == expand_layer_pattern(n, len(pattern))), None)
        out.update(experimental_attention_variant="gated_delta_net", linear_attention_freq=regular or pattern,
                   linear_conv_kernel_dim=int(config.get("linear_conv_kernel_dim", 4)),
                   linear_key_head_dim=int(config["linear_key_head_dim"]),
                   linear_value_head_dim=int(config["linear_value_head_dim"]),
                   linear_num_key_heads=int(config["linear_num_key_heads"]),
                   linear_num_value_heads=int(config["linear_num_value_heads"]))
    if model_type in MLA_MODEL_TYPES:
        out.update(_mla_args(config))
        out["num_query_groups"], out["group_query_attention"] = heads, False
        out["kv_channels"] = int(config["v_head_dim"])
        out["qk_layernorm"] = True  # Megatron's MLA builds its q/kv latent norms only with qk_layernorm
    if experts:
        step = int(config.get("decoder_sparse_step", 1) or 1)
        dense = set(config.get("mlp_only_layers") or []) | set(range(int(config.get("first_k_dense_replace") or 0)))
        pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(out["num_layers"])]
        out["moe_layer_freq"] = 1 if all(pattern) else pattern
    return out


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def hf_validate_args(args, config: dict | None = None) -> None:
    """Raise ``AssertionError("hf_validate_args failed: ...")`` listing every shape flag that
    disagrees with ``--hf-checkpoint``'s config.json (e.g. ``--rotary-base 10000.0 but config.json
    rope_theta 1000000.0``). Flags left unset (None) are not compared."""
    if config is None:
        config = load_hf_config(args.hf_checkpoint)
    config = text_config(config)
    expected = model_args_from_hf_config(config)
    experts = _num_experts(config) if _is_moe(config) else 0
    mla = expected["multi_latent_attention"]
    all_moe = bool(experts) and expected["moe_layer_freq"] == 1
    checks = [
        ("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
        ("num_attention_heads", "num_attention_heads"), ("vocab_size", "vocab_size"),
        ("norm_epsilon", "rms_norm_eps"), ("rotary_base", "rope_theta"), ("rotary_percent", "partial_rotary_factor"),
        ("multi_latent_attention", "model_type"),
        ("untie_embeddings_and_output_weights", "tie_word_embeddings"), ("qk_layernorm", "model_type"),
        ("add_qkv_bias", "model_type/attention_bias"), ("swiglu", "hidden_act"),
        ("use_gated_attention", "model_type"), ("apply_layernorm_1p", "model_type"),
        ("post_self_attn_layernorm", "model_type"), ("post_mlp_layernorm", "model_type"),
        ("experimental_attention_variant", "layer_types"),
    ]
    if expected["experimental_attention_variant"] or args.experimental_attention_variant:
        checks += [("linear_attention_freq", "layer_types"), ("linear_conv_kernel_dim", "linear_conv_kernel_dim"),
                   ("linear_key_head_dim", "linear_key_head_dim"), ("linear_value_head_dim", "linear_value_head_dim"),
                   ("linear_num_key_heads", "linear_num_key_heads"),
                   ("linear_num_value_heads", "linear_num_value_heads")]
    if not all_moe:
        checks.append(("ffn_hidden_size", "intermediate_size"))
    if expected["group_query_attention"] or args.group_query_attention:
        checks.append(("num_query_groups", "num_key_value_heads"))
    if not mla:  # (MLA's head sizes are checked below; DeepSeek configs' head_dim is the rotary part)
        checks += [("kv_channels", "head_dim"), ("rotary_interleaved", "model_type")]
    if mla or args.multi_latent_attention:
        checks += [("q_lora_rank", "q_lora_rank"), ("kv_lora_rank", "kv_lora_rank"), ("qk_head_dim", "qk_nope_head_dim"),
                   ("qk_pos_emb_head_dim", "qk_rope_head_dim"), ("v_head_dim", "v_head_dim"),
                   ("rotary_scaling_factor", "rope_scaling.factor"), ("mscale", "rope_scaling.mscale"),
                   ("mscale_all_dim", "rope_scaling.mscale_all_dim"), ("yarn_beta_fast", "rope_scaling.beta_fast"),
                   ("yarn_beta_slow", "rope_scaling.beta_slow"),
                   ("yarn_original_max_position_embeddings", "rope_scaling.original_max_position_embeddings")]
    if experts:
        checks += [("num_experts", "num_experts"), ("moe_ffn_hidden_size", "moe_intermediate_size"),
                   ("moe_router_topk", "num_experts_per_tok"),
                   ("moe_shared_expert_intermediate_size", "shared_expert_intermediate_size"),
                   ("moe_router_score_function", "model_type"), ("moe_router_enable_expert_bias", "e_score_correction_bias"),
                   ("moe_router_topk_scaling_factor", "routed_scaling_factor"), ("moe_router_num_groups", "n_group"),
                   ("moe_router_group_topk", "topk_group")]
        if not all_moe:
            checks.append(("moe_layer_freq", "first_k_dense_replace/mlp_only_layers"))
    problems = []
    for dest, hf_key in checks:
        given = getattr(args, dest, None)
        if given is None:
            continue
        want = expected[dest]
        if dest == "linear_attention_freq" and want is not None:  # 4 and its per-layer list say the same
            given, want = (expand_layer_pattern(v, expected["num_layers"]) for v in (given, want))
        same = abs(float(given) - float(want)) <= 1e-12 * max(1.0, abs(float(want))) if isinstance(want, float) else given == want
        if not same:
            hf_value = _hf_value(config, hf_key, want)
            problems.append(f"{_flag(dest)} {given} but config.json {hf_key} {hf_value}")
    if problems:
        raise AssertionError(f"hf_validate_args failed ({args.hf_checkpoint}): " + "; ".join(problems))


def _hf_value(config: dict, key: str, derived):
    if key == "rope_theta":
        return rope_theta(config)
    if key == "head_dim":
        return config.get("head_dim", derived)
    if key in ("model_type", "model_type/attention_bias"):
        return config.get("model_type")
    if key == "layer_types":
        return f"{config.get('layer_types') or config.get('model_type')} (linear-attention layers {derived})"
    if key.startswith("rope_scaling."):
        return _rope_parameters(config).get(key.split(".", 1)[1], derived)
    if key == "shared_expert_intermediate_size" and config.get("model_type") in SIGMOID_MOE_TYPES:
        return f"{derived} (n_shared_experts x moe_intermediate_size)"
    return config.get(key, derived)


def fill_model_args(args, config: dict) -> list[str]:
    """When no shape flag was given (no preset sourced), set them all from ``config``; returns
    the flags set. With a preset, nothing is changed (:func:`hf_validate_args` checks it)."""
    if args.num_layers is not None:
        return []
    filled = []
    for dest, value in model_args_from_hf_config(config).items():
        setattr(args, dest, value)
        filled.append(_flag(dest))
    return filled


def parameter_count(args) -> int:
    """Parameters of the decoder the Megatron shape flags describe (embeddings, attention — MLA or
    grouped-query —, dense and MoE MLPs with their routers and shared experts, norms; no
    multi-token-prediction layers, no vocabulary padding). Pure arithmetic on the flags: it checks a
    preset against a model's published size without building anything."""
    h, layers, vocab = args.hidden_size, args.num_layers, args.vocab_size
    heads = args.num_attention_heads
    norm = 1 if args.normalization == "RMSNorm" else 2  # LayerNorm has a bias
    if args.multi_latent_attention:
        q_head = args.qk_head_dim + args.qk_pos_emb_head_dim
        q = (h * args.q_lora_rank + args.q_lora_rank * norm + args.q_lora_rank * heads * q_head if args.q_lora_rank
             else h * heads * q_head)
        kv = h * (args.kv_lora_rank + args.qk_pos_emb_head_dim) + args.kv_lora_rank * norm
        kv += args.kv_lora_rank * heads * (args.qk_head_dim + args.v_head_dim)
        attention = q + kv + heads * args.v_head_dim * h
    else:
        head = args.kv_channels or h // heads
        groups = args.num_query_groups if args.group_query_attention else heads
        gate = heads if args.use_gated_attention else 0  # q_proj also emits the output gate
        attention = h * (heads + gate + 2 * groups) * head + heads * head * h
        attention += (heads + 2 * groups) * head if args.add_qkv_bias else 0
        attention += 2 * head * norm if args.qk_layernorm else 0
    mlp_matrices = 3 if args.swiglu else 2
    dense_mlp = mlp_matrices * h * args.ffn_hidden_size
    moe_layers = 0
    moe_mlp = 0
    if args.num_experts:
        freq = args.moe_layer_freq
        pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(layers)]
        moe_layers = sum(pattern)
        moe_mlp = h * args.num_experts + args.num_experts * mlp_matrices * h * args.moe_ffn_hidden_size
        moe_mlp += mlp_matrices * h * (args.moe_shared_expert_intermediate_size or 0)
        moe_mlp += h if args.moe_shared_expert_gate else 0
    per_layer_norms = (2 + args.post_self_attn_layernorm
                       + args.post_mlp_layernorm) * h * norm
    linear_layers = 0
    if args.linear_attention_freq is not None:
        linear_layers = sum(expand_layer_pattern(args.linear_attention_freq, layers))
    linear = _gated_delta_net_parameters(args) if linear_layers else 0
    total = ((layers - linear_layers) * attention + linear_layers * linear + layers * per_layer_norms + (layers - moe_layers) * dense_mlp + moe_layers * moe_mlp)
    total += vocab * h * (2 if args.untie_embeddings_and_output_weights else 1) + h * norm
    return total


def _gated_delta_net_parameters(args) -> int:
    """One gated-DeltaNet layer: q/k/v (through a depthwise causal conv), output gate z, beta and decay inputs,
    per-head decay (A_log, dt_bias), the gated norm of a value head, the output projection."""
    h = args.hidden_size
    key_dim = args.linear_num_key_heads * args.linear_key_head_dim
    value_dim = args.linear_num_value_heads * args.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    return (h * conv_dim + conv_dim * args.linear_conv_kernel_dim + h * value_dim + 2 * h * args.linear_num_value_heads
            + 2 * args.linear_num_value_heads + args.linear_value_head_dim + value_dim * h)
