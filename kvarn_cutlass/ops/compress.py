"""GPU tile compression (``csrc/compress.cu``), byte-identical to :func:`kvarn_cutlass.codec.encode_tiles`.

One launch compresses every record of a layer. On sm_90 each (record, K or V half) runs on a
thread-block cluster of ``tile_tokens / 16`` CTAs of 256 threads (8 warps) that exchange their column sums
through distributed shared memory (latency: a layer of 8 records keeps 128 SMs busy); before sm_90,
and for launches of more halves than fit as clusters (:func:`cluster_halves`: over 32 cluster warps per
SM, ~33 records on an H200), on one CTA of 32 warps (16 for head_dim 256 and 64-token tiles:
:func:`default_cta_warps`). The cache's append kernels
(:mod:`kvarn_cutlass.ops.append`) have both forms too and choose by the same rule. The launch reads the
cluster width and CTA size from the compiled kernel, and each form's shared memory from the module
(:data:`SMEM_SYMBOLS`). Entry points:

* :func:`compress_tiles` - the codec's contract: k, v [..., T, D] -> uint8 records [..., tile_nbytes].
* :func:`compress_layer` - the cache's layout: k, v [B, H, n_tiles*T, D] (token-strided views are
  fine) -> records [B, n_tiles, H, tile_nbytes], optionally written straight into a pool slice.

Quantizers. ``spec.quantizer`` is compiled into the kernel (``KVARN_QUANT``; lloyd_max modules
carry the decision thresholds of :func:`kvarn_cutlass.format.lloyd_max_thresholds` as exact float
literals and their kernel names end in ``_lm``), so each quantizer has its own cached module and the
uniform module is the same binary as before the option existed. Both follow the codec's order of
operations: lloyd_max takes each axis's mean and sum of squares as the codec's halving trees, the
RMS with a correctly rounded float32 sqrt.

Errors. The codec raises ValueError for non-finite input, for input magnitudes above 2^48 and when a
stored scale is not finite in ``scale_dtype`` (float16 overflow). The kernel reports these as bits
of an int32 error flag (see the table in ``compress.cu``). By default the wrapper reads the flag
back after the launch (one 4-byte device-to-host copy, which synchronizes with the stream: the
only host sync of the op) and raises the codec's ValueError; the returned records are then never
seen. Pass ``error_flag`` (a zeroed int32 CUDA tensor) to skip the sync: the kernel ORs its bits
into it and :func:`check_error_flag` raises later. A block whose input is rejected writes nothing;
other blocks of the launch still write their records, so on error ``out`` holds unspecified bytes.

Signed zeros (a limit of byte identity): the codec's ``amin``/``amax`` on a set holding both
-0.0 and +0.0 as its extreme returns either sign depending on torch's vectorization (the length
and position in the reduction, the CPU's SIMD width), so ``chan_min``/``tok_min``/steps of an
all-zero row or channel with mixed-sign zeros are not defined bit for bit by the codec. The kernel
takes IEEE 754-2019 minimum/maximum (-0 < +0). Inputs without -0.0 never produce -0.0 in the
rotated domain for float16 input (nor for bfloat16/float32 input away from float32 underflow).

Square roots: the kernel's RMS uses a correctly rounded sqrt (``__fsqrt_rn``); ``codec._rms`` takes
the square root in float64 and rounds it to float32, which is also correctly rounded (torch's float32
sqrt on MKL builds is not: it was 1 ulp low in ~0.7% of results and made float32-scale records differ,
until the codec switched). Records are byte-identical for float16 and float32 scales (H200,
2026-11-30: tests/test_compress.py; tests/test_compress_emulation.py mirrors the kernel on the CPU).
"""

from __future__ import annotations

import functools
import math
import os
import threading
import weakref

import torch

from .. import codec
from ..format import HEAD_DIMS, PRESETS, QUANTIZERS, SCALE_DTYPES, TileSpec, codebook, lloyd_max_thresholds
from ..runtime.arch import arch_target, device_arch, sm_count
from ..runtime.compiler import cubin_global
from ..runtime.registry import register
from ..runtime.spec import KernelSpec, build, get_kernel

