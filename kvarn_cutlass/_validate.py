"""Argument checks shared by the entry points: each raises an exception that names the argument."""

from __future__ import annotations

import torch

__all__ = ["check_device"]


def check_device(device, name: str = "device") -> torch.device:
    """The device that tensors created with ``device=device`` get, as a ``torch.device``.

    Normalizes the spellings of one device to one value, so that comparing it with a tensor's
    ``.device`` works: ``"cpu:0"`` -> ``cpu`` (CPU tensors carry no index), ``"cuda"`` ->
    ``cuda:<current device>``. Raises TypeError for a value that is not a device or a str, and
    ValueError naming ``name`` for an unknown device string or a device that torch cannot use
    here (``"cuda"`` on a CPU-only torch, a GPU index past the last one).
    """
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise TypeError(f"{name} must be a str or torch.device, got {type(device).__name__}")
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
