// Split-tile KVarN decode attention: one new query token per sequence.
//
// Kernel 1 (partials), grid (S + E, num_kv_heads, batch), 128 threads:
//   blockIdx.x < S : a contiguous range of tiles of one (sequence, KV head) for ALL q heads of the
//                    GQA group. Tiles per split are computed on the device from the live tile count
//                    (tps = max(min_tps, ceil(n_tiles / S))), so one fixed grid serves every length
//                    (CUDA-graph safe); splits past the live range write neutral partials (m=-inf, l=0).
//                    Records stream through a cp.async ring of NS stages (16-byte copies); scores come
//                    from the 4-bit channel-major K codes with fp16 tensor-core MMAs (codes are exact in
//                    fp16; q_rot*chan_step is split in fp16 hi+lo, fp32 accumulation), V is aggregated
//                    from the token-major codes with a second MMA (p*tok_step split hi+lo) in the
//                    rotated domain; per-tile col_scale, tok_min and chan_min are applied in fp32.
//   blockIdx.x = S + e: the exact part (sink + fp16/bf16 window) in the original domain, CUDA cores,
//                    tokens [e*TE, (e+1)*TE) of sink ++ window, staged in shared memory with cp.async.
//   Partials: po [B, Hkv, S+E, G, D] (unnormalized), pm / pl [B, Hkv, S+E, G], log2 domain.
// Kernel 2 (combine), grid (num_q_heads, batch): log-sum-exp merge of the tile splits, one inverse
//   WHT of the merged rotated tile output, LSE merge of the E exact partials, merge, normalize, store.
//
// Compile-time parameters (one module per record layout): KVD_D (head_dim), KVD_T (tile tokens),
// KVD_VB (V bits), KVD_SB (scale bytes: 2 = f16, 4 = f32), KVD_QZ (quantizer: 0 = uniform, 1 = lloyd_max).
//
// lloyd_max (KVD_QZ = 1, kernel names end in _lm): a code stands for the codebook value c[code] (the
// N(0,1) Lloyd-Max centroids), so the MMA operands are c[code] in f16 instead of the code itself; all
// the affine algebra (q*chan_step, q.chan_min, p*tok_step, p*tok_min, row/col scales) is the same. The
// lookup is done with byte permutes (PRMT) from the f16 table held in registers as lo-byte words
// KVD_KL0..3 / hi-byte words KVD_KH0..3 (entry i at byte i % 4 of word i / 4; V: KVD_VL*, KVD_VH*):
// 4 codes (nibbles of a selector) cost 2 PRMTs per byte plane and a LOP3 select for 16 entries
// (lut16), or 1 PRMT per byte plane for the 4-entry 2-bit book (lut4), plus 2 PRMTs to interleave
// the planes into two half2. A shared-memory table would cost one LDS per code plus the index
// arithmetic (two per half2 before the pack), more issue slots in a kernel that is issue-bound.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef KVD_D
#define KVD_D 128
#endif
#ifndef KVD_T
#define KVD_T 128
#endif
#ifndef KVD_VB
#define KVD_VB 2
#endif
#ifndef KVD_SB
#define KVD_SB 2
#endif
#ifndef KVD_QZ
#define KVD_QZ 0
#endif
#if KVD_QZ
#define KVD_QTAG _lm
#if !defined(KVD_KL0) || !defined(KVD_VL0)
#error "lloyd_max decode needs the codebook tables KVD_KL0..3, KVD_KH0..3, KVD_VL0..3, KVD_VH0..3 (decode.py)"
#endif
#else
#define KVD_QTAG
#endif

#define KVD_STR2(a, b, c, d, e, q) a##_d##b##_t##c##_v##d##_s##e##q
#define KVD_STR(a, b, c, d, e, q) KVD_STR2(a, b, c, d, e, q)
#define KVD_PARTIALS KVD_STR(kvarn_decode_partials, KVD_D, KVD_T, KVD_VB, KVD_SB, KVD_QTAG)
#define KVD_COMBINE KVD_STR(kvarn_decode_combine, KVD_D, KVD_T, KVD_VB, KVD_SB, KVD_QTAG)

namespace kvd {

constexpr int D = KVD_D, T = KVD_T, VB = KVD_VB, SB = KVD_SB;
constexpr int NT = 128, NW = 4;
constexpr int TPW = T / NW;          // tile tokens per warp: 32 or 16
constexpr int MB = TPW / 16;         // K-MMA m-blocks per warp: 2 or 1
constexpr int KSTEPS = D / 16;       // K-MMA k-steps (channels)
constexpr int VCH = D >= 256 ? 2 : 1;        // V channel chunks (bounds registers for D=256)
constexpr int GCH = D / 8;                   // V channels owned by one lane group g
constexpr int GCH_CHUNK = GCH / VCH;         // 8 or 16
constexpr int MBV = GCH_CHUNK / 2;           // V-MMA m-blocks per chunk
constexpr int VGB = GCH_CHUNK * VB / 8;      // V code bytes per (token row, g, chunk): 2, 4 or 8
constexpr int VROW = D * VB / 8;             // V code bytes per token
constexpr int KROW = T / 2;                  // K code bytes per channel
// Record layout (kvarn_cutlass.format): sections in this order, each 16-byte aligned.
constexpr int OFF_CSTEP = D * T / 2;
constexpr int OFF_CMIN = OFF_CSTEP + D * SB;
constexpr int OFF_RS = OFF_CMIN + D * SB;
constexpr int OFF_V = OFF_RS + T * SB;
constexpr int OFF_TSTEP = OFF_V + T * D * VB / 8;
constexpr int OFF_TMIN = OFF_TSTEP + T * SB;
constexpr int OFF_COL = OFF_TMIN + T * SB;
constexpr int REC = OFF_COL + D * SB;
constexpr int NS = REC <= 8192 ? 4 : (REC <= 20480 ? 3 : 2);   // cp.async ring stages
#ifndef KVD_MINB
constexpr int MINB = D >= 256 ? 2 : 4;
#else
constexpr int MINB = KVD_MINB;
#endif
// Dynamic shared memory of the partials kernel (the host computes the same from these numbers).
constexpr int SM_STAGES = NS * REC;
constexpr int SM_QROT = 8 * D * 4;
constexpr int SM_FRAG = KSTEPS * 32 * 16;
constexpr int SM_BIAS = NW * 8 * 4;
constexpr int SM_PT = NW * 2 * 8 * TPW * 2;
constexpr int SMEM_TILE = SM_STAGES + SM_QROT + SM_FRAG + SM_BIAS + SM_PT + 16;
// Exact (sink + window) blocks: TE tokens each, K/V rows staged in shared memory (see exact_part).
constexpr int exact_smem(int te) { return te * D * 4 + 8 * D * 4 + NT * 32 + 8 * te * 4 + 64 + NT * 64; }
constexpr int TE = exact_smem(64) <= SMEM_TILE ? 64 : 32;
constexpr int EX_NP = NT / TE;               // channel parts per token in the score phase: 2 or 4
constexpr int SMEM = SMEM_TILE > exact_smem(TE) ? SMEM_TILE : exact_smem(TE);

static_assert(OFF_CSTEP % 128 == 0 && OFF_V % 16 == 0 && REC % 16 == 0, "record sections must be aligned");
static_assert(VGB == 2 || VGB == 4 || VGB == 8, "unsupported V chunk");
static_assert((KSTEPS * 32) % NT == 0, "q fragment elements per thread");
static_assert(NW * 8 * (D + 2) * 4 <= SM_STAGES, "warp merge buffer must fit in the stage ring");

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float ld_in(const void* p, size_t i, bool bf) {
    if (bf) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p)[i]);
    return __half2float(reinterpret_cast<const __half*>(p)[i]);
}

