"""Weight buckets for the transports: order kept, each bucket within the limit unless one tensor is larger."""

import pytest
import torch

from slime.backends.training.weights import bucket_weights
from slime.backends.update_weight import bucket_named_tensors


def test_buckets_keep_order_and_respect_the_limit():
    named = [(f"w{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 5, 5])]
    buckets = list(bucket_weights(named, 80))  # 80 bytes = 20 floats
    assert [[name for name, _ in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3", "w4", "w5"]]
    assert [name for b in buckets for name, _ in b] == [name for name, _ in named]
    for bucket in buckets:  # over the limit only as a lone tensor
        assert len(bucket) == 1 or sum(t.numel() * t.element_size() for _, t in bucket) <= 80
    assert [[n for n, _ in b] for b in bucket_named_tensors(named, 80)] == [[n for n, _ in b] for b in buckets]


def test_buckets_are_lazy_and_reject_a_zero_limit():
    produced = []

    def named():
        for i in range(4):
            produced.append(i)
            yield f"w{i}", torch.zeros(4)

    first = next(iter(bucket_weights(named(), 16)))
    assert [n for n, _ in first] == ["w0"] and produced == [0, 1]  # the second tensor closed the first bucket
    with pytest.raises(ValueError, match="update-weight-buffer-size"):
        list(bucket_weights(named(), 0))
