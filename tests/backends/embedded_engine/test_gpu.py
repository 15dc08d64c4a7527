"""GPU tests of the embedded engine (``--device cuda``) on the tiny model; skipped without CUDA.

Reference: the same checkpoint in HF on the same GPU, teacher-forced on the engine's output. A
greedy token passes if HF's logit for it is within ``tol`` of HF's maximum at that position (so a
genuine near-tie may break either way, anything else must be the argmax), and a reported log-prob
passes if it is within ``tol`` of HF's ``log_softmax``. fp32 engines use ``tol`` 1e-3 (differences
are ~1e-6; the tiny model's median top-2 logit gap is ~0.09); the bf16 engine (the CUDA default)
uses 0.03 (bf16 vs fp32 logits of this model differ by up to ~0.01).

The NCCL weight-update test needs two GPUs (NCCL refuses two ranks on one device): the engine runs
on the second visible GPU, the test process joins as rank 0 on the first.

No pytest plugin is needed (no timeout/asyncio marks); every wait has its own timeout.
"""

from __future__ import annotations

import concurrent.futures
import os
from datetime import timedelta

import httpx
import pytest
import torch

from engine_test_utils import copy_with_weights, perturbed_state_dict, start_cuda_engine
from slime.backends.embedded_engine.serving.launch import find_free_port
from slime.backends.update_weight.wire_format import flatten_tensors, init_custom_process_group

# NVLink multicast off (not needed; some drivers refuse it), also in the engine processes we start.
for _var, _val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_var, _val)

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [100, 200, 300, 400, 500], [42]]
FP32_TOL, BF16_TOL = 1e-3, 0.03
CONTEXT = 2048
# fp32 KV of the tiny model is 2 KiB/token: 512 slots x 2048 tokens = 2 GiB once a long request has
# grown the slots to the context (they start at 512 tokens), plainly visible in mem_get_info.
BIG_CACHE = ["--context-length", str(CONTEXT), "--max-running-requests", "512"]


@pytest.fixture(scope="module")
def fp32_engine(tiny_model_dir):
    proc = start_cuda_engine(tiny_model_dir, "--dtype", "float32", *BIG_CACHE)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def bf16_engine(tiny_model_dir):
    proc = start_cuda_engine(tiny_model_dir, "--context-length", "512", "--max-running-requests", "16")  # --dtype auto
    yield proc
    proc.stop()


def hf_cuda(model_dir, dtype, state_dict=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    if state_dict is not None:
        model.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()})
    return model.to("cuda").eval()


def generate(url, prompts, n, temperature=0.0):
    body = {"input_ids": prompts, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "temperature": temperature, "ignore_eos": True}}
    response = httpx.post(url + "/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@torch.no_grad()
def check_against_hf(model, prompt, out, temperature, tol):
    """Teacher-force HF on prompt + engine output; check tokens (greedy) and log-probs."""
    ids = out["output_ids"]
    logits = model(torch.tensor([prompt + ids], device="cuda")).logits[0].double()
    rows = logits[len(prompt) - 1: len(prompt) - 1 + len(ids)]
    token_logits = rows[torch.arange(len(ids)), torch.tensor(ids, device="cuda")]
    if temperature == 0.0:
        gap = (rows.max(dim=-1).values - token_logits).tolist()
        assert max(gap) <= tol, f"greedy token is not HF's argmax (logit gaps {gap}) for prompt {prompt}"
    t = 1.0 if temperature == 0.0 else temperature
    expected = torch.log_softmax(rows / t, dim=-1)[torch.arange(len(ids)), torch.tensor(ids, device="cuda")].tolist()
    got = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(expected, abs=tol), f"log-probs differ from HF for prompt {prompt}"


def memory_usage(url) -> dict:
    return httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]["memory_usage"]