// N consecutive scales at index i of a scale section (aligned to min(N*SB, 16) bytes).
template <int N>
__device__ __forceinline__ void ld_scales(const unsigned char* sec, int i, float* out) {
    constexpr int BYTES = N * SB;
    const unsigned char* p = sec + i * SB;
    unsigned w[BYTES / 4];
    if constexpr (BYTES >= 16) {
#pragma unroll
        for (int k = 0; k < BYTES / 16; ++k) {
            uint4 v = *reinterpret_cast<const uint4*>(p + 16 * k);
            w[4 * k] = v.x; w[4 * k + 1] = v.y; w[4 * k + 2] = v.z; w[4 * k + 3] = v.w;
        }
    } else if constexpr (BYTES == 8) {
        uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x; w[1] = v.y;
    } else {
        static_assert(BYTES == 4, "scale loads of 4, 8 or 16k bytes");
        w[0] = *reinterpret_cast<const unsigned*>(p);
    }
#pragma unroll
    for (int k = 0; k < BYTES / 4; ++k) {
        if constexpr (SB == 2) {
            __half2 h = *reinterpret_cast<__half2*>(&w[k]);
            float2 f = __half22float2(h);
            out[2 * k] = f.x; out[2 * k + 1] = f.y;
        } else {
            out[k] = __uint_as_float(w[k]);
        }
    }
}

// Bits [K, K+NB) of bytes 0 and 2 of x as exact fp16 integers (low half from byte 0): the field is
// OR-ed into the mantissa of 1024.0 and 1024 is removed with one exact half2 FMA.
template <int K, int NB>
__device__ __forceinline__ unsigned codes2(unsigned x) {
    constexpr unsigned M = ((1u << NB) - 1u) << K;
    // (x & mask) | 0x64006400 as one LOP3 (written as C, ptxas emits two: one immediate per LOP3)
    unsigned v;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(v) : "r"(x), "n"(M | (M << 16)), "r"(0x64006400u));
    const unsigned short s_bits = (unsigned short)(0x3C00 - (K << 10));          // 2^-K
    const unsigned short o_bits = (unsigned short)(0x8000 | (0x3C00 + ((10 - K) << 10)));  // -2^(10-K)
    __half2 s = __halves2half2(__ushort_as_half(s_bits), __ushort_as_half(s_bits));
    __half2 o = __halves2half2(__ushort_as_half(o_bits), __ushort_as_half(o_bits));
    __half2 r = __hfma2(*reinterpret_cast<__half2*>(&v), s, o);
    return *reinterpret_cast<unsigned*>(&r);
}

#if KVD_QZ
// Codebook lookup of the 4 codes in nibbles 0..3 of sel (higher bits ignored) from a 16-entry f16 table
// (byte planes L, H): r0 = (c[n0], c[n2]), r1 = (c[n1], c[n3]) as half2 (low half first), i.e. the same
// pairing as codes2<0,4> / codes2<4,4> of bytes 0 and 1 of sel.
__device__ __forceinline__ void lut16(unsigned sel, const unsigned (&L)[4], const unsigned (&H)[4], unsigned& r0,
                                      unsigned& r1) {
    const unsigned s7 = sel & 0x7777u;                                        // index within a half table
    const unsigned m = __byte_perm(0x0000FF00u, 0u, (sel >> 3) & 0x1111u);  // byte k = 0xFF iff code k >= 8
    const unsigned la = __byte_perm(L[0], L[1], s7), lb = __byte_perm(L[2], L[3], s7);
    const unsigned ha = __byte_perm(H[0], H[1], s7), hb = __byte_perm(H[2], H[3], s7);
    const unsigned lo = (la & ~m) | (lb & m), hi = (ha & ~m) | (hb & m);   // one LOP3 each
    r0 = __byte_perm(lo, hi, 0x6240u);
    r1 = __byte_perm(lo, hi, 0x7351u);
}
// The same for the 4-entry (2-bit) table: codes in nibbles 0..3 of sel, each nibble < 4.
__device__ __forceinline__ void lut4(unsigned sel, unsigned L, unsigned H, unsigned& r0, unsigned& r1) {
    const unsigned lo = __byte_perm(L, 0u, sel), hi = __byte_perm(H, 0u, sel);
    r0 = __byte_perm(lo, hi, 0x6240u);
    r1 = __byte_perm(lo, hi, 0x7351u);
}
#endif

