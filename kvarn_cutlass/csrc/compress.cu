// KVarN tile compression on the GPU, byte-identical to the CPU codec (kvarn_cutlass/codec.py).
//
// Work unit: a record half, blockIdx.y = 0 for the K half of the record (k_codes, chan_step,
// chan_min, row_scale), 1 for the V half (v_codes, tok_step, tok_min, col_scale). Each half runs the
// whole pipeline on its own input: WHT along head_dim, Sinkhorn-like variance normalization
// (lowest-imbalance candidate), power-of-two balance, zero lines, stored scales, codes, packing.
// The layer kernel and the append's append_compress_cluster run a half on a thread-block cluster of
// R = T / 16 CTAs of KVARN_CW warps (8 shipped) on sm_90 (one CTA of KVARN_OW warps on sm_80); their
// one-CTA forms (compress_cta, append_compress) on one CTA of KVARN_OW warps (32 shipped, 16 at D=256;
// ops/compress.py and ops/append.py pick the form per launch). compress_impl is the same code for all: the "ranks" of a
// lone CTA are itself.
// The codes come from the quantizer compiled in (KVARN_QUANT): 0 = uniform (asymmetric
// round-to-nearest-even: *_min = axis minimum, *_step = range / (2^bits - 1)), 1 = lloyd_max (codes
// of the Gaussian fit (mean, RMS about the stored mean), then (min, step) = the stored least-squares
// refit for those codes, codes again; code = number of decision thresholds t_j < (u - min) / step,
// ties to the lower code; thresholds and codebook arrive as the defines KVARN_LM_THR4/2 and
// KVARN_LM_BOOK4/2 from kvarn_cutlass.format). The uniform build has no lloyd_max code in it.
//
// Exactness rules (the codec is the spec): float32 only; every +, -, *, sqrt is a correctly rounded
// intrinsic (__fadd_rn, __fsub_rn, __fmul_rn, __fsqrt_rn) and every division yields the correctly
// rounded quotient (__fdiv_rn, or the reciprocal-and-correction sequence of div_rn below where it
// provably equals it); the only fused multiply-adds are div_rn's (the module is compiled with
// --fmad=false); no fast math, no flush-to-zero. Sums are halving trees: x[i] + x[i + n/2], repeated
// (compress_impl's comment gives the layouts that keep their order).
//
// Error flag (int32, OR-ed, checked by the host; see kvarn_cutlass/ops/compress.py):
//   bit 0 K row_scale, 1 K chan step, 2 K chan min, 3 V col_scale, 4 V tok step, 5 V tok min
//   (a stored value is not finite: the codec's _store raises), bit 6 k non-finite input,
//   7 k input magnitude > 2^48, 8 v non-finite, 9 v magnitude > 2^48 (check_tile_input raises).
//   A record half whose input is rejected writes nothing (every rank of its cluster learns it at the
//   first exchange). lloyd_max checks the Gaussian fit's mean before its RMS (the codec raises on the
//   min first), so the host reads its min bits before its step bits. Bit 30 (KVC_SEEN) is never
//   written to the flag: it travels in that first exchange only (compress_impl's ENTRY_CHECK).
//
// Kernel names: kvarn_compress_t{T}_d{D}_{in}_{scale}_v{VB}, in = f16|bf16|f32, scale = s16|s32,
// with the suffix _lm for lloyd_max. The modules of the cache dtypes (in = f16|bf16) also hold the
// cache's append kernels, kvarn_append_{compress,compress_cluster,commit,snapshot}_... (the append
// section below): the same compress_impl, fed from the cache's window and the appended chunk.
//
// Append error bits (besides bits 0-9 above): 10 k / 11 v magnitude > 2^42 with float16 scales,
// 12 tile pool full.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include "append_plan.cuh"

typedef unsigned char u8;

// One kernel per module: the defines pick T, D, the input dtype (KVARN_IN 0 = f16, 1 = bf16,
// 2 = f32), the scale dtype (KVARN_SC 16 | 32), the V bits (KVARN_VB 2 | 4) and the quantizer
// (KVARN_QUANT 0 = uniform, 1 = lloyd_max, which also needs KVARN_LM_THR4 and, for KVARN_VB 2,
// KVARN_LM_THR2: comma-separated float literals).
#ifndef KVARN_T
#define KVARN_T 128
#endif
#ifndef KVARN_D
#define KVARN_D 128
#endif
#ifndef KVARN_IN
#define KVARN_IN 0
#endif
#ifndef KVARN_SC
#define KVARN_SC 16
#endif
#ifndef KVARN_VB
#define KVARN_VB 2
#endif
#ifndef KVARN_QUANT
#define KVARN_QUANT 0
#endif

// Warps of a lone CTA (the one-CTA forms, and every form before sm_90; KVARN_OW from
// kvarn_cutlass.ops.compress.compress_spec: 32 shipped up to head_dim 128, where a thread of the 1024 fits its
// state in the 64 registers it may hold, 16 at head_dim 256).
#ifndef KVARN_OW
#error "KVARN_OW (warps of a lone compression CTA) is defined by kvarn_cutlass.ops.compress.compress_spec"
#endif
static_assert(KVARN_OW == 16 || KVARN_OW == 32, "KVARN_OW: 16 or 32 warps per lone CTA");
#define KVC_W KVARN_OW
#define KVC_NT (32 * KVARN_OW)
// Warps per CTA of a cluster (KVARN_CW, from kvarn_cutlass.ops.compress.compress_spec: 8 shipped, two
// independent chains per scheduler; 4 and 16 are A/B variants), tokens t = rank + R * (w + W * k), so the
// halving trees keep the codec's order for every width.
#ifndef KVARN_CW
#error "KVARN_CW (warps per cluster CTA) is defined by kvarn_cutlass.ops.compress.compress_spec"
#endif
static_assert(KVARN_CW == 4 || KVARN_CW == 8 || KVARN_CW == 16, "KVARN_CW: 4, 8 or 16 warps per cluster CTA");
#define KVC_FULL 0xffffffffu

enum {
  KVC_ERR_K_ROW_SCALE = 1 << 0,
  KVC_ERR_K_CHAN_STEP = 1 << 1,
  KVC_ERR_K_CHAN_MIN = 1 << 2,
  KVC_ERR_V_COL_SCALE = 1 << 3,
  KVC_ERR_V_TOK_STEP = 1 << 4,
  KVC_ERR_V_TOK_MIN = 1 << 5,
  KVC_ERR_K_NONFINITE = 1 << 6,
  KVC_ERR_K_RANGE = 1 << 7,
  KVC_ERR_V_NONFINITE = 1 << 8,
  KVC_ERR_V_RANGE = 1 << 9,
  // the cache's append only (see the append section below)
  KVC_ERR_K_BOUND = 1 << 10,
  KVC_ERR_V_BOUND = 1 << 11,
  KVC_ERR_CAPACITY = 1 << 12,
  // not an error: a rank's "the flag was set when this half started" in the iteration-0 exchange
  KVC_SEEN = 1 << 30,
};

namespace kvc {

__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(float x) { return x; }

__device__ __forceinline__ bool is_nan(float x) { return x != x; }
__device__ __forceinline__ bool is_finite(float x) { return fabsf(x) <= 3.402823466e38f; }

// torch.amax / amin semantics for NaN (propagated). Signed zeros: IEEE 754-2019 maximum/minimum
// (+0 > -0), an order-independent choice; torch's own choice on mixed-sign zeros depends on the
// reduction's vectorization (see the report in kvarn_cutlass/ops/compress.py).
__device__ __forceinline__ float nanmax(float a, float b) {
  if (is_nan(a)) return a;
  if (is_nan(b)) return b;
  if (a == b) return (__float_as_uint(a) >> 31) ? b : a;
  return a > b ? a : b;
}
__device__ __forceinline__ float nanmin(float a, float b) {
  if (is_nan(a)) return a;
  if (is_nan(b)) return b;
  if (a == b) return (__float_as_uint(a) >> 31) ? a : b;
  return a < b ? a : b;
}
// The same without branches (PTX min.NaN / max.NaN, sm_80+: a NaN operand gives the canonical NaN), for
// operands that are never -0 (the quantized values u = RN(y / scale + 0.0), the column factors s, all
// >= +0 or NaN): there nanmin / nanmax and these agree bit for bit (the only NaN the kernel can hold
// is the canonical one that its arithmetic makes; a NaN input is rejected before).
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float min_nan(float a, float b) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Halving tree over a compile-time array: x[i] + x[i + n/2] repeated; result in x[0].
template <int N>
__device__ __forceinline__ void tree(float* x) {
  if constexpr (N > 1) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) x[i] = __fadd_rn(x[i], x[i + N / 2]);
    tree<N / 2>(x);
  }
}

__device__ __forceinline__ float warp_tree(float v) {
#pragma unroll
  for (int h = 16; h >= 1; h /= 2) v = __fadd_rn(v, __shfl_xor_sync(KVC_FULL, v, h));
  return v;
}
// codec._rms of one finished mean square (sum * (1/n), n a power of two: the quotient sum / n exactly):
// its correctly rounded sqrt, values under 2^-100 count as 1 (NaN stays NaN).
__device__ __forceinline__ float rms_of(float mean_square) {
  const float r = __fsqrt_rn(mean_square);
  return r < 0x1p-100f ? 1.0f : r;
}

// frexp(x).exponent as torch (glibc) computes it: 0 for zero, inf and NaN.
__device__ __forceinline__ int frexp_exponent(float x) {
  const unsigned bits = __float_as_uint(x) & 0x7fffffffu;
  const int e = (int)(bits >> 23);
  if (bits == 0 || e == 255) return 0;
  if (e == 0) return -126 - (__clz(bits) - 9) ;  // subnormal: m * 2^-149, m = bits
  return e - 126;
}

// float32(2^e) as torch.ldexp uses it (x * pow(2, e) in float32): inf above 127, 0 below -149.
__device__ __forceinline__ float pow2f(int e) {
  if (e > 127) return __uint_as_float(0x7f800000u);
  if (e >= -126) return __uint_as_float((unsigned)(e + 127) << 23);
  if (e >= -149) return __uint_as_float(1u << (e + 149));
  return 0.0f;
}

// lloyd_max code of a normalized value z: the number of decision thresholds t_j with z > t_j (a
// NaN-free z; ties go to the lower code). Fully unrolled: the thresholds become immediates.
template <int BITS>
__device__ __forceinline__ unsigned lloyd_max_code(float) {
  static_assert(BITS < 0, "the lloyd_max thresholds are compiled in only with KVARN_QUANT=1 (KVARN_LM_THR4/2)");
  return 0;
}
template <int BITS>
__device__ __forceinline__ float lloyd_max_value(unsigned) {
  static_assert(BITS < 0, "the lloyd_max codebook is compiled in only with KVARN_QUANT=1 (KVARN_LM_BOOK4/2)");
  return 0.0f;
}
#if KVARN_QUANT == 1
template <int N>
__device__ __forceinline__ unsigned count_above(float z, const float (&thr)[N]) {
  unsigned code = 0;
#pragma unroll
  for (int j = 0; j < N; ++j) code += z > thr[j] ? 1u : 0u;
  return code;
}
template <>
__device__ __forceinline__ unsigned lloyd_max_code<4>(float z) {
  const float thr[15] = {KVARN_LM_THR4};
  return count_above(z, thr);
}
#if KVARN_VB == 2
template <>
__device__ __forceinline__ unsigned lloyd_max_code<2>(float z) {
  const float thr[3] = {KVARN_LM_THR2};
  return count_above(z, thr);
}
#endif
// The codebook value of a code (format.codebook, the KVARN_LM_BOOK4/2 defines), for the refit's sums.
__constant__ float kvc_book4[16] = {KVARN_LM_BOOK4};
template <>
__device__ __forceinline__ float lloyd_max_value<4>(unsigned code) {
  return kvc_book4[code];
}
#if KVARN_VB == 2
__constant__ float kvc_book2[4] = {KVARN_LM_BOOK2};
template <>
__device__ __forceinline__ float lloyd_max_value<2>(unsigned code) {
  return kvc_book2[code];
}
#endif
#endif


