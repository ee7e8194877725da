// KVarN tile compression on the GPU, byte-identical to the CPU codec (kvarn_cutlass/codec.py).
//
// One block per (record, half): blockIdx.x is the record (b, tile, head), blockIdx.y is 0 for the
// K half of the record (k_codes, chan_step, chan_min, row_scale) and 1 for the V half (v_codes,
// tok_step, tok_min, col_scale). Both halves run the whole pipeline on their own input: WHT along
// head_dim, Sinkhorn-like variance normalization (lowest-imbalance candidate), power-of-two
// balance, stored scales, codes, packing. The codes come from the quantizer compiled in
// (KVARN_QUANT): 0 = uniform (asymmetric round-to-nearest-even: *_min = axis minimum, *_step =
// range / (2^bits - 1)), 1 = lloyd_max (*_min = axis mean, a halving-tree sum / n; *_step = RMS about
// the stored mean, sqrt of a halving-tree sum of squares / n; code = number of decision thresholds
// t_j < (u - min) / step, ties to the lower code; the thresholds arrive as the defines
// KVARN_LM_THR4 / KVARN_LM_THR2 from format.lloyd_max_thresholds). The uniform build has no
// lloyd_max code in it.
//
// Exactness rules (the codec is the spec): float32 only; every +, -, *, /, sqrt is a correctly
// rounded intrinsic (__fadd_rn, __fsub_rn, __fmul_rn, __fdiv_rn, __fsqrt_rn), so no FMA
// contraction can happen (the module is also compiled with --fmad=false); no fast math, no
// flush-to-zero. Sums are halving trees: x[i] + x[i + n/2], repeated.
//
// Thread layout (NT = 512 threads, W = 16 warps): thread (warp w, lane l) owns the elements
//   t = w + W*k (k < NK = T/W),   c = l + 32*j (j < NJ = D/32).
// * a row sum (over c) is the in-thread halving tree over j (pairs j, j + NJ/2 <=> c, c + D/2),
//   then __shfl_xor 16, 8, 4, 2, 1 (lane l pairs with l^16 = l + 16 for l < 16; the upper lanes
//   compute the same sums with the operands swapped, and IEEE addition is commutative);
// * a column sum (over t) is the in-thread halving tree over k (pairs k, k + NK/2 <=> t, t + T/2),
//   then the halving tree over the W per-warp partials (t = w) through shared memory;
// * the WHT butterfly at stride h < 32 is a __shfl_xor by h, at stride 32*b an in-thread pair of j.
//
// The rotated tile y lives in shared memory as float32 in a thread-private order (element i of
// thread tid at [i * NT + tid], conflict-free); y / s is cached in registers when NK*NJ <= 32.
//
// Error flag (int32, OR-ed, checked by the host; see kvarn_cutlass/ops/compress.py):
//   bit 0 K row_scale, 1 K chan step, 2 K chan min, 3 V col_scale, 4 V tok step, 5 V tok min
//   (a stored value is not finite: the codec's _store raises), bit 6 k non-finite input,
//   7 k input magnitude > 2^48, 8 v non-finite, 9 v magnitude > 2^48 (check_tile_input raises).
//   A block whose input is rejected writes nothing. lloyd_max stores the mean before the RMS (the
//   codec raises on the min first), so the host reads its min bits before its step bits.
//
// Kernel names: kvarn_compress_t{T}_d{D}_{in}_{scale}_v{VB}, in = f16|bf16|f32, scale = s16|s32,
// with the suffix _lm for lloyd_max. The modules of the cache dtypes (in = f16|bf16) also hold the
// cache's append kernels, kvarn_append_{compress,commit,snapshot}_... (the append section below):
// the same compress_impl, fed from the cache's window and the appended chunk.
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

#define KVC_NT 512
#define KVC_W 16
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
__device__ __forceinline__ float warp_nanmax(float v) {
#pragma unroll
  for (int h = 16; h >= 1; h /= 2) v = nanmax(v, __shfl_xor_sync(KVC_FULL, v, h));
  return v;
}
__device__ __forceinline__ float warp_nanmin(float v) {
#pragma unroll
  for (int h = 16; h >= 1; h /= 2) v = nanmin(v, __shfl_xor_sync(KVC_FULL, v, h));
  return v;
}

