// Split-tile KVarN decode attention, one kernel per layer and step: one new query token per sequence.
//
// Grid (S + E, num_kv_heads, batch), 128 threads (4 warps). Blocks are dispatched in linear order, and flags
// bit 2 (decode.py sets it for grids of several waves) maps that order to all B * Hkv * S tile blocks (j fastest,
// then h, then b) and then the B * Hkv * E short exact blocks, which fill the last wave's tail; without it each
// (sequence, KV head) takes its S + E blocks in turn (at batch 1 the exact blocks then run beside the tile blocks
// instead of after them). Block (j, h, b):
//   j < S : tiles [j*tps, min(n, (j+1)*tps)) of sequence b, KV head h, for all G q heads of the group
//           (tps = max(min_tps, ceil(n / S)) from the live tile count n on the device, so one grid serves
//           every length; blocks past the live range write neutral partials). Tile records are found
//           through the int32 tile table [batch, capacity] (entry = record slot s; record (s, h) starts at
//           pool + (s * Hkv + h) * REC) and stream through a cp.async ring of NS iterations.
//   j >= S: exact part, tokens [e*TE, (e+1)*TE) of sink ++ window (e = j - S), original domain.
//   Every block writes a partial (po [B, Hkv, S+E, G, D] unnormalized, pm / pl [B, Hkv, S+E, G], log2
//   domain), then takes a ticket; the last block of (b, h) merges the S + E partials, applies the inverse
//   WHT to the tile part, merges the exact part, normalizes and writes out [B, Hq, 1, D]. It resets the
//   ticket to 0, so the next launch (or graph replay) starts from 0.
//
// Tile loop (one iteration = 128 tokens = TPI tiles; warp w owns 32 tokens of it):
//   fold (all threads, then a barrier): per (tile, head) the rotated query folded with chan_step,
//     qf = q_rot * chan_step, quantized in two int8 levels against x = qf * 127 / max|qf|:
//     hi = rint(x), lo = rint((x - hi) * LFOLD) (LFOLD = 254: |x - (hi + lo/LFOLD)| <= 1/508 of a level),
//     laid out as the B fragments of the score MMA (columns 2h: hi, 2h+1: lo of head h);
//     bias = sum q_rot * (chan_min + 8 chan_step) and the centering offsets -8 * sum_c B[c][col]
//     (exact integers, the C input of the score MMA).
//   scores: int8 tensor cores on the channel-major 4-bit codes, no dequantization: ldmatrix.trans of the
//     codes (rows = channels), PRMT to 4 channels x 2 tokens per register, LOP3 masks split the even token
//     (low nibble, u8 code) from the odd one (high nibble, 16 x code; the 16 is folded into its score
//     factor); mma.m16n8k32 u8 x s8 -> s32 with M = 16 tokens, N = 8 (hi/lo x 4 heads), K = 32 channels.
//     Score (log2 units) = row_scale * (A * (LFOLD * acc_hi + acc_lo) + bias * kscale), exact integers up
//     to the one int -> float conversion.
//   softmax: per warp and head a running max m updated lazily (only when a tile's max exceeds m + TAU),
//     p~ = exp2(s - m_tile), p = 2^(m_tile - m) p~.
//   V: P' = p~ * tok_step / max_t(p~ * tok_step) in two int8 levels (as the query), exchanged through
//     warp-private shared memory into the B layout; V codes by ldmatrix.trans (rows = tokens), PRMT to
//     4 tokens per register, LOP3 masks select one channel per byte position (2-bit: x 4^j, 4-bit: x 16^j,
//     folded into the factor); mma.m16n8k32 u8 x s8 with M = 16 channels, N = 8, K = 32 tokens;
//     o += col_scale * (f * (LFOLD * acc_hi + acc_lo) + 2^(m_tile - m) sum_t p~ tok_min).
//
// lloyd_max (KVD_QZ = 1): a code stands for the centroid c[code]. K codes and 4-bit V codes are looked up
// (PRMT byte permutes from tables held in registers) in two int8 levels, th = rint(SC c), tl =
// rint((SC c - th) * LFOLD), each level its own MMA; the codebook is symmetric, so no centering. 2-bit V:
// c[k] = c[0] + a0 * k + g1 * bit1(k) exactly (the 4-level book is symmetric), so the uniform code MMA plus
// one more MMA on bit 1 of each code.
//
// Compile-time parameters (decode.py, from format.TileSpec): KVD_D, KVD_T, KVD_VB (V bits), KVD_SB
// (scale bytes), KVD_QZ (0 uniform, 1 lloyd_max), the record layout KVD_REC and KVD_OFF_<section>,
// KVD_SFX (name suffix); lloyd_max: KVD_KTH0..3 / KVD_KTL0..3 (K table levels, byte i of word i / 4 =
// entry i), KVD_KSC (f32 bits of 1 / SC), the same KVD_VTH*, KVD_VTL*, KVD_VSC for 4-bit V, and for 2-bit
// V KVD_VC0, KVD_VA0, KVD_VG1 (f32 bits of c[0], a0, g1). Knobs for A/B runs, unset in the
// shipped kernels (decode.DecodeVariant): KVD_NS (ring slots), KVD_MINB1 / KVD_MINB2 (launch-bounds
// minimum blocks per SM of the G <= 4 / G <= 8 kernel), KVD_PREFETCH (records a tile block asks L2 for before
// it waits on the previous kernel; see prefetch_first_records), KVD_Q_FIRST (a tile block reads q before its
// first record copies; see tile_split), KVD_RUN_MAX (p~ against the running max; see warp_tile),
// KVD_MERGE_GROUP (splits per merge group: a two-level merge; see group_merge), KVD_TRACE (a
// block timeline for tools/decode_trace.py; see trace_mark). Everything the host needs about the kernel's
// shared memory is exported in kvarn_decode_layout_<sfx> (see the end of the file).

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#if !defined(KVD_D) || !defined(KVD_T) || !defined(KVD_VB) || !defined(KVD_SB) || !defined(KVD_QZ) || \
    !defined(KVD_REC) || !defined(KVD_OFF_K_CODES) || !defined(KVD_OFF_CHAN_STEP) || !defined(KVD_OFF_CHAN_MIN) || \
    !defined(KVD_OFF_ROW_SCALE) || !defined(KVD_OFF_V_CODES) || !defined(KVD_OFF_TOK_STEP) || \
    !defined(KVD_OFF_TOK_MIN) || !defined(KVD_OFF_COL_SCALE) || !defined(KVD_SFX)
#error "decode.cu needs the record layout defines of decode.decode_spec (KVD_D, KVD_T, KVD_REC, KVD_OFF_*, ...)"
#endif

#define KVD_CAT2(a, b) a##b
#define KVD_CAT(a, b) KVD_CAT2(a, b)
#define KVD_NAME(stem) KVD_CAT(stem, KVD_SFX)

