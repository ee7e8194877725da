"""Chunked prefill attention over a KVarNCache: ``prefill_attention(q, k, v, cache, layer)``.

One call per chunk and layer: attention of the chunk's queries, then (by default) the chunk's
``cache.append``. Semantics are :func:`kvarn_cutlass.reference.attention` with the chunk passed in
(``k=``, ``v=``): the queries see the tiles the cache holds (all older than the chunk), and every
newer token exactly in the cache dtype (sink, window, the chunk itself, causal). The chunk's own
tokens, and the window tokens its append compresses, are never read quantized; the tiles its append
produces are byte-identical to appending it without attention.

Backends (``impl``):

* ``"gpu"``: the fused kernel (``csrc/prefill_fused.cu``, one launch, warp-specialized): producer
  warps copy each record into shared memory once and dequantize its K and V codes into f16 MMA
  operands there (f16x2 arithmetic, per-tile power-of-two ranges, so no f16 overflow) while consumer
  warps run scores and P.V on tensor cores (mma.sync) with an online softmax; after the tiles the
  accumulator is rotated back (inverse WHT in registers) and continued over the exact tokens in the
  cache dtype. Configs: :mod:`kvarn_cutlass.ops.prefill`.
* ``"torch"``: the same arithmetic in torch (f16 operands rounded where the kernel rounds them, f32
  accumulation; one softmax over all keys instead of the kernel's online one), on any device: the
  CPU path, and an independent check of the kernel's numerics. With a ``config`` whose ``k_operand`` is
  ``"int8"`` it mirrors that variant's K-scores instead (centered int8 codes, the query folded per tile
  into two int8 levels, exact integer dot products; see :func:`_int8_tile_logits`).
* ``"auto"``: ``"gpu"`` on CUDA, ``"torch"`` elsewhere.
"""

from __future__ import annotations

import torch

from . import codec
from ._validate import resolve_scale
from .cache import KVarNCache
from .ops.prefill import LOG2E
from .reference import check_query, chunk_kv

__all__ = ["prefill_attention", "IMPLS"]

IMPLS = ("auto", "gpu", "torch")
Q_DTYPES = (torch.float16, torch.bfloat16)
_EMULATION_ROWS = 1024  # rows per slab of the torch path (bounds its score tensors)


def _check_args(q, cache, layer, scale, impl, out):
    if q.device != cache.device:
        raise ValueError(f"q is on {q.device} but the cache is on {cache.device}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out must be a {q.dtype} tensor of shape {list(q.shape)} on {q.device}")


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVarNCache,
    layer: int,
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    append: bool = True,
    impl: str = "auto",
    config=None,
) -> torch.Tensor:
    """Attention of a chunk's queries over ``layer`` of ``cache`` plus the chunk itself; then append it.

    Args:
        q: [batch, num_q_heads, n, head_dim] float16/bfloat16 on the cache's device (num_q_heads a
            multiple of num_kv_heads); the queries of the chunk's n tokens.
        k, v: [batch, num_kv_heads, n, head_dim] float16/bfloat16/float32: the chunk's keys and values
            (post-RoPE), not yet in the cache. They are read in the cache dtype, as ``append`` stores them.
        cache: the :class:`KVarNCache`; layer: layer index.
        scale: softmax scale, default 1/sqrt(head_dim); a positive finite number.
        out: optional output tensor (q's shape and dtype).
        append: append k, v to the cache after the attention (default). With False the cache is not
            changed (the caller appends the same k, v before the next chunk).
        impl: ``"auto"`` | ``"gpu"`` | ``"torch"`` (module docstring).
        config: a :class:`kvarn_cutlass.ops.prefill.FusedConfig` for the GPU kernel (default: the tuned
            table, else the documented default). With ``impl="torch"`` only its ``k_operand`` matters
            (``"int8"``: the int8 K-operand variant's arithmetic; uniform quantizer only).

    Returns:
        [batch, num_q_heads, n, head_dim] in q's dtype. On bad input nothing is changed and the error
        names the argument; an error raised by the append leaves the cache as it was.
    """
    k, v = chunk_kv(cache, k, v)
    check_query(q, cache, layer, chunk=k.shape[2], dtypes=Q_DTYPES)
    _check_args(q, cache, layer, scale, impl, out)
    if impl == "auto":
        impl = "gpu" if q.is_cuda else "torch"
    if impl == "gpu" and not q.is_cuda:
        raise ValueError(f"impl='gpu' needs CUDA tensors; q is on {q.device} (use impl='torch')")
    scale = resolve_scale(scale, q.shape[-1])
    if impl == "gpu":
        res = _launch(q, k, v, cache, layer, scale, out, config)
    else:
        k_operand = getattr(config, "k_operand", "f16")
        if k_operand == "int8" and cache.spec.quantizer != "uniform":
            raise ValueError(f"the int8 K operand needs the uniform quantizer, not {cache.spec.quantizer!r}")
        res = _emulate(q, k, v, cache, layer, scale, k_operand)
        if out is not None:
            res = out.copy_(res)
    if append:
        cache._append(layer, k, v, impl == "gpu")
    return res