// Storage rounding (codec._store): round to the scale dtype, report non-finite, return float32.
template <typename SC>
struct Store;
template <>
struct Store<__half> {
  static constexpr float kSmallest = 0x1p-24f;  // finfo(float16).smallest_normal * eps
  __device__ static float round(float x, unsigned short& bits) {
    const __half h = __float2half_rn(x);
    bits = __half_as_ushort(h);
    return __half2float(h);
  }
  __device__ static void put(u8* base, int index, float stored, unsigned short bits) {
    reinterpret_cast<unsigned short*>(base)[index] = bits;
  }
};
template <>
struct Store<float> {
  static constexpr float kSmallest = 0x1p-149f;  // finfo(float32).smallest_normal * eps
  __device__ static float round(float x, unsigned short& bits) {
    bits = 0;
    return x;
  }
  __device__ static void put(u8* base, int index, float stored, unsigned short) {
    reinterpret_cast<float*>(base)[index] = stored;
  }
};

// The least-squares refit of a lloyd_max axis (codec._quantize_lloyd_max, step 2) from its finished
// sums den = tree_sum(db * db) and num = tree_sum(db * d), the unrounded mean and the (exact)
// codebook mean bm. False (keep the Gaussian fit) when every code is the same or the stored step is
// not positive and finite or the stored min not finite; no error bit either way.
template <typename SC>
__device__ __forceinline__ bool lloyd_max_refit(float den, float num, float mean, float bm, float& step,
                                                unsigned short& step_bits, float& low, unsigned short& low_bits) {
  if (!(den > 0.0f)) return false;
  step = Store<SC>::round(__fdiv_rn(num, den), step_bits);
  low = Store<SC>::round(__fsub_rn(mean, __fmul_rn(step, bm)), low_bits);
  return step > 0.0f && is_finite(step) && is_finite(low);
}

struct Sections {
  int k_codes, chan_step, chan_min, row_scale, v_codes, tok_step, tok_min, col_scale;
};

// ---- thread-block clusters -------------------------------------------------------------------
// A record half runs on R CTAs ("ranks"): R = 1 (one CTA, the append kernels and sm_80) or a
// thread-block cluster of R = T / 16 CTAs (the layer kernel on sm_90). With R = 1 the exchanges
// below are the CTA's own shared memory and __syncthreads.
template <int R>
__device__ __forceinline__ int cluster_rank() {
  if constexpr (R == 1) {
    return 0;
  } else {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return (int)r;
  }
}
// Every thread of every rank; this rank's shared-memory writes before it are visible to every rank after.
template <int R>
__device__ __forceinline__ void cluster_sync() {
  if constexpr (R == 1) {
    __syncthreads();
  } else {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
  }
}
// Waits for the cluster barrier's phase (R = 1: nothing): the exit guard after cluster_arrive_relaxed.
template <int R>
__device__ __forceinline__ void cluster_wait() {
  if constexpr (R > 1) asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// p (in this CTA's shared memory) written to rank q's copy of the same buffer.
template <int R>
__device__ __forceinline__ void st_rank(float* p, int q, float v) {
  if constexpr (R == 1) {
    *p = v;
  } else {
    unsigned a = (unsigned)__cvta_generic_to_shared(p), ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(q));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(ra), "f"(v) : "memory");
  }
}

// ---- the iteration exchange of a cluster: st.async pushes counted on mbarriers (sm_90) -----------
// Used with R > 1 only (compress_impl's comment gives the protocol). Addresses are 32-bit shared
// ones; mapa turns this CTA's address of a buffer or mbarrier into rank q's copy of it.
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ unsigned mapa_u32(unsigned a, int q) {
  unsigned ra;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(q));
  return ra;
}
// one thread, before any rank may push: count 1 (the local expect_tx arrival of each phase)
__device__ __forceinline__ void mbar_init(unsigned bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// every thread of every rank, after the init (the init's release is the fence above)
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
// the phase's one arrival, announcing the bytes the other ranks will push into this rank in it
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// until the phase of this parity has completed (its arrival made and all its bytes landed); acquire
// at cluster scope: the pushes' data (their complete_tx releases at cluster scope) is visible after
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void st_async(unsigned ra, unsigned v, unsigned rbar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(ra), "r"(v), "r"(rbar)
               : "memory");
}
__device__ __forceinline__ void st_async4(unsigned ra, uint4 v, unsigned rbar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(ra),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(rbar)
               : "memory");
}
// v to this rank's slot p of the receive buffer and, by st.async, to the same slot of every other
// rank, each push counted on that rank's copy of the mbarrier bar (destinations from rank + 1 on,
// so the ranks do not all start on rank 0). The own copy is a plain store (read by this thread, or
// after a __syncwarp by its warp).
template <int R>
__device__ __forceinline__ void push_all(float* p, int rank, float v, unsigned bar) {
  static_assert((R & (R - 1)) == 0, "ranks: a power of two");
  *p = v;
  const unsigned a = smem_u32(p);
#pragma unroll
  for (int d = 1; d < R; ++d) {
    const int q = (rank + d) & (R - 1);
    st_async(mapa_u32(a, q), __float_as_uint(v), mapa_u32(bar, q));
  }
}
template <int R>
__device__ __forceinline__ void push_all4(float* p, int rank, uint4 v, unsigned bar) {
  *reinterpret_cast<uint4*>(p) = v;
  const unsigned a = smem_u32(p);
#pragma unroll
  for (int d = 1; d < R; ++d) {
    const int q = (rank + d) & (R - 1);
    st_async4(mapa_u32(a, q), v, mapa_u32(bar, q));
  }
}
// A warp's 32 consecutive columns c (lane l: column c0 + l, value v), pushed in 16-byte pieces: the
// four lanes 4g .. 4g + 3 gather columns c0 + 4g .. c0 + 4g + 3 (shuffles) and share the R - 1
// destinations (lane 4g + i: ranks rank + i + 1, rank + i + 5, ...), so a CTA sends D / 4 pushes per
// destination instead of D (fewer messages through the SM-to-SM network and fewer complete_tx on each
// destination's mbarrier; the bytes are the same). Every lane of the warp calls it.
template <int R>
__device__ __forceinline__ void push_columns(float* p, int rank, float v, unsigned bar) {
  static_assert((R & (R - 1)) == 0, "ranks: a power of two");
  const int lane = threadIdx.x & 31, g0 = lane & ~3, i = lane & 3;
  *p = v;  // own slot
  uint4 x;
  x.x = __float_as_uint(__shfl_sync(KVC_FULL, v, g0));
  x.y = __float_as_uint(__shfl_sync(KVC_FULL, v, g0 + 1));
  x.z = __float_as_uint(__shfl_sync(KVC_FULL, v, g0 + 2));
  x.w = __float_as_uint(__shfl_sync(KVC_FULL, v, g0 + 3));
  const unsigned a = smem_u32(p - i);  // the group's first column: 16-byte aligned
#pragma unroll
  for (int k = 0; k < (R + 2) / 4; ++k) {
    const int d = i + 1 + 4 * k;
    if (d < R) {
      const int q = (rank + d) & (R - 1);
      st_async4(mapa_u32(a, q), x, mapa_u32(bar, q));
    }
  }
}

// ---- division --------------------------------------------------------------------------------
// Every per-element division of the codec, u = a / b, divides many elements by one b (a row or
// column factor, a stored scale or step). Instead of an IEEE division sequence per element (~10
// instructions and a branch), the divisor's correctly rounded reciprocal y = RN(1/b) (__frcp_rn, once
// per divisor) and per element
//     q0 = RN(a * y),  q1 = RN(q0 + RN(a - b * q0) * y),  q = RN(q1 + (a - b * q1) * y)   (FMA)
// which is RN(a / b), the IEEE quotient, under the range conditions below:
// * |a * y - a / b| <= |a / b| 2^-24 (y within half an ulp of 1/b), so q0 is within 1.5 ulp of a / b;
//   the first correction leaves q1 within half an ulp plus 2^-22 ulp (the residual, even if rounded,
//   is relatively exact to 2^-24): within 1 ulp;
// * Markstein's theorem (IBM J. Res. Dev. 34(1), 1990, Th. 1; Muller et al., Handbook of
//   Floating-Point Arithmetic, 2018, Th. 4.10): if y is within half an ulp of 1/b and q1 within 1 ulp
//   of a / b, the residual a - b * q1 is exact and RN(q1 + (a - b * q1) * y) = RN(a / b);
// * ranges: |b| in [2^-32, 2^32] and a = 0 or |a| in [2^-92, 2^92] keep y, q0, q1 and a / b normal
//   (|a / b| in [2^-124, 2^124]) and the residual representable (e_b + e_q >= e_min + p - 1 = -103,
//   with e_b + e_q >= e_a - 1 >= -93). a = 0 gives 0, possibly of the other sign than IEEE's -0 / b:
//   every quotient here is squared, compared, rounded to a code or has +0.0 added, where the sign
//   of a zero does not matter.
// Elements or divisors outside the ranges take __fdiv_rn (a per-thread branch, taken only by such
// degenerate data). Divisions by n = T or D (powers of two) are multiplications by 1/n, which are
// the same correctly rounded value; the few per-axis divisions (scores, steps) stay __fdiv_rn.
struct Recip {
  float b, y;
};
__device__ __forceinline__ Recip recip(float b) { return Recip{b, __frcp_rn(b)}; }
__device__ __forceinline__ bool divisor_ok(float b) { return fabsf(b) >= 0x1p-32f && fabsf(b) <= 0x1p32f; }
__device__ __forceinline__ bool dividend_ok(float a) {
  // bitwise | and &: the same truth value as || and &&, without the branches of short-circuit evaluation
  return (a == 0.0f) | ((fabsf(a) >= 0x1p-92f) & (fabsf(a) <= 0x1p92f));
}
__device__ __forceinline__ float div_rn(float a, Recip d) {
  const float q0 = __fmul_rn(a, d.y);
  const float q1 = __fmaf_rn(__fmaf_rn(-d.b, q0, a), d.y, q0);
  return __fmaf_rn(__fmaf_rn(-d.b, q1, a), d.y, q1);
}
// a / d.b by the fast sequence (F) or IEEE division; a code path is chosen once per batch of
// elements, `if (ok) body(Fast<true>{}) else body(Fast<false>{})`, so no element pays for both.
template <bool F>
struct Fast {
  static constexpr bool value = F;
};
template <int M>
struct Mode {
  static constexpr int value = M;
};
template <bool F>
__device__ __forceinline__ float divide(float a, Recip d) {
  if constexpr (F) return div_rn(a, d); else return __fdiv_rn(a, d.b);
}

// ---- order-free warp reductions of floats that are never NaN (one REDUX each) --------------------
// The int whose order is the float's (-0 < +0, as nanmin/nanmax); the map is its own inverse.
__device__ __forceinline__ int order_flip(int i) { return i >= 0 ? i : i ^ 0x7fffffff; }
__device__ __forceinline__ float warp_min(float x) {
  return __int_as_float(order_flip(__reduce_min_sync(KVC_FULL, order_flip(__float_as_int(x)))));
}
__device__ __forceinline__ float warp_max(float x) {
  return __int_as_float(order_flip(__reduce_max_sync(KVC_FULL, order_flip(__float_as_int(x)))));
}
// nanmax / nanmin over the warp of values >= +0 or NaN (RMS values, normalization factors): their
// bits order as ints; a NaN anywhere gives a NaN, as torch.amax / amin.
__device__ __forceinline__ float warp_max_pos(float x) {
  return __int_as_float(__reduce_max_sync(KVC_FULL, is_nan(x) ? 0x7fffffff : __float_as_int(x)));
}
__device__ __forceinline__ float warp_min_pos(float x) {
  const int m = __reduce_min_sync(KVC_FULL, is_nan(x) ? -1 : __float_as_int(x));
  return m < 0 ? __int_as_float(0x7fffffff) : __int_as_float(m);
}

