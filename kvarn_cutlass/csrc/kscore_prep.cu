// K-score GEMM prep kernels (NVRTC; sm_80+): unpack K tiles to int8 token-major rows, fold queries.
//
// Centered codes + two-level residual fold, one s8 x s8 -> s32 GEMM of depth K = 2*D:
//   codes row t = [16*(code-8) for c] ++ [(code-8) for c]       (values in [-128, 112] and [-8, 7])
//   qi8 row m   = [hi for c] ++ [lo for c], x = qfold*127/max|qfold|, hi = rint(x), lo = rint((x-hi)*16)
//   => qi8 . codes = 16 * sum_c (hi + lo/16) * (code-8), exact in int32; |x - (hi + lo/16)| <= 1/32.
// The per-row GEMM scale a = max|qfold|/127/16 carries the 1/16, bias carries the centering offset:
//   bias = sum_c q * (chanMin + 8*chanStep).
//
// Batch index convention (shared with kvarn_cutlass.gemm): l in [0, L), l = head * n_tiles + tile,
// where tile_index[l] is the record index of that (tile, KV head) in the tile pool: the record
// starts at pool + tile_index[l] * record_stride bytes.
//
// Tile record (uint8), see kvarn_cutlass.format.TileSpec: K codes channel-major at k_codes_offset
// (channel c: T tokens, 2 codes per byte, even token in the LOW nibble) = D*T/2 bytes; chanStep[D]
// at chan_step_offset; chanMin[D] at chan_min_offset; rowScale[T] at row_scale_offset; scales are
// f16 (SCALE = __half) or f32 (SCALE = float).
//
// lloyd_max records (the *_lm_* kernels): code i stands for the centroid c_i (symmetric, mean 0), and the
// codes operand comes from two 16-entry int8 tables given by the host (kvarn_cutlass.gemm.prep):
//   codes row t = [KSP_LM_HI[code] for c] ++ [KSP_LM_LO[code] for c]   (round(S c) and round(S c / 16))
// so qi8 . codes = sum_c hi * round(S c) + lo * round(S c / 16) ~= S * sum_c x * c; the fold uses
//   a = max|qfold|/127 * KSP_LM_INV_SCALE (f32 1/S) and bias = sum_c q * chanMin (no centering offset).
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef unsigned char u8;
typedef signed char s8;

#if !defined(KSP_LM_HI) || !defined(KSP_LM_LO) || !defined(KSP_LM_INV_SCALE)
#error "the lloyd_max tables KSP_LM_HI, KSP_LM_LO, KSP_LM_INV_SCALE come from the host (kvarn_cutlass.gemm.prep.prep_spec)"
#endif
__constant__ s8 ksp_lm_hi[16] = KSP_LM_HI;
__constant__ s8 ksp_lm_lo[16] = KSP_LM_LO;

__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(float x) { return x; }