# ---------------------------------------------------------------------------------------------
# GPU
def _aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, H, n, D] with a contiguous last dim and 16-byte aligned rows (what the kernel's vector accesses
    need). Element sizes are powers of two, so one OR of the outer strides tests them all (three calls per
    chunk and layer: this is on the prefill's host path)."""
    b, h, n, d = x.stride()
    if d != 1 or (x.data_ptr() | (b | h | n) * x.element_size()) % 16:
        return x.contiguous()
    return x


def _launch(q, k, v, cache, layer, scale, out, config):
    from .ops.prefill import get_kernel

    q = _aligned_rows(q)
    k, v = _aligned_rows(k), _aligned_rows(v)
    res = torch.empty_like(q) if out is None or out.stride() != q.stride() else out
    kernel = get_kernel(cache.spec, cache.dtype, q.dtype, q.device, config)
    buf = cache.buffers(layer)
    pos = cache.positions(layer)
    kernel.launch(q, res, cache.tile_pool(layer), cache.tile_table(layer), cache.num_tiles(layer),
                  buf["sink_k"], buf["sink_v"], pos["sink"][1] - pos["sink"][0],
                  buf["window_k"], buf["window_v"], pos["window"][1] - pos["window"][0],
                  k, v, cache.num_kv_heads, scale)
    if out is not None and res is not out:
        out.copy_(res)
        return out
    return res


# ---------------------------------------------------------------------------------------------
# torch: the kernel's arithmetic
def _pow2(e: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.to(torch.int32))


def _range_exponent(bound: torch.Tensor) -> torch.Tensor:
    """The kernel's f16_range_exponent: e with bound * 2^-e in [2^14, 2^15) (0 for bound 0), clamped to +-100."""
    _, e = torch.frexp(bound)
    return torch.where(bound > 0, (e - 15).clamp(-100, 100), torch.zeros_like(e))


def _row_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The kernel's row_scale_exponent: p with amax * 2^p in [2^7, 2^8) (0 for an all-zero row)."""
    _, e = torch.frexp(amax)
    return torch.where(amax > 0, (8 - e).clamp(-120, 120), torch.zeros_like(e))


def _scaled_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x * 2^p rounded to dtype, 2^-p) per row of x [..., D] f32: max|x * 2^p| in [2^7, 2^8)."""
    p = _row_scale_exponent(x.abs().amax(-1))
    return (x * _pow2(p)[..., None]).to(dtype), _pow2(-p)


def _unit_exponent(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The kernel's unit_exponent: e with x * 2^-e in [1/2, 1) (an f32-subnormal x counts as 2^-126; 0 for
    x = 0), clamped to [lo, hi]."""
    _, e = torch.frexp(x.clamp_min(torch.finfo(torch.float32).smallest_normal))
    return torch.where(x > 0, e.clamp(lo, hi), torch.zeros_like(e))


