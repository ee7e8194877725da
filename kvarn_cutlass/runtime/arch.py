"""GPU architecture names: parse the spellings users write, produce compiler targets.

An architecture is held as an int compute capability, major*10 + minor (90 for
H100/H200). The compiler target adds the ``a`` suffix (``sm_90a``) when a kernel
needs arch-specific instructions (wgmma, setmaxnreg); such a CUBIN loads only on
that exact architecture.
"""

from __future__ import annotations

import functools
import re

__all__ = ["MIN_ARCH", "normalize_arch", "arch_target", "device_arch"]

# cp.async, bf16 and int8 mma.sync with the shapes the kernels use need Ampere or newer.
MIN_ARCH = 80

_ARCH_RE = re.compile(r"^(?:sm_?)?(\d{2,3})(a?)$")
_DOTTED_RE = re.compile(r"^(\d{1,2})\.(\d)$")


def _parse(arch: str | int, argname: str) -> tuple[int, bool]:
    """(compute capability, arch-specific suffix present)."""
    if isinstance(arch, bool) or not isinstance(arch, (int, str)):
        raise TypeError(f"{argname} must be an int or str like 90, 'sm90', 'sm_90' or 'sm_90a', got {type(arch).__name__}")
    if isinstance(arch, int):
        cc, specific = arch, False
    else:
        text = arch.strip().lower()
        m = _ARCH_RE.match(text)
        d = _DOTTED_RE.match(text)
        if m:
            cc, specific = int(m.group(1)), m.group(2) == "a"
        elif d:
            cc, specific = int(d.group(1)) * 10 + int(d.group(2)), False
        else:
            raise ValueError(f"{argname}={arch!r} is not an architecture; expected e.g. 90, 'sm90', 'sm_90', 'sm_90a' or '9.0'")
    if cc < MIN_ARCH:
        raise ValueError(f"{argname}={arch!r}: kvarn-cutlass kernels need sm_{MIN_ARCH} or newer")
    if specific and cc < 90:
        raise ValueError(f"{argname}={arch!r}: arch-specific targets ('a' suffix) exist from sm_90 on")
    return cc, specific


def normalize_arch(arch: str | int) -> int:
    """Compute capability as an int: ``"sm90"``, ``"sm_90"``, ``"sm_90a"``, ``"90"``, ``"9.0"``, ``90`` -> ``90``.

    Raises:
        TypeError: ``arch`` is not an int or str.
        ValueError: unrecognized spelling, or older than ``sm_80``.
    """
    return _parse(arch, "arch")[0]


def arch_target(arch: str | int, arch_specific: bool = False) -> str:
    """Compiler target name: ``"sm_90"``, or ``"sm_90a"`` when ``arch`` says ``a`` or ``arch_specific`` is set.

    ``arch_specific`` is ignored below sm_90, where no arch-specific target exists.
    """
    cc, specific = _parse(arch, "arch")
    return f"sm_{cc}a" if (specific or arch_specific) and cc >= 90 else f"sm_{cc}"


def sm_count(device: "int | str | object | None" = None) -> int:
    """Streaming multiprocessors of a CUDA device (an index, ``cuda:N``, a ``torch.device``; torch's current device
    when ``None`` or without an index), read from the driver once per device (launch planning asks per call)."""
    import torch

    if isinstance(device, int) and not isinstance(device, bool):
        index = device
    else:
        index = None if device is None else torch.device(device).index
    return _sm_count_of(torch.cuda.current_device() if index is None else index)


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def device_arch(device: "int | str | object | None" = None) -> int:
    """Compute capability of a CUDA device (torch's current device when ``None``)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is available; pass an explicit arch to compile without a GPU")
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor
