"""Tokenizer / processor loading shared by the data loader, the default generator and SFT rollout."""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def _load_tokenizer_cached(name_or_path: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)


def load_tokenizer(name_or_path: str, **kwargs):
    """Load (and cache per process) the Hugging Face tokenizer of a checkpoint directory or hub name."""
    if not name_or_path:
        raise ValueError("load_tokenizer needs a checkpoint path (set --hf-checkpoint)")
    trust_remote_code = kwargs.pop("trust_remote_code", True)
    if kwargs:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **kwargs)
    return _load_tokenizer_cached(str(name_or_path), trust_remote_code)


def load_processor(name_or_path: str, **kwargs):
    """Load (and cache per process) the multimodal processor of a checkpoint, or return None for a text-only model.

    ``AutoProcessor`` falls back to returning the tokenizer for text-only checkpoints (or raises when
    there is no processor config); both mean "no processor" to slime.
    """
    if kwargs:
        return _load_processor(name_or_path, **kwargs)
    return _load_processor_cached(str(name_or_path))


@functools.lru_cache(maxsize=8)
def _load_processor_cached(name_or_path: str):
    return _load_processor(name_or_path)


def _load_processor(name_or_path: str, **kwargs):
    from transformers import AutoProcessor, PreTrainedTokenizerBase

    from slime.utils.multimodal import fallback_processor

    kwargs.setdefault("trust_remote_code", True)
    try:
        processor = AutoProcessor.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ImportError) as e:
        # e.g. a Qwen-VL processor whose video half needs torchvision: its image half still loads
        processor = fallback_processor(str(name_or_path), load_tokenizer(str(name_or_path)))
        if processor is not None:
            logger.warning("AutoProcessor of %s did not load (%s: %s); using its image processor and tokenizer "
                           "(images only)", name_or_path, type(e).__name__, e)
            return processor
        logger.debug("no processor for %s (%s); treating it as text-only", name_or_path, e)
        return None
    if isinstance(processor, PreTrainedTokenizerBase):
        return None
    return processor
