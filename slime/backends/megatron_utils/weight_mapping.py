"""Hugging Face <-> Megatron-Core parameter names and layouts, as pure functions of tensors.

No Megatron import: everything here runs on any machine and is tested on tiny random state dicts.
Three layers of functions:

* **names and layouts of whole tensors** (:func:`megatron_param_names`, :func:`hf_to_megatron_tensor`,
  :func:`megatron_to_hf_tensors`): a Megatron tensor here is the *unsharded* one (all TP ranks
  gathered, vocabulary padded to ``padded_vocab_size``), named with the *global* layer index and the
  *global* expert index;
* **tensor-parallel shards** (:func:`tp_split`, :func:`tp_merge`): how Megatron cuts each tensor over
  TP ranks (column-parallel along dim 0, row-parallel along dim 1, the SwiGLU ``linear_fc1`` cut
  gate and up separately, norms and routers replicated);
* **rank-local names** (:func:`localize_name`, :func:`globalize_name`): pipeline stages number their
  layers from 0, expert-parallel ranks their experts from 0.

Megatron layouts that differ from Hugging Face's:

* ``self_attention.linear_qkv`` is one tensor ``[(n_q + 2·n_kv)·d, h]`` ordered *per query group*:
  for each of the ``n_kv`` groups, its ``n_q/n_kv`` query heads, then its key head, then its value
  head (``d`` rows each). TP ranks hold whole groups, so a TP shard is a contiguous slice.
* ``mlp.linear_fc1`` of a SwiGLU MLP is ``cat(gate_proj, up_proj)`` ``[2·f, h]``; a TP shard is
  ``cat(gate_r, up_r)`` of the rank's slices, not a contiguous slice of the full tensor.
* the word embeddings and the output layer are padded with zero rows to ``padded_vocab_size``
  (a multiple of ``make_vocab_size_divisible_by × TP``); the rows are removed on the way back.
* with Transformer Engine's fused layers the pre-attention norm lives in
  ``linear_qkv.layer_norm_weight`` and the dense pre-MLP norm in ``linear_fc1.layer_norm_weight``
  (``te_fused_norms``); the local spec keeps ``input_layernorm`` / ``pre_mlp_layernorm``.
* experts are ``mlp.experts.local_experts.{e}.linear_fc{1,2}.weight`` (SequentialMLP) or
  ``mlp.experts.linear_fc{1,2}.weight{e}`` (grouped GEMM, ``grouped_experts``).
* multi-latent attention (DeepSeek-V3, ``mla``) maps one to one: ``linear_q_down_proj`` /
  ``linear_q_up_proj`` / ``linear_kv_down_proj`` / ``linear_kv_up_proj`` are HF's ``q_a_proj`` /
  ``q_b_proj`` / ``kv_a_proj_with_mqa`` / ``kv_b_proj`` with the same row order (per head
  ``[nope; rope]`` queries, ``[latent; rope]`` down-projected keys, per head ``[k_nope; v]``), and
  ``q_layernorm`` / ``kv_layernorm`` are ``q_a_layernorm`` / ``kv_a_layernorm`` (with TE fused into
  the up projections' ``layer_norm_weight``). HF's interleaved rotary channels (``rope_interleave``)
  need no permutation: Megatron's MLA de-interleaves them itself, as HF's rotary does. All four
  projections are column-parallel (contiguous row blocks per TP rank). The router's expert bias
  (a buffer) is ``mlp.router.expert_bias`` = HF ``mlp.gate.e_score_correction_bias``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

__all__ = [
    "SUPPORTED_MODEL_TYPES", "ModelLayout", "padded_vocab_size", "megatron_param_names", "hf_param_names",
    "hf_to_megatron_tensor", "megatron_to_hf_tensors", "hf_to_megatron", "megatron_to_hf", "tp_split", "tp_merge",
    "tp_kind", "pp_layer_range", "localize_name", "globalize_name", "expert_owner", "fuse_experts_for_transformers",
]

#: HF ``model_type`` values this mapping knows (dense and MoE decoder-only families).
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "kimi_k2",
                         "glm4_moe", "glm4")

#: MoE families with DeepSeek-V3's MoE block: ``mlp.gate.e_score_correction_bias`` (Megatron's
#: ``mlp.router.expert_bias``), ``mlp.shared_experts.*``, the first ``first_k_dense_replace`` layers dense
DEEPSEEK_MOE_TYPES = ("deepseek_v3", "kimi_k2", "glm4_moe")
#: MLA families (Kimi-K2 checkpoints have DeepSeek-V3's tensor names)
MLA_MODEL_TYPES = ("deepseek_v3", "kimi_k2")


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tp_size: int = 1) -> int:
    """Megatron's padding: the smallest multiple of ``divisible_by × tp_size`` ≥ ``vocab_size``."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