namespace kvd {

constexpr int D = KVD_D, T = KVD_T, VB = KVD_VB, SB = KVD_SB, QZ = KVD_QZ;
constexpr int REC = KVD_REC;
constexpr int OFF_K = KVD_OFF_K_CODES, OFF_CSTEP = KVD_OFF_CHAN_STEP, OFF_CMIN = KVD_OFF_CHAN_MIN;
constexpr int OFF_RS = KVD_OFF_ROW_SCALE, OFF_V = KVD_OFF_V_CODES, OFF_TSTEP = KVD_OFF_TOK_STEP;
constexpr int OFF_TMIN = KVD_OFF_TOK_MIN, OFF_COL = KVD_OFF_COL_SCALE;
constexpr int KBYTES = D * T / 2;  // channel-major 4-bit K codes: channel c at [c * T/2, (c+1) * T/2)
constexpr int VR = D * VB / 8;     // token-major V codes: bytes per token
constexpr int VBYTES = T * VR;

constexpr int NT = 128, NW = 4;
constexpr int TPI = 128 / T;       // tiles per loop iteration
constexpr int WPT = T / 32;        // warps per tile: warp w takes tile w / WPT, tokens 32 * (w % WPT) + [0, 32)
constexpr int KS = D / 32;         // k-steps (32 channels) of the score MMA
constexpr int KCPR = T / 32;       // 16-byte chunks per K channel row (32 tokens each)
constexpr int VCPR = VR / 16;      // 16-byte chunks per V token row
constexpr int VCHC = 128 / VB;     // channels per V chunk (64 or 32)
constexpr int VMB = VCHC / 16;     // V MMA m-blocks per chunk (4 or 2), one per code position in a byte
constexpr int VRUN = VCHC / 8;     // channels of a V chunk one lane holds (contiguous: VRUN * g + [0, VRUN))
constexpr int NOV = D / 8;         // output channels one lane holds per head
constexpr int LFOLD = 254;         // weight of the second int8 level (|lo| <= 127)
constexpr float TAU = 8.f;         // lazy rescale: the running max moves only when a tile exceeds it by TAU (log2)
constexpr float MAGIC = 12582912.f;  // 1.5 * 2^23: x + MAGIC holds rint(x) in its low mantissa bits (|x| < 2^22)
constexpr unsigned MAGIC_BITS = 0x4B400000u;

static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
static_assert(T == 64 || T == 128, "tile tokens 64 or 128");
static_assert(VB == 2 || VB == 4, "V bits 2 or 4");
static_assert(SB == 2 || SB == 4, "f16 or f32 scales");
static_assert(OFF_K % 16 == 0 && OFF_V % 16 == 0 && REC % 16 == 0 && OFF_K + KBYTES <= OFF_V && OFF_V + VBYTES <= REC,
              "record sections: 16-byte aligned, K codes before V codes");
static_assert(OFF_CSTEP % 16 == 0 && OFF_CMIN % 16 == 0 && OFF_RS % 16 == 0 && OFF_TSTEP % 16 == 0 &&
              OFF_TMIN % 16 == 0 && OFF_COL % 16 == 0, "scale sections must be 16-byte aligned (vector loads)");

// --- shared memory of the tile blocks (the exact blocks use exact_smem(TE) from offset 0) ----------------
constexpr int align128(int x) { return (x + 127) / 128 * 128; }
constexpr int RSLOT = TPI * REC;                          // one ring slot: the records of one iteration
// Ring slots: NS - 1 iterations of records in flight while one is computed on. Default 4 for records of
// <= 8 KB per iteration, else 3; KVD_NS (decode.DecodeVariant.ring, A/B runs) overrides it: NS = 2 keeps
// one iteration in flight and frees a slot of shared memory for more resident blocks.
#ifdef KVD_NS
constexpr int NS = KVD_NS;
#else
constexpr int NS = RSLOT <= 8192 ? 4 : 3;
#endif
static_assert(NS >= 2, "the ring needs a slot to compute on and one to load into");
constexpr int FRAG_WORDS = 72;                            // per (tile, n-block, k-step): 32 lanes x 2 words + 8 pad
constexpr int SM_FRAG = align128(NS * RSLOT);             // u32 [TPI][2][KS][FRAG_WORDS]: score B fragments
constexpr int SM_KCF = SM_FRAG + TPI * 2 * KS * FRAG_WORDS * 4;  // float4 [TPI][8]: score factors, bias
constexpr int SM_KCI = SM_KCF + TPI * 8 * 16;             // int4 [TPI][8]: score MMA C input (centering)
constexpr int SM_P = SM_KCI + TPI * 8 * 16;               // u32 [NW][2][64]: P' words, warp-private
constexpr int SM_Q = SM_P + NW * 2 * 64 * 4;              // float [8][D]: rotated queries
constexpr int SMEM_TILE = SM_Q + 8 * D * 4;
// Exact blocks: TE tokens each, K/V rows staged in shared memory (see exact_part).
constexpr int exact_smem(int te) { return te * D * 4 + 8 * D * 4 + NT * 32 + 8 * te * 4 + 64 + NT * 64; }
constexpr int TE = exact_smem(64) <= SMEM_TILE ? 64 : 32;
constexpr int EX_NP = NT / TE;  // channel parts per token in the exact score phase: 2 or 4
constexpr int SMEM = SMEM_TILE > exact_smem(TE) ? SMEM_TILE : exact_smem(TE);
static_assert(NW * 8 * (D + 2) * 4 <= NS * RSLOT, "the warp merge buffers must fit in the ring");
// Resident blocks per SM the register allocation is bounded for (__launch_bounds__' minimum): 4 (128
// registers) for the G <= 4 kernel, 3 for G <= 8 (twice the score and output registers); head_dim 256
// halves both. KVD_MINB1 / KVD_MINB2 (decode.DecodeVariant.min_blocks / min_blocks_g8, A/B runs) override
// them: 5 blocks of 128 threads leave 96 registers per thread, 6 leave 80. (No namespace-scope constants
// for them: NVRTC's -default-device makes each one a symbol of the CUBIN, so the shipped kernels' CUBINs
// would change.)
template <int NB>
constexpr int minb() {
#ifdef KVD_MINB1
    if (NB == 1) return KVD_MINB1;
#endif
#ifdef KVD_MINB2
    if (NB == 2) return KVD_MINB2;
#endif
    return D >= 256 ? (NB == 1 ? 2 : 1) : (NB == 1 ? 4 : 3);
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned s) { return __byte_perm(a, b, s); }
// MUFU.EX2 / MUFU.RCP without range fix-ups: arguments here are <= 0 (ex2(-inf) = 0, tiny results flush to 0)
// and reciprocals of positive normal numbers (2^-22 relative error, far below the int8 levels they scale).
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float rcp(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float ld_in(const void* p, size_t i, bool bf) {
    if (bf) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p)[i]);
    return __half2float(reinterpret_cast<const __half*>(p)[i]);
}

// N consecutive scales at index i of a scale section (aligned to min(N * SB, 16) bytes), as f32.
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
            float2 f = __half22float2(*reinterpret_cast<__half2*>(&w[k]));
            out[2 * k] = f.x; out[2 * k + 1] = f.y;
        } else {
            out[k] = __uint_as_float(w[k]);
        }
    }
}

// 16 bytes global -> shared, asynchronously; smem is a shared-window address (smem_u32)
__device__ __forceinline__ void cp_async16_u32(unsigned smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem));
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) { cp_async16_u32(smem_u32(smem), gmem); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Four 8x8 b16 matrices, transposed: lane (g = lane / 4, q = lane % 4) gets in r[m] the elements
// (row 2q, col g) (low half) and (row 2q + 1, col g) (high half) of matrix m; lane l gives the address of
// row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldsm4t(unsigned addr, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// d = a x b + c, m16n8k32 (row.col), s32 accumulation; AT / BT: u8 or s8. Fragments (lane g = lane / 4,
// q = lane % 4): a[0] = A[g][4q..4q+3], a[1] = A[g+8][4q..], a[2] = A[g][16+4q..], a[3] = A[g+8][16+4q..];
// b0 = B[4q..4q+3][g], b1 = B[16+4q..][g]; d[0..1] = D[g][2q, 2q+1], d[2..3] = D[g+8][2q, 2q+1].
#define KVD_MMA(name, at, bt)                                                                                    \
    __device__ __forceinline__ void name(int (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1,          \
                                         const int (&c)[4]) {                                                    \
        asm("mma.sync.aligned.m16n8k32.row.col.s32." at "." bt ".s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "  \
            "{%10,%11,%12,%13};\n"                                                                               \
            : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])                                                     \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c[0]), "r"(c[1]), "r"(c[2]),     \
              "r"(c[3]));                                                                                        \
    }
KVD_MMA(mma_u8s8, "u8", "s8")
KVD_MMA(mma_s8s8, "s8", "s8")
#undef KVD_MMA

// Shared-memory swizzle of a code section seen as 16-byte chunks i, CPR chunks per row (a channel of the
// K codes, a token of the V codes): chunk i goes to i ^ f(i / 8). The ldmatrix reads take the rows
// r(m, k) = 16 (m / 2) + 2 (m % 2) + 4 (k / 2) + k % 2 (matrix m, row k; + any multiple of 32) of one chunk
// column, and f spreads each matrix's 8 rows over the 8 16-byte bank groups (tests/test_decode.py checks it).
// Its period divides 128 chunks, so swz(i + 128 k) = swz(i) + 128 k.
template <int CPR>
__host__ __device__ constexpr int swz(int i) {
    const int L = i >> 3;
    const int f = CPR == 1 ? (L & 1) << 1 : CPR == 2 ? (L & 1) | ((L & 2) << 1) : CPR == 4 ? (L >> 1) & 3
                                                                                          : ((L >> 1) & 6) | (L & 1);
    return i ^ f;
}
__device__ __forceinline__ int ldsm_row(int lane) {
    const int m = lane >> 3, k = lane & 7;
    return 16 * (m >> 1) + 2 * (m & 1) + 4 * (k >> 1) + (k & 1);
}

// One thread's share of a record copy, tile-invariant, so the tile loop only adds the slot's shared address
// and the record's global address: chunk tid + k NT of each section (16 bytes), the K and V code sections
// swizzled (kdst = 16 swz<KCPR>(tid), vdst = 16 swz<VCPR>(tid)), everything else as is.
struct RecordCopy {
    unsigned plain, kdst, vdst;  // byte offsets in the record's slot: 16 tid, kdst, vdst
    int t16;                     // byte offset in the global record: 16 tid
};
__device__ __forceinline__ RecordCopy record_copy(int tid) {
    return {16u * tid, 16u * swz<KCPR>(tid), 16u * swz<VCPR>(tid), 16 * tid};
}
// Chunks [A, B) of the record unchanged.
template <int A, int B>
__device__ __forceinline__ void copy_plain(unsigned dst, const unsigned char* src, int tid) {
    constexpr int N = (B - A) / 16;
#pragma unroll
    for (int k = 0; k < (N + NT - 1) / NT; ++k)
        if (N % NT == 0 || tid + k * NT < N) cp_async16_u32(dst + A + 16 * k * NT, src + A + 16 * k * NT);
}
// One record into the ring slot at shared address slot from the global record rec.
__device__ __forceinline__ void load_record(unsigned slot, const unsigned char* rec, const RecordCopy& rc, int tid) {
    constexpr int KCH = KBYTES / 16, VCH = VBYTES / 16;
    static_assert(KCH % NT == 0 && (VCH % NT == 0 || VCH < NT), "code sections in whole rounds of 128 chunks");
    const unsigned char* src = rec + rc.t16;
    const unsigned dst = slot + rc.plain, dk = slot + rc.kdst + OFF_K, dv = slot + rc.vdst + OFF_V;
    copy_plain<0, OFF_K>(dst, src, tid);
#pragma unroll
    for (int k = 0; k < KCH / NT; ++k) cp_async16_u32(dk + k * NT * 16, src + OFF_K + k * NT * 16);
    copy_plain<OFF_K + KBYTES, OFF_V>(dst, src, tid);
    if constexpr (VCH >= NT) {
#pragma unroll
        for (int k = 0; k < VCH / NT; ++k) cp_async16_u32(dv + k * NT * 16, src + OFF_V + k * NT * 16);
    } else {
        if (tid < VCH) cp_async16_u32(dv, src + OFF_V);
    }
    copy_plain<OFF_V + VBYTES, REC>(dst, src, tid);
}