// The codes of one axis held by a warp, lane l holding values v[i] (elements l + 32*i), from its
// stored (low, step): uniform clamp(rint((v - low) / step)), lloyd_max #{j : (v - low) / step > t_j};
// 0 where step is 0 (codec: a zero stored step gives code 0).
template <int BITS, bool LM, int NV>
__device__ __forceinline__ void axis_codes(const float (&v)[NV], float low, float step, unsigned (&codes)[NV]) {
  const bool pos = step > 0.0f;
  float d[NV];
  bool ok = divisor_ok(step);
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    d[i] = __fsub_rn(v[i], low);
    ok &= dividend_ok(d[i]);
  }
  float z[NV];
  if (ok) {
    const Recip rc = recip(step);
#pragma unroll
    for (int i = 0; i < NV; ++i) z[i] = div_rn(d[i], rc);
  } else {
    const float safe = pos ? step : 1.0f;
#pragma unroll
    for (int i = 0; i < NV; ++i) z[i] = __fdiv_rn(d[i], safe);
  }
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    unsigned code;
    if constexpr (LM) {
      code = lloyd_max_code<BITS>(z[i]);
    } else {
      constexpr float QMAX = (float)((1 << BITS) - 1);
      float q = rintf(z[i]);
      q = q < 0.0f ? 0.0f : (q > QMAX ? QMAX : q);
      code = (unsigned)(int)q;
    }
    codes[i] = pos ? code : 0u;
  }
}

// The lloyd_max quantizer of one axis of n values held by a warp (as axis_codes): the Gaussian fit,
// its codes, the least-squares refit (codec._quantize_lloyd_max). Sums: the in-thread tree over i,
// then warp_tree; the caller's layout makes that the codec's halving tree over the axis.
template <typename SC, int BITS, int NV>
__device__ __forceinline__ void lloyd_max_axis(const float (&v)[NV], float n, float& step, unsigned short& sbits,
                                               float& low, unsigned short& lbits, int& errbits, int err_min,
                                               int err_step) {
  auto axis_sum = [&](auto value) {
    float t[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) t[i] = value(i);
    tree<NV>(t);
    return warp_tree(t[0]);
  };
  const float inv_n = __frcp_rn(n);  // n = T or D: exact, and x * (1/n) is x / n correctly rounded
  unsigned short unused;
  const float mean = __fmul_rn(axis_sum([&](int i) { return v[i]; }), inv_n);
  const float c = Store<SC>::round(mean, unused);
  if (!is_finite(c)) errbits |= err_min;
  const float rms = Store<SC>::round(__fsqrt_rn(__fmul_rn(axis_sum([&](int i) {
    const float d = __fsub_rn(v[i], c);
    return __fmul_rn(d, d);
  }), inv_n)), unused);
  if (!is_finite(rms)) errbits |= err_step;
  unsigned k0[NV];
  axis_codes<BITS, true, NV>(v, c, rms, k0);
  float b[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) b[i] = lloyd_max_value<BITS>(k0[i]);
  const float bm = __fmul_rn(axis_sum([&](int i) { return b[i]; }), inv_n);
  const float den = axis_sum([&](int i) {
    const float db = __fsub_rn(b[i], bm);
    return __fmul_rn(db, db);
  });
  const float num = axis_sum([&](int i) { return __fmul_rn(__fsub_rn(b[i], bm), __fsub_rn(v[i], c)); });
  if (!lloyd_max_refit<SC>(den, num, mean, bm, step, sbits, low, lbits)) {
    step = Store<SC>::round(rms, sbits);
    low = Store<SC>::round(c, lbits);
  }
}

// Token-major packing: each lane holds the code of element `lane` of a 32-element run; returns, in
// lanes 0 .. BITS - 1, the 32-bit words of the run (code of element e at bit (e % (32 / BITS)) *
// BITS of word e / (32 / BITS): the format's "lowest bits first").
template <int BITS>
__device__ __forceinline__ unsigned pack_run(unsigned code) {
  const int lane = threadIdx.x & 31;
  unsigned x = code;
#pragma unroll
  for (int h = 1; h < 32 / BITS; h *= 2) x |= __shfl_down_sync(KVC_FULL, x, h) << (BITS * h);
  // word m sits in lane m * (32 / BITS); bring it to lane m
  return __shfl_sync(KVC_FULL, x, (lane % BITS) * (32 / BITS));
}

// x[i] for a runtime i < N, by selects (an indexed register array would go to local memory).
template <int N>
__device__ __forceinline__ float pick(const float (&x)[N], int i) {
  float v = x[0];
#pragma unroll
  for (int k = 1; k < N; ++k) v = i == k ? x[k] : v;
  return v;
}

// The column tree over a thread's NK rows (tokens) as a depth-first recursion: node(i, m) = the sum
// over the rows k = i mod m, node(i, m) = node(i, 2m) + node(i + m, 2m) (the halving tree's order),
// the leaves (m = NK) the rows zsq(k * NJ + j), each also handed to row(values, k) as it is made.
// At most log2(NK) partial columns are live at once (registers: NK = 8 in a lone CTA).
template <int I, int M, int NK, int NJ, typename Zsq, typename Row>
__device__ __forceinline__ void column_node(float (&out)[NJ], const Zsq& zsq, const Row& row) {
  if constexpr (M == NK) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) out[j] = zsq(I * NJ + j);
    row(out, I);
  } else {
    float lo[NJ], hi[NJ];
    column_node<I, 2 * M, NK>(lo, zsq, row);
    column_node<I + M, 2 * M, NK>(hi, zsq, row);
#pragma unroll
    for (int j = 0; j < NJ; ++j) out[j] = __fadd_rn(lo[j], hi[j]);
  }
}

template <int T, int D, int R>
struct Shape {
  // KVARN_OW warps for a lone CTA (32 shipped, 16 at D=256); on a cluster KVARN_CW (8 shipped: two per
  // scheduler): a CTA's tile is T / R = 16 tokens, and fewer warps with more elements each cut the work that every warp repeats per iteration
  // (row RMS trees, reciprocals, the score); more warps give each scheduler independent chains (at 4 the
  // kernel issues once every 6.3 cycles, latency-bound: docs/perf-notes.md).
  static constexpr int W = R > 1 ? KVARN_CW : KVC_W;
  static constexpr int NT = 32 * W;
  static constexpr int NK = T / R / W;  // tokens per thread: t = rank + R * (w + W * k)
  static constexpr int NJ = D / 32;     // channels per thread: c = lane + 32 * j
  static constexpr int N = NK * NJ;
  static_assert(NK >= 1 && T % (R * W) == 0, "each warp needs a token of each rank");
  // y stays in registers on clusters (N <= 32); a lone CTA keeps it in shared memory (thread-private
  // slots, conflict-free) and y / s in registers when N <= 32.
  static constexpr bool kYInRegs = R > 1;
  static constexpr bool kCacheYs = N <= 32;
  static constexpr int CM = (D + NT - 1) / NT;  // columns per thread in the column phases: c = tid + NT * m
  static constexpr int CW = D / 32 < W ? D / 32 : W;  // warps that own columns there
  static constexpr int XW = D / 32 < W ? D / 32 : 0;  // the warp that also gathers the extras
  static constexpr int DR = D / R;      // K channels a rank quantizes (the transposed phase)
  static constexpr int NI = T / 32;     // tokens per lane there: t = lane + 32 * i
  static constexpr int kPitch = T + 1;  // R == 1: floats per transposed channel row (conflict-free)
  // The transposed K values: R == 1 channel-major [DR][kPitch]; R > 1 token-major [T][DR + 1], so that
  // the lanes of one push instruction that go to one rank write one token's DR / 32-lane run of
  // contiguous channels (a few coalesced DSMEM writes instead of one per lane); the readers' columns
  // (stride DR + 1, odd) stay conflict-free.
  static constexpr int kTRow = R > 1 ? DR + 1 : 1, kTCol = R > 1 ? 1 : kPitch;  // position t * kTRow + cl * kTCol
  static constexpr int kTrans = R > 1 ? T * (DR + 1) : DR * kPitch;
  // exchange slot of one rank per iteration: column partials [D], row RMS max / min, max r, input
  // error bits, the V half's nonzero-channel masks [NJ] (16-byte aligned: the extras are one v4 push)
  static constexpr int XB = (D + 4 + NJ + 3) / 4 * 4;
  // dynamic shared memory (floats): mbar (R > 1: 8-byte mbarriers, one per iteration parity and the
  // K transposition's, padded to 32 bytes) |
  // big (the y slots when R == 1, then the transposed K values, kTrans) | part [W][D] |
  // xbuf [2][R][XB] (per iteration parity, every rank's slot; R == 1: this CTA's own) | bc [3][D] |
  // red [4W + W * NJ] | red2 [2W + 12] | best [T + D]
  static constexpr int kMbar = R > 1 ? 8 : 0;
  static constexpr int kYSlots = kYInRegs ? 0 : N * NT;
  static constexpr int kBig = kYSlots > kTrans ? kYSlots : kTrans;
  static constexpr int kRed = 4 * W + W * NJ;
  static_assert((kMbar + kBig + W * D) % 4 == 0, "xbuf 16-byte aligned");
  static constexpr int kSmemFloats = kMbar + kBig + W * D + 2 * R * XB + 3 * D + kRed + 2 * W + 12 + T + D;
  static constexpr int kSmemBytes = (kSmemFloats * 4 + 15) / 16 * 16;
};

// The tile of compress_tiles / compress_layer: token t of the half at src[t * st].
template <typename IN>
struct StridedTile {
  const IN* __restrict__ src;
  long long st;
  __device__ __forceinline__ IN operator()(int t, int c) const { return src[(long long)t * st + c]; }
};

// One record half: the tile `tile(t, c)` (t < T, c < D, values of type IN) is compressed into the
// record at dst (K half if !is_v, else V half) by the R ranks of a cluster (R = 1: one CTA). The
// arithmetic does not depend on where the tile comes from: every source gives the same bytes for
// the same values.
//
// Layout: rank q, thread (warp w, lane l) owns tokens t = q + R*(w + W*k), k < NK, and channels
// c = l + 32*j, j < NJ. The codec's halving trees keep their order:
// * a row sum (over c): in-thread over j (pairs c, c + D/2), then __shfl_xor 16 .. 1 (lane l pairs
//   with l + 16, ...; the upper lanes compute the same sums with the operands swapped);
// * a column sum (over t): in-thread over k (pairs t, t + T/2), then over the W warps (t = q + R*w)
//   through shared memory, then over the R ranks (t = q) through the exchange buffers;
// * the K half's per-channel sums, after the transposition (rank q then holds channels
//   [q*DR, (q+1)*DR) for all tokens; warp w channel q*DR + w + W*m, lane l tokens t = l + 32*i):
//   in-thread over i (pairs t, t + T/2), then __shfl_xor 16 .. 1;
// * the WHT butterfly at stride h < 32 is a __shfl_xor by h, at stride 32*b an in-thread pair of j.
//
// One exchange per normalization iteration: the candidate's column partials and row RMS are
// written, __syncthreads, each rank's partial of every column (the tree over its warps) and its
// extras (row RMS max / min, max r; at iteration 0 the input error bits and nonzero-channel masks)
// go to every rank's receive slot of this rank, every rank finishes every column from the R slots
// in rank order 0 .. R - 1 (the same tree<R> as before, so all ranks hold the same column RMS, new s
// and score, and the bytes stay the codec's), __syncthreads. The update of r is rank-local. The K
// half then transposes u through the ranks' shared memory (on a cluster: pushed the same way, onto
// a third mbarrier, one phase); both halves wait for their cluster only before they exit.
//
// The exchange on a cluster (R > 1) has no cluster barrier: each rank pushes its slot into every
// other rank with st.async (shared::cluster, complete_tx on the destination's mbarrier; no
// GPU-scope fence, one local mbarrier wait per iteration instead of barrier.cluster + DSMEM loads).
// Protocol (b = it & 1, the iteration's parity):
// * receive slots xbuf[b][q] (rank q's data of the iterations of parity b) and an mbarrier mbar[b]
//   per parity, initialized with arrival count 1 before the loop (fence.mbarrier_init, then a
//   cluster arrive; each rank waits on it before its first push, so no push meets an
//   uninitialized barrier);
// * iteration it uses phase it >> 1 of mbar[b]: thread 0 makes the phase's one arrival with
//   expect_tx = the bytes the other R - 1 ranks push (4 (D + 4) each, + 4 NJ masks at it 0);
//   every thread waits for the phase with parity (it >> 1) & 1 (try_wait.parity, acquire at cluster
//   scope). Pushes may land before the expect_tx (the tx-count goes negative); the phase cannot
//   complete early then, its arrival is still pending;
// * no push lands in a slot or phase still in use: rank A pushes iteration it + 2 (slot and barrier
//   b again) only after its wait of iteration it + 1, which needs rank Y's pushes of it + 1, which
//   Y issues after its __syncthreads that follow every read of its slots b at it and its wait of
//   it (so Y's phase it >> 1 of mbar[b] has completed, and Y's next phase counts A's bytes). The
//   same chain one iteration shorter keeps A's pushes of it + 1 out of Y's slots 1 - b until Y has
//   read them at it - 1. Two parities are needed: with one barrier, A's pushes of it + 1 could be
//   counted in Y's phase of it while a third rank's bytes of it are still in flight to Y;
// * the column partials go in 16-byte pushes (push_columns: D / 4 per destination), the extras in
//   one; a rank's own slot is a plain store (read by the same thread, or by its warp after __syncwarp);
// * exit: after its last wait no more bytes come to a rank; a relaxed cluster arrive after that
//   wait (the V half's after the loop, the K half's after its transposition's) and a cluster wait
//   before the exit keep every rank alive until every rank has passed its last wait, so no push
//   to or from a rank is in flight when it exits. A rejected input exits at iteration 0 through
//   one cluster barrier (every rank decides the same).
// With R = 1 the slots are this CTA's own (xbuf[b][0]) and the exchange is two __syncthreads.
//
// ENTRY_CHECK (the append's rule: a half that finds the error flag already set does nothing, so that
// a failed append's first error stays the one reported): thread 0 reads the flag as the half starts,
// and its answer (KVC_SEEN) travels with the input error bits of iteration 0, so every rank of a
// cluster takes the rejected-input exit at the same point, with no barrier of its own; a half that
// saw the flag set ORs nothing into it. The read overlaps the load, the WHT and the first candidate.
//
// tick(): called by every thread once this CTA's threads hold their tile in registers (after the load and the
// WHT, which consume every loaded value): the append's fused form counts the CTAs done reading the window there
// (append_compress). NoTick for the rest.
struct NoTick {
  __device__ __forceinline__ void operator()() const {}
};
template <int T, int D, typename IN, typename SC, int VB, bool LM, int R, bool ENTRY_CHECK = false, typename Tile,
          typename Tick = NoTick>