@dataclass(frozen=True)
class ModelLayout:
    """What the mapping needs to know about a model (built from its HF config).

    ``moe_layers[i]`` is True when decoder layer ``i`` has a routed-expert MLP; ``num_experts`` is 0
    for dense models. ``shared_expert_gate`` marks the sigmoid gate of a Qwen2-MoE shared expert.
    """

    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_layernorm: bool = False
    num_experts: int = 0
    moe_layers: tuple[bool, ...] = field(default_factory=tuple)
    shared_expert: bool = False
    shared_expert_gate: bool = False
    te_fused_norms: bool = False
    grouped_experts: bool = False
    mla: bool = False  # DeepSeek-V3's multi-latent attention instead of linear_qkv
    q_lora_rank: int | None = None  # MLA: None = a full q_proj
    expert_bias: bool = False  # sigmoid router with e_score_correction_bias
    shared_expert_prefix: str = "mlp.shared_expert"  # HF prefix of the shared expert (DeepSeek: shared_experts)
    sandwich_norms: bool = False  # GLM-4: norms on the attention and MLP outputs (sandwich_norm.py)
    fused_gate_up: bool = False  # GLM-4: HF keeps a dense MLP's gate and up as one mlp.gate_up_proj

    @classmethod
    def from_hf_config(cls, config, *, make_vocab_size_divisible_by: int = 128, tp_size: int = 1,
                       padded_vocab: int | None = None, te_fused_norms: bool = False,
                       grouped_experts: bool = False) -> "ModelLayout":
        """``config``: a transformers ``PretrainedConfig`` or the dict of a ``config.json``."""
        get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
        model_type = get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            from slime.backends.megatron_utils.model_config import NOT_BUILT_BY_MEGATRON

            why = f" ({NOT_BUILT_BY_MEGATRON[model_type]})" if model_type in NOT_BUILT_BY_MEGATRON else ""
            raise ValueError(f"HF model_type {model_type!r} has no Megatron mapping{why}; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        layers = int(get("num_hidden_layers"))
        deepseek_moe = model_type in DEEPSEEK_MOE_TYPES
        # transformers 5 writes "num_local_experts"; published Qwen MoE configs say "num_experts"
        num_experts = (int(get("num_experts", None) or get("num_local_experts", 0) or get("n_routed_experts", 0) or 0)
                       if model_type.endswith("_moe") or deepseek_moe else 0)
        if num_experts:
            step = int(get("decoder_sparse_step", 1) or 1)
            dense_only = set(get("mlp_only_layers", []) or []) | set(range(int(get("first_k_dense_replace", 0) or 0)))
            moe_layers = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(layers))
        else:
            moe_layers = (False,) * layers
        shared = bool(num_experts and ((get("shared_expert_intermediate_size", 0) or 0) > 0
                                       or (deepseek_moe and (get("n_shared_experts", 0) or 0) > 0)))
        mla = model_type in MLA_MODEL_TYPES
        if mla and get("rope_interleave", True) is False:
            raise ValueError("DeepSeek-V3 config with rope_interleave false: Megatron's MLA de-interleaves the rotary "
                             "channels, so this layout has no mapping yet")
        return cls(
            model_type=model_type,
            num_layers=layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=int(get("num_key_value_heads", heads) or heads),
            head_dim=int(get("head_dim", None) or hidden // heads),
            vocab_size=int(get("vocab_size")),
            padded_vocab_size=padded_vocab or padded_vocab_size(int(get("vocab_size")), make_vocab_size_divisible_by, tp_size),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            qkv_bias=model_type in ("qwen2", "qwen2_moe") or bool(get("attention_bias", False)),
            qk_layernorm=model_type in ("qwen3", "qwen3_moe") or bool(get("use_qk_norm", False)),
            num_experts=num_experts,
            moe_layers=moe_layers,
            shared_expert=shared,
            shared_expert_gate=shared and model_type == "qwen2_moe",
            te_fused_norms=te_fused_norms,
            grouped_experts=grouped_experts,
            mla=mla,
            q_lora_rank=int(get("q_lora_rank")) if mla and get("q_lora_rank", None) else None,
            expert_bias=bool(num_experts) and deepseek_moe,
            shared_expert_prefix="mlp.shared_experts" if deepseek_moe else "mlp.shared_expert",
            sandwich_norms=model_type == "glm4",
            fused_gate_up=model_type == "glm4",
        )

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]


