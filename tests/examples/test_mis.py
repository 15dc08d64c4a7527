"""``examples.train_infer_mismatch_helper.mis``: each level, mode, rejection and the veto against weights written
here token by token from the formulas of its docstring; the loss gradient through ``policy_loss_function``
against autograd of that reference; metrics-only use leaving the loss and masks alone; bad keys refused."""

import math
from types import SimpleNamespace

import pytest
import torch

from examples.train_infer_mismatch_helper.mis import compute_mis_weights_with_cp
from slime.algorithms import functional as pu
from tests.algorithms.test_policy_loss_grads import _batch, _reference_loss, _tokens
from tests.algorithms.test_functional import _args


def _case(seed: int = 0, lengths=(5, 3, 6, 4)):
    """Per-sample trainer / rollout log-probs whose ratios spread over [0.3, 3], masks with holes, and one
    sample holding a token the engine found ~50x likelier than the trainer (the veto's case)."""
    g = torch.Generator().manual_seed(seed)
    old = [torch.randn(n, generator=g) * 0.5 - 2.0 for n in lengths]
    rollout = [o + torch.randn(o.numel(), generator=g) * 0.6 for o in old]
    rollout[2][1] = old[2][1] + math.log(50.0)
    masks = [(torch.rand(n, generator=g) > 0.2).int() for n in lengths]
    for m in masks:
        m[1] = 1
    pg_loss = torch.randn(sum(lengths), generator=g)
    return old, rollout, masks, pg_loss, list(lengths)


def _call(old, rollout, masks, pg_loss, lengths, **config):
    args = SimpleNamespace(tis_clip=2.0, tis_clip_low=0.0, **config)
    return compute_mis_weights_with_cp(args, pg_loss=pg_loss, train_log_probs=old, rollout_log_probs=rollout,
                                       loss_masks=masks, response_lengths=lengths, total_lengths=None)


def _log_weights(old, rollout, masks, level: str) -> list[float]:
    """The flat per-token log w of ``level``, one token at a time."""
    out = []
    for o, r, m in zip(old, rollout, masks):
        ratios = [float(a - b) for a, b in zip(o, r)]
        total = sum(x * int(k) for x, k in zip(ratios, m))
        count = max(sum(int(k) for k in m), 1)
        for x in ratios:
            out.append(x if level == "token" else total if level == "sequence" else total / count)
    return out


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "clip", "mask"])
def test_weights_follow_the_level_and_mode(level, mode):
    old, rollout, masks, pg_loss, lengths = _case(seed=1)
    # bounds that the case's weights fall on both sides of (sample weights: sequence 0.035 / 0.37 / 2.36 / 2.93,
    # geometric 0.51 / 0.82 / 1.33 / 1.43)
    low, high = {"token": (0.7, 1.6), "sequence": (0.3, 2.5), "geometric": (0.6, 1.4)}[level]
    out, new_masks, metrics = _call(old, rollout, masks, pg_loss, lengths, use_tis=True, tis_level=level,
                                    tis_mode=mode, tis_lower_bound=low, tis_upper_bound=high)
    assert new_masks is masks  # no rejection asked for
    expected, changed = [], []
    for log_w in _log_weights(old, rollout, masks, level):
        w = math.exp(log_w)
        if mode == "truncate":
            expected.append(min(w, high)), changed.append(w > high)
        elif mode == "clip":
            expected.append(min(max(w, low), high)), changed.append(not low <= w <= high)
        else:
            expected.append(w if low <= w <= high else 0.0), changed.append(not low <= w <= high)
    expected = torch.tensor(expected)
    torch.testing.assert_close(metrics["tis_weight"], expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out, pg_loss * expected, rtol=1e-5, atol=1e-7)
    assert metrics["tis_clipfrac"].tolist() == [float(c) for c in changed]
    assert 0 < sum(changed) < len(changed)  # the case exercises both sides
    if level != "token":  # one weight per sample
        for part in torch.split(metrics["tis_weight"], lengths):
            assert torch.all(part == part[0])


def test_token_truncation_is_vanilla_tis():
    """``token`` + ``truncate`` with the CLI's bounds is what ``--use-tis`` does without a custom function."""
    old, rollout, masks, pg_loss, lengths = _case(seed=2)
    out, _, metrics = _call(old, rollout, masks, pg_loss, lengths, use_tis=True)
    vanilla, _, vanilla_metrics = pu.vanilla_tis_function(_args(), pg_loss=pg_loss, train_log_probs=old,
                                                          rollout_log_probs=rollout, loss_masks=masks)
    torch.testing.assert_close(out, vanilla)
    for key in ("tis", "tis_abs", "tis_clipfrac"):
        torch.testing.assert_close(metrics[key], vanilla_metrics[key])


