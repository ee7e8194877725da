// Prefill softmax + V over KVarN tiles (NVRTC; sm_80+): the second half of the unfused prefill.
//
// Input: scores S [Lg, Mp, T] (f16 or f32; the K-score GEMM's output for one tile group), batch
// l = hl * Gt + g (local head hl of the group's head range, tile g of the group's tile range);
// tile_index[l] is the record index of that (tile, KV head) in the tile pool.
// State, read at the start and written at the end (so tile groups chain, online softmax):
//   acc [Hg, Mp, D] f32  -- unnormalized tile-part output in the rotated domain,
//   m   [Hg, Mp]    f32  -- running max of the scores (-inf: nothing seen yet),
//   l   [Hg, Mp]    f32  -- running sum of exp(s - m).
// Per tile, with p[t] = exp(s[t] - m) (causally masked), smax = max_t tok_step[t], h = 2^(VB-1):
//   P'[r, t]  = p[t] * tok_step[t] / smax             (f16, in [0, 1])
//   O[r, d]   = sum_t P'[r, t] * (code[t, d] - h)        (mma.sync m16n8k16, f32 accumulation;
//                                                         centered codes [-2, 1] / [-8, 7], exact in f16)
//   acc[r, d] = acc * exp(m_old - m_new)
//             + col_scale[d] * (smax * O[r, d] + sum_t p[t] * (tok_min[t] + h * tok_step[t]))   (f32)
// No dequantized V is formed: codes are exact small integers, tok_step/tok_min are folded into the
// probabilities and col_scale is applied to the per-tile product. The codes are centered because
// uncentered codes carry their mean: O and sum p*tok_min would then largely cancel, amplifying the f16
// rounding of P' (same reason and same fix as the K codes in kscore_prep.cu).
//
// lloyd_max records (the *_v<VB>lm_* kernels): a code stands for the centroid c[code] of the N(0,1)
// Lloyd-Max codebook (symmetric, so already centred; f16-exact by the format): the staged values are c[code] (from
// a 16-entry f16 table in shared memory: 8 words, any access pattern is conflict-free) and h = 0.
//
// Rows: r = j * n_new + i (j: q head within the GQA group, i: query index in the chunk); query i
// sits at position qpos0 + i; tile g of the group holds positions tile_pos0 + g*T + t. A key later
// than the query is masked (only tiles that end after qpos0 need the check).
//
// Block: 4 warps, 16 rows each (64 rows); grid (Mp / 64, Hg). Dynamic smem:
//   centered codes f16 [T][D + 8] | tok_step f32 [T] | tok_min + h*tok_step f32 [T] | col_scale f32 [D]
//   (lloyd_max: | codebook f16 [16])
// The codes are staged token-major, as stored (each 32-bit code word becomes 16 or 32 contiguous bytes
// of half2 pairs: vector stores, no bank conflicts to speak of), and the MMA's B fragments (token-pairs
// of one channel) come out of that layout with ldmatrix.trans. (Staging them channel-major with one
// 2-byte store per code cost 8-way bank conflicts: the kernel was shared-memory bound, ncu 2026-11-30.)
#include <cuda_fp16.h>

typedef unsigned char u8;
typedef unsigned int u32;

#define SV_WARPS 4
#define SV_ROWS (SV_WARPS * 16)
#define SV_NEG_INF __int_as_float(0xff800000)

#ifndef SV_LM_CB2  // f16 bit patterns of the lloyd_max codebooks, defined by the host (prefill.sv_spec)
#define SV_LM_CB2 {0xbe0b, 0xb73f, 0x373f, 0x3e0b}
#define SV_LM_CB4 {0xc177, 0xc023, 0xbe79, 0xbd06, 0xbb8a, 0xb941, 0xb635, 0xb01c, \
                   0x301c, 0x3635, 0x3941, 0x3b8a, 0x3d06, 0x3e79, 0x4023, 0x4177}
#endif
__constant__ unsigned short sv_lm_cb2[4] = SV_LM_CB2;
__constant__ unsigned short sv_lm_cb4[16] = SV_LM_CB4;

__device__ __forceinline__ float sc_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float sc_f32(float x) { return x; }