__device__ __forceinline__ void mma16816(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// fp16 hi + lo split of (x0, x1): hi + lo equals x to ~2^-22 relative.
__device__ __forceinline__ void split2(float x0, float x1, unsigned& hi, unsigned& lo) {
    __half2 h = __floats2half2_rn(x0, x1);
    float2 f = __half22float2(h);
    __half2 l = __floats2half2_rn(x0 - f.x, x1 - f.y);
    hi = *reinterpret_cast<unsigned*>(&h);
    lo = *reinterpret_cast<unsigned*>(&l);
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// XOR swizzle of 16-byte chunks inside 128-byte lines of the K code section (bank-conflict-free
// fragment loads: the four channel rows a lane quad reads land in different banks).
__device__ __forceinline__ int kswz(int a) { return a ^ (((a >> 7) & 7) << 4); }

// Chunk c = tid + k*NT of the record: the K code chunks are exactly k < KCH/NT (KCH is a multiple of
// NT), and kswz(tid*16 + k*NT*16) = kswz(tid*16) + k*NT*16 (NT*16 bytes = 16 whole 128-byte lines), so
// the thread's two destination offsets are tile-invariant (dk = kswz(16 tid), dn = 16 tid) and every
// copy is one LDGSTS with immediate offsets.
__device__ __forceinline__ void load_record(unsigned char* dst, const unsigned char* src, int tid, int dk) {
    constexpr int NCH = REC / 16, KCH = OFF_CSTEP / 16;
    constexpr int NFULL = NCH / NT, NREM = NCH % NT, KIT = KCH / NT;
    static_assert(KCH % NT == 0, "K code chunks must be a multiple of the block size");
    const int dn = tid * 16;
    dst += dn;
    src += dn;
#pragma unroll
    for (int k = 0; k < NFULL; ++k) cp_async16(dst + (k < KIT ? dk - dn : 0) + k * NT * 16, src + k * NT * 16);
    if constexpr (NREM > 0) {
        if (tid < NREM) cp_async16(dst + NFULL * NT * 16, src + NFULL * NT * 16);
    }
}

// Exact part: sink + window tokens in the original domain (fp16/bf16 K, V), all G heads. Block e of
// the E exact blocks covers tokens [e*TE, min(n, (e+1)*TE)) of the sequence sink ++ window; its K and V
// rows arrive with one round of cp.async (one memory latency), then scores, softmax and P.V run from
// shared memory. The block writes one partial (m, l, unnormalized o) like a tile split; the combine
// kernel merges the E partials (so this is the same math as one pass, in a different summation order).
__device__ void exact_part(unsigned char* smem, const void* q, const void* win_k, const void* win_v,
                           const void* sink_k, const void* sink_v, const int* win_len, const int* sink_len,
                           float* po, float* pm, float* pl, size_t slot, int b, int h, int Hkv, int G, int W,
                           int SC, int e, bool q_bf, bool kv_bf, float sl2) {
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    int sl = sink_len[b], wl = win_len[b];
    sl = sl < 0 ? 0 : (sl > SC ? SC : sl);
    wl = wl < 0 ? 0 : (wl > W ? W : wl);
    const int n = sl + wl;
    const int t0 = e * TE;
    const int cnt = min(TE, n - t0);
    if (cnt <= 0) {
        if (tid < G) { pm[slot + tid] = neg_inf(); pl[slot + tid] = 0.f; }
        return;
    }
    unsigned char* kb = smem;                                   // [TE][D] fp16/bf16
    unsigned char* vb = kb + TE * D * 2;                        // [TE][D]
    float* qs = reinterpret_cast<float*>(vb + TE * D * 2);      // [8][D]
    float* scp = qs + 8 * D;                                    // [EX_NP][8][TE]
    float* pr = scp + EX_NP * 8 * TE;                           // [8][TE]
    float* mst = pr + 8 * TE;                                   // [8]
    float* lst = mst + 8;                                       // [8]
    float* red = lst + 8;                                       // [NTG][8][D]
    const size_t sbase = (size_t)(b * Hkv + h) * SC;
    const size_t wbase = (size_t)(b * Hkv + h) * W;
    constexpr int RCH = D / 8;  // 16-byte chunks per row
    for (int c = tid; c < cnt * RCH; c += NT) {
        const int r = c / RCH, k = c % RCH, t = t0 + r;
        const size_t row = t < sl ? sbase + t : wbase + (t - sl);
        const unsigned char* srk = reinterpret_cast<const unsigned char*>(t < sl ? sink_k : win_k);
        const unsigned char* srv = reinterpret_cast<const unsigned char*>(t < sl ? sink_v : win_v);
        cp_async16(kb + r * D * 2 + k * 16, srk + row * D * 2 + k * 16);
        cp_async16(vb + r * D * 2 + k * 16, srv + row * D * 2 + k * 16);
    }
    cp_async_commit();
    const size_t qbase = (size_t)(b * Hkv + h) * G * D;
    for (int i = tid; i < G * D; i += NT) qs[i] = ld_in(q, qbase + i, q_bf) * sl2;
    cp_async_wait<0>();
    __syncthreads();
    // --- scores: thread (token t, channel part p) over D / EX_NP channels, 8 at a time --------------
    {
        const int t = tid % TE, p = tid / TE;
        constexpr int CPP = D / EX_NP, NCK = CPP / 8;
        float s[8];
#pragma unroll
        for (int g = 0; g < 8; ++g) s[g] = 0.f;
        if (t < cnt) {
            const unsigned char* row = kb + t * D * 2 + p * CPP * 2;
#pragma unroll 4
            for (int ck = 0; ck < NCK; ++ck) {
                const int c8 = (ck + t) % NCK;  // rotated start: the lanes of a phase hit different banks
                const uint4 u = *reinterpret_cast<const uint4*>(row + c8 * 16);
                unsigned uw[4] = {u.x, u.y, u.z, u.w};
                float kv[8];
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    if (kv_bf) {
                        kv[2 * k] = __uint_as_float(uw[k] << 16);
                        kv[2 * k + 1] = __uint_as_float(uw[k] & 0xffff0000u);
                    } else {
                        float2 f = __half22float2(*reinterpret_cast<__half2*>(&uw[k]));
                        kv[2 * k] = f.x; kv[2 * k + 1] = f.y;
                    }
                }
                const int c0 = p * CPP + c8 * 8;
#pragma unroll
                for (int g = 0; g < 8; ++g) {
                    if (g < G) {
                        const float4 q0 = *reinterpret_cast<const float4*>(qs + g * D + c0);
                        const float4 q1 = *reinterpret_cast<const float4*>(qs + g * D + c0 + 4);
                        s[g] += q0.x * kv[0] + q0.y * kv[1] + q0.z * kv[2] + q0.w * kv[3] + q1.x * kv[4] +
                                q1.y * kv[5] + q1.z * kv[6] + q1.w * kv[7];
                    }
                }
            }
        }
#pragma unroll
        for (int g = 0; g < 8; ++g)
            if (g < G) scp[(p * 8 + g) * TE + t] = s[g];
    }
    __syncthreads();
    for (int i = tid; i < G * TE; i += NT) {
        const int g = i / TE, t = i % TE;
        float v = 0.f;
#pragma unroll
        for (int p = 0; p < EX_NP; ++p) v += scp[(p * 8 + g) * TE + t];
        pr[g * TE + t] = t < cnt ? v : neg_inf();
    }
    __syncthreads();
    // --- softmax over the block's tokens, one warp per head ----------------------------------------
    for (int g = w; g < G; g += NW) {
        constexpr int PL = (TE + 31) / 32;
        float v[PL], mx = neg_inf();
#pragma unroll
        for (int k = 0; k < PL; ++k) {
            const int t = lane + 32 * k;
            v[k] = t < TE ? pr[g * TE + t] : neg_inf();
            mx = fmaxf(mx, v[k]);
        }
#pragma unroll
        for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float ps = 0.f;
#pragma unroll
        for (int k = 0; k < PL; ++k) {
            const int t = lane + 32 * k;
            const float pv = v[k] == neg_inf() ? 0.f : exp2f(v[k] - mx);
            if (t < TE) pr[g * TE + t] = pv;
            ps += pv;
        }
#pragma unroll
        for (int o = 16; o; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
        if (lane == 0) { mst[g] = mx; lst[g] = ps; }
    }
    __syncthreads();
    // --- P.V: thread (channel pair cp, token group tg) ---------------------------------------------
    constexpr int TPG = D / 2;               // threads per token group (2 channels each)
    constexpr int NTG = NT / TPG;            // token groups: 4, 2, 1
    const int cp = tid % TPG, tg = tid / TPG;
    float acc[8][2];
#pragma unroll
    for (int g = 0; g < 8; ++g) acc[g][0] = acc[g][1] = 0.f;
#pragma unroll 4
    for (int tt = tg; tt < cnt; tt += NTG) {
        const unsigned u = *reinterpret_cast<const unsigned*>(vb + tt * D * 2 + cp * 4);
        float v0, v1;
        if (kv_bf) { v0 = __uint_as_float(u << 16); v1 = __uint_as_float(u & 0xffff0000u); }
        else { float2 f = __half22float2(*reinterpret_cast<const __half2*>(&u)); v0 = f.x; v1 = f.y; }
#pragma unroll
        for (int g = 0; g < 8; ++g)
            if (g < G) { const float pv = pr[g * TE + tt]; acc[g][0] += pv * v0; acc[g][1] += pv * v1; }
    }
    if constexpr (NTG > 1) {
#pragma unroll
        for (int g = 0; g < 8; ++g)
            if (g < G) { red[(tg * 8 + g) * D + 2 * cp] = acc[g][0]; red[(tg * 8 + g) * D + 2 * cp + 1] = acc[g][1]; }
        __syncthreads();
        if (tg == 0) {
#pragma unroll
            for (int g = 0; g < 8; ++g) {
                if (g < G) {
                    for (int k = 1; k < NTG; ++k) {
                        acc[g][0] += red[(k * 8 + g) * D + 2 * cp];
                        acc[g][1] += red[(k * 8 + g) * D + 2 * cp + 1];
                    }
                }
            }
        }
    }
    if (tg == 0) {
#pragma unroll
        for (int g = 0; g < 8; ++g)
            if (g < G) *reinterpret_cast<float2*>(po + (slot + g) * D + 2 * cp) = make_float2(acc[g][0], acc[g][1]);
    }
    if (tid < G) { pm[slot + tid] = mst[tid]; pl[slot + tid] = lst[tid]; }
}

}  // namespace kvd

using namespace kvd;

// flags: bit 0 = q is bf16, bit 1 = window/sink are bf16.
extern "C" __global__ void __launch_bounds__(NT, MINB) KVD_PARTIALS(
    const void* __restrict__ q, const unsigned char* __restrict__ tiles, const void* __restrict__ win_k,
    const void* __restrict__ win_v, const void* __restrict__ sink_k, const void* __restrict__ sink_v,
    const int* __restrict__ n_tiles, const int* __restrict__ win_len, const int* __restrict__ sink_len,
    float* __restrict__ po, float* __restrict__ pm, float* __restrict__ pl, int Hkv, int G, int cap, int W, int SC,
    int S, int E, int min_tps, int flags, float scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, qq = lane & 3;
    const size_t slot = ((size_t)(b * Hkv + h) * (S + E) + split) * G;
    const bool q_bf = flags & 1;
    constexpr float LOG2E = 1.4426950408889634f;
    if (split >= S) {
        exact_part(smem, q, win_k, win_v, sink_k, sink_v, win_len, sink_len, po, pm, pl, slot, b, h, Hkv, G, W, SC,
                   split - S, q_bf, (flags & 2) != 0, scale * LOG2E);
        return;
    }
    int n = n_tiles[b];
    n = n < 0 ? 0 : (n > cap ? cap : n);
    const int tps = max(min_tps, (n + S - 1) / S);
    const int t0 = split * tps;
    const int t1 = min(n, t0 + tps);
    if (t0 >= t1) {
        if (tid < G) { pm[slot + tid] = neg_inf(); pl[slot + tid] = 0.f; }
        return;
    }
    const int nloc = t1 - t0;
    unsigned char* stages = smem;
    float* qrot = reinterpret_cast<float*>(smem + SM_STAGES);
    uint4* frag = reinterpret_cast<uint4*>(smem + SM_STAGES + SM_QROT);
    float* biasp = reinterpret_cast<float*>(smem + SM_STAGES + SM_QROT + SM_FRAG);
    __half* pt = reinterpret_cast<__half*>(smem + SM_STAGES + SM_QROT + SM_FRAG + SM_BIAS);
    int* maxbits = reinterpret_cast<int*>(smem + SM_STAGES + SM_QROT + SM_FRAG + SM_BIAS + SM_PT);

    const size_t rstride = (size_t)Hkv * REC;  // bytes between consecutive tiles of one head
    const unsigned char* rec0 = tiles + ((size_t)b * cap * Hkv + h) * REC + (size_t)t0 * rstride;
    const int dk = kswz(tid * 16);
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) {
        if (s < nloc) load_record(stages + s * REC, rec0 + s * rstride, tid, dk);
        cp_async_commit();
    }

    // q_rot = WHT(q) (unnormalized), scaled by a power of two so that max |q_rot| is in [16, 32).
    const size_t qbase = (size_t)(b * Hkv + h) * G * D;
    for (int i = tid; i < G * D; i += NT) qrot[i] = ld_in(q, qbase + i, q_bf);
    if (tid == 0) *maxbits = 0;
    __syncthreads();
    for (int len = 1; len < D; len <<= 1) {
        for (int i = tid; i < G * D / 2; i += NT) {
            const int gg = i / (D / 2), j = i % (D / 2);
            const int i0 = gg * D + (j / len) * 2 * len + (j % len), i1 = i0 + len;
            const float a = qrot[i0], c = qrot[i1];
            qrot[i0] = a + c;
            qrot[i1] = a - c;
        }
        __syncthreads();
    }
    float mx = 0.f;
    for (int i = tid; i < G * D; i += NT) mx = fmaxf(mx, fabsf(qrot[i]));
#pragma unroll
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (lane == 0) atomicMax(maxbits, __float_as_int(mx));
    __syncthreads();
    const float qmax = __int_as_float(*maxbits);
    int ex = 0;
    if (qmax > 0.f && qmax < 3.0e38f) { frexpf(qmax, &ex); }   // qmax in [2^(ex-1), 2^ex)
    const int sh = 5 - ex;                                      // max |q'| in [16, 32)
    for (int i = tid; i < G * D; i += NT) qrot[i] = ldexpf(qrot[i], sh);
    // score (log2 units) = kscale * row_scale * (q'.code*step + q'.min), q' = WHT_unnorm(q) * 2^sh
    const float kscale = scale * LOG2E * rsqrtf((float)D) * ldexpf(1.f, -sh);

    float acc[VCH][MBV][4];
#pragma unroll
    for (int c = 0; c < VCH; ++c)
#pragma unroll
        for (int m = 0; m < MBV; ++m) acc[c][m][0] = acc[c][m][1] = acc[c][m][2] = acc[c][m][3] = 0.f;
    float mrun0 = neg_inf(), mrun1 = neg_inf(), lrun0 = 0.f, lrun1 = 0.f;
    __half* ptw = pt + w * (2 * 8 * TPW);
    // K code byte offsets of this lane's four channel rows (see kswz): a + 1024 u keeps the swizzle of a
    // (1024 bytes = 8 whole lines), so step s reads kaddr[s % SPER][j] + (s / SPER) * 1024.
    constexpr int SPER = 1024 / (16 * KROW);
    static_assert(SPER >= 1 && KSTEPS % SPER == 0, "K steps per swizzle period");
    int kaddr[SPER][4];
#pragma unroll
    for (int sp = 0; sp < SPER; ++sp)
#pragma unroll
        for (int j = 0; j < 4; ++j) kaddr[sp][j] = kswz((16 * sp + 4 * qq + j) * KROW + w * (TPW / 2) + g * MB);

#if KVD_QZ
    const unsigned kbook_lo[4] = {KVD_KL0, KVD_KL1, KVD_KL2, KVD_KL3}, kbook_hi[4] = {KVD_KH0, KVD_KH1, KVD_KH2, KVD_KH3};
    const unsigned vbook_lo[4] = {KVD_VL0, KVD_VL1, KVD_VL2, KVD_VL3}, vbook_hi[4] = {KVD_VH0, KVD_VH1, KVD_VH2, KVD_VH3};
#endif
    for (int i = 0; i < nloc; ++i) {
        cp_async_wait<NS - 2>();
        __syncthreads();  // tile i landed for every thread; everyone is done with tile i-1
        {
            const int nx = i + NS - 1;
            if (nx < nloc) load_record(stages + (nx % NS) * REC, rec0 + (size_t)nx * rstride, tid, dk);
            cp_async_commit();
        }
        const unsigned char* st = stages + (i % NS) * REC;
        // --- q' * chan_step as fp16 hi/lo B fragments, and q' . chan_min partial sums -------------
        {
            float bsum = 0.f;
#pragma unroll
            for (int it = 0; it < KSTEPS * 32 / NT; ++it) {
                const int e = tid + it * NT;
                const int s = e >> 5;
                uint4 f = make_uint4(0u, 0u, 0u, 0u);
                if (g < G) {
                    const int c0 = 16 * s + 4 * qq;
                    float cs[4], cm[4];
                    ld_scales<4>(st + OFF_CSTEP, c0, cs);
                    ld_scales<4>(st + OFF_CMIN, c0, cm);
                    const float4 qv = *reinterpret_cast<const float4*>(qrot + g * D + c0);
                    split2(qv.x * cs[0], qv.y * cs[1], f.x, f.z);
                    split2(qv.z * cs[2], qv.w * cs[3], f.y, f.w);
                    bsum += qv.x * cm[0] + qv.y * cm[1] + qv.z * cm[2] + qv.w * cm[3];
                }
                frag[e] = f;
            }
            bsum += __shfl_xor_sync(0xffffffffu, bsum, 1);
            bsum += __shfl_xor_sync(0xffffffffu, bsum, 2);
            if (qq == 0) biasp[w * 8 + g] = bsum;
        }
        __syncthreads();
        // --- scores: S^T[token][head] = codes[token][channel] x qfold[channel][head] -----------------
        float sacc[MB][4];
#pragma unroll
        for (int m = 0; m < MB; ++m) sacc[m][0] = sacc[m][1] = sacc[m][2] = sacc[m][3] = 0.f;
#pragma unroll
        for (int s = 0; s < KSTEPS; ++s) {
            const uint4 f = frag[s * 32 + lane];
            unsigned x[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int a = kaddr[s % SPER][j] + (s / SPER) * 1024;
                if constexpr (MB == 2) x[j] = *reinterpret_cast<const unsigned short*>(st + a);
                else x[j] = st[a];
            }
#pragma unroll
            for (int m = 0; m < MB; ++m) {
#if KVD_QZ
                // bytes 0, 1 = byte m of channel rows 0, 1 (resp. 2, 3): nibbles = the four codes
                const unsigned sel = (unsigned)m | ((4u + m) << 4);
                unsigned a0, a1, a2, a3;
                lut16(__byte_perm(x[0], x[1], sel), kbook_lo, kbook_hi, a0, a1);
                lut16(__byte_perm(x[2], x[3], sel), kbook_lo, kbook_hi, a2, a3);
#else
                const unsigned sel = (unsigned)m | ((4u + m) << 8);
                const unsigned z01 = __byte_perm(x[0], x[1], sel), z23 = __byte_perm(x[2], x[3], sel);
                const unsigned a0 = codes2<0, 4>(z01), a1 = codes2<4, 4>(z01);
                const unsigned a2 = codes2<0, 4>(z23), a3 = codes2<4, 4>(z23);
#endif
                mma16816(sacc[m], a0, a1, a2, a3, f.x, f.y);
                mma16816(sacc[m], a0, a1, a2, a3, f.z, f.w);
            }
        }
        float bias0 = 0.f, bias1 = 0.f;
#pragma unroll
        for (int k = 0; k < NW; ++k) { bias0 += biasp[k * 8 + 2 * qq]; bias1 += biasp[k * 8 + 2 * qq + 1]; }
        // thread's tokens (tile-local): w*TPW + 2*g*MB + j, j = 2m + r (r = 1 for sacc[m][2..3])
        const int tok0 = w * TPW + 2 * g * MB;
        float rs[2 * MB], ts[2 * MB], tm[2 * MB];
        ld_scales<2 * MB>(st + OFF_RS, tok0, rs);
        ld_scales<2 * MB>(st + OFF_TSTEP, tok0, ts);
        ld_scales<2 * MB>(st + OFF_TMIN, tok0, tm);
        float sc[MB][4];
        float mx0 = neg_inf(), mx1 = neg_inf();
#pragma unroll
        for (int m = 0; m < MB; ++m) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float r = rs[2 * m + (k >> 1)] * kscale;
                sc[m][k] = (sacc[m][k] + ((k & 1) ? bias1 : bias0)) * r;
            }
            mx0 = fmaxf(mx0, fmaxf(sc[m][0], sc[m][2]));
            mx1 = fmaxf(mx1, fmaxf(sc[m][1], sc[m][3]));
        }
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
        }
        const float mn0 = fmaxf(mrun0, mx0), mn1 = fmaxf(mrun1, mx1);
        const float al0 = exp2f(mrun0 - mn0), al1 = exp2f(mrun1 - mn1);  // exp2(-inf) = 0 on the first tile
        mrun0 = mn0; mrun1 = mn1;
        float pmin0 = 0.f, pmin1 = 0.f, ps0 = 0.f, ps1 = 0.f;
        float pw[MB][4];
