"""slime.algorithms.functional against slow, obvious references (loops over samples and tokens)."""

import math
from types import SimpleNamespace

import pytest
import torch

from slime.algorithms import functional as pu


def _args(**kw):
    base = dict(
        eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None, advantage_estimator="grpo", use_rollout_logprobs=False,
        use_opsm=False, opsm_delta=1e-4, entropy_coef=0.0, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1",
        use_unbiased_kl=False, tis_clip=2.0, tis_clip_low=0.0, calculate_per_token_loss=False, value_clip=0.2,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def _random_batch(seed=0, n=4, max_len=7):
    g = torch.Generator().manual_seed(seed)
    lengths = [int(torch.randint(1, max_len + 1, (1,), generator=g)) for _ in range(n)]
    masks = [(torch.rand(L, generator=g) > 0.3).int() for L in lengths]
    masks[0][0] = 1
    return g, lengths, masks


# ------------------------------------------------------------------------------------ KL


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators_match_formulas(kind):
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(50, generator=g) * 6, torch.randn(50, generator=g) * 6
    got = pu.compute_approx_kl(a, b, kind)
    for x, y, v in zip(a.tolist(), b.tolist(), got.tolist()):
        d = x - y
        ref = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d, "low_var_kl": min(max(math.exp(-d) - 1 + d, -10), 10)}[kind]
        assert v == pytest.approx(ref, rel=1e-5, abs=1e-5)
    if kind in ("k3", "low_var_kl"):
        assert (got >= 0).all()


def test_unknown_names_list_valid_ones():
    with pytest.raises(ValueError, match="k1"):
        pu.compute_approx_kl(torch.zeros(1), torch.zeros(1), "kl")
    with pytest.raises(ValueError, match="reinforce_plus_plus"):
        pu.compute_advantages_and_returns("nope", rewards=torch.zeros(1), raw_rewards=torch.zeros(1), kl=[], loss_masks=[])


# ------------------------------------------------------------------------------------ rewards


def _ref_group_norm(raw, groups, std):
    out = [0.0] * len(raw)
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        vals = [raw[i] for i in idx]
        mean = sum(vals) / len(vals)
        sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else None
        for i in idx:
            out[i] = (raw[i] - mean) / (sd + 1e-6) if (std and sd is not None) else raw[i] - mean
    return out


@pytest.mark.parametrize("std", [True, False])
def test_group_normalisation_matches_reference_and_zero_mean(std):
    raw = torch.randn(12, generator=torch.Generator().manual_seed(2))
    groups = pu.positional_groups(12, 4, 12)
    got = pu.group_normalize_rewards(raw, groups, std)
    assert got.tolist() == pytest.approx(_ref_group_norm(raw.tolist(), groups, std), abs=1e-5)
    for g in range(3):
        assert float(got[g * 4 : g * 4 + 4].mean()) == pytest.approx(0.0, abs=1e-6)


def test_identical_rewards_give_zero_advantages():
    raw = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    got = pu.group_normalize_rewards(raw, pu.positional_groups(6, 3, 6), True)
    assert torch.equal(got, torch.zeros(6))
    adv, _ = pu.compute_advantages_and_returns("grpo", rewards=got, raw_rewards=raw, kl=[torch.zeros(3)] * 6, loss_masks=[torch.ones(3)] * 6)
    assert all(torch.equal(a, torch.zeros(3)) for a in adv)


def test_count_mismatch_uses_one_group():
    assert pu.positional_groups(5, 2, 6) == [0] * 5


def test_rollout_aware_grouping_counts_each_rollout_once():
    # group 0: rollout 10 fans out into 3 segments (reward 1 each), rollout 11 one segment (reward 0)
    raw = torch.tensor([1.0, 1.0, 1.0, 0.0])
    got = pu.group_normalize_rewards(raw, [0, 0, 0, 0], True, rollout_ids=[10, 10, 10, 11])
    # per-rollout rewards [1, 0]: mean 0.5, std sqrt(0.5)
    expect = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert got.tolist() == pytest.approx([expect, expect, expect, -expect], abs=1e-5)
    # a singleton group is zero and never NaN
    single = pu.group_normalize_rewards(torch.tensor([3.0, 3.0]), [0, 0], True, rollout_ids=[5, 5])
    assert torch.equal(single, torch.zeros(2))


