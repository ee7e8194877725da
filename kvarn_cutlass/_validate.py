"""Argument checks shared by the entry points: each raises an exception that names the argument."""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["check_device", "check_scale", "resolve_scale"]


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