// rint(x) in the low byte (two's complement) of the result's bits, |x| < 2^22; also the rounded value.
__device__ __forceinline__ float round_bits(float x) { return __fadd_rn(x, MAGIC); }
// The two int8 levels of x in [-127, 127]: hi bits (low byte = rint(x)), lo bits (low byte =
// rint((x - rint(x)) * LFOLD)); x - rint(x) is exact and the FMA rounds LFOLD * (x - rint(x)) once.
__device__ __forceinline__ void two_levels(float x, unsigned& hb, unsigned& lb) {
    const float h = round_bits(x);
    const float t = __fmaf_rn(__fsub_rn(h, MAGIC), -(float)LFOLD, MAGIC);
    hb = __float_as_uint(h);
    lb = __float_as_uint(__fmaf_rn(x, (float)LFOLD, t));
}
// Low bytes of a, b, c, d as one word (a in byte 0).
__device__ __forceinline__ unsigned pack4(unsigned a, unsigned b, unsigned c, unsigned d) {
    return prmt(prmt(a, b, 0x0040u), prmt(c, d, 0x0040u), 0x5410u);
}

template <int N>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
    for (int o = 1; o < N; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
template <int N>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = 1; o < N; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// Max of non-negative floats / wrapping u32 sum over groups of N consecutive lanes: a whole warp in one
// REDUX (non-negative floats order as their bit patterns), smaller groups by shuffles.
template <int N>
__device__ __forceinline__ float group_max_nonneg(float v) {
    if constexpr (N == 32) return __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(v)));
    else return group_max<N>(v);
}
template <int N>
__device__ __forceinline__ unsigned group_sum_u32(unsigned v) {
    if constexpr (N == 32) {
        return __reduce_add_sync(0xffffffffu, v);
    } else {
#pragma unroll
        for (int o = 1; o < N; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        return v;
    }
}
// Max / sum over the 8 lanes of a warp with the same lane % 4 (the tokens of one head).
__device__ __forceinline__ float head_max(float v) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float head_sum(float v) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Unnormalized WHT (Sylvester order) of one D-vector held by a warp, lane l holding channels
// [l * CPL, (l + 1) * CPL): butterflies of span < CPL in registers, the others across lanes.
template <int CPL>
__device__ __forceinline__ void wht_warp(float (&x)[CPL], int lane) {
#pragma unroll
    for (int len = 1; len < CPL; len <<= 1)
#pragma unroll
        for (int k = 0; k < CPL; ++k)
            if (!(k & len)) {
                const float a = x[k], b = x[k + len];
                x[k] = a + b;
                x[k + len] = a - b;
            }
#pragma unroll
    for (int m = 1; m < 32; m <<= 1)
#pragma unroll
        for (int k = 0; k < CPL; ++k) {
            const float y = __shfl_xor_sync(0xffffffffu, x[k], m);
            x[k] = (lane & m) ? y - x[k] : x[k] + y;
        }
}

#if KVD_QZ
// lloyd_max lookup of the 4 codes in nibbles 0..3 of sel (higher bits ignored) in a 16-entry table of
// int8 (entry i at byte i % 4 of word i / 4): byte k of the result = table[nibble k].
__device__ __forceinline__ unsigned lut16(unsigned s7, unsigned hmask, unsigned w0, unsigned w1, unsigned w2,
                                          unsigned w3) {
    const unsigned lo = prmt(w0, w1, s7), hi = prmt(w2, w3, s7);
    return (lo & ~hmask) | (hi & hmask);
}
#endif

// --- exact part: sink + window tokens in the original domain (fp16/bf16 K, V), all G heads ---------------
// Block e covers tokens [e*TE, min(n, (e+1)*TE)) of sink ++ window; its K and V rows arrive with one round of
// cp.async, then scores, softmax and P.V run from shared memory. Writes one partial like a tile split.
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
        mx = group_max<32>(mx);
        float ps = 0.f;
#pragma unroll
        for (int k = 0; k < PL; ++k) {
            const int t = lane + 32 * k;
            const float pv = v[k] == neg_inf() ? 0.f : exp2f(v[k] - mx);
            if (t < TE) pr[g * TE + t] = pv;
            ps += pv;
        }
        ps = group_sum<32>(ps);
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

// --- fold: the score MMA's B operand and constants for the tiles of one iteration ------------------------
// LPP lanes take one (tile, head) pair, pairs filling warps in order: a warp per pair (D = 64: half a warp),
// so at T = 128 and G = 4 every warp folds one head. Warp w of every resident block issues on the same
// SM sub-partition, so folding all pairs on one warp (8 lanes per pair, fewer instructions in all) made
// that sub-partition issue 827 of the iteration's 2,195 warp-instructions; spread, the busiest warp issues
// ~590 (d128 k4v2, tools/decode_sass_loop.py). UPL units of 4 channels each:
// unit u = a slot of the B fragments, k-step u / 8, half (u / 4) % 2 (b0 / b1), lane quad u % 4; its
// channels 32 (u / 8) + 16 ((u / 4) % 2) + 4 (u % 4) + [0, 4) are the K slots of those registers (see the
// score loop). kfac = kscale / (127 * LFOLD) (lloyd_max: / SC as well), kscale = scale * log2(e) / sqrt(D).
constexpr int FOLD_LPP = D / 4 < 32 ? D / 4 : 32, FOLD_UPL = D / 4 / FOLD_LPP;
// A lane's tile-invariant part of the fold's addressing: per unit k, the first channel c0 and the word offset
// of its B-fragment slot within a (tile, n-block) (the pair adds (j 2 + n-block) KS FRAG_WORDS + 2 hl).
struct FoldLane {
    int c0[FOLD_UPL], frag[FOLD_UPL];
};
__device__ __forceinline__ FoldLane fold_lane(int tid) {
    FoldLane f;
#pragma unroll
    for (int k = 0; k < FOLD_UPL; ++k) {
        const int u = tid % FOLD_LPP + FOLD_LPP * k;
        f.c0[k] = (u >> 3) * 32 + ((u >> 2) & 1) * 16 + (u & 3) * 4;
        f.frag[k] = (u >> 3) * FRAG_WORDS + ((u >> 2) & 1) + 2 * (u & 3);
    }
    return f;
}
__device__ __forceinline__ void fold_tiles(const unsigned char* slot, int ntl, int G, const float* qrot,
                                           unsigned* fragB, float4* kcf, int4* kci, float kfac, float kscale,
                                           int tid, const FoldLane& fl) {
    constexpr int LPP = FOLD_LPP, UPL = FOLD_UPL, PPR = NT / LPP, PPW = 32 / LPP;
    if (tid / 32 * PPW >= ntl * G) return;  // a warp without a pair in any round (warp-uniform)
    const int pl = tid % LPP;
    const int npairs = ntl * G;
    const int rounds = (npairs + PPR - 1) / PPR;
    for (int r = 0; r < rounds; ++r) {  // every lane of a warp runs every round (shuffles below)
        const int p = tid / LPP + r * PPR;
        const bool valid = p < npairs;
        const int pc = valid ? p : 0;
        const int j = TPI == 2 && pc >= G ? 1 : 0, h = pc - j * G;  // pairs (tile j, head h) = j * G + h
        const unsigned char* rec = slot + j * REC;
        float qf[UPL][4];
        float amax = 0.f, bias = 0.f;
#pragma unroll
        for (int k = 0; k < UPL; ++k) {
            const int c0 = fl.c0[k];
            const float4 qv = *reinterpret_cast<const float4*>(qrot + h * D + c0);
            float cs[4], cm[4];
            ld_scales<4>(rec + OFF_CSTEP, c0, cs);
            ld_scales<4>(rec + OFF_CMIN, c0, cm);
            const float qa[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                qf[k][i] = qa[i] * cs[i];
                amax = fmaxf(amax, fabsf(qf[k][i]));
                // uniform: the codes enter the MMA uncentered and the C input removes 8 * sum(B), so the
                // bias carries chan_min + 8 chan_step; lloyd_max: the centroids are centred
                bias = fmaf(qa[i], QZ ? cm[i] : fmaf(8.f, cs[i], cm[i]), bias);
            }
        }
        amax = group_max_nonneg<LPP>(amax);
        bias = group_sum<LPP>(bias);
        const float inv = amax > 0.f ? rcp(amax) * 127.f : 0.f;  // |x| <= 127 (1 + 2^-22) < 127.5
        unsigned ssum = 0;  // sum of the hi levels + 65536 x sum of the lo levels (|each| <= 127 D < 2^15)
        unsigned hw[UPL], lw[UPL];
#pragma unroll
        for (int k = 0; k < UPL; ++k) {
            unsigned hb[4], lb[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) two_levels(qf[k][i] * inv, hb[i], lb[i]);
            if constexpr (QZ) {  // the lookup's K-slot order: channels 0, 2, 1, 3 of the unit
                hw[k] = pack4(hb[0], hb[2], hb[1], hb[3]);
                lw[k] = pack4(lb[0], lb[2], lb[1], lb[3]);
            } else {
                hw[k] = pack4(hb[0], hb[1], hb[2], hb[3]);
                lw[k] = pack4(lb[0], lb[1], lb[2], lb[3]);
                const unsigned sh = hb[0] + hb[1] + hb[2] + hb[3] - 4u * MAGIC_BITS;  // mod 2^32
                const unsigned sl = lb[0] + lb[1] + lb[2] + lb[3] - 4u * MAGIC_BITS;
                ssum += sh + (sl << 16);
            }
        }
        if constexpr (!QZ) ssum = group_sum_u32<LPP>(ssum);
        if (valid) {
            const int nb = h >> 2, hl = 2 * (h & 3) * 4;  // lane (g = 2 (h % 4) + level, q) of the fragment
            unsigned* f = fragB + (j * 2 + nb) * KS * FRAG_WORDS + 2 * hl;
#pragma unroll
            for (int k = 0; k < UPL; ++k) {
                f[fl.frag[k]] = hw[k];
                f[fl.frag[k] + 8] = lw[k];
            }
            if (pl == 0) {
                const float a = amax * kfac;
                kcf[j * 8 + h] = make_float4(a, QZ ? a * (1.f / LFOLD) : a * (1.f / 16.f), bias * kscale, 0.f);
                if constexpr (!QZ) {
                    const int shi = (int)(short)(ssum & 0xffffu), slo = (int)(ssum - (unsigned)shi) >> 16;
                    // C of the score MMA: rows g (even token, code c) and g + 8 (odd token, 16 c),
                    // columns hi / lo: acc = sum B * (code - 8) (x 16 for the odd rows)
                    kci[j * 8 + h] = make_int4(-8 * shi, -8 * slo, -128 * shi, -128 * slo);
                }
            }
        }
    }
}

#ifdef KVD_TRACE
// A diagnostic timeline (tools/decode_trace.py), not a shipped kernel: thread 0 of block i (linear block index,
// i < TRACE_BLOCKS) writes %globaltimer (ns, comparable across SMs) into field f and clock64 (this SM's cycles)
// into field 8 + f at mark f: 0 entry, 1 after the programmatic wait, 2 the first tile's records landed (tile
// blocks), 3 the tile loop done, 4 the partial written, 5 the ticket taken, 6 the final merge done (the merging
// block); field 7: SM id | tiles << 16 | exact block << 32 | merging block << 33. Fields 16-20 split the ticket
// and the merge (%globaltimer only): 16 the barrier before the ticket's atomic passed (every block); in the
// merging block 17 the ticket reset, 18 its first head's first batch of partial rows visible to warp 0, 19 that
// head's rows added, 20 that head's output stored (with KVD_MERGE_GROUP: of the final merge).
constexpr int TRACE_BLOCKS = 8192, TRACE_FIELDS = 24;
extern "C" __device__ unsigned long long KVD_NAME(kvarn_decode_trace_)[TRACE_BLOCKS * TRACE_FIELDS];
__device__ __forceinline__ unsigned long long* trace_row() {
    const unsigned blk = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    return threadIdx.x == 0 && blk < TRACE_BLOCKS ? KVD_NAME(kvarn_decode_trace_) + blk * TRACE_FIELDS : nullptr;
}
__device__ __forceinline__ unsigned long long globaltimer_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void trace_mark(int f) {
    if (unsigned long long* row = trace_row()) {
        row[f] = globaltimer_ns();
        row[8 + f] = clock64();
    }
}
__device__ __forceinline__ void trace_time(int f) {
    if (unsigned long long* row = trace_row()) row[f] = globaltimer_ns();
}
__device__ __forceinline__ void trace_info(unsigned long long bits) {
    if (unsigned long long* row = trace_row()) {
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        row[7] = sm | bits;
    }
}
#define KVD_MARK(f) trace_mark(f)
#define KVD_TIME(f) trace_time(f)
#else
#define KVD_MARK(f)
#define KVD_TIME(f)
#endif

// --- one warp's 32 tokens of one tile: scores, online softmax, P' x V --------------------------------------
template <int NB>
struct WarpState {
    float m[NB], l[NB];  // running max (log2) and this lane's share of the sum, per head (lane % 4 + 4 nb)
    float o[NB][NOV];    // rotated-domain output: chunk c, channels c * VCHC + VRUN g + [0, VRUN)
};

template <int NB>
__device__ __forceinline__ void warp_tile(WarpState<NB>& st, const unsigned char* rec, const unsigned* fragB,
                                          const float4* kcf, const int4* kci, unsigned* pw, int koff, int vsw,
                                          int tb, int G, int lane) {
    const int g = lane >> 2, q = lane & 3;
    const unsigned rs_ = smem_u32(rec);
    // ---- scores: S[token][col] for the warp's tokens tb + [0, 32) --------------------------------------
    // m-block 0: rows g / g + 8 = tokens 4g / 4g + 1; m-block 1: tokens 4g + 2 / 4g + 3 (tb-relative)
#if KVD_QZ
    int acc[NB][2][2][4];  // [nb][m-block][table level][c]
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int t = 0; t < 2; ++t) acc[nb][m][t][0] = acc[nb][m][t][1] = acc[nb][m][t][2] = acc[nb][m][t][3] = 0;
    const unsigned kth[4] = {KVD_KTH0, KVD_KTH1, KVD_KTH2, KVD_KTH3};
    const unsigned ktl[4] = {KVD_KTL0, KVD_KTL1, KVD_KTL2, KVD_KTL3};
#else
    int acc[NB][2][4];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        const int4 ci = kci[q + 4 * nb];
        acc[nb][0][0] = acc[nb][1][0] = ci.x;
        acc[nb][0][1] = acc[nb][1][1] = ci.y;
        acc[nb][0][2] = acc[nb][1][2] = ci.z;
        acc[nb][0][3] = acc[nb][1][3] = ci.w;
    }
