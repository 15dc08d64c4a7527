"""Checkpoints the embedded engine refuses at load rather than serving them wrong."""

from __future__ import annotations

import json
import shutil

import pytest

from slime.backends.embedded_engine.model_runner import ModelRunner


def test_sliding_window_attention_is_refused_by_name(tiny_model_dir, tmp_path):
    """A Qwen3 checkpoint whose first two layers attend through a 16-token sliding window: the engine's masks and
    flash-decoding kernel let every token see all earlier ones, so it would decode something else than the model;
    the load fails naming the layers, the window and the backend that serves it. The same checkpoint with the
    window unused (``use_sliding_window`` off, as Qwen3 ships) loads."""
    windowed = tmp_path / "windowed"
    shutil.copytree(tiny_model_dir, windowed)
    config = json.loads((windowed / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config.update(sliding_window=16, use_sliding_window=True, max_window_layers=2,
                  layer_types=["sliding_attention"] * 2 + ["full_attention"] * (layers - 2))
    (windowed / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"2 attention layers use a sliding window \(model.layers.0.self_attn: 16 "
                                         r"tokens\).*--rollout-backend sglang"):
        ModelRunner(str(windowed), num_slots=2, slot_capacity=64)
    config.update(use_sliding_window=False, layer_types=["full_attention"] * layers)
    (windowed / "config.json").write_text(json.dumps(config))
    runner = ModelRunner(str(windowed), num_slots=2, slot_capacity=64)
    assert runner.model.config.layer_types == ["full_attention"] * layers