__device__ __forceinline__ void load_pair(const __half* p, float& x, float& y) {
  const __half2 h = *reinterpret_cast<const __half2*>(p);
  const float2 f = __half22float2(h);
  x = f.x;
  y = f.y;
}
__device__ __forceinline__ void load_pair(const float* p, float& x, float& y) {
  const float2 f = *reinterpret_cast<const float2*>(p);
  x = f.x;
  y = f.y;
}

__device__ __forceinline__ u32 pack_half2(float x, float y) {
  __half2 h = __floats2half2_rn(x, y);
  return *reinterpret_cast<u32*>(&h);
}

__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 b16 matrices, transposed: lane l receives (row 2(l%4) + {0,1}, column l/4) of matrix i in
// register i; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* row_addr) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row_addr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// Codes [VB*2i, VB*(2i+1)) and [VB*(2i+1), VB*(2i+2)) of a code word as the half2 (c0 - h, c1 - h):
// each field is OR-ed into the mantissa of 1024.0, then 1024 + h is subtracted exactly.
template <int VB>
__device__ __forceinline__ u32 code_pair(u32 word, int i) {
  constexpr u32 MASK = (1u << VB) - 1u;
  const u32 c0 = (word >> (2 * i * VB)) & MASK, c1 = (word >> ((2 * i + 1) * VB)) & MASK;
  u32 v = c0 | (c1 << 16) | 0x64006400u;
  const __half off = __float2half_rn(1024.f + (float)(1 << (VB - 1)));
  __half2 r = __hsub2(*reinterpret_cast<__half2*>(&v), __halves2half2(off, off));
  return *reinterpret_cast<u32*>(&r);
}

// lloyd_max: the same pair as codebook values, from the f16 table cb in shared memory.
template <int VB>
__device__ __forceinline__ u32 code_pair_lm(u32 word, int i, const unsigned short* cb) {
  constexpr u32 MASK = (1u << VB) - 1u;
  const u32 c0 = (word >> (2 * i * VB)) & MASK, c1 = (word >> ((2 * i + 1) * VB)) & MASK;
  return (u32)cb[c0] | ((u32)cb[c1] << 16);
}