// ---------------------------------------------------------------------------------------------
// (a) unpack: codes_out int8 [L, T, 2D] (token-major, row = [16*(code-8) ++ (code-8)]), rs_out f32 [L, T].
// One block per batch l; the D*T/2 code bytes are staged in shared memory with an odd row pitch
// (T/2 + 1 bytes) so the transposed reads are bank-conflict free; every thread then builds one
// 16-channel chunk of a token row and writes it twice (16-byte stores): scaled at c0, plain at D + c0
// (consecutive threads -> consecutive chunks of one row).
// lloyd_max (LM): the bytes come from the tables (shared memory: 8 words, so any access pattern is
// conflict-free) instead of the code ^ 8 arithmetic.
// dynamic smem: D * (T/2 + 1) bytes.
template <typename SCALE, bool LM>
__device__ void kscore_unpack_impl(const u8* __restrict__ pool, const int* __restrict__ tile_index,
                                   long long record_stride, int k_codes_offset, int row_scale_offset,
                                   int T, int D, s8* __restrict__ codes_out, float* __restrict__ rs_out) {
  extern __shared__ u8 smem[];
  __shared__ s8 lm_tab[32];  // [hi table ++ lo table] (lloyd_max only)
  if (LM && threadIdx.x < 32) lm_tab[threadIdx.x] = threadIdx.x < 16 ? ksp_lm_hi[threadIdx.x] : ksp_lm_lo[threadIdx.x - 16];
  const int l = blockIdx.x;
  const u8* rec = pool + (long long)tile_index[l] * record_stride;
  const int half_t = T >> 1;
  const int pitch = half_t + 1;
  const u8* codes = rec + k_codes_offset;
  // stage: 16-byte global loads (record offsets are 16-byte aligned), byte stores to smem
  const int nvec = (D * half_t) >> 4;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    uint4 v = reinterpret_cast<const uint4*>(codes)[i];
    const u8* b = reinterpret_cast<const u8*>(&v);
    const int byte0 = i << 4;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int g = byte0 + j;
      const int c = g / half_t, k = g - c * half_t;
      smem[c * pitch + k] = b[j];
    }
  }
  __syncthreads();
  const int chunks_per_row = D >> 4;
  const int nchunks = T * chunks_per_row;
  s8* out = codes_out + (long long)l * T * (2 * D);
  for (int i = threadIdx.x; i < nchunks; i += blockDim.x) {
    const int t = i / chunks_per_row, c0 = (i - t * chunks_per_row) << 4;
    const int shift = (t & 1) << 2;
    const int k = t >> 1;
    unsigned w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      unsigned acc = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const unsigned code = (smem[(c0 + q * 4 + j) * pitch + k] >> shift) & 0xF;
        acc |= code << (8 * j);
      }
      w[q] = acc;
    }
    // per byte: x = code ^ 8 is (code - 8) as a 4-bit two's complement value (0..15, no inter-byte carries)
    //   16*(code-8) mod 256 = x << 4;  (code-8) as int8 = x sign-extended from bit 3
    unsigned whi[4], wlo[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      if (LM) {
        whi[q] = wlo[q] = 0u;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const unsigned code = (w[q] >> (8 * j)) & 0xFu;
          whi[q] |= (unsigned)(u8)lm_tab[code] << (8 * j);
          wlo[q] |= (unsigned)(u8)lm_tab[16 + code] << (8 * j);
        }
      } else {
        const unsigned x = w[q] ^ 0x08080808u;
        whi[q] = x << 4;
        wlo[q] = x | (((x >> 3) & 0x01010101u) * 0xF0u);
      }
    }
    s8* row = out + (long long)t * (2 * D);
    reinterpret_cast<uint4*>(row + c0)[0] = make_uint4(whi[0], whi[1], whi[2], whi[3]);
    reinterpret_cast<uint4*>(row + D + c0)[0] = make_uint4(wlo[0], wlo[1], wlo[2], wlo[3]);
  }
  const SCALE* rs = reinterpret_cast<const SCALE*>(rec + row_scale_offset);
  for (int t = threadIdx.x; t < T; t += blockDim.x) rs_out[(long long)l * T + t] = to_f32(rs[t]);
}

// ---------------------------------------------------------------------------------------------
// (b) fold: for batch l (head h = l / n_tiles) and query row m (all f32, bit-exact with fold_reference
// for qi8 and a):
//   qfold[c] = q[h, m, c] * chanStep[c];  x = qfold * (127 / max_c |qfold|) (0 if the row is 0)
//   hi = rint(x) in [-127, 127];  lo = rint((x - hi) * 16) in [-8, 8]  (x - hi exact: Sterbenz)
//   qi8 row = [hi ++ lo] (2D bytes);  a = (max_c |qfold| / 127) / 16
//   bias = sum_c q[h, m, c] * (chanMin[c] + 8 * chanStep[c])
// lloyd_max (LM): a = (max_c |qfold| / 127) * KSP_LM_INV_SCALE and bias = sum_c q[h, m, c] * chanMin[c].
// q: [H, M, D] with row stride q_row_stride and head stride q_head_stride (elements).
// Out: qi8 int8 [L, M, 2D], a f32 [L, M], bias f32 [L, M].  Grid (ceil(M / FOLD_ROWS), L), 256 threads:
// each warp loads its lane's VPL = D/32 contiguous chanStep/chanMin once, then walks FOLD_ROWS/8 rows,
// one row per iteration (vector loads of q, two vector stores of qi8 per lane: hi at c0, lo at D + c0).
#define FOLD_ROWS 64