@pytest.mark.gpu
def test_fp32_greedy_matches_hf(fp32_engine, tiny_model_dir):
    from engine_test_utils import hf_greedy

    model = hf_cuda(tiny_model_dir, torch.float32)
    outs = generate(fp32_engine.url, PROMPTS, 24)
    exact = 0
    for prompt, out in zip(PROMPTS, outs):
        assert len(out["output_ids"]) == 24
        check_against_hf(model, prompt, out, 0.0, FP32_TOL)
        reference = hf_greedy(model.cpu(), prompt, 24)  # HF generate, fp32, on CPU: the CPU tests' reference
        model.cuda()
        exact += out["output_ids"] == reference
    assert exact >= len(PROMPTS) - 1, "fp32 greedy differs from HF generate on more than one prompt"


@pytest.mark.gpu
def test_cuda_graph_decode_with_many_rows_and_lengths_matches_hf(fp32_engine, tiny_model_dir):
    """Decode runs through CUDA graphs (one per batch bucket, captured at start; padding rows in free
    slots): 19 concurrent requests of different prompt lengths, 150 tokens each (rows from 2 to 240
    positions, the batch shrinking as they finish), every token and log-prob checked against HF, and
    no graph captured while they ran (the flash-decoding kernel reads each row to its own length)."""
    model = hf_cuda(tiny_model_dir, torch.float32)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 500, (int(n),), generator=gen).tolist() for n in torch.randint(1, 90, (19,), generator=gen)]
    before = httpx.get(fp32_engine.url + "/get_server_info", timeout=30).json()["internal_states"][0]
    outs = generate(fp32_engine.url, prompts, 150)
    for prompt, out in zip(prompts, outs):
        assert len(out["output_ids"]) == 150
        check_against_hf(model, prompt, out, 0.0, FP32_TOL)
    info = httpx.get(fp32_engine.url + "/get_server_info", timeout=30).json()["internal_states"][0]
    assert info["attention_backend"] == "triton", info  # decode through the flash-decoding kernel
    assert before["cuda_graph_captures"] >= 5, before  # batch buckets 1, 2, 4, 8, 16 (at least), before any request
    assert info["cuda_graph_captures"] == before["cuda_graph_captures"], "a graph was captured while serving"


@pytest.mark.gpu
def test_rows_stopping_while_the_next_step_runs_ahead(fp32_engine, tiny_model_dir):
    """On CUDA the engine launches decode step k+1 before it reads step k. Rows that step k ends with a
    stop token (at different steps, so the batch is compacted while a step is in flight) must end
    exactly there, and the other rows must be unaffected: every output is HF's greedy continuation
    (tokens and log-probs) and ends at its first stop token."""
    model = hf_cuda(tiny_model_dir, torch.float32)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, 500, (int(n),), generator=gen).tolist() for n in torch.randint(1, 60, (12,), generator=gen)]

    def run(stops):
        bodies = [{"input_ids": p, "return_logprob": True,
                   "sampling_params": {"max_new_tokens": 80, "temperature": 0.0, "stop_token_ids": stop}}
                  for p, stop in zip(prompts, stops)]
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            return list(pool.map(lambda b: httpx.post(fp32_engine.url + "/generate", json=b, timeout=120).json(),
                                 bodies))

    full = [out["output_ids"] for out in run([[]] * len(prompts))]
    # per prompt, a stop id taken from the middle of its greedy output (a different step for each row)
    stops = [ids[min(10 + 5 * i, len(ids) - 1)] for i, ids in enumerate(full)]
    outs = run([[stop] for stop in stops])
    for prompt, stop, out in zip(prompts, stops, outs):
        ids = out["output_ids"]
        assert ids[-1] == stop and stop not in ids[:-1], (stop, ids)
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        check_against_hf(model, prompt, out, 0.0, FP32_TOL)
    assert sorted(len(out["output_ids"]) for out in outs)[0] < sorted(len(out["output_ids"]) for out in outs)[-1]


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_sampled_logprobs_match_hf_forward(fp32_engine, tiny_model_dir, temperature):
    model = hf_cuda(tiny_model_dir, torch.float32)
    outs = generate(fp32_engine.url, PROMPTS, 16, temperature)
    for prompt, out in zip(PROMPTS, outs):
        check_against_hf(model, prompt, out, temperature, FP32_TOL)


