"""The policy loss at the loss boundary: gradients of CISPO, GSPO, dual clip and TIS against autograd of a
reference written here token by token (docs/INTERFACES.md §5.4), and TIS rejection (modified masks) applied to
every trained term and metric (docs/INTERFACES.md §2.11, §2.12)."""

import math

import pytest
import torch

from slime.algorithms import functional as pu
from tests.algorithms.test_functional import _args




def _batch(seed: int, lengths=(5, 3, 6)):
    """Samples whose ratios fall on both sides of every clip bound, advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    lengths = list(lengths)
    n = sum(lengths)
    old = torch.randn(n, generator=g) * 0.5 - 1.0
    new = (old + torch.randn(n, generator=g) * 0.6).double().requires_grad_()
    masks = [(torch.rand(length, generator=g) > 0.25).int() for length in lengths]
    for mask in masks:
        mask[0] = 1
    adv = torch.randn(n, generator=g) * 2
    rollout = old + torch.randn(n, generator=g) * 0.8
    denominators = [float(m.sum()) + 1.0 for m in masks]  # rollouts spanning more samples than these
    batch = {"response_lengths": lengths, "loss_masks": masks, "advantages": list(torch.split(adv.double(), lengths)),
             "log_probs": list(torch.split(old.double(), lengths)), "rollout_log_probs": list(torch.split(rollout.double(), lengths)),
             "rollout_mask_sums": denominators, "total_lengths": [length + 4 for length in lengths]}
    return batch, new


def _tokens(batch):
    """(sample, position, old, advantage, mask, rollout log-prob, denominator) per token, in flat order."""
    out = []
    for i, length in enumerate(batch["response_lengths"]):
        for t in range(length):
            out.append((i, t, float(batch["log_probs"][i][t]), float(batch["advantages"][i][t]), int(batch["loss_masks"][i][t]),
                        float(batch["rollout_log_probs"][i][t]), batch["rollout_mask_sums"][i]))
    return out


def _reference_loss(batch, new, mode: str, eps_low=0.2, eps_high=0.28, dual_c=None, tis=None):
    """Σ_i Σ_t ℓ_t · m_t / D_i, every token's ℓ computed on its own from the docs/INTERFACES.md §5.4 formulas."""
    tokens = _tokens(batch)
    seq_kl = {}
    if mode == "gspo":
        for i in set(k[0] for k in tokens):
            rows = [(j, k) for j, k in enumerate(tokens) if k[0] == i]
            total = sum((k[2] - new[j]) * k[4] for j, k in rows)
            seq_kl[i] = total / max(sum(k[4] for _, k in rows), 1)
    loss = new.new_zeros(())
    for j, (i, _t, old, a, m, mu, d) in enumerate(tokens):
        log_ratio = -seq_kl[i] if mode == "gspo" else new[j] - old
        ratio = torch.exp(log_ratio)
        clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
        if mode == "cispo":
            token = -clipped.detach() * a * new[j]
        else:
            token = torch.maximum(-ratio * a, -clipped * a)
            if dual_c is not None and a < 0:
                token = torch.minimum(token, torch.tensor(-dual_c * a, dtype=token.dtype))
        if tis is not None:
            token = token * min(max(math.exp(old - mu), tis[0]), tis[1])
        loss = loss + token * m / max(d, 1.0)
    return loss


