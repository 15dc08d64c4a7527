"""Micro-batches of samples laid out for Megatron-Core's ``GPTModel`` and its forward to the logits
that predict the response tokens.

* :func:`micro_batch_inputs` — packed (thd) or right-padded ``[n, L_max]`` inputs, with the rows of
  the K response positions, built on the host and copied to the device at once.
* :func:`run_model` — the forward; on the last stage the output layer runs on the response rows only
  (``GPTModel``'s ``output_processor`` hook).
* :func:`cut_vocabulary_padding` / :func:`response_logits` (and the one-stage composition
  :func:`forward_logits`) — ``[K, vocab_size]`` logits, Megatron's vocabulary padding cut off.

Megatron is imported inside functions: this module imports on a machine without it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from slime.backends.megatron_utils.model import have_transformer_engine, unwrap

__all__ = ["forward_logits", "MicroBatchInputs", "default_packed", "packs_micro_batches", "micro_batch_inputs", "run_model",
           "response_logits", "cut_vocabulary_padding", "response_targets"]


@dataclass
class MicroBatchInputs:
    """One micro-batch of samples laid out for ``GPTModel.forward``.

    ``input_ids``/``position_ids``: ``[1, T]`` packed (thd, every sample followed by the next) or
    ``[n, L_max]`` right-padded; ``packed_seq_params``: the thd boundaries, or None when padded;
    ``starts``: the row of each sample's first token in the flattened ``[b·s]`` output (empty under
    context parallelism, where a sample's tokens are split over the ranks: ``cp`` describes them);
    ``lengths``/``response_lengths``: tokens and response tokens per sample; ``targets``: ``[K]``
    the response tokens (what the K logit rows predict); ``rows_bs`` / ``rows_sb``: ``[K]`` the
    positions predicting them, as rows of the flattened ``[b·s]`` logits and of Megatron's
    ``[s·b]`` hidden states; ``sample_indices``: the samples' indices in the caller's rollout data.
    The device tensors are views of one buffer, copied from the host at once."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: object | None
    starts: list[int]
    lengths: list[int]
    response_lengths: list[int]
    targets: torch.Tensor
    rows_bs: torch.Tensor
    rows_sb: torch.Tensor
    sample_indices: list[int] = field(default_factory=list)
    cp: object | None = None  # context_parallel.CPLayout of this rank under context parallelism

    def gather(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """Values at this rank's response rows ``[K_local, …]`` → ``[K, …]`` in sample order (under
        context parallelism each rank holds some of the rows; otherwise ``values`` itself)."""
        if self.cp is None or values is None:
            return values
        from slime.backends.megatron_utils.context_parallel import gather_rows

        return gather_rows(values, self.cp)


def _check_response_lengths(lengths: list[int], response_lengths: list[int]) -> None:
    if any(r < 0 or r >= n for r, n in zip(response_lengths, lengths)):
        raise ValueError(f"response lengths {response_lengths} must be in [0, len(tokens)) for lengths {lengths}")


def _response_positions(lengths: list[int], response_lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample, position) ``[K]`` each, on the host: position ``p`` of sample ``i`` predicts token
    ``p + 1``, so the K response tokens are predicted at ``n_i − r_i − 1 … n_i − 2``."""
    _check_response_lengths(lengths, response_lengths)
    responses = torch.tensor(response_lengths, dtype=torch.long)
    first = torch.tensor(lengths, dtype=torch.long) - responses - 1
    sample = torch.repeat_interleave(torch.arange(len(lengths)), responses)
    offset = torch.arange(int(responses.sum())) - torch.repeat_interleave(torch.cumsum(responses, 0) - responses, responses)
    return sample, first[sample] + offset


def default_packed(device) -> bool:
    """Whether micro-batches are packed (thd) by default: with Transformer Engine; without it when
    :mod:`.packed_attention` runs flash attention (CUDA with PyTorch's varlen attention) or on the
    CPU, where its exact per-sample attention is what the tests check. Else right-padded (on CUDA
    without varlen attention the per-sample fallback would be slower than the padding)."""
    from slime.backends.training import varlen_attention

    return have_transformer_engine() or torch.device(device).type != "cuda" or varlen_attention.available()


def packs_micro_batches(model: torch.nn.Module, device) -> bool:
    """Whether the trainer packs ``model``'s micro-batches: :func:`default_packed`, and the model
    takes packed rows (Transformer Engine, or the local spec of :func:`model_provider`; a custom
    provider's model of the plain local spec is padded)."""
    if not default_packed(device):
        return False
    if have_transformer_engine():
        return True
    from slime.backends.megatron_utils.packed_attention import supports_packing

    return supports_packing(unwrap(model))


def micro_batch_inputs(tokens: list[torch.Tensor], response_lengths: list[int], device, packed: bool | None = None,
                       pad_multiple: int = 1, sample_indices: list[int] | None = None, cp_size: int = 1,
                       cp_rank: int = 0) -> MicroBatchInputs:
    """Lay out ``tokens`` packed (thd: Transformer Engine's attention, or the local spec's
    :class:`~.packed_attention.PackedCoreAttention`) or right-padded ``[n, L_max]`` (causal
    attention never looks at the padding on the right, so both are exact); ``packed=None``:
    :func:`default_packed`. ``pad_multiple``: the sequence dimension is padded to a multiple of it
    (sequence parallelism splits it over TP ranks). ``cp_size > 1``: this context-parallel rank's
    chunks of every sample (:mod:`.context_parallel`; packed, local spec). Everything is built on
    the host and goes to ``device`` in one copy."""
    if cp_size > 1:
        if packed is False or pad_multiple != 1:
            raise ValueError("context parallelism needs packed micro-batches without sequence-parallel padding")
        return _context_parallel_inputs(tokens, list(response_lengths), device, cp_size, cp_rank, sample_indices)
    if packed is None:
        packed = default_packed(device)
    lengths = [int(t.numel()) for t in tokens]
    targets = response_targets(tokens, response_lengths)
    sample, position = _response_positions(lengths, list(response_lengths))
    params, cu = None, None
    if packed:
        pad = -sum(lengths) % pad_multiple
        # the padding is a sequence of its own: nothing attends to it and no logit of it is read
        seq_lengths = lengths + ([pad] if pad else [])
        input_ids = torch.cat([t.long() for t in tokens] + [torch.zeros(pad, dtype=torch.long)])[None]
        position_ids = torch.cat([torch.arange(n) for n in seq_lengths])[None]
        cu = torch.zeros(len(seq_lengths) + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(torch.tensor(seq_lengths), 0)
        starts = [int(c) for c in cu[:len(lengths)]]
        rows_bs = rows_sb = cu[sample] + position  # one row of samples: both orders agree
    else:
        longest = -(-max(lengths) // pad_multiple) * pad_multiple
        input_ids = torch.zeros(len(tokens), longest, dtype=torch.long)
        for i, t in enumerate(tokens):
            input_ids[i, : lengths[i]] = t
        position_ids = torch.arange(longest).expand(len(tokens), -1)
        starts = [i * longest for i in range(len(tokens))]
        rows_bs = sample * longest + position
        rows_sb = position * len(tokens) + sample
    pieces = [input_ids, position_ids, targets, rows_bs, rows_sb] + ([cu] if cu is not None else [])
    on_device = torch.cat([p.reshape(-1) for p in pieces]).to(device).split([p.numel() for p in pieces])
    input_ids, position_ids, targets, rows_bs, rows_sb = (d.view(p.shape) for d, p in zip(on_device, pieces[:5]))
    if packed:
        longest = max(seq_lengths)
        cu = on_device[5].int()
        if have_transformer_engine():
            from megatron.core.packed_seq_params import PackedSeqParams

            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                     max_seqlen_kv=longest)
        else:
            from slime.backends.megatron_utils.packed_attention import LocalPackedSeqParams

            params = LocalPackedSeqParams(qkv_format="thd", max_seqlen_q=longest, max_seqlen_kv=longest,
                                          sample_cu_seqlens=cu, sample_lengths=seq_lengths)
    return MicroBatchInputs(input_ids, position_ids, params, starts, lengths, list(response_lengths), targets,
                            rows_bs, rows_sb, sample_indices=list(sample_indices or []))


def _context_parallel_inputs(tokens: list[torch.Tensor], response_lengths: list[int], device, cp_size: int, cp_rank: int,
                             sample_indices: list[int] | None) -> MicroBatchInputs:
    from slime.backends.megatron_utils import context_parallel as cpm
    from slime.backends.megatron_utils.packed_attention import LocalPackedSeqParams

    lengths = [int(t.numel()) for t in tokens]
    _check_response_lengths(lengths, response_lengths)
    cp = cpm.layout(lengths, response_lengths, cp_size, cp_rank)
    padded = cpm.padded_lengths(lengths, cp_size)
    flat = torch.cat([torch.cat([t.long(), torch.zeros(m - n, dtype=torch.long)]) for t, n, m in zip(tokens, lengths, padded)])
    sample_start = torch.cumsum(torch.tensor([0] + padded[:-1]), 0)
    where = sample_start[cp.sample_of] + cp.positions  # each local token's index in ``flat``
    first = torch.tensor([n - r - 1 for n, r in zip(lengths, response_lengths)])
    last = torch.tensor(lengths) - 2
    rows = torch.nonzero((cp.positions >= first[cp.sample_of]) & (cp.positions <= last[cp.sample_of])).reshape(-1)
    pieces = {"input_ids": flat[where][None], "position_ids": cp.positions[None], "targets": flat[where[rows] + 1],
              "rows": rows, "kv_index": cp.kv_index, "cu_q": cp.cu_q, "cu_k": cp.cu_k, "gather_index": cp.gather_index}
    on_device = dict(zip(pieces, torch.cat([p.reshape(-1).long() for p in pieces.values()]).to(device).split(
        [p.numel() for p in pieces.values()])))
    cp.kv_index, cp.gather_index = on_device["kv_index"], on_device["gather_index"]
    cp.cu_q, cp.cu_k = on_device["cu_q"].int(), on_device["cu_k"].int()
    params = LocalPackedSeqParams(qkv_format="thd", max_seqlen_q=max(padded), max_seqlen_kv=max(padded), cp=cp)
    rows = on_device["rows"]
    return MicroBatchInputs(on_device["input_ids"].view(1, -1), on_device["position_ids"].view(1, -1), params,
                            [], lengths, list(response_lengths), on_device["targets"], rows, rows,
                            sample_indices=list(sample_indices or []), cp=cp)


def run_model(model: torch.nn.Module, inputs: MicroBatchInputs, all_positions: bool = False) -> torch.Tensor:
    """``GPTModel.forward`` on one micro-batch. On the last pipeline stage: the output layer's
    result (TP-gathered, vocabulary padding included) at the K response rows only, ``[K, V_padded]``
    — or at every position, ``[b, s, V_padded]``, with ``all_positions``; on every other stage the
    hidden states to send."""
    kwargs = {"packed_seq_params": inputs.packed_seq_params} if inputs.packed_seq_params is not None else {}
    rows_only = not all_positions and _takes_output_processor(unwrap(model))
    if rows_only:
        kwargs.update(output_processor=_response_rows_output, output_processor_context=inputs.rows_sb)
    rotary = contextlib.nullcontext()
    if inputs.packed_seq_params is not None and (inputs.cp is not None or not have_transformer_engine()):
        from slime.backends.megatron_utils.packed_attention import per_token_rotary, supports_packing

        if not supports_packing(unwrap(model)):
            raise ValueError("packed micro-batches without Transformer Engine need the local spec's attention from "
                             "slime.backends.megatron_utils.model.model_provider (PackedCoreAttention) and RoPE; "
                             "pass packed=False for this model")
        rotary = per_token_rotary(unwrap(model), inputs.position_ids)
    with rotary:
        output = model(inputs.input_ids, inputs.position_ids, attention_mask=None, runtime_gather_output=True, **kwargs)
    if all_positions or rows_only or not getattr(unwrap(model), "post_process", True):
        return output
    # a model without the output_processor hook (a custom provider's): every position, then the rows
    return response_logits(output, inputs, output.shape[-1])


def _takes_output_processor(gpt: torch.nn.Module) -> bool:
    import inspect

    return "output_processor" in inspect.signature(type(gpt).forward).parameters


def _response_rows_output(*, hidden_states: torch.Tensor, output_layer, output_weight, context: torch.Tensor,
                          scale_logits=None, **_ignored) -> torch.Tensor:
    """``GPTModel``'s ``output_processor``: the output layer (the LM head, or the critic's
    :class:`ValueHead`) on the rows ``context`` of the ``[s·b]`` hidden states only → ``[K, V]``.

    Under sequence parallelism the hidden states are split over the TP ranks along ``s``: they are
    gathered first and the layer runs in its non-sequence-parallel mode, whose backward all-reduces
    the input gradient over TP; the gather's backward then keeps each rank's own slice of it —
    together the reduce-scatter the sequence-parallel layer would have done."""
    sequence_parallel = bool(getattr(output_layer, "sequence_parallel", False))
    if sequence_parallel:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False,
                                                             group=getattr(output_layer, "tp_group", None))
    rows = hidden_states.reshape(-1, hidden_states.shape[-1]).index_select(0, context).unsqueeze(1)  # [K, 1, h]
    output_layer.sequence_parallel = False
    try:
        logits, _ = output_layer(rows, weight=output_weight, runtime_gather_output=True)
    finally:
        output_layer.sequence_parallel = sequence_parallel
    if scale_logits is not None:
        logits = scale_logits(logits)
    return logits.squeeze(1)


def response_logits(logits: torch.Tensor, inputs: MicroBatchInputs, vocab_size: int) -> torch.Tensor:
    """Rows ``[K, vocab_size]`` of ``logits`` ``[b, s, V_padded]`` at the K = Σ response positions,
    samples in order.

    The columns past ``vocab_size`` are Megatron's vocabulary padding (zero rows of the output
    layer, logit 0): they are cut off here, or every log-softmax would count them as tokens."""
    picked = logits.reshape(-1, logits.shape[-1])[inputs.rows_bs]
    return picked[:, :vocab_size]


def forward_logits(model: torch.nn.Module, tokens: list[torch.Tensor], response_lengths: list[int], device, *,
                   vocab_size: int, packed: bool | None = None, pad_multiple: int = 1) -> torch.Tensor:
    """Logits ``[K, vocab_size]`` (TP-gathered, vocabulary padding removed) at the K = Σ response
    positions, samples in order — the same rows as the FSDP backend's ``forward_response_logits``.
    One stage only (no pipeline parallelism); the trainer goes through :mod:`.pipeline`."""
    inputs = micro_batch_inputs(tokens, response_lengths, device, packed, pad_multiple)
    return cut_vocabulary_padding(run_model(model, inputs), vocab_size)


def cut_vocabulary_padding(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The first ``vocab_size`` columns of ``[K, V_padded]`` logits (a view; the tensor itself when
    there is no padding, so that its gradient is not copied into a zero-padded one)."""
    return logits if logits.shape[-1] == vocab_size else logits[:, :vocab_size]


def response_targets(tokens: list[torch.Tensor], response_lengths: list[int]) -> torch.Tensor:
    return torch.cat([t[len(t) - r:].long() for t, r in zip(tokens, response_lengths)]) if tokens else torch.zeros(0, dtype=torch.long)