// codec._rms of one finished sum: sqrt(sum / n), values under 2^-100 count as 1 (NaN stays NaN).
__device__ __forceinline__ float rms_of(float sum, float n) {
  const float r = __fsqrt_rn(__fdiv_rn(sum, n));
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

struct Sections {
  int k_codes, chan_step, chan_min, row_scale, v_codes, tok_step, tok_min, col_scale;
};

template <int T, int D>
struct Shape {
  static constexpr int NK = T / KVC_W;
  static constexpr int NJ = D / 32;
  static constexpr int N = NK * NJ;
  static constexpr bool kCacheYs = N <= 32;
  // dynamic shared memory: the tile (float32, later the code bytes), the per-warp column partials
  // (W x D), the column RMS / per-channel step and min (3 x D), reduction scratch (4 x W + 4 x D/32).
  static constexpr int kSmemFloats = T * D + KVC_W * D + 3 * D + 4 * KVC_W + 4 * (D / 32);
  static constexpr int kSmemBytes = kSmemFloats * 4;
  // K code bytes are staged channel-major with a T + 4 byte pitch (bank-conflict-free stores).
  static constexpr int kKPitch = T + 4;
};

// The tile of compress_tiles / compress_layer: token t of the half at src[t * st].
template <typename IN>
struct StridedTile {
  const IN* __restrict__ src;
  long long st;
  __device__ __forceinline__ IN operator()(int t, int c) const { return src[(long long)t * st + c]; }
};

// One record half: the tile `tile(t, c)` (t < T, c < D, values of type IN) is compressed into the
// record at dst (K half if !is_v, else V half). The arithmetic does not depend on where the tile
// comes from: every source gives the same bytes for the same values.
template <int T, int D, typename IN, typename SC, int VB, bool LM, typename Tile>
__device__ __forceinline__ void compress_impl(const Tile& tile, const bool is_v, u8* __restrict__ dst, int iters,
                                              Sections sec, float inv_sqrt_d, int* __restrict__ err) {
  using S = Shape<T, D>;
  constexpr int NK = S::NK, NJ = S::NJ, N = S::N, NT = KVC_NT, W = KVC_W;
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  float* ysm = smem;                        // [N][NT]   the rotated tile; later code bytes / min-max partials
  float* part = ysm + T * D;                // [W][D]    column partial sums
  float* colrms = part + W * D;             // [D]
  float* cstep = colrms + D;                // [D]       stored K chan step (K) ...
  float* cmin = cstep + D;                  // [D]       ... and chan min
  float* red = cmin + D;                    // [4][W] + [4][D/32] reduction scratch
  u8* codes = reinterpret_cast<u8*>(ysm);

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;

  // ---- load, check, WHT ------------------------------------------------------------------------
  float y[N];
  bool nonfinite = false, toolarge = false;
#pragma unroll
  for (int k = 0; k < NK; ++k) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const float x = to_f32(tile(w + W * k, lane + 32 * j));
      nonfinite |= !is_finite(x);
      toolarge |= fabsf(x) > 0x1p48f;
      y[k * NJ + j] = x;
    }
  }
  const bool any_nonfinite = __syncthreads_or(nonfinite);
  const bool any_toolarge = __syncthreads_or(toolarge);
  if (any_nonfinite || any_toolarge) {
    if (tid == 0) {
      int bits = 0;
      if (any_nonfinite) bits |= is_v ? KVC_ERR_V_NONFINITE : KVC_ERR_K_NONFINITE;
      if (any_toolarge) bits |= is_v ? KVC_ERR_V_RANGE : KVC_ERR_K_RANGE;
      atomicOr(err, bits);
    }
    return;
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
#pragma unroll
  for (int i = 0; i < N; ++i) ysm[i * NT + tid] = __fmul_rn(y[i], inv_sqrt_d);
  // y[] is dead from here; the tile is read back from shared memory (private slots, no sync needed).

  // ---- variance normalization --------------------------------------------------------------------
  float r[NK], s[NJ], br[NK], bs[NJ];
#pragma unroll
  for (int k = 0; k < NK; ++k) r[k] = br[k] = 1.0f;
#pragma unroll
  for (int j = 0; j < NJ; ++j) s[j] = bs[j] = 1.0f;
  float best = __uint_as_float(0x7f800000u);
  float ys[S::kCacheYs ? N : 1];
  float zz[N];

  for (int it = 0;; ++it) {
    // candidate z = (y / s) / r, squared
#pragma unroll
    for (int k = 0; k < NK; ++k) {
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int i = k * NJ + j;
        float z;
        if (it == 0) {
          z = ysm[i * NT + tid];  // s = r = 1: (y / 1) / 1 == y exactly
        } else if constexpr (S::kCacheYs) {
          z = __fdiv_rn(ys[i], r[k]);
        } else {
          z = __fdiv_rn(__fdiv_rn(ysm[i * NT + tid], s[j]), r[k]);
        }
        zz[i] = __fmul_rn(z, z);
      }
    }
    // row RMS (over channels) for this thread's rows, and their max/min
    float rmax = 0.0f, rmin = 0.0f;
#pragma unroll
    for (int k = 0; k < NK; ++k) {
      float t[NJ];
#pragma unroll
      for (int j = 0; j < NJ; ++j) t[j] = zz[k * NJ + j];
      tree<NJ>(t);
      const float rr = rms_of(warp_tree(t[0]), (float)D);
      rmax = k == 0 ? rr : nanmax(rmax, rr);
      rmin = k == 0 ? rr : nanmin(rmin, rr);
    }
    // column partials over this thread's tokens
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      float t[NK];
#pragma unroll
      for (int k = 0; k < NK; ++k) t[k] = zz[k * NJ + j];
      tree<NK>(t);
      part[w * D + lane + 32 * j] = t[0];
    }
    if (lane == 0) {
      red[w] = rmax;
      red[W + w] = rmin;
    }
    __syncthreads();
    if (tid < D) {
      float p[W];
#pragma unroll
      for (int q = 0; q < W; ++q) p[q] = part[q * D + tid];
      tree<W>(p);
      const float cr = rms_of(p[0], (float)T);
      colrms[tid] = cr;
      const float mx = warp_nanmax(cr), mn = warp_nanmin(cr);
      if (lane == 0) {
        red[2 * W + w] = mx;
        red[2 * W + D / 32 + w] = mn;
      }
    }
    __syncthreads();
    float crmax = red[2 * W], crmin = red[2 * W + D / 32];