def _tile_operands(rec: torch.Tensor, spec):
    """Records [N, nbytes] -> the kernel's phase A operands and factors (see csrc/prefill_fused.cu):
    kd [N, D, T] and vd [N, T, D] (f16, the row scales in kd), fk [N] (f32, the scores' tile factor
    2^(ek + er)) and e_v [N] (int32: the values' tile factor is 2^e_v)."""
    f = codec.unpack_fields(rec, spec)
    kb, vb = f.k_codebook.abs().max(), f.v_codebook.abs().max()
    ek = _range_exponent(f.chan_min.abs().amax(-1) + kb * f.chan_step.abs().amax(-1))
    ev = _range_exponent(f.tok_min.abs().amax(-1) + vb * f.tok_step.abs().amax(-1))
    er = _unit_exponent(f.row_scale.amax(-1), -100, 100)
    ec = _unit_exponent(f.col_scale.amax(-1), -125, 126)
    kmul, vmul = _pow2(-ek)[:, None], _pow2(-ev)[:, None]
    # f16 scales: the kernel's f16x2 arithmetic (each fma rounded once to f16; the scales times a power
    # of two are exact in f16); f32 scales: f32 arithmetic, one final rounding (see prefill_fused.cu)
    if spec.scale_dtype == torch.float16:
        r16 = lambda x: x.to(torch.float16).to(torch.float32)  # noqa: E731
    else:
        r16 = lambda x: x  # noqa: E731
    rs = r16(f.row_scale * _pow2(-er)[:, None])  # [N, T], <= 1
    kd = (r16(torch.addcmul(r16(f.chan_min * kmul)[..., None], r16(f.chan_step * kmul)[..., None], f.k_values))
          * rs[:, None, :]).to(torch.float16)  # [N, D, T]
    cr = r16(f.col_scale * _pow2(-ec)[:, None])
    vd = (r16(torch.addcmul(r16(f.tok_min * vmul)[..., None], r16(f.tok_step * vmul)[..., None], f.v_values))
          * cr[:, None, :]).to(torch.float16)  # [N, T, D]
    fk = _pow2(ek) * _pow2(er)
    return kd, vd, fk, (ec + ev).to(torch.int32)


# The int8 K operand (csrc/prefill_int8.cuh): weight of the second query level, and the factor 16 the
# producers put on every centered code (16 (code - 8) is the nibble's high-half position, one LOP3).
LFOLD = 254
CODE_MUL = 16


def _int8_tile_fields(rec: torch.Tensor, spec):
    """Records [N, nbytes] -> what the int8 variant's producers stage per tile: kc = 16 (code - 8) [N, D, T]
    (exact integers in [-128, 112]), chan_step and mid = chan_min + 8 chan_step [N, D] (f32), row_scale [N, T]."""
    f = codec.unpack_fields(rec, spec)
    kc = (f.k_codes.float() - 8) * CODE_MUL
    return kc, f.chan_step.float(), (f.chan_min.float() + 8 * f.chan_step.float()), f.row_scale.float()


def _int8_tile_logits(qa: torch.Tensor, kc, cs, mid, rs, rowf) -> torch.Tensor:
    """The int8 variant's tile logits (log2 units) for rows qa [HH, R, D] (f16: q_rot scaled per row) against
    nt tiles per head: kc [HH, nt, D, T], cs, mid [HH, nt, D], rs [HH, nt, T], rowf [HH, R]. Per (row, tile):
    a = q_rot * chan_step (f32), x = a * (127 / max|a|), hi = rint(x), lo = rint(254 (x - hi)) (both int8),
    acc_* = sum_c level * 16 (code - 8) (exact integers), bias = q_rot . (chan_min + 8 chan_step) (f32),
    s = fA f32(254 acc_hi + acc_lo) + bias with fA = max|a| / (127 * 16 * 254); logit = s * row_scale[t] * rowf."""
    qf = qa.float()[:, :, None, :]
    a = qf * cs[:, None]                                        # [HH, R, nt, D]
    amax = a.abs().amax(-1)
    inv = torch.where(amax > 0, (1.0 / amax) * 127.0, torch.zeros_like(amax))
    x = a * inv[..., None]
    hi = torch.round(x)
    lo = torch.round((x.double() - hi.double()) * LFOLD)        # the kernel's FMA: one rounding of the exact value
    kcd = kc.double()
    acc_hi = torch.einsum("hrgd,hgdt->hrgt", hi.double(), kcd)  # exact integers (|acc| < 2^24)
    acc_lo = torch.einsum("hrgd,hgdt->hrgt", lo, kcd)
    acc = (acc_hi * LFOLD + acc_lo).float()  # the kernel's int32 254 acc_hi + acc_lo, one rounding to f32
    fa = amax * (1.0 / (127 * CODE_MUL * LFOLD))
    bias = (qf * mid[:, None]).sum(-1)
    s = fa[..., None] * acc + bias[..., None]
    s = s * rs[:, None]
    HH, R = qa.shape[:2]
    return s.reshape(HH, R, -1) * rowf[..., None]


