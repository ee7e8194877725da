"""``dequantize_layer(cache, layer)``: every token of a layer as K/V in the cache dtype, original domain.

The tiles go through one kernel launch (``csrc/dequant.cu``, one CTA per (tile, KV head): codes
through the codebook, the scales, the inverse WHT, all in f32, one rounding to the output dtype) on
CUDA, and through the codec (:func:`kvarn_cutlass.codec.decode_tiles`, float32) elsewhere; the sink and
window tokens are copied. What a "dequantize, then run an fp16 attention kernel" pipeline costs: the
baseline ``kvarn-cutlass bench --section prefill`` times against the fused kernel.
"""

from __future__ import annotations

import torch

from .. import codec
from ..cache import KVarNCache
from ..format import HEAD_DIMS, PRESETS, QUANTIZERS, SCALE_DTYPES, TileSpec
from ..runtime import KernelSpec, register
from .prefill import DTYPES, _c_floats

__all__ = ["dequantize_layer", "dequant_spec"]

KERNEL_SYMBOL = "kvarn_dequant_tiles"
_SIG = ("ptr pool", "ptr tile_table", "i32 table_stride", "i32 Hkv", "ptr k_out", "ptr v_out", "i32 out_tokens",
        "i32 tok0")


def dequant_spec(spec: TileSpec, out_dtype: torch.dtype) -> KernelSpec:
    """The KernelSpec of one (record layout, output dtype); every offset comes from ``spec``."""
    defines = {
        "KERNEL_NAME": KERNEL_SYMBOL, "HEAD_DIM": spec.head_dim, "TILE_TOKENS": spec.tile_tokens,
        "V_BITS": spec.v_bits, "SCALE_F32": int(spec.scale_bytes == 4), "OUT_BF16": int(out_dtype == torch.bfloat16),
        "LLOYD_MAX": int(spec.quantizer == "lloyd_max"), "K_CODEBOOK": _c_floats(spec.k_codebook),
        "V_CODEBOOK": _c_floats(spec.v_codebook), "RECORD_BYTES": spec.tile_nbytes,
    }
    for section in spec.section_names():
        defines["OFF_" + section.upper()] = spec.offset(section)
    lm = "lm" if spec.quantizer == "lloyd_max" else ""
    name = f"dequant_d{spec.head_dim}_t{spec.tile_tokens}_v{spec.v_bits}{lm}_s{spec.scale_bytes}_{DTYPES[out_dtype]}"
    return KernelSpec("dequant.cu", (KERNEL_SYMBOL,), defines=defines, name=name)


def _all_specs() -> list[KernelSpec]:
    return [dequant_spec(TileSpec(p, d, sd, quantizer=q), dt)
            for p in PRESETS for d in HEAD_DIMS for sd in SCALE_DTYPES for q in QUANTIZERS for dt in DTYPES]


register("dequant", _all_specs)

_kernels: dict = {}


def _kernel(spec: TileSpec, out_dtype: torch.dtype, device: torch.device):
    key = (spec, out_dtype, device.index)
    k = _kernels.get(key)
    if k is None:
        from ..runtime.arch import arch_target, device_arch
        from ..runtime.compiler import cubin_global
        from ..runtime.spec import build, get_module

        ks = dequant_spec(spec, out_dtype)
        smem = int.from_bytes(cubin_global(build(ks, arch_target(device_arch(device.index))).cubin,
                                           "kvarn_dequant_smem_bytes")[:4], "little")
        k = _kernels[key] = (get_module(ks, device.index).kernel(KERNEL_SYMBOL, _SIG), smem)
    return k


def dequantize_layer(cache: KVarNCache, layer: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every token of ``layer``, [batch, num_kv_heads, seq_len, head_dim] in the cache dtype.

    Tokens in position order: sink, tiles (dequantized: the codec's reconstruction, rounded once to the
    cache dtype), window. ``out``: optional (k, v) buffers [batch, num_kv_heads, >= seq_len, head_dim],
    contiguous, in the cache dtype and on its device, written in their first seq_len tokens (returned
    as views of that prefix).
    """
    if not isinstance(cache, KVarNCache):
        raise TypeError(f"cache must be a KVarNCache, got {type(cache).__name__}")
    L = cache.seq_len(layer)
    B, H, D = cache.batch_size, cache.num_kv_heads, cache.head_dim
    if out is None:
        k_out = torch.empty(B, H, L, D, dtype=cache.dtype, device=cache.device)
        v_out = torch.empty_like(k_out)
    else:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError("out must be a (k, v) tuple of tensors")
        k_out, v_out = out
        for name, t in (("out[0]", k_out), ("out[1]", v_out)):
            if (not isinstance(t, torch.Tensor) or t.dtype != cache.dtype or t.device != cache.device or t.dim() != 4
                    or (t.shape[0], t.shape[1], t.shape[3]) != (B, H, D) or t.shape[2] < L or not t.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous {cache.dtype} tensor [{B}, {H}, >= {L}, {D}] on "
                                 f"{cache.device}, got {getattr(t, 'dtype', type(t))} {list(getattr(t, 'shape', []))}")
    pos = cache.positions(layer)
    sink_k, sink_v = cache.sink_kv(layer)
    win_k, win_v = cache.window_kv(layer)
    s0, s1 = pos["tiles"]
    k_out[:, :, :s0] = sink_k
    v_out[:, :, :s0] = sink_v
    k_out[:, :, s1:L] = win_k
    v_out[:, :, s1:L] = win_v
    nt = cache.num_tiles(layer)
    if nt:
        if cache.device.type == "cuda":
            kernel, smem = _kernel(cache.spec, cache.dtype, cache.device)
            table = cache.tile_table(layer)
            kernel.launch((nt, H, B), 256, (cache.tile_pool(layer), table, table.shape[1], H, k_out, v_out,
                                             k_out.shape[2], s0), shared_mem=smem)
        else:
            kt, vt = codec.decode_tiles(cache.tile_bytes(layer), cache.spec)  # [B, nt, H, T, D] float32
            flat = lambda x: x.permute(0, 2, 1, 3, 4).reshape(B, H, s1 - s0, D)  # noqa: E731
            k_out[:, :, s0:s1] = flat(kt)
            v_out[:, :, s0:s1] = flat(vt)
    return k_out[:, :, :L], v_out[:, :, :L]
