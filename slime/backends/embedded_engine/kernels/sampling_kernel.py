"""One read of the logits per decode step: the sampler's fast path as two Triton kernels, for CUDA.

The fast path of :func:`sampler.sample_on_device` (every row at one temperature ``T``, no
truncation, no per-request seed, no banned ids — the common RL case) computes, per row,

    logprob(token) = x[token] - logsumexp(x),    x = logits / T (T = 1 for greedy rows)
    token          = argmax(x + G),  G_i = -log(-log U_i), U_i ~ U[0, 1)    (argmax(x) when greedy)

The Gumbel-max draw is the exponential race the torch path runs (``argmax(log p - log E)`` with
``E = -log U``; ``log p`` and ``x`` differ by the row's constant ``logsumexp``), so both draw from
``softmax(x)``. In torch that is ~8 passes over a ``[rows, vocab]`` fp32 tensor (scale, log-softmax,
exponential noise, its log, the difference, argmax, gather); these two kernels read the logits once, about a
tenth of the torch ops' time (docs/embedded_engine.md, "Sampling in one read of the logits";
``bench/decode_step.py --sample``). Here:

* :func:`_partial_kernel`, grid ``(rows, splits)``: each program streams one slice of a row once
  and keeps, per lane, the running max and the sum of ``exp(x - max)`` (the online log-sum-exp) and
  the best score with its id; the noise comes from Philox (``tl.rand4x``: one counter per four
  ids) keyed by a seed drawn from the engine's generator on the device (no host sync);
* :func:`_combine_kernel`, grid ``(rows,)``: merges the slices' partial sums and winners (ties go to
  the lowest id, as ``torch.argmax`` does) and reads the winner's logit for its log-prob.

Slices: enough programs to fill the GPU (``rows x splits`` >= 4 per SM) with >= 4 tiles each.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK = 1024  # ids a tile (four sub-tiles of 256, one Philox output each)
MAX_SPLITS = 64


if triton is not None:

    @triton.jit
    def _partial_kernel(logits_ptr, stride_row, vocab, temperature, seed_ptr, chunk,
                        max_ptr, sum_ptr, score_ptr, index_ptr, splits,
                        GREEDY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        split = tl.program_id(1)
        QUARTER: tl.constexpr = BLOCK // 4
        lanes = tl.arange(0, QUARTER)
        seed = tl.load(seed_ptr)
        run_max = tl.full([QUARTER], float("-inf"), tl.float32)
        run_sum = tl.zeros([QUARTER], tl.float32)
        best = tl.full([QUARTER], float("-inf"), tl.float32)
        best_id = tl.full([QUARTER], 2147483647, tl.int32)
        start = split * chunk
        end = tl.minimum(start + chunk, vocab)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        for tile in range(start, end, BLOCK):
            # one Philox counter per lane gives the noise of its four ids (one in each quarter)
            counter = (row * ((vocab + BLOCK - 1) // BLOCK) + tile // BLOCK) * QUARTER + lanes
            if not GREEDY:
                u0, u1, u2, u3 = tl.rand4x(seed, counter)
            for quarter in tl.static_range(4):
                ids = tile + quarter * QUARTER + lanes
                inside = ids < end
                x = tl.load(row_ptr + ids, mask=inside, other=float("-inf")).to(tl.float32) / temperature
                new_max = tl.maximum(run_max, x)
                safe = tl.where(new_max == float("-inf"), 0.0, new_max)  # all -inf so far: nothing summed
                run_sum = run_sum * tl.exp(run_max - safe) + tl.exp(x - safe)
                run_max = new_max
                if GREEDY:
                    score = x
                else:
                    if quarter == 0:
                        u = u0
                    elif quarter == 1:
                        u = u1
                    elif quarter == 2:
                        u = u2
                    else:
                        u = u3
                    score = x - tl.log(-tl.log(u))  # + Gumbel noise; u = 0 gives -inf (never drawn)
                score = tl.where(inside, score, float("-inf"))
                better = score > best  # strict: a lane keeps its first (lowest) id on ties
                best = tl.where(better, score, best)
                best_id = tl.where(better, ids, best_id)
        part_max = tl.max(run_max, axis=0)
        safe_max = tl.where(part_max == float("-inf"), 0.0, part_max)
        part_sum = tl.sum(run_sum * tl.exp(run_max - safe_max), axis=0)
        part_best = tl.max(best, axis=0)
        part_id = tl.min(tl.where(best == part_best, best_id, 2147483647), axis=0)
        out = row * splits + split
        tl.store(max_ptr + out, part_max)
        tl.store(sum_ptr + out, part_sum)
        tl.store(score_ptr + out, part_best)
        tl.store(index_ptr + out, part_id)

    @triton.jit
    def _combine_kernel(logits_ptr, stride_row, temperature, max_ptr, sum_ptr, score_ptr, index_ptr, splits,
                        tokens_ptr, logprobs_ptr, SPLITS: tl.constexpr):
        row = tl.program_id(0)
        parts = tl.arange(0, SPLITS)
        inside = parts < splits
        at = row * splits + parts
        part_max = tl.load(max_ptr + at, mask=inside, other=float("-inf"))
        part_sum = tl.load(sum_ptr + at, mask=inside, other=0.0)
        row_max = tl.max(part_max, axis=0)
        safe = tl.where(row_max == float("-inf"), 0.0, row_max)
        total = tl.sum(tl.where(part_max == float("-inf"), 0.0, part_sum * tl.exp(part_max - safe)), axis=0)
        log_total = safe + tl.log(total)
        score = tl.load(score_ptr + at, mask=inside, other=float("-inf"))
        index = tl.load(index_ptr + at, mask=inside, other=2147483647)
        best = tl.max(score, axis=0)
        token = tl.min(tl.where(score == best, index, 2147483647), axis=0)
        token = tl.where(token == 2147483647, 0, token)  # a row of NaNs: id 0, its log-prob NaN
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + token).to(tl.float32) / temperature
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logprobs_ptr + row, x - log_total)


def available(logits: torch.Tensor) -> bool:
    """Whether :func:`sample` takes ``logits``: Triton importable, a ``[rows, vocab]`` tensor with unit column
    stride. The device is the caller's choice (CUDA in the engine; the CPU under Triton's interpreter in tests)."""
    return triton is not None and logits.dim() == 2 and logits.stride(1) == 1 and logits.shape[1] > 0


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def splits_for(rows: int, vocab: int, device: torch.device) -> int:
    """Slices per row: >= 4 programs per SM over the batch, each slice >= 4 tiles."""
    by_occupancy = -(-4 * _multiprocessors(device) // max(rows, 1))
    by_length = max(1, vocab // (4 * BLOCK))
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def sample(logits: torch.Tensor, temperature: float, greedy: bool, generator: torch.Generator | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token ids [rows] int64, log-probs [rows] fp32)`` of ``logits`` ([rows, vocab], any float dtype,
    unit column stride) at one ``temperature`` (ignored when ``greedy``: argmax, log-probs at T = 1).
    The noise's seed is drawn from ``generator`` on the logits' device, so a seeded engine repeats."""
    rows, vocab = logits.shape
    device = logits.device
    if rows == 0:
        return (torch.empty(0, dtype=torch.int64, device=device), torch.empty(0, dtype=torch.float32, device=device))
    splits = splits_for(rows, vocab, device)
    chunk = -(-vocab // splits)
    chunk = -(-chunk // BLOCK) * BLOCK
    splits = -(-vocab // chunk)
    partial = torch.empty((3, rows, splits), dtype=torch.float32, device=device)  # each slice's max, sum, best score
    index = torch.empty((rows, splits), dtype=torch.int32, device=device)
    if greedy:
        seed = index  # not read
    else:
        seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device, generator=generator)
    t = 1.0 if greedy else float(temperature)
    _partial_kernel[(rows, splits)](logits, logits.stride(0), vocab, t, seed, chunk,
                                    partial[0], partial[1], partial[2], index, splits,
                                    GREEDY=greedy, BLOCK=BLOCK, num_warps=4)
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    _combine_kernel[(rows,)](logits, logits.stride(0), t, partial[0], partial[1], partial[2], index, splits,
                             tokens, logprobs, SPLITS=max(16, triton.next_power_of_2(splits)), num_warps=1)
    return tokens, logprobs