# ------------------------------------------------------------------------------------ GAE / returns


@pytest.mark.parametrize("gamma,lambd", [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0)])
def test_chunked_gae_equals_vanilla_and_loop(gamma, lambd):
    g = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(3, 300, generator=g), torch.randn(3, 300, generator=g)
    adv_c, ret_c = pu.chunked_gae(rewards, values, gamma, lambd, chunk_size=64)
    adv_v, ret_v = pu.vanilla_gae(rewards, values, gamma, lambd)
    torch.testing.assert_close(adv_c, adv_v, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ret_c, ret_v, rtol=1e-4, atol=1e-4)
    # brute-force definition for one row: A_t = Σ_l (γλ)^l δ_{t+l}
    r, v = rewards[1].tolist(), values[1].tolist()
    T = len(r)
    delta = [r[t] + gamma * (v[t + 1] if t + 1 < T else 0.0) - v[t] for t in range(T)]
    for t in (0, 5, 150, T - 1):
        ref = sum((gamma * lambd) ** l * delta[t + l] for l in range(T - t))
        assert float(adv_c[1, t]) == pytest.approx(ref, abs=1e-3)


def test_reinforce_plus_plus_returns_match_loop():
    g, lengths, masks = _random_batch(4)
    kl = [torch.randn(L, generator=g) for L in lengths]
    rewards = torch.randn(len(lengths), generator=g)
    got = pu.get_reinforce_plus_plus_returns(rewards, kl, masks, kl_coef=0.1, gamma=0.9)
    for i, L in enumerate(lengths):
        u = [-0.1 * float(kl[i][t]) * int(masks[i][t]) for t in range(L)]
        last = max(t for t in range(L) if masks[i][t])
        u[last] += float(rewards[i])
        ref = [sum(0.9 ** l * u[t + l] for l in range(L - t)) for t in range(L)]
        assert got[i].tolist() == pytest.approx(ref, abs=1e-5)
    with pytest.raises(ValueError, match="all-zero"):
        pu.get_reinforce_plus_plus_returns(rewards[:1], [torch.zeros(2)], [torch.zeros(2)], 0.1, 1.0)


def test_rpp_baseline_and_ppo_advantages():
    g, lengths, masks = _random_batch(5)
    kl = [torch.randn(L, generator=g) for L in lengths]
    rewards = torch.randn(len(lengths), generator=g)
    got = pu.get_reinforce_plus_plus_baseline_advantages(rewards, kl, 0.2)
    for i in range(len(lengths)):
        assert got[i].tolist() == pytest.approx([float(rewards[i]) - 0.2 * float(k) for k in kl[i]], abs=1e-6)
    values = [torch.randn(L, generator=g) for L in lengths]
    adv, ret = pu.compute_advantages_and_returns(
        "ppo", rewards=rewards, raw_rewards=rewards, kl=kl, loss_masks=masks, values=values, kl_coef=0.05, gamma=0.99, lambd=0.9
    )
    for i, L in enumerate(lengths):
        u = -0.05 * kl[i].clone()
        u[-1] += rewards[i]
        a_ref, r_ref = pu.vanilla_gae(u, values[i], 0.99, 0.9)
        torch.testing.assert_close(adv[i], a_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ret[i], r_ref, atol=1e-5, rtol=1e-5)


def test_whitening_matches_loop():
    g, lengths, masks = _random_batch(6, n=6)
    adv = [torch.randn(L, generator=g) * 3 + 1 for L in lengths]
    got = pu.whiten_advantages(adv, masks)
    vals = [float(a[t]) for a, m in zip(adv, masks) for t in range(len(a)) if m[t]]
    M = len(vals)
    mean = sum(vals) / M
    var = sum((v - mean) ** 2 for v in vals) / (M - 1)
    for a, w in zip(adv, got):
        assert w.tolist() == pytest.approx([(float(x) - mean) / math.sqrt(var + 1e-8) for x in a], abs=1e-5)
    # whitened masked tokens have mean 0
    flat = torch.cat([w[m.bool()] for w, m in zip(got, masks)])
    assert float(flat.mean()) == pytest.approx(0.0, abs=1e-5)
    with pytest.raises(ValueError, match="zero"):
        pu.whiten_advantages([torch.ones(2)], [torch.zeros(2)])


# ------------------------------------------------------------------------------------ policy loss