template <int BYTES> struct VecT;
template <> struct VecT<4> { typedef unsigned type; };
template <> struct VecT<8> { typedef uint2 type; };
template <> struct VecT<16> { typedef uint4 type; };
template <> struct VecT<32> { typedef struct { uint4 a, b; } type; };

template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&f)[N]) {
  typedef typename VecT<N * sizeof(T)>::type V;
  union { V v; T e[N]; } u;
  u.v = *reinterpret_cast<const V*>(p);
#pragma unroll
  for (int j = 0; j < N; ++j) f[j] = to_f32(u.e[j]);
}

template <typename QT, typename SCALE, int VPL, bool LM>
__device__ void kscore_fold_impl(const QT* __restrict__ q, long long q_row_stride, long long q_head_stride,
                                 const u8* __restrict__ pool, const int* __restrict__ tile_index,
                                 long long record_stride, int chan_step_offset, int chan_min_offset,
                                 int M, int n_tiles, s8* __restrict__ qi8, float* __restrict__ a_out,
                                 float* __restrict__ bias_out) {
  constexpr int D = VPL * 32;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int l = blockIdx.y;
  const int h = l / n_tiles;
  const u8* rec = pool + (long long)tile_index[l] * record_stride;
  const int c0 = lane * VPL;
  float step[VPL], cmin[VPL];
  load_vec<SCALE, VPL>(reinterpret_cast<const SCALE*>(rec + chan_step_offset) + c0, step);
  load_vec<SCALE, VPL>(reinterpret_cast<const SCALE*>(rec + chan_min_offset) + c0, cmin);
  if (!LM) {
#pragma unroll
    for (int j = 0; j < VPL; ++j) cmin[j] = cmin[j] + 8.0f * step[j];  // centering offset of the codes
  }
  const QT* qh = q + (long long)h * q_head_stride + c0;
  const int m_end = min(M, (int)(blockIdx.x + 1) * FOLD_ROWS);
#pragma unroll 2
  for (int m = blockIdx.x * FOLD_ROWS + warp; m < m_end; m += warps) {
    float qv[VPL];
    load_vec<QT, VPL>(qh + (long long)m * q_row_stride, qv);
    float f[VPL];
    float amax = 0.f, bias = 0.f;
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      f[j] = qv[j] * step[j];
      amax = fmaxf(amax, fabsf(f[j]));
      bias = fmaf(qv[j], cmin[j], bias);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      bias += __shfl_xor_sync(0xffffffffu, bias, o);
    }
    // uniform: the residual level's 1/16 (exact power of two); lloyd_max: 1/S of the int8 tables
    const float a = (amax / 127.0f) * (LM ? KSP_LM_INV_SCALE : 0.0625f);
    const float inv = amax > 0.f ? 127.0f / amax : 0.f;  // one IEEE division per row, then multiplies
    unsigned phi[2] = {0u, 0u}, plo[2] = {0u, 0u};
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      const float x = f[j] * inv;
      const float hf = fminf(127.0f, fmaxf(-127.0f, rintf(x)));
      int lo = __float2int_rn((x - hf) * 16.0f);
      lo = max(-8, min(8, lo));
      const int hi = (int)hf;
      phi[j >> 2] |= (unsigned)(hi & 0xFF) << (8 * (j & 3));
      plo[j >> 2] |= (unsigned)(lo & 0xFF) << (8 * (j & 3));
    }
    const long long row = (long long)l * M + m;
    s8* dst = qi8 + row * (2 * D) + c0;
    if (VPL == 8) {
      reinterpret_cast<uint2*>(dst)[0] = make_uint2(phi[0], phi[1]);
      reinterpret_cast<uint2*>(dst + D)[0] = make_uint2(plo[0], plo[1]);
    } else if (VPL == 4) {
      reinterpret_cast<unsigned*>(dst)[0] = phi[0];
      reinterpret_cast<unsigned*>(dst + D)[0] = plo[0];
    } else {
      reinterpret_cast<unsigned short*>(dst)[0] = (unsigned short)(phi[0] & 0xFFFF);
      reinterpret_cast<unsigned short*>(dst + D)[0] = (unsigned short)(plo[0] & 0xFFFF);
    }
    if (lane == 0) {
      a_out[row] = a;
      bias_out[row] = bias;
    }
  }
}

