"""Importance weighting and rejection for the train/rollout mismatch (``--custom-tis-function-path
examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp``), configured by YAML keys through
``--custom-config-path`` (``mis.yaml`` beside this file is a starting point).

The rollout engine samples token ``y_t`` from ``μ`` (its own kernels, its own precision: an FP8 rollout moves
``log μ`` ~10x further from the trainer than a bf16 one), while the loss is built for the trainer's
``π_old``. With the per-token log-ratio ``r_t = log π_old(y_t) − log μ(y_t)`` over a sample's response tokens
(``m_t`` its loss mask), a *level* says what one weight covers:

* ``token``: ``log w_t = r_t`` (Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
  Training", 2025: truncated importance sampling);
* ``sequence``: ``log w = Σ_t m_t r_t`` for every token of the sample (the sequence's likelihood ratio);
* ``geometric``: ``log w = Σ_t m_t r_t / Σ_t m_t`` (its per-token geometric mean: a sequence-level decision that
  does not grow with the length).

**Importance sampling** (``use_tis``; ``tis_level``, ``tis_mode``, ``tis_lower_bound`` (default
``--tis-clip-low``), ``tis_upper_bound`` (default ``--tis-clip``)) multiplies each token's policy-gradient
loss by a detached weight made from ``w``: ``truncate`` ``min(w, U)``; ``clip`` ``clamp(w, L, U)``; ``mask``
``w · 1[L ≤ w ≤ U]`` — masked importance sampling (Liu, Li, Yao et al., "When Speed Kills Stability:
Demystifying RL Collapse from the Training-Inference Mismatch", 2025), which drops what truncation would
keep at the bound. ``tis_batch_normalize`` rescales the weights to mean 1 over the micro-batch's tokens in
force (``token``) or its samples (``sequence``, ``geometric``).

**Rejection** (``use_rs``; ``rs_level``, ``rs_lower_bound`` (default ``1 / rs_upper_bound``),
``rs_upper_bound`` (default 2), ``rs_veto_threshold`` (default off)) removes tokens from the loss masks
instead of reweighting them: at ``token`` level each token whose ratio leaves ``[L, U]``, at ``sequence`` /
``geometric`` level whole samples; the veto removes a whole sample holding any token with ratio below the
threshold (a token the engine found far likelier than the trainer does: ``π_old / μ < veto``). The masks
returned are then in force for every loss term, with the original per-sample denominators
(``slime.algorithms.functional.policy_loss_function``).

Every comparison is made in log space, and a weight is exponentiated only inside its bounds, so sequence
ratios of long responses neither overflow nor underflow. With ``--get-mismatch-metrics`` and neither
``use_tis`` nor ``use_rs``, the loss and masks pass through unchanged and only the metrics are reported.

Metrics (per token, reduced like any training metric over the original masks; ``train/<key>``): ``tis``
(token ratio, ``exp(r_t)`` with ``r_t`` capped at 20), ``tis_abs`` (``|ratio − 1|``), ``mismatch_k3_kl``
(``ρ − log ρ − 1`` with ``ρ = exp(r_t)``: the k3 estimate of ``KL(μ ‖ π_old)`` from tokens sampled by μ),
``mismatch_log_ratio_abs`` (``|r_t|``), ``mismatch_seq_log_ratio_abs`` (``|Σ_t m_t r_t|`` of the token's
sample); with ``use_tis`` ``tis_weight`` (the weight applied) and ``tis_clipfrac`` (weights the mode changed);
with ``use_rs`` ``rs_reject_frac`` (tokens removed) and ``rs_veto_frac`` (tokens of vetoed samples).

Context parallelism needs nothing here: slime's Megatron backend gathers every per-token value of a micro-batch
back into whole samples on each CP rank before the loss (``slime/backends/megatron_utils/context_parallel.py``),
so sequence sums are local. The name keeps the public path users configure.
"""

from __future__ import annotations

import math

import torch

LEVELS = ("token", "sequence", "geometric")
TIS_MODES = ("truncate", "clip", "mask")
LOG_RATIO_METRIC_CAP = 20.0  # the ``tis`` metric's exp: a ratio of e^20 already says "broken"


