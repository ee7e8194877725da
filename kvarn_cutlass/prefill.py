"""Chunked prefill attention over a KVarNCache: ``prefill_attention(q, cache, layer, scale=None)``.

Semantics are :func:`kvarn_cutlass.reference.attention` (queries are the newest n_new tokens of the
layer, causal, sink and window exact, tiles as their quantized reconstruction); the output is in
q's dtype. The chunk's own K/V must already be in the cache (``cache.append`` first, as in a
model's forward pass).

Pipeline (unfused; one pass per tile group, online softmax state carried across groups)::

    q [B, Hq, n, D] -> rows [B*Hkv, group*n (pad to Mp), D] -> WHT (f32)                      (rotate)
    per tile group (head range x tile range, sized to the scratch budget):
        fold:   qi8 [L, Mp, 2D] int8 [hi ++ lo], a, bias [L, Mp] (gemm.prep kernel / torch ref)
        unpack: K codes int8 [L, T, 2D] [16(c-8) ++ (c-8)], row_scale [L, T] (kernel / torch ref)
        GEMM:   S [L, Mp, T] = scale*rs*(a*(qi8 . codes) + bias), depth K = 2D
                                                                 (gemm.KScoreGemm / torch ref)
        sv:     online softmax over the group's tiles (causal for tiles newer than the chunk's
                first query) and V from the codes on tensor cores: P' = p*tok_step/smax (f16)
                x centered codes (code - 2^(v_bits-1), exact in f16), f32 accumulation, plus
                sum p*(tok_min + 2^(v_bits-1)*tok_step) in f32, times col_scale
                (csrc/prefill_sv.cu mma.sync kernel, or torch.bmm on f16 codes)
        lloyd_max caches: the K operand rows come from the int8 centroid tables of gemm.prep
                (a = ... / S, no centering offset in bias) and the V codes from the f16 codebook
                (P' x codebook[code], plus sum p*tok_min): the codebooks are already centred
    tile part: one inverse WHT of acc at the end
    exact part (sink + window, causal): f32 torch matmuls, slabbed to the budget
    log-sum-exp merge of the two parts, / total sum -> q.dtype

Row order: row ``r = j * n + i`` of KV head h is query i of q head ``h * group + j`` (a free reshape
of q), batch-major heads ``hh = b * Hkv + h``; the batch of the GEMM is ``l = hl * Gt + g``.

Backends (``impl``): ``"gpu"`` (prep kernels + CUTLASS GEMM + sv kernel; CUDA sm_90),
``"gpu-torch-sv"`` (same, with the torch.bmm sv stage), ``"torch"`` (the torch references of the
prep ops and of the GEMM, the torch sv stage: runs anywhere, and is the path CPU tests exercise;
the orchestration code is shared). ``"auto"``: ``"gpu"`` on CUDA, ``"torch"`` elsewhere.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from . import codec
from .cache import KVarNCache
from .reference import check_query

__all__ = ["prefill_attention", "PrefillWorkspace", "DEFAULT_SCRATCH_BYTES", "IMPLS", "plan_groups", "sv_kernel_name",
           "clear_workspaces", "workspace_bytes"]

DEFAULT_SCRATCH_BYTES = 256 << 20
IMPLS = ("auto", "gpu", "gpu-torch-sv", "torch")
ROW_TILE = 128  # query rows are padded to the GEMM's tile_m (and the sv kernel's 64-row blocks)
SCORE_DTYPES = {"f16": torch.float16, "f32": torch.float32}
_SV_ROWS = 64
_SV_THREADS = 128


# ---------------------------------------------------------------------------------------------
# planning
def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _per_tile_head_bytes(Mp: int, T: int, D: int, score_bytes: int, torch_sv: bool) -> int:
    """Scratch bytes one (tile, KV head) pair of a group needs."""
    b = Mp * 2 * D + 8 * Mp + T * 2 * D + 4 * T + score_bytes * Mp * T + 4  # qi8, a+bias, codes (K = 2D), rs, S, index
    if torch_sv:  # p (f32), P' (f16), O (f16 -> f32), V codes f16, fields
        b += Mp * T * (4 + 2) + Mp * D * (2 + 4) + T * D * 2 + 16 * T + 8 * D
    return b


def plan_groups(n_heads: int, n_tiles: int, per_pair_bytes: int, budget: int) -> tuple[int, int]:
    """(heads per group, tiles per group) so that a group's scratch stays under ``budget``.

    All heads with as many tiles as fit; when even one tile of every head does not fit, one tile
    of as many heads as fit (at least one (head, tile) pair, whatever the budget).
    """
    if n_tiles == 0:
        return n_heads, 0
    fit = max(1, budget // max(1, per_pair_bytes))
    if fit >= n_heads:
        return n_heads, min(n_tiles, fit // n_heads)
    return fit, 1


# ---------------------------------------------------------------------------------------------
# workspace
@dataclass
class PrefillWorkspace:
    """Scratch buffers for one (device, shape bucket); reused across calls so pointers stay stable.

    Flat buffers sized for ``pairs`` (tile, head) pairs of ``Mp_cap`` rows; each call takes
    views from offset 0, so the data pointers handed to the GEMM (which caches its launch
    parameters per pointer set) are the same for every group and call of the bucket.
    """

    device: torch.device
    Mp_cap: int
    pairs: int
    T: int
    D: int
    score_dtype: torch.dtype
    qi8: torch.Tensor = field(init=False)
    a: torch.Tensor = field(init=False)
    bias: torch.Tensor = field(init=False)
    codes: torch.Tensor = field(init=False)
    rs: torch.Tensor = field(init=False)
    scores: torch.Tensor = field(init=False)
    tile_index: torch.Tensor = field(init=False)
    gemms: dict = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        P, Mp, T, D, dev = self.pairs, self.Mp_cap, self.T, self.D, self.device
        K = 2 * D  # GEMM depth: [hi ++ lo] folded queries against [16(c-8) ++ (c-8)] codes (gemm.prep)
        self.qi8 = torch.empty(P * Mp * K, dtype=torch.int8, device=dev)
        self.a = torch.empty(P * Mp, dtype=torch.float32, device=dev)
        self.bias = torch.empty(P * Mp, dtype=torch.float32, device=dev)
        self.codes = torch.empty(P * T * K, dtype=torch.int8, device=dev)
        self.rs = torch.empty(P * T, dtype=torch.float32, device=dev)
        self.scores = torch.empty(P * Mp * T, dtype=self.score_dtype, device=dev)
        self.tile_index = torch.zeros(P, dtype=torch.int32, device=dev)

    def views(self, L: int, Mp: int):
        T, K = self.T, 2 * self.D
        return (
            self.qi8[: L * Mp * K].view(L, Mp, K),
            self.a[: L * Mp].view(L, Mp),
            self.bias[: L * Mp].view(L, Mp),
            self.codes[: L * T * K].view(L, T, K),
            self.rs[: L * T].view(L, T),
            self.scores[: L * Mp * T].view(L, Mp, T),
            self.tile_index[:L],
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qi8, self.a, self.bias, self.codes, self.rs,
                                                           self.scores, self.tile_index))

    def gemm(self, Mp: int, L: int):
        """The K-score GEMM bound to (Mp, T, K = 2D, L) on this device, built once."""
        key = (Mp, L)
        g = self.gemms.get(key)
        if g is None:
            from .gemm.launcher import KScoreGemm

            out = "f16" if self.score_dtype == torch.float16 else "f32"
            g = self.gemms[key] = KScoreGemm(Mp, self.T, 2 * self.D, L, out_dtype=out, device=self.device)
        return g


_workspaces: dict[tuple, PrefillWorkspace] = {}
_ws_lock = threading.Lock()
_MAX_WORKSPACES = 4


def _bucket(Mp: int) -> int:
    return 1 << max(0, (Mp - 1).bit_length())


def get_workspace(device: torch.device, Mp: int, pairs: int, T: int, D: int, score_dtype: torch.dtype) -> PrefillWorkspace:
    """The workspace of (device, row bucket, T, D, score dtype) holding at least ``pairs`` pairs of Mp rows."""
    Mp_cap = max(ROW_TILE, _bucket(Mp))
    key = (str(device), Mp_cap, T, D, score_dtype)
    with _ws_lock:
        ws = _workspaces.get(key)
        # codes, rs and tile_index hold one slot per pair whatever Mp is, so a call with fewer rows
        # (more pairs per group) needs more pairs even when its rows fit the row buffers.
        if ws is None or ws.pairs < pairs:
            if len(_workspaces) >= _MAX_WORKSPACES and key not in _workspaces:
                _workspaces.pop(next(iter(_workspaces)))
            ws = _workspaces[key] = PrefillWorkspace(device, Mp_cap, pairs, T, D, score_dtype)
        return ws


def clear_workspaces() -> None:
    """Drop every cached workspace (frees their scratch memory)."""
    with _ws_lock:
        _workspaces.clear()


def workspace_bytes() -> int:
    """Device bytes held by the cached workspaces."""
    with _ws_lock:
        return sum(ws.nbytes() for ws in _workspaces.values())


# ---------------------------------------------------------------------------------------------
# stage implementations
def sv_kernel_name(D: int, T: int, v_bits: int, scale_dtype: torch.dtype, score_dtype: torch.dtype,
                   quantizer: str = "uniform") -> str:
    sc = "f16" if scale_dtype == torch.float16 else "f32"
    st = "f16" if score_dtype == torch.float16 else "f32"
    vq = f"v{v_bits}lm" if quantizer == "lloyd_max" else f"v{v_bits}"
    return f"kvarn_prefill_sv_d{D}_t{T}_{vq}_{sc}_{st}"


_SV_SIG = ("ptr S", "ptr pool", "ptr tile_index", "i64 record_stride", "i32 v_codes_off", "i32 tok_step_off",
           "i32 tok_min_off", "i32 col_scale_off", "i32 Mp", "i32 Gt", "i32 n_new", "i64 qpos0", "i64 tile_pos0",
           "ptr acc", "ptr m", "ptr l")


def _f16_bits(values) -> str:
    """A C initializer of the f16 bit patterns of ``values`` (round to nearest even, as torch does)."""
    bits = torch.tensor(values, dtype=torch.float32).to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return "{" + ", ".join(f"0x{int(b):04x}" for b in bits) + "}"


def sv_spec():
    """The module of the sv kernels: both quantizers (lloyd_max names carry ``lm`` after the V bits)."""
    from .format import codebook
    from .runtime.spec import KernelSpec

    names = tuple(
        f"kvarn_prefill_sv_d{D}_t{T}_v{vq}_{sc}_{st}"
        for D in (64, 128, 256) for T in (64, 128) for vq in ("2", "4", "2lm", "4lm") for sc in ("f16", "f32")
        for st in ("f16", "f32")
    )
    defines = {"SV_LM_CB2": _f16_bits(codebook("lloyd_max", 2)), "SV_LM_CB4": _f16_bits(codebook("lloyd_max", 4))}
    return KernelSpec("prefill_sv.cu", names, defines=defines, options=("-lineinfo",), name="prefill_sv")


def sv_smem_bytes(D: int, T: int, quantizer: str = "uniform") -> int:
    """Dynamic smem of the sv kernel: codes f16 [T][D + 8], tok_step and offsets f32 [T], col_scale f32 [D]
    (lloyd_max: and the f16 codebook, 16 entries)."""
    return T * (D + 8) * 2 + (2 * T + D) * 4 + (32 if quantizer == "lloyd_max" else 0)


try:  # make `kvarn-cutlass build` see the family; harmless when the registry is absent
    from .runtime.registry import register as _register

    _register("prefill_sv", lambda: [sv_spec()])
except Exception:  # pragma: no cover
    pass

def _sv_kernel(device: torch.device, name: str):
    from .runtime.spec import get_kernel

    return get_kernel(sv_spec(), name, _SV_SIG, device)


@dataclass
class _Ctx:
    """Everything about one call that the stages need."""

    cache: KVarNCache
    layer: int
    pool: torch.Tensor          # uint8 [B, cap, Hkv, nbytes]
    n_new: int
    M: int
    Mp: int
    qpos0: int                  # position of the chunk's first query
    tile_pos0: int              # position of tile 0's first token
    scale: float
    score_dtype: torch.dtype
    timer: Any = None


class _TorchStages:
    """Torch references of fold / unpack / GEMM (exact emulation: int products in f32 are exact)."""

    def fold(self, ctx, q3, offs, n_tiles, qi8, a, bias, tile_index):
        from .gemm.prep import fold_reference

        qi, aa, bb = fold_reference(q3, ctx.pool, tile_index, offs, n_tiles)
        qi8.copy_(qi), a.copy_(aa), bias.copy_(bb)

    def unpack(self, ctx, offs, codes, rs, tile_index):
        from .gemm.prep import unpack_reference

        c, r = unpack_reference(ctx.pool, tile_index, offs)
        codes.copy_(c), rs.copy_(r)

    def kscore(self, ctx, ws, qi8, codes, a, bias, rs, S):
        # exact: integer partial sums, |acc| <= D * (127*128 + 8*8) < 2^23 (lloyd_max: D * (127*104 + 8*7))
        acc = torch.bmm(qi8.to(torch.float32), codes.to(torch.float32).transpose(1, 2))
        S.copy_((ctx.scale * rs)[:, None, :] * (a[..., None] * acc + bias[..., None]))


class _GpuStages:
    def fold(self, ctx, q3, offs, n_tiles, qi8, a, bias, tile_index):
        from .gemm.prep import PrepKernels

        PrepKernels.get(ctx.pool.device.index).fold(q3, ctx.pool, tile_index, offs, n_tiles, qi8, a, bias)

    def unpack(self, ctx, offs, codes, rs, tile_index):
        from .gemm.prep import PrepKernels

        PrepKernels.get(ctx.pool.device.index).unpack(ctx.pool, tile_index, offs, codes, rs)

    def kscore(self, ctx, ws, qi8, codes, a, bias, rs, S):
        ws.gemm(ctx.Mp, qi8.shape[0]).run(qi8, codes, a, bias, rs, ctx.scale, S)


def _v_code_offset(spec) -> int:
    """h: the centering offset of the V code values (2^(v_bits-1) for uniform, 0 for the centred lloyd_max codebook)."""
    return 0 if spec.quantizer == "lloyd_max" else 1 << (spec.v_bits - 1)


def _v_fields(pool: torch.Tensor, tile_index: torch.Tensor, spec):
    """(centered v code values f16 [L, T, D], tok_step, tok_min [L, T], col_scale [L, D]) in f32.

    Code values are ``code - 2^(v_bits-1)`` for uniform ([-2, 1] or [-8, 7], exact in f16) and the codebook
    value ``codebook[code]`` for lloyd_max (f16-exact, already centred); the caller adds
    ``h * tok_step`` to tok_min, h = :func:`_v_code_offset` (see :func:`_sv_torch`).
    """
    T, D, vb = spec.tile_tokens, spec.head_dim, spec.v_bits
    recs = pool.reshape(-1, spec.tile_nbytes).index_select(0, tile_index.to(torch.int64))

    def scales(name, n):
        off, nb = spec.section(name)
        return recs[:, off:off + nb].contiguous().view(spec.scale_dtype).to(torch.float32).reshape(-1, n)

    off, nb = spec.section("v_codes")
    raw = recs[:, off:off + nb].to(torch.int32)
    per = 8 // vb
    shifts = torch.arange(per, dtype=torch.int32, device=pool.device) * vb
    codes = ((raw[..., None] >> shifts) & (2**vb - 1)).reshape(-1, T, D)
    if spec.quantizer == "lloyd_max":
        book = torch.tensor(spec.v_codebook, dtype=torch.float32, device=pool.device).to(torch.float16)
        values = book[codes.to(torch.int64)]
    else:
        values = (codes - _v_code_offset(spec)).to(torch.float16)
    return values, scales("tok_step", T), scales("tok_min", T), scales("col_scale", D)


def _tile_mask(ctx: _Ctx, g0: int, Gt: int, Mp: int):
    """Bool [Gt, Mp, T] (True = masked) or None when no tile of the range is newer than the first query."""
    T = ctx.cache.spec.tile_tokens
    last = ctx.tile_pos0 + (g0 + Gt) * T - 1
    if last <= ctx.qpos0:
        return None
    dev = ctx.pool.device
    kpos = ctx.tile_pos0 + (g0 + torch.arange(Gt, device=dev))[:, None] * T + torch.arange(T, device=dev)  # [Gt, T]
    qpos = ctx.qpos0 + torch.arange(Mp, device=dev) % ctx.n_new  # [Mp]
    return kpos[:, None, :] > qpos[None, :, None]


def _pv_f16(pp: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """P' x codes with f16 operands and f32 accumulation, result f32 (what the mma.sync kernel does)."""
    if pp.is_cuda:
        try:  # cuBLAS f16 tensor cores with an f32 result (torch >= 2.8)
            return torch.bmm(pp, codes, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # older torch: f16 result (one more f16 rounding of O)
            return torch.bmm(pp, codes).to(torch.float32)
    # CPU emulation: f16 operands (exact in f32), f32 accumulation
    return torch.bmm(pp.to(torch.float32), codes.to(torch.float32))


def _sv_torch(ctx: _Ctx, S, tile_index, Hg, Gt, g0, acc, m, l):
    """Online softmax + V (torch; tensor cores via torch.bmm on f16 on CUDA). State [Hg, Mp(, D)] in place.

    Per tile: V[t, d] = col_scale[d] * (tok_min[t] + tok_step[t] * value[t, d]) is summed as
    col_scale[d] * (smax * sum_t P'[t] * (value[t, d] - h) + sum_t p[t] * (tok_min[t] + h * tok_step[t]))
    with P' = p * tok_step / smax rounded to f16; value = code and h = 2^(v_bits-1) for uniform, value =
    codebook[code] (f16) and h = 0 for lloyd_max. Centered codes (exact in f16) keep
    the f16 product small: uncentered codes carry their mean, so P' x codes and sum p*tok_min cancel
    and the f16 rounding of P' is amplified by that cancellation.
    """
    spec = ctx.cache.spec
    T, D = spec.tile_tokens, spec.head_dim
    Mp = S.shape[1]
    s = S.view(Hg, Gt, Mp, T).to(torch.float32)
    mask = _tile_mask(ctx, g0, Gt, Mp)
    if mask is not None:
        s = s.masked_fill(mask[None], float("-inf"))
    m_new = torch.maximum(m, s.amax(dim=(1, 3)))
    m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - m_use)
    p = torch.exp(s - m_use[:, None, :, None])  # [Hg, Gt, Mp, T]
    codes, tok_step, tok_min, col_scale = _v_fields(ctx.pool, tile_index, spec)
    tok_step, tok_min, col_scale = (x.view(Hg, Gt, -1) for x in (tok_step, tok_min, col_scale))
    tok_off = tok_min + float(_v_code_offset(spec)) * tok_step  # the centering offset, f32
    smax = tok_step.amax(-1)  # [Hg, Gt]; P' in [0, 1] (p <= 1), so f16 keeps its relative precision
    inv = torch.where(smax > 0, 1.0 / torch.where(smax > 0, smax, torch.ones_like(smax)), torch.zeros_like(smax))
    pp = (p * (tok_step * inv[..., None])[:, :, None, :]).to(torch.float16).view(Hg * Gt, Mp, T)
    o = _pv_f16(pp, codes).view(Hg, Gt, Mp, D)
    poff = (p * tok_off[:, :, None, :]).sum(-1)  # [Hg, Gt, Mp], f32
    contrib = ((o * smax[..., None, None] + poff[..., None]) * col_scale[:, :, None, :]).sum(1)
    l.mul_(alpha).add_(p.sum(dim=(1, 3)))
    acc.mul_(alpha[..., None]).add_(contrib)
    m.copy_(m_new)