#pragma unroll
    for (int q = 1; q < D / 32; ++q) {
      crmax = nanmax(crmax, red[2 * W + q]);
      crmin = nanmin(crmin, red[2 * W + D / 32 + q]);
    }
    float rrmax = red[0], rrmin = red[W];
#pragma unroll
    for (int q = 1; q < W; ++q) {
      rrmax = nanmax(rrmax, red[q]);
      rrmin = nanmin(rrmin, red[W + q]);
    }
    const float score = __fadd_rn(__fdiv_rn(crmax, crmin), __fdiv_rn(rrmax, rrmin));
    if (score < best) {  // uniform across the block
      best = score;
#pragma unroll
      for (int k = 0; k < NK; ++k) br[k] = r[k];
#pragma unroll
      for (int j = 0; j < NJ; ++j) bs[j] = s[j];
    }
    __syncthreads();  // every thread has read red[]: the next writes of part/red/colrms may start
    if (it >= iters) break;
    // s *= col_rms(z); then r *= row_rms((y / s) / r) with the new s
#pragma unroll
    for (int j = 0; j < NJ; ++j) s[j] = __fmul_rn(s[j], colrms[lane + 32 * j]);
#pragma unroll
    for (int k = 0; k < NK; ++k) {
      float t[NJ];
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int i = k * NJ + j;
        const float q = __fdiv_rn(ysm[i * NT + tid], s[j]);
        if constexpr (S::kCacheYs) ys[i] = q;
        const float z = __fdiv_rn(q, r[k]);
        t[j] = __fmul_rn(z, z);
      }
      tree<NJ>(t);
      r[k] = __fmul_rn(r[k], rms_of(warp_tree(t[0]), (float)D));
    }
  }

  // ---- power-of-two balance ----------------------------------------------------------------------
  float mr = br[0];
#pragma unroll
  for (int k = 1; k < NK; ++k) mr = nanmax(mr, br[k]);
  float ms = bs[0];
#pragma unroll
  for (int j = 1; j < NJ; ++j) ms = nanmax(ms, bs[j]);
  ms = warp_nanmax(ms);
  if (lane == 0) red[w] = mr;
  __syncthreads();
  mr = red[0];
