"""Pure RL algorithm math for slime: rewards, KL, advantages, losses, reducers (docs/INTERFACES.md §5).

Every function takes tensors and numbers and returns tensors (and, for losses, a metrics dict).
Nothing here imports torch.distributed, Ray, Megatron or HTTP code: the trainer backends do the
parallel glue (DP all-reduces, micro-batch scaling) and call these functions.

Conventions
-----------
* A micro-batch holds samples i = 1..n. Per-token quantities are *flat*: the response tokens of
  all samples concatenated in sample order (length Σ_i response_length_i). Per-sample quantities
  are lists of 1-D tensors of length response_length_i.
* ``m`` is the loss mask (1 = trained token). ``D_i`` is ``rollout_mask_sums[i]``: the loss-mask
  total of all samples sharing sample i's rollout in the optimizer step (docs/INTERFACES.md §1.8.6, §5.8).

Registries (name -> function; an unknown name raises with the valid names):
``KL_ESTIMATORS``, ``ADVANTAGE_ESTIMATORS``, ``REWARD_POST_PROCESSORS``, ``POLICY_LOSS_MODES``,
``LOSS_FUNCTIONS``.

This file is longer than STYLE.md's ~600 line guide because it is the single home of the
algorithm catalogue (one docstring with formula and paper per function); splitting it would
scatter the registries.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = [
    "KL_ESTIMATORS",
    "ADVANTAGE_ESTIMATORS",
    "REWARD_POST_PROCESSORS",
    "POLICY_LOSS_MODES",
    "LOSS_FUNCTIONS",
    "lookup",
    "compute_approx_kl",
    "group_normalize_rewards",
    "vanilla_gae",
    "chunked_gae",
    "chunked_discounted_returns",
    "get_grpo_returns",
    "get_reinforce_plus_plus_returns",
    "get_reinforce_plus_plus_baseline_advantages",
    "get_ppo_advantages_and_returns",
    "compute_advantages_and_returns",
    "whitening_sums",
    "whiten_with_sums",
    "whiten_advantages",
    "apply_opd",
    "compute_policy_loss",
    "compute_cispo_loss",
    "compute_gspo_kl",
    "compute_opsm_mask",
    "vanilla_tis_function",
    "icepop_function",
    "compute_value_loss",
    "compute_log_probs",
    "compute_entropy",
    "sum_of_sample_mean",
    "make_sum_of_sample_mean",
    "policy_loss_function",
    "value_loss_function",
    "sft_loss_function",
]


def lookup(registry: dict, name: str, what: str):
    """Return ``registry[name]`` or raise a ValueError listing the valid names."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; valid names: {sorted(registry)}") from None


# ----------------------------------------------------------------------------------------------
# KL estimators (docs/INTERFACES.md §5.2) — Schulman, "Approximating KL Divergence" (2020).
# ----------------------------------------------------------------------------------------------


def _kl_k1(d: torch.Tensor) -> torch.Tensor:
    """k1 = d = log π − log π_base (unbiased, high variance)."""
    return d


def _kl_k2(d: torch.Tensor) -> torch.Tensor:
    """k2 = d²/2 (biased, low variance)."""
    return d * d / 2.0


def _kl_k3(d: torch.Tensor) -> torch.Tensor:
    """k3 = exp(−d) − 1 + d = ρ − 1 − log ρ with ρ = π_base/π (unbiased, non-negative)."""
    return torch.exp(-d) - 1.0 + d


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _kl_k1,
    "k2": _kl_k2,
    "k3": _kl_k3,
    "low_var_kl": _kl_k3,  # clamped to [-10, 10] in compute_approx_kl
}


