"""The backend-neutral training core: the rollout-step flow written once over a narrow backend
interface, and the kernels both backends use (log-prob head, fused Triton log-probs, varlen attention).
Imports no backend; ``fsdp_utils`` and ``megatron_utils`` implement :class:`~slime.backends.training.backend.TrainBackend`."""