template <int D, int T, int VB, bool LM, typename SC, typename ST>
__device__ void sv_impl(const ST* __restrict__ S, const u8* __restrict__ pool, const int* __restrict__ tile_index,
                        long long record_stride, int v_codes_off, int tok_step_off, int tok_min_off,
                        int col_scale_off, int Mp, int Gt, int n_new, long long qpos0, long long tile_pos0,
                        float* __restrict__ acc_state, float* __restrict__ m_state, float* __restrict__ l_state) {
  constexpr int PD = D + 8;          // f16 pitch of a code row: ldmatrix rows 16 bytes apart mod 128
  constexpr int KB = T / 16;         // k blocks of the P' x codes MMA
  constexpr int NB = D / 8;          // n blocks (8 channels each)
  static_assert(NB % 2 == 0, "ldmatrix.x4 loads two n blocks");
  constexpr float LOG2E = 1.4426950408889634f;
  constexpr int HALF = LM ? 0 : 1 << (VB - 1);  // code centering offset (the lloyd_max codebook is centred)
  extern __shared__ __align__(16) u8 smem[];
  __half* vn = reinterpret_cast<__half*>(smem);
  float* s_step = reinterpret_cast<float*>(smem + T * PD * 2);
  float* s_min = s_step + T;
  float* s_cs = s_min + T;
  unsigned short* s_cb = reinterpret_cast<unsigned short*>(s_cs + D);  // lloyd_max codebook [1 << VB]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (LM && tid < (1 << VB)) s_cb[tid] = VB == 2 ? sv_lm_cb2[tid] : sv_lm_cb4[tid];  // read after the tile loop's barrier
  const int hl = blockIdx.y;
  const int r_lo = blockIdx.x * SV_ROWS + warp * 16 + (lane >> 2);
  const int r_hi = r_lo + 8;
  const int kq = (lane & 3) * 2;
  const long long qp_lo = qpos0 + (r_lo % n_new), qp_hi = qpos0 + (r_hi % n_new);

  // ---- state in
  float acc[NB][4];
  float* acc_lo = acc_state + ((long long)hl * Mp + r_lo) * D;
  float* acc_hi = acc_state + ((long long)hl * Mp + r_hi) * D;
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    const float2 lo = *reinterpret_cast<const float2*>(acc_lo + j * 8 + kq);
    const float2 hi = *reinterpret_cast<const float2*>(acc_hi + j * 8 + kq);
    acc[j][0] = lo.x; acc[j][1] = lo.y; acc[j][2] = hi.x; acc[j][3] = hi.y;
  }
  float m_lo = m_state[(long long)hl * Mp + r_lo], m_hi = m_state[(long long)hl * Mp + r_hi];
  // l is kept as per-thread partial sums (quad-reduced at the end); the stored value enters once
  float l_lo = (lane & 3) == 0 ? l_state[(long long)hl * Mp + r_lo] : 0.f;
  float l_hi = (lane & 3) == 0 ? l_state[(long long)hl * Mp + r_hi] : 0.f;

  for (int g = 0; g < Gt; ++g) {
    const int l = hl * Gt + g;
    const u8* rec = pool + (long long)tile_index[l] * record_stride;
    __syncthreads();  // the previous tile's smem is no longer read
    {
      const SC* ts = reinterpret_cast<const SC*>(rec + tok_step_off);
      const SC* tm = reinterpret_cast<const SC*>(rec + tok_min_off);
      const SC* cs = reinterpret_cast<const SC*>(rec + col_scale_off);
      for (int i = tid; i < T; i += blockDim.x) {
        const float st = sc_f32(ts[i]);
        s_step[i] = st;
        s_min[i] = fmaf((float)HALF, st, sc_f32(tm[i]));  // tok_min + h * tok_step (h*st exact)
      }
      for (int i = tid; i < D; i += blockDim.x) s_cs[i] = sc_f32(cs[i]);
      // V codes: token-major, low bits first; each 32-bit word holds CPW = 32/VB codes of one token,
      // staged as CPW/2 half2 pairs (CPW * 2 contiguous bytes) at row t, channels d0..d0+CPW-1
      constexpr int CPW = 32 / VB, WPT = D / CPW;
      const u32* vw = reinterpret_cast<const u32*>(rec + v_codes_off);
      for (int w = tid; w < T * WPT; w += blockDim.x) {
        const u32 word = vw[w];
        const int t = w / WPT, d0 = (w - t * WPT) * CPW;
        uint4* dst = reinterpret_cast<uint4*>(vn + t * PD + d0);
#pragma unroll
        for (int q = 0; q < CPW / 8; ++q) {
          if constexpr (LM)
            dst[q] = make_uint4(code_pair_lm<VB>(word, 4 * q, s_cb), code_pair_lm<VB>(word, 4 * q + 1, s_cb),
                                code_pair_lm<VB>(word, 4 * q + 2, s_cb), code_pair_lm<VB>(word, 4 * q + 3, s_cb));
          else
            dst[q] = make_uint4(code_pair<VB>(word, 4 * q), code_pair<VB>(word, 4 * q + 1),
                                code_pair<VB>(word, 4 * q + 2), code_pair<VB>(word, 4 * q + 3));
        }
      }
    }
    __syncthreads();
    float smax = 0.f;
    for (int i = lane; i < T; i += 32) smax = fmaxf(smax, s_step[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, o));
    const float inv_smax = smax > 0.f ? 1.f / smax : 0.f;

    // ---- scores of rows r_lo / r_hi, columns kb*16 + kq + {0,1} and + 8 + {0,1}
    const ST* s_lo = S + ((long long)l * Mp + r_lo) * T;
    const ST* s_hi = S + ((long long)l * Mp + r_hi) * T;
    float sv[KB][8];
#pragma unroll
    for (int kb = 0; kb < KB; ++kb) {
      load_pair(s_lo + kb * 16 + kq, sv[kb][0], sv[kb][1]);
      load_pair(s_hi + kb * 16 + kq, sv[kb][2], sv[kb][3]);
      load_pair(s_lo + kb * 16 + kq + 8, sv[kb][4], sv[kb][5]);
      load_pair(s_hi + kb * 16 + kq + 8, sv[kb][6], sv[kb][7]);
    }
    const long long kpos0 = tile_pos0 + (long long)g * T;
    if (kpos0 + T - 1 > qpos0) {  // this tile holds tokens newer than the chunk's first query
#pragma unroll
      for (int kb = 0; kb < KB; ++kb) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const long long kp = kpos0 + kb * 16 + kq + (e & 1) + ((e & 4) ? 8 : 0);
          const long long qp = (e & 2) ? qp_hi : qp_lo;
          if (kp > qp) sv[kb][e] = SV_NEG_INF;
        }
      }
    }
    float tmax_lo = SV_NEG_INF, tmax_hi = SV_NEG_INF;