def _ref_ppo_token(old, new, a, lo, hi, c):
    ratio = math.exp(new - old)
    l1, l2 = -ratio * a, -min(max(ratio, 1 - lo), 1 + hi) * a
    loss = max(l1, l2)
    if c is not None and a < 0:
        loss = min(loss, -c * a)
    return loss, float(l2 > l1)


@pytest.mark.parametrize("dual", [None, 3.0])
def test_ppo_clip_matches_reference(dual):
    g = torch.Generator().manual_seed(7)
    old, new, a = torch.randn(200, generator=g) * 0.5, torch.randn(200, generator=g) * 0.5, torch.randn(200, generator=g)
    loss, clip = pu.compute_policy_loss(old - new, a, 0.2, 0.28, dual)
    for i in range(200):
        rl, rc = _ref_ppo_token(float(old[i]), float(new[i]), float(a[i]), 0.2, 0.28, dual)
        assert float(loss[i]) == pytest.approx(rl, rel=1e-5, abs=1e-6)
        assert float(clip[i]) == rc


def test_cispo_gspo_opsm_match_reference():
    g, lengths, masks = _random_batch(8)
    n = sum(lengths)
    old, new, a = torch.randn(n, generator=g) * 0.3, torch.randn(n, generator=g) * 0.3, torch.randn(n, generator=g)
    loss, clip = pu.compute_cispo_loss(new, old - new, a, 1.0, 4.0)
    for i in range(n):
        r = math.exp(float(new[i] - old[i]))
        rc = min(max(r, 0.0), 5.0)
        assert float(loss[i]) == pytest.approx(-rc * float(a[i]) * float(new[i]), rel=1e-5, abs=1e-6)
    gspo = pu.compute_gspo_kl(old - new, masks, lengths)
    start = 0
    for m, L in zip(masks, lengths):
        s = sum(float(old[start + t] - new[start + t]) * int(m[t]) for t in range(L)) / max(int(m.sum()), 1)
        assert gspo[start : start + L].tolist() == pytest.approx([s] * L, abs=1e-6)
        start += L
    keep, frac = pu.compute_opsm_mask(old - new, a, masks, lengths, opsm_delta=-1.0)  # every sample "off-policy"
    assert keep.tolist() == [0.0 if float(x) < 0 else 1.0 for x in a]
    ref_frac = 0.0
    start = 0
    for m, L in zip(masks, lengths):
        ref_frac += sum(1 for t in range(L) if a[start + t] < 0 and m[t]) / max(int(m.sum()), 1)
        start += L
    assert float(frac) == pytest.approx(ref_frac, abs=1e-6)


def test_ratio_one_gives_zero_clipfrac_and_ppo_kl():
    g, lengths, masks = _random_batch(9)
    n = sum(lengths)
    lp = torch.randn(n, generator=g)
    batch = {"response_lengths": lengths, "loss_masks": masks, "advantages": list(torch.split(torch.randn(n, generator=g) * 5, lengths)),
             "log_probs": list(torch.split(lp.clone(), lengths))}
    reducer = pu.make_sum_of_sample_mean(lengths, masks)
    for est in ("grpo", "gspo", "cispo"):
        _, m = pu.policy_loss_function(_args(advantage_estimator=est), batch, lp.clone(), None, reducer)
        assert float(m["ppo_kl"]) == 0.0 and float(m["pg_clipfrac"]) == 0.0


def test_tis_and_icepop():
    g = torch.Generator().manual_seed(10)
    old, roll = [torch.randn(5, generator=g)], [torch.randn(5, generator=g)]
    pg = torch.randn(5, generator=g)
    args = _args(tis_clip=1.5, tis_clip_low=0.5)
    out, masks, metrics = pu.vanilla_tis_function(args, pg_loss=pg, train_log_probs=old, rollout_log_probs=roll, loss_masks=[torch.ones(5)])
    for t in range(5):
        r = math.exp(float(old[0][t] - roll[0][t]))
        assert float(out[t]) == pytest.approx(float(pg[t]) * min(max(r, 0.5), 1.5), rel=1e-5)
        assert float(metrics["tis"][t]) == pytest.approx(r, rel=1e-5)
    out, _, _ = pu.icepop_function(args, pg_loss=pg, train_log_probs=old, rollout_log_probs=roll, loss_masks=[torch.ones(5)])
    for t in range(5):
        r = math.exp(float(old[0][t] - roll[0][t]))
        assert float(out[t]) == pytest.approx(float(pg[t]) * (r if 0.5 <= r <= 1.5 else 0.0), rel=1e-5)
    from slime.backends.megatron_utils.loss import icepop_function, vanilla_tis_function

    assert icepop_function is pu.icepop_function and vanilla_tis_function is pu.vanilla_tis_function