#pragma unroll
  for (int q = 1; q < W; ++q) mr = nanmax(mr, red[q]);
  const int diff = frexp_exponent(mr) - frexp_exponent(ms);
  const int shift = diff >= 0 ? diff / 2 : -((1 - diff) / 2);  // floor(diff / 2)

  constexpr float kSmallest = Store<SC>::kSmallest;
  unsigned short bits;
  int errbits = 0;

  if (!is_v) {
    // ---- K: row_scale = r, u = y / row_scale, per-channel codes over tokens, channel-major -------
    float rs[NK];
    const float p2 = pow2f(-shift);
#pragma unroll
    for (int k = 0; k < NK; ++k) {
      float x = __fmul_rn(br[k], p2);
      x = x < kSmallest ? kSmallest : x;  // clamp_min (NaN stays NaN)
      rs[k] = Store<SC>::round(x, bits);
      if (!is_finite(rs[k])) errbits |= KVC_ERR_K_ROW_SCALE;
      if (lane == k) Store<SC>::put(dst + sec.row_scale, w + W * k, rs[k], bits);
    }
    float* u = zz;
    float lo[NJ], hi[NJ];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
#pragma unroll
      for (int k = 0; k < NK; ++k) {
        const int i = k * NJ + j;
        u[i] = __fadd_rn(__fdiv_rn(ysm[i * NT + tid], rs[k]), 0.0f);  // canonical +0 (codec: u + 0.0)
        if constexpr (!LM) {
          lo[j] = k == 0 ? u[i] : nanmin(lo[j], u[i]);
          hi[j] = k == 0 ? u[i] : nanmax(hi[j], u[i]);
        }
      }
    }
    constexpr int P = S::kKPitch;
    if constexpr (!LM) {
      __syncthreads();  // every thread is done with ysm: reuse it for the min/max partials
      float* pmin = ysm;
      float* pmax = ysm + W * D;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        pmin[w * D + lane + 32 * j] = lo[j];
        pmax[w * D + lane + 32 * j] = hi[j];
      }
      __syncthreads();
      if (tid < D) {
        float l = pmin[tid], hh = pmax[tid];
#pragma unroll
        for (int q = 1; q < W; ++q) {
          l = nanmin(l, pmin[q * D + tid]);
          hh = nanmax(hh, pmax[q * D + tid]);
        }
        const float step = Store<SC>::round(__fdiv_rn(__fsub_rn(hh, l), 15.0f), bits);
        if (!is_finite(step)) errbits |= KVC_ERR_K_CHAN_STEP;
        Store<SC>::put(dst + sec.chan_step, tid, step, bits);
        const float low = Store<SC>::round(l, bits);
        if (!is_finite(low)) errbits |= KVC_ERR_K_CHAN_MIN;
        Store<SC>::put(dst + sec.chan_min, tid, low, bits);
        cstep[tid] = step;
        cmin[tid] = low;
      }
      __syncthreads();  // partials consumed; ysm now holds code bytes
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int c = lane + 32 * j;
        const float step = cstep[c], low = cmin[c];
        const bool pos = step > 0.0f;
        const float safe = pos ? step : 1.0f;
#pragma unroll
        for (int k = 0; k < NK; ++k) {
          float q = rintf(__fdiv_rn(__fsub_rn(u[k * NJ + j], low), safe));
          q = q < 0.0f ? 0.0f : (q > 15.0f ? 15.0f : q);
          codes[c * P + w + W * k] = pos ? (u8)(int)q : (u8)0;
        }
      }
    } else {
      // lloyd_max. A channel's sum over t = w + W*k is the codec's halving tree: in-thread over k
      // (pairs t, t + T/2), then over the W per-warp partials (t = w) in part[].
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        float t[NK];
#pragma unroll
        for (int k = 0; k < NK; ++k) t[k] = u[k * NJ + j];
        tree<NK>(t);
        part[w * D + lane + 32 * j] = t[0];
      }
      __syncthreads();
      if (tid < D) {
        float p[W];
#pragma unroll
        for (int q = 0; q < W; ++q) p[q] = part[q * D + tid];
        tree<W>(p);
        const float mean = Store<SC>::round(__fdiv_rn(p[0], (float)T), bits);
        if (!is_finite(mean)) errbits |= KVC_ERR_K_CHAN_MIN;
        Store<SC>::put(dst + sec.chan_min, tid, mean, bits);
        cmin[tid] = mean;
      }
      __syncthreads();  // stored means visible, partials consumed
      // u -= stored mean (in place: the codes need it again), then the sum of squares the same way
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const float mean = cmin[lane + 32 * j];
        float t[NK];
#pragma unroll
        for (int k = 0; k < NK; ++k) {
          const int i = k * NJ + j;
          u[i] = __fsub_rn(u[i], mean);
          t[k] = __fmul_rn(u[i], u[i]);
        }
        tree<NK>(t);
        part[w * D + lane + 32 * j] = t[0];
      }
      __syncthreads();
      if (tid < D) {
        float p[W];
#pragma unroll
        for (int q = 0; q < W; ++q) p[q] = part[q * D + tid];
        tree<W>(p);
        const float rms = Store<SC>::round(__fsqrt_rn(__fdiv_rn(p[0], (float)T)), bits);
        if (!is_finite(rms)) errbits |= KVC_ERR_K_CHAN_STEP;
        Store<SC>::put(dst + sec.chan_step, tid, rms, bits);
        cstep[tid] = rms;
      }
      __syncthreads();  // stored RMS visible; ysm (read for u before the first barrier) now holds code bytes
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int c = lane + 32 * j;
        const float step = cstep[c];
        const bool pos = step > 0.0f;