# --------------------------------------------------------------------------- names

def _expert_fc(layout: ModelLayout, layer: int, expert: int, fc: int) -> str:
    if layout.grouped_experts:
        return f"decoder.layers.{layer}.mlp.experts.linear_fc{fc}.weight{expert}"
    return f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc{fc}.weight"


def _input_norm(layout: ModelLayout, layer: int) -> str:
    if layout.te_fused_norms and not layout.mla:  # (TE's MLA keeps a separate input norm: two down projections)
        return f"decoder.layers.{layer}.self_attention.linear_qkv.layer_norm_weight"
    return f"decoder.layers.{layer}.input_layernorm.weight"


def _pre_mlp_norm(layout: ModelLayout, layer: int) -> str:
    if layout.te_fused_norms and not layout.is_moe_layer(layer):
        return f"decoder.layers.{layer}.mlp.linear_fc1.layer_norm_weight"
    return f"decoder.layers.{layer}.pre_mlp_layernorm.weight"


def megatron_param_names(layout: ModelLayout) -> list[str]:
    """Every parameter of the full model, global layer and expert indices, in model order."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(layout.num_layers):
        p = f"decoder.layers.{i}."
        names.append(_input_norm(layout, i))
        if layout.mla:
            names += _mla_names(layout, p)
        else:
            names.append(p + "self_attention.linear_qkv.weight")
            if layout.qkv_bias:
                names.append(p + "self_attention.linear_qkv.bias")
            if layout.qk_layernorm:
                names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
        names.append(p + "self_attention.linear_proj.weight")
        if layout.sandwich_norms:
            names.append(p + "post_self_attn_layernorm.weight")
        names.append(_pre_mlp_norm(layout, i))
        if layout.is_moe_layer(i):
            names.append(p + "mlp.router.weight")
            if layout.expert_bias:
                names.append(p + "mlp.router.expert_bias")
            for e in range(layout.num_experts):
                names += [_expert_fc(layout, i, e, 1), _expert_fc(layout, i, e, 2)]
            if layout.shared_expert:
                names += [p + "mlp.shared_experts.linear_fc1.weight", p + "mlp.shared_experts.linear_fc2.weight"]
                if layout.shared_expert_gate:
                    names.append(p + "mlp.shared_experts.gate_weight")
        else:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
        if layout.sandwich_norms:
            names.append(p + "post_mlp_layernorm.weight")
    names.append("decoder.final_layernorm.weight")
    if not layout.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def _mla_norm(layout: ModelLayout, which: str) -> str:
    """``q`` / ``kv``: the MLA latent norm (TE fuses it into the up projection)."""
    if layout.te_fused_norms:
        return f"self_attention.linear_{which}_up_proj.layer_norm_weight"
    return f"self_attention.{which}_layernorm.weight"


def _mla_names(layout: ModelLayout, prefix: str) -> list[str]:
    if layout.q_lora_rank:
        names = [prefix + "self_attention.linear_q_down_proj.weight", prefix + _mla_norm(layout, "q"),
                 prefix + "self_attention.linear_q_up_proj.weight"]
    else:
        names = [prefix + "self_attention.linear_q_proj.weight"]
    return names + [prefix + "self_attention.linear_kv_down_proj.weight", prefix + _mla_norm(layout, "kv"),
                    prefix + "self_attention.linear_kv_up_proj.weight"]


# MLA suffixes inside a layer: Megatron -> HF (local spec and TE spellings of the latent norms)
_MLA_SIMPLE = {
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
}


def hf_param_names(layout: ModelLayout) -> list[str]:
    """The HF checkpoint names the mapping reads and writes (tied ``lm_head`` excluded)."""
    names: list[str] = []
    for name in megatron_param_names(layout):
        names += _hf_sources(name, layout)
    return names


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_SEQ = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
_EXPERT_GROUPED = re.compile(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$")

# one-to-one suffixes inside a layer: Megatron -> HF (without the "model.layers.{i}." prefix)
_LAYER_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
    "post_self_attn_layernorm.weight": "post_self_attn_layernorm.weight",
    "post_mlp_layernorm.weight": "post_mlp_layernorm.weight",
}
_TOP_SIMPLE = {"decoder.final_layernorm.weight": "model.norm.weight"}


def _split_expert(suffix: str) -> tuple[int, int] | None:
    """(expert, fc) of an expert weight suffix, else None."""
    m = _EXPERT_SEQ.match(suffix)
    if m:
        return int(m.group(1)), int(m.group(2))
    m = _EXPERT_GROUPED.match(suffix)
    if m:
        return int(m.group(2)), int(m.group(1))
    return None


def _hf_sources(name: str, layout: ModelLayout) -> list[str]:
    """HF names that make up the Megatron tensor ``name`` (global indices), in concatenation order."""
    if name == "embedding.word_embeddings.weight":
        return ["model.embed_tokens.weight"]
    if name == "output_layer.weight":
        return ["model.embed_tokens.weight" if layout.tie_word_embeddings else "lm_head.weight"]
    if name in _TOP_SIMPLE:
        return [_TOP_SIMPLE[name]]
    m = _LAYER.match(name)
    if not m:
        raise KeyError(f"no HF counterpart for Megatron parameter {name!r}")
    layer, suffix = int(m.group(1)), m.group(2)
    hf = f"model.layers.{layer}."
    if layout.mla and suffix in _MLA_SIMPLE:
        return [hf + _MLA_SIMPLE[suffix]]
    if suffix in _LAYER_SIMPLE:
        return [hf + _LAYER_SIMPLE[suffix]]
    if suffix == "mlp.shared_experts.linear_fc2.weight":
        return [hf + layout.shared_expert_prefix + ".down_proj.weight"]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        return [hf + f"self_attn.{p}_proj.{kind}" for p in ("q", "k", "v")]
    if suffix == "mlp.linear_fc1.weight":
        if layout.fused_gate_up:  # already Megatron's [gate; up]
            return [hf + "mlp.gate_up_proj.weight"]
        return [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
    if suffix == "mlp.shared_experts.linear_fc1.weight":
        return [hf + layout.shared_expert_prefix + ".gate_proj.weight", hf + layout.shared_expert_prefix + ".up_proj.weight"]
    expert = _split_expert(suffix)
    if expert is not None:
        e, fc = expert
        if fc == 1:
            return [hf + f"mlp.experts.{e}.gate_proj.weight", hf + f"mlp.experts.{e}.up_proj.weight"]
        return [hf + f"mlp.experts.{e}.down_proj.weight"]
    raise KeyError(f"no HF counterpart for Megatron parameter {name!r}")


# --------------------------------------------------------------------------- tensors

def _qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ModelLayout) -> torch.Tensor:
    """HF q [n_q·d, …], k/v [n_kv·d, …] -> Megatron per-group order [(n_q + 2·n_kv)·d, …]."""
    groups, d = layout.num_query_groups, layout.head_dim
    per_group = layout.num_attention_heads // groups
    tail = q.shape[1:]
    q = q.reshape(groups, per_group * d, *tail)
    k = k.reshape(groups, d, *tail)
    v = v.reshape(groups, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def _qkv_to_hf(qkv: torch.Tensor, layout: ModelLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = layout.num_query_groups, layout.head_dim
    per_group = layout.num_attention_heads // groups
    tail = qkv.shape[1:]
    expected = (layout.num_attention_heads + 2 * groups) * d
    if qkv.shape[0] != expected:
        raise ValueError(f"linear_qkv has {qkv.shape[0]} rows, expected (heads + 2·groups)·head_dim = {expected}")
    grouped = qkv.reshape(groups, (per_group + 2) * d, *tail)
    q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _pad_vocab(weight: torch.Tensor, layout: ModelLayout) -> torch.Tensor:
    extra = layout.padded_vocab_size - weight.shape[0]
    if extra < 0:
        raise ValueError(f"vocabulary of {weight.shape[0]} rows exceeds padded_vocab_size {layout.padded_vocab_size}")
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])])


def hf_to_megatron_tensor(name: str, get_hf: Callable[[str], torch.Tensor], layout: ModelLayout) -> torch.Tensor:
    """The full Megatron tensor ``name`` (global indices) built from HF tensors read with ``get_hf``."""
    sources = [get_hf(n) for n in _hf_sources(name, layout)]
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return _pad_vocab(sources[0], layout)
    if name.endswith("self_attention.linear_qkv.weight") or name.endswith("self_attention.linear_qkv.bias"):
        return _qkv_to_megatron(*sources, layout)
    if len(sources) == 2:  # gate and up of a SwiGLU fc1
        return torch.cat(sources, dim=0)
    return sources[0]


def megatron_to_hf_tensors(name: str, tensor: torch.Tensor, layout: ModelLayout) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of the full Megatron tensor ``name`` (global indices).

    The tied output layer and a TE-fused norm duplicate are not repeated: ``output_layer.weight``
    of a tied model gives nothing (the embeddings carry it)."""
    if name == "output_layer.weight" and layout.tie_word_embeddings:
        return []
    targets = _hf_sources(name, layout)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return [(targets[0], tensor[: layout.vocab_size])]
    if name.endswith("self_attention.linear_qkv.weight") or name.endswith("self_attention.linear_qkv.bias"):
        return list(zip(targets, _qkv_to_hf(tensor, layout)))
    if len(targets) == 2:
        gate, up = torch.chunk(tensor, 2, dim=0)
        return [(targets[0], gate), (targets[1], up)]
    return [(targets[0], tensor)]