def test_value_loss_matches_reference():
    g = torch.Generator().manual_seed(11)
    v, vo, ret = (torch.randn(40, generator=g) for _ in range(3))
    loss, clip = pu.compute_value_loss(v, vo, ret, 0.2)
    for i in range(40):
        vc = float(vo[i]) + min(max(float(v[i] - vo[i]), -0.2), 0.2)
        assert float(loss[i]) == pytest.approx(max((vc - float(ret[i])) ** 2, (float(v[i]) - float(ret[i])) ** 2), rel=1e-5)
        assert float(clip[i]) == float(abs(float(v[i] - vo[i])) > 0.2)


def test_log_probs_and_entropy():
    g = torch.Generator().manual_seed(12)
    logits, targets = torch.randn(6, 11, generator=g), torch.randint(0, 11, (6,), generator=g)
    lp, ent = pu.compute_log_probs(logits, targets, 0.7), pu.compute_entropy(logits, 0.7)
    for i in range(6):
        z = [float(x) / 0.7 for x in logits[i]]
        lse = math.log(sum(math.exp(x) for x in z))
        assert float(lp[i]) == pytest.approx(z[int(targets[i])] - lse, abs=1e-5)
        assert float(ent[i]) == pytest.approx(-sum(math.exp(x - lse) * (x - lse) for x in z), abs=1e-5)


# ------------------------------------------------------------------------------------ reducers


def test_reducers_per_rollout_and_per_token():
    g, lengths, masks = _random_batch(13, n=5)
    x = torch.randn(sum(lengths), generator=g)
    sums = [float(m.sum()) + 2 for m in masks]  # rollout totals include tokens of other segments
    got = pu.sum_of_sample_mean(x, lengths, masks, sums)
    ref, start = 0.0, 0
    for m, L, d in zip(masks, lengths, sums):
        ref += sum(float(x[start + t]) * int(m[t]) for t in range(L)) / max(d, 1)
        start += L
    assert float(got) == pytest.approx(ref, abs=1e-5)
    per_token = pu.sum_of_sample_mean(x, lengths, masks, sums, calculate_per_token_loss=True)
    assert float(per_token) == pytest.approx(sum(float(v) for v, m in zip(x, torch.cat(masks)) if m), abs=1e-5)


def test_per_token_vs_per_sample_differ_exactly_as_defined():
    # sample A: 1 token of loss 1; sample B: 3 tokens of loss 0.
    x, lengths, masks = torch.tensor([1.0, 0.0, 0.0, 0.0]), [1, 3], [torch.ones(1), torch.ones(3)]
    per_sample = pu.sum_of_sample_mean(x, lengths, masks) / 2  # mean over 2 samples
    per_token = pu.sum_of_sample_mean(x, lengths, masks, calculate_per_token_loss=True) / 4  # over 4 tokens
    assert float(per_sample) == 0.5 and float(per_token) == 0.25


def test_reducer_exact_under_any_micro_batch_split():
    g, lengths, masks = _random_batch(14, n=6)
    x = torch.randn(sum(lengths), generator=g)
    sums = [float(m.sum()) for m in masks]
    whole = pu.sum_of_sample_mean(x, lengths, masks, sums)
    parts = list(torch.split(x, lengths))
    split = sum(
        pu.sum_of_sample_mean(torch.cat(parts[a:b]), lengths[a:b], masks[a:b], sums[a:b]) for a, b in [(0, 1), (1, 4), (4, 6)]
    )
    assert float(split) == pytest.approx(float(whole), abs=1e-6)


