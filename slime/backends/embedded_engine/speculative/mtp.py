"""NEXTN drafting: the model's own multi-token-prediction (MTP) layer proposes the drafts.

DeepSeek-V3-family checkpoints (``num_nextn_predict_layers`` in config.json) carry, after their
``num_hidden_layers`` decoder layers, an MTP block under ``model.layers.{num_hidden_layers}.*``
(transformers builds no module for it and drops those weights at load). The block, as SGLang's
``deepseek_nextn.py`` builds and loads it::

    x = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])     # Linear 2H -> H, the embedding half first
    g = shared_head.norm(decoder(x))                      # one decoder layer of the model (MoE or dense)
    logits = lm_head(g)                                   # the model's own head and embedding (shared)

where ``h_i`` is the target's final hidden state at position ``i`` (after its final norm), so the
block at position ``i`` predicts token ``i + 2``. Weight names, checked against SGLang's loader:
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` belong to the block, everything else of the
layer (``self_attn.*``, ``mlp.*``, ``input_layernorm``, ``post_attention_layernorm``) to its decoder
layer; the layer's ``embed_tokens`` and ``shared_head.head`` copies are skipped: the block uses the
model's ``model.embed_tokens`` and ``lm_head``, as SGLang does. SGLang serves one MTP layer; so does
this module (the first, ``model.layers.{num_hidden_layers}``; tensors of later ones are ignored).

Drafting (:class:`NextNDrafter`, the chain SGLang's EAGLE worker runs for NEXTN with top-k 1): the
block keeps its own one-layer slot cache in the target's slot layout. Position ``i`` of that cache
holds ``(h_i, t_{i+1})`` once the target has computed position ``i``; each row keeps the target
hidden states the block has not consumed yet (from prefill, then from each verify forward, only the
accepted positions). A decode step first feeds a row those positions (the *catch-up*: the prompt
after prefill, the ``1 + accepted`` verified positions after a verify step), whose last output gives
draft 1; drafts 2..k chain the block on its own output ``g`` and its previous draft. Chained entries
lie past the row's verified length: the next catch-up overwrites them with the target's hidden
states, so the cache always equals what a from-scratch run of the block over the text would hold.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from slime.backends.embedded_engine.kv_cache import SlotKVCache
from slime.backends.embedded_engine.model_runner import ForwardRow, ModelRunner, _fused_expert_slice
from slime.backends.embedded_engine.speculative.decoder import ChainDrafter

if TYPE_CHECKING:
    from slime.backends.embedded_engine.scheduler import Sequence

logger = logging.getLogger(__name__)

#: transformers families whose MTP block this module builds (SGLang's deepseek_nextn / glm4_moe_nextn layout)
MODEL_TYPES = ("deepseek_v3", "glm4_moe")
#: the block's own tensors (SGLang's ``nextn_spec_weight_names``); the rest of the layer is its decoder layer
OWN_PREFIXES = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
#: the layer's copies of the model's embedding and head: skipped, the model's own are used (as SGLang does)
SHARED_PREFIXES = ("embed_tokens.", "shared_head.head.")


def nextn_layers(config) -> int:
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0)


class MTPLayer(torch.nn.Module):
    """One MTP block of ``model`` (built from its own decoder-layer and RMSNorm classes), with the
    weight-name mapping the engine's update paths use (``ModelRunner.mtp``)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        config = model.config
        base = model.get_decoder()
        norm = type(base.norm)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer_index = config.num_hidden_layers
        self.num_nextn = nextn_layers(config)
        self.prefix = f"model.layers.{self.layer_index}."
        self.enorm = norm(hidden, eps=eps)
        self.hnorm = norm(hidden, eps=eps)
        self.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        # the model's own decoder-layer class at the MTP layer's index (MoE past first_k_dense_replace)
        self.decoder = type(base.layers[-1])(config, self.layer_index)
        self.decoder.self_attn.layer_idx = 0  # the block's cache has one layer
        self.shared_head = torch.nn.Module()
        self.shared_head.norm = norm(hidden, eps=eps)
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings, mask: torch.Tensor,
                cache) -> torch.Tensor:
        """``embeds`` (of the next tokens) and ``hidden`` (the target's, or the block's own when chained),
        both ``[rows, q, H]`` -> the block's output hidden states ``[rows, q, H]`` (what the head reads)."""
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        x = self.decoder(x, attention_mask=mask, position_embeddings=position_embeddings, use_cache=True,
                         **{self._cache_kwarg: cache})
        return self.shared_head.norm(x[0] if isinstance(x, tuple) else x)

    # ------------------------------------------------------------------ weights by checkpoint name
    def owns(self, name: str) -> bool:
        """Whether ``name`` is a tensor of an MTP layer (``model.layers.{L}.*``, L >= num_hidden_layers)."""
        parts = name.split(".", 3)
        return len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() \
            and int(parts[2]) >= self.layer_index

    def local_name(self, name: str) -> str | None:
        """This block's parameter name for checkpoint name ``name``; None for what it does not serve
        (the shared embedding/head copies, later MTP layers)."""
        if not name.startswith(self.prefix):
            return None
        rest = name[len(self.prefix):]
        if rest.startswith(SHARED_PREFIXES):
            return None
        return rest if rest.startswith(OWN_PREFIXES) else "decoder." + rest

    def _target(self, local: str) -> tuple[str, torch.Tensor] | None:
        """(parameter name, tensor to fill) of a local name: a parameter/buffer, or the slice of a fused
        expert parameter that a checkpoint-named expert fills."""
        params = dict(self.named_parameters())
        params.update(dict(self.named_buffers()))
        if local in params:
            return local, params[local]
        tensor = _fused_expert_slice(params, local)
        if tensor is None:
            return None
        fused = local.rsplit(".experts.", 1)[0] + ".experts." + ("down_proj" if ".down_proj." in local else "gate_up_proj")
        return fused, tensor

    @torch.inference_mode()
    def load(self, name: str, tensor: torch.Tensor) -> int:
        """Copy one checkpoint-named tensor in (1), or skip one the block does not serve (0)."""
        local = self.local_name(name)
        if local is None:
            return 0
        found = self._target(local)
        if found is None:
            raise KeyError(f"weight {name!r} is not a tensor of the model's MTP layer (its names: "
                           f"{self.prefix}{{enorm,hnorm,eh_proj,shared_head.norm,self_attn,mlp,...}}.*)")
        _, target = found
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r}: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
        target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        return 1

    def get(self, name: str) -> torch.Tensor:
        local = self.local_name(name)
        found = self._target(local) if local is not None else None
        if found is None:
            raise KeyError(f"no tensor of the served MTP layer is named {name!r} (its embed_tokens and "
                           "shared_head.head are the model's model.embed_tokens and lm_head)")
        return found[1]

    def read_checkpoint(self, model_path: str) -> dict[str, torch.Tensor] | None:
        """This block's tensors in the checkpoint's safetensors files (checkpoint names), checked to cover
        every parameter; None when the files hold none of them."""
        from safetensors import safe_open

        files = checkpoint_files(model_path)
        tensors, filled = {}, set()
        for file in files:
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    local = self.local_name(name)
                    if local is None:
                        continue
                    found = self._target(local)
                    if found is None:
                        raise KeyError(f"{model_path}: tensor {name!r} is not one of the MTP layer's")
                    tensors[name] = f.get_tensor(name)
                    filled.add(found[0])
        if not tensors:
            return None
        expected = set(self.state_dict())
        missing = sorted(expected - filled)
        if missing:
            raise ValueError(f"--speculative-algorithm NEXTN: {model_path} lacks MTP tensors for {missing[:4]} "
                             f"({len(missing)} of the layer's {len(expected)}; names under {self.prefix})")
        return tensors

    def load_checkpoint(self, model_path: str) -> int:
        """At start: the block's weights from the checkpoint, which must carry all of them."""
        tensors = self.read_checkpoint(model_path)
        if tensors is None:
            raise ValueError(f"--speculative-algorithm NEXTN: {model_path}/config.json has num_nextn_predict_layers = "
                             f"{self.num_nextn}, but no tensor of its safetensors files "
                             f"({', '.join(f.name for f in checkpoint_files(model_path))}) is named {self.prefix}*: "
                             "the checkpoint carries no MTP weights; use NGRAM or STANDALONE")
        return sum(self.load(name, tensor) for name, tensor in tensors.items())