def test_sequence_ratios_of_long_responses_neither_overflow_nor_vanish():
    """A 4000-token response drifting 0.05 nats a token has a sequence ratio of e^200: out of fp32, yet its
    truncated weight is exactly the bound, the mask drops it, and the geometric level keeps e^0.05."""
    old = [torch.zeros(4000), torch.zeros(3)]
    rollout = [torch.full((4000,), -0.05), torch.zeros(3)]
    masks = [torch.ones(4000, dtype=torch.int32), torch.ones(3, dtype=torch.int32)]
    pg_loss = torch.ones(4003)
    for mode, first in (("truncate", 2.0), ("mask", 0.0)):
        _, _, metrics = _call(old, rollout, masks, pg_loss, [4000, 3], use_tis=True, tis_level="sequence",
                              tis_mode=mode)
        assert torch.isfinite(metrics["tis_weight"]).all()
        assert float(metrics["tis_weight"][0]) == first and float(metrics["tis_weight"][-1]) == 1.0
    _, _, metrics = _call(old, rollout, masks, pg_loss, [4000, 3], use_tis=True, tis_level="geometric")
    assert float(metrics["tis_weight"][0]) == pytest.approx(math.exp(0.05), rel=1e-5)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_rejection_removes_tokens_or_whole_samples_and_the_veto_its_sample(level):
    old, rollout, masks, pg_loss, lengths = _case(seed=3)
    low, high = 0.8, 1.25
    out, new_masks, metrics = _call(old, rollout, masks, pg_loss, lengths, use_rs=True, rs_level=level,
                                    rs_lower_bound=low, rs_upper_bound=high, rs_veto_threshold=0.05)
    torch.testing.assert_close(out, pg_loss)  # rejection only: no reweighting
    log_w = _log_weights(old, rollout, masks, level)
    expected, rejected, vetoed = [], [], []
    start = 0
    for i, (o, r, m) in enumerate(zip(old, rollout, masks)):
        veto = any(int(k) and math.exp(float(a - b)) < 0.05 for a, b, k in zip(o, r, m))
        for t in range(len(m)):
            keep = low <= math.exp(log_w[start + t]) <= high and not veto
            expected.append(int(m[t]) * int(keep))
            rejected.append(float(bool(int(m[t])) and not keep))
            vetoed.append(float(veto))
        start += len(m)
    assert [int(x) for m in new_masks for x in m] == expected
    assert [m.dtype for m in new_masks] == [m.dtype for m in masks]
    assert metrics["rs_reject_frac"].tolist() == rejected and metrics["rs_veto_frac"].tolist() == vetoed
    assert sum(vetoed[8:14]) == 6 and sum(vetoed) == 6  # sample 2 (its 50x token), only it
    assert 0 < sum(expected) < sum(int(x) for m in masks for x in m)
    if level != "token":  # a sample is kept or dropped whole
        for new, old_mask in zip(new_masks, masks):
            assert torch.equal(new, old_mask) or not new.any()


def test_batch_normalization_gives_mean_one_over_what_is_in_force():
    old, rollout, masks, pg_loss, lengths = _case(seed=4)
    _, new_masks, metrics = _call(old, rollout, masks, pg_loss, lengths, use_tis=True, tis_mode="clip",
                                  tis_lower_bound=0.5, tis_batch_normalize=True, use_rs=True, rs_upper_bound=2.5)
    in_force = torch.cat(new_masks).float()
    assert float((metrics["tis_weight"] * in_force).sum() / in_force.sum()) == pytest.approx(1.0, rel=1e-6)
    _, _, metrics = _call(old, rollout, masks, pg_loss, lengths, use_tis=True, tis_level="geometric",
                          tis_batch_normalize=True)
    per_sample = [float(part[0]) for part in torch.split(metrics["tis_weight"], lengths)]
    assert sum(per_sample) / len(per_sample) == pytest.approx(1.0, rel=1e-6)


def test_metrics_only_leaves_the_loss_and_masks_and_reports_the_mismatch():
    """``--get-mismatch-metrics`` without ``use_tis`` / ``use_rs``: the hook reports, the loss is unchanged."""
    old, rollout, masks, pg_loss, lengths = _case(seed=5)
    out, new_masks, metrics = _call(old, rollout, masks, pg_loss, lengths)
    assert out is pg_loss and new_masks is masks
    assert set(metrics) == {"tis", "tis_abs", "mismatch_k3_kl", "mismatch_log_ratio_abs", "mismatch_seq_log_ratio_abs"}
    r = torch.cat(old) - torch.cat(rollout)
    torch.testing.assert_close(metrics["mismatch_k3_kl"], torch.exp(r) - r - 1, rtol=1e-5, atol=1e-6)
    assert (metrics["mismatch_k3_kl"] >= 0).all()
    seq = [abs(sum(float(x) * int(k) for x, k in zip(o - ro, m))) for o, ro, m in zip(old, rollout, masks)]
    torch.testing.assert_close(metrics["mismatch_seq_log_ratio_abs"],
                               torch.tensor([seq[i] for i, n in enumerate(lengths) for _ in range(n)]))


