"""PyTorch FSDP2 training backend (CPU with gloo, GPU with NCCL) on Hugging Face models.

``FSDPTrainWorker`` (worker.py) is the per-rank trainer; ``add_fsdp_arguments`` (arguments.py) its
extra flags. Imported lazily so ``import slime.backends.fsdp_utils`` stays cheap.
"""

__all__ = ["FSDPTrainWorker", "add_fsdp_arguments"]


def __getattr__(name):
    if name == "FSDPTrainWorker":
        from slime.backends.fsdp_utils.worker import FSDPTrainWorker

        return FSDPTrainWorker
    if name == "add_fsdp_arguments":
        from slime.backends.fsdp_utils.arguments import add_fsdp_arguments

        return add_fsdp_arguments
    raise AttributeError(name)
