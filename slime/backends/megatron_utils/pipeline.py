"""Micro-batches through Megatron-Core's pipeline schedule: forward-only and training passes.

``get_forward_backward_func()`` picks the schedule for this rank's pipeline size: no pipelining at
PP = 1, the non-interleaved 1F1B schedule at PP > 1 (the first stage embeds the tokens, the last
one computes logits, hidden states travel between stages). Micro-batches differ in length, so the
stages exchange each tensor's shape first (``variable_seq_lengths``); every rank of one pipeline
must be handed the same micro-batches in the same order (the trainer merges the shards of a
model-parallel group, :mod:`.data`).

The caller's ``loss_fn(inputs, logits)`` runs on the last stage only, on the response rows
(``[K, V]``, in the autocast dtype, vocabulary padding removed; the output layer computed only
those rows) of one micro-batch, and returns ``(loss, payload)``; the
gradient accumulated over a training pass is exactly that of Σ loss. (The schedule divides what it
is handed by the number of micro-batches and multiplies it by the context-parallel size, Megatron's
own loss averaging; :func:`forward_backward` undoes both, so the scaling of docs/INTERFACES.md §5.8 stays
in one place, the trainer's loss.) The payloads (log-probs, metric sums: CPU tensors) are returned
in micro-batch order on the last stage, an empty list elsewhere; :func:`broadcast_from_last_stage`
hands them to every stage.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from slime.backends.megatron_utils.forward import MicroBatchInputs, cut_vocabulary_padding, run_model
from slime.backends.megatron_utils.model import unwrap

__all__ = ["forward_backward", "broadcast_from_last_stage", "is_last_stage"]

LossFn = Callable[[MicroBatchInputs, torch.Tensor], tuple[torch.Tensor, object]]


def is_last_stage() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage()


def forward_backward(model: torch.nn.Module, batches: Sequence[MicroBatchInputs], loss_fn: LossFn, *,
                     forward_only: bool, vocab_size: int, autocast_dtype: torch.dtype | None = None,
                     around_forward: Callable[[MicroBatchInputs], contextlib.AbstractContextManager] | None = None) -> list:
    """Run ``batches`` through the schedule; with ``forward_only=False`` the gradients of
    Σ loss are accumulated into the parameters (DDP's ``main_grad`` buffers or ``.grad``), not
    reduced over data-parallel ranks (that is ``finalize_model_grads``, the caller's).
    ``around_forward(inputs)``: a context entered around each micro-batch's model forward (MoE
    routing record/replay)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not batches:
        return []
    count = len(batches)
    cp_size = ps.get_context_parallel_world_size()
    config = unwrap(model).config
    last = ps.is_pipeline_last_stage()

    def forward_step(data_iterator, module):
        inputs = next(data_iterator)
        autocast = (torch.autocast(inputs.input_ids.device.type, dtype=autocast_dtype) if autocast_dtype is not None
                    else contextlib.nullcontext())
        around = around_forward(inputs) if around_forward is not None else contextlib.nullcontext()
        with around, autocast:
            output = run_model(module, inputs)
        if not last and output.dtype != config.pipeline_dtype:
            # the next stage receives into a buffer of pipeline_dtype: a mismatch would be read as garbage
            raise RuntimeError(f"pipeline stage output is {output.dtype} but TransformerConfig.pipeline_dtype is "
                               f"{config.pipeline_dtype}; they must agree")

        def loss_func(output_tensor):
            loss, payload = loss_fn(inputs, cut_vocabulary_padding(output_tensor, vocab_size))
            return loss * count / cp_size, payload

        return output, loss_func

    longest = max(int(b.input_ids.shape[-1]) for b in batches)
    schedule = get_forward_backward_func()
    payloads = schedule(forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                        num_microbatches=count, seq_length=longest, micro_batch_size=int(batches[0].input_ids.shape[0]),
                        forward_only=forward_only)
    return list(payloads) if last else []


def broadcast_from_last_stage(obj):
    """``obj`` of the last pipeline stage on every stage of this rank's pipeline (picklable; keep
    tensors on the CPU)."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return obj
    holder = [obj if ps.is_pipeline_last_stage() else None]
    dist.broadcast_object_list(holder, src=ps.get_pipeline_model_parallel_last_rank(), group=group)
    return holder[0]
