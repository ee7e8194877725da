"""The shared argument checks of kvarn_cutlass._validate."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from kvarn_cutlass._validate import check_device, check_scale


@pytest.mark.parametrize("scale", [0.125, 3, np.float32(0.3), np.float64(1e-30), Fraction(1, 8), 1e300])
def test_check_scale_returns_the_float(scale):
    got = check_scale(scale)
    assert type(got) is float and got == float(scale)


@pytest.mark.parametrize("scale, exc", [
    (math.inf, ValueError), (-math.inf, ValueError), (math.nan, ValueError), (np.float32("nan"), ValueError),
    (0.0, ValueError), (-0.0, ValueError), (0, ValueError), (-0.5, ValueError),
    (True, TypeError), ("0.1", TypeError), (None, TypeError), (torch.tensor(0.1), TypeError), (1j, TypeError),
])
def test_check_scale_rejects_naming_the_argument(scale, exc):
    with pytest.raises(exc, match=r"^q_scale must be a positive finite number, got "):
        check_scale(scale, "q_scale")


@pytest.mark.parametrize("device", ["cpu", "cpu:0", torch.device("cpu", 0)])
def test_check_device_gives_the_device_of_tensors_made_there(device):
    got = check_device(device)
    assert got == torch.zeros(1, device=device).device == torch.device("cpu")
