"""The engine's kept top-p set (top-p replay): exactly the tokens the sampler can draw."""

import torch

from slime.backends.embedded_engine.sampler import RowSampling, kept_token_ids, sample


def _nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> set[int]:
    """Slow reference: the smallest top set of softmax(logits / T) whose mass before the token is ≤ top_p."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(p, descending=True).tolist()
    kept, mass = set(), 0.0
    for token in order:
        if mass > top_p:
            break
        kept.add(token)
        mass += float(p[token])
    return kept


def test_kept_sets_are_the_nucleus_and_hold_every_draw():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g)
    rows = [RowSampling(temperature=0.8, top_p=0.6), RowSampling(temperature=1.0, top_p=0.9),
            RowSampling(temperature=0.7, top_p=1.0, top_k=4), RowSampling(temperature=0.0),
            RowSampling(temperature=1.2, top_p=0.5, banned_token_ids=(int(logits[4].argmax()),))]
    kept = [set(k.tolist()) for k in kept_token_ids(logits, rows)]
    assert kept[0] == _nucleus(logits[0], 0.8, 0.6) and kept[1] == _nucleus(logits[1], 1.0, 0.9)
    assert kept[2] == set(torch.topk(logits[2], 4).indices.tolist())
    assert kept[3] == {int(logits[3].argmax())}
    banned = logits[4].clone()
    banned[int(logits[4].argmax())] = float("-inf")
    assert kept[4] == _nucleus(banned, 1.2, 0.5) and int(logits[4].argmax()) not in kept[4]
    assert 1 < len(kept[0]) < 50
    generator = torch.Generator().manual_seed(1)
    seen = [set() for _ in rows]
    for _ in range(200):
        tokens, _ = sample(logits.clone(), rows, generator)
        for row, token in enumerate(tokens):
            assert token in kept[row]
            seen[row].add(token)
    assert len(seen[0]) > 1