def test_policy_loss_metrics_and_kl_entropy_terms():
    g, lengths, masks = _random_batch(15)
    n = sum(lengths)
    old, new, ref, ent = (torch.randn(n, generator=g) * 0.3 for _ in range(4))
    adv = torch.randn(n, generator=g)
    batch = {"response_lengths": lengths, "loss_masks": masks, "advantages": list(torch.split(adv, lengths)),
             "log_probs": list(torch.split(old, lengths)), "ref_log_probs": list(torch.split(ref, lengths))}
    reducer = pu.make_sum_of_sample_mean(lengths, masks)
    args = _args(use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type="k3", entropy_coef=0.01)
    loss, m = pu.policy_loss_function(args, batch, new, ent, reducer)
    pg, _ = pu.compute_policy_loss(old - new, adv, 0.2, 0.28)
    expect = reducer(pg) - 0.01 * reducer(ent) + 0.3 * reducer(pu.compute_approx_kl(new, ref, "k3"))
    assert float(loss) == pytest.approx(float(expect), abs=1e-6)
    assert set(m) >= {"loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl", "kl_loss"}


def test_returns_helpers_take_upstreams_keywords_and_keep_the_dtype():
    rewards = torch.tensor([1.0, -1.0])
    kl = [torch.tensor([0.5, 0.25], dtype=torch.bfloat16), torch.tensor([0.125], dtype=torch.bfloat16)]
    masks = [torch.ones(2), torch.ones(1)]
    grpo = pu.get_grpo_returns(rewards, kl, response_lengths=[2, 1])
    rpp = pu.get_reinforce_plus_plus_returns(rewards=rewards, kl=kl, loss_masks=masks, response_lengths=[2, 1],
                                             total_lengths=[5, 3], kl_coef=0.0, gamma=1.0)
    base = pu.get_reinforce_plus_plus_baseline_advantages(rewards, kl, loss_masks=masks, kl_coef=0.0,
                                                          response_lengths=[2, 1])
    for result in (grpo, rpp, base):
        assert [t.dtype for t in result] == [torch.bfloat16, torch.bfloat16]
        assert [t.tolist() for t in result] == [[1.0, 1.0], [-1.0]]
    with pytest.raises(ValueError, match=r"response_lengths \[2, 2\] do not match"):
        pu.get_grpo_returns(rewards, kl, response_lengths=[2, 2])


def test_discounted_sums_keep_float64_and_its_precision():
    """float64 in, float64 out, computed in float64: within 1e-12 of the exact loop, where a float32
    pass (what the helpers used to do, then a cast) misses by ~1e-6 on these sums."""
    g = torch.Generator().manual_seed(5)
    rewards, values = torch.randn(2, 200, generator=g, dtype=torch.float64), torch.randn(2, 200, generator=g, dtype=torch.float64)
    r, v = rewards[0].tolist(), values[0].tolist()
    exact, last = [0.0] * 200, 0.0
    for t in reversed(range(200)):
        last = r[t] + 0.99 * (v[t + 1] if t + 1 < 200 else 0.0) - v[t] + 0.99 * 0.95 * last
        exact[t] = last
    exact = torch.tensor(exact, dtype=torch.float64)
    for adv, ret in (pu.chunked_gae(rewards, values, 0.99, 0.95, chunk_size=64), pu.vanilla_gae(rewards, values, 0.99, 0.95)):
        assert adv.dtype == ret.dtype == torch.float64
        torch.testing.assert_close(adv[0], exact, rtol=0, atol=1e-12)
        torch.testing.assert_close(ret, adv + values, rtol=0, atol=1e-12)
    float32_pass = pu.chunked_gae(rewards.float(), values.float(), 0.99, 0.95, chunk_size=64)[0][0].double()
    assert (float32_pass - exact).abs().max() > 1e-9  # the effect the float64 path removes
    returns = pu.chunked_discounted_returns(rewards, 0.9)
    assert returns.dtype == torch.float64
    kl = [torch.randn(7, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)]
    rpp = pu.get_reinforce_plus_plus_returns(torch.tensor([1.0, 0.5]), kl, [torch.ones(7), torch.ones(3)], kl_coef=0.1,
                                             gamma=0.9)
    assert [t.dtype for t in rpp] == [torch.float64, torch.float64]
    u = (-0.1 * kl[0]).tolist()
    u[-1] += 1.0
    expected = [sum(0.9 ** l * u[t + l] for l in range(7 - t)) for t in range(7)]
    torch.testing.assert_close(rpp[0], torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    half = pu.chunked_gae(rewards.bfloat16(), values.bfloat16(), 1.0, 1.0)[0]
    assert half.dtype == torch.bfloat16