@pytest.mark.parametrize("mode,kw", [
    ("ppo", {}),
    ("ppo-dual-clip", {"eps_clip_c": 3.0}),
    ("cispo", {"advantage_estimator": "cispo", "eps_clip": 1.0, "eps_clip_high": 4.0}),
    ("gspo", {"advantage_estimator": "gspo", "eps_clip": 3e-4, "eps_clip_high": 4e-4}),
    ("ppo-tis", {"tis_clip": 1.3, "tis_clip_low": 0.6}),
])
def test_policy_loss_gradient_equals_autograd_of_the_reference(mode, kw):
    batch, new = _batch(seed=len(mode))
    args = _args(**kw)
    reducer = pu.make_sum_of_sample_mean(batch["response_lengths"], batch["loss_masks"], batch["rollout_mask_sums"])
    tis = pu.vanilla_tis_function if mode == "ppo-tis" else None
    loss, _ = pu.policy_loss_function(args, batch, new, None, reducer, tis_function=tis)
    (grad,) = torch.autograd.grad(loss, new)
    reference = _reference_loss(batch, new, mode.split("-")[0] if mode != "ppo-dual-clip" else "ppo",
                                eps_low=args.eps_clip, eps_high=args.eps_clip_high, dual_c=kw.get("eps_clip_c"),
                                tis=(args.tis_clip_low, args.tis_clip) if tis else None)
    (expected,) = torch.autograd.grad(reference, new)
    # float32 inside the loss (TIS weights, reducer weights): agreement to ~1e-7
    assert float(loss) == pytest.approx(float(reference), rel=1e-6, abs=1e-9)
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-9)
    assert float(expected.abs().sum()) > 0  # the case trains something


def test_cispo_clip_is_detached_and_gspo_ratio_is_per_sequence():
    """What distinguishes the variants shows in the gradient: CISPO's weight carries no gradient
    (∂ℓ/∂log π = −clip(ρ)·A exactly), GSPO's tokens of one sample share one ratio."""
    batch, new = _batch(seed=3)
    reducer = pu.make_sum_of_sample_mean(batch["response_lengths"], batch["loss_masks"], batch["rollout_mask_sums"])
    loss, _ = pu.policy_loss_function(_args(advantage_estimator="cispo", eps_clip=0.1, eps_clip_high=0.1), batch, new, None, reducer)
    (grad,) = torch.autograd.grad(loss, new)
    for j, (_i, _t, old, a, m, _mu, d) in enumerate(_tokens(batch)):
        clipped = min(max(math.exp(float(new[j]) - old), 0.9), 1.1)
        assert float(grad[j]) == pytest.approx(-clipped * a * m / d, rel=1e-6, abs=1e-9)
    gspo = _args(advantage_estimator="gspo", eps_clip=10.0, eps_clip_high=10.0)  # no clipping: ℓ = −ρ_i·A
    loss, _ = pu.policy_loss_function(gspo, batch, new, None, reducer)
    (grad,) = torch.autograd.grad(loss, new)
    tokens = _tokens(batch)
    for i, length in enumerate(batch["response_lengths"]):
        rows = [j for j, k in enumerate(tokens) if k[0] == i]
        masked = sum(tokens[j][4] for j in rows)
        s = sum((tokens[j][2] - float(new[j])) * tokens[j][4] for j in rows) / masked
        weight = sum(tokens[j][3] * tokens[j][4] / tokens[j][6] for j in rows)  # Σ_t A·m/D of sample i
        for j in rows:  # ∂/∂log π_t of −exp(−s_i)·weight, s_i = Σ (old − new)·m / M
            assert float(grad[j]) == pytest.approx(-math.exp(-s) * weight * tokens[j][4] / masked, rel=1e-6, abs=1e-9)


def _rejecting_tis(threshold: float):
    """A TIS function that rejects tokens whose π_old/μ ratio exceeds ``threshold`` (rejection sampling, MIS-style)."""
    def tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
        old = torch.cat([t.double() for t in train_log_probs])
        mu = torch.cat([t.double() for t in rollout_log_probs])
        ratio = torch.exp(old - mu)
        keep = (ratio <= threshold).int()
        masks = [m * k for m, k in zip(loss_masks, torch.split(keep, [len(m) for m in loss_masks]))]
        return pg_loss, masks, {"mis_ratio": ratio}
    return tis