#pragma unroll
        for (int k = 0; k < NK; ++k)
          codes[c * P + w + W * k] = pos ? (u8)lloyd_max_code<4>(__fdiv_rn(u[k * NJ + j], step)) : (u8)0;
      }
    }
    __syncthreads();
    // pack: 16 output bytes (32 tokens of one channel) per work item, 4-byte smem reads
    constexpr int kChunks = D * T / 32;
    for (int q = tid; q < kChunks; q += NT) {
      const int c = q / (T / 32), t0 = (q % (T / 32)) * 32;
      const unsigned* cw = reinterpret_cast<const unsigned*>(codes + c * P + t0);
      unsigned o[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const unsigned a = cw[2 * m], bb = cw[2 * m + 1];
        // bytes a = tokens 0..3, bb = tokens 4..7 -> out bytes (t0|t1<<4), (t2|t3<<4), ...
        unsigned v = 0;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          v |= (((a >> (16 * e)) & 0xfu) | (((a >> (16 * e + 8)) & 0xfu) << 4)) << (8 * e);
          v |= (((bb >> (16 * e)) & 0xfu) | (((bb >> (16 * e + 8)) & 0xfu) << 4)) << (8 * (e + 2));
        }
        o[m] = v;
      }
      reinterpret_cast<uint4*>(dst + sec.k_codes)[q] = make_uint4(o[0], o[1], o[2], o[3]);
    }
  } else {
    // ---- V: col_scale = s, w = y / col_scale, per-token codes over channels, token-major ---------
    float cs[NJ];
    const float p2 = pow2f(shift);
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      float x = __fmul_rn(bs[j], p2);
      x = x < kSmallest ? kSmallest : x;
      cs[j] = Store<SC>::round(x, bits);
      if (!is_finite(cs[j])) errbits |= KVC_ERR_V_COL_SCALE;
      if (w == 0) Store<SC>::put(dst + sec.col_scale, lane + 32 * j, cs[j], bits);
    }
    float* u = zz;
    float tstep[NK];
    if constexpr (!LM) {
      constexpr int QMAX = (1 << VB) - 1;
      float tlow[NK];
#pragma unroll
      for (int k = 0; k < NK; ++k) {
        float l = 0.0f, hh = 0.0f;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const int i = k * NJ + j;
          u[i] = __fadd_rn(__fdiv_rn(ysm[i * NT + tid], cs[j]), 0.0f);  // canonical +0 (codec: u + 0.0)
          l = j == 0 ? u[i] : nanmin(l, u[i]);
          hh = j == 0 ? u[i] : nanmax(hh, u[i]);
        }
        l = warp_nanmin(l);
        hh = warp_nanmax(hh);
        tstep[k] = Store<SC>::round(__fdiv_rn(__fsub_rn(hh, l), (float)QMAX), bits);
        if (!is_finite(tstep[k])) errbits |= KVC_ERR_V_TOK_STEP;
        if (lane == k) Store<SC>::put(dst + sec.tok_step, w + W * k, tstep[k], bits);
        tlow[k] = Store<SC>::round(l, bits);
        if (!is_finite(tlow[k])) errbits |= KVC_ERR_V_TOK_MIN;
        if (lane == k) Store<SC>::put(dst + sec.tok_min, w + W * k, tlow[k], bits);
      }
      __syncthreads();  // ysm now holds code bytes [T][D]
#pragma unroll
      for (int k = 0; k < NK; ++k) {
        const bool pos = tstep[k] > 0.0f;
        const float safe = pos ? tstep[k] : 1.0f;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          float q = rintf(__fdiv_rn(__fsub_rn(u[k * NJ + j], tlow[k]), safe));
          q = q < 0.0f ? 0.0f : (q > (float)QMAX ? (float)QMAX : q);
          codes[(w + W * k) * D + lane + 32 * j] = pos ? (u8)(int)q : (u8)0;
        }
      }
    } else {
      // lloyd_max. A token's sum over c = l + 32*j is the codec's halving tree: in-thread over j
      // (pairs c, c + D/2), then warp_tree over the lanes; every lane holds the result.
#pragma unroll
      for (int k = 0; k < NK; ++k) {
        float t[NJ];
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const int i = k * NJ + j;
          u[i] = __fadd_rn(__fdiv_rn(ysm[i * NT + tid], cs[j]), 0.0f);  // canonical +0 (codec: u + 0.0)
          t[j] = u[i];
        }
        tree<NJ>(t);
        const float mean = Store<SC>::round(__fdiv_rn(warp_tree(t[0]), (float)D), bits);
        if (!is_finite(mean)) errbits |= KVC_ERR_V_TOK_MIN;
        if (lane == k) Store<SC>::put(dst + sec.tok_min, w + W * k, mean, bits);
        // u -= stored mean (in place: the codes need it again), then the sum of squares the same way
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const int i = k * NJ + j;
          u[i] = __fsub_rn(u[i], mean);
          t[j] = __fmul_rn(u[i], u[i]);
        }
        tree<NJ>(t);
        tstep[k] = Store<SC>::round(__fsqrt_rn(__fdiv_rn(warp_tree(t[0]), (float)D)), bits);
        if (!is_finite(tstep[k])) errbits |= KVC_ERR_V_TOK_STEP;
        if (lane == k) Store<SC>::put(dst + sec.tok_step, w + W * k, tstep[k], bits);
      }
      __syncthreads();  // ysm now holds code bytes [T][D]
