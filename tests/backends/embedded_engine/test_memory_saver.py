"""The KV cache under ``--enable-memory-saver`` (memory_saver.py): a release pauses the cache's region
and keeps the tensors (their addresses, which CUDA graphs captured), a resume maps it back and zeroes it
as a new cache is; a regrown cache gets a region of its own. torch-memory-saver needs CUDA, so here a
recording stand-in takes its place (the GPU test in test_gpu.py runs the real one)."""

from __future__ import annotations

import contextlib
import itertools

import torch

from slime.backends.embedded_engine.kv_cache import CacheShape, SlotKVCache


class RecordingSaver:
    def __init__(self):
        self.calls, self._tags = [], itertools.count()

    def new_kv_tag(self):
        return f"kv_cache_{next(self._tags)}"

    @contextlib.contextmanager
    def region(self, tag, keep_content):
        self.calls.append(("region", tag, keep_content))
        yield

    def pause(self, tag):
        self.calls.append(("pause", tag))

    def resume(self, tag):
        self.calls.append(("resume", tag))


SHAPE = CacheShape(num_layers=2, num_kv_heads=2, head_dim=4, num_slots=3, slot_capacity=8)


def test_release_pauses_in_place_and_allocate_resumes_a_zeroed_cache():
    saver = RecordingSaver()
    cache = SlotKVCache(SHAPE, torch.float32, torch.device("cpu"), saver=saver)
    assert saver.calls == [("region", "kv_cache_0", False)]  # allocated inside its own region, content not kept
    pointers = [t.data_ptr() for t in cache.keys + cache.values]
    nbytes = cache.nbytes()
    assert nbytes == 2 * 2 * 3 * 2 * 8 * 4 * 4
    for t in cache.keys + cache.values:
        t.fill_(7.0)
    cache.release()
    assert saver.calls[-1] == ("pause", "kv_cache_0")
    assert not cache.allocated and cache.nbytes() == 0
    assert [t.data_ptr() for t in cache.keys + cache.values] == pointers  # the addresses the graphs hold
    cache.release()  # twice: one pause
    assert saver.calls.count(("pause", "kv_cache_0")) == 1
    cache.allocate()
    assert saver.calls[-1] == ("resume", "kv_cache_0")
    assert cache.allocated and cache.nbytes() == nbytes
    assert [t.data_ptr() for t in cache.keys + cache.values] == pointers
    assert all(bool((t == 0).all()) for t in cache.keys + cache.values)  # fresh memory reads as a new cache
    regrown = SlotKVCache(CacheShape(2, 2, 4, 3, 16), torch.float32, torch.device("cpu"), saver=saver)
    assert saver.calls[-1] == ("region", "kv_cache_1", False)
    assert regrown.tag != cache.tag


def test_without_a_saver_release_frees_the_buffers():
    cache = SlotKVCache(SHAPE, torch.float32, torch.device("cpu"))
    cache.release()
    assert cache.keys == [] and cache.nbytes() == 0 and not cache.allocated
    cache.allocate()
    assert cache.allocated and len(cache.keys) == 2