def test_tis_rejected_tokens_are_not_trained_and_not_counted():
    batch, new = _batch(seed=5)
    entropy = (torch.rand(new.numel(), dtype=torch.float64) + 0.5).requires_grad_()
    ref = torch.randn(new.numel(), dtype=torch.float64) * 0.3 - 1.0
    batch["ref_log_probs"] = list(torch.split(ref, batch["response_lengths"]))
    args = _args(entropy_coef=0.05, use_kl_loss=True, kl_loss_coef=0.2, kl_loss_type="k3")
    tokens = _tokens(batch)
    kept = [1 if math.exp(k[2] - k[5]) <= 1.0 else 0 for k in tokens]
    assert 0 < sum(k * t[4] for k, t in zip(kept, tokens)) < sum(t[4] for t in tokens)  # some trained tokens rejected
    seen_masks = []

    def reducer_factory(total_lengths, response_lengths, masks, per_token):
        seen_masks.append([m.clone() for m in masks])
        return pu.make_sum_of_sample_mean(response_lengths, masks, [4.0] * len(masks), per_token)

    reducer = pu.make_sum_of_sample_mean(batch["response_lengths"], batch["loss_masks"], batch["rollout_mask_sums"])
    factory = (lambda masks: reducer_factory(batch["total_lengths"], batch["response_lengths"], masks, False))
    loss, metrics = pu.policy_loss_function(args, batch, new, entropy, reducer, pg_reducer_factory=factory,
                                            tis_function=_rejecting_tis(1.0))
    # the custom reducer was built from the modified masks
    assert [int(x) for m in seen_masks[0] for x in m] == [k * t[4] for k, t in zip(kept, tokens)]

    def reduce(values, trained_only=True):
        return sum(float(v) * t[4] * (k if trained_only else 1) / t[6] for v, t, k in zip(values, tokens, kept))

    log_ratio = [float(new[j]) - t[2] for j, t in enumerate(tokens)]
    ppo_kl = [-x for x in log_ratio]
    clipfrac = [float(-math.exp(x) * t[3] < -min(max(math.exp(x), 0.8), 1.28) * t[3]) for x, t in zip(log_ratio, tokens)]
    kl = [math.exp(float(r) - float(n)) - 1 - (float(r) - float(n)) for r, n in zip(ref, new)]
    assert float(metrics["ppo_kl"]) == pytest.approx(reduce(ppo_kl), rel=1e-6, abs=1e-9)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(reduce(clipfrac), rel=1e-6, abs=1e-9)
    assert float(metrics["entropy_loss"]) == pytest.approx(reduce(entropy.detach()), rel=1e-6)
    assert float(metrics["kl_loss"]) == pytest.approx(reduce(kl), rel=1e-6)
    # the mismatch metric describes every sampled token: the original masks
    ratios = [math.exp(t[2] - t[5]) for t in tokens]
    assert float(metrics["mis_ratio"]) == pytest.approx(reduce(ratios, trained_only=False), rel=1e-6)
    # a rejected token gets no gradient from any term (pg, entropy, KL)
    grad_new, grad_entropy = torch.autograd.grad(loss, [new, entropy])
    for j, (k, t) in enumerate(zip(kept, tokens)):
        if not (k and t[4]):
            assert float(grad_new[j]) == 0.0 and float(grad_entropy[j]) == 0.0, j
    assert float(grad_new.abs().sum()) > 0 and float(grad_entropy.abs().sum()) > 0


def test_tis_without_rejection_keeps_the_original_masks_everywhere():
    """Vanilla TIS returns the masks it was given: every reducer is the default one."""
    batch, new = _batch(seed=6)
    reducer = pu.make_sum_of_sample_mean(batch["response_lengths"], batch["loss_masks"], batch["rollout_mask_sums"])
    _, with_tis = pu.policy_loss_function(_args(), batch, new, None, reducer, tis_function=pu.vanilla_tis_function)
    _, without = pu.policy_loss_function(_args(), batch, new, None, reducer)
    assert float(with_tis["ppo_kl"]) == float(without["ppo_kl"])
    assert float(with_tis["pg_clipfrac"]) == float(without["pg_clipfrac"])
