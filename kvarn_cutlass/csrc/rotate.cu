// Row-wise normalized Walsh-Hadamard transform (Sylvester order, its own inverse): the query
// rotation into the KVarN domain and the inverse rotation of attention outputs.
//
// Bit-identical to codec.wht on float32 input: butterflies at strides 1, 2, ..., D/2 with
// correctly rounded adds/subs (__fadd_rn/__fsub_rn), then one __fmul_rn by float32(1/sqrt(D)).
// One warp per row; lane l holds channels c = l + 32*j (stride h < 32: __shfl_xor by h, stride
// 32*b: an in-thread pair of j). 8 rows (warps) per 256-thread block.
//
// Defines: KVARN_D (64 | 128 | 256). Kernels, IN/OUT in f16 | bf16 | f32:
//   kvarn_wht_d{D}_{IN}_{OUT}(const IN* x, long long x_row_stride, OUT* y, long long y_row_stride,
//                             long long rows, float inv_sqrt_d)
// Row strides are in elements; channels are contiguous.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef KVARN_D
#define KVARN_D 128
#endif

namespace kvr {

__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(float x) { return x; }

template <typename OUT>
__device__ __forceinline__ OUT from_f32(float x);
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }

template <int D, typename IN, typename OUT>
__device__ __forceinline__ void wht_rows(const IN* __restrict__ x, long long xs, OUT* __restrict__ y, long long ys,
                                         long long rows, float inv_sqrt_d) {
  constexpr int NJ = D / 32;
  const int lane = threadIdx.x & 31;
  const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= rows) return;  // whole warps exit together
  const IN* src = x + row * xs;
  float v[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) v[j] = to_f32(src[lane + 32 * j]);
#pragma unroll
  for (int h = 1; h < 32; h *= 2) {
    const bool upper = (lane & h) != 0;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const float p = __shfl_xor_sync(0xffffffffu, v[j], h);
      v[j] = upper ? __fsub_rn(p, v[j]) : __fadd_rn(v[j], p);
    }
  }
#pragma unroll
  for (int hb = 1; hb < NJ; hb *= 2) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      if (!(j & hb)) {
        const float a = v[j], b = v[j | hb];
        v[j] = __fadd_rn(a, b);
        v[j | hb] = __fsub_rn(a, b);
      }
    }
  }
  OUT* dst = y + row * ys;
#pragma unroll
  for (int j = 0; j < NJ; ++j) dst[lane + 32 * j] = from_f32<OUT>(__fmul_rn(v[j], inv_sqrt_d));
}

}  // namespace kvr

#define KVR_KERNEL(D, IN, INNAME, OUT, OUTNAME)                                                                  \
  extern "C" __global__ void __launch_bounds__(256) kvarn_wht_d##D##_##INNAME##_##OUTNAME(                      \
      const IN* __restrict__ x, long long xs, OUT* __restrict__ y, long long ys, long long rows, float inv_sqrt_d) { \
    kvr::wht_rows<D, IN, OUT>(x, xs, y, ys, rows, inv_sqrt_d);                                                  \
  }
#define KVR_KERNEL_X(...) KVR_KERNEL(__VA_ARGS__)

KVR_KERNEL_X(KVARN_D, __half, f16, float, f32)
KVR_KERNEL_X(KVARN_D, __half, f16, __half, f16)
KVR_KERNEL_X(KVARN_D, __nv_bfloat16, bf16, float, f32)
KVR_KERNEL_X(KVARN_D, __nv_bfloat16, bf16, __nv_bfloat16, bf16)
KVR_KERNEL_X(KVARN_D, float, f32, float, f32)