#pragma unroll
    for (int kb = 0; kb < KB; ++kb) {
      tmax_lo = fmaxf(tmax_lo, fmaxf(fmaxf(sv[kb][0], sv[kb][1]), fmaxf(sv[kb][4], sv[kb][5])));
      tmax_hi = fmaxf(tmax_hi, fmaxf(fmaxf(sv[kb][2], sv[kb][3]), fmaxf(sv[kb][6], sv[kb][7])));
    }
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      tmax_lo = fmaxf(tmax_lo, __shfl_xor_sync(0xffffffffu, tmax_lo, o));
      tmax_hi = fmaxf(tmax_hi, __shfl_xor_sync(0xffffffffu, tmax_hi, o));
    }
    const float mn_lo = fmaxf(m_lo, tmax_lo), mn_hi = fmaxf(m_hi, tmax_hi);
    const float mu_lo = mn_lo == SV_NEG_INF ? 0.f : mn_lo, mu_hi = mn_hi == SV_NEG_INF ? 0.f : mn_hi;
    const float al_lo = exp2f((m_lo - mu_lo) * LOG2E), al_hi = exp2f((m_hi - mu_hi) * LOG2E);
    m_lo = mn_lo;
    m_hi = mn_hi;
    l_lo *= al_lo;
    l_hi *= al_hi;
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      acc[j][0] *= al_lo; acc[j][1] *= al_lo; acc[j][2] *= al_hi; acc[j][3] *= al_hi;
    }
    // ---- p, P' (A fragments), row sums and sum p * (tok_min + h * tok_step)
    u32 afr[KB][4];
    float pm_lo = 0.f, pm_hi = 0.f;
#pragma unroll
    for (int kb = 0; kb < KB; ++kb) {
      float p[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float mu = (e & 2) ? mu_hi : mu_lo;
        p[e] = exp2f((sv[kb][e] - mu) * LOG2E);
      }
      const int c0 = kb * 16 + kq;
      const float st0 = s_step[c0] * inv_smax, st1 = s_step[c0 + 1] * inv_smax;
      const float st8 = s_step[c0 + 8] * inv_smax, st9 = s_step[c0 + 9] * inv_smax;
      const float mi0 = s_min[c0], mi1 = s_min[c0 + 1], mi8 = s_min[c0 + 8], mi9 = s_min[c0 + 9];
      l_lo += p[0] + p[1] + p[4] + p[5];
      l_hi += p[2] + p[3] + p[6] + p[7];
      pm_lo += p[0] * mi0 + p[1] * mi1 + p[4] * mi8 + p[5] * mi9;
      pm_hi += p[2] * mi0 + p[3] * mi1 + p[6] * mi8 + p[7] * mi9;
      afr[kb][0] = pack_half2(p[0] * st0, p[1] * st1);  // (r_lo, k, k+1)
      afr[kb][1] = pack_half2(p[2] * st0, p[3] * st1);  // (r_hi, k, k+1)
      afr[kb][2] = pack_half2(p[4] * st8, p[5] * st9);  // (r_lo, k+8, k+9)
      afr[kb][3] = pack_half2(p[6] * st8, p[7] * st9);  // (r_hi, k+8, k+9)
    }
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      pm_lo += __shfl_xor_sync(0xffffffffu, pm_lo, o);
      pm_hi += __shfl_xor_sync(0xffffffffu, pm_hi, o);
    }
    // ---- O = P' x codes, 16 channels (two n blocks) at a time, folded into acc with col_scale.
    // ldmatrix.x4.trans matrices: 0/1 = tokens kb*16 + 0..7 / 8..15 of n block j (b0 / b1 of j),
    // 2/3 the same for n block j + 1.
    const int lm_row = (lane & 7) + ((lane >> 3) & 1) * 8, lm_col = (lane >> 4) * 8;
#pragma unroll
    for (int j = 0; j < NB; j += 2) {
      float o0[4] = {0.f, 0.f, 0.f, 0.f}, o1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kb = 0; kb < KB; ++kb) {
        u32 b[4];
        ldmatrix_x4_trans(b, vn + (kb * 16 + lm_row) * PD + j * 8 + lm_col);
        mma_16816(o0, afr[kb], b[0], b[1]);
        mma_16816(o1, afr[kb], b[2], b[3]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float* o = h ? o1 : o0;
        const int jj = j + h;
        const float cs0 = s_cs[jj * 8 + kq], cs1 = s_cs[jj * 8 + kq + 1];
        acc[jj][0] += cs0 * (smax * o[0] + pm_lo);
        acc[jj][1] += cs1 * (smax * o[1] + pm_lo);
        acc[jj][2] += cs0 * (smax * o[2] + pm_hi);
        acc[jj][3] += cs1 * (smax * o[3] + pm_hi);
      }
    }
  }

  // ---- state out
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    *reinterpret_cast<float2*>(acc_lo + j * 8 + kq) = make_float2(acc[j][0], acc[j][1]);
    *reinterpret_cast<float2*>(acc_hi + j * 8 + kq) = make_float2(acc[j][2], acc[j][3]);
  }
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, o);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, o);
  }
  if ((lane & 3) == 0) {
    m_state[(long long)hl * Mp + r_lo] = m_lo;
    m_state[(long long)hl * Mp + r_hi] = m_hi;
    l_state[(long long)hl * Mp + r_lo] = l_lo;
    l_state[(long long)hl * Mp + r_hi] = l_hi;
  }
}

// extern "C" entry points: kvarn_prefill_sv_d<D>_t<T>_v<VB>[lm]_<scale dtype>_<score dtype>
#define KVARN_SV(D, T, VB, VQ, LM, SCN, SC, STN, ST)                                                    \
  extern "C" __global__ void __launch_bounds__(SV_WARPS * 32)                                          \
      kvarn_prefill_sv_d##D##_t##T##_v##VQ##_##SCN##_##STN(                                            \
          const ST* S, const u8* pool, const int* tile_index, long long record_stride, int v_codes_off,  \
          int tok_step_off, int tok_min_off, int col_scale_off, int Mp, int Gt, int n_new,              \
          long long qpos0, long long tile_pos0, float* acc, float* m, float* l) {                       \
    sv_impl<D, T, VB, LM, SC, ST>(S, pool, tile_index, record_stride, v_codes_off, tok_step_off,        \
                                  tok_min_off, col_scale_off, Mp, Gt, n_new, qpos0, tile_pos0, acc, m, l); \
  }

#define KVARN_SV_SCORES(D, T, VB, VQ, LM, SCN, SC) \
  KVARN_SV(D, T, VB, VQ, LM, SCN, SC, f16, __half)  \
  KVARN_SV(D, T, VB, VQ, LM, SCN, SC, f32, float)

#define KVARN_SV_SCALES(D, T, VB, VQ, LM)              \
  KVARN_SV_SCORES(D, T, VB, VQ, LM, f16, __half)        \
  KVARN_SV_SCORES(D, T, VB, VQ, LM, f32, float)

#define KVARN_SV_BITS(D, T)              \
  KVARN_SV_SCALES(D, T, 2, 2, false)     \
  KVARN_SV_SCALES(D, T, 4, 4, false)     \
  KVARN_SV_SCALES(D, T, 2, 2lm, true)    \
  KVARN_SV_SCALES(D, T, 4, 4lm, true)

KVARN_SV_BITS(64, 64)
KVARN_SV_BITS(64, 128)
KVARN_SV_BITS(128, 64)
KVARN_SV_BITS(128, 128)
KVARN_SV_BITS(256, 64)
KVARN_SV_BITS(256, 128)
