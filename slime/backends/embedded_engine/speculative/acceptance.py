"""Speculative (rejection) sampling of a verify step: which drafts the target accepts, and the token after them.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding"); Chen et al. 2023:
draft ``x_j`` (drawn from the draft distribution ``q_j``) is accepted with probability
``min(1, p_j(x_j) / q_j(x_j))``, in order; at the first rejection the row emits one token from the
residual ``norm(max(p_j - q_j, 0))``, after a full run a bonus token from ``p_{k+1}``. The emitted tokens
then follow the target's ``p`` exactly. :func:`accept_drafts` runs the rule for every row of a verify
step at once on the device and reads the outcome with one device->host copy; :func:`accept_greedy` is
its outcome when every ``p`` is one-hot (greedy rows), without distributions or random draws.
``tests/backends/embedded_engine/speculative/test_speculative.py`` holds the row-by-row reference both are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slime.backends.embedded_engine.sampler import RowSampling, _exponential_noise, kept_ids_of, seeded_noise, to_device

#: seeded requests: the acceptance tests' uniforms come from their own stream (an integer: ``hash`` of a
#: tuple of ints is the same in every process)
ACCEPT_STREAM = 2


def draw(probs: torch.Tensor, rows: list[RowSampling], generator: torch.Generator | None) -> torch.Tensor:
    """One id per row of ``probs`` (exponential race, per-request seeds honoured as in the sampler)."""
    noise = _exponential_noise(probs.shape, rows, generator, probs.device)
    return (probs / noise).argmax(dim=-1)


def _uniforms(rows: list[RowSampling], generator: torch.Generator | None, device) -> torch.Tensor:
    u = torch.rand(len(rows), device=device, generator=generator)
    for i, row in enumerate(rows):
        if row.seed is not None:
            seeded = torch.Generator(device=device).manual_seed(hash((row.seed, row.position, ACCEPT_STREAM)) & 0x7FFFFFFF)
            u[i] = torch.rand(1, device=device, generator=seeded)[0]
    return u


@dataclass
class Verified:
    """One verify step's outcome per row: emitted tokens (accepted drafts + one more), their target
    log-probs, how many drafts were accepted, and the kept sets (top-p replay) where asked."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    accepted: list[int]
    kept: list[list | None]


@dataclass
class _DraftTable:
    """A verify step's drafts as device index tables, rows padded to ``width`` (the most drafts of a row)
    columns; built on the host (the drafts are known there before the forward) and sent in one copy.

    ``tokens`` / ``positions`` [rows, width]: each draft and its flat verify position (padding: token 0 at
    the row's first position); ``flat`` [rows, width]: its index among all drafts row by row (padding:
    0); ``valid`` [rows, width]; ``emit`` [rows, width + 1]: the position of the row's j-th emitted token
    (clamped to the row's last); ``offsets`` / ``counts`` [rows]: the row's first position, its drafts."""

    width: int
    tokens: torch.Tensor
    positions: torch.Tensor
    flat: torch.Tensor
    valid: torch.Tensor
    emit: torch.Tensor
    offsets: torch.Tensor
    counts: torch.Tensor


def _draft_table(offsets: list[int], drafts: list[list[int]], device: torch.device) -> _DraftTable:
    rows, counts = len(drafts), [len(d) for d in drafts]
    width = max(counts, default=0)
    tokens, positions, flat, valid, emit, n = [], [], [], [], [], 0
    for o, d, k in zip(offsets, drafts, counts):
        pad = width - k
        tokens += d + [0] * pad
        positions += list(range(o, o + k)) + [o] * pad
        flat += list(range(n, n + k)) + [0] * pad
        valid += [1] * k + [0] * pad
        emit += list(range(o, o + k + 1)) + [o + k] * pad
        n += k
    packed = to_device(tokens + positions + flat + valid + emit + list(offsets) + counts, device)
    t, p, f, v, e, off, cnt = packed.split([rows * width] * 4 + [rows * (width + 1), rows, rows])
    return _DraftTable(width, t.view(rows, width), p.view(rows, width), f.view(rows, width), v.view(rows, width).bool(),
                       e.view(rows, width + 1), off, cnt)


def _accepted_run(ok: torch.Tensor) -> torch.Tensor:
    """[rows, width] acceptance flags -> [rows]: the length of each row's leading run of accepted drafts."""
    return ok.long().cumprod(dim=1).sum(dim=1)


def _read_back(table: _DraftTable, accepted: torch.Tensor, last: torch.Tensor, logprobs: torch.Tensor
               ) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """Each row's emitted tokens (its accepted drafts, then ``last``), their log-probs and its accepted
    count, in one device->host copy (the step's only sync)."""
    width = table.width
    column = torch.arange(width + 1, device=last.device)
    padded = torch.cat((table.tokens, last.unsqueeze(1)), dim=1)
    emitted = torch.where(column < accepted.unsqueeze(1), padded, last.unsqueeze(1))  # [rows, width + 1]
    emitted_lp = logprobs[table.emit, emitted]
    host = torch.cat((accepted.unsqueeze(1).double(), emitted.double(), emitted_lp.double()), dim=1).tolist()
    tokens, lps, counts = [], [], []
    for row in host:
        a = int(row[0])
        counts.append(a)
        tokens.append([int(t) for t in row[1: a + 2]])
        lps.append(row[width + 2: width + 3 + a])
    return tokens, lps, counts


