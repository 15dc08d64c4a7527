"""SFT "rollout": no generation, chat conversations turned into tokens and loss masks (docs/INTERFACES.md §3.1).

Each prompt group (size 1) holds a chat-message list; the loss-mask generator of ``--loss-mask-type``
renders it with the tokenizer's template, and the response region runs from the first trainable
token to the end (assistant turns trained, ``step_loss_mask: 0`` turns not).
"""

from __future__ import annotations

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.utils.mask_utils import MultiTurnLossMaskGenerator
from slime.utils.multimodal import MediaError, expand_image_tokens, image_inputs, load_image, sample_images
from slime.utils.processing_utils import load_processor, load_tokenizer
from slime.utils.types import Sample


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    if evaluation:
        raise ValueError("the SFT rollout has no evaluation mode; set --eval-function-path to a generating rollout")
    if not args.rollout_global_dataset:
        raise ValueError("the SFT rollout needs the global dataset (remove --disable-rollout-global-dataset)")
    generator = MultiTurnLossMaskGenerator(
        load_tokenizer(args.hf_checkpoint), tokenizer_type=args.loss_mask_type
    )
    groups = data_source.get_samples(args.rollout_batch_size)
    processor = None
    for group in groups:
        if len(group) != 1:
            raise ValueError(f"the SFT rollout needs --n-samples-per-prompt 1, got groups of {len(group)}")
        sample = group[0]
        if not isinstance(sample.prompt, list):
            raise ValueError(
                f"SFT sample {sample.index}: prompt must be a chat-message list (use --input-key messages and no "
                f"--apply-chat-template); got {type(sample.prompt).__name__}"
            )
        token_ids, loss_mask = generator.get_loss_mask(sample.prompt, tools=sample.metadata.get("tools"))
        if sample_images(sample):  # each image placeholder expanded to its tokens (context), pixels for the trainer
            processor = processor or load_processor(args.hf_checkpoint)
            token_ids, loss_mask = _with_images(args, processor, sample, token_ids, loss_mask)
        response_length = generator.get_response_lengths([loss_mask])[0]
        sample.tokens = token_ids
        sample.response_length = response_length
        sample.loss_mask = loss_mask[len(loss_mask) - response_length :]
        sample.reward = 0
        sample.status = Sample.Status.COMPLETED
    return RolloutFnTrainOutput(samples=groups)


def _with_images(args, processor, sample: Sample, token_ids: list[int], loss_mask: list[int]
                 ) -> tuple[list[int], list[int]]:
    if processor is None:
        raise ValueError(f"SFT sample {sample.index} has images but {args.hf_checkpoint} has no image processor")
    try:
        images = [load_image(item) for item in sample_images(sample)]
        sample.multimodal_train_inputs, counts = image_inputs(processor, images)
        return expand_image_tokens(token_ids, processor.image_token_id, counts, loss_mask)
    except MediaError as e:
        raise ValueError(f"SFT sample {sample.index}: {e}") from None
