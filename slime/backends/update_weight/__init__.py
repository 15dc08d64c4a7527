"""Trainer → engine weight transports (DESIGN §5), shared by every training backend.

A trainer produces HF-named full tensors in buckets (``iter_weight_buckets``); a transport delivers
them to every engine over SGLang's weight-update endpoints:

==============  ============================================================================
``tensor``      colocated: ``/update_weights_from_tensor`` (shared memory on CPU, CUDA IPC on GPU)
``distributed`` disaggregated: ``/init_weights_update_group`` + ``/update_weights_from_distributed``
``disk``        ``/update_weights_from_disk`` on an HF checkpoint written per version (full mode), or on
                a host-local checkpoint that ``/pull_weights`` keeps in sync with published deltas
==============  ============================================================================

Engines are paused and their caches flushed around an update, and every bucket carries the new
``weight_version`` so samples record the policy that produced them.
"""

from slime.backends.update_weight.base import EngineClient, bucket_named_tensors, make_weight_updater

__all__ = ["EngineClient", "bucket_named_tensors", "make_weight_updater"]