__device__ __forceinline__ void compress_impl(const Tile& tile, const bool is_v, u8* __restrict__ dst, int iters,
                                              Sections sec, float inv_sqrt_d, int* __restrict__ err,
                                              const Tick& tick = Tick{}) {
  using S = Shape<T, D, R>;
  constexpr int NK = S::NK, NJ = S::NJ, N = S::N, NT = S::NT, W = S::W, XB = S::XB, CM = S::CM, CW = S::CW;
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  unsigned long long* mbar = reinterpret_cast<unsigned long long*>(smem);  // [3] (R > 1) parity 0, 1, K transposition
  float* big = smem + S::kMbar;   // y slots (R == 1) [N][NT]; then the transposed K values (Shape::kTrans)
  float* part = big + S::kBig;    // [W][D]  per-warp column partials
  float* xbuf = part + W * D;     // [2][R][XB] receive slots, by iteration parity and sending rank
  float* bc = xbuf + 2 * R * XB;  // [3][D]  column RMS, new s, RN(1 / new s)
  float* red = bc + 3 * D;        // [4W + W*NJ] per-warp row RMS max / min, max r, error bits, masks
  float* red2 = red + S::kRed;    // [2W + 12] per-warp column RMS max / min; the cluster's extras
  float* best = red2 + 2 * W + 12;  // [T + D] the best candidate's r (by token) and s (by channel)
  int* redi = reinterpret_cast<int*>(red);
  int* red2i = reinterpret_cast<int*>(red2);

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int rank = cluster_rank<R>();
  auto token = [&](int k) { return rank + R * (w + W * k); };
  // L2 (coherent with the atomics that set the flag); consumed at iteration 0's exchange
  const bool flagged = ENTRY_CHECK && tid == 0 && __ldcg(err) != 0;
  if constexpr (R > 1) {
    // the exchange's mbarriers, before any rank may push into this one: every rank waits for this
    // arrival (its cluster_wait at iteration 0) before its first push; the load, the WHT and the
    // first candidate run in between
    if (tid == 0) {
      mbar_init(smem_u32(mbar));
      mbar_init(smem_u32(mbar + 1));
      mbar_init(smem_u32(mbar + 2));  // the K half's transposition
      mbar_init_fence();
    }
    cluster_arrive_relaxed();
  }

  // ---- load, check, WHT ------------------------------------------------------------------------
  float y[N];
  bool nonfinite = false, toolarge = false;
#pragma unroll
  for (int k = 0; k < NK; ++k) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const float x = to_f32(tile(token(k), lane + 32 * j));
      nonfinite |= !is_finite(x);
      toolarge |= fabsf(x) > 0x1p48f;
      y[k * NJ + j] = x;
    }
  }
#pragma unroll
  for (int hs = 1; hs < 32; hs *= 2) {
    const bool upper = (lane & hs) != 0;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float p = __shfl_xor_sync(KVC_FULL, y[i], hs);
      y[i] = upper ? __fsub_rn(p, y[i]) : __fadd_rn(y[i], p);
    }
  }
#pragma unroll
  for (int hb = 1; hb < NJ; hb *= 2) {
#pragma unroll
    for (int k = 0; k < NK; ++k) {
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        if (!(j & hb)) {
          const float a = y[k * NJ + j], c = y[k * NJ + (j | hb)];
          y[k * NJ + j] = __fadd_rn(a, c);
          y[k * NJ + (j | hb)] = __fsub_rn(a, c);
        }
      }
    }
  }
  tick();
  // |y| <= 2^52 for accepted input; the fast division needs its dividends in [2^-40, 2^52] or 0 (the
  // derived dividends y / s, y / r, ... then stay within [2^-92, 2^92] for divisors in [2^-32, 2^32]).
  bool y_ok = true;
  unsigned col_nz = 0;  // bit j: channel lane + 32*j has a nonzero among this thread's tokens
#pragma unroll
  for (int k = 0; k < NK; ++k) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int i = k * NJ + j;
      y[i] = __fmul_rn(y[i], inv_sqrt_d);
      y_ok &= y[i] == 0.0f || fabsf(y[i]) >= 0x1p-40f;
      col_nz |= (y[i] != 0.0f ? 1u : 0u) << j;
    }
  }
  float* ysm = big;
  if constexpr (!S::kYInRegs) {
#pragma unroll
    for (int i = 0; i < N; ++i) ysm[i * NT + tid] = y[i];
  }
  // y[] lives on in registers on clusters; a lone CTA reads its slots back (no sync needed)
  auto Y = [&](int i) -> float {
    if constexpr (S::kYInRegs) return y[i]; else return ysm[i * NT + tid];
  };

  // ---- variance normalization --------------------------------------------------------------------
  // the best candidate's factors wait in shared memory (best[t], best[T + c]: registers are short
  // for a lone CTA's 64 elements a thread at D = 256); written by the threads that hold them
  float r[NK], s[NJ];
  auto keep_best = [&]() {
    if (lane == 0) {
#pragma unroll
      for (int k = 0; k < NK; ++k) best[token(k)] = r[k];
    }
    if (w == 0) {
#pragma unroll
      for (int j = 0; j < NJ; ++j) best[T + lane + 32 * j] = s[j];
    }
  };
  float ir[NK];  // RN(1 / r), the fast division's reciprocals; RN(1 / s) stays in bc[2D + c]
#pragma unroll
  for (int k = 0; k < NK; ++k) r[k] = ir[k] = 1.0f;
#pragma unroll
  for (int j = 0; j < NJ; ++j) s[j] = 1.0f;
  keep_best();  // the identity, should no score be below +inf (NaN)
  float best_score = __uint_as_float(0x7f800000u), best_rmax = 1.0f;
  float ys[S::kCacheYs ? N : 1];
  // the fast division's conditions for this thread's divisors (r, s) and dividends (y, y / s)
  bool r_ok = true, s_ok = true;

  for (int it = 0;; ++it) {
    float* rb = xbuf + (it & 1) * R * XB;  // this iteration's receive slots, rb[q * XB + i] from rank q
    float* xb = rb + rank * XB;            // this rank's own slot
    const unsigned bar = R > 1 ? smem_u32(mbar + (it & 1)) : 0u;
    // candidate z = (y / s) / r (it 0: y), squared: each token's RMS, and the column partials over
    // this thread's tokens (the tree over k, its first level as the rows are made: pairs k, k + NK/2)
    // this lane's token k = lane % NK: its sum over c of z^2 (every lane has every token's; keep one)
    float rowsum = 0.0f, colp[NJ];
    auto candidate = [&](auto mode) {
      constexpr int M = decltype(mode)::value;  // 0: it 0 (z = y), 1: fast division, 2: IEEE
      auto zsq = [&](int i) {
        float z;
        if constexpr (M == 0) z = Y(i);  // s = r = 1: (y / 1) / 1 == y exactly
        else if constexpr (S::kCacheYs) z = divide<M == 1>(ys[i], Recip{r[i / NJ], ir[i / NJ]});
        else z = divide<M == 1>(divide<M == 1>(Y(i), Recip{s[i % NJ], bc[2 * D + lane + 32 * (i % NJ)]}), Recip{r[i / NJ], ir[i / NJ]});
        return __fmul_rn(z, z);
      };
      auto row_sum = [&](const float (&zz)[NJ], int k) {
        float t[NJ];
#pragma unroll
        for (int j = 0; j < NJ; ++j) t[j] = zz[j];
        tree<NJ>(t);
        const float sum = warp_tree(t[0]);
        rowsum = lane % NK == k ? sum : rowsum;
      };
      column_node<0, 1, NK>(colp, zsq, row_sum);
    };
    if (it == 0) candidate(Mode<0>{});
    else if (y_ok && s_ok && r_ok) candidate(Mode<1>{});
    else candidate(Mode<2>{});
    // the per-token scalars once per token: lane l takes token k = l % NK, the warp reduces them
    const float rr = rms_of(__fmul_rn(rowsum, 1.0f / D));
    const float rmax = warp_max_pos(rr), rmin = warp_min_pos(rr), mr = warp_max_pos(pick<NK>(r, lane % NK));
#pragma unroll
    for (int j = 0; j < NJ; ++j) part[w * D + lane + 32 * j] = colp[j];
    if (lane == 0) {
      red[w] = rmax;
      red[W + w] = rmin;
      red[2 * W + w] = mr;
    }
    if (it == 0) {
      const int bits = (nonfinite ? (is_v ? KVC_ERR_V_NONFINITE : KVC_ERR_K_NONFINITE) : 0) |
                       (toolarge ? (is_v ? KVC_ERR_V_RANGE : KVC_ERR_K_RANGE) : 0) | (flagged ? KVC_SEEN : 0);
      const int wbits = __reduce_or_sync(KVC_FULL, bits);
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const unsigned m = __ballot_sync(KVC_FULL, (col_nz >> j) & 1u);
        if (lane == 0) redi[4 * W + w * NJ + j] = (int)m;
      }
      if (lane == 0) redi[3 * W + w] = wbits;
    }
    __syncthreads();
    if constexpr (R > 1) {
      if (it == 0) cluster_wait<R>();  // every rank's mbarriers are initialized
      // this phase's one arrival: the bytes the other R - 1 ranks push into this rank's slots
      if (tid == 0) mbar_arrive_expect_tx(bar, (R - 1) * 4 * (D + 4 + (it == 0 ? NJ : 0)));
    }