#pragma unroll
        for (int m = 0; m < MB; ++m) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int j = 2 * m + (k >> 1);
                const float p = exp2f(sc[m][k] - ((k & 1) ? mn1 : mn0));
                if (k & 1) { ps1 += p; pmin1 += p * tm[j]; } else { ps0 += p; pmin0 += p * tm[j]; }
                pw[m][k] = p * ts[j];
            }
        }
        lrun0 = lrun0 * al0 + ps0;
        lrun1 = lrun1 * al1 + ps1;
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
            pmin0 += __shfl_xor_sync(0xffffffffu, pmin0, o);
            pmin1 += __shfl_xor_sync(0xffffffffu, pmin1, o);
        }
        // p * tok_step, transposed through shared memory: ptw[hl][head][token] (warp-private)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            unsigned hi[MB], lo[MB];
#pragma unroll
            for (int m = 0; m < MB; ++m) split2(pw[m][hh], pw[m][2 + hh], hi[m], lo[m]);
            __half* dh = ptw + (2 * qq + hh) * TPW + 2 * g * MB;
            __half* dl = dh + 8 * TPW;
            if constexpr (MB == 2) {
                *reinterpret_cast<uint2*>(dh) = make_uint2(hi[0], hi[1]);
                *reinterpret_cast<uint2*>(dl) = make_uint2(lo[0], lo[1]);
            } else {
                *reinterpret_cast<unsigned*>(dh) = hi[0];
                *reinterpret_cast<unsigned*>(dl) = lo[0];
            }
        }
        __syncwarp();
        // --- V: O^T[channel][head] += codes^T[channel][token] x P'^T[token][head] --------------------
