"""The Megatron backend's micro-batch layout (``model.micro_batch_inputs``) and its response rows.

The rows are checked against the tokens themselves: the row that predicts a response token is the
position just before it, in both flattened orders (``[b·s]`` logits, Megatron's ``[s·b]`` hidden
states), padded and packed.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slime.backends.megatron_utils.forward import micro_batch_inputs, response_logits

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import megatron_cpu  # noqa: E402

TOKENS = [torch.arange(10, 17), torch.arange(20, 24), torch.arange(30, 39)]
RESPONSES = [3, 2, 5]


def test_padded_rows_point_at_the_positions_predicting_the_response():
    inputs = micro_batch_inputs(TOKENS, RESPONSES, "cpu", packed=False, pad_multiple=4)
    n, length = inputs.input_ids.shape
    assert (n, length) == (3, 12)  # 9 tokens padded to a multiple of 4
    assert inputs.input_ids[1].tolist() == [20, 21, 22, 23] + [0] * 8
    assert inputs.position_ids.tolist() == [list(range(12))] * 3
    expected = torch.cat([t[-r:] for t, r in zip(TOKENS, RESPONSES)])
    assert inputs.targets.tolist() == expected.tolist()
    # the next position after each row holds the token that row predicts, in either order
    assert inputs.input_ids.reshape(-1)[inputs.rows_bs + 1].tolist() == expected.tolist()
    assert inputs.input_ids.t().reshape(-1)[inputs.rows_sb + n].tolist() == expected.tolist()
    assert inputs.starts == [0, 12, 24] and inputs.lengths == [7, 4, 9]


def test_every_device_tensor_comes_from_one_host_copy():
    inputs = micro_batch_inputs(TOKENS, RESPONSES, "cpu", packed=False)
    storages = {t.untyped_storage().data_ptr() for t in (inputs.input_ids, inputs.position_ids, inputs.targets,
                                                         inputs.rows_bs, inputs.rows_sb)}
    assert len(storages) == 1


def test_response_logits_picks_the_rows_and_cuts_the_vocabulary_padding():
    inputs = micro_batch_inputs(TOKENS, RESPONSES, "cpu", packed=False)
    n, length = inputs.input_ids.shape
    # logits whose value at (sample, position, column) encodes where it came from
    logits = torch.arange(n * length * 8, dtype=torch.float32).reshape(n, length, 8)
    picked = response_logits(logits, inputs, vocab_size=6)
    assert picked.shape == (10, 6)
    sample = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2])
    position = torch.tensor([3, 4, 5, 1, 2, 3, 4, 5, 6, 7])
    assert torch.equal(picked, logits[sample, position, :6])


def test_full_responses_cover_every_position_but_the_last():
    """The custom-loss layout: every token but the first is a target."""
    inputs = micro_batch_inputs(TOKENS, [len(t) - 1 for t in TOKENS], "cpu", packed=False)
    assert inputs.targets.tolist() == torch.cat([t[1:] for t in TOKENS]).tolist()


def test_bad_response_lengths_are_refused():
    with pytest.raises(ValueError, match="response lengths"):
        micro_batch_inputs(TOKENS, [3, 4, 5], "cpu", packed=False)  # the second sample has 4 tokens


PACKED_CHECK = """
import torch
from slime.backends.megatron_utils.forward import micro_batch_inputs
tokens = [torch.arange(10, 17), torch.arange(20, 24), torch.arange(30, 39)]
inputs = micro_batch_inputs(tokens, [3, 2, 5], "cpu", packed=True, pad_multiple=8)
expected = torch.cat([t[-r:] for t, r in zip(tokens, [3, 2, 5])])
assert inputs.input_ids.shape == (1, 24), inputs.input_ids.shape  # 20 tokens + a padding sequence of 4
assert inputs.position_ids[0].tolist() == list(range(7)) + list(range(4)) + list(range(9)) + list(range(4))
assert inputs.targets.tolist() == expected.tolist()
assert inputs.input_ids[0][inputs.rows_bs + 1].tolist() == expected.tolist()
assert torch.equal(inputs.rows_bs, inputs.rows_sb)
params = inputs.packed_seq_params
assert params.qkv_format == "thd" and params.max_seqlen_q == 9 and inputs.starts == [0, 7, 11]
# without Transformer Engine the boundaries are where only PackedCoreAttention reads them (Megatron's
# own thd RoPE, which loops over the samples, is not used)
assert params.cu_seqlens_q is None and params.sample_lengths == [7, 4, 9, 4]
cu = params.sample_cu_seqlens
assert cu.dtype == torch.int32 and cu.tolist() == [0, 7, 11, 20, 24]
print("ok")
"""


def test_packed_rows_and_boundaries():
    path = megatron_cpu.pythonpath()
    if path is None:
        pytest.skip("Megatron-Core's code is not unpacked in .venv/megatron-core (bash scripts/setup-env.sh does it)")
    env = {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", PACKED_CHECK], cwd=megatron_cpu.ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