def checkpoint_files(model_path: str) -> list[Path]:
    """The safetensors files of an HF directory (those its index names, else all of them)."""
    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    if index.exists():
        return sorted({root / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"--speculative-algorithm NEXTN: {model_path} has no safetensors files to read the MTP "
                         "layer from")
    return files


class NextNDrafter(ChainDrafter):
    """NEXTN drafter: the model's MTP block in its own one-layer slot cache (see the module docstring)."""

    needs_hidden = True  # the engine hands it the target's hidden states of every computed position

    def __init__(self, runner: ModelRunner, prefill_tokens: int):
        layers = nextn_layers(runner.config)
        if layers < 1:
            raise ValueError(f"--speculative-algorithm NEXTN drafts with the model's own multi-token-prediction layers, "
                             f"but {runner.model_path}/config.json has num_nextn_predict_layers = "
                             f"{getattr(runner.config, 'num_nextn_predict_layers', None)}; use NGRAM or STANDALONE")
        if runner.config.model_type not in MODEL_TYPES:
            raise ValueError(f"--speculative-algorithm NEXTN: the embedded engine builds the MTP layer of "
                             f"{MODEL_TYPES} models, not {runner.config.model_type!r}")
        if layers > 1:
            logger.warning("%s has %d MTP layers; NEXTN drafts with the first (model.layers.%d), as SGLang does",
                           runner.model_path, layers, runner.config.num_hidden_layers)
        self.runner = runner
        self.prefill_tokens = prefill_tokens
        layer = MTPLayer(runner.model)
        layer.load_checkpoint(runner.model_path)
        self.layer = layer.to(device=runner.device, dtype=runner.dtype).eval()
        if runner.mla_layers:  # the absorbed MLA decode for its single-token chain steps, as the model's layers
            from slime.backends.embedded_engine.kernels import mla_decode

            mla_decode.install(self.layer)
        runner.mtp = self.layer  # weight updates by model.layers.{L}.* names reach it through the runner
        self.kv_cache = self._new_cache()

    def _new_cache(self) -> SlotKVCache:
        # the target's slots, one softmax-attention layer
        shape = dataclasses.replace(self.runner.kv_cache.shape, num_layers=1, kv_layers=None, linear=None)
        # stored like the target's (--kv-cache-dtype), scale 1.0: no checkpoint names the MTP layer's scales
        return SlotKVCache(shape, self.runner.kv_cache_dtype, self.runner.device, compute_dtype=self.runner.dtype)

    # ------------------------------------------------------------------ engine hooks
    def num_slots(self) -> int:
        return self.kv_cache.shape.num_slots

    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.kv_cache.move_slot(src, dst, length)

    def grow_cache(self, need: int) -> None:
        """After the target's cache grew (nothing running): the same slots, one layer."""
        if self.kv_cache.shape.slot_capacity < self.runner.kv_cache.shape.slot_capacity:
            self.kv_cache.release()
            self.kv_cache = self._new_cache()

    def rewind(self, seq: "Sequence") -> None:
        """Nothing: the chained entries lie past ``draft_computed``, which stays at the catch-up point."""

    # ------------------------------------------------------------------ forwards
    @torch.inference_mode()
    def _forward(self, seqs: list["Sequence"], rows: list[ForwardRow], hidden: list[torch.Tensor],
                 token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block over ``rows`` (row i: tokens ``t_{p+1}..`` at positions ``p..``, with the hidden
        states ``hidden[i]`` of positions ``p..``); fp32 logits and output hidden state at each row's
        last position. ``token_ids`` ([rows, q], on the device) replaces the rows' tokens."""
        runner = self.runner
        input_ids, positions, mask, view = runner.row_inputs([seq.slot for seq in seqs], rows, self.kv_cache)
        if token_ids is not None:
            input_ids = token_ids
        q_len = input_ids.shape[1]
        padded = torch.stack([torch.nn.functional.pad(h, (0, 0, q_len - h.shape[0], 0)) for h in hidden])
        embeds = runner.model.get_input_embeddings()(input_ids)
        position_embeddings = runner.model.get_decoder().rotary_emb(embeds, positions)
        with runner.prefill_attention():  # SDPA's flash / memory-efficient kernels, as the target's forward
            out = self.layer(embeds, padded.to(embeds.dtype), position_embeddings, mask, view)[:, -1]
        return runner.model.get_output_embeddings()(out).float(), out

    def _catch_up(self, seqs: list["Sequence"]) -> torch.Tensor:
        """Feed each row its verified positions the block has not seen, ``(h_p, t_{p+1})`` for
        ``p = draft_computed .. num_computed - 1``; logits of the last one (draft 1) ``[rows, vocab]``."""
        for seq in seqs:
            state = seq.spec
            have = 0 if state.hidden is None else state.hidden.shape[0]
            if have != seq.num_computed - state.draft_computed or have == 0:
                raise RuntimeError(f"NEXTN: request {seq.rid} holds target hidden states for {have} positions, its "
                                   f"MTP cache lags {seq.num_computed - state.draft_computed}")
        last: list[torch.Tensor | None] = [None] * len(seqs)
        pending = list(range(len(seqs)))
        while pending:
            chunk = max(1, self.prefill_tokens // len(pending))
            rows, hidden = [], []
            for i in pending:
                state, fill = seqs[i].spec, seqs[i].fill_ids
                n = min(chunk, seqs[i].num_computed - state.draft_computed)
                rows.append(ForwardRow(fill[state.draft_computed + 1: state.draft_computed + 1 + n], state.draft_computed))
                hidden.append(state.hidden[:n])
            logits, out = self._forward([seqs[i] for i in pending], rows, hidden)
            for n, i in enumerate(pending):
                state, fed = seqs[i].spec, len(rows[n].tokens)
                state.draft_computed += fed
                state.hidden = state.hidden[fed:] if state.hidden.shape[0] > fed else None
                state.chain_hidden, state.chain_position = out[n: n + 1], state.draft_computed
                last[i] = logits[n]
            pending = [i for i in pending if seqs[i].spec.draft_computed < seqs[i].num_computed]
        return torch.stack(last)

    def _feed(self, seqs: list["Sequence"], tokens: torch.Tensor, batch_size: int) -> torch.Tensor:
        """One chained step per row: its last draft with the block's own output, past the verified length
        (the draft ids go in from the device, ``tokens``; each row's host token list only gives its length)."""
        rows = [ForwardRow([0], seq.spec.chain_position) for seq in seqs]
        logits, out = self._forward(seqs, rows, [seq.spec.chain_hidden for seq in seqs], tokens.view(-1, 1))
        for n, seq in enumerate(seqs):
            seq.spec.chain_hidden, seq.spec.chain_position = out[n: n + 1], seq.spec.chain_position + 1
        return logits


def checkpoint_tensors(layer: MTPLayer) -> dict[str, torch.Tensor]:
    """The block's weights under checkpoint names (``model.layers.{L}.*``, experts one by one, as
    checkpoints and SGLang name them): what a DeepSeek-V3 checkpoint's MTP layer holds."""
    out = {}
    for local, tensor in layer.state_dict().items():
        name = layer.prefix + (local[len("decoder."):] if local.startswith("decoder.") else local)
        if name.endswith(".experts.gate_up_proj"):
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = tensor[e, :half].clone()
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = tensor[e, half:].clone()
        elif name.endswith(".experts.down_proj"):
            for e in range(tensor.shape[0]):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = tensor[e].clone()
        else:
            out[name] = tensor.clone()
    return out


def add_mtp_layer(model_dir: str, seed: int = 0, std: float = 0.02,
                  edit: Callable[[MTPLayer], None] | None = None) -> dict[str, torch.Tensor]:
    """Write a random MTP layer (``num_nextn_predict_layers = 1``) into the HF checkpoint ``model_dir``
    (one ``model.safetensors``), ``edit(layer)`` changing it first; returns the tensors written (checkpoint
    names, with the copies of the embedding and head DeepSeek-V3's checkpoints carry). For tests and
    benchmarks: no checkpoint with MTP weights can be downloaded here."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    root = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    config.num_nextn_predict_layers = 1
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32)
    layer = MTPLayer(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in layer.state_dict().items():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                tensor.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                tensor.normal_(0.0, 0.05, generator=gen)
            else:
                tensor.normal_(0.0, std, generator=gen)
        if edit is not None:
            edit(layer)
    tensors = checkpoint_tensors(layer)
    # DeepSeek-V3's checkpoints carry copies of the embedding and head in the MTP layer (the loader skips them)
    tensors[layer.prefix + "embed_tokens.weight"] = model.get_input_embeddings().weight.detach().clone()
    tensors[layer.prefix + "shared_head.head.weight"] = model.get_output_embeddings().weight.detach().clone()
    weights = root / "model.safetensors"
    existing = load_file(str(weights))
    dtype = next(iter(existing.values())).dtype
    save_file({**existing, **{k: v.to(dtype).contiguous() for k, v in tensors.items()}}, str(weights),
              metadata={"format": "pt"})
    config.save_pretrained(model_dir)
    return tensors


#: the weights whose zeroing makes a layer pass its input through (attention and MLP outputs)
OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "experts.down_proj")


def make_markov_checkpoint(model_dir: str, mtp: str = "exact", noise: float = 0.0, seed: int = 1) -> str:
    """Turn the DeepSeek-V3 checkpoint ``model_dir`` (in place) into a "Markov" model with an MTP layer
    of known quality, for tests and benchmarks: every layer's attention and MLP output is zeroed, so
    its next token depends on the current token only (the compute is unchanged: the GEMMs still run);
    the MTP layer's own attention and MLP outputs are zeroed too and ``eh_proj`` is ``[I, 0]``
    (``exact``: it forwards the next token's embedding and so predicts the target's next-next token
    exactly) or ``[0, I]`` (``wrong``: it forwards the current hidden state, one token behind), plus
    ``noise`` (Gaussian, on ``eh_proj``)."""
    from safetensors.torch import load_file, save_file

    if mtp not in ("exact", "wrong"):
        raise ValueError(f"mtp must be 'exact' or 'wrong', got {mtp!r}")
    weights = Path(model_dir) / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({k: torch.zeros_like(v) if k.endswith(OUTPUT_PROJECTIONS) else v for k, v in tensors.items()},
              str(weights), metadata={"format": "pt"})

    def edit(layer: MTPLayer) -> None:
        size = layer.eh_proj.weight.shape[0]
        eye, zero = torch.eye(size), torch.zeros(size, size)
        layer.eh_proj.weight.copy_(torch.cat([zero, eye] if mtp == "wrong" else [eye, zero], dim=1))
        if noise:
            layer.eh_proj.weight.add_(noise * torch.randn(layer.eh_proj.weight.shape,
                                                          generator=torch.Generator().manual_seed(seed + 4)))
        for name, tensor in layer.state_dict().items():
            if name.endswith(OUTPUT_PROJECTIONS):
                tensor.zero_()

    add_mtp_layer(model_dir, seed=seed, edit=edit)
    return model_dir