#endif
#pragma unroll
    for (int s = 0; s < KS; ++s) {
        unsigned r[4];
        ldsm4t(rs_ + koff + s * 512 * KCPR, r);
        // byte i of x = channel 32 s + 4 q + i (r[0]: i = 0, 1; r[1]: 2, 3), tokens 4g, 4g + 1 (nibbles);
        // y: tokens 4g + 2, 4g + 3; x1 / y1 the same for channels + 16 (r[2], r[3])
        const unsigned x0 = prmt(r[0], r[1], 0x6420u), y0 = prmt(r[0], r[1], 0x7531u);
        const unsigned x1 = prmt(r[2], r[3], 0x6420u), y1 = prmt(r[2], r[3], 0x7531u);
        uint2 bf[NB];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
            bf[nb] = *reinterpret_cast<const uint2*>(fragB + (nb * KS + s) * FRAG_WORDS + 2 * lane);
#if KVD_QZ
        const unsigned xs[2][2] = {{x0, x1}, {y0, y1}};
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            unsigned ah[4], al[4];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const unsigned x = xs[m][hh];
                // nibble selectors of the even / odd token: channels 0, 2, 1, 3 of x's four bytes
                const unsigned se = (x & 0x0F0Fu) | ((x >> 12) & 0xF0F0u);
                const unsigned so = ((x >> 4) & 0x0F0Fu) | ((x >> 16) & 0xF0F0u);
#pragma unroll
                for (int par = 0; par < 2; ++par) {
                    const unsigned sel = par ? so : se;
                    const unsigned s7 = sel & 0x7777u;
                    const unsigned hm = prmt(0x0000FF00u, 0u, (sel >> 3) & 0x1111u);  // 0xFF where code >= 8
                    ah[2 * hh + par] = lut16(s7, hm, kth[0], kth[1], kth[2], kth[3]);
                    al[2 * hh + par] = lut16(s7, hm, ktl[0], ktl[1], ktl[2], ktl[3]);
                }
            }
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
                mma_s8s8(acc[nb][m][0], ah, bf[nb].x, bf[nb].y, acc[nb][m][0]);
                mma_s8s8(acc[nb][m][1], al, bf[nb].x, bf[nb].y, acc[nb][m][1]);
            }
        }
#else
        const unsigned a0[4] = {x0 & 0x0F0F0F0Fu, x0 & 0xF0F0F0F0u, x1 & 0x0F0F0F0Fu, x1 & 0xF0F0F0F0u};
        const unsigned a1[4] = {y0 & 0x0F0F0F0Fu, y0 & 0xF0F0F0F0u, y1 & 0x0F0F0F0Fu, y1 & 0xF0F0F0F0u};
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            mma_u8s8(acc[nb][0], a0, bf[nb].x, bf[nb].y, acc[nb][0]);
            mma_u8s8(acc[nb][1], a1, bf[nb].x, bf[nb].y, acc[nb][1]);
        }
#endif
    }
    float rsc[4], tsc[4], tmn[4];  // tokens tb + 4g + [0, 4)
    ld_scales<4>(rec + OFF_RS, tb + 4 * g, rsc);
    ld_scales<4>(rec + OFF_TSTEP, tb + 4 * g, tsc);
    ld_scales<4>(rec + OFF_TMIN, tb + 4 * g, tmn);
#if KVD_QZ && KVD_VB == 2
    {
        const float c0 = __uint_as_float(KVD_VC0);
#pragma unroll
        for (int i = 0; i < 4; ++i) tmn[i] = fmaf(tsc[i], c0, tmn[i]);  // V = tok_min + tok_step c[0] + ...
    }
#endif
    // ---- online softmax and P' per head ------------------------------------------------------------------
    float fv[NB], pv[NB];  // V factor 2^(m_tile - m) max(w) / (127 LFOLD), tok_min term
    uint2 bv[NB];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        const int hd = q + 4 * nb;
        const float4 kf = kcf[hd];
        float sc[4];
#pragma unroll
        for (int m = 0; m < 2; ++m) {
#if KVD_QZ
            const float e0 = fmaf((float)(acc[nb][m][1][0] * LFOLD + acc[nb][m][1][1]), kf.y,
                                  (float)(acc[nb][m][0][0] * LFOLD + acc[nb][m][0][1]) * kf.x);
            const float e1 = fmaf((float)(acc[nb][m][1][2] * LFOLD + acc[nb][m][1][3]), kf.y,
                                  (float)(acc[nb][m][0][2] * LFOLD + acc[nb][m][0][3]) * kf.x);
            sc[2 * m] = (e0 + kf.z) * rsc[2 * m];
            sc[2 * m + 1] = (e1 + kf.z) * rsc[2 * m + 1];
#else
            sc[2 * m] = fmaf((float)(acc[nb][m][0] * LFOLD + acc[nb][m][1]), kf.x, kf.z) * rsc[2 * m];
            sc[2 * m + 1] = fmaf((float)(acc[nb][m][2] * LFOLD + acc[nb][m][3]), kf.y, kf.z) * rsc[2 * m + 1];
#endif
        }
