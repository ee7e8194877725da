"""Row-wise normalized Walsh-Hadamard transform on the GPU (``csrc/rotate.cu``).

The transform is the codec's (:func:`kvarn_cutlass.codec.wht`: Sylvester order, butterflies at
strides 1, 2, ..., D/2, then one multiplication by float32(1/sqrt(D))) and is its own inverse, so
one kernel rotates queries into the KVarN domain and rotates attention outputs back. With
float32 output the result is bit-identical to ``codec.wht(x.float())``.
"""

from __future__ import annotations

import math

import torch

from ..format import HEAD_DIMS
from ..runtime.registry import register
from ..runtime.spec import KernelSpec, get_kernel

__all__ = ["WHT_SIGNATURE", "rotate_spec", "kernel_name", "wht", "rotate_queries", "unrotate_outputs"]

WHT_SIGNATURE = ("ptr x", "i64 x_row_stride", "ptr y", "i64 y_row_stride", "i64 rows", "f32 inv_sqrt_d")
_ROWS_PER_BLOCK = 8  # one warp per row, 256 threads
_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
# (input dtype, output dtype) pairs with a kernel
_PAIRS = (
    (torch.float16, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
)


def kernel_name(head_dim: int, in_dtype: torch.dtype, out_dtype: torch.dtype) -> str:
    return f"kvarn_wht_d{head_dim}_{_NAMES[in_dtype]}_{_NAMES[out_dtype]}"


def rotate_spec(head_dim: int) -> KernelSpec:
    """The module of the WHT kernels for one head_dim (all dtype pairs)."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim!r} is not supported; choose one of {list(HEAD_DIMS)}")
    return KernelSpec(
        "rotate.cu",
        tuple(kernel_name(head_dim, a, b) for a, b in _PAIRS),
        defines={"KVARN_D": head_dim},
        options=("--fmad=false",),
        name=f"rotate_d{head_dim}",
    )


register("rotate", lambda: [rotate_spec(d) for d in HEAD_DIMS])

def _kernel(device_index: int, head_dim: int, name: str):
    return get_kernel(rotate_spec(head_dim), name, WHT_SIGNATURE, device_index)


def _inv_sqrt(d: int) -> float:
    return float(torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32))


def wht(x: torch.Tensor, out_dtype: torch.dtype | None = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """Normalized WHT of every row of ``x`` along the last dim, on x's CUDA device and torch's current stream.

    Args:
        x: [..., D] float16/bfloat16/float32 CUDA tensor, D in 64/128/256; the last dim must be
            contiguous (other dims may be strided when they flatten to one row stride, else x is copied).
        out_dtype: float32 (default) or x.dtype (rounded to nearest even from the float32 result);
            ``None`` means x.dtype.
        out: optional output [..., D] of ``out_dtype`` on x's device, rows flattening to one stride.

    Returns:
        ``out`` (or a new tensor) [..., D] of ``out_dtype``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _NAMES:
        raise TypeError(f"x has dtype {x.dtype}; supported: float16, bfloat16, float32")
    if x.dim() < 1 or x.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"x must have shape [..., D] with D in {list(HEAD_DIMS)}, got {list(x.shape)}")
    if x.device.type != "cuda":
        raise ValueError(f"x is on {x.device}; wht needs a CUDA tensor (codec.wht is the CPU version)")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if (x.dtype, out_dtype) not in _PAIRS:
        raise TypeError(f"out_dtype={out_dtype} is not supported for x of {x.dtype}; use torch.float32 or {x.dtype}")
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.numel() and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    else:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.dtype != out_dtype or out.shape != x.shape or out.device != x.device:
            raise ValueError(
                f"out must be {out_dtype} {list(x.shape)} on {x.device}, got {out.dtype} {list(out.shape)} on {out.device}"
            )
    try:
        o2 = out.view(-1, D)
    except RuntimeError:
        raise ValueError(f"out (strides {out.stride()}) must flatten to rows of one stride with contiguous channels") from None
    if o2.numel() and o2.stride(-1) != 1:
        raise ValueError(f"out must have a contiguous last dim, got strides {out.stride()}")
    rows = x2.shape[0]
    if rows == 0:
        return out
    kernel = _kernel(x.device.index, D, kernel_name(D, x.dtype, out_dtype))
    blocks = (rows + _ROWS_PER_BLOCK - 1) // _ROWS_PER_BLOCK
    kernel.launch(blocks, 32 * _ROWS_PER_BLOCK, (x2, x2.stride(0), o2, o2.stride(0), rows, _inv_sqrt(D)))
    return out


def rotate_queries(q: torch.Tensor, out_dtype: torch.dtype | None = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """Queries [..., D] into the rotated (KVarN) domain: :func:`wht`."""
    return wht(q, out_dtype, out)


def unrotate_outputs(o: torch.Tensor, out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention outputs [..., D] from the rotated domain back (the WHT is its own inverse); default dtype: o's."""
    return wht(o, out_dtype, out)
