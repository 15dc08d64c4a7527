"""Device memory released and resumed at the same addresses (``--enable-memory-saver``, CUDA).

A colocated engine gives its device memory to the trainer while it trains (``/release_memory_occupation``)
and takes it back before the next rollout. Freeing and reallocating the tensors would move them, and
every CUDA graph captured against the weights and the KV cache would have to be captured again at
the next rollout (0.6B on an H200: the rollout took 2.61 s instead of 1.49 s, the release 0.88 s instead of 0.036 s).
``torch-memory-saver`` (the package SGLang uses for the same flag) allocates tensors through CUDA's
virtual memory API instead: a pause unmaps the physical memory of a tagged region (the device really
has it free: ``cudaMemGetInfo`` and the trainer see it), a resume maps new physical memory at the
same virtual addresses, so the graphs replay as captured.

Content across a pause, as in SGLang: the KV cache keeps none (nothing runs while it is released, and
this engine keeps no prefix cache); the model's parameters keep none either unless
``--enable-weights-cpu-backup`` (SGLang's flag, off by default): the colocated cycle resumes them and
pushes every weight before the next rollout, so copying 1.2 GB to the host and back would be wasted.
The runner then tracks which parameters were rewritten since the resume and refuses to generate until
all were (``ModelRunner.unwritten_weights``). What a weight push does not rewrite is always backed up in
pinned host memory kept between pauses (tag ``weights_kept``): buffers (rotary tables, ...), a NEXTN
draft layer, and the FP8 weights and scales of ``--quantization fp8`` (their update path quantizes into them).

What each release and resume costs inside the loop (one allocation per region, no weight backup) is in
docs/loop.md: for Qwen3-0.6B on an H200 the release of weights and KV takes 0.016 s.
Tensors in a region cannot be shared by CUDA IPC; the engine only opens the trainer's handles.
"""

from __future__ import annotations

import itertools

import torch

WEIGHTS = "weights"  # the model's parameters: content kept only with --enable-weights-cpu-backup
WEIGHTS_KEPT = "weights_kept"  # what a weight push does not rewrite: content always kept
_kv_regions = itertools.count()


class MemorySaver:
    """``region(tag, keep_content)`` allocates pausable tensors; ``pause(tag)`` / ``resume(tag)``."""

    def __init__(self):
        try:
            import torch_memory_saver
        except ImportError as exc:
            raise RuntimeError("--enable-memory-saver needs the torch-memory-saver package on CUDA "
                               "(pip install torch-memory-saver); without the flag a released engine copies its "
                               "weights to the host and recaptures its CUDA graphs after a resume") from exc
        self._tms = torch_memory_saver.torch_memory_saver
        self._tms.hook_mode = "torch"  # torch's pluggable allocator: no LD_PRELOAD in the engine's environment
        self._tms.retain_cpu_backup = True  # pinned host backups are allocated once, not at every pause
        self.paused: set[str] = set()
        self.weight_tags: set[str] = set()  # the weight regions that hold tensors (adopt)

    @staticmethod
    def new_kv_tag() -> str:
        """A fresh tag for one KV cache allocation (a cache regrown longer gets a new one)."""
        return f"kv_cache_{next(_kv_regions)}"

    def region(self, tag: str, keep_content: bool):
        return self._tms.region(tag=tag, enable_cpu_backup=keep_content)

    def pause(self, tag: str) -> None:
        if tag not in self.paused:
            self._tms.pause(tag)
            self.paused.add(tag)

    def resume(self, tag: str) -> None:
        if tag in self.paused:
            self._tms.resume(tag)
            self.paused.discard(tag)

    def pause_weights(self) -> None:
        for tag in sorted(self.weight_tags):
            self.pause(tag)

    def resume_weights(self) -> None:
        for tag in sorted(self.weight_tags):
            self.resume(tag)

    @torch.no_grad()
    def adopt(self, modules: list[torch.nn.Module], keep_parameters: bool = True) -> list[torch.Tensor]:
        """Move every device parameter and buffer of ``modules`` into a pausable region, keeping each Parameter
        object (tied weights stay tied): the parameters into ``weights`` (their content kept across pauses only
        if ``keep_parameters``), buffers into ``weights_kept``. Each region gets ONE allocation that the tensors
        are views of: a pause and a resume cost one unmap / map per allocation (0.6B's 310 parameters one by
        one took ~0.07 s to resume on the H200, mostly those calls). Returns the parameters whose content a
        pause drops (none when ``keep_parameters``)."""
        params, seen = [], set()
        for module in modules:
            for sub in module.modules():
                for param in sub._parameters.values():
                    if param is not None and param.is_cuda and id(param) not in seen:
                        seen.add(id(param))
                        params.append(param)
        buffers = {}  # a buffer two modules share stays shared
        for module in modules:
            for sub in module.modules():
                for name, buf in sub._buffers.items():
                    if buf is not None and buf.is_cuda:
                        buffers.setdefault(id(buf), (buf, []))[1].append((sub, name))
        param_tag = WEIGHTS if not keep_parameters else WEIGHTS_KEPT
        with self.region(param_tag, keep_content=keep_parameters):
            for param, view in zip(params, _flat_copies([p.data for p in params])):
                param.data = view
        with self.region(WEIGHTS_KEPT, keep_content=True):
            for (buf, owners), view in zip(buffers.values(), _flat_copies([b for b, _ in buffers.values()])):
                for sub, name in owners:
                    sub._buffers[name] = view
        if params:
            self.weight_tags.add(param_tag)
        if buffers:
            self.weight_tags.add(WEIGHTS_KEPT)
        del buffers
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the tensors they replaced
        return [] if keep_parameters else params


_ALIGN = 256  # bytes: every view starts where a fresh allocation would (vectorized loads, TMA)


def _flat_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of ``tensors`` as views of one new uint8 allocation (made in the caller's region)."""
    if not tensors:
        return []
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // _ALIGN) * _ALIGN
    flat = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
    views = []
    for t, offset, size in zip(tensors, offsets, sizes):
        view = flat[offset:offset + size].view(t.dtype).view(t.shape)
        view.copy_(t)
        views.append(view)
    return views