#ifdef KVD_RUN_MAX
        // p~ against the running max m itself (<= 2^TAU): the tile's head maximum is needed only when one of the
        // warp's scores exceeds m + TAU, which every lane sees in its own scores, so the common path has no
        // reduction before the exponentials. Every lane votes (the padding heads too: their m becomes finite
        // on the first tile, and their scores, 0 from zero fragments, never exceed it again).
        const float smax = fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3]));
        if (__any_sync(0xffffffffu, smax > st.m[nb] + TAU)) {  // rare after the first tiles
            const float mn = fmaxf(st.m[nb], head_max(smax));
            const float al = ex2(st.m[nb] - mn);  // 0 on the first tile (m = -inf)
#pragma unroll
            for (int i = 0; i < NOV; ++i) st.o[nb][i] *= al;
            st.l[nb] *= al;
            st.m[nb] = mn;
        }
        const float mt = st.m[nb];
        constexpr float fm = 1.f;
#else
        const float mt = head_max(fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3])));
        if (__any_sync(0xffffffffu, hd < G && mt > st.m[nb] + TAU)) {  // rare after the first tiles
            const float mn = fmaxf(st.m[nb], mt);
            const float al = ex2(st.m[nb] - mn);  // 0 on the first tile (m = -inf)
#pragma unroll
            for (int i = 0; i < NOV; ++i) st.o[nb][i] *= al;
            st.l[nb] *= al;
            st.m[nb] = mn;
        }
        const float fm = ex2(mt - st.m[nb]);  // <= 2^TAU
#endif
        float pt[4], w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            pt[i] = ex2(sc[i] - mt);
            w[i] = pt[i] * tsc[i];
        }
        st.l[nb] = fmaf(fm, (pt[0] + pt[1]) + (pt[2] + pt[3]), st.l[nb]);
        const float wmax = head_max(fmaxf(fmaxf(w[0], w[1]), fmaxf(w[2], w[3])));
        const float rw = wmax > 0.f ? rcp(wmax) * 127.f : 0.f;
        unsigned hb[4], lb[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) two_levels(w[i] * rw, hb[i], lb[i]);
        // P' words of quad g (tokens 4g .. 4g + 3) for head q: [level][head][quad % 4][quad / 4]
#if KVD_QZ && KVD_VB == 4
        const unsigned ph = pack4(hb[0], hb[2], hb[1], hb[3]), plo = pack4(lb[0], lb[2], lb[1], lb[3]);
#else
        const unsigned ph = pack4(hb[0], hb[1], hb[2], hb[3]), plo = pack4(lb[0], lb[1], lb[2], lb[3]);
#endif
        unsigned* p = pw + nb * 64;
        p[(q * 4 + (g & 3)) * 2 + (g >> 2)] = ph;
        p[((4 + q) * 4 + (g & 3)) * 2 + (g >> 2)] = plo;
        float pm = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) pm = fmaf(pt[i], tmn[i], pm);
        pv[nb] = fm * head_sum(pm);
        fv[nb] = fm * wmax * (1.f / (127.f * LFOLD));
    }
    __syncwarp();
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)  // B fragment: column g = (head g / 2, level g % 2), quads q and 4 + q
        bv[nb] = *reinterpret_cast<const uint2*>(pw + nb * 64 + (((g & 1) * 4 + (g >> 1)) * 4 + q) * 2);
    // ---- O^T[channel][col] += V^T[channel][token] x P'[token][col] --------------------------------------
#pragma unroll
    for (int c = 0; c < VCPR; ++c) {
        unsigned r[4];
        ldsm4t(rs_ + OFF_V + (vsw ^ (16 * c)), r);
        // byte i of z = byte 2g of token 4q + i (chunk c), of zh: byte 2g + 1; z1 / zh1: tokens 16 + 4q + i
        const unsigned z0 = prmt(r[0], r[1], 0x6420u), zh0 = prmt(r[0], r[1], 0x7531u);
        const unsigned z1 = prmt(r[2], r[3], 0x6420u), zh1 = prmt(r[2], r[3], 0x7531u);
        float cs[VRUN];
        ld_scales<VRUN>(rec + OFF_COL, c * VCHC + VRUN * g, cs);
#if KVD_QZ && KVD_VB == 4
        const unsigned vth[4] = {KVD_VTH0, KVD_VTH1, KVD_VTH2, KVD_VTH3};
        const unsigned vtl[4] = {KVD_VTL0, KVD_VTL1, KVD_VTL2, KVD_VTL3};
        const float vinv = __uint_as_float(KVD_VSC);
        const unsigned zs[4] = {z0, zh0, z1, zh1};
#pragma unroll
        for (int jm = 0; jm < 2; ++jm) {  // code position: low / high nibble; rows g: channel 4g + jm, g + 8: 4g + 2 + jm
            unsigned ah[4], al[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const unsigned x = jm ? zs[k] >> 4 : zs[k];
                const unsigned sel = (x & 0x0F0Fu) | ((x >> 12) & 0xF0F0u);  // tokens 0, 2, 1, 3 of the quad
                const unsigned s7 = sel & 0x7777u;
                const unsigned hm = prmt(0x0000FF00u, 0u, (sel >> 3) & 0x1111u);
                ah[k] = lut16(s7, hm, vth[0], vth[1], vth[2], vth[3]);
                al[k] = lut16(s7, hm, vtl[0], vtl[1], vtl[2], vtl[3]);
            }
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
                const int z[4] = {0, 0, 0, 0};
                int dh[4], dl[4];
                mma_s8s8(dh, ah, bv[nb].x, bv[nb].y, z);
                mma_s8s8(dl, al, bv[nb].x, bv[nb].y, z);
                const float f = fv[nb] * vinv;
                const float v0 = fmaf((float)(dl[0] * LFOLD + dl[1]), f * (1.f / LFOLD), (float)(dh[0] * LFOLD + dh[1]) * f);
                const float v1 = fmaf((float)(dl[2] * LFOLD + dl[3]), f * (1.f / LFOLD), (float)(dh[2] * LFOLD + dh[3]) * f);
                float& o0 = st.o[nb][c * VRUN + jm];
                float& o1 = st.o[nb][c * VRUN + 2 + jm];
                o0 = fmaf(cs[jm], v0 + pv[nb], o0);
                o1 = fmaf(cs[2 + jm], v1 + pv[nb], o1);
            }
        }
#else
#pragma unroll
        for (int jm = 0; jm < VMB; ++jm) {
            // code position jm of each byte: 2-bit rows g: channel 8g + jm, g + 8: 8g + 4 + jm (x 4^jm);
            // 4-bit rows g: 4g + jm, g + 8: 4g + 2 + jm (x 16^jm)
            const unsigned mask = VB == 2 ? 0x03030303u << (2 * jm) : 0x0F0F0F0Fu << (4 * jm);
            const unsigned a[4] = {z0 & mask, zh0 & mask, z1 & mask, zh1 & mask};
            constexpr int E1 = VB == 2 ? 4 : 2;
#if KVD_QZ
            // 2-bit lloyd_max: c[k] = c[0] + a0 k + g1 bit1(k); bit 1 in place is 2 x 4^jm
            const unsigned mb1 = 0x02020202u << (2 * jm);
            const unsigned a2[4] = {z0 & mb1, zh0 & mb1, z1 & mb1, zh1 & mb1};
            const float ca = __uint_as_float(KVD_VA0), cg = __uint_as_float(KVD_VG1) * 0.5f;
#endif
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
                const int z[4] = {0, 0, 0, 0};
                int d[4];
                mma_u8s8(d, a, bv[nb].x, bv[nb].y, z);
                const float f = fv[nb] * (VB == 2 ? 1.f / (float)(1 << (2 * jm)) : 1.f / (float)(1 << (4 * jm)));
#if KVD_QZ
                int d2[4];
                mma_u8s8(d2, a2, bv[nb].x, bv[nb].y, z);
                const float v0 = fmaf((float)(d2[0] * LFOLD + d2[1]), f * cg, (float)(d[0] * LFOLD + d[1]) * (f * ca));
                const float v1 = fmaf((float)(d2[2] * LFOLD + d2[3]), f * cg, (float)(d[2] * LFOLD + d[3]) * (f * ca));
#else
                const float v0 = (float)(d[0] * LFOLD + d[1]) * f;
                const float v1 = (float)(d[2] * LFOLD + d[3]) * f;
#endif
                float& o0 = st.o[nb][c * VRUN + jm];
                float& o1 = st.o[nb][c * VRUN + E1 + jm];
                o0 = fmaf(cs[jm], v0 + pv[nb], o0);
                o1 = fmaf(cs[E1 + jm], v1 + pv[nb], o1);
            }
        }
#endif
    }
}

// --- tile split: the tiles [t0, t1) of (b, h) ----------------------------------------------------------
// The live tile count of a sequence as the kernel uses it: n_tiles clamped into [0, cap].
__device__ __forceinline__ int live_tiles(int n, int cap) { return n < 0 ? 0 : (n > cap ? cap : n); }
// Tiles of each tile block (split) of a sequence with n live tiles: one grid serves every length.
__device__ __forceinline__ int tiles_per_split(int n, int S, int min_tps) { return max(min_tps, (n + S - 1) / S); }
// A table entry clamped into the pool's record slots, so that a corrupt or stale entry reads a record, never
// outside the pool.
__device__ __forceinline__ int clamp_slot(int s, int nslots) { return s < 0 ? 0 : (s >= nslots ? nslots - 1 : s); }

