"""Vision-language models in the engine (Qwen2.5-VL, Qwen3-VL, Qwen3.5): images in, M-RoPE positions, the vision tower at prefill.

A request's images (``image_data`` of ``/generate``, ``image_url`` parts of a chat) are loaded and
run through the checkpoint's image processor when the request arrives (:meth:`VisionLanguage.prepare`):
each image's placeholder run in the prompt ids becomes ``t*h*w / merge**2`` image tokens (a single
placeholder is expanded; a run of the right length is kept), and the prompt's 3-D rotary positions
come from the model's own ``get_rope_index``. Text after the prompt continues at ``position +
delta`` on all three axes (``delta`` = highest prompt position + 1 - prompt length), so decode needs
one number per row: :attr:`VisionLanguage.rope_deltas`, a device buffer indexed by cache slot that the
decode step (and its CUDA graph) adds to the positions it feeds.

The vision tower runs once per request, at its first prefill chunk (:meth:`VisionLanguage.encode`);
prefill rows then feed the language model embeddings in which each image token's row is the tower's
output (and, for Qwen3-VL, the tower's deepstack features are added after the first decoder layers,
as the model does). Requests that share a prefill must share their images too: :attr:`RequestVision.key`
is part of the engine's shared-prefill key.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from slime.backends.embedded_engine.io_struct import RequestError
from slime.utils.multimodal import is_vision_language

__all__ = ["RequestVision", "VisionLanguage", "attach_images", "is_vision_language"]


@dataclass
class RequestVision:
    """The images of one request, processed: what its prefill and decode rows need."""

    pixel_values: torch.Tensor  # [patches, channels * temporal * patch**2]
    grid_thw: torch.Tensor  # [images, 3]
    positions: torch.Tensor  # [3, prompt_len] M-RoPE positions of the prompt
    delta: int  # a token at position p >= prompt_len rotates at p + delta on every axis
    embed_index: list[int]  # per prompt position: its row of the image embeddings, -1 for text
    key: str  # digest of the pixels and grids (shared-prefill key)
    embeds: torch.Tensor | None = None  # [image tokens, hidden], from the vision tower at the first prefill
    deepstack: list[torch.Tensor] = field(default_factory=list)  # Qwen3-VL: per early layer, [image tokens, hidden]

    def rotary_positions(self, start: int, count: int) -> torch.Tensor:
        """[3, count] rotary positions of the tokens at ``start .. start + count``."""
        prompt_len = self.positions.shape[1]
        inside = self.positions[:, start:min(start + count, prompt_len)]
        first_after = max(start, prompt_len)
        after = torch.arange(first_after, max(first_after, start + count), dtype=torch.long) + self.delta
        return torch.cat([inside, after.view(1, -1).expand(3, -1)], dim=1)


class VisionLanguage:
    """The vision side of a served vision-language model (see the module docstring)."""

    def __init__(self, model, model_path: str, max_slots: int, device: torch.device):
        self.model = model
        self.config = model.config
        self.model_path = model_path
        self.image_token_id = int(self.config.image_token_id)
        self.merge = int(self.config.vision_config.spatial_merge_size)
        self.deepstack = bool(getattr(self.config.vision_config, "deepstack_visual_indexes", None))
        #: per cache slot, the rotary offset of its request's generated tokens (0 for text-only requests)
        self.rope_deltas = torch.zeros(max_slots, dtype=torch.long, device=device)
        self._image_processor = None

    @property
    def image_processor(self):
        if self._image_processor is None:
            from transformers import AutoImageProcessor

            try:
                self._image_processor = AutoImageProcessor.from_pretrained(self.model_path)
            except (OSError, ValueError) as e:
                raise RequestError(f"the served checkpoint {self.model_path} has no image processor "
                                   f"(preprocessor_config.json): {e}") from None
        return self._image_processor

    @property
    def language_model(self):
        return self.model.model.language_model

    # ------------------------------------------------------------------ requests
    def prepare(self, input_ids: list[int], image_data: list) -> tuple[list[int], RequestVision]:
        """Load and process a request's images; return the prompt ids with every image's placeholders
        expanded and the request's :class:`RequestVision`. Bad images and placeholder counts are 400s."""
        from slime.utils.multimodal import MediaError, expand_image_tokens, load_image

        try:
            images = [load_image(item) for item in image_data]
        except MediaError as e:
            raise RequestError(f"image_data: {e}") from None
        processed = self.image_processor(images=images, return_tensors="pt")
        grid = processed["image_grid_thw"].long()
        counts = [int(g.prod()) // self.merge ** 2 for g in grid]
        try:
            ids, _ = expand_image_tokens(input_ids, self.image_token_id, counts)
        except MediaError as e:
            raise RequestError(f"image_data: {e}") from None
        ids_tensor = torch.tensor([ids], dtype=torch.long)
        token_type = (ids_tensor == self.image_token_id).int()
        positions, delta = self.model.model.get_rope_index(ids_tensor, mm_token_type_ids=token_type,
                                                           image_grid_thw=grid)
        embed_index, row = [], 0
        for token in ids:
            embed_index.append(row if token == self.image_token_id else -1)
            row += token == self.image_token_id
        digest = hashlib.sha256(processed["pixel_values"].numpy().tobytes())
        digest.update(grid.numpy().tobytes())
        vision = RequestVision(pixel_values=processed["pixel_values"], grid_thw=grid, positions=positions[:, 0].cpu(),
                               delta=int(delta.view(-1)[0]), embed_index=embed_index, key=digest.hexdigest())
        return ids, vision

    def check_text_only(self, image_data) -> None:
        if image_data:
            raise RequestError("image_data was given but the served model has no vision tower")

    # ------------------------------------------------------------------ forwards
    @torch.inference_mode()
    def encode(self, vision: RequestVision) -> None:
        """Run the vision tower over the request's images (once; requests sharing images share the result)."""
        if vision.embeds is not None:
            return
        visual = self.model.model.visual
        out = self.model.model.get_image_features(vision.pixel_values.to(visual.device, visual.dtype),
                                                  vision.grid_thw.to(visual.device), return_dict=True)
        vision.embeds = torch.cat(out.pooler_output, dim=0)
        if self.deepstack:
            vision.deepstack = [torch.cat(features, dim=0) for features in out.deepstack_features]

    def prefill(self, rows, slots: list[int], input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache_kwargs: dict, logits_to_keep: int) -> torch.Tensor:
        """The forward of prefill rows (left-padded ``[rows, q]`` ``input_ids`` at ``positions``): image tokens
        take the tower's embeddings, every token its M-RoPE position. Returns the logits (last position
        only when ``logits_to_keep`` is 1)."""
        q_len = input_ids.shape[1]
        embeds = self.language_model.embed_tokens(input_ids)
        rotary = positions.unsqueeze(0).repeat(3, 1, 1)
        visual_rows, visual_cols, image_rows, owners = [], [], [], []
        for i, (slot, row) in enumerate(zip(slots, rows)):
            vision = row.vision
            self.rope_deltas[slot] = vision.delta if vision is not None else 0
            if vision is None:
                continue
            self.encode(vision)
            pad = q_len - len(row.tokens)
            rotary[:, i, pad:] = vision.rotary_positions(row.start, len(row.tokens)).to(rotary.device)
            for j in range(len(row.tokens)):
                index = vision.embed_index[row.start + j] if row.start + j < len(vision.embed_index) else -1
                if index >= 0:
                    visual_rows.append(i)
                    visual_cols.append(pad + j)
                    image_rows.append(index)
                    owners.append(vision)
        extra = {}
        if visual_rows:
            r = torch.tensor(visual_rows, device=embeds.device)
            c = torch.tensor(visual_cols, device=embeds.device)
            embeds[r, c] = torch.stack([v.embeds[k] for v, k in zip(owners, image_rows)]).to(embeds.dtype)
            if self.deepstack:
                # the model adds layer l's features at hidden[visual_pos_masks] (row-major order, as built here)
                visual_mask = torch.zeros(input_ids.shape, dtype=torch.bool, device=embeds.device)
                visual_mask[r, c] = True
                layers = len(owners[0].deepstack)
                extra = {"visual_pos_masks": visual_mask, "deepstack_visual_embeds": [
                    torch.stack([v.deepstack[layer][k] for v, k in zip(owners, image_rows)]) for layer in range(layers)]}
        hidden = self.language_model(inputs_embeds=embeds, position_ids=rotary, attention_mask=mask, use_cache=True,
                                     **cache_kwargs, **extra).last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return self.model.lm_head(hidden)

    def decode_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotary positions of a decode step's rows (slot b is row b): the cache positions plus each slot's delta."""
        return positions + self.rope_deltas[:positions.shape[0]].view(-1, 1)

    def move_slot(self, src: int, dst: int) -> None:
        self.rope_deltas[dst] = self.rope_deltas[src]

    def copy_slots(self, srcs: list[int], dsts: list[int]) -> None:
        index = torch.tensor(srcs, dtype=torch.long, device=self.rope_deltas.device)
        self.rope_deltas[torch.tensor(dsts, dtype=torch.long, device=index.device)] = self.rope_deltas[index]


def attach_images(runner, requests) -> None:
    """Process the ``image_data`` of ``requests`` (from one body; the ``n`` copies of a prompt share one
    result): expanded prompt ids and :class:`RequestVision` on each, the context length checked again."""
    done: dict[int, tuple[list[int], RequestVision]] = {}
    for request in requests:
        if not request.image_data:
            continue
        if runner.vision is None:
            raise RequestError("image_data was given but the served model has no vision tower")
        key = id(request.image_data)
        if key not in done:
            done[key] = runner.vision.prepare(request.input_ids, request.image_data)
        request.input_ids, request.vision = list(done[key][0]), done[key][1]
        budget = request.params.max_new_tokens or 0
        if len(request.input_ids) + budget > runner.context_length:
            raise RequestError(f"The input ({len(request.input_ids)} tokens with its images) and max_new_tokens "
                               f"({budget}) exceed the model's context length ({runner.context_length} tokens).")