#pragma unroll
      for (int k = 0; k < NK; ++k) {
        const bool pos = tstep[k] > 0.0f;
#pragma unroll
        for (int j = 0; j < NJ; ++j)
          codes[(w + W * k) * D + lane + 32 * j] = pos ? (u8)lloyd_max_code<VB>(__fdiv_rn(u[k * NJ + j], tstep[k])) : (u8)0;
      }
    }
    __syncthreads();
    // pack: 16 output bytes (16 * 8 / VB channels of one token) per work item
    constexpr int kPer = 8 / VB;                 // codes per byte
    constexpr int kChunks = T * D * VB / 128;    // 16-byte output chunks
    for (int q = tid; q < kChunks; q += NT) {
      const unsigned* cw = reinterpret_cast<const unsigned*>(codes + q * 16 * kPer);  // token-major, contiguous
      unsigned o[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        unsigned v = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // output byte 4m+e from codes [(4m+e)*kPer, +kPer)
          unsigned byte = 0;
#pragma unroll
          for (int g = 0; g < kPer; ++g) {
            const int ci = (4 * m + e) * kPer + g;
            const unsigned code = (cw[ci >> 2] >> (8 * (ci & 3))) & 0xffu;
            byte |= code << (VB * g);
          }
          v |= byte << (8 * e);
        }
        o[m] = v;
      }
      reinterpret_cast<uint4*>(dst + sec.v_codes)[q] = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
  if (errbits) atomicOr(err, errbits);
}


// The layer kernel's block: record (b, tile, head) = blockIdx.x, half = blockIdx.y, from strided input.
template <int T, int D, typename IN, typename SC, int VB, bool LM>
__device__ __forceinline__ void compress_layer_block(const IN* __restrict__ k_in, const IN* __restrict__ v_in,
                                                     long long k_sb, long long k_sh, long long k_st,
                                                     long long v_sb, long long v_sh, long long v_st,
                                                     u8* __restrict__ out, long long o_sb, long long o_si, long long o_sh,
                                                     int n_heads, int n_tiles, int iters, Sections sec,
                                                     float inv_sqrt_d, int* __restrict__ err) {
  const bool is_v = blockIdx.y != 0;
  const long long rec = blockIdx.x;
  const int h = (int)(rec % n_heads);
  const long long bt = rec / n_heads;
  const int tile = (int)(bt % n_tiles);
  const long long b = bt / n_tiles;
  const StridedTile<IN> src{is_v ? v_in + b * v_sb + h * v_sh + (long long)tile * T * v_st
                                 : k_in + b * k_sb + h * k_sh + (long long)tile * T * k_st,
                            is_v ? v_st : k_st};
  u8* dst = out + b * o_sb + (long long)tile * o_si + h * o_sh;
  compress_impl<T, D, IN, SC, VB, LM>(src, is_v, dst, iters, sec, inv_sqrt_d, err);
}

// ==== the cache's append (kvarn_cutlass/ops/append.py) ============================================
//
// Two kernels per append of n tokens to one layer, both reading the layer's lengths from the device
// (int32 lens[3][batch]: n_tiles, window_len, sink_len of each sequence), so that one launch serves
// any length (CUDA graphs):
//
// * append_compress (only needed when a tile completes): blocks [0, batch * max_new * heads) x 2
//   halves compress tile i < n_new of (b, head) from the stream window[0, wl) ++ chunk[n_sink, n)
//   straight into pool slot tile_table[b][n_tiles + i] (no staging copy); then batch * heads *
//   aux_parts "aux" blocks x 2 check every chunk token (below) and, given a backup buffer, copy the
//   window as it is into it (what a failed deferred block restores). Nothing visible changes.
// * append_commit, grid (batch * heads, 2 halves), 256 threads: writes the sink and window. With no
//   tile completing the window only grows: chunk tokens go to window[wl, ...) beyond the live
//   length, so the block checks them as it writes. With tiles, the window is rewritten in place in
//   rounds (append_plan.cuh) from tokens the compress launch has checked. The block that finishes
//   last commits the new lengths, only if the error flag is still clean.
//
// Error protocol: *err is OR-ed, never cleared by the kernels. A block that finds it set does no
// work, and append_commit commits nothing then, so a failed append changes no length and no live
// token: the only writes are pool records past n_tiles and window/sink tokens past the live lengths
// (plus the window rewrite, which runs only on a clean flag after every check). The caller reads
// the flag where it chooses (kvarn_cutlass/cache.py).
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