__all__ = [
    "COMPRESS_SIGNATURE",
    "LAYER_ROLES",
    "ERROR_BITS",
    "ERROR_BITS_LLOYD_MAX",
    "compress_spec",
    "kernel_name",
    "SMEM_SYMBOLS",
    "kernel_smem_bytes",
    "cluster_halves",
    "cluster_warps",
    "CLUSTER_WARPS",
    "cta_warps",
    "CTA_WARPS",
    "default_cta_warps",
    "compress_tiles",
    "compress_layer",
    "check_error_flag",
    "error_message",
]

# Warps of a lone CTA (the one-CTA forms; compress.cu's KVARN_OW): 32 for 128-token tiles up to head_dim 128 (eight
# warps a scheduler for launches of more halves than clusters: b16 prefill chunks; measured 0.93-0.97x the 16-warp
# time), else 16 (a thread of 1024 may hold 64 registers: at head_dim 256 its state spills, and 64-token tiles at
# head_dim 64 park a value in local memory and were not measured); $KVARN_COMPRESS_CTA_WARPS (cta_warps) picks the
# other width for A/B runs where it compiles.
CTA_WARPS = (16, 32)
CTA_WARPS_ENV = "KVARN_COMPRESS_CTA_WARPS"
CTA_WARPS_MAX_HEAD_DIM = {16: 256, 32: 128}


def default_cta_warps(tile_tokens: int, head_dim: int) -> int:
    """Warps of a lone CTA the compression kernels ship with for (``tile_tokens``, ``head_dim``): 32 for
    128-token tiles where it compiles (:data:`CTA_WARPS_MAX_HEAD_DIM`), else 16."""
    return 32 if tile_tokens == 128 and head_dim <= CTA_WARPS_MAX_HEAD_DIM[32] else 16


# Warps per CTA of the cluster forms (compress.cu's KVARN_CW): the shipped 8, and the A/B variants 4 and 16
# (one, two or four independent chains per scheduler), chosen with $KVARN_COMPRESS_CLUSTER_WARPS (cluster_warps).
DEFAULT_CLUSTER_WARPS = 8
CLUSTER_WARPS = (4, 8, 16)
CLUSTER_WARPS_ENV = "KVARN_COMPRESS_CLUSTER_WARPS"
_IN_CODE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
_IN_NAME = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
_SC_BITS = {torch.float16: 16, torch.float32: 32}

COMPRESS_SIGNATURE = (
    "ptr k", "ptr v",
    "i64 k_sb", "i64 k_sh", "i64 k_st",
    "i64 v_sb", "i64 v_sh", "i64 v_st",
    "ptr out", "i64 o_sb", "i64 o_si", "i64 o_sh",
    "i32 n_heads", "i32 n_tiles", "i32 iters",
    "i32 off_k_codes", "i32 off_chan_step", "i32 off_chan_min", "i32 off_row_scale",
    "i32 off_v_codes", "i32 off_tok_step", "i32 off_tok_min", "i32 off_col_scale",
    "f32 inv_sqrt_d", "ptr err",
)
_SECTIONS = ("k_codes", "chan_step", "chan_min", "row_scale", "v_codes", "tok_step", "tok_min", "col_scale")

# Error flag bits, in the order the codec would raise (input checks of k, then of v, then the
# stores of the K half, then of the V half): (bit, message). Within a half, uniform stores the step
# before the min; lloyd_max stores the min (the mean, which the RMS needs) before the step.
ERROR_BITS: tuple[tuple[int, str], ...] = (
    (1 << 6, "k contains NaN or Inf"),
    (1 << 7, "k has values of magnitude > 2^48, outside the codec's float32 range"),
    (1 << 8, "v contains NaN or Inf"),
    (1 << 9, "v has values of magnitude > 2^48, outside the codec's float32 range"),
    (1 << 0, "K row_scale"),
    (1 << 1, "K chan step"),
    (1 << 2, "K chan min"),
    (1 << 3, "V col_scale"),
    (1 << 4, "V tok step"),
    (1 << 5, "V tok min"),
)
# The same bits in the lloyd_max codec's order.
ERROR_BITS_LLOYD_MAX: tuple[tuple[int, str], ...] = (
    *ERROR_BITS[:5],
    (1 << 2, "K chan min"),
    (1 << 1, "K chan step"),
    (1 << 3, "V col_scale"),
    (1 << 5, "V tok min"),
    (1 << 4, "V tok step"),
)
_INPUT_BITS = (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9)


