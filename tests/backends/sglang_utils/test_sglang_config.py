"""--sglang-config YAML: parsing, defaults, and errors that name the file, key path and bad value."""

from __future__ import annotations

import pytest

from slime.backends.sglang_utils.sglang_config import SGLangConfigError, load_sglang_config, models_from_args
from slime.arguments import parse_args
from slime.utils.passthrough import SGLANG_EXCLUDED

EXAMPLE = """
sglang:
  - name: actor
    server_groups:
      - worker_type: prefill
        num_gpus: 8
        num_gpus_per_engine: 4
        overrides: {mem_fraction_static: 0.8, chunked_prefill_size: 8192}
      - worker_type: decode
        num_gpus: 8
      - worker_type: placeholder
        num_gpus: 2
  - name: judge
    update_weights: false
    model_path: /ckpt/judge
    server_groups: [{worker_type: regular, num_gpus: 2, num_gpus_per_engine: 2}]
"""


def load(tmp_path, text, known=None):
    path = tmp_path / "engines.yaml"
    path.write_text(text)
    return load_sglang_config(str(path), default_model_path="/ckpt/actor", default_gpus_per_engine=8,
                              known_fields=known, owned_fields=SGLANG_EXCLUDED), str(path)


def test_example_parses_with_defaults(tmp_path):
    (actor, judge), _ = load(tmp_path, EXAMPLE)
    assert (actor.name, actor.model_path, actor.update_weights, actor.pd_disaggregation) == ("actor", "/ckpt/actor", True, True)
    assert [(g.worker_type, g.num_gpus, g.num_gpus_per_engine, g.num_engines) for g in actor.server_groups] == [
        ("prefill", 8, 4, 2), ("decode", 8, 8, 1), ("placeholder", 2, 8, 0)]
    assert actor.server_groups[0].overrides == {"mem_fraction_static": 0.8, "chunked_prefill_size": 8192}
    assert (judge.model_path, judge.update_weights, judge.pd_disaggregation, judge.num_gpus) == ("/ckpt/judge", False, False, 2)


@pytest.mark.parametrize("text,key_path,match", [
    ("sglang: []", "sglang", "non-empty list of models"),
    ("models: []", "<top level>", "the key 'sglang'"),
    ("sglang: [{name: a, server_groups: [{worker_type: prefil, num_gpus: 2}]}]",
     r"sglang\[0\]\.server_groups\[0\]\.worker_type", "'prefil' is not one of regular, prefill, decode, placeholder"),
    ("sglang: [{name: a, server_groups: [{num_gpus: 3, num_gpus_per_engine: 2}]}]",
     r"sglang\[0\]\.server_groups\[0\]\.num_gpus", "3 is not a multiple of num_gpus_per_engine 2"),
    ("sglang: [{name: a, server_groups: [{num_gpus: -1}]}]", r"sglang\[0\]\.server_groups\[0\]\.num_gpus",
     "positive integer, got -1"),
    ("sglang: [{name: a, server_groups: [{num_gpus: 8, gpus: 1}]}]", r"sglang\[0\]\.server_groups\[0\]",
     r"unknown keys \['gpus'\]"),
    ("sglang: [{name: a, update_weights: maybe, server_groups: [{num_gpus: 8}]}]", r"sglang\[0\]\.update_weights",
     "expected true or false, got 'maybe'"),
    ("sglang: [{name: a, server_groups: [{num_gpus: 8}]}, {name: a, server_groups: [{num_gpus: 8}]}]",
     r"sglang\[1\]\.name", "duplicate model name 'a'"),
    ("sglang: [{server_groups: [{num_gpus: 8}]}, {name: b, server_groups: [{num_gpus: 8}]}]", r"sglang\[0\]\.name",
     "needs a name"),
    ("sglang: [{name: a, server_groups: [{worker_type: prefill, num_gpus: 8}]}]", r"sglang\[0\]\.server_groups",
     "needs both prefill and decode"),
    ("sglang: [{name: a, server_groups: [{num_gpus: 8, overrides: {tp_size: 2}}]}]",
     r"sglang\[0\]\.server_groups\[0\]\.overrides\.tp_size", "set by slime"),
])
def test_errors_name_file_key_path_and_value(tmp_path, text, key_path, match):
    with pytest.raises(SGLangConfigError, match=rf"engines\.yaml: {key_path}: .*{match}"):
        load(tmp_path, text)


def test_override_names_checked_against_installed_sglang(tmp_path):
    text = "sglang: [{name: a, server_groups: [{num_gpus: 8, overrides: {mem_fraction_statc: 0.5}}]}]"
    with pytest.raises(SGLangConfigError, match="not a ServerArgs field .*did you mean 'mem_fraction_static'"):
        load(tmp_path, text, known={"mem_fraction_static", "context_length"})
    (model,), _ = load(tmp_path, text)  # without SGLang the name is forwarded as given
    assert model.server_groups[0].overrides == {"mem_fraction_statc": 0.5}


def test_flags_and_file_are_one_layout(tmp_path):
    base = ["--rollout-batch-size", "4", "--num-rollout", "2", "--train-backend", "fsdp", "--rollout-backend", "embedded",
            "--hf-checkpoint", "/ckpt/actor"]
    (model,) = models_from_args(parse_args(base + ["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2"]))
    assert [(g.worker_type, g.num_gpus) for g in model.server_groups] == [("regular", 4)]
    path = tmp_path / "engines.yaml"
    path.write_text(EXAMPLE)
    args = parse_args(base + ["--sglang-config", str(path), "--rollout-num-gpus", "20"])
    assert [m.name for m in models_from_args(args)] == ["actor", "judge"]
    with pytest.raises(ValueError, match="--sglang-config and --rollout-external-engine-addrs are mutually exclusive"):
        parse_args(base + ["--sglang-config", str(path), "--rollout-external-engine-addrs", "h:1"])
    with pytest.raises(FileNotFoundError, match="--sglang-config '/no/such.yaml' does not exist"):
        models_from_args(parse_args(base + ["--sglang-config", "/no/such.yaml"]))


def test_external_engines_cannot_be_colocated():
    with pytest.raises(ValueError, match="cannot be combined with --colocate"):
        parse_args(["--rollout-batch-size", "4", "--num-rollout", "2", "--train-backend", "fsdp",
                    "--rollout-external-engine-addrs", "10.0.0.5:30000", "--colocate"])