@pytest.mark.gpu
def test_bf16_is_the_cuda_default_and_matches_hf_bf16(bf16_engine, tiny_model_dir):
    model = hf_cuda(tiny_model_dir, torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    assert memory_usage(bf16_engine.url)["weight"] * 2**30 == pytest.approx(2 * n_params), "weights are not bf16"
    for temperature in (0.0, 1.0):
        outs = generate(bf16_engine.url, PROMPTS, 16, temperature)
        for prompt, out in zip(PROMPTS, outs):
            check_against_hf(model, prompt, out, temperature, BF16_TOL)


@pytest.mark.gpu
def test_release_and_resume_memory_occupation(fp32_engine):
    url = fp32_engine.url
    small = memory_usage(url)["kvcache"] * 2**30
    generate(url, [[1 + i % 400 for i in range(2030)]], 8)  # a 2038-token request: slots grow from 512 to 2048 tokens
    kv_bytes = memory_usage(url)["kvcache"] * 2**30
    assert kv_bytes >= 2**30 and kv_bytes >= 3.9 * small, "the grown cache should be ~2 GiB"
    before_out = generate(url, PROMPTS[:2], 12)
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    assert httpx.post(url + "/release_memory_occupation", json={}, timeout=120).json() is None
    free_released, _ = torch.cuda.mem_get_info()
    assert free_released - free_before >= 0.95 * kv_bytes, (free_before, free_released, kv_bytes)
    assert memory_usage(url)["kvcache"] == 0
    assert httpx.post(url + "/resume_memory_occupation", json={}, timeout=120).json() is None
    free_resumed, _ = torch.cuda.mem_get_info()
    assert free_released - free_resumed >= 0.95 * kv_bytes, (free_released, free_resumed, kv_bytes)
    assert memory_usage(url)["kvcache"] * 2**30 == kv_bytes
    after_out = generate(url, PROMPTS[:2], 12)  # weights came back intact, cache works
    assert [o["output_ids"] for o in after_out] == [o["output_ids"] for o in before_out]


@pytest.fixture(scope="module")
def saver_engine(tiny_model_dir):
    pytest.importorskip("torch_memory_saver")
    proc = start_cuda_engine(tiny_model_dir, "--dtype", "float32", "--enable-memory-saver", "--enable-weights-cpu-backup",
                             *BIG_CACHE)
    yield proc
    proc.stop()


@pytest.mark.gpu
def test_memory_saver_frees_weights_and_cache_and_keeps_the_graphs(saver_engine, tiny_model_dir, tmp_path):
    """--enable-memory-saver --enable-weights-cpu-backup: a release frees the weights' and the cache's device
    memory (seen by this process), a resume brings both back at the same addresses: the decode graphs replay (no
    capture after the resume), the weights are intact (same greedy output, HF's argmax), and an update after the
    resume lands."""
    url = saver_engine.url
    generate(url, [[1 + i % 400 for i in range(2030)]], 8)  # slots grow to 2048 tokens: ~2 GiB of KV
    usage = memory_usage(url)
    kv_bytes, weight_bytes = usage["kvcache"] * 2**30, usage["weight"] * 2**30
    before_out = generate(url, PROMPTS, 12)
    captures = httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]["cuda_graph_captures"]
    assert captures >= 1
    for round_ in range(2):
        torch.cuda.synchronize()
        free_before, _ = torch.cuda.mem_get_info()
        assert httpx.post(url + "/release_memory_occupation", json={}, timeout=120).json() is None
        free_released, _ = torch.cuda.mem_get_info()
        assert free_released - free_before >= 0.95 * (kv_bytes + weight_bytes), (round_, free_before, free_released)
        refused = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(tiny_model_dir)}, timeout=120)
        assert refused.status_code == 400 and "released" in refused.text, refused.text
        assert httpx.post(url + "/resume_memory_occupation", json={}, timeout=120).json() is None
        after_out = generate(url, PROMPTS, 12)
        assert [o["output_ids"] for o in after_out] == [o["output_ids"] for o in before_out], round_
        info = httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]
        assert info["cuda_graph_captures"] == captures, "a resume in place keeps the captured graphs"
    model = hf_cuda(tiny_model_dir, torch.float32)
    for prompt, out in zip(PROMPTS, after_out):
        check_against_hf(model, prompt, out, 0.0, FP32_TOL)
    # weights resumed in place take updates: a perturbed checkpoint moves the output as it moves HF's
    state = perturbed_state_dict(tiny_model_dir)
    moved_dir = copy_with_weights(tiny_model_dir, tmp_path / "perturbed", state)
    loaded = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(moved_dir)}, timeout=120)
    assert loaded.status_code == 200 and loaded.json()["success"], loaded.text
    moved = generate(url, PROMPTS, 12)
    assert [o["output_ids"] for o in moved] != [o["output_ids"] for o in after_out]
    model = hf_cuda(moved_dir, torch.float32)
    for prompt, out in zip(PROMPTS, moved):
        check_against_hf(model, prompt, out, 0.0, FP32_TOL)