_QUANT_CODE = {"uniform": 0, "lloyd_max": 1}
_QUANT_SUFFIX = {"uniform": "", "lloyd_max": "_lm"}


def kernel_name(
    tile_tokens: int, head_dim: int, in_dtype: torch.dtype, scale_dtype: torch.dtype, v_bits: int,
    quantizer: str = "uniform", role: str = "compress",
) -> str:
    """The symbol of a kernel of the module; ``role``: one of :data:`LAYER_ROLES` (the codec's
    contract: ``compress``, a thread-block cluster per record half on sm_90, and ``compress_cta``, one
    CTA per half) or, in the modules of the cache dtypes float16 / bfloat16 only, one of
    :data:`APPEND_ROLES` (the cache's append, :mod:`kvarn_cutlass.ops.append`: ``append_compress``
    one CTA per record half, ``append_compress_cluster`` a cluster per half on sm_90)."""
    return (
        f"kvarn_{role}_t{tile_tokens}_d{head_dim}_{_IN_NAME[in_dtype]}_s{_SC_BITS[scale_dtype]}_v{v_bits}"
        f"{_QUANT_SUFFIX[quantizer]}"
    )


# The layer kernels of every module, and the append kernels in the modules of the cache dtypes
# (compress.cu, the append section).
LAYER_ROLES = ("compress", "compress_cta")
APPEND_ROLES = ("append_compress", "append_compress_cluster", "append_commit", "append_snapshot")
APPEND_DTYPES = (torch.float16, torch.bfloat16)


def _float_literals(values) -> str:
    """C float literals, comma-separated, exact (every value is a float32; hex keeps all bits)."""
    return ",".join(f"{float(x).hex()}f" for x in values)


def cluster_warps() -> int:
    """Warps per cluster CTA of the compression kernels to launch: DEFAULT_CLUSTER_WARPS, or
    ``$KVARN_COMPRESS_CLUSTER_WARPS`` (one of :data:`CLUSTER_WARPS`; A/B runs: tools/compress_variants.py)."""
    text = os.environ.get(CLUSTER_WARPS_ENV, "").strip()
    if not text:
        return DEFAULT_CLUSTER_WARPS
    if text not in {str(w) for w in CLUSTER_WARPS}:
        raise ValueError(f"${CLUSTER_WARPS_ENV}={text!r}: choose one of {list(CLUSTER_WARPS)}")
    return int(text)


def cta_warps(tile_tokens: int, head_dim: int) -> int:
    """Warps of a lone CTA of the compression kernels to launch for (``tile_tokens``, ``head_dim``):
    :func:`default_cta_warps`, or
    ``$KVARN_COMPRESS_CTA_WARPS`` (one of :data:`CTA_WARPS`; A/B runs: tools/compress_variants.py) where that
    width compiles for the head_dim (:data:`CTA_WARPS_MAX_HEAD_DIM`; a wider head_dim keeps the default)."""
    text = os.environ.get(CTA_WARPS_ENV, "").strip()
    if not text:
        return default_cta_warps(tile_tokens, head_dim)
    if text not in {str(w) for w in CTA_WARPS}:
        raise ValueError(f"${CTA_WARPS_ENV}={text!r}: choose one of {list(CTA_WARPS)}")
    return int(text) if head_dim <= CTA_WARPS_MAX_HEAD_DIM[int(text)] else default_cta_warps(tile_tokens, head_dim)