#pragma unroll
        for (int ch = 0; ch < VCH; ++ch) {
            float tmp[MBV][4];
#pragma unroll
            for (int m = 0; m < MBV; ++m) tmp[m][0] = tmp[m][1] = tmp[m][2] = tmp[m][3] = 0.f;
#pragma unroll
            for (int sv = 0; sv < TPW / 16; ++sv) {
                const __half* bh = ptw + g * TPW + 16 * sv + 2 * qq;
                const unsigned bh0 = *reinterpret_cast<const unsigned*>(bh);
                const unsigned bh1 = *reinterpret_cast<const unsigned*>(bh + 8);
                const unsigned bl0 = *reinterpret_cast<const unsigned*>(bh + 8 * TPW);
                const unsigned bl1 = *reinterpret_cast<const unsigned*>(bh + 8 * TPW + 8);
                unsigned vw[4][2];
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    const int tok = w * TPW + 16 * sv + 2 * qq + (jj & 1) + 8 * (jj >> 1);
                    const unsigned char* p = st + OFF_V + tok * VROW + g * (GCH * VB / 8) + ch * VGB;
                    if constexpr (VGB == 8) {
                        const uint2 u = *reinterpret_cast<const uint2*>(p);
                        vw[jj][0] = u.x; vw[jj][1] = u.y;
                    } else if constexpr (VGB == 4) {
                        vw[jj][0] = *reinterpret_cast<const unsigned*>(p); vw[jj][1] = 0u;
                    } else {
                        vw[jj][0] = *reinterpret_cast<const unsigned short*>(p); vw[jj][1] = 0u;
                    }
                }
#pragma unroll
                for (int bi = 0; bi < VGB; ++bi) {
#if KVD_QZ
                    // bytes 0, 1 = byte bi of token rows 0, 1 (resp. 2, 3): nibbles as in the K loop
                    const unsigned lsel = (unsigned)(bi & 3) | ((4u + (bi & 3)) << 4);
                    const unsigned y01 = __byte_perm(vw[0][bi >> 2], vw[1][bi >> 2], lsel);
                    const unsigned y23 = __byte_perm(vw[2][bi >> 2], vw[3][bi >> 2], lsel);
                    if constexpr (VB == 4) {
                        unsigned a0, a1, a2, a3;
                        lut16(y01, vbook_lo, vbook_hi, a0, a1);
                        lut16(y23, vbook_lo, vbook_hi, a2, a3);
                        mma16816(tmp[bi], a0, a1, a2, a3, bh0, bh1);
                        mma16816(tmp[bi], a0, a1, a2, a3, bl0, bl1);
                    } else {
                        // 2-bit fields 0 and 2 of each byte (mask 0x3333) / 1 and 3 (shift by 2): r0 of a
                        // lookup feeds the first MMA (fields 0, 1), r1 the second (fields 2, 3)
                        unsigned a0[2], a1[2], a2[2], a3[2];
                        lut4(y01 & 0x3333u, vbook_lo[0], vbook_hi[0], a0[0], a0[1]);
                        lut4((y01 >> 2) & 0x3333u, vbook_lo[0], vbook_hi[0], a1[0], a1[1]);
                        lut4(y23 & 0x3333u, vbook_lo[0], vbook_hi[0], a2[0], a2[1]);
                        lut4((y23 >> 2) & 0x3333u, vbook_lo[0], vbook_hi[0], a3[0], a3[1]);
#pragma unroll
                        for (int hf = 0; hf < 2; ++hf) {
                            mma16816(tmp[2 * bi + hf], a0[hf], a1[hf], a2[hf], a3[hf], bh0, bh1);
                            mma16816(tmp[2 * bi + hf], a0[hf], a1[hf], a2[hf], a3[hf], bl0, bl1);
                        }
                    }
#else
                    const unsigned sel = (unsigned)(bi & 3) | ((4u + (bi & 3)) << 8);
                    const unsigned z01 = __byte_perm(vw[0][bi >> 2], vw[1][bi >> 2], sel);
                    const unsigned z23 = __byte_perm(vw[2][bi >> 2], vw[3][bi >> 2], sel);
                    if constexpr (VB == 4) {
                        const unsigned a0 = codes2<0, 4>(z01), a1 = codes2<4, 4>(z01);
                        const unsigned a2 = codes2<0, 4>(z23), a3 = codes2<4, 4>(z23);
                        mma16816(tmp[bi], a0, a1, a2, a3, bh0, bh1);
                        mma16816(tmp[bi], a0, a1, a2, a3, bl0, bl1);
                    } else {
                        {
                            const unsigned a0 = codes2<0, 2>(z01), a1 = codes2<2, 2>(z01);
                            const unsigned a2 = codes2<0, 2>(z23), a3 = codes2<2, 2>(z23);
                            mma16816(tmp[2 * bi], a0, a1, a2, a3, bh0, bh1);
                            mma16816(tmp[2 * bi], a0, a1, a2, a3, bl0, bl1);
                        }
                        {
                            const unsigned a0 = codes2<4, 2>(z01), a1 = codes2<6, 2>(z01);
                            const unsigned a2 = codes2<4, 2>(z23), a3 = codes2<6, 2>(z23);
                            mma16816(tmp[2 * bi + 1], a0, a1, a2, a3, bh0, bh1);
                            mma16816(tmp[2 * bi + 1], a0, a1, a2, a3, bl0, bl1);
                        }
                    }
#endif
                }
            }
            float cs[GCH_CHUNK];
            ld_scales<GCH_CHUNK>(st + OFF_COL, g * GCH + ch * GCH_CHUNK, cs);
