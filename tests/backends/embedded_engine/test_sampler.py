"""The sampler's draws: the CPU's inverse-transform path and the exponential race draw from the same
distribution, softmax(logits / T) with banned ids at zero (chi-square against the exact probabilities)."""

from collections import Counter

import pytest
import torch

from slime.backends.embedded_engine import sampler
from slime.backends.embedded_engine.sampler import RowSampling, reference_logprob, sample

CHI2_LIMIT_7 = 29.9  # chi-square quantile at p = 1e-4, 7 degrees of freedom


def chi2(counts: Counter, probs: torch.Tensor, n: int) -> float:
    return sum((counts.get(v, 0) - n * float(p)) ** 2 / (n * float(p)) for v, p in enumerate(probs) if p > 0)


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.25, -0.5])
BANNED = 6


@pytest.mark.parametrize("inverse_cdf", [True, False], ids=["inverse-cdf", "race"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_draws_follow_the_tempered_softmax(monkeypatch, inverse_cdf, temperature):
    monkeypatch.setattr(sampler, "CPU_INVERSE_CDF", inverse_cdf)
    n = 40000
    rows = [RowSampling(temperature=temperature, banned_token_ids=(BANNED,))] * n
    gen = torch.Generator().manual_seed(0)
    tokens, logprobs = sample(LOGITS.repeat(n, 1), rows, gen)
    banned = LOGITS.clone()
    banned[BANNED] = float("-inf")
    probs = torch.softmax(banned.double() / temperature, dim=-1)
    counts = Counter(tokens)
    assert BANNED not in counts
    assert chi2(counts, probs, n) < CHI2_LIMIT_7
    for token, logprob in list(zip(tokens, logprobs))[:50]:  # the log-prob of the drawn id, over the full vocabulary
        assert logprob == pytest.approx(float(probs[token].log()), abs=1e-5)


def test_inverse_cdf_sees_a_wrong_distribution():
    """The chi-square test above has the power to reject: draws from other logits fail it."""
    n = 40000
    gen = torch.Generator().manual_seed(0)
    tokens, _ = sample((LOGITS * 1.2).repeat(n, 1), [RowSampling(temperature=1.0)] * n, gen)
    assert chi2(Counter(tokens), torch.softmax(LOGITS.double(), dim=-1), n) > 10 * CHI2_LIMIT_7


def test_inverse_cdf_rows_are_independent_and_reproducible():
    """Each row draws from its own logits; the same generator state gives the same tokens."""
    logits = torch.full((4, 9), -30.0)
    for row, hot in enumerate((0, 8, 3, 5)):  # one id per row holds (almost) all the mass
        logits[row, hot] = 10.0
    rows = [RowSampling(temperature=1.0)] * 4
    first = sample(logits, rows, torch.Generator().manual_seed(3))
    again = sample(logits, rows, torch.Generator().manual_seed(3))
    assert first == again and first[0] == [0, 8, 3, 5]
    assert first[1][1] == pytest.approx(reference_logprob(logits[1], 8, 1.0), abs=1e-6)


def test_seeded_and_truncated_rows_keep_the_race(monkeypatch):
    """A seeded row's draw depends only on its seed and position, whatever batch it is in (the race with
    its own noise): the inverse-transform path must not take it."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    seeded = RowSampling(temperature=1.0, seed=7, position=2)
    alone = sample(logits[:1], [seeded], torch.Generator().manual_seed(0))[0]
    batch = sample(logits, [seeded, RowSampling(temperature=1.0), RowSampling(temperature=1.0)],
                   torch.Generator().manual_seed(5))[0]
    assert batch[0] == alone[0]