@functools.lru_cache(maxsize=None)
def compress_spec(
    tile_tokens: int, head_dim: int, in_dtype: torch.dtype, scale_dtype: torch.dtype, v_bits: int,
    quantizer: str = "uniform", cluster_warps: int = DEFAULT_CLUSTER_WARPS, cta_warps: int | None = None,
) -> KernelSpec:
    """The one-kernel module for a (T, D, input dtype, scale dtype, V bits, quantizer) variant.

    The quantizer is compiled in (``KVARN_QUANT``), with the lloyd_max decision thresholds of
    :func:`kvarn_cutlass.format.lloyd_max_thresholds` and the codebook of
    :func:`kvarn_cutlass.format.codebook` (the refit's sums) as defines, so the kernel cache keys of the
    two quantizers differ and both have one source. The uniform module has neither.
    ``cluster_warps`` (one of :data:`CLUSTER_WARPS`): warps per CTA of the cluster forms, compiled in
    (``KVARN_CW``); a value other than DEFAULT_CLUSTER_WARPS is named (``_cw4``) as an A/B variant.
    ``cta_warps`` (one of :data:`CTA_WARPS`, up to its :data:`CTA_WARPS_MAX_HEAD_DIM`; None:
    :func:`default_cta_warps`): warps of the one-CTA forms (``KVARN_OW``), named (``_ow16``) when not the default.
    The records are the same bytes for every value of either.
    """
    if cluster_warps not in CLUSTER_WARPS:
        raise ValueError(f"cluster_warps must be one of {list(CLUSTER_WARPS)}, got {cluster_warps!r}")
    if cta_warps is None:
        cta_warps = default_cta_warps(tile_tokens, head_dim)
    if cta_warps not in CTA_WARPS:
        raise ValueError(f"cta_warps must be one of {list(CTA_WARPS)}, got {cta_warps!r}")
    if head_dim > CTA_WARPS_MAX_HEAD_DIM[cta_warps]:
        raise ValueError(f"cta_warps={cta_warps} compiles only up to head_dim {CTA_WARPS_MAX_HEAD_DIM[cta_warps]} "
                         f"(registers), got head_dim={head_dim}")
    defines = {
        "KVARN_T": tile_tokens,
        "KVARN_D": head_dim,
        "KVARN_IN": _IN_CODE[in_dtype],
        "KVARN_SC": _SC_BITS[scale_dtype],
        "KVARN_VB": v_bits,
        "KVARN_QUANT": _QUANT_CODE[quantizer],
    }
    if quantizer == "lloyd_max":
        for bits in (4, 2) if v_bits == 2 else (4,):  # K codes are 4-bit
            defines[f"KVARN_LM_THR{bits}"] = _float_literals(lloyd_max_thresholds(bits))
            defines[f"KVARN_LM_BOOK{bits}"] = _float_literals(codebook("lloyd_max", bits))
    defines["KVARN_CW"] = cluster_warps
    defines["KVARN_OW"] = cta_warps
    name = f"compress_t{tile_tokens}_d{head_dim}_{_IN_NAME[in_dtype]}_s{_SC_BITS[scale_dtype]}_v{v_bits}"
    roles = LAYER_ROLES + (APPEND_ROLES if in_dtype in APPEND_DTYPES else ())
    names = tuple(kernel_name(tile_tokens, head_dim, in_dtype, scale_dtype, v_bits, quantizer, role) for role in roles)
    return KernelSpec(
        "compress.cu",
        names,
        defines=defines,
        # Belt and braces: the source already spells every operation as a correctly rounded intrinsic.
        options=("--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true"),
        name=name + _QUANT_SUFFIX[quantizer] + ("" if cluster_warps == DEFAULT_CLUSTER_WARPS else f"_cw{cluster_warps}")
        + ("" if cta_warps == default_cta_warps(tile_tokens, head_dim) else f"_ow{cta_warps}"),
    )