#pragma unroll
            for (int m = 0; m < MBV; ++m) {
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const float al = (k & 1) ? al1 : al0;
                    const float pmn = (k & 1) ? pmin1 : pmin0;
                    acc[ch][m][k] = acc[ch][m][k] * al + cs[2 * m + (k >> 1)] * (tmp[m][k] + pmn);
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();
    // --- merge the four warps (each saw a quarter of every tile's tokens) ------------------------
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
        lrun0 += __shfl_xor_sync(0xffffffffu, lrun0, o);
        lrun1 += __shfl_xor_sync(0xffffffffu, lrun1, o);
    }
    float* mw = reinterpret_cast<float*>(stages);  // [NW][8]
    float* lw = mw + NW * 8;                        // [NW][8]
    float* ow = lw + NW * 8;                        // [NW][8][D]
    if (g == 0) {
        mw[w * 8 + 2 * qq] = mrun0; mw[w * 8 + 2 * qq + 1] = mrun1;
        lw[w * 8 + 2 * qq] = lrun0; lw[w * 8 + 2 * qq + 1] = lrun1;
    }
#pragma unroll
    for (int ch = 0; ch < VCH; ++ch)
#pragma unroll
        for (int m = 0; m < MBV; ++m)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int c = g * GCH + ch * GCH_CHUNK + 2 * m + (k >> 1);
                ow[(w * 8 + 2 * qq + (k & 1)) * D + c] = acc[ch][m][k];
            }
    __syncthreads();
    for (int i = tid; i < G * D; i += NT) {
        const int gg = i / D, c = i % D;
        float M = neg_inf();
#pragma unroll
        for (int k = 0; k < NW; ++k) M = fmaxf(M, mw[k * 8 + gg]);
        float o = 0.f;
#pragma unroll
        for (int k = 0; k < NW; ++k) o += exp2f(mw[k * 8 + gg] - M) * ow[(k * 8 + gg) * D + c];
        po[(slot + gg) * D + c] = o;
    }
    if (tid < G) {
        float M = neg_inf(), L = 0.f;
#pragma unroll
        for (int k = 0; k < NW; ++k) M = fmaxf(M, mw[k * 8 + tid]);
#pragma unroll
        for (int k = 0; k < NW; ++k) L += exp2f(mw[k * 8 + tid] - M) * lw[k * 8 + tid];
        pm[slot + tid] = M;
        pl[slot + tid] = L;
    }
}

