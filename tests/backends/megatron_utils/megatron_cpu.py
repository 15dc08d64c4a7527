"""Megatron-Core on the CPU, for tests: where its code is, and the few CUDA-only calls redirected.

Megatron-Core 0.19's wheels are CPython 3.12 only and its model code assumes CUDA in a handful of
places, but the rest is plain PyTorch and ``torch.distributed``, so on gloo it computes the same
network. ``scripts/setup-env.sh`` unpacks the wheel's Python code into ``.venv/megatron-core``
(off the import path: slime must not believe Megatron is installed on a CPU machine); the triton
it imports at module level comes from ``.venv/sglang-args``. Tests run Megatron in a subprocess
(torchrun) with :func:`pythonpath` on ``PYTHONPATH``; the script calls :func:`patch_for_cpu`
first. What is redirected (test scaffolding only; nothing in ``slime/`` relies on it):

* ``torch.cuda.current_device()`` → the CPU device (rotary embeddings, p2p buffers, DDP buffers);
* ``torch.cuda.synchronize()`` → no-op (p2p shape exchange); ``Tensor.cuda()`` → the tensor
  itself (the tied output layer of the last pipeline stage); ``torch.cuda.current_stream()`` → a
  stream that never waits (DDP's gradient reduction);
* the default causal mask, built with ``device="cuda"`` in ``fused_softmax``;
* the model-parallel CUDA RNG tracker's ``fork()`` → no-op (dropout is 0 in these tests);
* tensors made with ``device="cuda"`` inside the pipeline schedules and the optimizer modules.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MEGATRON_DIR = ROOT / ".venv" / "megatron-core"
TRITON_DIR = ROOT / ".venv" / "sglang-args" / "triton"


def pythonpath() -> str | None:
    """``PYTHONPATH`` entries that make ``megatron.core`` importable here, or None when absent."""
    if not (MEGATRON_DIR / "megatron" / "core").is_dir() or not TRITON_DIR.is_dir():
        return None
    # only triton from sglang-args: the rest of it (SGLang itself) must stay invisible
    # one folder per checkout: a link left by another checkout (or a deleted one) must not be reused
    checkout = hashlib.sha1(str(TRITON_DIR).encode()).hexdigest()[:12]
    link_dir = Path(tempfile.gettempdir()) / f"slime-megatron-triton-{os.getuid()}-{checkout}"
    link_dir.mkdir(exist_ok=True)
    link = link_dir / "triton"
    if not (link.is_symlink() and os.readlink(link) == str(TRITON_DIR)):
        staged = link_dir / f"triton.{os.getpid()}"
        staged.unlink(missing_ok=True)
        staged.symlink_to(TRITON_DIR)
        os.replace(staged, link)  # atomic, so parallel tests never see a missing link
    return os.pathsep.join([str(MEGATRON_DIR), str(link_dir), str(ROOT)])


def patch_for_cpu() -> None:
    """Redirect Megatron-Core's CUDA-only calls to the CPU (call before building a model)."""
    import contextlib
    import types

    import torch

    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self

    class _NoStream:
        def wait_event(self, event):
            pass

        def wait_stream(self, stream):
            pass

    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()

    import megatron.core.fusions.fused_softmax as fused_softmax
    from megatron.core.tensor_parallel import random as mp_random

    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
    mp_random.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()

    class _CpuTorch(types.ModuleType):
        """``torch`` as one Megatron module sees it: tensors asked for on "cuda" are made on the CPU."""

        def __getattr__(self, name):
            return getattr(torch, name)

    def _cpu_factory(factory):
        def make(*args, device=None, **kwargs):
            if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
                device = "cpu"
            return factory(*args, device=device, **kwargs)
        return make

    cpu_torch = _CpuTorch("torch")
    for name in ("zeros", "ones", "empty", "tensor", "full", "zeros_like", "empty_like"):
        setattr(cpu_torch, name, _cpu_factory(getattr(torch, name)))
    import importlib

    for module in ("megatron.core.pipeline_parallel.schedules", "megatron.core.optimizer.optimizer",
                   "megatron.core.optimizer.distrib_optimizer", "megatron.core.optimizer.clip_grads"):
        importlib.import_module(module).torch = cpu_torch