def _all_specs() -> list[KernelSpec]:
    out = []
    for quantizer in QUANTIZERS:
        for t, vb in sorted({(T, vb) for (_, vb, T) in PRESETS.values()}, reverse=True):
            for d in HEAD_DIMS:
                for ind in _IN_CODE:
                    for sd in SCALE_DTYPES:
                        out.append(compress_spec(t, d, ind, sd, vb, quantizer))
    return out


register("compress", _all_specs)


# The module globals in which compress.cu reports the dynamic shared memory per CTA of each launch
# form (its Shape<T, D, R>::kSmemBytes): ``compress``, the cluster forms as compiled (a cluster CTA on
# sm_90, one CTA before: the layer kernel and the append's append_compress_cluster); ``compress_cta``,
# one CTA of 32 x KVARN_OW threads (the one-CTA layer kernel and the append's append_compress).
SMEM_SYMBOLS = {"compress": "kvarn_compress_smem_bytes", "compress_cta": "kvarn_compress_cta_smem_bytes"}


def kernel_smem_bytes(cubin: bytes) -> dict[str, int]:
    """Launch form (a key of :data:`SMEM_SYMBOLS`) -> dynamic shared memory per CTA, as a compiled
    compression module reports it (no GPU needed)."""
    return {form: int.from_bytes(cubin_global(cubin, symbol)[:4], "little", signed=True)
            for form, symbol in SMEM_SYMBOLS.items()}


def _inv_sqrt(d: int) -> float:
    # The codec's constant: float32(1 / sqrt(D)) rounded from the Python double.
    return float(torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32))


# --- error flags ----------------------------------------------------------------------------------
def error_message(bits: int, scale_dtype: torch.dtype, quantizer: str = "uniform") -> str:
    """The codec's ValueError message for the first error (in the order the codec of ``quantizer``
    checks) among ``bits``."""
    if quantizer not in _QUANT_CODE:
        raise ValueError(f"quantizer={quantizer!r} is not supported; choose one of {list(QUANTIZERS)}")
    for bit, what in ERROR_BITS_LLOYD_MAX if quantizer == "lloyd_max" else ERROR_BITS:
        if bits & bit:
            if bit & _INPUT_BITS:
                return what
            return f"{what} overflows {scale_dtype}: the input's magnitude needs scale_dtype=torch.float32"
    raise ValueError(f"error flag {bits:#x} has no known bit")


def check_error_flag(flag: torch.Tensor, spec: TileSpec) -> None:
    """Raise the codec's ValueError if the int32 ``flag`` filled by compression launches is nonzero.

    Reads the flag back (synchronizes with the current stream).
    """
    bits = int(flag.reshape(-1)[0].item())
    if bits:
        raise ValueError(error_message(bits, spec.scale_dtype, spec.quantizer))


_flags: dict[tuple[int, int], torch.Tensor] = {}
_lock = threading.Lock()