// LSE merge of partials j in [j0, j1) of one (sequence, KV head, q head), spread over the block so that
// the loads of many partials are in flight at once (a per-channel loop over j had one L2 round trip per
// 4 partials: ~20 us at 69 partials, measured as the batch-1 floor):
//   M = max_j m_j and L = sum_j 2^(m_j - M) l_j: thread t takes partials j0 + t, j0 + t + 128, ...,
//       then a block reduction (warp shuffles, one value per warp in red[]);
//   O[c] = sum_j 2^(m_j - M) o_j[c]: warp w takes partials j0 + w, j0 + w + 4, ... (unrolled, so
//       several rows are in flight), lane l channels l*CPL .. l*CPL + CPL - 1; the four warp sums
//       are added in warp order through wo[].
// Neutral partials (m = -inf: splits past the live tiles) are skipped; their o is never written.
// Writes M, L (every thread) and O to o_out[D] in shared memory; ends with __syncthreads().
__device__ __forceinline__ float block_reduce(float v, bool is_max, float* red, int tid) {
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        const float u = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, u) : v + u;
    }
    __syncthreads();  // red[] is free (earlier readers are done)
    if ((tid & 31) == 0) red[tid >> 5] = v;
    __syncthreads();
    v = red[0];
#pragma unroll
    for (int w = 1; w < NT / 32; ++w) v = is_max ? fmaxf(v, red[w]) : v + red[w];
    return v;
}

