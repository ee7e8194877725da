"""The shared argument checks of kvarn_cutlass._validate."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from kvarn_cutlass._validate import check_device, check_query, check_scale


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


QUERY = dict(batch=2, num_kv_heads=2, head_dim=64)


@pytest.mark.parametrize("shape, kw", [
    ((2, 2, 1, 64), dict(n_q=1)), ((2, 8, 1, 64), dict(n_q=1, max_group=4)), ((2, 6, 3, 64), dict(n_q=(1, 3))),
    ((2, 4, 1, 64), dict(n_q=(1, 1))), ((2, 16, 7, 64), dict(n_q=7)),
])
def test_check_query_accepts(shape, kw):
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        check_query(torch.zeros(shape, dtype=dtype), **QUERY, **kw)
    check_query(torch.zeros(shape, dtype=torch.float16), **QUERY, dtypes=(torch.float16,), **kw)


@pytest.mark.parametrize("q, kw, exc, match", [
    ("q", dict(n_q=1), TypeError, r"^qq must be a torch.Tensor, got str"),
    (torch.zeros(2, 2, 1, 64, dtype=torch.int32), dict(n_q=1), TypeError, r"^qq must be a floating-point tensor"),
    (torch.zeros(2, 2, 1, 64), dict(n_q=1, dtypes=(torch.float16, torch.bfloat16)), TypeError,
     r"^qq has dtype torch.float32; this entry point takes \[torch.float16, torch.bfloat16\]"),
    (torch.zeros(2, 2, 64), dict(n_q=1), ValueError, r"^qq must have shape \[batch=2, .*got \[2, 2, 64\]"),
    (torch.zeros(3, 2, 1, 64), dict(n_q=1), ValueError, r"^qq must have shape \[batch=2"),
    (torch.zeros(2, 3, 1, 64), dict(n_q=1), ValueError, r"a multiple of num_kv_heads=2"),
    (torch.zeros(2, 1, 1, 64), dict(n_q=1), ValueError, r"a multiple of num_kv_heads=2"),
    (torch.zeros(2, 10, 1, 64), dict(n_q=1, max_group=4), ValueError, r"\(1\.\.4 x num_kv_heads=2\)"),
    (torch.zeros(2, 2, 1, 32), dict(n_q=1), ValueError, r"head_dim=64\], got \[2, 2, 1, 32\]"),
    (torch.zeros(2, 2, 2, 64), dict(n_q=1, n_q_why="one query per sequence"), ValueError,
     r"n_q=1 \(one query per sequence\), head_dim=64\], got \[2, 2, 2, 64\]"),
    (torch.zeros(2, 2, 0, 64), dict(n_q=(1, 5), n_q_why="5 tokens held"), ValueError,
     r"^qq has n_q=0 queries; it must have 1 <= n_q <= 5 \(5 tokens held\)$"),
    (torch.zeros(2, 2, 6, 64), dict(n_q=(1, 5)), ValueError, r"^qq has n_q=6 queries; it must have 1 <= n_q <= 5$"),
])
def test_check_query_rejects_naming_the_argument(q, kw, exc, match):
    with pytest.raises(exc, match=match):
        check_query(q, **QUERY, name="qq", **kw)
