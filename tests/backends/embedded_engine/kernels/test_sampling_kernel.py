"""The sampler's one-read fast path (``sampling_kernel.py``) against the torch reference it replaces:
the log-probs of the drawn ids equal ``log_softmax(logits / T)``, greedy rows take ``torch.argmax``'s id
(ties to the lowest), and the draws follow ``softmax(logits / T)``. On the CPU under Triton's
interpreter (``bash scripts/test.sh`` runs them with ``TRITON_INTERPRET=1``) and on CUDA (``gpu``)."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="runs the Triton kernels on the CPU: needs TRITON_INTERPRET=1 and an importable triton")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                                reason="needs CUDA and triton")

PEAK_LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 1.2]


def peak_ids(vocab: int) -> list[int]:
    """Ids spread across the vocabulary: different slices, tiles, lanes and quarters of a tile."""
    return [3, 260, vocab // 8 + 1, vocab // 3, vocab // 2, vocab - 257, vocab - 2]


def peaked_logits(rows: int, vocab: int) -> torch.Tensor:
    logits = torch.full((rows, vocab), -30.0)
    logits[:, peak_ids(vocab)] = torch.tensor(PEAK_LOGITS)
    return logits


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_P001 = 22.46  # the 0.001 critical value of chi-square with 6 degrees of freedom (7 buckets at most)


def reference_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, rows: int = 1024) -> torch.Tensor:
    """``log_softmax(logits / T)`` in float64 at the drawn ids, a block of rows at a time: the whole
    float64 log-softmax of 20k rows of a 152k vocabulary (22.6 GiB, twice over) would not fit an 80 GB card."""
    out = []
    for start in range(0, logits.shape[0], rows):
        block = torch.log_softmax(logits[start:start + rows].double() / temperature, dim=-1)
        out.append(block.gather(1, tokens[start:start + rows].view(-1, 1)).view(-1))
    return torch.cat(out)


def check_logprobs_and_distribution(device: str, rows: int, vocab: int):
    from slime.backends.embedded_engine.kernels import sampling_kernel

    generator = torch.Generator(device=device).manual_seed(7)
    ids = peak_ids(vocab)
    for temperature in (1.0, 0.6):
        logits = peaked_logits(rows, vocab).to(device)
        tokens, logprobs = sampling_kernel.sample(logits, temperature, False, generator)
        torch.testing.assert_close(logprobs.double(), reference_logprobs(logits, tokens, temperature), atol=2e-5, rtol=0)
        probs = torch.softmax(torch.tensor(PEAK_LOGITS, dtype=torch.float64) / temperature, dim=0).numpy()
        drawn = tokens.cpu().numpy()
        assert np.isin(drawn, ids).all()  # the rest of the vocabulary holds ~1e-12 of the mass
        counts = np.array([(drawn == i).sum() for i in ids], dtype=float)
        order = np.argsort(probs)[::-1]  # ids expected < 5 times are pooled into one bucket
        big = [i for i in order if probs[i] * rows >= 5]
        small = [i for i in order if probs[i] * rows < 5]
        if small:
            counts, expected = np.append(counts[big], counts[small].sum()), np.append(probs[big], probs[small].sum())
        else:
            counts, expected = counts[big], probs[big]
        stat = chi_square(counts, expected)
        assert stat < CHI2_P001, (temperature, counts, expected * rows)
    # the same seed draws the same ids; another seed does not
    logits = peaked_logits(16, vocab).to(device)
    a = sampling_kernel.sample(logits, 1.0, False, torch.Generator(device=device).manual_seed(3))[0]
    b = sampling_kernel.sample(logits, 1.0, False, torch.Generator(device=device).manual_seed(3))[0]
    c = sampling_kernel.sample(logits, 1.0, False, torch.Generator(device=device).manual_seed(4))[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def check_greedy(device: str):
    from slime.backends.embedded_engine.kernels import sampling_kernel

    torch.manual_seed(0)
    logits = (torch.randn(6, 12_000) * 4).to(device)
    logits[1, [9000, 700, 701]] = 50.0  # a tie across slices and lanes: the lowest id wins, as torch.argmax
    logits[2, 4096 + 256 * np.arange(4)] = 60.0  # a tie across the quarters of one tile (one lane)
    logits[3, :] = float("-inf")
    logits[3, 11_999] = 0.0  # one finite id, in the last, partial tile
    logits[4, 5:] = float("-inf")  # slices made only of -inf
    tokens, logprobs = sampling_kernel.sample(logits, 0.0, True)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    assert tokens[1].item() == 700 and tokens[2].item() == 4096 and tokens[3].item() == 11_999
    reference = torch.log_softmax(logits.double(), dim=-1).gather(1, tokens.view(-1, 1)).view(-1)
    torch.testing.assert_close(logprobs.double(), reference, atol=2e-5, rtol=0)


@needs_interpreter
def test_fused_sampling_interpreted_draws_softmax_with_exact_logprobs():
    check_logprobs_and_distribution("cpu", rows=500, vocab=1024)  # one tile: the interpreter is slow


@needs_interpreter
def test_fused_sampling_interpreted_logprobs_over_several_slices():
    from slime.backends.embedded_engine.kernels import sampling_kernel

    torch.manual_seed(1)
    logits = torch.randn(3, 20_000) * 5
    logits[1, 100:9000] = float("-inf")
    assert sampling_kernel.splits_for(3, 20_000, logits.device) >= 4
    for temperature in (1.0, 0.7):
        tokens, logprobs = sampling_kernel.sample(logits, temperature, False, torch.Generator().manual_seed(0))
        reference = torch.log_softmax(logits.double() / temperature, dim=-1).gather(1, tokens.view(-1, 1)).view(-1)
        torch.testing.assert_close(logprobs.double(), reference, atol=2e-5, rtol=0)
        assert not (100 <= tokens[1] < 9000)


@needs_interpreter
def test_fused_sampling_interpreted_greedy_is_torch_argmax():
    check_greedy("cpu")


@pytest.mark.gpu
@needs_cuda
def test_fused_sampling_on_cuda_draws_softmax_with_exact_logprobs():
    check_logprobs_and_distribution("cuda", rows=20_000, vocab=151_936)
    check_greedy("cuda")


@pytest.mark.gpu
@needs_cuda
def test_sample_on_device_uses_the_kernel_on_the_fast_path_only():
    """The engine's sampler: fast-path rows go through the kernel (same draws as calling it with the
    same generator state); a truncated row keeps the torch path; both give log_softmax's log-probs."""
    from slime.backends.embedded_engine import sampler
    from slime.backends.embedded_engine.kernels import sampling_kernel
    from slime.backends.embedded_engine.sampler import RowSampling

    logits = (torch.randn(128, 151_936, device="cuda") * 3)
    rows = [RowSampling(temperature=0.8)] * 128
    tokens, logprobs = sampler.sample_on_device(logits, rows, torch.Generator(device="cuda").manual_seed(5))
    again = sampling_kernel.sample(logits, 0.8, False, torch.Generator(device="cuda").manual_seed(5))[0]
    assert torch.equal(tokens, again)
    reference = torch.log_softmax(logits / 0.8, dim=-1)
    torch.testing.assert_close(logprobs, reference.gather(1, tokens.view(-1, 1)).view(-1), atol=1e-5, rtol=0)
    truncated = [RowSampling(temperature=0.8, top_k=5)] * 128
    tokens, logprobs = sampler.sample_on_device(logits, truncated, torch.Generator(device="cuda").manual_seed(5))
    assert (logits.topk(5, dim=-1).indices == tokens.view(-1, 1)).any(dim=1).all()
    torch.testing.assert_close(logprobs, reference.gather(1, tokens.view(-1, 1)).view(-1), atol=1e-5, rtol=0)


@needs_interpreter
def test_fused_sampling_interpreted_takes_an_empty_batch():
    from slime.backends.embedded_engine.kernels import sampling_kernel

    tokens, logprobs = sampling_kernel.sample(torch.zeros(0, 5000), 1.0, False)
    assert tokens.shape == (0,) and tokens.dtype == torch.int64 and logprobs.shape == (0,)