#pragma unroll
    for (int m = 0; m < CM; ++m) {
      const int c = tid + NT * m;
      if (c < D) {
        float p[W];
#pragma unroll
        for (int q = 0; q < W; ++q) p[q] = part[q * D + c];
        tree<W>(p);
        if constexpr (R > 1) push_columns<R>(xb + c, rank, p[0], bar); else xb[c] = p[0];  // c < D: whole warps
      }
    }
    if (w == S::XW) {
      // this rank's extras: row RMS max / min and max r over its warps; (it 0) error bits, masks
      const int q = lane < W ? lane : 0;
      const float a = warp_max_pos(red[q]), b = warp_min_pos(red[W + q]), c = warp_max_pos(red[2 * W + q]);
      if constexpr (R > 1) {
        const int e = it == 0 ? __reduce_or_sync(KVC_FULL, lane < W ? redi[3 * W + lane] : 0) : 0;
        if (lane == 0) push_all4<R>(xb + D, rank, make_uint4(__float_as_uint(a), __float_as_uint(b), __float_as_uint(c), (unsigned)e), bar);
        if (it == 0 && lane < NJ) {
          int mk = 0;
#pragma unroll
          for (int qq = 0; qq < W; ++qq) mk |= redi[4 * W + qq * NJ + lane];
          push_all<R>(xb + D + 4 + lane, rank, __int_as_float(mk), bar);
        }
        __syncwarp();  // lane 0's own slot to the lane that reads it below
      } else {
        if (lane == 0) {
          xb[D] = a;
          xb[D + 1] = b;
          xb[D + 2] = c;
        }
        if (it == 0) {
          const int e = __reduce_or_sync(KVC_FULL, lane < W ? redi[3 * W + lane] : 0);
          if (lane == 0) reinterpret_cast<int*>(xb)[D + 3] = e;
          if (lane < NJ) {
            int mk = 0;
#pragma unroll
            for (int qq = 0; qq < W; ++qq) mk |= redi[4 * W + qq * NJ + lane];
            reinterpret_cast<int*>(xb)[D + 4 + lane] = mk;
          }
        }
      }
    }
    if constexpr (R > 1) mbar_wait(bar, (unsigned)(it >> 1) & 1u);  // every rank's slots landed
    else __syncthreads();
    if (w < CW) {
      float mx = 0.0f, mn = 0.0f;
#pragma unroll
      for (int m = 0; m < CM; ++m) {
        const int c = tid + NT * m;
        float p[R];
#pragma unroll
        for (int q = 0; q < R; ++q) p[q] = rb[q * XB + c];
        tree<R>(p);
        const float cr = rms_of(__fmul_rn(p[0], 1.0f / T));
        const float s_c = it == 0 ? 1.0f : bc[D + c];  // column c's s: this thread's new s of the last iteration
        const float sn = __fmul_rn(s_c, cr);
        bc[c] = cr;
        bc[D + c] = sn;
        bc[2 * D + c] = __frcp_rn(sn);
        mx = m == 0 ? cr : nanmax(mx, cr);
        mn = m == 0 ? cr : nanmin(mn, cr);
      }
      mx = warp_max_pos(mx);
      mn = warp_min_pos(mn);
      if (lane == 0) {
        red2[w] = mx;
        red2[W + w] = mn;
      }
    }
    if (w == S::XW) {
      const int q = lane < R ? lane : 0;
      const float a = warp_max_pos(rb[q * XB + D]), b = warp_min_pos(rb[q * XB + D + 1]);
      const float c = warp_max_pos(rb[q * XB + D + 2]);
      if (lane == 0) {
        red2[2 * W] = a;
        red2[2 * W + 1] = b;
        red2[2 * W + 2] = c;
      }
      if (it == 0) {
        const int e = __reduce_or_sync(KVC_FULL, __float_as_int(rb[q * XB + D + 3]));
        if (lane == 0) red2i[2 * W + 3] = e;
        if (is_v && lane < NJ) {
          int mk = 0;
#pragma unroll
          for (int qq = 0; qq < R; ++qq) mk |= __float_as_int(rb[qq * XB + D + 4 + lane]);
          red2i[2 * W + 4 + lane] = mk;
        }
      }
    }
    __syncthreads();
    if (it == 0) {
      const int e = red2i[2 * W + 3];
      if (e) {  // rejected input, or the flag set at entry: nothing is written (the same decision on every rank)
        if (rank == 0 && tid == 0 && !(ENTRY_CHECK && (e & KVC_SEEN))) atomicOr(err, e);
        cluster_sync<R>();  // no rank leaves while a push to it or from it may be in flight
        return;
      }
    }
    const int cq = lane < CW ? lane : 0;
    const float crmax = warp_max_pos(red2[cq]), crmin = warp_min_pos(red2[W + cq]);
    const float score = __fadd_rn(__fdiv_rn(crmax, crmin), __fdiv_rn(red2[2 * W], red2[2 * W + 1]));
    if (score < best_score) {  // uniform across the cluster
      best_score = score;
      best_rmax = red2[2 * W + 2];
      keep_best();
    }
    if (it >= iters) break;
    // s *= col_rms(z); then r *= row_rms((y / s) / r) with the new s
    s_ok = true;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      s[j] = bc[D + lane + 32 * j];
      s_ok &= divisor_ok(s[j]);
    }
    float row = 0.0f;  // sum over c of ((y / s) / r)^2 of this lane's token k = lane % NK
    auto update = [&](auto fast) {
      constexpr bool F = decltype(fast)::value;
#pragma unroll
      for (int k = 0; k < NK; ++k) {
        float t[NJ];
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const int i = k * NJ + j;
          const float q = divide<F>(Y(i), Recip{s[j], bc[2 * D + lane + 32 * j]});
          if constexpr (S::kCacheYs) ys[i] = q;
          const float z = divide<F>(q, Recip{r[k], ir[k]});
          t[j] = __fmul_rn(z, z);
        }
        tree<NJ>(t);
        const float sum = warp_tree(t[0]);
        row = lane % NK == k ? sum : row;
      }
    };
    if (y_ok && s_ok && r_ok) update(Fast<true>{}); else update(Fast<false>{});
    // r *= row RMS, and RN(1 / r), once per token (lane k), then to every lane
    const float rn = __fmul_rn(pick<NK>(r, lane % NK), rms_of(__fmul_rn(row, 1.0f / D)));
    const float irn = __frcp_rn(rn);
#pragma unroll
    for (int k = 0; k < NK; ++k) {
      r[k] = __shfl_sync(KVC_FULL, rn, k);
      ir[k] = __shfl_sync(KVC_FULL, irn, k);
    }
    r_ok = __all_sync(KVC_FULL, divisor_ok(rn));
  }
  // V: this rank has passed its last wait (no push to it is left); it exits only after every rank
  // has (cluster_wait at the end), so no push to or from it is in flight at its exit. Relaxed: no
  // data passes through this barrier. (The K half arrives after its transposition's wait.)
  if constexpr (R > 1) {
    if (is_v) cluster_arrive_relaxed();
  }

  // ---- power-of-two balance ----------------------------------------------------------------------
  __syncthreads();  // the best factors visible
  float bs[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) bs[j] = best[T + lane + 32 * j];
  float ms = bs[0];
#pragma unroll
  for (int j = 1; j < NJ; ++j) ms = max_nan(ms, bs[j]);  // s >= +0 or NaN: nanmax's value
  ms = warp_max_pos(ms);  // every warp holds every column
  const int diff = frexp_exponent(best_rmax) - frexp_exponent(ms);
  const int shift = diff >= 0 ? diff / 2 : -((1 - diff) / 2);  // floor(diff / 2)

  constexpr float kSmallest = Store<SC>::kSmallest;
  unsigned short bits;
  int errbits = 0;

  if (!is_v) {
    // ---- K: row_scale = r (zero tokens: the smallest scale), u = y / row_scale -------------------
    float rs[NK];
    const float p2 = pow2f(-shift);
    bool rs_ok = true;
#pragma unroll
    for (int k = 0; k < NK; ++k) {
      bool nz = false;
#pragma unroll
      for (int j = 0; j < NJ; ++j) nz |= Y(k * NJ + j) != 0.0f;
      float x = __any_sync(KVC_FULL, nz) ? __fmul_rn(best[token(k)], p2) : 0.0f;
      x = x < kSmallest ? kSmallest : x;  // clamp_min (NaN stays NaN)
      rs[k] = Store<SC>::round(x, bits);
      if (!is_finite(rs[k])) errbits |= KVC_ERR_K_ROW_SCALE;
      if (lane == 0) Store<SC>::put(dst + sec.row_scale, token(k), rs[k], bits);
      rs_ok &= divisor_ok(rs[k]);
    }
    float u[N];
    if (y_ok && rs_ok) {
#pragma unroll
      for (int k = 0; k < NK; ++k) {
        const Recip d = recip(rs[k]);
#pragma unroll
        for (int j = 0; j < NJ; ++j) u[k * NJ + j] = __fadd_rn(div_rn(Y(k * NJ + j), d), 0.0f);
      }
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) u[i] = __fadd_rn(__fdiv_rn(Y(i), rs[i / NJ]), 0.0f);  // canonical +0
    }
    // transpose: u(t, c) to rank c / DR, local channel c % DR, token t (layout: Shape::kTrans)
    constexpr int DR = S::DR, NI = S::NI, TR = S::kTRow, TC = S::kTCol;  // (cl, t) at tb[t * TR + cl * TC]
    float* tb = big;
    if constexpr (!S::kYInRegs) __syncthreads();  // every y slot read: tb overwrites them
#pragma unroll
    for (int k = 0; k < NK; ++k) {
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int c = lane + 32 * j;
        if constexpr (R > 1) {
          // pushed like the iteration exchange, counted on mbar[2] (one phase, parity 0); this
          // rank's own tokens by plain stores
          float* p = tb + token(k) * TR + (c % DR) * TC;
          const int q = c / DR;
          if (q == rank) *p = u[k * NJ + j];
          else st_async(mapa_u32(smem_u32(p), q), __float_as_uint(u[k * NJ + j]), mapa_u32(smem_u32(mbar + 2), q));
        } else {
          st_rank<R>(tb + token(k) * TR + (c % DR) * TC, c / DR, u[k * NJ + j]);
        }
      }
    }
    if constexpr (R > 1) {
      // the other ranks' T - T / R tokens of this rank's DR channels; the arrival may come after some
      // of them (the phase cannot complete before it)
      if (tid == 0) mbar_arrive_expect_tx(smem_u32(mbar + 2), (T - T / R) * DR * 4);
      mbar_wait(smem_u32(mbar + 2), 0u);
      __syncthreads();               // this rank's own tokens, stored by its other warps
      cluster_arrive_relaxed();      // exit guard: see the V half's
    } else {
      cluster_sync<R>();
    }
    // ---- K: per channel over the tile's tokens: warp w, channels q*DR + w + W*m --------------------
    for (int cl = w; cl < DR; cl += W) {
      const int c = rank * DR + cl;
      float v[NI];
#pragma unroll
      for (int i = 0; i < NI; ++i) v[i] = tb[(lane + 32 * i) * TR + cl * TC];
      float step, low;
      unsigned short sbits, lbits;
      if constexpr (!LM) {
        float lo = v[0], hi = v[0];
#pragma unroll
        for (int i = 1; i < NI; ++i) {
          lo = min_nan(lo, v[i]);  // u: never -0 (canonical +0), so nanmin's value
          hi = max_nan(hi, v[i]);
        }
        lo = warp_min(lo);
        hi = warp_max(hi);
        step = Store<SC>::round(__fdiv_rn(__fsub_rn(hi, lo), 15.0f), sbits);
        if (!is_finite(step)) errbits |= KVC_ERR_K_CHAN_STEP;
        low = Store<SC>::round(lo, lbits);
        if (!is_finite(low)) errbits |= KVC_ERR_K_CHAN_MIN;
      } else {
        lloyd_max_axis<SC, 4, NI>(v, (float)T, step, sbits, low, lbits, errbits, KVC_ERR_K_CHAN_MIN, KVC_ERR_K_CHAN_STEP);
      }
      if (lane == 0) {
        Store<SC>::put(dst + sec.chan_step, c, step, sbits);
        Store<SC>::put(dst + sec.chan_min, c, low, lbits);
      }
      unsigned codes[NI];
      axis_codes<4, LM, NI>(v, low, step, codes);
      // channel-major nibbles: token t at bit 4 * (t % 8) of word t / 8 of the channel's T / 8 words
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        const unsigned word = pack_run<4>(codes[i]);
        if (lane < 4) reinterpret_cast<unsigned*>(dst + sec.k_codes + c * (T / 2))[4 * i + lane] = word;
      }
    }
  } else {
    // ---- V: col_scale = s (zero channels: the smallest scale), u = y / col_scale --------------------
    float cs[NJ];
    const float p2 = pow2f(shift);
    bool cs_ok = true;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      float x = (red2i[2 * W + 4 + j] >> lane) & 1 ? __fmul_rn(bs[j], p2) : 0.0f;
      x = x < kSmallest ? kSmallest : x;
      cs[j] = Store<SC>::round(x, bits);
      if (!is_finite(cs[j])) errbits |= KVC_ERR_V_COL_SCALE;
      if (rank == 0 && w == 0) Store<SC>::put(dst + sec.col_scale, lane + 32 * j, cs[j], bits);
      cs_ok &= divisor_ok(cs[j]);
    }
    float u[N];
    if (y_ok && cs_ok) {
      Recip d[NJ];
#pragma unroll
      for (int j = 0; j < NJ; ++j) d[j] = recip(cs[j]);
#pragma unroll
      for (int i = 0; i < N; ++i) u[i] = __fadd_rn(div_rn(Y(i), d[i % NJ]), 0.0f);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) u[i] = __fadd_rn(__fdiv_rn(Y(i), cs[i % NJ]), 0.0f);  // canonical +0
    }
    // ---- V: per token over the channels (this warp's tokens) ---------------------------------------
    constexpr int QMAX = (1 << VB) - 1;
