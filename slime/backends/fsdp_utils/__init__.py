"""PyTorch FSDP2 training backend (CPU with gloo, GPU with NCCL) on Hugging Face models.

``FSDPBackend`` (backend.py) implements :class:`slime.backends.training.backend.TrainBackend`;
``add_fsdp_arguments`` (arguments.py) adds its flags. Imported lazily so
``import slime.backends.fsdp_utils`` stays cheap.
"""

__all__ = ["FSDPBackend", "add_fsdp_arguments"]


def __getattr__(name):
    if name == "FSDPBackend":
        from slime.backends.fsdp_utils.backend import FSDPBackend

        return FSDPBackend
    if name == "add_fsdp_arguments":
        from slime.backends.fsdp_utils.arguments import add_fsdp_arguments

        return add_fsdp_arguments
    raise AttributeError(name)
