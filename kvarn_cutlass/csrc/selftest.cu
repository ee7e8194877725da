// Self-test kernels of the runtime: they exercise every argument kind of a launch
// signature (pointers, 32/64-bit ints, floats, doubles, a by-value struct), dynamic
// shared memory above the 48 KiB default, and thread-block clusters. Tests and the
// `launch` bench section use them; they compute nothing the library needs.

// Integer types are spelled as builtins (int = i32, unsigned = u32, long long = i64,
// unsigned long long = u64): NVRTC has no <stdint.h> without the toolkit's CCCL headers,
// and the self-test must build wherever NVRTC alone is installed.

#ifndef KVARN_SELFTEST_BIAS
#define KVARN_SELFTEST_BIAS 0.0f
#endif

// out[i] = alpha * x[i] + y[i] + KVARN_SELFTEST_BIAS, grid-stride over n elements.
extern "C" __global__ void kvarn_selftest_axpy(float* __restrict__ out, const float* __restrict__ x,
                                               const float* __restrict__ y, float alpha, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    out[i] = alpha * x[i] + y[i] + KVARN_SELFTEST_BIAS;
  }
}

// Passed by value as "bytes:16"; the layout must match the Python side's struct.pack("<fi2f").
struct SelftestParams {
  float scale;
  int shift;
  float bias[2];
};

// out[i] = p.scale * x[(i * stride) % n] + p.bias[i & 1] + beta * (offset + p.shift), in double.
extern "C" __global__ void kvarn_selftest_mix(double* __restrict__ out, const float* __restrict__ x,
                                              SelftestParams p, int offset, unsigned stride, double beta,
                                              unsigned long long n) {
  unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  if (i < n) {
    out[i] = (double)p.scale * (double)x[(i * stride) % n] + (double)((i & 1) ? p.bias[1] : p.bias[0]) + beta * (double)(offset + p.shift);
  }
}

// Each block reverses its chunk of `chunk` floats through dynamic shared memory
// (chunk * 4 bytes of it), so launches can ask for more than 48 KiB.
extern "C" __global__ void kvarn_selftest_reverse(float* __restrict__ out, const float* __restrict__ x, int chunk) {
  extern __shared__ float buf[];
  const long long base = (long long)blockIdx.x * chunk;
  for (int j = threadIdx.x; j < chunk; j += blockDim.x) buf[j] = x[base + j];
  __syncthreads();
  for (int j = threadIdx.x; j < chunk; j += blockDim.x) out[base + j] = buf[chunk - 1 - j];
}

// out[block] = the block's rank in its thread-block cluster (sm_90+), else -1.
extern "C" __global__ void kvarn_selftest_cluster_rank(int* __restrict__ out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  if (threadIdx.x == 0) out[blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)] = (int)rank;
#else
  if (threadIdx.x == 0) out[blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)] = -1;
#endif
}