#pragma unroll
    for (int k = 0; k < NK; ++k) {
      float v[NJ];
#pragma unroll
      for (int j = 0; j < NJ; ++j) v[j] = u[k * NJ + j];
      float step, low;
      unsigned short sbits, lbits;
      if constexpr (!LM) {
        float lo = v[0], hi = v[0];
#pragma unroll
        for (int j = 1; j < NJ; ++j) {
          lo = min_nan(lo, v[j]);  // u: never -0 (canonical +0), so nanmin's value
          hi = max_nan(hi, v[j]);
        }
        lo = warp_min(lo);
        hi = warp_max(hi);
        step = Store<SC>::round(__fdiv_rn(__fsub_rn(hi, lo), (float)QMAX), sbits);
        if (!is_finite(step)) errbits |= KVC_ERR_V_TOK_STEP;
        low = Store<SC>::round(lo, lbits);
        if (!is_finite(low)) errbits |= KVC_ERR_V_TOK_MIN;
      } else {
        lloyd_max_axis<SC, VB, NJ>(v, (float)D, step, sbits, low, lbits, errbits, KVC_ERR_V_TOK_MIN, KVC_ERR_V_TOK_STEP);
      }
      const int t = token(k);
      if (lane == 0) {
        Store<SC>::put(dst + sec.tok_step, t, step, sbits);
        Store<SC>::put(dst + sec.tok_min, t, low, lbits);
      }
      unsigned codes[NJ];
      axis_codes<VB, LM, NJ>(v, low, step, codes);
      // token-major: channels 32j .. 32j + 31 are VB words of the token's D * VB / 32
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const unsigned word = pack_run<VB>(codes[j]);
        if (lane < VB) reinterpret_cast<unsigned*>(dst + sec.v_codes + t * (D * VB / 8))[VB * j + lane] = word;
      }
    }
  }
  cluster_wait<R>();  // both halves: the exit guard
  errbits = __reduce_or_sync(KVC_FULL, errbits);
  if (lane == 0 && errbits) atomicOr(err, errbits);
}

// The layer kernel's CTA: record (b, tile, head) = blockIdx.x / R, rank blockIdx.x % R (the cluster
// spans x), half = blockIdx.y, from strided input.
template <int T, int D, typename IN, typename SC, int VB, bool LM, int R>
__device__ __forceinline__ void compress_layer_block(const IN* __restrict__ k_in, const IN* __restrict__ v_in,
                                                     long long k_sb, long long k_sh, long long k_st,
                                                     long long v_sb, long long v_sh, long long v_st,
                                                     u8* __restrict__ out, long long o_sb, long long o_si, long long o_sh,
                                                     int n_heads, int n_tiles, int iters, Sections sec,
                                                     float inv_sqrt_d, int* __restrict__ err) {
  const bool is_v = blockIdx.y != 0;
  const long long rec = blockIdx.x / R;
  const int h = (int)(rec % n_heads);
  const long long bt = rec / n_heads;
  const int tile = (int)(bt % n_tiles);
  const long long b = bt / n_tiles;
  const StridedTile<IN> src{is_v ? v_in + b * v_sb + h * v_sh + (long long)tile * T * v_st
                                 : k_in + b * k_sb + h * k_sh + (long long)tile * T * k_st,
                            is_v ? v_st : k_st};
  u8* dst = out + b * o_sb + (long long)tile * o_si + h * o_sh;
  compress_impl<T, D, IN, SC, VB, LM, R>(src, is_v, dst, iters, sec, inv_sqrt_d, err);
}

// ==== the cache's append (kvarn_cutlass/ops/append.py) ============================================
//
// Two kernels per append of n tokens to one layer (one in the fused form below), both reading the layer's lengths
// from the device (int32 lens[3][batch]: n_tiles, window_len, sink_len of each sequence), so that one launch
// serves any length (CUDA graphs):
//
// * append_compress (only needed when a tile completes): record halves [0, batch * max_new * heads)
//   x 2 (blockIdx.y: K, V) compress tile i < n_new of (b, head) from the stream window[0, wl) ++
//   chunk[n_sink, n) straight into pool slot tile_table[b][n_tiles + i] (no staging copy), each on R
//   CTAs (blockIdx.x / R is the half; R = T / 16, a thread-block cluster, in
//   append_compress_cluster on sm_90; R = 1 in append_compress); then batch * heads * aux_parts
//   "aux" CTAs x 2, one each (padded with idle CTAs to whole clusters), check every chunk token
//   (below) and, given a backup buffer, copy the window as it is into it (what a failed deferred
//   block restores). Nothing visible changes.
// * append_commit, grid (batch * heads, 2 halves, parts), 256 threads: writes the sink and window. With
//   no tile completing the window only grows: chunk tokens go to window[wl, ...) beyond the live
//   length, so the block checks them as it writes. With tiles, the window is rewritten in place in
//   rounds (append_plan.cuh) from tokens the compress launch has checked. The rows of a copy are
//   split over the `parts` blocks of a (sequence, head, half), so that a prefill chunk's window
//   (256 rows of a head, ~64 KB) is not one block's serial copy; a rewrite of more than one round
//   (a round's reads are the next round's writes) stays on part 0, ordered by its barriers. The
//   block that finishes last commits the new lengths, only if the error flag is still clean.
// * the fused form (append_compress given `groups`, an append that completes tiles inside a deferred block):
//   append_compress does append_commit's work too, each (b, head, half)'s sink and window written by the CTA
//   that completes the group's count of CTAs done reading the window, the lengths by the launch's last CTA
//   (append_compress's comment has the protocol and what a failure leaves for the restore).
//
// Error protocol: *err is OR-ed, never cleared by the kernels. A block that finds it set does no
// work (a compressing half: through compress_impl's ENTRY_CHECK, the same answer on every rank of
// its cluster; a full pool sets KVC_ERR_CAPACITY only into a clean flag), and append_commit commits
// nothing then, so a failed append changes no length and no live token: the only writes are pool
// records past n_tiles and window/sink tokens past the live lengths (plus the window rewrite, which
// runs only on a clean flag after every check). The caller reads the flag where it chooses
// (kvarn_cutlass/cache.py).
//
// Checks of each chunk token, in the cache dtype (what the window keeps): NaN/Inf (bits 6 / 8);
// tokens that will be compressed (not sink tokens) also |x| > 2^48 (bits 7 / 9, the codec's input
// limit) and, with float16 scales, |x| > 2^42 (bits 10 / 11): no tile holding such a token can be
// stored with float16 scales (codec.MAX_INPUT_ABS_F16_SCALES gives the bound's proof). The
// comparisons are on the raw bits, exact.
//
// Assumes every sequence of the batch has the same lengths (what KVarNCache keeps): then every
// (b, head) takes the same branch, and the checks of a no-tile append and its writes, which all lie
// past the live lengths, happen in one launch.

template <typename IN>
struct CacheBits;
template <>
struct CacheBits<__half> {
  static constexpr unsigned kInf = 0x7c00u;       // |bits| >= kInf: Inf or NaN
  static constexpr unsigned kAbove48 = 0x7bffu;   // no finite float16 exceeds 2^42 (max 65504)
  static constexpr unsigned kAbove42 = 0x7bffu;
};
template <>
struct CacheBits<__nv_bfloat16> {
  static constexpr unsigned kInf = 0x7f80u;
  static constexpr unsigned kAbove48 = 0x5780u;   // the bits of 2^48: |x| > 2^48 <=> |bits| > 0x5780
  static constexpr unsigned kAbove42 = 0x5480u;   // the bits of 2^42
};

// Error bits of 8 cache-dtype values (16 bytes). `compressed`: the token will be compressed.
template <typename IN, bool F16_SCALES>
__device__ __forceinline__ int check_vec(const uint4 x, const bool compressed, const bool is_v) {
  using L = CacheBits<IN>;
  const unsigned words[4] = {x.x, x.y, x.z, x.w};
  bool nonfinite = false, range = false, bound = false;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const unsigned m = (words[e >> 1] >> (16 * (e & 1))) & 0x7fffu;
    const bool finite = m < L::kInf;
    nonfinite |= !finite;
    range |= finite && m > L::kAbove48;
    bound |= finite && m > L::kAbove42;
  }
  int bits = nonfinite ? (is_v ? KVC_ERR_V_NONFINITE : KVC_ERR_K_NONFINITE) : 0;
  if (compressed && range) bits |= is_v ? KVC_ERR_V_RANGE : KVC_ERR_K_RANGE;
  if (compressed && F16_SCALES && bound) bits |= is_v ? KVC_ERR_V_BOUND : KVC_ERR_K_BOUND;
  return bits;
}

// 16-byte vector c of row r of a [rows, D] token matrix with row stride st (elements).
template <typename IN>
__device__ __forceinline__ uint4 row_vec(const IN* base, long long st, int r, int c) {
  return reinterpret_cast<const uint4*>(base + (long long)r * st)[c];
}

// True in every thread when the error flag is set (one atomic read, one barrier).
__device__ __forceinline__ bool block_sees_error(int* err) {
  return __syncthreads_or(threadIdx.x == 0 && atomicOr(err, 0) != 0) != 0;
}

// OR a thread's error bits into the flag: one atomic per warp that found any. Every lane calls it.
__device__ __forceinline__ void or_error(int* err, int bits) {
  bits = __reduce_or_sync(KVC_FULL, bits);
  if ((threadIdx.x & 31) == 0 && bits) {
    atomicOr(err, bits);
    __threadfence();  // before this block reports itself done (append_commit's counter)
  }
}

// The stream of one (b, head, half) seen as tile i: token t is stream position first + t.
template <typename IN, int D>
struct StreamTile {
  const IN* __restrict__ window;  // [window, D] of this (b, head)
  const IN* __restrict__ chunk;   // row r at chunk + r * st
  long long st;
  int first, wl, n_sink;
  __device__ __forceinline__ IN operator()(int t, int c) const {
    const int p = first + t;
    return p < wl ? window[(long long)p * D + c] : chunk[(long long)(p - wl + n_sink) * st + c];
  }
};

struct Lens {
  int n_tiles, window_len, sink_len;
};
__device__ __forceinline__ Lens read_lens(const int* lens, int batch, int b) {
  return Lens{lens[b], lens[batch + b], lens[2 * batch + b]};
}