#define KVARN_UNPACK(NAME, SCALE, LM)                                                                 \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                            \
      const u8* pool, const int* tile_index, long long record_stride, int k_codes_offset,             \
      int row_scale_offset, int T, int D, s8* codes_out, float* rs_out) {                             \
    kscore_unpack_impl<SCALE, LM>(pool, tile_index, record_stride, k_codes_offset, row_scale_offset, T, \
                                  D, codes_out, rs_out);                                               \
  }

KVARN_UNPACK(kvarn_kscore_unpack_f16, __half, false)
KVARN_UNPACK(kvarn_kscore_unpack_f32, float, false)
KVARN_UNPACK(kvarn_kscore_unpack_lm_f16, __half, true)
KVARN_UNPACK(kvarn_kscore_unpack_lm_f32, float, true)

#define KVARN_FOLD(NAME, QT, SCALE, LM)                                                               \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                            \
      const QT* q, long long q_row_stride, long long q_head_stride, const u8* pool,                   \
      const int* tile_index, long long record_stride, int chan_step_offset, int chan_min_offset,      \
      int M, int D, int n_tiles, s8* qi8, float* a_out, float* bias_out) {                            \
    if (D == 128)                                                                                      \
      kscore_fold_impl<QT, SCALE, 4, LM>(q, q_row_stride, q_head_stride, pool, tile_index, record_stride, \
                                         chan_step_offset, chan_min_offset, M, n_tiles, qi8, a_out, bias_out); \
    else if (D == 64)                                                                                  \
      kscore_fold_impl<QT, SCALE, 2, LM>(q, q_row_stride, q_head_stride, pool, tile_index, record_stride, \
                                         chan_step_offset, chan_min_offset, M, n_tiles, qi8, a_out, bias_out); \
    else if (D == 256)                                                                                 \
      kscore_fold_impl<QT, SCALE, 8, LM>(q, q_row_stride, q_head_stride, pool, tile_index, record_stride, \
                                         chan_step_offset, chan_min_offset, M, n_tiles, qi8, a_out, bias_out); \
  }

KVARN_FOLD(kvarn_kscore_fold_f16_f16, __half, __half, false)
KVARN_FOLD(kvarn_kscore_fold_bf16_f16, __nv_bfloat16, __half, false)
KVARN_FOLD(kvarn_kscore_fold_f32_f16, float, __half, false)
KVARN_FOLD(kvarn_kscore_fold_f16_f32, __half, float, false)
KVARN_FOLD(kvarn_kscore_fold_bf16_f32, __nv_bfloat16, float, false)
KVARN_FOLD(kvarn_kscore_fold_f32_f32, float, float, false)
KVARN_FOLD(kvarn_kscore_fold_f16_lm_f16, __half, __half, true)
KVARN_FOLD(kvarn_kscore_fold_bf16_lm_f16, __nv_bfloat16, __half, true)
KVARN_FOLD(kvarn_kscore_fold_f32_lm_f16, float, __half, true)
KVARN_FOLD(kvarn_kscore_fold_f16_lm_f32, __half, float, true)
KVARN_FOLD(kvarn_kscore_fold_bf16_lm_f32, __nv_bfloat16, float, true)
KVARN_FOLD(kvarn_kscore_fold_f32_lm_f32, float, float, true)