template <int NB>
__device__ void tile_split(unsigned char* smem, const void* q, const unsigned char* pool, const int* table, int b,
                           int h, int Hkv, int G, int cap, int nslots, int t0, int t1, float* po, float* pm,
                           float* pl, size_t slot, bool q_bf, float scale) {
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, qq = lane & 3;
    unsigned char* ring = smem;
    unsigned* fragB = reinterpret_cast<unsigned*>(smem + SM_FRAG);
    float4* kcf = reinterpret_cast<float4*>(smem + SM_KCF);
    int4* kci = reinterpret_cast<int4*>(smem + SM_KCI);
    unsigned* pw = reinterpret_cast<unsigned*>(smem + SM_P) + w * 2 * 64;
    float* qrot = reinterpret_cast<float*>(smem + SM_Q);
    const int nloc = t1 - t0;
    const int nit = (nloc + TPI - 1) / TPI;
    const int* trow = table + (size_t)b * cap + t0;
    const unsigned char* head = pool + (size_t)h * REC;
    const size_t sstride = (size_t)Hkv * REC;
    auto slot_of = [&](int t) {  // record slot of tile t (split-relative), clamped into the pool
        return clamp_slot(t < nloc ? trow[t] : 0, nslots);
    };
    RecordCopy rc = record_copy(tid);
    FoldLane fl = fold_lane(tid);
    const unsigned ring_s = smem_u32(ring);
#ifdef KVD_Q_FIRST
    // q of this warp's heads (w + j NW) read before the ring's first copies: its loads then do not queue behind
    // the records of every block of the grid, which all start at once (the fold of tile 0 needs both)
    float qx[NB][D / 32];
#pragma unroll
    for (int j = 0; j < NB; ++j) {
        const size_t row = ((size_t)(b * Hkv + h) * G + w + j * NW) * D + lane * (D / 32);
#pragma unroll
        for (int k = 0; k < D / 32; ++k) qx[j][k] = w + j * NW < G ? ld_in(q, row + k, q_bf) : 0.f;
    }
#endif
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) {
        if (s < nit) {
#pragma unroll
            for (int jt = 0; jt < TPI; ++jt)
                if (s * TPI + jt < nloc)
                    load_record(ring_s + s * RSLOT + jt * REC, head + slot_of(s * TPI + jt) * sstride, rc, tid);
        }
        cp_async_commit();
    }
    int pre[TPI];  // slots of the next iteration to load, read one iteration ahead (hides the table read)
#pragma unroll
    for (int jt = 0; jt < TPI; ++jt) pre[jt] = slot_of((NS - 1) * TPI + jt);
    // Zero the fragments and constants once: columns of heads >= G stay 0 (finite scores, ignored).
    for (int i = tid; i < (SM_P - SM_FRAG) / 16; i += NT) reinterpret_cast<uint4*>(smem + SM_FRAG)[i] = make_uint4(0, 0, 0, 0);
    // q_rot = WHT(q) unnormalized, one warp per head
    {
        constexpr int CPL = D / 32;
#ifdef KVD_Q_FIRST
#pragma unroll
        for (int j = 0; j < NB; ++j) {
            const int gg = w + j * NW;
            if (gg < G) {
                wht_warp<CPL>(qx[j], lane);
#pragma unroll
                for (int k = 0; k < CPL; ++k) qrot[gg * D + lane * CPL + k] = qx[j][k];
            }
        }
#else
        const size_t qbase = (size_t)(b * Hkv + h) * G * D;
        for (int gg = w; gg < G; gg += NW) {
            float x[CPL];
#pragma unroll
            for (int k = 0; k < CPL; ++k) x[k] = ld_in(q, qbase + gg * D + lane * CPL + k, q_bf);
            wht_warp<CPL>(x, lane);
#pragma unroll
            for (int k = 0; k < CPL; ++k) qrot[gg * D + lane * CPL + k] = x[k];
        }
#endif
    }
    constexpr float LOG2E = 1.4426950408889634f;
    const float kscale = scale * LOG2E * rsqrtf((float)D);
#if KVD_QZ
    const float kfac = kscale * (1.f / (127.f * LFOLD)) * __uint_as_float(KVD_KSC);
#else
    const float kfac = kscale * (1.f / (127.f * LFOLD));
#endif
    WarpState<NB> st;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        st.m[nb] = neg_inf();
        st.l[nb] = 0.f;
#pragma unroll
        for (int i = 0; i < NOV; ++i) st.o[nb][i] = 0.f;
    }
    const int jw = w / WPT, kc = w % WPT, tb = 32 * kc;
    const int rr = ldsm_row(lane);
    const int koff = OFF_K + 16 * swz<KCPR>(rr * KCPR + kc);
    const int vsw = 16 * swz<VCPR>((tb + rr) * VCPR);
    int rs = 0, ws = NS - 1;  // ring slots of iteration it and of it + NS - 1
    for (int it = 0; it < nit; ++it) {
        cp_async_wait<NS - 2>();
        __syncthreads();  // iteration it landed for every thread; everyone is done with it - 1
#ifdef KVD_TRACE
        if (it == 0) KVD_MARK(2);
#endif
        {
            const int nx = it + NS - 1;
            if (nx < nit) {
                // the copy's offsets are held in registers, not recomputed from tid every iteration
                asm volatile("" : "+r"(rc.plain), "+r"(rc.kdst), "+r"(rc.vdst), "+r"(rc.t16));
                const unsigned dst = ring_s + ws * RSLOT;  // slot (it + NS - 1) % NS = (it - 1) % NS: free now
#pragma unroll
                for (int jt = 0; jt < TPI; ++jt)
                    if (nx * TPI + jt < nloc) load_record(dst + jt * REC, head + pre[jt] * sstride, rc, tid);
#pragma unroll
                for (int jt = 0; jt < TPI; ++jt) pre[jt] = slot_of((nx + 1) * TPI + jt);
            }
            cp_async_commit();
        }
        const unsigned char* sl = ring + rs * RSLOT;
        rs = rs + 1 == NS ? 0 : rs + 1;
        ws = ws + 1 == NS ? 0 : ws + 1;
        const int ntl = min(TPI, nloc - it * TPI);
        asm volatile("" : "+r"(fl.c0[0]), "+r"(fl.frag[0]));  // kept in registers, as rc above
        fold_tiles(sl, ntl, G, qrot, fragB, kcf, kci, kfac, kscale, tid, fl);
        __syncthreads();
        if (jw < ntl)
            warp_tile<NB>(st, sl + jw * REC, fragB + jw * 2 * KS * FRAG_WORDS, kcf + jw * 8, kci + jw * 8, pw, koff, vsw,
                          tb, G, lane);
    }
    KVD_MARK(3);
    cp_async_wait<0>();
    __syncthreads();  // the ring is free: merge the four warps there
    float* mw = reinterpret_cast<float*>(ring);  // [NW][8]
    float* lw = mw + NW * 8;                     // [NW][8]
    float* ow = lw + NW * 8;                     // [NW][8][D]
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        const int hd = qq + 4 * nb;
        const float l = head_sum(st.l[nb]);
        if (g == 0) { mw[w * 8 + hd] = st.m[nb]; lw[w * 8 + hd] = l; }
#pragma unroll
        for (int c = 0; c < VCPR; ++c)
