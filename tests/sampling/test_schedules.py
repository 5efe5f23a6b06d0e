"""Schedules (docs/api.md §1)."""

import math

import numpy as np
import pytest
import torch

from flowrl.sampling.schedules import (
    exponential_time_shift,
    flux_dynamic_sigmas,
    flux_mu,
    shifted_sigmas,
    time_shift,
    validate_sigmas,
)

# docs/api.md §1, N = 16, s = 3, printed to 5 decimals.
REF_16_3 = [1.0, .97826, .95455, .92857, .9, .86842, .83333, .79412, .75, .7, .64286,
            .57692, .5, .40909, .3, .16667, 0.0]


def test_shifted_sigmas_reference_values():
    sig = shifted_sigmas(16, 3.0)
    assert sig.dtype == torch.float32 and sig.shape == (17,)
    # the reference is rounded to 5 decimals -> |error| <= 5e-6 (+ float32 rounding)
    assert torch.allclose(sig.double(), torch.tensor(REF_16_3, dtype=torch.float64), atol=6e-6, rtol=0)
    assert sig[0].item() == 1.0 and sig[-1].item() == 0.0


def test_shifted_sigmas_by_hand_n17():
    # sigma_1 = 3 (16/17) / (1 + 2 (16/17)) = 48/49 ; sigma_16 = 3 (1/17) / (1 + 2/17) = 3/19
    sig = shifted_sigmas(17, 3.0)
    assert abs(sig[1].item() - 48 / 49) < 1e-7
    assert abs(sig[16].item() - 3 / 19) < 1e-7


def test_shifted_sigmas_match_diffusers_fixed_shift():
    # independent computation: diffusers' scheduler applies the same SD3 shift to given sigmas
    from diffusers import FlowMatchEulerDiscreteScheduler

    n = 17
    sch = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sch.set_timesteps(sigmas=np.linspace(1.0, 1.0 / n, n).tolist())
    assert torch.allclose(sch.sigmas.float(), shifted_sigmas(n, 3.0), atol=1e-6, rtol=0)


def test_time_shift_fixed_points():
    t = time_shift(torch.tensor([0.0, 0.5, 1.0]), 3.0)
    # 0 -> 0, 1 -> 1, 0.5 -> 1.5 / 2 = 0.75
    assert t.tolist() == [0.0, 0.75, 1.0]


def test_flux_mu_by_hand():
    assert flux_mu(256) == pytest.approx(0.5, abs=1e-12)
    assert flux_mu(4096) == pytest.approx(1.15, abs=1e-12)
    # 720x720: (720/16)^2 = 2025 tokens; 0.5 + (2025 - 256) * 0.65 / 3840 = 0.79943359375
    assert flux_mu(2025) == pytest.approx(0.5 + 1769 * 0.65 / 3840, abs=1e-12)


@pytest.mark.parametrize("n,seq", [(17, 2025), (28, 4096), (4, 64)])
def test_flux_dynamic_sigmas_match_diffusers(n, seq):
    from diffusers import FlowMatchEulerDiscreteScheduler

    sch = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential",
    )
    sch.set_timesteps(sigmas=np.linspace(1.0, 1.0 / n, n).tolist(), mu=flux_mu(seq))
    ours = flux_dynamic_sigmas(n, seq)
    assert ours.dtype == torch.float32 and ours[-1].item() == 0.0
    assert torch.allclose(sch.sigmas.float(), ours, atol=1e-6, rtol=0)


def test_exponential_shift_is_fixed_shift_with_exp_mu():
    # exp(mu) / (exp(mu) + 1/t - 1) = e t / (1 + (e - 1) t)
    t = torch.linspace(1, 0, 11)
    assert torch.allclose(exponential_time_shift(t, 0.8), time_shift(t, math.exp(0.8)), atol=1e-7)


def test_validate_sigmas():
    ok = validate_sigmas([1.0, 0.5, 0.0])
    assert ok.dtype == torch.float32
    with pytest.raises(ValueError, match="strictly decreasing"):
        validate_sigmas([1.0, 0.5, 0.5, 0.0])
    with pytest.raises(ValueError, match="end exactly at 0"):
        validate_sigmas([1.0, 0.5, 0.1])
    with pytest.raises(ValueError, match="<= 1"):
        validate_sigmas([1.2, 0.5, 0.0])
    with pytest.raises(ValueError, match="1-D"):
        validate_sigmas([[1.0, 0.0]])
    with pytest.raises(ValueError, match="finite"):
        validate_sigmas([1.0, float("nan"), 0.0])
    with pytest.raises(ValueError, match="num_steps"):
        shifted_sigmas(0)