@pytest.mark.gpu
def test_memory_saver_without_weight_backup_needs_the_push_and_keeps_the_graphs(tiny_model_dir, tmp_path):
    """SGLang's default (no --enable-weights-cpu-backup): a release frees the weights and the cache, a resume
    maps fresh memory; generation is refused (409) until every parameter was rewritten, then a full update
    decodes HF's output of the new weights with the graphs captured before the release."""
    pytest.importorskip("torch_memory_saver")
    proc = start_cuda_engine(tiny_model_dir, "--dtype", "float32", "--enable-memory-saver", *BIG_CACHE)
    try:
        url = proc.url
        generate(url, [[1 + i % 400 for i in range(2030)]], 8)
        usage = memory_usage(url)
        kv_bytes, weight_bytes = usage["kvcache"] * 2**30, usage["weight"] * 2**30
        generate(url, PROMPTS, 12)
        captures = httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]["cuda_graph_captures"]
        moved_dir = copy_with_weights(tiny_model_dir, tmp_path / "perturbed", perturbed_state_dict(tiny_model_dir))
        for round_ in range(2):
            torch.cuda.synchronize()
            free_before, _ = torch.cuda.mem_get_info()
            assert httpx.post(url + "/release_memory_occupation", json={}, timeout=120).json() is None
            free_released, _ = torch.cuda.mem_get_info()
            assert free_released - free_before >= 0.95 * (kv_bytes + weight_bytes), (round_, free_before, free_released)
            assert httpx.post(url + "/resume_memory_occupation", json={}, timeout=120).json() is None
            refused = httpx.post(url + "/generate", json={"input_ids": PROMPTS[0], "sampling_params": {
                "max_new_tokens": 4, "temperature": 0}}, timeout=120)
            assert refused.status_code == 409 and "--enable-weights-cpu-backup" in refused.text, refused.text
            source = moved_dir if round_ == 0 else tiny_model_dir
            loaded = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(source)}, timeout=120)
            assert loaded.status_code == 200 and loaded.json()["success"], loaded.text
            outs = generate(url, PROMPTS, 12)
            model = hf_cuda(source, torch.float32)
            for prompt, out in zip(PROMPTS, outs):
                check_against_hf(model, prompt, out, 0.0, FP32_TOL)
        info = httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]
        assert info["cuda_graph_captures"] == captures, "a resume in place keeps the captured graphs"
    finally:
        proc.stop()