def _sv_kernel_launch(ctx: _Ctx, S, tile_index, Hg, Gt, g0, acc, m, l):
    spec = ctx.cache.spec
    T, D = spec.tile_tokens, spec.head_dim
    Mp = S.shape[1]
    name = sv_kernel_name(D, T, spec.v_bits, spec.scale_dtype, S.dtype, spec.quantizer)
    k = _sv_kernel(ctx.pool.device, name)
    k.launch((Mp // _SV_ROWS, Hg, 1), _SV_THREADS,
             (S, ctx.pool, tile_index, spec.tile_nbytes, spec.offset("v_codes"), spec.offset("tok_step"),
              spec.offset("tok_min"), spec.offset("col_scale"), Mp, Gt, ctx.n_new, ctx.qpos0,
              ctx.tile_pos0 + g0 * T, acc, m, l),
             shared_mem=sv_smem_bytes(D, T, spec.quantizer))


# ---------------------------------------------------------------------------------------------
# exact part: sink + window
def _exact_part(ctx: _Ctx, qrows: torch.Tensor, budget: int):
    """(acc [HH, M, D] f32 unnormalized, m [HH, M], l [HH, M]) of the sink and window tokens, causal."""
    cache, layer = ctx.cache, ctx.layer
    sink_k, sink_v = cache.sink_kv(layer)
    win_k, win_v = cache.window_kv(layer)
    HH, M, D = qrows.shape
    dev = qrows.device
    ke = torch.cat((sink_k, win_k), 2).reshape(HH, -1, D)
    ve = torch.cat((sink_v, win_v), 2).reshape(HH, -1, D)
    Ne = ke.shape[1]
    acc = torch.zeros(HH, M, D, dtype=torch.float32, device=dev)
    m = torch.full((HH, M), float("-inf"), dtype=torch.float32, device=dev)
    lsum = torch.zeros(HH, M, dtype=torch.float32, device=dev)
    if Ne == 0:
        return acc, m, lsum
    pos = cache.positions(layer)
    kpos = torch.cat((torch.arange(*pos["sink"], device=dev), torch.arange(*pos["window"], device=dev)))
    kf, vf = ke.to(torch.float32), ve.to(torch.float32)
    rows = max(1, min(M, budget // max(1, HH * Ne * 4 * 3)))
    for r0 in range(0, M, rows):
        r1 = min(M, r0 + rows)
        s = torch.matmul(qrows[:, r0:r1], kf.transpose(1, 2)) * ctx.scale  # [HH, r, Ne] f32
        qpos = ctx.qpos0 + torch.arange(r0, r1, device=dev) % ctx.n_new
        s.masked_fill_(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
        mm = s.amax(-1)
        mu = torch.where(torch.isinf(mm), torch.zeros_like(mm), mm)
        p = torch.exp(s - mu[..., None])
        m[:, r0:r1] = mm
        lsum[:, r0:r1] = p.sum(-1)
        acc[:, r0:r1] = torch.matmul(p, vf)
    return acc, m, lsum


# ---------------------------------------------------------------------------------------------
def _rotate(x: torch.Tensor) -> torch.Tensor:
    """Normalized WHT along the last dim in f32 (GPU kernel when available, else the codec's)."""
    if x.is_cuda:
        try:
            from .ops.rotate import wht as gpu_wht

            return gpu_wht(x.contiguous(), torch.float32)
        except ImportError:
            pass
    return codec.wht(x.to(torch.float32))


class _NullTimer:
    def stage(self, name):
        return _NullCtx()


class _NullCtx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _check_args(q, cache, layer, scale, impl, scratch_bytes, score_dtype, out):
    if not isinstance(cache, KVarNCache):
        raise TypeError(f"cache must be a KVarNCache, got {type(cache).__name__}")
    check_query(q, cache, layer)
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q must be float16 or bfloat16, got {q.dtype}")
    if q.device != cache.device:
        raise ValueError(f"q is on {q.device} but the cache is on {cache.device}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if isinstance(scratch_bytes, bool) or not isinstance(scratch_bytes, int) or scratch_bytes < 1:
        raise ValueError(f"scratch_bytes must be a positive int, got {scratch_bytes!r}")
    if score_dtype not in SCORE_DTYPES:
        raise ValueError(f"score_dtype must be one of {list(SCORE_DTYPES)}, got {score_dtype!r}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out must be a {q.dtype} tensor of shape {list(q.shape)} on {q.device}")


def prefill_attention(
    q: torch.Tensor,
    cache: KVarNCache,
    layer: int,
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    impl: str = "auto",
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
    score_dtype: str = "f16",
    timer: Any = None,
) -> torch.Tensor:
    """Attention of the chunk's queries over ``layer`` of ``cache`` (the chunk already appended).

    Args:
        q: [batch, num_q_heads, n_new, head_dim] float16/bfloat16 on the cache's device;
            num_q_heads a multiple of the cache's num_kv_heads; 1 <= n_new <= seq_len(layer).
        cache: the :class:`KVarNCache` holding the chunk's K/V.
        layer: layer index.
        scale: softmax scale, default 1/sqrt(head_dim).
        out: optional output tensor (q's shape and dtype).
        impl: ``"auto"`` | ``"gpu"`` | ``"gpu-torch-sv"`` | ``"torch"`` (see the module docstring).
        scratch_bytes: budget for the per-group scratch (folded queries, codes, scores); the
            context is processed in tile groups sized to it (at least one (tile, head) pair).
        score_dtype: ``"f16"`` (default) or ``"f32"`` scores out of the K-score GEMM.
        timer: optional object with ``stage(name)`` returning a context manager (bench breakdown).

    Returns:
        [batch, num_q_heads, n_new, head_dim] in q's dtype.
    """
    _check_args(q, cache, layer, scale, impl, scratch_bytes, score_dtype, out)
    if impl == "auto":
        impl = "gpu" if q.is_cuda else "torch"
    if impl != "torch" and not q.is_cuda:
        raise ValueError(f"impl={impl!r} needs CUDA tensors; q is on {q.device} (use impl='torch')")
    timer = timer or _NullTimer()
    spec = cache.spec
    B, Hq, n, D = q.shape
    Hkv, T = cache.num_kv_heads, spec.tile_tokens
    group = Hq // Hkv
    HH, M = B * Hkv, group * n
    Mp = _round_up(M, ROW_TILE)
    L_len = cache.seq_len(layer)
    pos = cache.positions(layer)
    nt = cache.num_tiles(layer)
    sdt = SCORE_DTYPES[score_dtype]
    ctx = _Ctx(cache=cache, layer=layer, pool=cache.tile_pool(layer), n_new=n, M=M, Mp=Mp, qpos0=L_len - n,
               tile_pos0=pos["tiles"][0], scale=D**-0.5 if scale is None else float(scale), score_dtype=sdt)
    dev = q.device

    with timer.stage("rotate"):
        qrows = q.reshape(HH, M, D)
        qrot = torch.zeros(HH, Mp, D, dtype=torch.float32, device=dev)
        qrot[:, :M] = _rotate(qrows)

    with timer.stage("window"):
        acc_e, m_e, l_e = _exact_part(ctx, qrows.to(torch.float32), scratch_bytes)

    acc_t = torch.zeros(HH, Mp, D, dtype=torch.float32, device=dev)
    m_t = torch.full((HH, Mp), float("-inf"), dtype=torch.float32, device=dev)
    l_t = torch.zeros(HH, Mp, dtype=torch.float32, device=dev)
    # tiles newer than the chunk's first query can only be compressed tiles of this chunk;
    # tiles are all live tiles (every tile is older than at least the chunk's last query)
    if nt:
        from .gemm.prep import TileOffsets

        torch_sv = impl != "gpu"
        per_pair = _per_tile_head_bytes(Mp, T, D, sdt.itemsize, torch_sv)
        Hg_max, Gt_max = plan_groups(HH, nt, per_pair, scratch_bytes)
        ws = get_workspace(dev, Mp, Hg_max * Gt_max, T, D, sdt)
        stages = _TorchStages() if impl == "torch" else _GpuStages()
        cap = ctx.pool.shape[1]
        offs = TileOffsets.from_spec(spec)
        # record index of (head hh = b*Hkv + h, tile g): (b*cap + g)*Hkv + h
        hh = torch.arange(HH, device=dev)
        idx_all = (((hh // Hkv) * cap)[:, None] + torch.arange(nt, device=dev)[None, :]) * Hkv + (hh % Hkv)[:, None]
        idx_all = idx_all.to(torch.int32)
        for h0 in range(0, HH, Hg_max):
            h1 = min(HH, h0 + Hg_max)
            Hg = h1 - h0
            for g0 in range(0, nt, Gt_max):
                g1 = min(nt, g0 + Gt_max)
                Gt = g1 - g0
                L = Hg * Gt
                qi8, a, bias, codes, rs, S, tidx = ws.views(L, Mp)
                tidx.copy_(idx_all[h0:h1, g0:g1].reshape(-1))
                with timer.stage("fold"):
                    stages.fold(ctx, qrot[h0:h1], offs, Gt, qi8, a, bias, tidx)
                with timer.stage("unpack"):
                    stages.unpack(ctx, offs, codes, rs, tidx)
                with timer.stage("gemm"):
                    stages.kscore(ctx, ws, qi8, codes, a, bias, rs, S)
                with timer.stage("softmax_v"):
                    st = (acc_t[h0:h1], m_t[h0:h1], l_t[h0:h1])
                    if impl == "gpu":
                        _sv_kernel_launch(ctx, S, tidx, Hg, Gt, g0, *st)
                    else:
                        _sv_torch(ctx, S, tidx, Hg, Gt, g0, *st)

    with timer.stage("merge"):
        acc_t, m_t, l_t = acc_t[:, :M], m_t[:, :M], l_t[:, :M]
        if nt:
            acc_t = _rotate(acc_t)  # the deferred inverse WHT (its own inverse)
        mm = torch.maximum(m_t, m_e)
        w_t = torch.exp(m_t - mm)
        w_e = torch.exp(m_e - mm)
        num = acc_t * w_t[..., None] + acc_e * w_e[..., None]
        den = l_t * w_t + l_e * w_e
        res = (num / den[..., None]).reshape(B, Hq, n, D)
        if out is None:
            return res.to(q.dtype)
        out.copy_(res)
        return out