def _stream_flag(device: torch.device) -> torch.Tensor:
    """A zeroed int32 flag per (device, stream); it stays zero between calls (reset on error)."""
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    flag = _flags.get(key)
    if flag is None:
        with _lock:
            flag = _flags.get(key)
            if flag is None:
                flag = _flags[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return flag


def _kernel(device_index: int, spec: KernelSpec, role: str = "compress"):
    return get_kernel(spec, spec.kernel_names[LAYER_ROLES.index(role)], COMPRESS_SIGNATURE, device_index)


_smem: dict[tuple[int, str], dict[str, int]] = {}


def _module_smem_bytes(spec: KernelSpec, device_index: int) -> dict[str, int]:
    """:func:`kernel_smem_bytes` of the CUBIN that ``spec``'s module loads on the device, read once
    per (device, module)."""
    key = (device_index, spec.name)
    smem = _smem.get(key)
    if smem is None:
        cubin = build(spec, arch_target(device_arch(device_index), spec.arch_specific)).cubin
        smem = _smem[key] = kernel_smem_bytes(cubin)
    return smem


# Keyed by the Kernel itself: the cluster-warps variants share function names across their modules.
_layouts: "weakref.WeakKeyDictionary[object, tuple[int, int]]" = weakref.WeakKeyDictionary()
# Clusters pay for their latency with repeated per-rank work (each rank's warps redo the row RMS and
# score steps): ~1.8x the instructions of one CTA per half. A cluster CTA of the shipped 8 warps (64
# registers at D=128, sm_90, 2026-12) fits 4 times per SM by registers; past that a launch is
# throughput-bound and the one-CTA kernel is faster. Counted in warps: 32 cluster warps per SM (4 CTAs of
# 8 warps, 8 of 4, 2 of 16), so a 512-token chunk of 8 KV heads (64 halves) runs as clusters: its
# appends took 1.444 ms per 16k prompt as 8-warp clusters against 1.704 one-CTA, after GEMMs
# (docs/perf-notes.md "Compression with more warps per cluster CTA: measured").
_CLUSTER_WARPS_PER_SM = 32


def cluster_halves(ranks: int, device_index: int, threads: int = 32 * DEFAULT_CLUSTER_WARPS) -> int:
    """The most record halves one launch runs as thread-block clusters of ``ranks`` CTAs of ``threads`` on the
    device (``_CLUSTER_WARPS_PER_SM`` cluster warps per SM); a launch of more halves takes the one-CTA form."""
    return max(1, _CLUSTER_WARPS_PER_SM * 32 // threads) * sm_count(device_index) // ranks


def _layer_layout(kernel) -> tuple[int, int]:
    """(CTAs per record half, threads per CTA) of a compression kernel (the layer kernel, the append's
    append_compress_cluster, or a one-CTA form), as compiled: its cluster width (sm_90: T / 16 CTAs of 32 x
    KVARN_CW threads; without a cluster, one CTA of 32 x KVARN_OW)."""
    layout = _layouts.get(kernel)
    if layout is None:
        ranks = max(1, int(kernel.attribute("REQUIRED_CLUSTER_WIDTH")))
        layout = _layouts[kernel] = (ranks, int(kernel.attribute("MAX_THREADS_PER_BLOCK")))
    return layout


# --- validation -----------------------------------------------------------------------------------
def _check_spec(spec) -> None:
    if not isinstance(spec, TileSpec):
        raise TypeError(f"spec must be a kvarn_cutlass.TileSpec, got {type(spec).__name__}")


def _check_input(name: str, x, spec: TileSpec, layer: bool) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in codec.FLOAT_INPUT_DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}; supported: {list(codec.FLOAT_INPUT_DTYPES)}")
    T, D = spec.tile_tokens, spec.head_dim
    if layer:
        if x.dim() != 4 or x.shape[-1] != D or x.shape[2] % T:
            raise ValueError(
                f"{name} must have shape [batch, heads, n_tiles*{T}, {D}] (a multiple of tile_tokens={T} tokens, "
                f"head_dim={D}), got {list(x.shape)}"
            )
    elif x.dim() < 2 or tuple(x.shape[-2:]) != (T, D):
        raise ValueError(f"{name} must have shape [..., {T}, {D}] (tile_tokens, head_dim), got {list(x.shape)}")


def _check_pair(k, v) -> None:
    for name, x in (("k", k), ("v", v)):
        if x.device.type != "cuda":
            raise ValueError(f"{name} is on {x.device}; GPU compression needs CUDA tensors (codec.encode_tiles runs anywhere)")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
    if k.device != v.device:
        raise ValueError(f"k and v must be on one device, got {k.device} and {v.device}")


def _same_dtype(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # One kernel reads both halves with one input type; float32 holds f16 and bf16 exactly.
    if k.dtype != v.dtype:
        return k.float(), v.float()
    return k, v


def _check_out(out, shape: tuple[int, ...], device: torch.device, spec: TileSpec) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != torch.uint8 or tuple(out.shape) != shape or out.device != device:
        raise ValueError(
            f"out must be uint8 {list(shape)} on {device} (tile_nbytes={spec.tile_nbytes}), "
            f"got {out.dtype} {list(out.shape)} on {out.device}"
        )
    if out.numel() == 0:
        return
    if out.stride(-1) != 1 or out.data_ptr() % 16:
        raise ValueError(f"out must have contiguous records starting at 16-byte aligned addresses, got strides {out.stride()}")
    for d in range(out.dim() - 1):
        if out.shape[d] > 1 and out.stride(d) % 16:
            raise ValueError(f"out's record strides must be multiples of 16 bytes, got strides {out.stride()}")


def _resolve_flag(error_flag, device: torch.device) -> tuple[torch.Tensor, bool]:
    if error_flag is None:
        return _stream_flag(device), True
    if (
        not isinstance(error_flag, torch.Tensor) or error_flag.dtype != torch.int32
        or error_flag.device != device or error_flag.numel() < 1
    ):
        raise ValueError(f"error_flag must be an int32 tensor with >= 1 element on {device}")
    return error_flag, False


# --- launch ---------------------------------------------------------------------------------------
_smem_limits: dict[int, int] = {}


def _smem_limit(index: int) -> int:
    limit = _smem_limits.get(index)
    if limit is None:
        props = torch.cuda.get_device_properties(index)
        # sm_80: 163 KiB, sm_90: 227 KiB opt-in per block
        limit = getattr(props, "shared_memory_per_block_optin", 0) or (227 if props.major >= 9 else 163) * 1024
        _smem_limits[index] = limit
    return limit


def _launch(k, v, kstr, vstr, out, ostr, B, n_tiles, H, spec: TileSpec, flag: torch.Tensor) -> None:
    n_records = B * n_tiles * H
    if n_records == 0:
        return
    if n_records > 2**31 - 1:
        raise ValueError(f"{n_records} records exceed one launch's grid (2^31 - 1)")
    T, D = spec.tile_tokens, spec.head_dim
    kspec = compress_spec(T, D, k.dtype, spec.scale_dtype, spec.v_bits, spec.quantizer, cluster_warps(), cta_warps(T, D))
    index = k.device.index
    kernel = _kernel(index, kspec)
    ranks, threads = _layer_layout(kernel)
    form = "compress"
    if ranks > 1 and 2 * n_records > cluster_halves(ranks, index, threads):
        kernel, form = _kernel(index, kspec, "compress_cta"), "compress_cta"
        ranks, threads = _layer_layout(kernel)
    if n_records * ranks > 2**31 - 1:
        raise ValueError(f"{n_records} records of {ranks} CTAs each exceed one launch's grid (2^31 - 1)")
    smem = _module_smem_bytes(kspec, index)[form]
    limit = _smem_limit(k.device.index)
    if smem > limit:
        raise ValueError(f"compression of T={T}, D={D} needs {smem} bytes of shared memory per block, {k.device} has {limit}")
    offsets = [spec.offset(s) for s in _SECTIONS]
    args = (k, v, *kstr, *vstr, out, *ostr, H, n_tiles, spec.sinkhorn_iters, *offsets, _inv_sqrt(D), flag)
    kernel.launch((n_records * ranks, 2), threads, args, shared_mem=smem)


def _finish(flag: torch.Tensor, sync_check: bool, spec: TileSpec) -> None:
    if not sync_check:
        return
    bits = int(flag.item())
    if bits:
        flag.zero_()
        raise ValueError(error_message(bits, spec.scale_dtype, spec.quantizer))


def compress_tiles(
    k: torch.Tensor,
    v: torch.Tensor,
    spec: TileSpec,
    out: torch.Tensor | None = None,
    *,
    error_flag: torch.Tensor | None = None,
) -> torch.Tensor:
    """Encode tiles of K and V into records on the GPU; the contract of :func:`codec.encode_tiles`.

    Args:
        k, v: [..., tile_tokens, head_dim] float16/bfloat16/float32 CUDA tensors of one shape and
            device (different dtypes are read as float32, which is exact). Any strides with a
            contiguous last dim that flatten to [records, T, D] without a copy; others are copied.
        spec: the :class:`TileSpec` (preset, head_dim, scale dtype, sinkhorn_iters, quantizer).
        out: optional uint8 [..., tile_nbytes] on the same device: contiguous records at 16-byte
            aligned addresses and strides.
        error_flag: optional zeroed int32 CUDA tensor; when given, errors are OR-ed into it and
            not checked here (no host sync): call :func:`check_error_flag` before using the records.

    Returns:
        uint8 [..., tile_nbytes], byte-identical to ``codec.encode_tiles(k, v, spec)``.

    Raises:
        TypeError / ValueError: bad arguments (naming them), or the codec's ValueError for
        non-finite or too large input and scale overflow (without ``error_flag``).
    """
    _check_spec(spec)
    _check_input("k", k, spec, layer=False)
    _check_input("v", v, spec, layer=False)
    _check_pair(k, v)
    k, v = _same_dtype(k, v)
    T, D, nb = spec.tile_tokens, spec.head_dim, spec.tile_nbytes
    lead = tuple(k.shape[:-2])
    k3 = k.reshape(-1, T, D)
    v3 = v.reshape(-1, T, D)
    if k3.stride(-1) != 1:
        k3 = k3.contiguous()
    if v3.stride(-1) != 1:
        v3 = v3.contiguous()
    if out is None:
        out = torch.empty(lead + (nb,), dtype=torch.uint8, device=k.device)
    else:
        _check_out(out, lead + (nb,), k.device, spec)
    try:
        o2 = out.view(-1, nb)
    except RuntimeError:
        raise ValueError(f"out (strides {out.stride()}) must flatten to [records, tile_nbytes] without a copy") from None
    flag, sync_check = _resolve_flag(error_flag, k.device)
    R = k3.shape[0]
    # records as (batch=1, tile=0, head=r): input offset r * stride(0) + t * stride(1), output r * nb
    _launch(
        k3, v3, (0, k3.stride(0), k3.stride(1)), (0, v3.stride(0), v3.stride(1)),
        o2, (0, 0, o2.stride(0) if R > 1 else nb), 1, 1, R, spec, flag,
    )
    _finish(flag, sync_check, spec)
    return out


def compress_layer(
    k: torch.Tensor,
    v: torch.Tensor,
    spec: TileSpec,
    out: torch.Tensor | None = None,
    *,
    error_flag: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compress every tile of every head and sequence of one layer in one launch (the cache's layout).

    Args:
        k, v: [B, H, n_tiles * tile_tokens, head_dim] CUDA tensors (float16/bfloat16/float32), any
            strides with a contiguous last dim (e.g. a token-range view of a longer buffer).
        spec: the :class:`TileSpec`.
        out: optional uint8 [B, n_tiles, H, tile_nbytes], e.g. ``pool[:, n:n + n_tiles]`` of the
            cache's tile pool; records contiguous, 16-byte aligned addresses and strides.
        error_flag: as in :func:`compress_tiles`.

    Returns:
        uint8 [B, n_tiles, H, tile_nbytes]: record [b, i, h] = ``codec.encode_tiles`` of tokens
        ``i*T .. i*T + T - 1`` of (b, h).
    """
    _check_spec(spec)
    _check_input("k", k, spec, layer=True)
    _check_input("v", v, spec, layer=True)
    _check_pair(k, v)
    k, v = _same_dtype(k, v)
    if k.numel() and k.stride(-1) != 1:
        k = k.contiguous()
    if v.numel() and v.stride(-1) != 1:
        v = v.contiguous()
    B, H, n, D = k.shape
    T, nb = spec.tile_tokens, spec.tile_nbytes
    n_tiles = n // T
    shape = (B, n_tiles, H, nb)
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8, device=k.device)
    else:
        _check_out(out, shape, k.device, spec)
    flag, sync_check = _resolve_flag(error_flag, k.device)
    _launch(
        k, v, (k.stride(0), k.stride(1), k.stride(2)), (v.stride(0), v.stride(1), v.stride(2)),
        out, (out.stride(0), out.stride(1), out.stride(2)), B, n_tiles, H, spec, flag,
    )
    _finish(flag, sync_check, spec)
    return out