def hf_to_megatron(hf_state: dict[str, torch.Tensor], layout: ModelLayout) -> dict[str, torch.Tensor]:
    """Whole HF state dict -> full Megatron state dict (every name of :func:`megatron_param_names`)."""
    def get(hf_name: str) -> torch.Tensor:
        if hf_name not in hf_state:
            raise KeyError(f"HF checkpoint has no tensor {hf_name!r} (model_type {layout.model_type})")
        return hf_state[hf_name]

    return {name: hf_to_megatron_tensor(name, get, layout) for name in megatron_param_names(layout)}


def megatron_to_hf(megatron_state: dict[str, torch.Tensor], layout: ModelLayout) -> dict[str, torch.Tensor]:
    """Full Megatron state dict -> HF state dict (padding removed, tied ``lm_head`` omitted)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in megatron_state.items():
        for hf_name, hf_tensor in megatron_to_hf_tensors(name, tensor, layout):
            out[hf_name] = hf_tensor
    return out


# --------------------------------------------------------------------------- tensor parallelism

_COLUMN_SUFFIXES = ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "linear_q_proj.weight",
                    "linear_q_down_proj.weight", "linear_q_up_proj.weight", "linear_kv_down_proj.weight",
                    "linear_kv_up_proj.weight")
_ROW_SUFFIXES = ("linear_proj.weight", "linear_fc2.weight")


def tp_kind(name: str) -> str:
    """How Megatron cuts ``name`` over TP ranks: ``"column"`` (dim 0), ``"row"`` (dim 1),
    ``"gated_column"`` (SwiGLU fc1: gate and up cut separately), or ``"replicated"``."""
    if name == "output_layer.weight" or name.endswith(_COLUMN_SUFFIXES):
        return "column"
    suffix = _LAYER.match(name).group(2) if _LAYER.match(name) else name
    expert = _split_expert(suffix)
    if name.endswith("linear_fc1.weight") or (expert is not None and expert[1] == 1):
        return "gated_column"
    if name.endswith(_ROW_SUFFIXES) or (expert is not None and expert[1] == 2):
        return "row"
    return "replicated"


def tp_split(name: str, full: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
    """The ``tp_size`` shards Megatron keeps of the full tensor ``name`` (rank order)."""
    kind = tp_kind(name)
    if tp_size == 1 or kind == "replicated":
        return [full] * tp_size
    dim = 1 if kind == "row" else 0
    if full.shape[dim] % tp_size:
        raise ValueError(f"{name}: dim {dim} of size {full.shape[dim]} is not divisible by TP size {tp_size}")
    if kind == "gated_column":
        gate, up = torch.chunk(full, 2, dim=0)
        return [torch.cat([g, u]) for g, u in zip(torch.chunk(gate, tp_size), torch.chunk(up, tp_size))]
    return list(torch.chunk(full, tp_size, dim=dim))


def tp_merge(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`tp_split` (replicated tensors: the first shard)."""
    kind = tp_kind(name)
    if len(shards) == 1 or kind == "replicated":
        return shards[0]
    if kind == "gated_column":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=1 if kind == "row" else 0)


