// Dequantize tile records to K/V in the original domain (NVRTC; sm_80+): one CTA per (tile, KV head).
//
//   K[t][c] = WHT(row_scale[t] * (chan_min + chan_step * kbook[code_k[c][t]]))   (WHT over c)
//   V[t][c] = WHT(col_scale[c] * (tok_min[t] + tok_step[t] * vbook[code_v[t][c]]))
// in f32, then rounded to the output dtype. The rotated values are staged in shared memory as f32
// [T][D + 1] (K written channel by channel, as its codes are stored), then each warp transforms token
// rows (lane l holds D/32 consecutive channels; strides below D/32 inside the thread, the rest through
// shuffles) and stores them.
//
// Defines (kvarn_cutlass.ops.dequant): HEAD_DIM, TILE_TOKENS, V_BITS, SCALE_F32, OUT_BF16, LLOYD_MAX,
// K_CODEBOOK, V_CODEBOOK, OFF_* / RECORD_BYTES from format.TileSpec, KERNEL_NAME.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include "record_scales.cuh"
#include "wht_lanes.cuh"

typedef unsigned char u8;
typedef unsigned int u32;

constexpr int D = HEAD_DIM;
constexpr int T = TILE_TOKENS;
constexpr int VB = V_BITS;
constexpr int NT = 256;
constexpr int PS = D + 1;  // padded f32 row stride of the staging buffer
constexpr int QE = D / 32;

extern "C" __device__ const int kvarn_dequant_smem_bytes = T * PS * 4;

#if OUT_BF16
typedef __nv_bfloat16 out_t;
__device__ __forceinline__ out_t to_out(float x) { return __float2bfloat16_rn(x); }
#else
typedef __half out_t;
__device__ __forceinline__ out_t to_out(float x) { return __float2half_rn(x); }
#endif


#if LLOYD_MAX
__constant__ float k_codebook[16] = K_CODEBOOK;
__constant__ float v_codebook[1 << VB] = V_CODEBOOK;
__device__ __forceinline__ float k_value(u32 c) { return k_codebook[c]; }
__device__ __forceinline__ float v_value(u32 c) { return v_codebook[c]; }
#else
__device__ __forceinline__ float k_value(u32 c) { return (float)c; }
__device__ __forceinline__ float v_value(u32 c) { return (float)c; }
#endif

// Transforms the staged rows and stores them: out rows [T][D] at `dst` (row stride D).
__device__ __forceinline__ void wht_store(const float* stage, out_t* dst, int warp, int lane) {
    for (int t = warp; t < T; t += NT / 32) {
        float x[QE];
#pragma unroll
        for (int e = 0; e < QE; ++e) x[e] = stage[t * PS + lane * QE + e];
        wht_lanes(x, lane);
#pragma unroll
        for (int e = 0; e < QE; ++e) dst[t * D + lane * QE + e] = to_out(x[e]);
    }
}

// grid (n_tiles, Hkv, B), 256 threads. pool/tile_table as in prefill_fused.cu; k_out, v_out
// [B, Hkv, out_stride_tokens, D] (contiguous), tile g written at token offset tok0 + g * T.
extern "C" __global__ void __launch_bounds__(NT) KERNEL_NAME(const u8* __restrict__ pool,
                                                             const int* __restrict__ tile_table, int table_stride,
                                                             int Hkv, out_t* __restrict__ k_out,
                                                             out_t* __restrict__ v_out, int out_tokens, int tok0) {
    extern __shared__ __align__(16) float stage[];
    const int g = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const long long slot = tile_table[(long long)b * table_stride + g];
    const u8* rec = pool + (slot * Hkv + h) * (long long)RECORD_BYTES;
    const long long row0 = ((long long)(b * Hkv + h) * out_tokens + tok0 + (long long)g * T) * D;

    // K: thread per (channel, 8-token word)
    for (int item = tid; item < D * T / 8; item += NT) {
        const int c = item / (T / 8), wi = item - c * (T / 8);
        const u32 w = *reinterpret_cast<const u32*>(rec + OFF_K_CODES + c * (T / 2) + wi * 4);
        const float step = scale_at(rec + OFF_CHAN_STEP, c), mn = scale_at(rec + OFF_CHAN_MIN, c);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int t = wi * 8 + k;
            stage[t * PS + c] = scale_at(rec + OFF_ROW_SCALE, t) * fmaf(step, k_value((w >> (4 * k)) & 15u), mn);
        }
    }
    __syncthreads();
    wht_store(stage, k_out + row0, warp, lane);
    __syncthreads();
    // V: thread per (token, channel)
    constexpr int MASK = (1 << VB) - 1;
    for (int item = tid; item < T * D; item += NT) {
        const int t = item / D, c = item - t * D;
        const u32 byte = rec[OFF_V_CODES + t * (D * VB / 8) + (c * VB) / 8];
        const u32 code = (byte >> ((c * VB) & 7)) & MASK;
        stage[t * PS + c] = scale_at(rec + OFF_COL_SCALE, c) *
                            fmaf(scale_at(rec + OFF_TOK_STEP, t), v_value(code), scale_at(rec + OFF_TOK_MIN, t));
    }
    __syncthreads();
    wht_store(stage, v_out + row0, warp, lane);
}