def _emulate(q, k, v, cache: KVarNCache, layer: int, scale: float, k_operand: str = "f16") -> torch.Tensor:
    B, Hq, n, D = q.shape
    Hkv = cache.num_kv_heads
    G, HH, M = Hq // Hkv, B * Hkv, Hq // Hkv * n
    spec, dt = cache.spec, cache.dtype
    qrows = q.reshape(HH, M, D).to(torch.float32)
    rows_i = torch.arange(M, device=q.device) % n  # query index of each row
    scale_log2 = torch.tensor(scale * LOG2E, dtype=torch.float32)

    # exact part: [sink | window | chunk] per (b, h)
    sk, sv = cache.sink_kv(layer)
    wk, wv = cache.window_kv(layer)
    ke = torch.cat((sk, wk, k), 2).reshape(HH, -1, D).to(torch.float32)
    ve = torch.cat((sv, wv, v), 2).reshape(HH, -1, D)
    E0 = ke.shape[1] - n
    qb, qb_f = _scaled_rows(qrows, dt)
    # tile part
    nt = cache.num_tiles(layer)
    if nt:
        rec = cache.tile_bytes(layer).permute(0, 2, 1, 3).reshape(HH * nt, spec.tile_nbytes)
        kd, vd, fk, e_v = _tile_operands(rec, spec)
        T = spec.tile_tokens
        if k_operand == "int8":
            kc, cs, mid, rs = _int8_tile_fields(rec, spec)
            kc = kc.view(HH, nt, D, T)
            cs, mid, rs = cs.view(HH, nt, D), mid.view(HH, nt, D), rs.view(HH, nt, T)
        kd = kd.float().view(HH, nt, D, T).permute(0, 2, 1, 3).reshape(HH, D, nt * T)
        vd = vd.view(HH, nt, T, D)
        fk = fk.view(HH, nt).repeat_interleave(T, -1)  # [HH, nt*T]
        e_v = e_v.view(HH, nt)
        e_run = e_v.amax(-1)  # [HH]
        fv_run = _pow2(e_run)
        # P' = p * 2^-k, k = e_run - e_v clamped to the kernel's KF_MAX (P' is 0 in f16 either way)
        ratio = _pow2(-(e_run[:, None] - e_v).clamp_max(64)).repeat_interleave(T, -1)  # [HH, nt*T]
        qa, qa_f = _scaled_rows(codec.wht(qrows), torch.float16)

    out = torch.empty(HH, M, D, dtype=torch.float32, device=q.device)
    for r0 in range(0, M, _EMULATION_ROWS):
        r1 = min(M, r0 + _EMULATION_ROWS)
        lg_e = (qb[:, r0:r1].float() @ ke.transpose(1, 2)) * (qb_f[:, r0:r1] * scale_log2)[..., None]
        lim = E0 + rows_i[r0:r1]  # key e visible iff e <= E0 + i
        lg_e = lg_e.masked_fill(torch.arange(ke.shape[1], device=q.device)[None, None, :] > lim[None, :, None],
                                float("-inf"))
        m = lg_e.amax(-1)
        if nt:
            if k_operand == "int8":
                lg_t = _int8_tile_logits(qa[:, r0:r1], kc, cs, mid, rs, qa_f[:, r0:r1] * scale_log2)
            else:
                lg_t = (qa[:, r0:r1].float() @ kd) * ((qa_f[:, r0:r1] * scale_log2)[..., None] * fk[:, None, :])
            m = torch.maximum(m, lg_t.amax(-1))
        p_e = torch.exp2(lg_e - m[..., None])
        l = p_e.sum(-1)
        acc = p_e.to(dt).float() @ ve.float()
        if nt:
            p_t = torch.exp2(lg_t - m[..., None])
            l = l + p_t.sum(-1)
            pp = (p_t * ratio[:, None, :]).to(torch.float16).float().view(HH, r1 - r0, nt, T)
            acc_t = torch.einsum("hrgt,hgtd->hrd", pp, vd.float()) * fv_run[:, None, None]
            acc = acc + codec.wht(acc_t)
        out[:, r0:r1] = acc / l[..., None]
    return out.reshape(B, Hq, n, D).to(q.dtype)