// The window rewrite of an append that completes tiles, for one (b, head, half): window[j] = stream[s + j] for
// j < keep, s = n_new * T, in rounds of s (append_plan.cuh). One round's reads (window rows >= s, the chunk) and
// writes (rows < keep <= s) are disjoint, so its rows split over `parts` blocks (this one is `part`), and a thread
// loads KVA_COPY_BATCH vectors before it stores any (the fused form's rewrite is on the append's critical path:
// one CTA copies a group's ~64 KB, and a load-store chain per vector would be one memory round trip each); a
// rewrite of more than one round (a round's reads are the next round's writes) runs on part 0 alone, its rounds
// ordered by barriers. NT threads, every one of the block's.
#define KVA_COPY_BATCH 8
template <int T, int D, typename IN, int NT>
__device__ __forceinline__ void rewrite_window(uint4* win, const IN* chunk, long long st, const Lens& ln,
                                               const KvaPlan& pl, int parts, int part) {
  constexpr int VPR = D * (int)sizeof(IN) / 16;
  const int tid = threadIdx.x, s = pl.n_new * T, rounds = kva_rounds(pl, T);
  const auto source = [&](int q) {  // vector q of the new window: row j = q / VPR comes from stream row s + j
    const int j = q / VPR, c = q % VPR, p = s + j;
    return p < ln.window_len ? win[p * VPR + c] : row_vec(chunk, st, p - ln.window_len + pl.n_sink, c);
  };
  if (rounds == 1) {
    const int lo = (int)((long long)pl.keep * part / parts) * VPR;
    const int hi = (int)((long long)pl.keep * (part + 1) / parts) * VPR;
    for (int q0 = lo + tid; q0 < hi; q0 += NT * KVA_COPY_BATCH) {
      uint4 x[KVA_COPY_BATCH];
#pragma unroll
      for (int u = 0; u < KVA_COPY_BATCH; ++u)
        if (q0 + u * NT < hi) x[u] = source(q0 + u * NT);
#pragma unroll
      for (int u = 0; u < KVA_COPY_BATCH; ++u)
        if (q0 + u * NT < hi) win[q0 + u * NT] = x[u];
    }
  } else if (part == 0) {
    for (int round = 0; round < rounds; ++round) {
      const int hi = min((round + 1) * s, pl.keep) * VPR;
      for (int q = round * s * VPR + tid; q < hi; q += NT) win[q] = source(q);
      __syncthreads();  // this round's reads before the next round's writes
    }
  }
}

// The block that raises `counter` to the count of the launch's blocks commits the new lengths of every sequence if
// the error flag is clean, and resets the counter. Every thread of every block of the launch calls it once, last.
template <int T, int NT>
__device__ __forceinline__ void commit_lengths(int* lens, int* err, int* counter, int batch, int n, int sink_cap,
                                               int window) {
  __shared__ int last;
  const int tid = threadIdx.x;
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    last = atomicAdd(counter, 1) == (int)(gridDim.x * gridDim.y * gridDim.z) - 1;
  }
  __syncthreads();
  if (!last) return;
  __shared__ int clean;
  if (tid == 0) {
    atomicExch(counter, 0);
    clean = atomicOr(err, 0) == 0;
  }
  __syncthreads();
  if (!clean) return;
  for (int bb = tid; bb < batch; bb += NT) {
    const Lens l = read_lens(lens, batch, bb);
    const KvaPlan p = kva_plan(l.sink_len, l.window_len, n, sink_cap, window, T);
    lens[bb] = l.n_tiles + p.n_new;
    lens[batch + bb] = p.keep;
    lens[2 * batch + bb] = l.sink_len + p.n_sink;
  }
}

// groups != nullptr: the fused form (one launch per append, inside a deferred block whose restore copies the
// window back whatever the lengths say): every CTA of a (b, head, half) group (its n_new * R compressing CTAs and
// its aux_parts aux CTAs) raises the group's counter groups[2 * (b * heads + head) + half] once it has read the
// window rows it reads; the CTA whose raise completes the group resets it and, after its own work and if the error
// flag is clean then, writes the group's sink and window as append_commit would; every CTA then raises `counter`,
// and the last commits the lengths on a clean flag. A group's rewrite waits only for its own checks, so a failed
// append may have rewritten other groups' windows: the aux CTAs copy the window into the backup whatever the flag
// says, and the cache's restore copies every fused layer's window back (kvarn_cutlass/cache.py).
// What the fused form needs after a CTA's own work is recomputed there from the arguments and blockIdx (they live
// in the constant bank), so that none of it holds a register through compress_impl.
__shared__ int kva_group_last;  // this CTA's raise completed its group (fused form)

// Programmatic dependent launch (ops/append.py: an append enqueued right after the fused prefill kernel, which lets
// its dependents launch once all its CTAs run, so that the compression fills the SMs its last CTAs leave idle):
// waits until the previous kernel of the stream has completed and its writes are visible. append_compress reads
// nothing that kernel writes (its inputs were complete before that kernel started) and writes nothing it reads
// (records into slots past the lengths it was given, the backups) until the window and sink rewrite, so the
// rewriting CTAs wait first, and the grid's last CTA waits before it exits, so that the launch completes after the
// previous kernel, as a plain launch would. The last one: CTAs are dispatched in order, so a waiting CTA holds an SM
// only once every other CTA has one, where CTA (0, 0) would hold one of the few the previous kernel leaves free for
// the whole of it. Without the launch attribute a no-op.
__device__ __forceinline__ void wait_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// The CTA of append_compress that blockIdx is: its record half (compress) or aux CTA, (b, head), half.
struct AppendUnit {
  bool compress, padding, is_v;
  int rest, b, h;
  __device__ __forceinline__ AppendUnit(int batch, int heads, int max_new, int aux_parts, int R) {
    const int n_compress = batch * max_new * heads;
    is_v = blockIdx.y != 0;
    compress = (int)blockIdx.x < n_compress * R;
    const int unit = compress ? (int)blockIdx.x / R : (int)blockIdx.x - n_compress * R;
    padding = !compress && unit >= batch * heads * aux_parts;  // of the last aux cluster
    rest = unit / heads;
    h = unit % heads;
    b = padding ? 0 : compress ? rest / max_new : rest / aux_parts;
  }
};

template <int T, int D, typename IN, typename SC, int VB, bool LM, int R>
__device__ __forceinline__ void append_compress(const IN* __restrict__ k, const IN* __restrict__ v,
                                                long long k_sb, long long k_sh, long long k_st,
                                                long long v_sb, long long v_sh, long long v_st,
                                                IN* win_k, IN* win_v,
                                                u8* __restrict__ pool, const int* __restrict__ table,
                                                int* __restrict__ lens, int* __restrict__ err,
                                                IN* __restrict__ backup_k, IN* __restrict__ backup_v,
                                                int batch, int n, int sink_cap, int window, int heads, int cap,
                                                int max_new, int aux_parts, int aux_rows, int iters, Sections sec,
                                                float inv_sqrt_d, IN* __restrict__ sink_k, IN* __restrict__ sink_v,
                                                int* __restrict__ counter, int* __restrict__ groups) {
  constexpr int VPR = D * (int)sizeof(IN) / 16;  // 16-byte vectors per token row
  constexpr int NT = Shape<T, D, R>::NT;
  // (fused) this CTA is done reading the window: raise its group's counter
  const auto raise_group = [=]() {
    if (groups == nullptr) return;  // (an argument: the same branch in every thread of the launch)
    __syncthreads();
    if (threadIdx.x == 0) {
      const AppendUnit u(batch, heads, max_new, aux_parts, R);
      const Lens l = read_lens(lens, batch, u.b);
      const int expected = kva_plan(l.sink_len, l.window_len, n, sink_cap, window, T).n_new * R + aux_parts;
      __threadfence();
      kva_group_last = atomicAdd(groups + 2 * ((long long)u.b * heads + u.h) + u.is_v, 1) == expected - 1;
    }
  };
  {
    const AppendUnit u(batch, heads, max_new, aux_parts, R);
    if (groups != nullptr && threadIdx.x == 0) kva_group_last = 0;
    const Lens ln = read_lens(lens, batch, u.b);
    const KvaPlan pl = kva_plan(ln.sink_len, ln.window_len, n, sink_cap, window, T);
    const long long bh = (long long)u.b * heads + u.h;
    const IN* chunk = u.is_v ? v + u.b * v_sb + u.h * v_sh : k + u.b * k_sb + u.h * k_sh;
    const long long st = u.is_v ? v_st : k_st;
    const IN* win = (u.is_v ? win_v : win_k) + bh * window * D;
    if (u.padding) {
      // no work
    } else if (u.compress) {
      // every decision here reads only the lengths, which no CTA of this launch writes before its last CTA's
      // commit: the same on every rank of the cluster, which must enter compress_impl together or not at all
      const int i = u.rest % max_new;
      if (i < pl.n_new) {
        if (ln.n_tiles + pl.n_new > cap) {
          if (threadIdx.x == 0) atomicCAS(err, 0, KVC_ERR_CAPACITY);  // only into a clean flag (the rule above)
          raise_group();
        } else {
          const StreamTile<IN, D> tile{win, chunk, st, i * T, ln.window_len, pl.n_sink};
          const long long slot = table[(long long)u.b * cap + ln.n_tiles + i];
          const int nbytes = sec.col_scale + D * (int)sizeof(SC);
          compress_impl<T, D, IN, SC, VB, LM, R, true>(tile, u.is_v, pool + (slot * heads + u.h) * nbytes, iters,
                                                       sec, inv_sqrt_d, err, raise_group);
        }
      }
    } else if (pl.n_new > 0) {
      // aux CTA: part of (b, head)'s chunk rows; a no-tile append is checked by append_commit instead.
      // No cluster work: its cluster's other CTAs are aux CTAs too (the compress CTAs come first).
      const int part = u.rest % aux_parts;
      IN* backup = u.is_v ? backup_v : backup_k;
      const bool clean = !block_sees_error(err);
      if (part == 0 && backup != nullptr && (clean || groups != nullptr)) {
        const uint4* src = reinterpret_cast<const uint4*>(win);
        uint4* dst = reinterpret_cast<uint4*>(backup + bh * window * D);
        for (int q = threadIdx.x; q < ln.window_len * VPR; q += NT) dst[q] = src[q];
      }
      if (clean) {
        const int lo = part * aux_rows, hi = min(n, lo + aux_rows);
        int bits = 0;
        for (int q = threadIdx.x; q < (hi - lo) * VPR; q += NT) {
          const int r = lo + q / VPR;
          bits |= check_vec<IN, sizeof(SC) == 2>(row_vec(chunk, st, r, q % VPR), r >= pl.n_sink, u.is_v);
        }
        or_error(err, bits);
      }
      raise_group();
    }
  }
  if (blockIdx.x == gridDim.x - 1 && blockIdx.y == gridDim.y - 1) wait_previous_grid();
  if (groups == nullptr) return;
  __syncthreads();
  if (kva_group_last) {
    wait_previous_grid();
    const AppendUnit u(batch, heads, max_new, aux_parts, R);
    const Lens ln = read_lens(lens, batch, u.b);
    const KvaPlan pl = kva_plan(ln.sink_len, ln.window_len, n, sink_cap, window, T);
    const long long bh = (long long)u.b * heads + u.h;
    if (threadIdx.x == 0) atomicExch(groups + 2 * bh + u.is_v, 0);  // every raise of this launch is in
    if (!block_sees_error(err)) {
      const IN* chunk = u.is_v ? v + u.b * v_sb + u.h * v_sh : k + u.b * k_sb + u.h * k_sh;
      const long long st = u.is_v ? v_st : k_st;
      uint4* sink = reinterpret_cast<uint4*>((u.is_v ? sink_v : sink_k) + bh * sink_cap * D);
      for (int q = threadIdx.x; q < pl.n_sink * VPR; q += NT)
        sink[(ln.sink_len + q / VPR) * VPR + q % VPR] = row_vec(chunk, st, q / VPR, q % VPR);
      rewrite_window<T, D, IN, NT>(reinterpret_cast<uint4*>((u.is_v ? win_v : win_k) + bh * window * D), chunk, st,
                                   ln, pl, 1, 0);
    }
  }
  commit_lengths<T, NT>(lens, err, counter, batch, n, sink_cap, window);
}

#define KVA_COMMIT_THREADS 256