template <int T, int D, typename IN, typename SC, int VB, bool LM>
__device__ __forceinline__ void append_compress(const IN* __restrict__ k, const IN* __restrict__ v,
                                                long long k_sb, long long k_sh, long long k_st,
                                                long long v_sb, long long v_sh, long long v_st,
                                                const IN* __restrict__ win_k, const IN* __restrict__ win_v,
                                                u8* __restrict__ pool, const int* __restrict__ table,
                                                const int* __restrict__ lens, int* __restrict__ err,
                                                IN* __restrict__ backup_k, IN* __restrict__ backup_v,
                                                int batch, int n, int sink_cap, int window, int heads, int cap,
                                                int max_new, int aux_parts, int aux_rows, int iters, Sections sec,
                                                float inv_sqrt_d) {
  constexpr int VPR = D * (int)sizeof(IN) / 16;  // 16-byte vectors per token row
  const bool is_v = blockIdx.y != 0;
  const int n_compress = batch * max_new * heads;
  const int blk = blockIdx.x;
  const bool compress = blk < n_compress;
  const int rest = compress ? blk / heads : (blk - n_compress) / heads;
  const int h = compress ? blk % heads : (blk - n_compress) % heads;
  const int b = compress ? rest / max_new : rest / aux_parts;
  const Lens ln = read_lens(lens, batch, b);
  const KvaPlan pl = kva_plan(ln.sink_len, ln.window_len, n, sink_cap, window, T);
  const long long bh = (long long)b * heads + h;
  const IN* chunk = is_v ? v + b * v_sb + h * v_sh : k + b * k_sb + h * k_sh;
  const long long st = is_v ? v_st : k_st;
  const IN* win = (is_v ? win_v : win_k) + bh * window * D;
  if (compress) {
    const int i = rest % max_new;
    if (i >= pl.n_new) return;
    if (block_sees_error(err)) return;
    if (ln.n_tiles + pl.n_new > cap) {
      if (threadIdx.x == 0) atomicOr(err, KVC_ERR_CAPACITY);
      return;
    }
    const StreamTile<IN, D> tile{win, chunk, st, i * T, ln.window_len, pl.n_sink};
    const long long slot = table[(long long)b * cap + ln.n_tiles + i];
    const int nbytes = sec.col_scale + D * (int)sizeof(SC);
    compress_impl<T, D, IN, SC, VB, LM>(tile, is_v, pool + (slot * heads + h) * nbytes, iters, sec, inv_sqrt_d, err);
    return;
  }
  // aux block: part of (b, head)'s chunk rows; a no-tile append is checked by append_commit instead
  const int part = rest % aux_parts;
  if (pl.n_new == 0) return;
  if (block_sees_error(err)) return;
  const int lo = part * aux_rows, hi = min(n, lo + aux_rows);
  int bits = 0;
  for (int q = threadIdx.x; q < (hi - lo) * VPR; q += KVC_NT) {
    const int r = lo + q / VPR;
    bits |= check_vec<IN, sizeof(SC) == 2>(row_vec(chunk, st, r, q % VPR), r >= pl.n_sink, is_v);
  }
  IN* backup = is_v ? backup_v : backup_k;
  if (part == 0 && backup != nullptr) {
    const uint4* src = reinterpret_cast<const uint4*>(win);
    uint4* dst = reinterpret_cast<uint4*>(backup + bh * window * D);
    for (int q = threadIdx.x; q < ln.window_len * VPR; q += KVC_NT) dst[q] = src[q];
  }
  or_error(err, bits);
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
  int bits = 0;
  if (!block_sees_error(err)) {
    const bool self_check = pl.n_new == 0;  // with tiles, append_compress checked every chunk token
    for (int q = tid; q < pl.n_sink * VPR; q += NT) {
      const int r = q / VPR, c = q % VPR;
      const uint4 x = row_vec(chunk, st, r, c);
      if (self_check) bits |= check_vec<IN, F16_SCALES>(x, false, is_v);
      sink[(ln.sink_len + r) * VPR + c] = x;
    }
    if (pl.n_new == 0) {  // the window grows: tokens past the live length, checked here
      for (int q = tid; q < (pl.stream_len - ln.window_len) * VPR; q += NT) {
        const int r = q / VPR, c = q % VPR;
        const uint4 x = row_vec(chunk, st, pl.n_sink + r, c);
        bits |= check_vec<IN, F16_SCALES>(x, true, is_v);
        win[(ln.window_len + r) * VPR + c] = x;
      }
    } else {  // in-place rewrite: window[j] = stream[s + j], in rounds of s (append_plan.cuh)
      const int s = pl.n_new * T, rounds = kva_rounds(pl, T);
      for (int round = 0; round < rounds; ++round) {
        const int lo = round * s, hi = min(lo + s, pl.keep);
        for (int q = tid; q < (hi - lo) * VPR; q += NT) {
          const int j = lo + q / VPR, c = q % VPR, p = s + j;
          win[j * VPR + c] = p < ln.window_len ? win[p * VPR + c] : row_vec(chunk, st, p - ln.window_len + pl.n_sink, c);
        }
        __syncthreads();  // this round's reads before the next round's writes
      }
    }
  }
  or_error(err, bits);
  // the block that finishes last commits the lengths of every sequence, if no block found an error
  __shared__ int last;
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    last = atomicAdd(counter, 1) == (int)(gridDim.x * gridDim.y) - 1;
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

}  // namespace kvc