def compute_mis_weights_with_cp(args, *, pg_loss: torch.Tensor, train_log_probs: list[torch.Tensor],
                                rollout_log_probs: list[torch.Tensor], loss_masks: list[torch.Tensor],
                                response_lengths: list[int] | None = None, **kwargs
                                ) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """``--custom-tis-function-path`` hook: (re-weighted flat per-token ``pg_loss``, per-sample loss masks with
    rejected tokens zeroed, flat per-token metrics); see the module docstring for the YAML keys."""
    config = _config(args)
    device = pg_loss.device
    lengths = ([int(t.numel()) for t in train_log_probs] if response_lengths is None
               else [int(n) for n in response_lengths])
    old = torch.cat([t.detach().float().reshape(-1) for t in train_log_probs]).to(device)
    rollout = torch.cat([t.detach().float().reshape(-1) for t in rollout_log_probs]).to(device)
    masks = [m.to(device=device, dtype=torch.float32).reshape(-1) for m in loss_masks]
    mask = torch.cat(masks) if masks else old.new_zeros(0)
    if not old.numel() == rollout.numel() == mask.numel() == pg_loss.numel() == sum(lengths):
        raise ValueError(f"mismatch weights: trainer log-probs {old.numel()}, rollout log-probs {rollout.numel()}, "
                         f"masks {mask.numel()} and pg_loss {pg_loss.numel()} tokens must all equal the responses' "
                         f"{sum(lengths)}")
    log_ratio = old - rollout
    sample = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    seq_log_ratio = _per_sample_sum(log_ratio * mask, sample, len(lengths))
    tokens_per_sample = _per_sample_sum(mask, sample, len(lengths))

    def level_log_weight(level: str) -> torch.Tensor:
        """Flat per-token ``log w`` at ``level`` (sequence and geometric values repeated over their tokens)."""
        if level == "token":
            return log_ratio
        per_sample = seq_log_ratio if level == "sequence" else seq_log_ratio / tokens_per_sample.clamp(min=1.0)
        return per_sample[sample]

    ratio = torch.exp(log_ratio.clamp(max=LOG_RATIO_METRIC_CAP))
    metrics = {
        "tis": ratio,
        "tis_abs": (ratio - 1.0).abs(),
        "mismatch_k3_kl": torch.expm1(log_ratio.clamp(max=LOG_RATIO_METRIC_CAP)) - log_ratio,
        "mismatch_log_ratio_abs": log_ratio.abs(),
        "mismatch_seq_log_ratio_abs": seq_log_ratio.abs()[sample],
    }
    new_masks = loss_masks
    in_force = mask
    if config["use_rs"]:
        keep = _inside(level_log_weight(config["rs_level"]), config["rs_lower_bound"], config["rs_upper_bound"])
        vetoed = torch.zeros_like(mask, dtype=torch.bool)
        if config["rs_veto_threshold"] is not None:
            catastrophic = (log_ratio < math.log(config["rs_veto_threshold"])) & (mask > 0)
            vetoed = _per_sample_sum(catastrophic.float(), sample, len(lengths))[sample] > 0
            keep = keep & ~vetoed
        in_force = mask * keep
        metrics["rs_reject_frac"] = ((mask > 0) & ~keep).float()
        metrics["rs_veto_frac"] = vetoed.float()
        new_masks = [part.to(dtype=original.dtype).view_as(original)
                     for part, original in zip(torch.split(in_force, lengths), loss_masks)]
    if config["use_tis"]:
        log_w = level_log_weight(config["tis_level"])
        low, high = config["tis_lower_bound"], config["tis_upper_bound"]
        log_low = math.log(low) if low > 0 else -math.inf
        if config["tis_mode"] == "truncate":
            weights = torch.exp(log_w.clamp(max=math.log(high)))
            changed = log_w > math.log(high)
        elif config["tis_mode"] == "clip":
            weights = torch.exp(log_w.clamp(min=log_low, max=math.log(high)))
            changed = (log_w > math.log(high)) | (log_w < log_low)
        else:  # mask
            inside = _inside(log_w, low, high)
            weights = torch.where(inside, torch.exp(log_w.clamp(max=math.log(high))), torch.zeros_like(log_w))
            changed = ~inside
        if config["tis_batch_normalize"]:
            weights = weights / _mean_weight(weights, in_force, config["tis_level"], sample, len(lengths))
        metrics["tis_weight"] = weights
        metrics["tis_clipfrac"] = changed.float()
        pg_loss = pg_loss * weights.detach().to(pg_loss.dtype)
    return pg_loss, new_masks, {key: value.detach() for key, value in metrics.items()}


