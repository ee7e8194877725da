"""Exceptions raised by the GPU runtime, and the status checks that raise them.

Every cuda-bindings call returns ``(status, *values)``; the helpers here turn a
non-success status into an exception that names the call, the kernel and the
CUDA error string, so a failure deep in a launch path is diagnosable from the
message alone.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["CudaError", "CompileError", "check_driver", "check_nvrtc"]


class CudaError(RuntimeError):
    """A CUDA driver or NVRTC call returned an error status.

    Attributes:
        call: name of the API call, e.g. ``"cuLaunchKernelEx"``.
        code: the numeric status code.
        error_name: the symbolic name, e.g. ``"CUDA_ERROR_INVALID_VALUE"``.
        error_string: the human-readable description from ``cuGetErrorString``.
        kernel: the kernel involved, if any.
    """

    def __init__(self, call: str, code: int, error_name: str, error_string: str, kernel: str | None = None):
        self.call = call
        self.code = code
        self.error_name = error_name
        self.error_string = error_string
        self.kernel = kernel
        where = f" (kernel {kernel!r})" if kernel else ""
        super().__init__(f"{call} failed{where}: {error_name} ({code}): {error_string}")


class CompileError(RuntimeError):
    """Compilation of a CUDA source failed.

    Attributes:
        source_name: file name of the source (as given to the compiler).
        log: the full compiler log.
        options: the compiler options used.
    """

    def __init__(self, source_name: str, log: str, options: Sequence[str] = (), reason: str = "compilation failed"):
        self.source_name = source_name
        self.log = log
        self.options = tuple(options)
        super().__init__(
            f"{source_name}: {reason}\noptions: {' '.join(self.options)}\n--- compiler log ---\n{log.rstrip()}"
        )


def _driver_error_text(status: Any) -> tuple[str, str]:
    """(name, description) of a CUresult; falls back to the enum name when the driver is unavailable."""
    from cuda.bindings import driver

    name = getattr(status, "name", str(status))
    try:
        err, text = driver.cuGetErrorString(status)
    except Exception:  # the driver library may be missing (CPU machine); the enum name is still informative
        return name, name
    if err != driver.CUresult.CUDA_SUCCESS or text is None:
        return name, name
    return name, text.decode() if isinstance(text, bytes) else str(text)


def check_driver(result: tuple, call: str, kernel: str | None = None) -> Any:
    """Check the status of a cuda-bindings driver call; return its value(s).

    Args:
        result: the tuple returned by the call, ``(CUresult, *values)``.
        call: API name for the error message.
        kernel: kernel name for the error message.

    Returns:
        ``None`` for no values, the single value, or a tuple of values.
    """
    from cuda.bindings import driver

    status = result[0]
    if status != driver.CUresult.CUDA_SUCCESS:
        name, text = _driver_error_text(status)
        raise CudaError(call, int(status), name, text, kernel)
    return _values(result)


def check_nvrtc(result: tuple, call: str, kernel: str | None = None) -> Any:
    """Like :func:`check_driver` for NVRTC calls (``nvrtcGetErrorString`` gives the text)."""
    from cuda.bindings import nvrtc

    status = result[0]
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, text = nvrtc.nvrtcGetErrorString(status)
        name = getattr(status, "name", str(status))
        raise CudaError(call, int(status), name, text.decode() if isinstance(text, bytes) else str(text), kernel)
    return _values(result)


def _values(result: tuple) -> Any:
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]