def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    kl_loss_type: str,
    importance_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate between π (``log_probs``) and π_base (docs/INTERFACES.md §5.2).

    d = log π − log π_base (float32); k1 = d, k2 = d²/2, k3 = exp(−d) − 1 + d, low_var_kl = k3
    clamped to [−10, 10]. With ``importance_ratio`` (``--use-unbiased-kl``: π_θ/π_old) the estimate
    is multiplied by it before the clamp.
    """
    estimator = lookup(KL_ESTIMATORS, kl_loss_type, "--kl-loss-type")
    d = log_probs.float() - log_probs_base.float()
    kl = estimator(d)
    if importance_ratio is not None:
        kl = kl * importance_ratio
    if kl_loss_type == "low_var_kl":
        kl = torch.clamp(kl, min=-10.0, max=10.0)
    return kl


# ----------------------------------------------------------------------------------------------
# Reward post-processing (docs/INTERFACES.md §5.1, §1.8 item 9)
# ----------------------------------------------------------------------------------------------


def group_normalize_rewards(
    raw_rewards: torch.Tensor,
    group_ids: list,
    std_normalization: bool,
    rollout_ids: list | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO group normalisation (Shao et al., DeepSeekMath 2024; Dr.GRPO: Liu et al. 2025 without std).

    r_i = (raw_i − mean_{g(i)}) / (std_{g(i)} + eps)   (std: unbiased, N−1; omitted when
    ``std_normalization`` is False).

    Rollout-aware (docs/INTERFACES.md §1.8 item 9): when ``rollout_ids`` is given, each group's statistics are taken
    over *one reward per rollout* (the mean of its segments' raw rewards), so a rollout that fanned
    out into K segments counts once, and every segment i gets (raw_i − mean_g) / (std_g + eps).
    A group with a single rollout has no spread: its normalised rewards are raw − mean (= 0 when
    the segments agree) and the std division is skipped (upstream PR #1918 zeroes such groups).
    """
    raw = raw_rewards.float()
    out = torch.empty_like(raw)
    members: dict = {}
    for position, group in enumerate(group_ids):
        members.setdefault(group, []).append(position)
    for positions in members.values():
        index = torch.tensor(positions, dtype=torch.long)
        values = raw[index]
        if rollout_ids is None:
            unit_rewards = values
        else:
            per_rollout: dict = {}
            for position in positions:
                per_rollout.setdefault(rollout_ids[position], []).append(raw[position])
            unit_rewards = torch.stack([torch.stack(v).mean() for v in per_rollout.values()])
        centred = values - unit_rewards.mean()
        if std_normalization and unit_rewards.numel() > 1:
            centred = centred / (unit_rewards.std(unbiased=True) + eps)
        out[index] = centred
    return out


def positional_groups(num_samples: int, group_size: int, expected_total: int) -> list[int]:
    """Group ids of the default docs/INTERFACES.md §5.1 rule: rows of ``group_size`` consecutive samples when
    ``num_samples == expected_total``, otherwise one group holding everything."""
    if num_samples == expected_total and group_size > 0:
        return [i // group_size for i in range(num_samples)]
    return [0] * num_samples


REWARD_POST_PROCESSORS = {
    # estimator -> (normalise?, std allowed?)
    "grpo": (True, True),
    "gspo": (True, True),
    "cispo": (True, True),
    "reinforce_plus_plus_baseline": (True, False),
    "reinforce_plus_plus": (False, False),
    "ppo": (False, False),
}


# ----------------------------------------------------------------------------------------------
# Discounted sums: GAE (Schulman et al., "High-Dimensional Continuous Control Using GAE", 2016)
# ----------------------------------------------------------------------------------------------


def vanilla_gae(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Serial reference GAE over one sequence (the obvious backward loop).

    δ_t = u_t + γ V_{t+1} − V_t (V_{T} = 0 past the end), A_t = δ_t + γλ A_{t+1}, G_t = A_t + V_t.
    Accepts 1-D ``[T]`` or batched ``[B, T]`` tensors; results in the inputs' dtype (float64 stays float64).
    """
    dtype, out_dtype = _scan_dtypes(rewards, values)
    rewards, values = rewards.to(dtype), values.to(dtype)
    length = rewards.shape[-1]
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[..., 0])
    for t in reversed(range(length)):
        next_value = values[..., t + 1] if t + 1 < length else torch.zeros_like(last)
        delta = rewards[..., t] + gamma * next_value - values[..., t]
        last = delta + gamma * lambd * last
        advantages[..., t] = last
    return advantages.to(out_dtype), (advantages + values).to(out_dtype)


def _scan_dtypes(*tensors: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(dtype to compute in, dtype to return): float64 inputs stay float64; half precision is summed in
    float32 and returned in its own dtype; integer rewards give float32."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    if not dtype.is_floating_point:
        return torch.float32, torch.float32
    return (torch.float64 if dtype == torch.float64 else torch.float32), dtype


def chunked_gae(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float, chunk_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE by a chunked parallel scan, equal (up to float rounding) to :func:`vanilla_gae`.

    Inside a chunk of C positions A = δ·Wᵀ with W[i, j] = w^{j−i} (j ≥ i, w = γλ); the chunks are
    then joined right to left, A_t += w^{C_end − t} · A_{first position of next chunk}. Inputs are
    ``[B, T]`` (right-padded with zeros, which contribute nothing after the end of a sample when
    both reward and value padding are zero) or ``[T]``. Results in the inputs' dtype.
    """
    squeeze = rewards.dim() == 1
    dtype, out_dtype = _scan_dtypes(rewards, values)
    rewards = rewards.to(dtype).reshape(-1, rewards.shape[-1])
    values = values.to(dtype).reshape(-1, values.shape[-1])
    batch, length = rewards.shape
    next_values = torch.cat([values[:, 1:], torch.zeros(batch, 1, dtype=values.dtype, device=values.device)], dim=1)
    deltas = rewards + gamma * next_values - values
    w = gamma * lambd
    advantages = torch.zeros_like(deltas)
    carry = torch.zeros(batch, dtype=deltas.dtype, device=deltas.device)
    for end in range(length, 0, -chunk_size):
        start = max(0, end - chunk_size)
        size = end - start
        offsets = torch.arange(size, device=deltas.device, dtype=deltas.dtype)
        exponent = offsets[None, :] - offsets[:, None]  # j - i
        base = torch.tensor(w, dtype=deltas.dtype, device=deltas.device)
        weights = torch.where(exponent >= 0, torch.pow(base, exponent.clamp(min=0)), torch.zeros_like(exponent))
        local = deltas[:, start:end] @ weights.T
        tail_power = torch.pow(base, size - offsets)  # w^(end - t): reach of the next chunk's first A
        local = local + carry[:, None] * tail_power[None, :]
        advantages[:, start:end] = local
        carry = local[:, 0]
    advantages, returns = advantages.to(out_dtype), (advantages + values).to(out_dtype)
    if squeeze:
        return advantages[0], returns[0]
    return advantages, returns


def chunked_discounted_returns(rewards: torch.Tensor, gamma: float, chunk_size: int = 128) -> torch.Tensor:
    """G_t = Σ_{l≥0} γ^l u_{t+l}: GAE with V ≡ 0 and λ = 1, in the rewards' dtype."""
    advantages, _ = chunked_gae(rewards, torch.zeros_like(rewards), gamma, 1.0, chunk_size)
    return advantages


def _pad(tensors: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    length = max((t.numel() for t in tensors), default=0)
    out = torch.zeros(len(tensors), length, dtype=dtype)
    for i, t in enumerate(tensors):
        out[i, : t.numel()] = t.to(dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Advantage estimators (docs/INTERFACES.md §5.3)
# ----------------------------------------------------------------------------------------------


def _out_dtype(kl_i: torch.Tensor) -> torch.dtype:
    return kl_i.dtype if kl_i.is_floating_point() else torch.float32


def _check_lengths(kl: list[torch.Tensor], response_lengths, name: str) -> None:
    """``response_lengths`` (upstream's keyword) must match the per-sample tensors it describes."""
    if response_lengths is None:
        return
    got = [int(t.numel()) for t in kl]
    if list(map(int, response_lengths)) != got:
        raise ValueError(f"{name}: response_lengths {list(response_lengths)} do not match the kl tensors' lengths {got}")


def get_grpo_returns(rewards: torch.Tensor, kl: list[torch.Tensor], *, response_lengths=None,
                     **_unused) -> list[torch.Tensor]:
    """GRPO/GSPO/CISPO (Shao et al. 2024): A_{i,t} = r_i broadcast over the response; KL not applied.
    Results are in kl's dtype."""
    _check_lengths(kl, response_lengths, "get_grpo_returns")
    return [torch.full_like(kl_i, float(rewards[i]), dtype=_out_dtype(kl_i)) for i, kl_i in enumerate(kl)]


def get_reinforce_plus_plus_returns(
    rewards: torch.Tensor,
    kl: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    *,
    response_lengths=None,
    total_lengths=None,
) -> list[torch.Tensor]:
    """REINFORCE++ (Hu, 2025): u_t = −kl_coef·kl_t·m_t, plus r_i at the last loss-masked position;
    A_t = G_t = Σ_{l≥0} γ^l u_{t+l}. A sample with no loss-masked token is an error. Results are in
    kl's dtype (computed in float32, or float64 for float64 kl). ``response_lengths`` /
    ``total_lengths`` are accepted as upstream's keywords; response lengths are checked against the tensors."""
    _check_lengths(kl, response_lengths, "get_reinforce_plus_plus_returns")
    dtype = torch.float64 if any(k.dtype == torch.float64 for k in kl) else torch.float32
    token_rewards = []
    for i, (kl_i, mask_i) in enumerate(zip(kl, loss_masks)):
        mask_i = mask_i.to(dtype)
        nonzero = torch.nonzero(mask_i > 0)
        if nonzero.numel() == 0:
            raise ValueError(f"reinforce_plus_plus: sample {i} has an all-zero loss mask (no position for its reward)")
        u = -kl_coef * kl_i.to(dtype) * mask_i
        u[int(nonzero[-1])] += float(rewards[i])
        token_rewards.append(u)
    if not token_rewards:
        return []
    returns = chunked_discounted_returns(_pad(token_rewards, dtype), gamma)
    return [returns[i, : t.numel()].to(_out_dtype(kl[i])) for i, t in enumerate(token_rewards)]


def get_reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor, kl: list[torch.Tensor], kl_coef: float = 0.0, *, loss_masks=None, response_lengths=None,
) -> list[torch.Tensor]:
    """REINFORCE++-baseline (Hu, 2025): A_{i,t} = r_i − kl_coef·kl_{i,t}, r_i group-mean-centred.
    Results are in kl's dtype; ``loss_masks`` (upstream's keyword) is accepted and not applied."""
    _check_lengths(kl, response_lengths, "get_reinforce_plus_plus_baseline_advantages")
    return [(float(rewards[i]) - kl_coef * kl_i.float()).to(_out_dtype(kl_i)) for i, kl_i in enumerate(kl)]


def get_ppo_advantages_and_returns(
    raw_rewards: torch.Tensor,
    kl: list[torch.Tensor],
    values: list[torch.Tensor],
    kl_coef: float,
    gamma: float,
    lambd: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """PPO with GAE (Schulman et al. 2017; 2016): u_t = −kl_coef·kl_t, plus R_i at the last response
    position (masks not applied); δ_t = u_t + γV_{t+1} − V_t; A_t = Σ (γλ)^l δ_{t+l}; G = A + V."""
    token_rewards = []
    for i, kl_i in enumerate(kl):
        u = -kl_coef * kl_i.float()
        if u.numel():
            u[-1] += float(raw_rewards[i])
        token_rewards.append(u)
    if not token_rewards:
        return [], []
    advantages, returns = chunked_gae(_pad(token_rewards), _pad(values), gamma, lambd)
    lengths = [t.numel() for t in token_rewards]
    return [advantages[i, :n] for i, n in enumerate(lengths)], [returns[i, :n] for i, n in enumerate(lengths)]


def _adv_grpo(*, rewards, kl, **_):
    advantages = get_grpo_returns(rewards, kl)
    return advantages, advantages


def _adv_rpp(*, rewards, kl, loss_masks, kl_coef, gamma, **_):
    advantages = get_reinforce_plus_plus_returns(rewards, kl, loss_masks, kl_coef, gamma)
    return advantages, advantages


def _adv_rpp_baseline(*, rewards, kl, kl_coef, **_):
    advantages = get_reinforce_plus_plus_baseline_advantages(rewards, kl, kl_coef)
    return advantages, advantages


def _adv_ppo(*, raw_rewards, kl, values, kl_coef, gamma, lambd, **_):
    if values is None:
        raise ValueError("--advantage-estimator ppo needs critic values in rollout_data['values']")
    return get_ppo_advantages_and_returns(raw_rewards, kl, values, kl_coef, gamma, lambd)


ADVANTAGE_ESTIMATORS = {
    "grpo": _adv_grpo,
    "gspo": _adv_grpo,
    "cispo": _adv_grpo,
    "reinforce_plus_plus": _adv_rpp,
    "reinforce_plus_plus_baseline": _adv_rpp_baseline,
    "ppo": _adv_ppo,
}


def compute_advantages_and_returns(
    estimator: str,
    *,
    rewards: torch.Tensor,
    raw_rewards: torch.Tensor,
    kl: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    values: list[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lambd: float = 1.0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Dispatch to the ``--advantage-estimator`` by name; returns (advantages, returns) per sample.

    ``rewards`` are the post-processed rewards (docs/INTERFACES.md §5.1), ``raw_rewards`` the raw ones (PPO uses raw).
    """
    fn = lookup(ADVANTAGE_ESTIMATORS, estimator, "--advantage-estimator")
    return fn(
        rewards=rewards, raw_rewards=raw_rewards, kl=kl, loss_masks=loss_masks, values=values,
        kl_coef=kl_coef, gamma=gamma, lambd=lambd,
    )


# ----------------------------------------------------------------------------------------------
# Whitening and OPD (docs/INTERFACES.md §5.3 post-steps)
# ----------------------------------------------------------------------------------------------


def whitening_sums(advantages: list[torch.Tensor], loss_masks: list[torch.Tensor]) -> torch.Tensor:
    """Local sufficient statistics [Σm, Σ A·m, Σ A²·m] (float64) — the backend all-reduces them."""
    sums = torch.zeros(3, dtype=torch.float64)
    for a, m in zip(advantages, loss_masks):
        a, m = a.double(), m.double()
        sums += torch.stack([m.sum(), (a * m).sum(), (a * a * m).sum()])
    return sums


def whiten_with_sums(advantages: list[torch.Tensor], sums: torch.Tensor, eps: float = 1e-8) -> list[torch.Tensor]:
    """A ← (A − μ)/sqrt(σ² + eps), μ = ΣAm/M, σ² = (ΣA²m/M − μ²)·M/(M−1) (Bessel when M ≥ 2),
    applied to every token including masked ones. M = 0 raises."""
    count, total, total_sq = (float(x) for x in sums)
    if count <= 0:
        raise ValueError("--normalize-advantages: the loss-mask sum over the data-parallel group is zero")
    mean = total / count
    var = total_sq / count - mean * mean
    if count >= 2:
        var = var * count / (count - 1)
    scale = 1.0 / math.sqrt(max(var, 0.0) + eps)
    return [((a.double() - mean) * scale).float() for a in advantages]


def whiten_advantages(advantages: list[torch.Tensor], loss_masks: list[torch.Tensor], eps: float = 1e-8):
    """Single-process whitening (= whiten_with_sums(whitening_sums(...)))."""
    return whiten_with_sums(advantages, whitening_sums(advantages, loss_masks), eps)


def apply_opd(
    advantages: list[torch.Tensor],
    old_log_probs: list[torch.Tensor],
    teacher_log_probs: list[torch.Tensor] | None,
    opd_kl_coef: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """On-policy distillation (Agarwal et al. 2024; Thinking Machines "On-Policy Distillation" 2025):
    A ← A − λ·(log π_old − log π_teacher). Returns (advantages, opd_reverse_kl per sample)."""
    if teacher_log_probs is None or any(t is None for t in teacher_log_probs):
        raise ValueError("--use-opd: teacher log-probs are missing (sample.teacher_log_probs or a teacher pass)")
    reverse_kl = [o.float() - t.float() for o, t in zip(old_log_probs, teacher_log_probs)]
    return [a - opd_kl_coef * r for a, r in zip(advantages, reverse_kl)], reverse_kl


# ----------------------------------------------------------------------------------------------
# Log-probs and entropy from logits
# ----------------------------------------------------------------------------------------------


def compute_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[target] per row. ``logits`` [N, V], ``targets`` [N] -> [N] float32."""
    logits = logits.float() / temperature
    return torch.gather(F.log_softmax(logits, dim=-1), -1, targets.long().unsqueeze(-1)).squeeze(-1)


def compute_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H = −Σ_v p_v log p_v of softmax(logits / T) over the full vocabulary; [N, V] -> [N]."""
    log_p = F.log_softmax(logits.float() / temperature, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


# ----------------------------------------------------------------------------------------------
# Policy-loss pieces (docs/INTERFACES.md §5.4)
# ----------------------------------------------------------------------------------------------


def compute_policy_loss(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate (Schulman et al. 2017) with asymmetric clip (DAPO, Yu et al. 2025) and
    dual clip (Ye et al. 2020). ρ = exp(−ppo_kl); L¹ = −ρA; L² = −clip(ρ, 1−ε_l, 1+ε_h)·A;
    L = max(L¹, L²); clipfrac = 1[L² > L¹]; dual clip: L ← min(L, −c·A) where A < 0.
    Returns per-token (loss, clipfrac)."""
    ratio = torch.exp(-ppo_kl)
    loss1 = -ratio * advantages
    loss2 = -torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = torch.maximum(loss1, loss2)
    clipfrac = (loss2 > loss1).float()
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"--eps-clip-c must be > 1 for dual clip, got {eps_clip_c}")
        loss3 = -eps_clip_c * advantages
        loss = torch.where(advantages < 0, torch.minimum(loss, loss3), loss)
    return loss, clipfrac


def compute_cispo_loss(
    log_probs: torch.Tensor, ppo_kl: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, 2025): L = −sg(clip(ρ, 1−ε_l, 1+ε_h))·A·log π_θ; clipfrac = 1[clip(ρ) ≠ ρ]."""
    ratio = torch.exp(-ppo_kl)
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = -clipped.detach() * advantages * log_probs
    return loss, (clipped != ratio).float()


def _per_sample_mean(values: torch.Tensor, masks: list[torch.Tensor], lengths: list[int]) -> list[torch.Tensor]:
    out, start = [], 0
    for mask, n in zip(masks, lengths):
        segment = values[start : start + n]
        mask = mask.to(segment.dtype)
        out.append((segment * mask).sum() / torch.clamp(mask.sum(), min=1.0))
        start += n
    return out


def compute_gspo_kl(
    ppo_kl: torch.Tensor, loss_masks: list[torch.Tensor], response_lengths: list[int]
) -> torch.Tensor:
    """GSPO (Zheng et al. 2025): s_i = Σ_t ppo_kl·m / max(Σ m, 1), broadcast to sample i's tokens;
    gradients flow through s_i (ρ becomes the geometric-mean sequence ratio)."""
    means = _per_sample_mean(ppo_kl, loss_masks, response_lengths)
    return torch.cat([s.expand(n) for s, n in zip(means, response_lengths)]) if means else ppo_kl


def compute_opsm_mask(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    loss_masks: list[torch.Tensor],
    response_lengths: list[int],
    opsm_delta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Off-policy sequence masking (DeepSeek-V3.2 report, 2025): k_i = Σ_t ppo_kl·m / max(Σ m, 1);
    tokens with A < 0 in samples with k_i > δ get weight 0. Returns (keep [flat float],
    opsm_clipfrac = Σ_i #masked_i / max(Σ m_i, 1))."""
    with torch.no_grad():
        means = _per_sample_mean(ppo_kl.detach(), loss_masks, response_lengths)
        keep = torch.ones_like(advantages, dtype=torch.float32)
        clipfrac = torch.zeros((), dtype=torch.float32)
        start = 0
        for k_i, mask, n in zip(means, loss_masks, response_lengths):
            if float(k_i) > opsm_delta:
                drop = (advantages[start : start + n] < 0).float()
                keep[start : start + n] = 1.0 - drop
                clipfrac = clipfrac + (drop * mask.float()).sum() / max(float(mask.sum()), 1.0)
            start += n
    return keep, clipfrac


def vanilla_tis_function(
    args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """Truncated importance sampling (Yao et al., "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training", 2025): w = clamp(exp(log π_old − log μ), tis_clip_low, tis_clip);
    L ← L·w. Metrics (flat per token): tis (unclamped ratio), tis_clipfrac, tis_abs = |ratio − 1|."""
    old = torch.cat([t.float() for t in train_log_probs]).to(pg_loss.device)
    rollout = torch.cat([t.float() for t in rollout_log_probs]).to(pg_loss.device)
    ratio = torch.exp(old - rollout)
    weights = torch.clamp(ratio, min=args.tis_clip_low, max=args.tis_clip)
    metrics = {
        "tis": ratio.detach(),
        "tis_clipfrac": (weights != ratio).float(),
        "tis_abs": (ratio - 1.0).abs().detach(),
    }
    return pg_loss * weights.detach(), loss_masks, metrics


def icepop_function(
    args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """IcePop (Ling team, "Small Leak Can Sink a Great Ship", 2025): w = ratio inside
    [tis_clip_low, tis_clip], 0 outside (hard mask instead of clamping)."""
    old = torch.cat([t.float() for t in train_log_probs]).to(pg_loss.device)
    rollout = torch.cat([t.float() for t in rollout_log_probs]).to(pg_loss.device)
    ratio = torch.exp(old - rollout)
    low, high = args.tis_clip_low, args.tis_clip
    inside = (ratio >= low) & (ratio <= high)
    weights = torch.where(inside, ratio, torch.zeros_like(ratio))
    metrics = {
        "tis": ratio.detach(),
        "tis_clipfrac": (~inside).float(),
        "tis_abs": (ratio - 1.0).abs().detach(),
    }
    return pg_loss * weights.detach(), loss_masks, metrics


def compute_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO, Schulman et al. 2017): V_clip = V_old + clip(V − V_old, −ε, ε);
    L = max((V_clip − G)², (V − G)²); clipfrac = 1[|V − V_old| > ε]. Per token."""
    clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    loss = torch.maximum((clipped - returns) ** 2, (values - returns) ** 2)
    return loss, ((values - old_values).abs() > value_clip).float()


# ----------------------------------------------------------------------------------------------
# Reducers (docs/INTERFACES.md §5.8)
# ----------------------------------------------------------------------------------------------


def sum_of_sample_mean(
    x: torch.Tensor,
    response_lengths: list[int],
    loss_masks: list[torch.Tensor],
    rollout_mask_sums: list[float] | torch.Tensor | None = None,
    calculate_per_token_loss: bool = False,
) -> torch.Tensor:
    """Default reducer S over one micro-batch (flat per-token ``x``).

    per-rollout mode: S(x) = Σ_i Σ_t x_{i,t}·m_{i,t} / max(D_i, 1), D_i = rollout_mask_sums[i]
    (absent → Σ_t m_{i,t}); per-token mode: S(x) = Σ_i Σ_t x_{i,t}·m_{i,t}.
    Step normalisers (number of rollouts B, or total tokens) are applied by the backend.
    """
    return make_sum_of_sample_mean(response_lengths, loss_masks, rollout_mask_sums, calculate_per_token_loss)(x)


def make_sum_of_sample_mean(
    response_lengths: list[int],
    loss_masks: list[torch.Tensor],
    rollout_mask_sums: list[float] | torch.Tensor | None = None,
    calculate_per_token_loss: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Build S (see :func:`sum_of_sample_mean`) as one per-token weight vector: S(x) = Σ x·w."""
    weights = []
    for i, (mask, n) in enumerate(zip(loss_masks, response_lengths)):
        mask = mask.float()
        if mask.numel() != n:
            raise ValueError(f"loss mask of sample {i} has {mask.numel()} entries, response_length is {n}")
        if calculate_per_token_loss:
            weights.append(mask)
        else:
            denom = float(rollout_mask_sums[i]) if rollout_mask_sums is not None else float(mask.sum())
            weights.append(mask / max(denom, 1.0))
    weight = torch.cat(weights) if weights else torch.zeros(0)
    placed: dict = {}  # the weight on each (device, dtype) it is applied on: one copy per micro-batch

    def reduce(x: torch.Tensor) -> torch.Tensor:
        key = (x.device, x.dtype)
        if key not in placed:
            placed[key] = weight.to(device=x.device, dtype=x.dtype)
        return (x * placed[key]).sum()

    return reduce


# ----------------------------------------------------------------------------------------------
# Loss functions per micro-batch (docs/INTERFACES.md §5.4–5.6). Inputs: ``batch`` of per-sample lists for the
# micro-batch plus the current flat log-probs / entropy / values. Output: (loss, metrics) where
# metrics are *sums* S(·) to be added over micro-batches and DP ranks and divided by the step
# normaliser. ``reducer`` is the default S, ``pg_reducer`` the custom one if configured.
# ----------------------------------------------------------------------------------------------


def _on_device(tensors: list[torch.Tensor], lengths: list[int], device) -> list[torch.Tensor]:
    """Per-sample tensors on ``device`` with one host-to-device copy (not one per sample)."""
    if not tensors or all(t.device == torch.device(device) for t in tensors):
        return list(tensors)
    return list(torch.cat([t.reshape(-1) for t in tensors]).to(device).split(lengths))


def _flat(values: list[torch.Tensor] | None, device) -> torch.Tensor | None:
    if values is None:
        return None
    return torch.cat([v.float() for v in values]).to(device) if len(values) else torch.zeros(0, device=device)


POLICY_LOSS_MODES = ("ppo", "gspo", "cispo")


def policy_loss_function(
    args,
    batch: dict,
    log_probs: torch.Tensor,
    entropy: torch.Tensor | None,
    reducer: Callable[[torch.Tensor], torch.Tensor],
    pg_reducer_factory: Callable[[list[torch.Tensor]], Callable] | None = None,
    tis_function: Callable | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss of docs/INTERFACES.md §5.4 for one micro-batch; returns (loss, metrics) with every metric already
    reduced by S (sums over the micro-batch's samples). Keys: loss, pg_loss, entropy_loss,
    pg_clipfrac, ppo_kl, and when applicable kl_loss, opsm_clipfrac, ois, tis*,
    train_rollout_logprob_abs_diff.

    ``pg_reducer_factory(masks)`` builds the custom pg-loss reducer (docs/INTERFACES.md §2.12) from the loss masks in
    force. When the TIS function rejects tokens (returns modified masks), those masks are in force
    for every loss term and training metric — pg_loss (default or custom reducer), pg_clipfrac,
    ppo_kl, entropy_loss, kl_loss, opd_reverse_kl — with the original per-rollout denominators;
    only the mismatch metrics (the TIS function's own, ois, train_rollout_logprob_abs_diff) keep the
    original masks, since they describe every sampled token."""
    device = log_probs.device
    lengths = [int(n) for n in batch["response_lengths"]]
    masks = _on_device(batch["loss_masks"], lengths, device)
    advantages = _flat(batch["advantages"], device)
    use_rollout = args.use_rollout_logprobs
    old_source = batch.get("rollout_log_probs") if use_rollout else batch.get("log_probs")
    old_log_probs = _flat(old_source, device) if old_source is not None else log_probs.detach()

    ppo_kl = old_log_probs - log_probs
    estimator = args.advantage_estimator
    if estimator == "gspo":
        ppo_kl = compute_gspo_kl(ppo_kl, masks, lengths)
    eps_clip = args.eps_clip
    eps_clip_high = args.eps_clip_high if args.eps_clip_high is not None else eps_clip
    if estimator == "cispo":
        pg_loss, clipfrac = compute_cispo_loss(log_probs, ppo_kl, advantages, eps_clip, eps_clip_high)
    else:
        pg_loss, clipfrac = compute_policy_loss(
            ppo_kl, advantages, eps_clip, eps_clip_high, args.eps_clip_c
        )

    metrics: dict[str, torch.Tensor] = {}
    if args.use_opsm:
        keep, opsm_clipfrac = compute_opsm_mask(ppo_kl, advantages, masks, lengths, args.opsm_delta)
        pg_loss = pg_loss * keep
        metrics["opsm_clipfrac"] = opsm_clipfrac

    rollout_log_probs = batch.get("rollout_log_probs")
    pg_masks = masks
    trained = reducer  # S over the tokens in force (TIS rejection removes some)
    if tis_function is not None:
        if rollout_log_probs is None:
            raise ValueError("--use-tis needs rollout log-probs in the samples (sample.rollout_log_probs)")
        train_lp = batch.get("log_probs") or [t.detach() for t in _split(log_probs, lengths)]
        pg_loss, pg_masks, tis_metrics = tis_function(
            args=args, pg_loss=pg_loss, train_log_probs=train_lp, rollout_log_probs=rollout_log_probs,
            loss_masks=masks, total_lengths=batch.get("total_lengths"), response_lengths=lengths,
        )
        pg_masks = _on_device(pg_masks, lengths, device)
        metrics["ois"] = reducer(torch.exp(-ppo_kl).detach())
        for key, value in tis_metrics.items():
            metrics[key] = reducer(value.detach().float())
        if pg_masks is not masks:
            trained = _reducer_with_masks(batch, pg_masks, args)
    pg_loss_value = pg_reducer_factory(pg_masks)(pg_loss) if pg_reducer_factory is not None else trained(pg_loss)

    loss = pg_loss_value
    entropy_coef = args.entropy_coef
    if entropy is not None:
        entropy_loss = trained(entropy)
        if entropy_coef != 0.0:
            loss = loss - entropy_coef * entropy_loss
        metrics["entropy_loss"] = entropy_loss.detach()
    if args.use_kl_loss:
        ref = _flat(batch.get("ref_log_probs"), device)
        if ref is None:
            raise ValueError("--use-kl-loss needs reference log-probs (ref_log_probs)")
        ratio = torch.exp(log_probs - old_log_probs) if args.use_unbiased_kl else None
        kl_loss = trained(compute_approx_kl(log_probs, ref, args.kl_loss_type, importance_ratio=ratio))
        loss = loss + args.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    if rollout_log_probs is not None:
        base = log_probs.detach() if use_rollout else old_log_probs
        metrics["train_rollout_logprob_abs_diff"] = reducer((base - _flat(rollout_log_probs, device)).abs())
    if batch.get("opd_reverse_kl") is not None:
        metrics["opd_reverse_kl"] = trained(_flat(batch["opd_reverse_kl"], device))
    metrics.update(
        loss=loss.detach(),
        pg_loss=pg_loss_value.detach(),
        pg_clipfrac=trained(clipfrac),
        ppo_kl=trained(ppo_kl.detach()),
    )
    return loss, metrics


def _split(flat: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    return list(torch.split(flat, lengths)) if lengths else []


def _reducer_with_masks(batch: dict, masks: list[torch.Tensor], args):
    """S with modified numerator masks (TIS rejection) but the original per-rollout denominators."""
    per_token = args.calculate_per_token_loss
    sums = batch.get("rollout_mask_sums")
    if sums is None and not per_token:
        sums = [float(m.sum()) for m in batch["loss_masks"]]
    return make_sum_of_sample_mean([int(n) for n in batch["response_lengths"]], masks, sums, per_token)


def value_loss_function(
    args, batch: dict, values: torch.Tensor, reducer: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic loss of docs/INTERFACES.md §5.5: S(max((V_clip − G)², (V − G)²)); metrics value_loss, value_clipfrac."""
    device = values.device
    old_values = _flat(batch["values"], device)
    returns = _flat(batch["returns"], device)
    loss_per_token, clipfrac = compute_value_loss(values, old_values, returns, args.value_clip)
    loss = reducer(loss_per_token)
    return loss, {"value_loss": loss.detach(), "value_clipfrac": reducer(clipfrac)}


def sft_loss_function(
    args, batch: dict, log_probs: torch.Tensor, reducer: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SFT (docs/INTERFACES.md §5.6): loss = −S(log π_θ) over loss-masked response tokens."""
    loss = -reducer(log_probs)
    return loss, {"loss": loss.detach()}


LOSS_FUNCTIONS = {
    "policy_loss": policy_loss_function,
    "value_loss": value_loss_function,
    "sft_loss": sft_loss_function,
    "custom_loss": None,  # resolved from --custom-loss-function-path by the backend
}