template <int T, int D, typename IN, bool F16_SCALES>
__device__ __forceinline__ void append_commit(const IN* __restrict__ k, const IN* __restrict__ v,
                                              long long k_sb, long long k_sh, long long k_st,
                                              long long v_sb, long long v_sh, long long v_st,
                                              IN* __restrict__ win_k, IN* __restrict__ win_v,
                                              IN* __restrict__ sink_k, IN* __restrict__ sink_v,
                                              int* __restrict__ lens, int* __restrict__ err, int* __restrict__ counter,
                                              int batch, int n, int sink_cap, int window, int heads) {
  constexpr int VPR = D * (int)sizeof(IN) / 16;
  constexpr int NT = KVA_COMMIT_THREADS;
  const int tid = threadIdx.x;
  const int b = blockIdx.x / heads, h = blockIdx.x % heads;
  const bool is_v = blockIdx.y != 0;
  const Lens ln = read_lens(lens, batch, b);
  const KvaPlan pl = kva_plan(ln.sink_len, ln.window_len, n, sink_cap, window, T);
  const long long bh = (long long)b * heads + h;
  const IN* chunk = is_v ? v + b * v_sb + h * v_sh : k + b * k_sb + h * k_sh;
  const long long st = is_v ? v_st : k_st;
  uint4* win = reinterpret_cast<uint4*>((is_v ? win_v : win_k) + bh * window * D);
  uint4* sink = reinterpret_cast<uint4*>((is_v ? sink_v : sink_k) + bh * sink_cap * D);
  const int parts = gridDim.z, part = blockIdx.z;
  // this block's share [lo, hi) of `rows` rows
  const auto share = [parts, part](int rows, int& lo, int& hi) {
    lo = (int)((long long)rows * part / parts);
    hi = (int)((long long)rows * (part + 1) / parts);
  };
  int bits = 0;
  if (!block_sees_error(err)) {
    const bool self_check = pl.n_new == 0;  // with tiles, append_compress checked every chunk token
    int lo, hi;
    share(pl.n_sink, lo, hi);
    for (int q = lo * VPR + tid; q < hi * VPR; q += NT) {
      const int r = q / VPR, c = q % VPR;
      const uint4 x = row_vec(chunk, st, r, c);
      if (self_check) bits |= check_vec<IN, F16_SCALES>(x, false, is_v);
      sink[(ln.sink_len + r) * VPR + c] = x;
    }
    if (pl.n_new == 0) {  // the window grows: tokens past the live length, checked here
      share(pl.stream_len - ln.window_len, lo, hi);
      for (int q = lo * VPR + tid; q < hi * VPR; q += NT) {
        const int r = q / VPR, c = q % VPR;
        const uint4 x = row_vec(chunk, st, pl.n_sink + r, c);
        bits |= check_vec<IN, F16_SCALES>(x, true, is_v);
        win[(ln.window_len + r) * VPR + c] = x;
      }
    } else {  // in-place rewrite from tokens the compress launch has checked
      rewrite_window<T, D, IN, NT>(win, chunk, st, ln, pl, parts, part);
    }
  }
  or_error(err, bits);
  commit_lengths<T, NT>(lens, err, counter, batch, n, sink_cap, window);
}

}  // namespace kvc

// The layer kernel: a thread-block cluster of KVC_RANKS CTAs per record half on sm_90 (the launch's
// grid is records * KVC_RANKS wide; ops/compress.py reads the width from the kernel's
// CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH), one CTA per half before.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KVC_RANKS (KVARN_T / 16)
#define KVC_CLUSTER_DIMS __cluster_dims__(KVC_RANKS, 1, 1)
#else
#define KVC_RANKS 1
#define KVC_CLUSTER_DIMS
#endif
// its CTA size (ops/compress.py reads it from the kernel's CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)
#define KVC_LAYER_NT (kvc::Shape<KVARN_T, KVARN_D, KVC_RANKS>::NT)
// Dynamic shared memory per CTA of each launch form, which the host reads from the CUBIN (one source
// for Shape's layout): the cluster forms as compiled (a cluster CTA on sm_90, one CTA before: the layer
// kernel and the append's kvarn_append_compress_cluster_...), and one CTA of KVC_NT threads
// (kvarn_compress_cta_... and the append's kvarn_append_compress_...).
extern "C" __device__ const int kvarn_compress_smem_bytes = kvc::Shape<KVARN_T, KVARN_D, KVC_RANKS>::kSmemBytes;
extern "C" __device__ const int kvarn_compress_cta_smem_bytes = kvc::Shape<KVARN_T, KVARN_D, 1>::kSmemBytes;
#define KVC_LAYER_KERNEL(NAME, ATTRS, RANKS, T, D, IN, SC, VB, LM)                                                  \
  extern "C" __global__ void ATTRS NAME(                                                                            \
      const IN* __restrict__ k, const IN* __restrict__ v, long long k_sb, long long k_sh, long long k_st,          \
      long long v_sb, long long v_sh, long long v_st, u8* __restrict__ out, long long o_sb, long long o_si,        \
      long long o_sh, int n_heads, int n_tiles, int iters, int off_k_codes, int off_chan_step, int off_chan_min,   \
      int off_row_scale, int off_v_codes, int off_tok_step, int off_tok_min, int off_col_scale, float inv_sqrt_d,  \
      int* __restrict__ err) {                                                                                      \
    kvc::Sections sec{off_k_codes, off_chan_step, off_chan_min, off_row_scale,                                     \
                      off_v_codes, off_tok_step,  off_tok_min,  off_col_scale};                                    \
    kvc::compress_layer_block<T, D, IN, SC, VB, LM, RANKS>(k, v, k_sb, k_sh, k_st, v_sb, v_sh, v_st, out, o_sb, o_si, \
                                                           o_sh, n_heads, n_tiles, iters, sec, inv_sqrt_d, err);  \
  }
// The layer kernel (a cluster per record half where there are clusters) and its one-CTA form
// (kvarn_compress_cta_...: more records per SM when a launch has more halves than the GPU has room
// for clusters; ops/compress.py picks).
#define KVC_KERNEL(T, D, IN, INNAME, SC, SCNAME, VB, LM, SUFFIX)                                                   \
  KVC_LAYER_KERNEL(kvarn_compress_t##T##_d##D##_##INNAME##_##SCNAME##_v##VB##SUFFIX,                               \
                   __launch_bounds__(KVC_LAYER_NT, 1) KVC_CLUSTER_DIMS, KVC_RANKS, T, D, IN, SC, VB, LM)           \
  KVC_LAYER_KERNEL(kvarn_compress_cta_t##T##_d##D##_##INNAME##_##SCNAME##_v##VB##SUFFIX,                           \
                   __launch_bounds__(KVC_NT, 1), 1, T, D, IN, SC, VB, LM)

// append_compress of a record half on RANKS CTAs (the append section above), as kernel NAME.
#define KVC_APPEND_COMPRESS(NAME, ATTRS, RANKS, T, D, IN, SC, VB, LM)                                               \
  extern "C" __global__ void ATTRS NAME(                                                                            \
      const IN* __restrict__ k, const IN* __restrict__ v, long long k_sb, long long k_sh, long long k_st,          \
      long long v_sb, long long v_sh, long long v_st, IN* win_k, IN* win_v, u8* __restrict__ pool,                 \
      const int* __restrict__ table, int* __restrict__ lens, int* __restrict__ err, IN* __restrict__ backup_k,      \
      IN* __restrict__ backup_v, int batch, int n, int sink_cap, int window, int heads, int cap, int max_new,       \
      int aux_parts, int aux_rows, int iters, int off_k_codes, int off_chan_step, int off_chan_min,                 \
      int off_row_scale, int off_v_codes, int off_tok_step, int off_tok_min, int off_col_scale, float inv_sqrt_d,   \
      IN* __restrict__ sink_k, IN* __restrict__ sink_v, int* __restrict__ counter, int* __restrict__ groups) {      \
    kvc::Sections sec{off_k_codes, off_chan_step, off_chan_min, off_row_scale,                                     \
                      off_v_codes, off_tok_step,  off_tok_min,  off_col_scale};                                    \
    kvc::append_compress<T, D, IN, SC, VB, LM, RANKS>(k, v, k_sb, k_sh, k_st, v_sb, v_sh, v_st, win_k, win_v, pool, \
                                                      table, lens, err, backup_k, backup_v, batch, n, sink_cap,    \
                                                      window, heads, cap, max_new, aux_parts, aux_rows, iters, sec, \
                                                      inv_sqrt_d, sink_k, sink_v, counter, groups);                \
  }
// The cache's append kernels (cache dtypes float16 / bfloat16 only; see the append section above):
// append_compress on one CTA per record half, append_compress_cluster on a cluster where there are
// clusters (ops/append.py picks per launch, as ops/compress.py does for the layer kernel).
#define KVC_APPEND_KERNELS(T, D, IN, INNAME, SC, SCNAME, VB, LM, SUFFIX)                                           \
  KVC_APPEND_COMPRESS(kvarn_append_compress_t##T##_d##D##_##INNAME##_##SCNAME##_v##VB##SUFFIX,                     \
                      __launch_bounds__(KVC_NT, 1), 1, T, D, IN, SC, VB, LM)                                       \
  KVC_APPEND_COMPRESS(kvarn_append_compress_cluster_t##T##_d##D##_##INNAME##_##SCNAME##_v##VB##SUFFIX,             \
                      __launch_bounds__(KVC_LAYER_NT, 1) KVC_CLUSTER_DIMS, KVC_RANKS, T, D, IN, SC, VB, LM)        \
  extern "C" __global__ void __launch_bounds__(KVA_COMMIT_THREADS)                                                 \
      kvarn_append_commit_t##T##_d##D##_##INNAME##_##SCNAME##_v##VB##SUFFIX(                                       \
      const IN* __restrict__ k, const IN* __restrict__ v, long long k_sb, long long k_sh, long long k_st,          \
      long long v_sb, long long v_sh, long long v_st, IN* __restrict__ win_k, IN* __restrict__ win_v,              \
      IN* __restrict__ sink_k, IN* __restrict__ sink_v, int* __restrict__ lens, int* __restrict__ err,             \
      int* __restrict__ counter, int batch, int n, int sink_cap, int window, int heads) {                          \
    kvc::append_commit<T, D, IN, sizeof(SC) == 2>(k, v, k_sb, k_sh, k_st, v_sb, v_sh, v_st, win_k, win_v, sink_k,  \
                                                  sink_v, lens, err, counter, batch, n, sink_cap, window, heads);  \
  }                                                                                                                 \
  /* lens -> saved, unless the error flag is set (a step graph's record of the last clean state) */                \
  extern "C" __global__ void kvarn_append_snapshot_t##T##_d##D##_##INNAME##_##SCNAME##_v##VB##SUFFIX(              \
      const int* __restrict__ lens, int* __restrict__ saved, int* __restrict__ err, int count) {                   \
    if (kvc::block_sees_error(err)) return;                                                                         \
    for (int i = threadIdx.x; i < count; i += blockDim.x) saved[i] = lens[i];                                      \
  }


#define KVC_KERNEL_X(...) KVC_KERNEL(__VA_ARGS__)  // expands the defines before token pasting
#if KVARN_SC == 16
#define KVC_SC __half, s16
#elif KVARN_SC == 32
#define KVC_SC float, s32
#else
#error "KVARN_SC must be 16 or 32"
#endif
#if KVARN_IN == 0
#define KVC_IN __half, f16
#elif KVARN_IN == 1
#define KVC_IN __nv_bfloat16, bf16
#elif KVARN_IN == 2
#define KVC_IN float, f32
#else
#error "KVARN_IN must be 0 (f16), 1 (bf16) or 2 (f32)"
#endif
#if KVARN_QUANT == 0
#define KVC_QUANT false,
#elif KVARN_QUANT == 1
#define KVC_QUANT true, _lm
#else
#error "KVARN_QUANT must be 0 (uniform) or 1 (lloyd_max)"
#endif
KVC_KERNEL_X(KVARN_T, KVARN_D, KVC_IN, KVC_SC, KVARN_VB, KVC_QUANT)
#if KVARN_IN != 2
#define KVC_APPEND_KERNELS_X(...) KVC_APPEND_KERNELS(__VA_ARGS__)
KVC_APPEND_KERNELS_X(KVARN_T, KVARN_D, KVC_IN, KVC_SC, KVARN_VB, KVC_QUANT)
#endif
