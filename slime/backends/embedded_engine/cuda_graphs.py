"""CUDA graphs of the engine's decode steps and speculative verify steps (:class:`DecodeGraphs`).

A decode step of a small model is launch-bound: replaying it as one CUDA graph removes the host's
kernel launches. The graphs run :meth:`ModelRunner.decode_forward` on static device buffers in one
memory pool. Where attention is the flash-decoding kernel (``ModelRunner.kernel_attention``, the CUDA
default), which reads each row to its own length, a graph reads the whole slot capacity and there is one
per batch bucket, all captured before serving (:meth:`DecodeGraphs.capture_ahead`, as SGLang captures
its batch sizes at start); otherwise they are captured lazily per (batch bucket, KV-length bucket).
Verify steps have graphs per ``T`` tokens a row too, captured lazily. Without CUDA (or with graphs off)
the same forward runs eagerly at the exact length.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from slime.backends.embedded_engine.kv_cache import SlotKVCache

logger = logging.getLogger(__name__)


class GraphedRunner(Protocol):
    """What the graphs use of the model runner that owns them (``model_runner.ModelRunner``): its device,
    dtype, cache and sizes, its capturable decode forward and the expert dispatch a capture needs."""

    device: torch.device
    dtype: torch.dtype
    model: nn.Module
    kv_cache: "SlotKVCache"
    max_slots: int
    vocab_size: int

    @property
    def kernel_attention(self) -> bool: ...

    def decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_length: int,
                       out: torch.Tensor | None = None, hidden_out: torch.Tensor | None = None) -> torch.Tensor: ...

    def capturable_experts(self) -> contextlib.AbstractContextManager: ...


def _buckets(limit: int, sizes: list[int] | None = None) -> list[int]:
    """Batch sizes a graph is captured for: ``sizes`` up to ``limit`` (``--cuda-graph-bs``), by default 1, 2, 4, 8,
    then every 8 up to ``limit`` (and ``limit``). A batch pads up to the next size; above the largest it runs
    eagerly."""
    if sizes is not None:
        chosen = sorted({b for b in sizes if 1 <= b <= limit})
        if not chosen:
            raise ValueError(f"--cuda-graph-bs {' '.join(map(str, sizes))}: no batch size is within 1..{limit} "
                             "(--max-running-requests / --cuda-graph-max-bs)")
        return chosen
    sizes = [b for b in (1, 2, 4) if b < limit] + list(range(8, limit, 8)) + [limit]
    return sorted(set(sizes))


def kv_length_bucket(need: int, smallest: int = 128) -> int:
    """The KV length a graph reads for rows needing ``need`` positions: from ``smallest`` in four steps
    per octave (128, 160, 192, 224, 256, 320, ...), so at most 25% more than needed."""
    length = smallest
    while length < need:
        octave = 1 << (length.bit_length() - 1)
        length += octave // 4
    return length


class DecodeGraphs:
    """CUDA graphs of the decode forward, per batch bucket (and KV-length bucket where attention is not the
    flash-decoding kernel).

    Inputs live in static device buffers (token ids and positions of every slot); a replay reads
    them, writes the new keys/values into the cache and leaves the logits in the graph's output
    tensor, which the caller consumes before the next replay. All graphs share one memory pool.
    With the flash-decoding kernel a graph's KV length is the slot capacity (the kernel stops at each
    row's own length, read on the device), so one graph per batch bucket serves every length and
    :meth:`capture_ahead` records them all before serving; a cache that grows drops them and records
    them again. Other attention reads a dense ``[B, L]`` window, so there the KV length is bucketed
    from 128 in four steps per octave (128, 160, 192, 224, 256, 320, ..., capped at the slot capacity;
    a step reads at most 25% more keys than it needs) and graphs are captured lazily per (batch
    bucket, KV-length bucket). Without CUDA (or with graphs disabled) the same forward runs eagerly at
    the exact length.

    Speculative verify steps (:meth:`run_verify`: ``T`` tokens a row) have graphs of their own, keyed
    (batch bucket, KV-length bucket, T, with hidden states), captured lazily in the same pool, with
    static ``[slots, T]`` inputs and one ``[slots, T, vocab]`` fp32 logits buffer per ``T``.
    """

    MIN_KV_BUCKET = 128

    def __init__(self, runner: GraphedRunner, enabled: bool, max_batch: int, sizes: list[int] | None = None):
        self.runner = runner
        self.enabled = enabled
        self.batch_buckets = _buckets(max_batch, sizes) if enabled else []
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.ids = self.positions = self.host = self.logits = None
        self.copied: dict[int, torch.cuda.Event] = {}  # per pinned host buffer: its last copy to the device
        self.captures = 0
        self.capture_seconds = 0.0  # wall time of every capture (its warm-up forwards included), device work done
        # verify steps (run_verify): graphs by (batch bucket, KV-length bucket, T, with hidden states), and
        # per T their static inputs [slots, T] (ids, positions, a pinned host copy) and outputs
        self.verify_graphs: dict[tuple[int, int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor,
                                                                   torch.Tensor | None]] = {}
        self.verify_buffers: dict[int, dict[str, torch.Tensor]] = {}
        self.verify_captures = 0

    def clear(self) -> None:
        self.graphs.clear()
        self.verify_graphs.clear()
        self.pool = None
        self.logits = None
        for buffers in self.verify_buffers.values():  # the outputs: reallocated with the next capture
            buffers.pop("logits", None)
            buffers.pop("hidden", None)

    def _bucket(self, batch: int, need: int) -> tuple[int, int] | None:
        if not self.enabled or batch > self.batch_buckets[-1] or batch > self.runner.kv_cache.shape.num_slots:
            return None
        capacity = self.runner.kv_cache.shape.slot_capacity
        # the flash-decoding kernel reads each row to its own length: one graph over the whole slot serves all
        length = capacity if self.runner.kernel_attention else min(kv_length_bucket(need, self.MIN_KV_BUCKET), capacity)
        slots = self.runner.kv_cache.shape.num_slots  # padding rows use free slots: never more than there are
        return min(next(b for b in self.batch_buckets if b >= batch), slots), length

    def capture_ahead(self) -> None:
        """Record the decode graph of every batch bucket now, before serving, where graphs do not depend on
        the rows' lengths (``ModelRunner.kernel_attention``): a rollout then never waits on a capture, which
        costs two eager forwards and the recording (an engine start of Qwen3-4B took ~3 s longer for its 18 graphs
        in bf16, up to ~12-16 s under FP8; docs/embedded_engine.md). Called at start and after the cache
        grows; needs no running request (the captures write keys and values at position 0 of the slots
        they pad into). Elsewhere graphs stay lazy (one per batch and KV-length bucket would be too many)."""
        if not self.enabled or not self.runner.kernel_attention or not self.runner.kv_cache.allocated:
            return
        started, before = time.perf_counter(), self.captures
        for batch in self.batch_buckets:
            key = self._bucket(batch, 1)
            if key is not None and key not in self.graphs:
                self._fill([0] * key[0], [0] * key[0], key[0])
                self.graphs[key] = self._capture(*key)
        if self.captures > before:
            logger.info("captured %d decode CUDA graphs (batch sizes %s, KV length %d) in %.1f s", self.captures - before,
                        sorted({b for b, _ in self.graphs}), self.runner.kv_cache.shape.slot_capacity,
                        time.perf_counter() - started)

    def run(self, tokens: list[int] | torch.Tensor, positions: list[int]) -> torch.Tensor:
        """A decode step: row i feeds ``tokens[i]`` (a host list, or ids already on the device: a draft
        model's chained drafts) at ``positions[i]``."""
        runner = self.runner
        batch = len(tokens)
        key = self._bucket(batch, max(positions) + 1)
        if key is None:
            if isinstance(tokens, torch.Tensor):
                ids = tokens.view(-1, 1).to(runner.device)
            else:
                ids = torch.tensor(tokens, dtype=torch.long).view(-1, 1).to(runner.device)
            pos = torch.tensor(positions, dtype=torch.long).view(-1, 1).to(runner.device)
            return runner.decode_forward(ids, pos, max(positions) + 1)
        padded, length = key
        self._fill(tokens, positions, padded)
        if key not in self.graphs:
            self.graphs[key] = self._capture(padded, length)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits[:batch]

    def can_run(self, batch: int, positions: list[int]) -> bool:
        """Whether a step of this batch goes through a graph (else :meth:`run` runs it eagerly)."""
        return self._bucket(batch, max(positions) + 1) is not None

    def run_next(self, tokens: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """The step after a graph step of the *same* rows, without a host round trip: token ids are
        the previous step's samples (``tokens``, on the device) and every row's position advances by
        one on the device (``positions`` is the host's copy, used only to pick the KV bucket)."""
        batch = int(tokens.shape[0])
        padded, length = key = self._bucket(batch, max(positions) + 1)
        self.ids[:batch, 0].copy_(tokens)
        self.positions[:batch, 0].add_(1)
        if key not in self.graphs:
            self.graphs[key] = self._capture(padded, length)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits[:batch]

    def _fill(self, tokens: list[int] | torch.Tensor, positions: list[int], padded: int) -> None:
        """Copy this step's inputs into the static buffers (padding rows: token 0 at position 0); device
        ``tokens`` are copied device to device after the host buffer's copy."""
        if self.ids is None:
            slots = self.runner.max_slots
            self.ids = torch.zeros((slots, 1), dtype=torch.long, device=self.runner.device)
            self.positions = torch.zeros((slots, 1), dtype=torch.long, device=self.runner.device)
            self.host = torch.zeros((2, slots), dtype=torch.long, pin_memory=self.runner.device.type == "cuda")
        batch = len(tokens)
        self._reusable(self.host)
        self.host[:, :padded] = 0
        on_device = isinstance(tokens, torch.Tensor)
        if not on_device:
            self.host[0, :batch] = torch.tensor(tokens, dtype=torch.long)
        self.host[1, :batch] = torch.tensor(positions, dtype=torch.long)
        self.ids[:padded, 0].copy_(self.host[0, :padded], non_blocking=True)
        self.positions[:padded, 0].copy_(self.host[1, :padded], non_blocking=True)
        self._copied(self.host)
        if on_device:
            self.ids[:batch, 0].copy_(tokens)

    def _reusable(self, host: torch.Tensor) -> None:
        """Wait until the device has read ``host``'s previous contents. Its copies are asynchronous
        (pinned memory), so a caller that does not read a step's results before feeding the next one
        would otherwise overwrite inputs the device has not copied yet — the engine reads each step,
        so this wait returns at once there; a caller that feeds steps without reading (a forced-token
        scorer) waits here instead of replaying a step with the next step's tokens and positions."""
        event = self.copied.get(host.data_ptr())
        if event is not None:
            event.synchronize()

    def _copied(self, host: torch.Tensor) -> None:
        if host.is_pinned():
            event = self.copied.get(host.data_ptr())
            if event is None:
                event = self.copied[host.data_ptr()] = torch.cuda.Event()
            event.record()

    def _capture(self, padded: int, length: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        runner = self.runner
        ids, pos = self.ids[:padded], self.positions[:padded]
        if self.logits is None:  # one output buffer for every graph: graphs keep no live memory of their own
            self.logits = torch.empty((len(self.ids), runner.vocab_size), dtype=torch.float32, device=runner.device)
        with runner.capturable_experts(), runner.linear_state_kept(padded):
            graph = self._record(lambda: runner.decode_forward(ids, pos, length, out=self.logits[:padded]))
        self.captures += 1
        logger.info("captured a decode CUDA graph for batch %d, KV length %d", padded, length)
        return graph, self.logits[:padded]

    def _record(self, forward):
        """A CUDA graph of ``forward()`` in the graphs' pool. Warm-up on a side stream first (lazy
        initialisations must not land in the graph); it writes the same keys/values the replay will
        write, so running it on the real inputs is harmless."""
        device = self.runner.device
        started = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            forward()
        # captures happen inside serving steps (a new batch or KV-length bucket): their cost is counted apart so
        # benchmarks can tell a slow step from a step that captured
        torch.cuda.synchronize(device)
        self.capture_seconds += time.perf_counter() - started
        return graph

    # ------------------------------------------------------------------ verify steps: T tokens a row
    def run_verify(self, tokens: list[list[int]], starts: list[int], with_hidden: bool
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A verify step (:meth:`ModelRunner.verify`): rows ``0..B-1`` each feed their ``T`` tokens from
        ``starts[i]``. Through a graph captured for (batch bucket, KV-length bucket, T) when graphs are
        on, else eagerly at the exact length. Padding rows of a bucket feed token 0 at positions
        ``0..T-1`` of the free slots after B (the caller checked that every row's T positions fit its slot)."""
        runner = self.runner
        batch, width = len(tokens), len(tokens[0])
        need = max(starts) + width
        key = self._bucket(batch, need)
        hidden_size = runner.model.get_decoder().norm.weight.shape[-1]
        if key is None:
            ids = torch.tensor(tokens, dtype=torch.long).to(runner.device)
            pos = (torch.tensor(starts, dtype=torch.long).view(-1, 1) + torch.arange(width)).to(runner.device)
            hidden = (torch.empty((batch, width, hidden_size), dtype=runner.dtype, device=runner.device)
                      if with_hidden else None)
            return runner.decode_forward(ids, pos, need, hidden_out=hidden), hidden
        padded, length = key
        buffers = self._fill_verify(tokens, starts, padded, width)
        graph_key = (padded, length, width, with_hidden)
        if graph_key not in self.verify_graphs:
            self.verify_graphs[graph_key] = self._capture_verify(padded, length, width, with_hidden, hidden_size)
        graph, logits, hidden = self.verify_graphs[graph_key]
        graph.replay()
        return logits[:batch], (hidden[:batch] if hidden is not None else None)

    def _fill_verify(self, tokens: list[list[int]], starts: list[int], padded: int, width: int) -> dict:
        buffers = self.verify_buffers.get(width)
        if buffers is None:
            slots, device = self.runner.max_slots, self.runner.device
            buffers = self.verify_buffers[width] = {
                "ids": torch.zeros((slots, width), dtype=torch.long, device=device),
                "positions": torch.zeros((slots, width), dtype=torch.long, device=device),
                "host": torch.zeros((2, slots, width), dtype=torch.long, pin_memory=device.type == "cuda")}
        host, batch = buffers["host"], len(tokens)
        self._reusable(host)
        host[0, :padded] = 0
        host[1, :padded] = torch.arange(width)  # padding rows: positions 0..T-1 of their free slots
        host[0, :batch] = torch.tensor(tokens, dtype=torch.long)
        host[1, :batch] += torch.tensor(starts, dtype=torch.long).view(-1, 1)
        buffers["ids"][:padded].copy_(host[0, :padded], non_blocking=True)
        buffers["positions"][:padded].copy_(host[1, :padded], non_blocking=True)
        self._copied(host)
        return buffers

    def _capture_verify(self, padded: int, length: int, width: int, with_hidden: bool, hidden_size: int):
        runner = self.runner
        buffers = self.verify_buffers[width]
        ids, pos = buffers["ids"][:padded], buffers["positions"][:padded]
        slots = len(buffers["ids"])
        if "logits" not in buffers:  # one output buffer per T for every graph of that T
            buffers["logits"] = torch.empty((slots, width, runner.vocab_size), dtype=torch.float32,
                                            device=runner.device)
        if with_hidden and "hidden" not in buffers:
            buffers["hidden"] = torch.empty((slots, width, hidden_size), dtype=runner.dtype, device=runner.device)
        hidden = buffers["hidden"][:padded] if with_hidden else None
        with runner.capturable_experts(), runner.linear_state_kept(padded):
            graph = self._record(lambda: runner.decode_forward(ids, pos, length, out=buffers["logits"][:padded],
                                                               hidden_out=hidden))
        self.captures += 1
        self.verify_captures += 1
        logger.info("captured a verify CUDA graph for batch %d x %d tokens, KV length %d", padded, width, length)
        return graph, buffers["logits"][:padded], hidden