__device__ void lse_merge(const float* __restrict__ po, const float* __restrict__ pm, const float* __restrict__ pl,
                          size_t base, int G, int gg, int j0, int j1, int tid, float& M, float& L, float* o_out,
                          float* red, float* wo) {
    constexpr int CPL = D / 32;  // channels per lane: 2, 4 or 8
    static_assert(CPL == 2 || CPL % 4 == 0, "D = 64, 128 or 256");
    float m = neg_inf();
    for (int j = j0 + tid; j < j1; j += NT) m = fmaxf(m, pm[(base + j) * G + gg]);
    M = block_reduce(m, true, red, tid);
    float l = 0.f;
    if (M != neg_inf())
        for (int j = j0 + tid; j < j1; j += NT) {
            const float mj = pm[(base + j) * G + gg];
            if (mj != neg_inf()) l += exp2f(mj - M) * pl[(base + j) * G + gg];
        }
    L = block_reduce(l, false, red, tid);
    const int w = tid >> 5, lane = tid & 31;
    float acc[CPL];
#pragma unroll
    for (int k = 0; k < CPL; ++k) acc[k] = 0.f;
    if (M != neg_inf()) {
#pragma unroll 4
        for (int j = j0 + w; j < j1; j += NT / 32) {
            const float mj = pm[(base + j) * G + gg];
            if (mj == neg_inf()) continue;  // warp-uniform
            const float wgt = exp2f(mj - M);
            const float* row = po + ((base + j) * G + gg) * D + lane * CPL;
            if constexpr (CPL % 4 == 0) {
#pragma unroll
                for (int k = 0; k < CPL; k += 4) {
                    const float4 v = *reinterpret_cast<const float4*>(row + k);
                    acc[k] += wgt * v.x; acc[k + 1] += wgt * v.y; acc[k + 2] += wgt * v.z; acc[k + 3] += wgt * v.w;
                }
            } else {
                const float2 v = *reinterpret_cast<const float2*>(row);
                acc[0] += wgt * v.x; acc[1] += wgt * v.y;
            }
        }
    }
#pragma unroll
    for (int k = 0; k < CPL; ++k) wo[w * D + lane * CPL + k] = acc[k];
    __syncthreads();
    for (int c = tid; c < D; c += NT) {
        float v = wo[c];
#pragma unroll
        for (int k = 1; k < NT / 32; ++k) v += wo[k * D + c];
        o_out[c] = v;
    }
    __syncthreads();
}

// out: [B, Hkv*G, 1, D] in q's dtype (out_bf16). Grid (Hkv*G, B), 128 threads. Partials 0..S-1 are tile
// splits (rotated domain), S..S+E-1 the exact blocks (original domain).
extern "C" __global__ void __launch_bounds__(128) KVD_COMBINE(const float* __restrict__ po,
                                                              const float* __restrict__ pm,
                                                              const float* __restrict__ pl, void* __restrict__ out,
                                                              int Hkv, int G, int S, int E, int out_bf16) {
    __shared__ float x[D], xe[D], red[NT / 32];
    __shared__ __align__(16) float wo[(NT / 32) * D];
    const int hq = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
    const int h = hq / G, gg = hq % G;
    const size_t base = (size_t)(b * Hkv + h) * (S + E);
    float Mt, Lt, Me, Le;
    lse_merge(po, pm, pl, base, G, gg, 0, S, tid, Mt, Lt, x, red, wo);
    lse_merge(po, pm, pl, base, G, gg, S, S + E, tid, Me, Le, xe, red, wo);
    // inverse WHT (Sylvester butterflies; the 1/sqrt(D) is applied below), once per head
    for (int len = 1; len < D; len <<= 1) {
        for (int i = tid; i < D / 2; i += NT) {
            const int i0 = (i / len) * 2 * len + (i % len), i1 = i0 + len;
            const float a = x[i0], c = x[i1];
            x[i0] = a + c;
            x[i1] = a - c;
        }
        __syncthreads();
    }
    const float M = fmaxf(Mt, Me);
    const float wt = Mt == neg_inf() ? 0.f : exp2f(Mt - M);
    const float we = Me == neg_inf() ? 0.f : exp2f(Me - M);
    const float den = wt * Lt + we * Le;
    const float inv = den > 0.f ? 1.f / den : 0.f;
    const float rd = rsqrtf((float)D);
    for (int c = tid; c < D; c += NT) {
        const float r = (wt * x[c] * rd + we * xe[c]) * inv;
        const size_t oi = ((size_t)b * Hkv * G + hq) * D + c;
        if (out_bf16) reinterpret_cast<__nv_bfloat16*>(out)[oi] = __float2bfloat16(r);
        else reinterpret_cast<__half*>(out)[oi] = __float2half(r);
    }
}