#pragma unroll
            for (int e = 0; e < VRUN; ++e) ow[(w * 8 + hd) * D + c * VCHC + VRUN * g + e] = st.o[nb][c * VRUN + e];
    }
    __syncthreads();
    for (int i = tid; i < G * D; i += NT) {
        const int gg = i / D, c = i % D;
        float M = neg_inf();
#pragma unroll
        for (int k = 0; k < NW; ++k) M = fmaxf(M, mw[k * 8 + gg]);
        float o = 0.f;
#pragma unroll
        for (int k = 0; k < NW; ++k) o += exp2f(mw[k * 8 + gg] - M) * ow[(k * 8 + gg) * D + c];  // idle warp: m = -inf
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

// --- the last block of (b, h): merge the S + E partials, inverse WHT, normalize, store -----------------------
// One warp per head (heads w, w + 4): lane l holds channels [l * CPL, (l + 1) * CPL). At small batch this
// block's L2 round trips are on the step's latency chain (the rest of the GPU is idle), so they are few: the
// partial rows go in batches of at most MB rows through the warp's quarter of the (now free) shared memory by
// cp.async, two batches in flight, the m and l of each block of 32 rows loaded with its first batch, and each
// range (tile part j < S, exact part j >= S) keeps a running max, moved once per block of 32, so no pass over
// the maxima comes first. At D = 128 (MB = 12) and S + E = 65: 7 batches, two at a time, where rows loaded
// into registers 8 at a time after a pass over the maxima took about 12 dependent round trips. A partial with
// m = -inf (an empty split) never wrote its row: its weight 0 is applied by a select, because the stale row
// may hold anything (pl is always written).
constexpr int MERGE_REGION = SMEM / NW / 16 * 16;                    // bytes of shared memory per warp
constexpr int MERGE_ROWS = MERGE_REGION / (2 * D * 4) < 32 ? MERGE_REGION / (2 * D * 4) : 32;  // MB
static_assert(MERGE_ROWS >= 4, "two batches of partial rows per warp must fit in shared memory");

// Lane's CPL channels of a partial row in shared memory.
template <int CPL>
__device__ __forceinline__ void merge_row(const float* row, float (&v)[CPL]) {
    if constexpr (CPL % 4 == 0) {
#pragma unroll
        for (int q4 = 0; q4 < CPL / 4; ++q4) {
            const float4 x = reinterpret_cast<const float4*>(row)[q4];
            v[4 * q4] = x.x, v[4 * q4 + 1] = x.y, v[4 * q4 + 2] = x.z, v[4 * q4 + 3] = x.w;
        }
    } else {
        const float2 x = *reinterpret_cast<const float2*>(row);
        v[0] = x.x, v[1] = x.y;
    }
}

// Partial rows j < n of one head added per range (rows j < S the tile range, the others the exact range): m and
// l of row j at i0 + j G, its D channels at (i0 + j G) D. Out: each range's max M and L (the lane's share, for
// the caller to sum over the warp) and the lane's CPL channels of o. buf / buf_s: the warp's shared memory.
template <int CPL>
__device__ __forceinline__ void merge_head(float* buf, unsigned buf_s, const float* po, const float* pm,
                                           const float* pl, size_t i0, int n, int S, int G, int lane, bool mark,
                                           float& Mt_out, float& Me_out, float& Lt_out, float& Le_out,
                                           float (&ot)[CPL], float (&oe)[CPL]) {
    constexpr int CH = D / 4, MB = MERGE_ROWS;  // CH: 16-byte chunks of a row
    // Rows go in blocks of 32 (lane r holds row 32 blk + r's m and l, loaded with the block's first batch),
    // each block in BPB batches of at most MB rows; batch k (block k / BPB) is copied into buf[k % 2].
    // The running max moves once per block, so the sums do not depend on MB (a variant's shared memory).
    constexpr int BPB = (32 + MB - 1) / MB;
    const int nbat = (n / 32) * BPB + (n % 32 + MB - 1) / MB;
    float m_next = neg_inf(), l_next = 0.f;
    auto issue = [&](int k) {
        const int blk = k / BPB, j0 = 32 * blk + (k % BPB) * MB, cnt = min(min(MB, 32 * blk + 32 - j0), n - j0);
        const unsigned dst = buf_s + (k & 1) * MB * D * 4;
        // Unrolled over the batch's chunks: chunk lane + 32 i is row RI i + lr's chunk CI i + lc, so the lane's
        // addresses are set once a batch and each copy adds a constant (a row is G D floats after the last).
        constexpr int RI = CH >= 32 ? 0 : 32 / CH;  // rows per copy instruction (CH < 32) ...
        constexpr int CI = CH >= 32 ? 32 : 0;       // ... or chunks of one row (CH >= 32)
        const int lr = CH >= 32 ? 0 : lane / CH, lc = CH >= 32 ? lane : lane % CH;
        const size_t row_stride = (size_t)G * D;
        const float* src = po + (i0 + (size_t)(j0 + lr) * G) * D + lc * 4;
        const unsigned dst_l = dst + (lr * D + lc * 4) * 4;
#pragma unroll
        for (int i = 0; i < (MB * CH + 31) / 32; ++i) {
            const int r = CH >= 32 ? CI * i / CH : RI * i, c = CH >= 32 ? CI * i % CH : 0;
            if (r + lr < cnt) cp_async16_u32(dst_l + (r * D + c * 4) * 4, src + r * row_stride + c * 4);
        }
        cp_async_commit();
        if (k % BPB == 0) {
            const int j = 32 * blk + lane;
            m_next = j < n ? __ldcg(pm + i0 + (size_t)j * G) : neg_inf();
            l_next = j < n ? __ldcg(pl + i0 + (size_t)j * G) : 0.f;
        }
    };
    issue(0);
    // per range a running max M (online, as the tile loop's softmax: no pass over the maxima first) and
    // L = sum_j 2^(m_j - M) l_j, o = sum_j 2^(m_j - M) o_j
    float Mt = neg_inf(), Me = neg_inf(), Lt = 0.f, Le = 0.f, wj = 0.f;
#pragma unroll
    for (int k = 0; k < CPL; ++k) ot[k] = oe[k] = 0.f;
    for (int k = 0; k < nbat; ++k) {
        const int blk = k / BPB, j0 = 32 * blk + (k % BPB) * MB, cnt = min(min(MB, 32 * blk + 32 - j0), n - j0);
        if (k % BPB == 0) {  // a new block of 32 rows: its weights (before issue(k + 1) may load the next's)
            const float mj = m_next, lj = l_next;
            const bool tile_l = 32 * blk + lane < S;
            const float nt = fmaxf(Mt, group_max<32>(tile_l ? mj : neg_inf()));
            const float ne = fmaxf(Me, group_max<32>(tile_l ? neg_inf() : mj));
            const float st = Mt == neg_inf() ? 0.f : exp2f(Mt - nt), se = Me == neg_inf() ? 0.f : exp2f(Me - ne);
            Mt = nt, Me = ne;
            Lt *= st, Le *= se;
#pragma unroll
            for (int e = 0; e < CPL; ++e) ot[e] *= st, oe[e] *= se;
            wj = mj == neg_inf() ? 0.f : exp2f(mj - (tile_l ? Mt : Me));
            if (tile_l) Lt = fmaf(wj, lj, Lt);
            else Le = fmaf(wj, lj, Le);  // (lanes past n add 0 x 0)
        }
        if (k + 1 < nbat) issue(k + 1);
        else cp_async_commit();  // an empty group: batch k is then always the second newest
        cp_async_wait<1>();
        __syncwarp();  // every lane's copies of batch k are visible to the warp
        if (k == 0 && mark) KVD_TIME(18);
        const float* rows = buf + (k & 1) * MB * D + lane * CPL;
#pragma unroll 2
        for (int r = 0; r < cnt; ++r) {
            const float wgt = __shfl_sync(0xffffffffu, wj, (j0 + r) & 31);
            const bool tile = j0 + r < S;
            const float wt = tile ? wgt : 0.f, we = tile ? 0.f : wgt;
            float v[CPL];
            merge_row<CPL>(rows + r * D, v);
#pragma unroll
            for (int e = 0; e < CPL; ++e) {
                ot[e] = wt != 0.f ? fmaf(wt, v[e], ot[e]) : ot[e];
                oe[e] = we != 0.f ? fmaf(we, v[e], oe[e]) : oe[e];
            }
        }
        __syncwarp();  // buf[k % 2] is read before batch k + 2 is copied into it
    }
    cp_async_wait<0>();
    // sums kept in locals and copied out once: written through the references inside the loop, ptxas allocates
    // the merge's registers differently (same instructions, other SASS) than for the measured kernel
    Mt_out = Mt, Me_out = Me, Lt_out = Lt, Le_out = Le;
}

// The last block of (b, h): partials [base, base + n) of the pair (rows < S the tile range) merged per head,
// the tile range's inverse WHT, both ranges normalized together, out [B, Hkv G, 1, D] written.
__device__ void final_merge(unsigned char* smem, const float* po, const float* pm, const float* pl, void* out,
                            int b, int h, int Hkv, int G, size_t base, int n, int S, bool out_bf) {
    constexpr int CPL = D / 32;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    float* buf = reinterpret_cast<float*>(smem + w * MERGE_REGION);  // [2][MB][D]
    const unsigned buf_s = smem_u32(buf);
    cp_async_wait<0>();
    __syncwarp();
    for (int gg = w; gg < G; gg += NW) {
        float Mt, Me, Lt, Le, ot[CPL], oe[CPL];
        merge_head<CPL>(buf, buf_s, po, pm, pl, base * G + gg, n, S, G, lane, gg == w, Mt, Me, Lt, Le, ot, oe);
        if (gg == w) KVD_TIME(19);
        Lt = group_sum<32>(Lt);
        Le = group_sum<32>(Le);
        wht_warp<CPL>(ot, lane);  // the deferred inverse WHT of the tile part (1 / sqrt(D) below)
        const float M = fmaxf(Mt, Me);
        const float wt = Mt == neg_inf() ? 0.f : exp2f(Mt - M);
        const float we = Me == neg_inf() ? 0.f : exp2f(Me - M);
        const float den = wt * Lt + we * Le;
        const float inv = den > 0.f ? 1.f / den : 0.f;  // no token at all: zeros
        const float wtr = wt * rsqrtf((float)D);
        const size_t ob = ((size_t)(b * Hkv + h) * G + gg) * D + lane * CPL;
#pragma unroll
        for (int k = 0; k < CPL; ++k) {
            const float r = (wtr * ot[k] + we * oe[k]) * inv;
            if (out_bf) reinterpret_cast<__nv_bfloat16*>(out)[ob + k] = __float2bfloat16(r);
            else reinterpret_cast<__half*>(out)[ob + k] = __float2half(r);
        }
        if (gg == w) KVD_TIME(20);
    }
}

#ifdef KVD_MERGE_GROUP
// Splits per merge group (KVD_MERGE_GROUP, decode.DecodeVariant.merge_group, A/B runs): the last block of a group
// merges the group's rows while other groups still run, so the pair's last block merges one row per group.
constexpr int MERGE_GROUP = KVD_MERGE_GROUP;

// The last block of a group: the group's partial rows [base, base + n) of the pair, all of one range (tile: the
// WHT domain, kept), merged per head into row dst as a split writes its partial (the range's max m, l, and the
// unnormalized o), so that the final merge takes it as one more partial of that range.
__device__ void group_merge(unsigned char* smem, float* po, float* pm, float* pl, size_t base, int n, bool tile,
                            size_t dst, int G) {
    constexpr int CPL = D / 32;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    float* buf = reinterpret_cast<float*>(smem + w * MERGE_REGION);
    const unsigned buf_s = smem_u32(buf);
    cp_async_wait<0>();
    __syncwarp();
    for (int gg = w; gg < G; gg += NW) {
        float Mt, Me, Lt, Le, ot[CPL], oe[CPL];
        merge_head<CPL>(buf, buf_s, po, pm, pl, base * G + gg, n, tile ? n : 0, G, lane, false, Mt, Me, Lt, Le, ot,
                        oe);
        const float L = group_sum<32>(tile ? Lt : Le);
        const size_t i = dst * G + gg;
        float* row = po + i * D + lane * CPL;
#pragma unroll
        for (int e = 0; e < CPL; ++e) row[e] = tile ? ot[e] : oe[e];
        if (lane == 0) pm[i] = tile ? Mt : Me, pl[i] = L;
    }
}
#endif

// Block (split, h, b) of the block order (the grid comment at the top). The block index is read with volatile
// moves, so that a second call recomputes it instead of holding it in registers in between.
__device__ __forceinline__ void block_coords(int S, int E, int Hkv, bool exact_last, int& split, int& h, int& b) {
    unsigned x, y, z, nz;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(x));
    asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(y));
    asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
    asm volatile("mov.u32 %0, %%nctaid.z;" : "=r"(nz));
    if (!exact_last) {
        split = (int)x, h = (int)y, b = (int)z;
        return;
    }
    const int lin = (int)x + (S + E) * ((int)y + Hkv * (int)z), tile_blocks = S * Hkv * (int)nz;
    const bool tile = lin < tile_blocks;
    const int r = tile ? lin : lin - tile_blocks, n = tile ? S : E, pair = r / n;
    split = (tile ? 0 : S) + r % n, h = pair % Hkv, b = pair / Hkv;
}

