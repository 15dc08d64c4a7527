"""bench/common.py: the card a result was measured on names its file and its roofline (DEVICE.md's results format)."""

from __future__ import annotations

import pytest
import torch

from bench import common


@pytest.mark.parametrize("name,peak,of", [
    ("NVIDIA H200", 4.8e12, "NVIDIA H200"),
    ("NVIDIA H100 80GB HBM3", 3.35e12, "NVIDIA H100 80GB HBM3"),
    ("NVIDIA H100 PCIe", 2.0e12, "NVIDIA H100 PCIe"),
    ("NVIDIA H100 NVL", 3.9e12, "NVIDIA H100 NVL"),
    ("NVIDIA GH200 480GB", 4.8e12, "H200 (assumed; this is NVIDIA GH200 480GB)"),
    ("NVIDIA A100-SXM4-80GB", 4.8e12, "H200 (assumed; this is NVIDIA A100-SXM4-80GB)")])
def test_hbm_peak_is_the_cards_own_spec_or_named_as_assumed(name, peak, of):
    assert common.hbm_peak(name) == (peak, of)


@pytest.mark.parametrize("name,count,machine", [("NVIDIA H200", 1, "nvidia-h200"), ("NVIDIA H200", 2, "nvidia-h200-x2"),
                                                ("NVIDIA H100 80GB HBM3", 1, "nvidia-h100"),
                                                ("NVIDIA H100 80GB HBM3", 4, "nvidia-h100-x4"),
                                                ("NVIDIA GH200 480GB", 1, "NVIDIA GH200 480GB")])
def test_machine_name_and_roofline_follow_the_gpu(monkeypatch, name, count, machine):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)
    assert common.machine_name() == machine
    assert common.hbm_peak() == common.hbm_peak(name)


def test_without_a_gpu_the_roofline_is_named_as_assumed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert common.hbm_peak() == (4.8e12, "H200 (assumed; this is no GPU)")
    assert common.machine_name().startswith("cpu-")