def _second_gpu() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[1].strip() if visible else "1"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="NCCL needs the engine and the trainer on two different GPUs")
@pytest.mark.parametrize("flattened", [False, True])
def test_update_weights_from_distributed_nccl(tiny_model_dir, flattened):
    import torch.distributed as dist

    torch.cuda.set_device(0)
    engine = start_cuda_engine(tiny_model_dir, "--dtype", "float32", "--context-length", "512",
                          "--max-running-requests", "16", env={"CUDA_VISIBLE_DEVICES": _second_gpu()})
    group = None
    try:
        old_outs = generate(engine.url, PROMPTS, 16)
        state = {k: v.to("cuda").contiguous() for k, v in perturbed_state_dict(tiny_model_dir).items()}
        port, group_name = find_free_port(), f"gpu-test-{flattened}"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            init = pool.submit(httpx.post, engine.url + "/init_weights_update_group", json={
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "group_name": group_name, "backend": "nccl"}, timeout=180)
            group = init_custom_process_group("nccl", f"tcp://127.0.0.1:{port}", 2, 0, group_name,
                                              timeout=timedelta(seconds=120))
            assert init.result(timeout=180).json()["success"]
            names = list(state)
            body = {"names": names, "dtypes": [str(state[n].dtype).replace("torch.", "") for n in names],
                    "shapes": [list(state[n].shape) for n in names], "group_name": group_name,
                    "weight_version": f"nccl-{flattened}", "load_format": "flattened_bucket" if flattened else None}
            update = pool.submit(httpx.post, engine.url + "/update_weights_from_distributed", json=body, timeout=180)
            if flattened:
                dist.broadcast(flatten_tensors([(n, state[n]) for n in names])["flattened_tensor"], src=0, group=group)
            else:
                for n in names:
                    dist.broadcast(state[n], src=0, group=group)
            torch.cuda.synchronize()
            response = update.result(timeout=180)
            assert response.json()["success"], response.text
        new_outs = generate(engine.url, PROMPTS, 16)
        assert [o["output_ids"] for o in new_outs] != [o["output_ids"] for o in old_outs], "outputs did not change"
        assert all(o["meta_info"]["weight_version"] == f"nccl-{flattened}" for o in new_outs)
        new_model = hf_cuda(tiny_model_dir, torch.float32, {k: v.cpu() for k, v in state.items()})
        for prompt, out in zip(PROMPTS, new_outs):
            check_against_hf(new_model, prompt, out, 0.0, FP32_TOL)
        # NCCL's communicator destroy waits for the peer: both sides at once.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            destroyed = pool.submit(httpx.post, engine.url + "/destroy_weights_update_group",
                                    json={"group_name": group_name}, timeout=60)
            dist.destroy_process_group(group)
            group = None
            assert destroyed.result(timeout=90).json()["success"]
    finally:
        if group is not None:
            dist.destroy_process_group(group)
        engine.stop()


@pytest.mark.gpu
def test_graph_decode_steps_fed_without_reading_equal_steps_read_one_by_one(tiny_model_dir):
    """ModelRunner.decode fills a graph's inputs from a pinned host buffer with asynchronous copies: a
    caller that feeds step after step without reading the logits (scoring forced tokens) must get the
    same logits as one that reads each step — the host may not overwrite inputs the device has not
    copied yet (it did: a forced-token run of the FP8-KV engine test differed from the bf16 cache by
    1.36 nats, from a step replayed with the next step's tokens and positions)."""
    from slime.backends.embedded_engine.model_runner import ForwardRow, ModelRunner

    prompt = list(range(3, 19))
    forced = torch.randint(5, 200, (48,), generator=torch.Generator().manual_seed(0)).tolist()

    def run(read_each: bool) -> torch.Tensor:
        runner = ModelRunner(tiny_model_dir, device="cuda", dtype="float32", num_slots=4)
        runner.forward([0], [ForwardRow(prompt, 0)])
        torch.cuda.synchronize()
        steps = []
        for i, token in enumerate(forced):
            logits = runner.decode([token], [len(prompt) + i]).clone()  # clone: queued on the device, no sync
            steps.append(logits.cpu() if read_each else logits)
            if not read_each:  # keep the device busy so the host runs ahead of it
                torch.cuda._sleep(2_000_000)  # ~1 ms of device time a step
        return torch.stack([s.cpu() for s in steps])

    read, unread = run(True), run(False)
    assert torch.equal(read, unread), float((read - unread).abs().max())
