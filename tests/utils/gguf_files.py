"""Small GGUF files for the loader's tests, written with the gguf package's writer the way llama.cpp's
converter writes a Llama checkpoint (its tensor names, its q/k row permutation, a gpt2-style tokenizer)."""

from __future__ import annotations

import json

import numpy as np

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_llama(seed: int = 0):
    """A 2-layer Llama (grouped-query attention, untied head) on the tiny model's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from slime.utils.tiny_model import build_tokenizer

    tokenizer = build_tokenizer(320, seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                         bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # norms away from 1 so a misplaced norm weight shows in the logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model, tokenizer


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (rotary halves interleaved), which transformers' reader undoes."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


def _gguf_tensors(model) -> list[tuple[str, str, np.ndarray, int | None]]:
    """(HF name, GGUF name, array as the file stores it, heads of its q/k permutation or None)."""
    config = model.config
    top_level = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    heads = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
    out = []
    for name, tensor in model.state_dict().items():
        array = tensor.detach().float().numpy()
        if name in top_level:
            out.append((name, top_level[name], array, None))
            continue
        layer, rest = name[len("model.layers."):].split(".", 1)
        module = rest.rsplit(".", 1)[0]
        n_head = heads.get(module)
        out.append((name, f"blk.{layer}.{per_layer[module]}.weight",
                    array if n_head is None else _permute(array, n_head), n_head))
    return out


def _unpermute(weights: np.ndarray, n_head: int) -> np.ndarray:
    return weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


def write_llama_gguf(path, model, tokenizer, quantize: dict[str, str] | None = None, arch: str = "llama") -> dict:
    """Write ``model`` as a GGUF at ``path``; ``quantize`` maps a GGUF tensor-name substring to a
    quantization type name (e.g. ``{"ffn": "Q8_0"}``). Returns the HF state dict as the file holds it
    (quantized tensors dequantized), to compare a loaded model against."""
    import gguf
    import torch

    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m
                             for m in json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)
    quantize = quantize or {}
    reference = {}
    for hf_name, name, array, n_head in _gguf_tensors(model):
        qtype = next((getattr(gguf.GGMLQuantizationType, q) for part, q in quantize.items() if part in name), None)
        if qtype is None:
            writer.add_tensor(name, array)
            held = array
        else:
            packed = gguf.quants.quantize(array, qtype)
            writer.add_tensor(name, packed, raw_dtype=qtype)
            held = gguf.quants.dequantize(packed, qtype)
        held = held if n_head is None else _unpermute(held, n_head)
        reference[hf_name] = torch.from_numpy(np.ascontiguousarray(held, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def write_raw_gguf(path, arch: str = "llama", tensor_type: str = "F32") -> None:
    """A GGUF with an architecture name and one 32x32 tensor of ``tensor_type`` (bytes all zero)."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, tensor_type)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((32, 32 // block * type_size), dtype=np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