# --------------------------------------------------------------------------- pipeline and expert parallelism

def pp_layer_range(num_layers: int, pp_size: int, pp_rank: int, first: int | None = None,
                   last: int | None = None) -> tuple[int, int]:
    """Global layers ``[start, end)`` of pipeline stage ``pp_rank`` (Megatron's split: even, or
    ``--decoder-first/last-pipeline-num-layers`` on the ends and the rest even in the middle)."""
    if pp_size == 1:
        return 0, num_layers
    sizes = [0] * pp_size
    middle = list(range(pp_size))
    rest = num_layers
    if first is not None:
        sizes[0], rest, middle = first, rest - first, middle[1:]
    if last is not None:
        sizes[-1], rest, middle = last, rest - last, middle[:-1]
    if middle:
        if rest % len(middle):
            raise ValueError(f"{rest} layers do not split evenly over {len(middle)} pipeline stages")
        for r in middle:
            sizes[r] = rest // len(middle)
    elif rest:
        raise ValueError(f"--decoder-first/last-pipeline-num-layers leave {rest} layers without a stage")
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def expert_owner(expert: int, num_experts: int, ep_size: int) -> tuple[int, int]:
    """(EP rank, local index) of a global expert."""
    per_rank = num_experts // ep_size
    return expert // per_rank, expert % per_rank


