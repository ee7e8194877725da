"""The runtime's self-test kernel family (``csrc/selftest.cu``), used by tests and benchmarks.

Kernels and their launch signatures:

    kvarn_selftest_axpy          out[i] = alpha * x[i] + y[i]                 (AXPY_SIGNATURE)
    kvarn_selftest_mix           every scalar kind and a 16-byte struct      (MIX_SIGNATURE)
    kvarn_selftest_reverse       per-block reversal through dynamic smem     (REVERSE_SIGNATURE)
    kvarn_selftest_cluster_rank  block rank within its cluster (sm_90+)      (CLUSTER_RANK_SIGNATURE)
"""

from __future__ import annotations

import struct
from typing import Any

from .module import Module
from .registry import register
from .spec import KernelSpec, get_module

__all__ = [
    "SELFTEST",
    "AXPY_SIGNATURE",
    "MIX_SIGNATURE",
    "REVERSE_SIGNATURE",
    "CLUSTER_RANK_SIGNATURE",
    "mix_params",
    "selftest_module",
    "axpy",
]

SELFTEST = KernelSpec(
    "selftest.cu",
    ("kvarn_selftest_axpy", "kvarn_selftest_mix", "kvarn_selftest_reverse", "kvarn_selftest_cluster_rank"),
)
register("selftest", [SELFTEST])

AXPY_SIGNATURE = ("ptr out", "ptr x", "ptr y", "f32 alpha", "i64 n")
MIX_SIGNATURE = ("ptr out", "ptr x", "bytes:16 params", "i32 offset", "u32 stride", "f64 beta", "u64 n")
REVERSE_SIGNATURE = ("ptr out", "ptr x", "i32 chunk")
CLUSTER_RANK_SIGNATURE = ("ptr out",)

_AXPY_BLOCK = 256


def mix_params(scale: float, shift: int, bias0: float, bias1: float) -> bytes:
    """The 16-byte ``SelftestParams`` struct of ``kvarn_selftest_mix``: float, int32, float[2]."""
    return struct.pack("<fi2f", scale, shift, bias0, bias1)


def selftest_module(device: Any = None) -> Module:
    """The self-test module loaded on ``device`` (torch's current device when ``None``)."""
    return get_module(SELFTEST, device)


def axpy(x: "torch.Tensor", y: "torch.Tensor", alpha: float, out: "torch.Tensor | None" = None) -> "torch.Tensor":
    """``out = alpha * x + y`` on the GPU through the runtime.

    Args:
        x, y: float32 CUDA tensors of one shape, contiguous, on one device.
        alpha: Python float.
        out: optional float32 tensor like ``x``; allocated when ``None``.

    Returns:
        ``out``, shape of ``x``, float32.
    """
    import torch

    for argname, t in (("x", x), ("y", y)) + ((("out", out),) if out is not None else ()):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or not t.is_cuda or not t.is_contiguous():
            raise TypeError(f"{argname} must be a contiguous float32 CUDA tensor, got {getattr(t, 'dtype', type(t))}")
        if t.shape != x.shape or t.device != x.device:
            raise ValueError(f"{argname} has shape {tuple(t.shape)} on {t.device}; x has {tuple(x.shape)} on {x.device}")
    if out is None:
        out = torch.empty_like(x)
    n = x.numel()
    if n:
        kernel = selftest_module(x.device).kernel("kvarn_selftest_axpy", AXPY_SIGNATURE)
        blocks = min((n + _AXPY_BLOCK - 1) // _AXPY_BLOCK, 65535)  # grid-stride loop covers the rest
        kernel.launch(blocks, _AXPY_BLOCK, (out, x, y, alpha, n))
    return out