def _final_noise(shape, settings: list[list[RowSampling]], counts: list[int], accepted: torch.Tensor,
                 generator: torch.Generator | None, device) -> torch.Tensor:
    """The exponential-race noise of each row's last token (:func:`_draw`'s), drawn before the host knows
    where that token is: a seeded row's noise depends on its position, so each of its ``counts[i] + 1``
    candidate positions' noise is drawn and the one at ``accepted[i]`` picked on the device."""
    noise = torch.empty(shape, device=device).exponential_(generator=generator)
    for i, row in enumerate(settings):
        if row[0].seed is not None:
            candidates = torch.stack([seeded_noise(s, shape[1], device) for s in row[: counts[i] + 1]])
            noise[i] = candidates.index_select(0, accepted[i: i + 1])[0]
    return noise.clamp_min_(1e-20)


def accept_drafts(probs: torch.Tensor, logprobs: torch.Tensor, offsets: list[int], drafts: list[list[int]],
                  draft_probs: list[torch.Tensor] | None, settings: list[list[RowSampling]],
                  generator: torch.Generator | None, want_kept: list[bool] | None = None) -> Verified:
    """Speculative (rejection) sampling over flattened verify positions.

    ``probs`` / ``logprobs`` ([positions, vocab]): the target's sampling distribution and full-vocabulary
    log-probs at each verified position; row i's ``len(drafts[i]) + 1`` positions start at
    ``offsets[i]``. ``draft_probs[i]`` ([k_i, vocab]) is the draft distribution ``q`` of row i's drafts
    (None: every draft is a point mass, as n-gram proposals are). ``settings[i][j]``: row i's sampling
    settings at its j-th verified position (noise seeds).

    All rows at once on the device, padded to the most drafts of a row, and one device->host copy at
    the end; the random draws are the row-by-row rule's (``tests/.../test_speculative.py``'s reference),
    in the same order: uniforms for every draft, row by row, then one noise row per row."""
    device, rows = probs.device, len(drafts)
    table = _draft_table(offsets, drafts, device)
    counts = [len(d) for d in drafts]
    accepted = torch.zeros(rows, dtype=torch.long, device=device)
    q = torch.cat(draft_probs) if draft_probs is not None and table.width else None  # row n: q of draft n
    if table.width:
        ratio = probs[table.positions, table.tokens]  # p(x) [rows, width]
        if q is not None:
            ratio = ratio / q[table.flat, table.tokens].clamp_min(1e-30)
        u = _uniforms([settings[i][j] for i, k in enumerate(counts) for j in range(k)], generator, device)
        accepted = _accepted_run((u[table.flat] < ratio) & table.valid)
    # the one token after the accepted run: from the residual at a rejection, from p after a full run
    final = probs[table.offsets + accepted]
    if table.width:
        at = accepted.clamp(max=table.width - 1).unsqueeze(1)  # the rejected draft, where there is one
        if q is None:  # point masses at the rejected drafts
            q_rejected = torch.zeros_like(final).scatter_(1, table.tokens.gather(1, at), 1.0)
        else:
            q_rejected = q[table.flat.gather(1, at).squeeze(1)]
        residual = (final - q_rejected).clamp_min(0.0)
        total = residual.sum(dim=-1, keepdim=True)
        # p == q to rounding (the rejection itself was rounding): keep p
        renormed = torch.where(total > 1e-12, residual / total.clamp_min(1e-30), final)
        final = torch.where((accepted < table.counts).unsqueeze(1), renormed, final)
    last = (final / _final_noise(final.shape, settings, counts, accepted, generator, device)).argmax(dim=-1)
    tokens, out_lp, accepted_host = _read_back(table, accepted, last, logprobs)
    kept: list[list | None] = [None] * rows
    for i, wants in enumerate(want_kept or []):
        if wants:
            kept[i] = kept_ids_of(probs[offsets[i]: offsets[i] + len(tokens[i])])
    return Verified(tokens, out_lp, accepted_host, kept)


def accept_greedy(argmax: torch.Tensor, logprobs: torch.Tensor, offsets: list[int], drafts: list[list[int]],
                  want_kept: list[bool] | None = None) -> Verified:
    """:func:`accept_drafts` when every verified position is greedy (``p`` one-hot at ``argmax``
    [positions]): a draft is accepted iff it is the argmax, whatever ``q`` was, and the row's last token
    is the argmax after its run (the residual of a one-hot ``p`` is ``p``) — the same outcome without
    the distributions or any random draw."""
    table = _draft_table(offsets, drafts, argmax.device)
    accepted = torch.zeros(len(drafts), dtype=torch.long, device=argmax.device)
    if table.width:
        accepted = _accepted_run((argmax[table.positions] == table.tokens) & table.valid)
    last = argmax[table.offsets + accepted]
    tokens, out_lp, accepted_host = _read_back(table, accepted, last, logprobs)
    kept = [[np.array([t], dtype=np.int32) for t in emitted] if wants else None  # one-hot p: the argmax alone
            for emitted, wants in zip(tokens, want_kept or [False] * len(drafts))]
    return Verified(tokens, out_lp, accepted_host, kept)