#if defined(KVD_PREFETCH) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
static_assert(KVD_PREFETCH >= 1 && KVD_PREFETCH <= NT, "one thread asks for each prefetched record");
// A tile block that becomes resident while the previous kernel still runs (programmatic dependent launch: at a
// layer boundary, the previous layer's final merges or the step's append) asks L2 for the records of its first
// KVD_PREFETCH tiles, one bulk prefetch each, so that its ring's first copies find them there once the wait
// is over instead of all blocks' first copies reaching DRAM at once. A prefetch is only a hint: the tile count
// and table entries it reads may still be written by the previous kernel (relaxed loads at GPU scope, which
// leave no L1 line behind; a stale value prefetches another record, whose slot is clamped into the pool like
// the ring's), and nothing read here is used after the wait.
__device__ __forceinline__ void prefetch_first_records(const unsigned char* pool, const int* table, const int* n_tiles,
                                                       int Hkv, int cap, int nslots, int S, int E, int min_tps,
                                                       bool exact_last) {
    const int tid = threadIdx.x;
    if (tid >= KVD_PREFETCH) return;
    int split, h, b;
    block_coords(S, E, Hkv, exact_last, split, h, b);
    if (split >= S) return;
    int n;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(n) : "l"(n_tiles + b));
    n = live_tiles(n, cap);
    const int tps = tiles_per_split(n, S, min_tps), t = split * tps + tid;
    if (tid >= tps || t >= n) return;
    int s;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(s) : "l"(table + (size_t)b * cap + t));
    s = clamp_slot(s, nslots);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(pool + ((size_t)s * Hkv + h) * REC), "r"(REC)
                 : "memory");
}
#endif

// Partial rows per (b, h) in po, pm, pl: the S + E blocks' (the tile splits', then the exact blocks'), and with
// KVD_MERGE_GROUP one per group of splits (the tile part's groups, then the exact part's).
__device__ __forceinline__ int pair_rows(int S, int E) {
#ifdef KVD_MERGE_GROUP
    return S + E + (S + MERGE_GROUP - 1) / MERGE_GROUP + (E + MERGE_GROUP - 1) / MERGE_GROUP;
#else
    return S + E;
#endif
}

// Releases the block's writes and takes one of the count tickets of *ticket; last (shared memory) is then nonzero
// in the block that took the last one, in every thread, and that block has acquired the other blocks' writes.
// mark: the trace's mark 16 (the barrier before the atomic passed).
__device__ __forceinline__ void ticket_take(int* ticket, int count, bool mark, int tid, int& last) {
    // Thread 0 alone releases and acquires (the pattern of CUTLASS's generic barrier): the first barrier orders
    // every thread's writes before its atomic, whose release is cumulative over them, and the second orders its
    // acquire before the other threads' reads of the merge (through L2: ld.cg, cp.async.cg). One atomic at GPU
    // scope instead of an SC fence (MEMBAR.SC.GPU with an L1 invalidation) by every thread on each side of the
    // ticket: 0.5 us less at b1/4k (docs/perf-notes.md, "Twenty-fifth session").
    __syncthreads();
    if (mark) KVD_TIME(16);
    if (tid == 0) {
        int before;
        asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(before) : "l"(ticket) : "memory");
        last = before == count - 1;
    }
    __syncthreads();
}

// In the block that took the last ticket: the ticket reset for the next launch (stream-ordered after this one).
__device__ __forceinline__ void ticket_reset(int* ticket, int tid) {
    if (tid == 0) *ticket = 0;
}

// flags: bit 0 = q (and out) bf16, bit 1 = window/sink bf16, bit 2 = the exact blocks after every tile block.
template <int NB>
__device__ __forceinline__ void decode_block(const void* q, const unsigned char* pool, const int* table,
                                             const void* win_k, const void* win_v, const void* sink_k,
                                             const void* sink_v, const int* n_tiles, const int* win_len,
                                             const int* sink_len, float* po, float* pm, float* pl, int* tickets,
                                             void* out, int Hkv, int G, int cap, int nslots, int W, int SC, int S,
                                             int E, int min_tps, int flags, float scale) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ int last;
    KVD_MARK(0);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // Programmatic dependent launch (decode.py, $KVARN_DECODE_PDL): the grid may become resident while the
    // previous kernel of the stream (the step's append, another layer's decode sharing the workspace) still
    // runs. Nothing is read before it completed; the next kernel may then be launched at once, since it too
    // waits before reading. Without the launch attribute both are no-ops.
#ifdef KVD_PREFETCH
    prefetch_first_records(pool, table, n_tiles, Hkv, cap, nslots, S, E, min_tps, (flags & 4) != 0);
#endif
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
    KVD_MARK(1);
    const int tid = threadIdx.x;
    int split, h, b;
    block_coords(S, E, Hkv, (flags & 4) != 0, split, h, b);
    const size_t slot = ((size_t)(b * Hkv + h) * pair_rows(S, E) + split) * G;
    const bool q_bf = flags & 1;
    constexpr float LOG2E = 1.4426950408889634f;
    if (split >= S) {
        exact_part(smem, q, win_k, win_v, sink_k, sink_v, win_len, sink_len, po, pm, pl, slot, b, h, Hkv, G, W, SC,
                   split - S, q_bf, (flags & 2) != 0, scale * LOG2E);
    } else {
        const int n = live_tiles(n_tiles[b], cap);
        const int tps = tiles_per_split(n, S, min_tps);
        const int t0 = split * tps, t1 = min(n, t0 + tps);
        if (t0 < t1) {
            tile_split<NB>(smem, q, pool, table, b, h, Hkv, G, cap, nslots, t0, t1, po, pm, pl, slot, q_bf, scale);
        } else if (tid < G) {
            pm[slot + tid] = neg_inf();
            pl[slot + tid] = 0.f;
        }
    }
    KVD_MARK(4);
    block_coords(S, E, Hkv, (flags & 4) != 0, split, h, b);  // recomputed: held through the tile loop they cost registers
    // ---- ticket: the last of the S + E blocks of (b, h) merges (with KVD_MERGE_GROUP: the last of each group of
    // splits merges the group's partials into one row, and the last of those merges the pair's group rows)
#ifdef KVD_MERGE_GROUP
    const int ngt = (S + MERGE_GROUP - 1) / MERGE_GROUP, ng = ngt + (E + MERGE_GROUP - 1) / MERGE_GROUP;
    const bool tile_part = split < S;
    const int grp = tile_part ? split / MERGE_GROUP : ngt + (split - S) / MERGE_GROUP;
    const int j0 = tile_part ? split - split % MERGE_GROUP : split - (split - S) % MERGE_GROUP;
    int* const pair_tickets = tickets + (size_t)(b * Hkv + h) * (1 + ng);  // [0] the pair's, [1 + k] group k's
    int* const ticket = pair_tickets + 1 + grp;
    const int count = min(MERGE_GROUP, (tile_part ? S : S + E) - j0);
#else
    int* const ticket = tickets + b * Hkv + h;
    const int count = S + E;
#endif
    ticket_take(ticket, count, true, tid, last);
    KVD_MARK(5);
#ifdef KVD_TRACE
    {
        const int n = live_tiles(n_tiles[b], cap), tps = tiles_per_split(n, S, min_tps);
        const int tiles = split < S ? max(0, min(n, split * tps + tps) - split * tps) : 0;
        trace_info((unsigned long long)tiles << 16 | (unsigned long long)(split >= S) << 32 |
                   (unsigned long long)(last != 0) << 33);
    }
#endif
    if (!last) return;
    ticket_reset(ticket, tid);
    KVD_TIME(17);
    const size_t pair = (size_t)(b * Hkv + h) * pair_rows(S, E);
#ifdef KVD_MERGE_GROUP
    group_merge(smem, po, pm, pl, pair + j0, count, tile_part, pair + S + E + grp, G);
    ticket_take(pair_tickets, ng, false, tid, last);
    if (!last) {
        KVD_MARK(6);  // a group's merge done (the trace's merging blocks are the groups' last blocks)
        return;
    }
    ticket_reset(pair_tickets, tid);
    final_merge(smem, po, pm, pl, out, b, h, Hkv, G, pair + S + E, ng, ngt, q_bf);
#else
    final_merge(smem, po, pm, pl, out, b, h, Hkv, G, pair, S + E, S, q_bf);
#endif
    KVD_MARK(6);
}

}  // namespace kvd

using namespace kvd;

#define KVD_ENTRY(NBV)                                                                                             \
    extern "C" __global__ void __launch_bounds__(NT, minb<NBV>()) KVD_NAME(kvarn_decode_n##NBV##_)(                      \
        const void* __restrict__ q, const unsigned char* __restrict__ pool, const int* __restrict__ table,        \
        const void* __restrict__ win_k, const void* __restrict__ win_v, const void* __restrict__ sink_k,          \
        const void* __restrict__ sink_v, const int* __restrict__ n_tiles, const int* __restrict__ win_len,         \
        const int* __restrict__ sink_len, float* po, float* pm, float* pl, int* tickets, void* out, int Hkv, int G, \
        int cap, int nslots, int W, int SC, int S, int E, int min_tps, int flags, float scale) {                  \
        decode_block<NBV>(q, pool, table, win_k, win_v, sink_k, sink_v, n_tiles, win_len, sink_len, po, pm, pl,    \
                          tickets, out, Hkv, G, cap, nslots, W, SC, S, E, min_tps, flags, scale);                   \
    }
KVD_ENTRY(1)  // G <= 4: one n-block of 4 heads
KVD_ENTRY(2)  // G <= 8
#undef KVD_ENTRY

// What the host needs to launch: dynamic shared memory per block, tokens per exact block.
extern "C" __device__ const int KVD_NAME(kvarn_decode_layout_)[2] = {SMEM, TE};
