"""The peak behind ``speed/mfu``: each GPU, named as torch names it, maps to its dense bf16 peak
(flowrl.train.throughput.PEAK_TFLOPS), and every peak says where it comes from."""

from __future__ import annotations

import pytest
import torch

from flowrl.train import throughput

#: ``torch.cuda.get_device_name`` of each board -> its dense (not sparse) bf16 tensor-core TFLOP/s
NAMES = {
    "NVIDIA H100 80GB HBM3": 989.4,  # the SXM5 board
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.5,
    "NVIDIA H200": 989.4,
    "NVIDIA H200 NVL": 835.5,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA B200": 2250.0,
    "NVIDIA GB200": 2500.0,
    "NVIDIA L40S": 362.05,
    "NVIDIA L4": 121.0,
    "NVIDIA A10": 125.0,
    "NVIDIA A10G": 70.0,
    "NVIDIA GeForce RTX 4090": 165.2,
    "NVIDIA GeForce RTX 3090": 71.0,
    "NVIDIA L40": None,  # not in the table: no MFU rather than the L40S's or the L4's peak
    "NVIDIA H800": None,
    "Tesla T4": None,
}


@pytest.mark.parametrize("name", list(NAMES))
def test_each_device_name_maps_to_its_dense_bf16_peak(name, monkeypatch):
    monkeypatch.delenv("FLOWRL_PEAK_TFLOPS", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert throughput.peak_tflops(torch.device("cuda", 0)) == NAMES[name]


def test_the_override_and_a_cpu(monkeypatch):
    monkeypatch.delenv("FLOWRL_PEAK_TFLOPS", raising=False)
    assert throughput.peak_tflops(torch.device("cpu")) is None
    monkeypatch.setenv("FLOWRL_PEAK_TFLOPS", "123.5")
    assert throughput.peak_tflops(torch.device("cpu")) == 123.5


def test_every_peak_names_its_source_and_which_figure_is_sparse():
    assert set(throughput.PEAK_SOURCES) == set(throughput.PEAK_TFLOPS)
    for key, source in throughput.PEAK_SOURCES.items():
        assert "sparse" in source or "sparsity" in source or "Uncertain" in source, key