#define KVC_KERNEL(T, D, IN, INNAME, SC, SCNAME, VB, LM, SUFFIX)                                                   \
  extern "C" __global__ void __launch_bounds__(KVC_NT)                                                             \
      kvarn_compress_t##T##_d##D##_##INNAME##_##SCNAME##_v##VB##SUFFIX(                                            \
      const IN* __restrict__ k, const IN* __restrict__ v, long long k_sb, long long k_sh, long long k_st,          \
      long long v_sb, long long v_sh, long long v_st, u8* __restrict__ out, long long o_sb, long long o_si,        \
      long long o_sh, int n_heads, int n_tiles, int iters, int off_k_codes, int off_chan_step, int off_chan_min,   \
      int off_row_scale, int off_v_codes, int off_tok_step, int off_tok_min, int off_col_scale, float inv_sqrt_d,  \
      int* __restrict__ err) {                                                                                      \
    kvc::Sections sec{off_k_codes, off_chan_step, off_chan_min, off_row_scale,                                     \
                      off_v_codes, off_tok_step,  off_tok_min,  off_col_scale};                                    \
    kvc::compress_layer_block<T, D, IN, SC, VB, LM>(k, v, k_sb, k_sh, k_st, v_sb, v_sh, v_st, out, o_sb, o_si, o_sh, \
                                                    n_heads, n_tiles, iters, sec, inv_sqrt_d, err);              \
  }

// The cache's append kernels (cache dtypes float16 / bfloat16 only; see the append section above).
#define KVC_APPEND_KERNELS(T, D, IN, INNAME, SC, SCNAME, VB, LM, SUFFIX)                                           \
  extern "C" __global__ void __launch_bounds__(KVC_NT)                                                             \
      kvarn_append_compress_t##T##_d##D##_##INNAME##_##SCNAME##_v##VB##SUFFIX(                                     \
      const IN* __restrict__ k, const IN* __restrict__ v, long long k_sb, long long k_sh, long long k_st,          \
      long long v_sb, long long v_sh, long long v_st, const IN* __restrict__ win_k, const IN* __restrict__ win_v,  \
      u8* __restrict__ pool, const int* __restrict__ table, const int* __restrict__ lens, int* __restrict__ err,   \
      IN* __restrict__ backup_k, IN* __restrict__ backup_v, int batch, int n, int sink_cap, int window, int heads,  \
      int cap, int max_new, int aux_parts, int aux_rows, int iters, int off_k_codes, int off_chan_step,            \
      int off_chan_min, int off_row_scale, int off_v_codes, int off_tok_step, int off_tok_min, int off_col_scale,  \
      float inv_sqrt_d) {                                                                                           \
    kvc::Sections sec{off_k_codes, off_chan_step, off_chan_min, off_row_scale,                                     \
                      off_v_codes, off_tok_step,  off_tok_min,  off_col_scale};                                    \
    kvc::append_compress<T, D, IN, SC, VB, LM>(k, v, k_sb, k_sh, k_st, v_sb, v_sh, v_st, win_k, win_v, pool, table, \
                                               lens, err, backup_k, backup_v, batch, n, sink_cap, window, heads,   \
                                               cap, max_new, aux_parts, aux_rows, iters, sec, inv_sqrt_d);         \
  }                                                                                                                 \
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
