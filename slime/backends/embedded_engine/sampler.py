"""Token sampling with exact log-probs of the sampled tokens (SGLang semantics).

For each row with temperature ``T`` (greedy rows use ``T = 1``):

    logprob(token) = log_softmax(logits / T)[token]          over the full vocabulary

evaluated *before* top-k / top-p / min-p truncation (no renormalisation), which is what SGLang
returns in ``output_token_logprobs`` and what an RL trainer recomputes. The token itself is drawn
from the truncated, renormalised distribution; greedy rows take the argmax of the raw logits.

Sampling uses the exponential race (``argmax(p / E)``, ``E ~ Exp(1)``), so a row with a
``sampling_seed`` draws its noise from its own generator and is reproducible whatever batch it
runs in. On the CPU, a step where no row is seeded or truncated draws by inverse transform
instead (one uniform a row against the row's cumulative distribution, :func:`_draw_inverse_cdf`):
the same distribution for 64 uniforms instead of ``rows x vocab`` exponentials, which cost ~0.9 ms
of a 64-row, 591-token step on one core.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from slime.backends.embedded_engine.kernels import sampling_kernel

GREEDY_EPS = 1e-6  # SGLang: temperature below this means greedy
#: CPU: untruncated, unseeded rows sample by inverse transform (:func:`_draw_inverse_cdf`); False
#: keeps the exponential race there too (bench A/B switch)
CPU_INVERSE_CDF = True
#: CUDA: the fast path (:func:`on_fast_path`) as one read of the logits (``kernels/sampling_kernel.py``);
#: SLIME_FUSED_SAMPLING=0 keeps the torch ops (the A/B of bench/engine_decode.py and decode_step.py)
FUSED_ON_CUDA = os.environ.get("SLIME_FUSED_SAMPLING", "1") != "0"


@dataclass
class RowSampling:
    """Per-row sampling settings for one step (already validated)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None  # per-request sampling_seed; combined with the output position
    position: int = 0  # index of the token being sampled in the output (for seeded noise)
    banned_token_ids: tuple[int, ...] = ()  # stop ids suppressed before min_new_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list as a device tensor without a stream sync: ``torch.tensor(values, device=cuda)``
    copies from pageable memory and waits for every kernel queued before it; this copies from pinned
    memory asynchronously (the caching host allocator keeps the buffer until the copy has run)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def sample(logits: torch.Tensor, rows: list[RowSampling], generator: torch.Generator | None = None
           ) -> tuple[list[int], list[float]]:
    """Pick one token per row of ``logits`` ([rows, vocab], fp32); return (token ids, log-probs).

    The common RL case (every row sampled at one temperature, no truncation) costs a handful of
    passes over the logits and no host round trip before the final copy of the results.
    """
    tokens, chosen = sample_on_device(logits, rows, generator)
    return tokens.tolist(), chosen.tolist()


def on_fast_path(rows: list[RowSampling], vocab: int) -> bool:
    """True when :func:`sample_on_device` makes no host round trip for ``rows``: one temperature,
    no truncation, no per-request seed, no banned tokens."""
    first = rows[0]
    return all(r.temperature == first.temperature and not 0 < r.top_k < vocab and r.top_p >= 1.0 and r.min_p <= 0
               and r.seed is None and not r.banned_token_ids for r in rows)


