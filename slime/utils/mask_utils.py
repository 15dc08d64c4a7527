"""Loss masks for chat conversations (SFT rollout, rollout-buffer plugins).

``MultiTurnLossMaskGenerator.get_loss_mask(messages, tools)`` renders a conversation with the
tokenizer's own chat template and marks which tokens are trained: the content of assistant turns
(up to and including the end-of-turn token), unless the message carries ``step_loss_mask: 0``.
Role headers (``<|im_start|>assistant\\n``), system/user/tool turns and the newline after an
end-of-turn token are context (mask 0).

It works on any template whose rendering of ``messages[:k+1]`` extends the rendering of
``messages[:k]`` (true for the Qwen 2.5 / Qwen3 / distill-Qwen families on conversations whose
assistant turns carry no reasoning to be stripped); otherwise it raises and says so.
"""

from __future__ import annotations

SUPPORTED_TOKENIZER_TYPES = ("qwen", "qwen3", "qwen3_5", "distill_qwen")


class MultiTurnLossMaskGenerator:
    def __init__(self, tokenizer, tokenizer_type: str = "qwen"):
        if tokenizer_type not in SUPPORTED_TOKENIZER_TYPES:
            raise ValueError(
                f"unknown --loss-mask-type {tokenizer_type!r}; expected one of {list(SUPPORTED_TOKENIZER_TYPES)}"
            )
        self.tokenizer = tokenizer
        self.tokenizer_type = tokenizer_type
        self.end_of_turn_id = tokenizer.eos_token_id

    def _render(self, messages, tools, add_generation_prompt: bool) -> str:
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def get_loss_mask(self, messages: list[dict], tools: list | None = None) -> tuple[list[int], list[int]]:
        """Return ``(token_ids, loss_mask)`` of the whole conversation, equal lengths."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("get_loss_mask expects a list of chat messages (dicts with 'role' and 'content')")
        token_ids: list[int] = []
        loss_mask: list[int] = []
        previous = ""
        for k, message in enumerate(messages):
            rendered = self._render(messages[: k + 1], tools, add_generation_prompt=False)
            if not rendered.startswith(previous):
                raise ValueError(
                    f"the chat template does not render turn {k} as an extension of the previous turns "
                    f"(it rewrites earlier text, e.g. strips reasoning); loss masks cannot be derived by prefix "
                    f"diffing for this conversation"
                )
            if message["role"] == "assistant":
                with_header = self._render(messages[:k], tools, add_generation_prompt=True) if k else ""
                header = with_header[len(previous) :] if with_header.startswith(previous) else ""
                segment = rendered[len(previous) :]
                if not segment.startswith(header):
                    header = ""
                header_ids = self._encode(header)
                body_ids = self._encode(segment[len(header) :])
                trainable = int(message.get("step_loss_mask", 1)) == 1
                body_mask = [1 if trainable else 0] * len(body_ids)
                # Tokens after the last end-of-turn token (the template's trailing newline) are context.
                if trainable and self.end_of_turn_id in body_ids:
                    last_eot = len(body_ids) - 1 - body_ids[::-1].index(self.end_of_turn_id)
                    body_mask[last_eot + 1 :] = [0] * (len(body_ids) - last_eot - 1)
                token_ids += header_ids + body_ids
                loss_mask += [0] * len(header_ids) + body_mask
            else:
                segment_ids = self._encode(rendered[len(previous) :])
                token_ids += segment_ids
                loss_mask += [0] * len(segment_ids)
            previous = rendered
        return token_ids, loss_mask

    @staticmethod
    def get_response_lengths(loss_masks: list[list[int]]) -> list[int]:
        """Response length of each mask: from its first trainable token to the end (0 if none)."""
        lengths = []
        for mask in loss_masks:
            first = next((i for i, m in enumerate(mask) if m), None)
            lengths.append(0 if first is None else len(mask) - first)
        return lengths