def _rename_indices(name: str, layer_map: Callable[[int], int], expert_map: Callable[[int], int]) -> str:
    m = _LAYER.match(name)
    if not m:
        return name
    layer, suffix = layer_map(int(m.group(1))), m.group(2)
    seq = _EXPERT_SEQ.match(suffix)
    if seq:
        suffix = f"mlp.experts.local_experts.{expert_map(int(seq.group(1)))}.linear_fc{seq.group(2)}.weight"
    grouped = _EXPERT_GROUPED.match(suffix)
    if grouped:
        suffix = f"mlp.experts.linear_fc{grouped.group(1)}.weight{expert_map(int(grouped.group(2)))}"
    return f"decoder.layers.{layer}.{suffix}"


def globalize_name(local_name: str, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """Rank-local parameter name -> global (layer + ``layer_offset``, expert + ``expert_offset``)."""
    return _rename_indices(local_name, lambda i: i + layer_offset, lambda e: e + expert_offset)


def localize_name(global_name: str, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """Inverse of :func:`globalize_name`."""
    return _rename_indices(global_name, lambda i: i - layer_offset, lambda e: e - expert_offset)


def is_expert_param(name: str) -> bool:
    m = _LAYER.match(name)
    return bool(m) and _split_expert(m.group(2)) is not None


def expert_index(name: str) -> int | None:
    m = _LAYER.match(name)
    found = _split_expert(m.group(2)) if m else None
    return found[0] if found else None


def iter_hf_names(names: Iterable[str], layout: ModelLayout) -> Iterable[str]:
    for name in names:
        yield from _hf_sources(name, layout)


_HF_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts_for_transformers(named_tensors: Iterable[tuple[str, torch.Tensor]], layout: ModelLayout
                                  ) -> Iterable[tuple[str, torch.Tensor]]:
    """Checkpoint-named expert tensors -> the 3-D parameters transformers 5 keeps in memory
    (``mlp.experts.gate_up_proj`` ``[E, 2·I, H]`` = per expert ``[gate; up]``, and
    ``mlp.experts.down_proj`` ``[E, H, I]``), for engines that load by module parameter name
    (the embedded engine). Streaming: a layer's experts are held until all of them have arrived;
    every other tensor passes through unchanged."""
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in named_tensors:
        m = _HF_EXPERT.match(name)
        if not m:
            yield name, tensor
            continue
        prefix, expert, kind = m.group(1), int(m.group(2)), m.group(3)
        layer = pending.setdefault(prefix, {})
        layer[(expert, kind)] = tensor
        if len(layer) == 3 * layout.num_experts:
            experts = range(layout.num_experts)
            yield prefix + ".gate_up_proj", torch.stack([torch.cat([layer[(e, "gate_proj")], layer[(e, "up_proj")]]) for e in experts])
            yield prefix + ".down_proj", torch.stack([layer[(e, "down_proj")] for e in experts])
            del pending[prefix]
    if pending:
        missing = {prefix: 3 * layout.num_experts - len(layer) for prefix, layer in pending.items()}
        raise ValueError(f"expert tensors missing for {missing} (expected gate/up/down of {layout.num_experts} experts)")