def test_policy_loss_gradient_with_masked_importance_sampling_equals_autograd_of_the_reference():
    """Through ``policy_loss_function``: token-level MIS weights (detached) on the PPO loss, tokens outside the
    bounds weighted 0, and rejected samples (geometric level) out of every sum with the original denominators."""
    batch, new = _batch(seed=11)
    args = _args(tis_clip=1.5, tis_clip_low=0.5)
    args.use_tis, args.tis_mode = True, "mask"
    reducer = pu.make_sum_of_sample_mean(batch["response_lengths"], batch["loss_masks"], batch["rollout_mask_sums"])
    loss, metrics = pu.policy_loss_function(args, batch, new, None, reducer, tis_function=compute_mis_weights_with_cp)
    (grad,) = torch.autograd.grad(loss, new)
    tokens = _tokens(batch)
    reference = new.new_zeros(())
    for j, (_i, _t, old, a, m, mu, d) in enumerate(tokens):
        ratio = torch.exp(new[j] - old)
        token = torch.maximum(-ratio * a, -torch.clamp(ratio, 1 - args.eps_clip, 1 + args.eps_clip_high) * a)
        w = math.exp(old - mu)
        reference = reference + token * (w if 0.5 <= w <= 1.5 else 0.0) * m / max(d, 1.0)
    (expected,) = torch.autograd.grad(reference, new)
    assert float(loss.detach()) == pytest.approx(float(reference.detach()), rel=1e-6, abs=1e-9)
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-9)
    assert float(expected.abs().sum()) > 0
    masked = sum(1 for k in tokens if k[4] and not 0.5 <= math.exp(k[2] - k[5]) <= 1.5)
    assert masked > 0  # the case has tokens the mask drops (a clamp would have kept them at the bound)
    # and equal to the plain reference of vanilla TIS where no weight leaves the bounds
    wide = _args(tis_clip=1e6, tis_clip_low=1e-6)
    wide.use_tis, wide.tis_mode = True, "mask"
    loss_wide, _ = pu.policy_loss_function(wide, batch, new, None, reducer, tis_function=compute_mis_weights_with_cp)
    wide_reference = _reference_loss(batch, new, "ppo", tis=(0.0, 1e6)).detach()
    assert float(loss_wide.detach()) == pytest.approx(float(wide_reference), rel=1e-6)
    # geometric rejection: whole samples leave every sum, their tokens get no gradient
    reject = _args()
    reject.use_rs, reject.rs_level, reject.rs_lower_bound, reject.rs_upper_bound = True, "geometric", 0.9, 1.1
    loss_rs, _ = pu.policy_loss_function(reject, batch, new, None, reducer, tis_function=compute_mis_weights_with_cp)
    (grad_rs,) = torch.autograd.grad(loss_rs, new)
    for i, part in enumerate(torch.split(grad_rs, batch["response_lengths"])):
        rows = [k for k in tokens if k[0] == i]
        geo = sum((k[2] - k[5]) * k[4] for k in rows) / max(sum(k[4] for k in rows), 1)
        assert (float(part.abs().sum()) == 0.0) == (not 0.9 <= math.exp(geo) <= 1.1), i


@pytest.mark.parametrize("key,value,message", [
    ("tis_mode", "clamp", r"tis_mode\): 'clamp' is not one of \['truncate', 'clip', 'mask'\]"),
    ("rs_level", "sentence", r"rs_level\): 'sentence' is not one of"),
    ("tis_upper_bound", 0, r"tis_upper_bound\): 0 must be a positive"),
    ("rs_veto_threshold", "1e-4", r"rs_veto_threshold\): '1e-4' must be a positive"),
    ("tis_lower_bound", 3.0, r"the interval \[3.0, 2.0\] is empty"),
])
def test_bad_keys_are_refused_by_name(key, value, message):
    old, rollout, masks, pg_loss, lengths = _case()
    with pytest.raises(ValueError, match=message):
        _call(old, rollout, masks, pg_loss, lengths, use_tis=True, **{key: value})


def test_token_counts_that_disagree_are_refused():
    old, rollout, masks, pg_loss, lengths = _case()
    with pytest.raises(ValueError, match="must all equal the responses'"):
        _call(old, rollout[:-1], masks, pg_loss, lengths, use_tis=True)
