"""The KV cache under ``--enable-memory-saver`` (memory_saver.py): a release pauses the cache's region
and keeps the tensors (their addresses, which CUDA graphs captured), a resume maps it back and zeroes it
as a new cache is; a regrown cache gets a region of its own. torch-memory-saver needs CUDA, so here a
recording stand-in takes its place (the GPU test in test_gpu.py runs the real one)."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from slime.backends.embedded_engine.kv_cache import CacheShape, SlotKVCache
from slime.backends.embedded_engine.memory_saver import _flat_copies


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


# ------------------------------------------------------------------ weights released without a host backup
class WeightSaver(RecordingSaver):
    def pause_weights(self):
        self.calls.append(("pause", "weights"))

    def resume_weights(self):
        self.calls.append(("resume", "weights"))


def greedy_answer(engine, prompt, n=6):
    import threading

    from slime.backends.embedded_engine.io_struct import GenerateRequest, SamplingParams

    done = threading.Event()
    request = GenerateRequest(rid=f"g{id(done)}", input_ids=prompt,
                              params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
    seq = engine.call(lambda: engine.add_request(request, lambda s, f: f and done.set())).result(10)
    assert done.wait(60)
    return seq


def test_weights_released_without_backup_refuse_generation_until_every_parameter_is_rewritten(tiny_model_dir,
                                                                                               monkeypatch):
    """No --enable-weights-cpu-backup (SGLang's default): after a resume the parameters hold garbage until the
    push rewrote all of them. The engine answers 409 naming what is missing (nothing silently decodes from
    stale memory), a push that leaves out one projection of a fused q/k/v GEMM is not enough, a full one
    restores HF's greedy output. (The real torch-memory-saver needs CUDA: test_gpu.py runs it.)"""
    from engine_test_utils import hf_greedy, load_hf
    from slime.backends.embedded_engine.engine import Engine
    from slime.backends.embedded_engine.model_runner import ModelRunner

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    runner = ModelRunner(tiny_model_dir, device="cpu", num_slots=2, slot_capacity=64)
    assert runner.fused_projections["qkv"] > 0
    hf = load_hf(tiny_model_dir)
    weights = {name: t.clone() for name, t in hf.state_dict().items()}
    params = list(runner.model.parameters())
    with torch.no_grad():  # as MemorySaver.adopt lays them out: views of one allocation
        for param, view in zip(params, _flat_copies([p.data for p in params])):
            param.data = view
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    runner.saver, runner._dropped_on_release = WeightSaver(), params
    engine = Engine(runner, chunked_prefill_size=64)
    engine.start()
    try:
        prompt = [5, 9, 33, 2]
        assert list(greedy_answer(engine, prompt).output_ids) == hf_greedy(hf, prompt, 6)
        engine.call(runner.release_weights).result(10)
        engine.call(runner.resume_weights).result(10)
        with torch.no_grad():
            for p in runner.model.parameters():
                p.fill_(0.5)  # what unbacked memory may hold after a resume
        refused = greedy_answer(engine, prompt)
        assert refused.finish_reason["status_code"] == 409 and refused.output_ids == []
        assert "--enable-weights-cpu-backup" in refused.finish_reason["message"]
        with pytest.raises(RuntimeError, match="not rewritten since the resume"):
            runner.get_weight("model.norm.weight")
        left_out = "model.layers.1.self_attn.v_proj.weight"
        engine.call(lambda: runner.load_named_tensors((n, t) for n, t in weights.items() if n != left_out)).result(10)
        refused = greedy_answer(engine, prompt)
        assert refused.finish_reason["status_code"] == 409 and "1 parameter(s)" in refused.finish_reason["message"]
        assert "layers.1.self_attn" in refused.finish_reason["message"]
        engine.call(lambda: runner.load_named_tensors([(left_out, weights[left_out])])).result(10)
        assert list(greedy_answer(engine, prompt).output_ids) == hf_greedy(hf, prompt, 6)
        assert runner.saver.calls[-2:] == [("pause", "weights"), ("resume", "weights")]
    finally:
        engine.stop()


def test_flat_copies_keep_values_shapes_and_dtypes_in_one_aligned_allocation():
    """What MemorySaver.adopt rebinds the weights to: one allocation, every view at a multiple of 256 bytes, equal
    contents (fp32, bf16, FP8 e4m3, bool, a 0-dim scalar, an empty tensor, a non-contiguous source)."""
    sources = [torch.randn(3, 5), torch.randn(7, dtype=torch.bfloat16), torch.randn(4, 4).to(torch.float8_e4m3fn),
               torch.tensor([True, False, True]), torch.tensor(2.5), torch.empty(0, 3), torch.randn(6, 4).t()]
    views = _flat_copies(sources)
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    for src, view in zip(sources, views):
        assert view.dtype == src.dtype and view.shape == src.shape and view.is_contiguous()
        if view.numel():  # (an empty tensor reports address 0)
            assert (view.data_ptr() - views[0].data_ptr()) % 256 == 0  # from the allocation's start (CUDA's are aligned)
        assert torch.equal(view.view(torch.uint8) if src.dtype == torch.float8_e4m3fn else view,
                           src.contiguous().view(torch.uint8) if src.dtype == torch.float8_e4m3fn else src)
    starts = sorted((v.data_ptr(), v.numel() * v.element_size()) for v in views if v.numel())
    assert all(a + n <= b for (a, n), (b, _) in zip(starts, starts[1:]))  # no two overlap
