// Normalized Walsh-Hadamard transform (Sylvester order, its own inverse) of one row of D = 32 * E values
// held by a warp, E consecutive values per lane (lane l holds x[l*E .. l*E + E)): strides below E inside
// the thread, the others through shuffles. Shared by the kernels that rotate rows (prefill_fused.cu,
// dequant.cu); f32 throughout.
#pragma once

template <int E>
__device__ __forceinline__ void wht_lanes(float (&x)[E], int lane) {
#pragma unroll
    for (int h = 1; h < E; h <<= 1) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            if (!(e & h)) {
                const float a = x[e], b = x[e + h];
                x[e] = a + b;
                x[e + h] = a - b;
            }
        }
    }
#pragma unroll
    for (int ls = 1; ls < 32; ls <<= 1) {
        const bool upper = lane & ls;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const float o = __shfl_xor_sync(0xffffffffu, x[e], ls);
            x[e] = upper ? o - x[e] : x[e] + o;
        }
    }
    const float norm = rsqrtf((float)(32 * E));
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] *= norm;
}