def sample_on_device(logits: torch.Tensor, rows: list[RowSampling], generator: torch.Generator | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample` without the final copy: ``(token ids [rows] int64, log-probs [rows] fp32)`` on the
    logits' device. On CUDA the fast path runs as two Triton kernels (``kernels/sampling_kernel.py``): the same
    distribution and log-probs, drawn with Philox noise instead of torch's exponential noise."""
    if (FUSED_ON_CUDA and logits.is_cuda and sampling_kernel.available(logits)
            and on_fast_path(rows, logits.shape[1])):
        return sampling_kernel.sample(logits, rows[0].temperature, rows[0].greedy, generator)
    logits = logits.float()
    for i, row in enumerate(rows):
        if row.banned_token_ids:
            logits[i, list(row.banned_token_ids)] = float("-inf")
    temperatures = [1.0 if r.greedy else r.temperature for r in rows]
    if all(t == temperatures[0] for t in temperatures):
        scaled = logits if temperatures[0] == 1.0 else logits / temperatures[0]
    else:
        scaled = logits / to_device(temperatures, logits.device).unsqueeze(1)
    logprobs = torch.log_softmax(scaled, dim=-1)
    sampled = [i for i, r in enumerate(rows) if not r.greedy]
    if len(sampled) == len(rows):
        tokens = _draw(logprobs, rows, generator)
    else:
        tokens = logits.argmax(dim=-1)
        if sampled:
            idx = to_device(sampled, logits.device)
            tokens[idx] = _draw(logprobs[idx], [rows[i] for i in sampled], generator)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, chosen


def _draw(logprobs: torch.Tensor, rows: list[RowSampling], generator) -> torch.Tensor:
    """Exponential race ``argmax(p / E)``, evaluated as ``argmax(log p - log E)`` when nothing is truncated;
    on the CPU without seeds or truncation the inverse transform, which draws from the same distribution."""
    truncated = any(0 < r.top_k < logprobs.shape[1] or r.top_p < 1.0 or r.min_p > 0 for r in rows)
    if CPU_INVERSE_CDF and logprobs.device.type == "cpu" and not truncated and all(r.seed is None for r in rows):
        return _draw_inverse_cdf(logprobs, generator)
    noise = _exponential_noise(logprobs.shape, rows, generator, logprobs.device)
    if truncated:
        return (_truncate(logprobs.exp(), rows) / noise).argmax(dim=-1)
    return (logprobs - noise.log_()).argmax(dim=-1)


def _draw_inverse_cdf(logprobs: torch.Tensor, generator) -> torch.Tensor:
    """One id per row of ``logprobs`` ([rows, vocab]) drawn from ``exp(logprobs)``: the first id whose
    cumulative probability exceeds ``u x total``, ``u ~ U[0, 1)``. The sum runs in fp64, so each id's
    share of ``[0, total)`` is its fp32 probability to ~1e-16 (the race compares fp32 ``log p - log E``:
    no less exact); an id of probability 0 (a banned token) is an empty interval and is never drawn."""
    cumulative = logprobs.exp().cumsum(dim=-1, dtype=torch.float64)
    u = torch.rand((logprobs.shape[0], 1), generator=generator, dtype=torch.float64, device=logprobs.device)
    ids = torch.searchsorted(cumulative, u * cumulative[:, -1:], right=True)
    return ids.squeeze(1).clamp_(max=logprobs.shape[1] - 1)


def _truncate(probs: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Zero out tokens outside top-k / top-p / min-p (the relative order is all that matters later)."""
    vocab, device = probs.shape[1], probs.device
    # which truncations apply is decided from the settings on the host (no device round trip), compared
    # in the probabilities' precision as the device would
    if any(0 < r.top_k < vocab or np.float32(r.top_p) < 1.0 for r in rows):
        top_k = to_device([r.top_k if 0 < r.top_k < vocab else vocab for r in rows], device)
        top_p = to_device([r.top_p for r in rows], device, probs.dtype)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=probs.device).unsqueeze(0)
        cumulative_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (ranks >= top_k.unsqueeze(1)) | (cumulative_before > top_p.unsqueeze(1))
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(1, order, sorted_probs)
    if any(np.float32(r.min_p) > 0 for r in rows):
        min_p = to_device([r.min_p for r in rows], device, probs.dtype)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def sampling_distribution(logits: torch.Tensor, rows: list[RowSampling]) -> tuple[torch.Tensor, torch.Tensor]:
    """The two distributions of a sampling step, per row of ``logits`` ([rows, vocab]):

    * ``logprobs``: ``log_softmax(logits / T)`` over the full vocabulary (banned ids at -inf), what
      :func:`sample` returns for the sampled token;
    * ``probs``: the distribution :func:`sample` draws from: top-k / top-p / min-p truncation of
      ``softmax(logits / T)``, renormalised; a greedy row is one-hot at its argmax.

    Speculative verification (``speculative/decoder.py``) accepts draft tokens against ``probs`` so that the
    tokens it emits follow exactly what :func:`sample` would have drawn."""
    logits = _banned(logits, rows)
    temperatures = [1.0 if r.greedy else r.temperature for r in rows]
    if any(t != 1.0 for t in temperatures):  # dividing by 1.0 changes nothing: skip the pass and the copy
        logits_t = logits / to_device(temperatures, logits.device).unsqueeze(1)
    else:
        logits_t = logits
    logprobs = torch.log_softmax(logits_t, dim=-1)
    probs = _truncate(logprobs.exp(), rows)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    greedy = [i for i, row in enumerate(rows) if row.greedy]
    if greedy:
        idx = to_device(greedy, logits.device)
        top = logits[idx].argmax(dim=-1, keepdim=True)
        probs[idx] = torch.zeros((len(greedy), probs.shape[1]), dtype=probs.dtype, device=probs.device).scatter_(1, top, 1.0)
    return logprobs, probs


def greedy_distribution(logits: torch.Tensor, rows: list[RowSampling]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sampling_distribution` of rows that are all greedy, without the one-hot ``probs``:
    ``(logprobs, argmax [rows])``, the same log-probs and the one id each row's ``probs`` holds."""
    logits = _banned(logits, rows)
    return torch.log_softmax(logits, dim=-1), logits.argmax(dim=-1)


def _banned(logits: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """fp32 ``logits`` with each row's banned ids at -inf (a copy only where some row bans ids)."""
    logits = logits.float()
    if any(row.banned_token_ids for row in rows):
        logits = logits.clone()
        for i, row in enumerate(rows):
            if row.banned_token_ids:
                logits[i, list(row.banned_token_ids)] = float("-inf")
    return logits


def kept_token_ids(logits: torch.Tensor, rows: list[RowSampling]) -> list[np.ndarray]:
    """Per row, the ids the sampler could draw from: non-zero probability after top-k / top-p /
    min-p truncation of softmax(logits / T) as int32 arrays, i.e. the set :func:`sample` drew from (the nucleus a
    trainer renormalises over; top-p replay, ``custom_params.return_top_p_token_ids``). Greedy rows
    keep their argmax only. Off the fast path: called only for rows whose request asked for it."""
    return kept_ids_of(sampling_distribution(logits, rows)[1])


def kept_ids_of(probs: torch.Tensor) -> list[np.ndarray]:
    """Row-wise ids with non-zero probability in ``probs`` ([rows, vocab]) as int32 arrays."""
    keep = probs > 0
    ids = torch.nonzero(keep)[:, 1].to(torch.int32).cpu().numpy()  # row-major
    counts = keep.sum(dim=1).cpu().numpy()
    return np.split(ids, np.cumsum(counts)[:-1])


def _exponential_noise(shape, rows: list[RowSampling], generator, device) -> torch.Tensor:
    noise = torch.empty(shape, device=device).exponential_(generator=generator)
    for i, row in enumerate(rows):
        if row.seed is not None:
            noise[i] = seeded_noise(row, shape[1], device)
    return noise.clamp_min_(1e-20)


def seeded_noise(row: RowSampling, size: int, device) -> torch.Tensor:
    """The exponential noise of a seeded row (``sampling_seed``) at its position: its own stream, so the
    draw is the same whatever batch the request runs in."""
    seeded = torch.Generator(device=device).manual_seed(hash((row.seed, row.position)) & 0x7FFFFFFF)
    return torch.empty(size, device=device).exponential_(generator=seeded)


def exact_log_probs(logits: torch.Tensor, rows: list[RowSampling], tokens: list[int] | torch.Tensor
                    ) -> torch.Tensor:
    """``--true-on-policy``: each row's log-prob of its token (``[rows]`` fp32, on the logits' device) by the
    trainer's batch-invariant log-softmax (``batch_invariant.log_softmax`` of ``logits / T``), so it equals the
    trainer's bit for bit. ``logits``: the model's, cast to fp32 from its dtype (as the trainer's head does)."""
    from slime.backends import batch_invariant

    logits = _banned(logits, rows)
    temperatures = to_device([1.0 if r.greedy else r.temperature for r in rows], logits.device).unsqueeze(1)
    logprobs = batch_invariant.log_softmax(logits, temperatures)
    index = torch.as_tensor(tokens, dtype=torch.long).to(logits.device).unsqueeze(1)
    return logprobs.gather(1, index).squeeze(1)


def reference_logprob(logits: torch.Tensor, token: int, temperature: float) -> float:
    """Slow, obvious reference for one position: log_softmax(logits / T)[token] (T=1 when greedy)."""
    t = 1.0 if temperature < GREEDY_EPS else temperature
    return float(torch.log_softmax(logits.double() / t, dim=-1)[token])
