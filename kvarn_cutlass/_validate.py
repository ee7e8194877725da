"""Argument checks shared by the entry points: each raises an exception that names the argument."""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["check_device", "check_query", "check_scale", "resolve_scale"]


def check_scale(scale, name: str = "scale") -> float:
    """``scale`` as a float, if it is a positive finite real number (a softmax scale, a multiplier).

    Raises TypeError naming ``name`` for a value that is not a real number (bools, strings, tensors)
    and ValueError for NaN, an infinity, zero or a negative value: an infinite softmax scale turns
    every score into +-inf or NaN, zero makes attention uniform and a negative one inverts it, all
    silently. ``None`` (a default such as ``head_dim ** -0.5``) is the caller's to resolve first.
    """
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{name} must be a positive finite number, got {type(scale).__name__}")
    value = float(scale)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {scale!r}")
    return value


def resolve_scale(scale, head_dim: int, name: str = "scale") -> float:
    """The softmax scale of an attention entry point: ``head_dim ** -0.5`` for None, else :func:`check_scale`."""
    return head_dim**-0.5 if scale is None else check_scale(scale, name)


def check_query(q, *, batch: int, num_kv_heads: int, head_dim: int, n_q: int | tuple[int, int],
                dtypes: tuple[torch.dtype, ...] | None = None, max_group: int | None = None,
                n_q_why: str = "", name: str = "q") -> None:
    """Validate the queries of an attention entry point: q [batch, num_kv_heads * group, n_q, head_dim].

    ``n_q``: the exact count of queries per sequence (part of the shape), or an inclusive ``(lo, hi)``
    range; ``n_q_why`` says in the error where that count comes from (e.g. "a chunk of 512 tokens").
    ``dtypes``: the accepted dtypes (None: any floating-point dtype). ``max_group``: the most query
    heads per KV head the caller serves (None: any multiple). Raises TypeError naming ``name`` for a
    non-tensor or a dtype outside ``dtypes``, ValueError naming it for a wrong shape or query count.
    Devices are the caller's to check (each entry point knows where its data lives).
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(q).__name__}")
    if dtypes is None:
        if not q.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {q.dtype}")
    elif q.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {q.dtype}; this entry point takes {list(dtypes)}")
    exact = isinstance(n_q, int)
    why = f" ({n_q_why})" if n_q_why else ""
    if (q.dim() != 4 or q.shape[0] != batch or q.shape[3] != head_dim or q.shape[1] < num_kv_heads
            or q.shape[1] % num_kv_heads or (max_group is not None and q.shape[1] // num_kv_heads > max_group)
            or (exact and q.shape[2] != n_q)):
        groups = "a multiple of" if max_group is None else f"1..{max_group} x"
        rows = f"n_q={n_q}{why}" if exact else "n_q"
        raise ValueError(f"{name} must have shape [batch={batch}, num_q_heads ({groups} num_kv_heads={num_kv_heads}), "
                         f"{rows}, head_dim={head_dim}], got {list(q.shape)}")
    if not exact and not n_q[0] <= q.shape[2] <= n_q[1]:
        raise ValueError(f"{name} has n_q={q.shape[2]} queries; it must have {n_q[0]} <= n_q <= {n_q[1]}{why}")


def check_device(device, name: str = "device") -> torch.device:
    """The device that tensors created with ``device=device`` get, as a ``torch.device``.

    Normalizes the spellings of one device to one value, so that comparing it with a tensor's
    ``.device`` works: ``"cpu:0"`` -> ``cpu`` (CPU tensors carry no index), ``"cuda"`` ->
    ``cuda:<current device>``, an int ``i`` -> ``cuda:i`` (torch's convention). Raises TypeError
    naming ``name`` for any other type, and ValueError naming it for an unknown device string or a
    device that torch cannot use here (``"cuda"`` on a CPU-only torch, a GPU index past the last one).
    """
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise TypeError(f"{name} must be a str, torch.device or CUDA device index, got {type(device).__name__}")
    try:
        requested = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{name}={device!r} is not a device: {e}") from None
    try:
        # an empty allocation resolves the index (CPU: none, CUDA: the current device) and checks availability
        return torch.empty(0, device=requested).device
    except (AssertionError, RuntimeError) as e:  # CPU-only torch builds raise AssertionError for "cuda"
        raise ValueError(f"{name}={device!r} cannot be used here ({str(e).strip() or type(e).__name__}); "
                         f"torch.cuda.is_available() is {torch.cuda.is_available()}") from None
