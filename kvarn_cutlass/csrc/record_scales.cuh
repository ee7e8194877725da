// Scale i of a record section (chan_step, tok_min, ...) as f32: the record's scales are f32 with
// SCALE_F32, f16 otherwise (format.TileSpec.scale_dtype). Shared by the kernels that read records.
#pragma once
#include <cuda_fp16.h>

__device__ __forceinline__ float scale_at(const unsigned char* p, int i) {
#if SCALE_F32
    return reinterpret_cast<const float*>(p)[i];
#else
    return __half2float(reinterpret_cast<const __half*>(p)[i]);
#endif
}