def _per_sample_sum(values: torch.Tensor, sample: torch.Tensor, samples: int) -> torch.Tensor:
    return torch.zeros(samples, dtype=values.dtype, device=values.device).index_add_(0, sample, values)


def _inside(log_w: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """``L ≤ exp(log_w) ≤ U``, decided in log space (``L = 0``: no lower bound)."""
    above = log_w >= math.log(low) if low > 0 else torch.ones_like(log_w, dtype=torch.bool)
    return above & (log_w <= math.log(high))


def _mean_weight(weights: torch.Tensor, mask: torch.Tensor, level: str, sample: torch.Tensor,
                 samples: int) -> torch.Tensor:
    """The mean the weights are normalized by: over the tokens in force (token level), or over the samples with
    a token in force, each counted once (sequence and geometric levels, whose weight is per sample); 1 where
    nothing is in force or every weight is 0."""
    if level == "token":
        total, count = (weights * mask).sum(), mask.sum()
    else:
        tokens = _per_sample_sum(mask, sample, samples)
        per_sample = _per_sample_sum(weights * mask, sample, samples) / tokens.clamp(min=1.0)
        total, count = per_sample.sum(), (tokens > 0).sum().float()
    mean = total / count.clamp(min=1.0)
    return torch.where(mean > 0, mean, torch.ones_like(mean))


def _config(args) -> dict:
    """The YAML keys (set on ``args`` by ``--custom-config-path``) with their defaults, checked: a ValueError
    names the key, what it got and what it takes."""
    where = "the mismatch weights (--custom-config-path key"

    def choice(key: str, default: str, allowed: tuple[str, ...]) -> str:
        value = getattr(args, key, None) or default
        if value not in allowed:
            raise ValueError(f"{where} {key}): {value!r} is not one of {list(allowed)}")
        return value

    def bound(key: str, default: float | None, positive: bool = True) -> float | None:
        value = getattr(args, key, None)
        value = default if value is None else value
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < 0 or (positive and value == 0):
            raise ValueError(f"{where} {key}): {value!r} must be a {'positive' if positive else 'non-negative'} "
                             "finite number")
        return float(value)

    config = {
        "use_tis": bool(getattr(args, "use_tis", False)),
        "use_rs": bool(getattr(args, "use_rs", False)),
        "tis_level": choice("tis_level", "token", LEVELS),
        "tis_mode": choice("tis_mode", "truncate", TIS_MODES),
        "tis_upper_bound": bound("tis_upper_bound", getattr(args, "tis_clip", 2.0)),
        "tis_lower_bound": bound("tis_lower_bound", getattr(args, "tis_clip_low", 0.0), positive=False),
        "tis_batch_normalize": bool(getattr(args, "tis_batch_normalize", False)),
        "rs_level": choice("rs_level", "token", LEVELS),
        "rs_upper_bound": bound("rs_upper_bound", 2.0),
        "rs_veto_threshold": bound("rs_veto_threshold", None),
    }
    config["rs_lower_bound"] = bound("rs_lower_bound", 1.0 / config["rs_upper_bound"], positive=False)
    for kind in ("tis", "rs"):
        low, high = config[f"{kind}_lower_bound"], config[f"{kind}_upper_bound"]
        if low >= high:
            raise ValueError(f"{where} {kind}_lower_bound / {kind}_upper_bound): the interval [{low}, {high}] is empty")
    return config
