"""Vision-language actors in the FSDP trainer (Qwen2.5-VL, Qwen3-VL, Qwen3.5): images in packed micro-batches.

A sample's ``multimodal_train_inputs`` (the processor's ``pixel_values`` and ``image_grid_thw``) go with
its tokens. For a micro-batch (:func:`attach`), the samples' pixels are concatenated, every prompt
image token is marked in ``image_mask`` (row-major over the packed or padded layout: the order the
images' embeddings fill them), and each sample's M-RoPE positions come from the model's own
``get_rope_index`` over its prompt; response tokens continue at ``position + delta`` on all three
axes, as the engine decodes them. Only the prompt's image tokens take image embeddings: a response
token that happens to be the image placeholder is text, as it was for the engine that sampled it.

:func:`install_forward` gives the model a forward taking those inputs: the vision tower (trainable,
or frozen by ``--freeze-vision-tower``), the embeddings scattered into the token embeddings
(Qwen3-VL's deepstack features added after its first decoder layers), the language model, the head.
It replaces the instance's ``forward`` so FSDP's hooks around the module call still run. Extra keywords
reach the language model: Qwen3.5's linear-attention layers read the packed row's sample boundaries
(``cu_seq_lens_q``, :mod:`slime.utils.linear_attention`).
"""

from __future__ import annotations

import types

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast


def install_forward(model: torch.nn.Module) -> None:
    model.forward = types.MethodType(_forward, model)


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """``--freeze-vision-tower``: no gradient for the vision encoder and its merger; returns the parameters frozen."""
    frozen = 0
    for param in model.model.visual.parameters():
        param.requires_grad_(False)
        frozen += 1
    return frozen


def _forward(self, input_ids, position_ids=None, attention_mask=None, use_cache=False, logits_to_keep=0,
             pixel_values=None, image_grid_thw=None, image_mask=None, **kwargs):
    inner = self.model
    embeds = inner.get_input_embeddings()(input_ids)
    extra = {}
    if pixel_values is not None:
        vision = inner.get_image_features(pixel_values, image_grid_thw, return_dict=True)
        image_embeds = torch.cat(vision.pooler_output, dim=0).to(embeds.dtype)
        if int(image_mask.sum()) != image_embeds.shape[0]:
            raise ValueError(f"{int(image_mask.sum())} image tokens in the micro-batch's prompts for "
                             f"{image_embeds.shape[0]} image embeddings (image_grid_thw {image_grid_thw.tolist()})")
        embeds = embeds.masked_scatter(image_mask[..., None], image_embeds)
        if getattr(vision, "deepstack_features", None):
            extra = {"visual_pos_masks": image_mask,
                     "deepstack_visual_embeds": [torch.cat(f, dim=0).to(embeds.dtype) for f in vision.deepstack_features]}
    hidden = inner.language_model(inputs_embeds=embeds, position_ids=position_ids, attention_mask=attention_mask,
                                  use_cache=False, **extra, **kwargs).last_hidden_state
    if isinstance(logits_to_keep, int):
        hidden = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
    else:
        hidden = hidden[:, logits_to_keep]
    return CausalLMOutputWithPast(logits=self.lm_head(hidden))


def _sample_positions(model, tokens: torch.Tensor, response_length: int, inputs: dict | None) -> torch.Tensor:
    """[3, L] M-RoPE positions of one sample (prompt from the rope index, response continuing)."""
    length = int(tokens.numel())
    if not inputs or inputs.get("image_grid_thw") is None:
        return torch.arange(length, dtype=torch.long).view(1, -1).expand(3, -1)
    prompt = tokens[:length - response_length].long().view(1, -1)
    token_type = (prompt == model.config.image_token_id).int()
    positions, delta = model.model.get_rope_index(prompt, mm_token_type_ids=token_type,
                                                  image_grid_thw=inputs["image_grid_thw"].long())
    after = torch.arange(length - response_length, length, dtype=torch.long) + int(delta.view(-1)[0])
    return torch.cat([positions[:, 0].cpu(), after.view(1, -1).expand(3, -1)], dim=1)


def attach(model, packed, tokens: list[torch.Tensor], response_lengths: list[int], train_inputs: list, names: list[str],
           device) -> None:
    """Set a micro-batch's M-RoPE ``position_ids`` and its image inputs (``packed.model_kwargs``)."""
    image_token = model.config.image_token_id
    rows, width = packed.input_ids.shape
    mask = torch.zeros(rows, width, dtype=torch.bool)
    positions = torch.zeros(3, rows, width, dtype=torch.long)
    pixels, grids, offset = [], [], 0
    for i, (sample, response_length, inputs) in enumerate(zip(tokens, response_lengths, train_inputs)):
        length = int(sample.numel())
        row, start = (i, 0) if packed.padded else (0, offset)
        positions[:, row, start:start + length] = _sample_positions(model, sample, response_length, inputs)
        if inputs and inputs.get("pixel_values") is not None:
            prompt_images = (sample[:length - response_length] == image_token)
            expected = int(sum(int(g.prod()) for g in inputs["image_grid_thw"])) // model.model.visual.spatial_merge_size ** 2
            if int(prompt_images.sum()) != expected:
                raise ValueError(f"{names[i]}: its prompt has {int(prompt_images.sum())} image tokens, its "
                                 f"multimodal_train_inputs' image_grid_thw make {expected}")
            mask[row, start:start + length - response_length] = prompt_images
            pixels.append(torch.as_tensor(inputs["pixel_values"]))
            grids.append(torch.as_tensor(inputs["image_grid_thw"]).long())
        offset += length
    if packed.padded:
        packed.position_ids = positions.to(device)
    else:  # text positions first: the packed layout's sample boundaries for varlen attention
        packed.position_ids = torch.cat([packed.position_ids.cpu()[None], positions]).to(device)
    if pixels:
        packed.model_kwargs = {"pixel_values": torch.cat(pixels).to(device), "image_grid_thw": torch.cat(grids).to(device),
                               "image_mask": mask.to(device)}
