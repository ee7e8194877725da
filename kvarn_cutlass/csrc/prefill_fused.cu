// Fused chunked-prefill attention over a KVarN cache (NVRTC; mma.sync m16n8k16, sm_80+).
//
// One launch per chunk and layer. A CTA owns BM = CONSUMER_WARPS * ROWS_PER_WARP query rows of one
// (sequence b, KV head h); row r = j * n + i is query i of q head h * G + j (the rows of a KV head are
// its G q heads one after another, a free view of q [B, Hq, n, D]). Every score stays on chip.
//
// What a chunk's queries see (kvarn_cutlass.reference.attention with the chunk passed in): the
// cache's tiles (all older than the chunk), then the exact tokens E = [sink | window | chunk] in the
// cache dtype, causal inside the chunk (query i sees chunk token j <= i). Two phases share one online
// softmax (running max m and sum l per row, in units of log2; `rowf` turns a raw dot product into one).
//
// Warp specialization: CONSUMER_WARPS warps compute, 4 producer warps stage operands (as one group, or
// as two groups of 2 warps taking alternate tiles, so one group's per-tile work, the record's scale
// reductions, overlaps the other's dequantization). The work is one
// sequence of BLOCK_N-token blocks (the tiles' blocks, then the exact tokens' blocks) through a
// three-stage ring of shared-memory buffers; barriers FULL[s] (producers -> consumers) and EMPTY[s]
// (consumers -> producers) hand each stage over (StageHandoff), so dequantization overlaps the MMAs.
//
// Phase A, tiles (rotated domain). q_rot = WHT(q) in f32, scaled per row by a power of two s_r so that
// max|q_rot| lies in [2^7, 2^8), rounded to f16. The producers copy each record into a ring of RSLOTS
// slots (cp.async, each group one of its tiles ahead) and dequantize it block by block into f16 operands:
//   K: kd[c][t] = f16(f16(chan_min' + chan_step' * kbook[code]) * f16(rs'[t]))   (f16 scales; f32 scales:
//      f32 math, one rounding), channel-major, with chan_*' = chan_* * 2^-ek and rs'[t] = row_scale[t] *
//      2^-er <= 1 (the row scale is in the operand: the consumers multiply nothing per token);
//      score[r][t] = (q_rot[r] . kd[:, t]) * fK * scale * log2(e) / s_r, tile factor fK = 2^(ek + er)
//   V: vd[t][c] = f16(f16(tok_min' + tok_step' * vbook[code]) * f16(col_scale[c] * 2^-ec))   (f16 scales;
//      f32 scales: f32 math, one rounding) with tok_*' = tok_* * 2^-ev; V[t][c] = fV * vd[t][c], tile
//      factor fV = 2^eV, eV = ec + ev (a power of two: 2^ec > max_c col_scale)
// ek, ev, er, ec chosen per tile from the record's scales so that |kd|, |vd| < 2^15: the f16 operands
// never overflow whatever the magnitudes (the tile factors stay in f32 / as exponents). The accumulator
// is kept in units of fV_run = 2^eV_run, the largest tile factor so far: P' = p * 2^-(eV_run - eV) <= 1
// is the f16 MMA operand (the power of two is folded into the exponential's argument, and the row sum
// gets the p back by one multiply per row), and when a tile raises eV_run the accumulator is rescaled by
// 2^(old - new) (<= 1; nothing can overflow). After the tiles the consumers multiply the accumulator by
// fV_run and rotate it back (inverse WHT in registers). kvarn_cutlass.prefill._emulate does the same
// arithmetic in torch.
//
// Phase B, exact tokens (original domain): q scaled per row by a power of two (|q| < 2^8) in the cache
// dtype; the producers copy K and V blocks (cp.async) from the sink, window and chunk buffers, token by
// token (a block may straddle them); P in the cache dtype.
//
// Output: acc / l in q's dtype, [B, Hq, n, D] with element strides.
//
// MMA kind (WGMMA): 0, mma.sync m16n8k16 per consumer warp from ldmatrix fragments (sm_80+); 1, wgmma
// (sm_90a, CuTe's SM90 GMMA atoms) per consumer warpgroup of 64 rows: S = Q . K^T with both operands in
// shared memory (N = BLOCK_N), O += P . V with P from registers (the S accumulator re-packed, as in
// FlashAttention 3; N = D, up to 256 in one instruction). At D=256 the blocks are 32 tokens and the ring
// three stages (64 KB of Q rows for two warpgroups), or 64 tokens and two stages (two consumer warpgroups,
// where the records leave room: half the score MMAs' re-reads of Q), one producer warpgroup, and with two consumer
// warpgroups the roles trade registers (a 64 x 256 f32 accumulator is 128 registers a consumer thread).
// The wgmma operands sit in the canonical no-swizzle core-matrix layout (8 rows x 16 bytes, contiguous):
// Q and the exact K are K-major, the dequantized tile K and every V are MN-major (see the *_off helpers);
// the producers write that layout directly, and fence the generic-proxy stores for the async proxy.
// Q_REGS (wgmma only): each consumer warpgroup loads its rotated query rows once, after staging them, into
// registers as the m64k16 A fragments (D / 4 registers a thread), and the tile phase's S = Q . K^T runs RS:
// with both operands in shared memory a 64 x 64 x 16 score MMA reads 4 KB for 128 KFLOP, the SM's shared-
// memory rate, and K alone is half of that. The exact phase (a few blocks per CTA) stays SS.
//
// Compile-time parameters (defines from kvarn_cutlass.ops.prefill.fused_spec; the record layout from
// format.TileSpec): HEAD_DIM, TILE_TOKENS, V_BITS, SCALE_F32, CACHE_BF16, Q_BF16, LLOYD_MAX,
// K_CODEBOOK, V_CODEBOOK, K_CB_LIMIT, V_CB_LIMIT, ROWS_PER_WARP, CONSUMER_WARPS, PRODUCER_WARPS,
// PRODUCER_GROUPS, BLOCK_N, WGMMA, OFF_* and RECORD_BYTES,
// KERNEL_NAME, MERGE_NAME; K_INT8 (default 0): the int8 K operand of prefill_int8.cuh instead of f16 tile K (mma.sync);
// Q_REGS (default 0): the tile phase's Q as wgmma register fragments (above).
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include "record_scales.cuh"
#include "wht_lanes.cuh"

#ifndef K_INT8
#define K_INT8 0
#endif
#ifndef Q_REGS
#define Q_REGS 0
#endif

#if WGMMA
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#if !defined(CUTE_ARCH_MMA_SM90A_ENABLED)
#error "WGMMA=1 needs the sm_90a target (CuTe's GMMA atoms compile to nothing elsewhere)"
#endif
#endif

typedef unsigned char u8;
typedef unsigned int u32;

constexpr int D = HEAD_DIM;
constexpr int T = TILE_TOKENS;
constexpr int VB = V_BITS;
constexpr int RPW = ROWS_PER_WARP;
constexpr int NC = CONSUMER_WARPS;    // consumer warps (4 or 8)
constexpr int NP = PRODUCER_WARPS;    // producer warps (4 or 8: one or two warpgroups)
constexpr int BN = BLOCK_N;
constexpr int NT = (NC + NP) * 32;    // threads
constexpr int PT = NP * 32;           // producer threads
constexpr int NG = PRODUCER_GROUPS;   // producer groups (1 or 2), each its own tiles
constexpr int GT = PT / NG;           // threads of a producer group
constexpr int BM = NC * RPW;          // rows per CTA
constexpr int MT = RPW / 16;          // m16 tiles per warp
constexpr int SN = BN / 8;            // n8 tiles of a score block
constexpr int ON = D / 8;             // n8 tiles of the output
// mma.sync: padded rows against ldmatrix bank conflicts; wgmma: dense core matrices
constexpr int QS = WGMMA ? D : D + 8;    // row stride (halves) of Q and token-major K/V buffers
constexpr int KS = WGMMA ? BN : BN + 8;  // row stride (halves) of the channel-major dequantized K
constexpr int REC = RECORD_BYTES;
constexpr int BPT = T / BN;           // blocks per tile
// stages of the producer -> consumer ring: with two producer groups, each group owns the stages of its
// tiles' blocks (tile g's blocks go to group g % 2); wgmma's consumers hold two stages at a time (a
// block's scores and the previous block's pending P . V), so one more keeps the producers as far ahead,
// except at D=256, where a fourth 32 KB stage does not fit beside 64 KB of Q rows and the record ring, and
// 64-token blocks there have two 64 KB stages (218-232 KB in all; over the limit beside 128-token records of
// 4-bit V or with float32 scales and Lloyd-Max, which the launcher refuses by the exported layout size)
constexpr int NSTAGE = NG == 1 ? (WGMMA && D <= 128 ? 4 : (D == 256 && BN == 64 ? 2 : 3)) : NG * BPT;
// blocks past the one whose stage the consumers free that they read first: wgmma's consumers release a
// block after the turn that issues the next block's scores beside its P . V; mma.sync's right after it
constexpr int CONSUMER_HOLD = WGMMA ? 1 : 0;

static_assert(RPW == 16 || RPW == 32, "ROWS_PER_WARP is 16 or 32");
static_assert(NC == 4 || NC == 8, "CONSUMER_WARPS is 4 or 8");
static_assert(NP == 4 || (NP == 8 && WGMMA), "PRODUCER_WARPS is 4, or 8 with wgmma");
// The warpgroups trade registers (setmaxnreg) from the CTA's pool, what the launch allocated (65536 / NT per
// thread, in steps of 8: 128 for 512 threads, 168 for 384): the consumers' accumulators need more than the
// producers' dequantization. 512 threads: two producer and two consumer warpgroups. D=256 under wgmma with
// two consumer warpgroups (384 threads): a consumer thread holds 128 accumulator registers (64 x 256 f32
// over the warpgroup), 16 of S and 8 of P for a 32-token block, more than 168; 2 x 200 + 104 = 504, of which
// ptxas uses up to R196 in the consumers (the tight spot: the inverse WHT of the accumulator after the tiles)
// and R101 in the producers over the D=256 variants (docs/perf-notes.md: the splits tried). With 64-token blocks
// (32 registers of S) the consumers spill 16 bytes at 200; 2 x 208 + 88 holds both roles with no spill.
// Q_REGS at D=128 with two consumer warpgroups and one producer warpgroup (384 threads): the Q fragments (32
// registers) put the consumers over the launch's 168 (ptxas: R0-R168 at 184, producers up to R113 at 136; at
// 168 the consumers spill and ptxas serializes the wgmmas); 2 x 184 + 136 = 504. At D=64 (16 registers) every
// wgmma config fits as it is; with two producer warpgroups at D=128 the consumers' share of 512 x 128 is too
// small (168 spilled 64 bytes, 152 220), so kvarn_cutlass.ops.prefill.FusedConfig.fits refuses those.
// Two producer groups (512 threads, D <= 128): 2 x 112 + 2 x 144. The producers spilled ~100 bytes in their
// per-tile and per-block code at 104; 144 holds the consumers with a P . V in flight during the softmax.
constexpr bool QR_TRADE = Q_REGS && D == 128 && NC == 8 && NP == 4;
constexpr int QR_CONSUMER_REGS = 184, QR_PRODUCER_REGS = 136;
constexpr bool REG_TRADE = NT == 512 || (WGMMA && D == 256 && NC == 8) || QR_TRADE;
constexpr int LAUNCH_REGS = 65536 / NT / 8 * 8;
constexpr int PRODUCER_REGS = QR_TRADE ? QR_PRODUCER_REGS : D == 256 ? (BN == 64 ? 88 : 104) : NG == 2 ? 112 : 88;
constexpr int CONSUMER_REGS = QR_TRADE ? QR_CONSUMER_REGS : D == 256 ? (BN == 64 ? 208 : 200) : NG == 2 ? 144 : 168;
static_assert(!REG_TRADE || (NP / 4) * PRODUCER_REGS + (NC / 4) * CONSUMER_REGS <= (NT / 128) * LAUNCH_REGS,
              "the CTA's register pool");
static_assert(!Q_REGS || WGMMA, "Q_REGS: the register A operand of wgmma");
static_assert(NG == 1 || (NG == 2 && BPT <= 2), "PRODUCER_GROUPS is 1, or 2 with at most 2 blocks per tile");
static_assert(BN == 32 || BN == 64, "BLOCK_N is 32 or 64");
static_assert(T % BN == 0, "a tile is a whole number of blocks");
static_assert(REC % 16 == 0, "records are 16-byte multiples");
static_assert(D == 64 || D == 128 || D == 256, "head_dim");
static_assert(!WGMMA || (RPW == 16 && ((BN == 64 && D <= 128) || (D == 256 && NP == 4 && NG == 1 && (BN == 32 || NC == 8)))),
              "wgmma: 16 rows per warp (64 per warpgroup); 64-token blocks at head_dim 64 or 128; at head_dim 256 one "
              "producer warpgroup, and 64-token blocks only with two consumer warpgroups");

// K_WORD_INTERLEAVED (uniform codes, f16 K operand):
// the 8 tokens of a K code word go to the K stage in the order the nibble extraction yields their pairs,
// t0 t4 t1 t5 t2 t6 t3 t7, with no byte permutes per word (4 an item, 13% of dequant_k's instructions at
// D=256; the kernel 4% faster there, 1% at D=128), and the V stage's rows take the same order within each 8
// tokens. A tile block's scores and P . V are sums over its tokens, which no order changes, and no tile block
// masks a column.
constexpr bool K_WORD_INTERLEAVED = !LLOYD_MAX && !K_INT8;
// the record token held by row (K column) p of a tile block's stage
__device__ __forceinline__ int stage_token(int p) {
    return K_WORD_INTERLEAVED ? (p & ~7) | ((p & 7) >> 1) | ((p & 1) << 2) : p;
}

// Shared memory, bytes: Q rows, the record ring, the producers' per-tile parameters, the lloyd_max
// byte tables, the per-row factors, the stage mbarriers (MBAR_HANDOFF), and the stages. A stage holds a
// tile block (kd [D][KS] f16, vd [BN][QS] f16, the tile factors fK and eV) or an exact block (K and V
// [BN][QS], cache dtype); NSTAGE of them, so one role's jitter does not stall the other at once.
constexpr int SM_Q = BM * QS * 2;
constexpr int SM_PAR1 = D * 8 + D * 4 + T * 8 + T * 4 + 8 * 8 * 4;  // kp [D], cr [D], vp [T], rs [T], red (Params)
constexpr int SM_PAR = NG * SM_PAR1;                      // one set per producer group
constexpr int SM_LUT = LLOYD_MAX ? 256 * 4 + (VB == 2 ? 256 * 8 : 0) : 0;
constexpr int SM_ROWF = BM * 4;
// The stage hand-off (see "synchronization"): mbarriers with two producer groups, named barriers with one.
constexpr bool MBAR_HANDOFF = NG == 2;
constexpr int SM_MBAR = MBAR_HANDOFF ? 2 * NSTAGE * 8 : 0;  // the stages' FULL and EMPTY mbarriers
constexpr int ST_KD = D * KS * 2;
constexpr int ST_VD = BN * QS * 2;
constexpr int ST_TILE = ST_KD + ST_VD + 16;  // + the tile factors (fK f32, eV int)
constexpr int ST_EK = BN * QS * 2;  // the exact block's K; its V follows
constexpr int ST_EXACT = 2 * ST_EK;
// 128-byte aligned stages (wgmma descriptors address whole core matrices)
constexpr int ST_BYTES = ((ST_TILE > ST_EXACT ? ST_TILE : ST_EXACT) + 127) / 128 * 128;
// Record slots: two per producer group where shared memory allows (a group's next record is then in
// flight during its whole current tile; with one slot the group waits out a record's latency every tile).
// One group: two slots, or one where two do not fit (D=256 under wgmma with 128 rows: 64 KB of Q, and
// 128-token records of 4-bit V, 34-37 KB): the group then fetches tile g + 1 after tile g's last block and
// waits for it at g + 1's first, while the consumers work through the stages in flight.
// opt-in dynamic shared memory per block: sm_90 227 KB, sm_80 / sm_87 163 KB, other sm_8x 99 KB
constexpr int SMEM_LIMIT = (__CUDA_ARCH__ >= 900 ? 227 : (__CUDA_ARCH__ == 800 || __CUDA_ARCH__ == 870) ? 163 : 99) * 1024;
constexpr int SMEM_BUT_RECORDS = SM_Q + SM_PAR + SM_LUT + SM_ROWF + SM_MBAR + 127 + NSTAGE * ST_BYTES;
constexpr int RSLOTS = (NG == 2 && SMEM_BUT_RECORDS + 4 * REC <= SMEM_LIMIT) ? 4
                       : (NG == 2 || SMEM_BUT_RECORDS + 2 * REC <= SMEM_LIMIT) ? 2 : 1;
constexpr int AHEAD = RSLOTS / NG - 1;  // records of a group's later tiles in flight while it works on one
constexpr int SM_REC = RSLOTS * REC;
constexpr int OFF_SM_REC = SM_Q;
constexpr int OFF_SM_PAR = OFF_SM_REC + SM_REC;
constexpr int OFF_SM_LUT = OFF_SM_PAR + SM_PAR;
constexpr int OFF_SM_ROWF = OFF_SM_LUT + SM_LUT;
constexpr int OFF_SM_MBAR = OFF_SM_ROWF + SM_ROWF;  // 8-byte aligned: BM is a multiple of 16
constexpr int OFF_SM_STAGE = (OFF_SM_MBAR + SM_MBAR + 127) / 128 * 128;
constexpr int SMEM_TOTAL = OFF_SM_STAGE + NSTAGE * ST_BYTES;

// The launcher reads this from the module (one source for the layout above).
extern "C" __device__ const int kvarn_prefill_smem_bytes = SMEM_TOTAL;

// FETCH_HALVES (one record slot, two blocks a tile): a record is copied in two parts, A (the scales and the codes
// of the tile's first block) and B (those of its second), A of tile g + 1 once tile g's first block is dequantized
// and B once its second is, so each part lands while the producers still work on tile g or on g + 1's setup;
// otherwise the whole record would be copied after tile g's last block and waited for at once (1.7% and 3.9% of
// the D=256 kernel's time in two interleaved A/Bs on an H100: tools/prefill_variants.py's whole_record_fetch).
constexpr bool FETCH_HALVES = RSLOTS == 1 && BPT == 2 && !K_INT8;

#if CACHE_BF16
typedef __nv_bfloat16 cache_t;
typedef __nv_bfloat162 cache2_t;
#else
typedef __half cache_t;
typedef __half2 cache2_t;
#endif
#if Q_BF16
typedef __nv_bfloat16 q_t;
#else
typedef __half q_t;
#endif

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

// f32 pair -> packed 16-bit pair (lower index in the low half), in bf16 or f16.
template <bool BF16>
__device__ __forceinline__ u32 pack2(float a, float b) {
    if (BF16) {
        __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
        return *reinterpret_cast<u32*>(&h);
    }
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<u32*>(&h);
}
__device__ __forceinline__ u32 pack_f16(float a, float b) { return pack2<false>(a, b); }
__device__ __forceinline__ u32 pack_cache(float a, float b) { return pack2<(bool)CACHE_BF16>(a, b); }
__device__ __forceinline__ u32 pack_q(float a, float b) { return pack2<(bool)Q_BF16>(a, b); }

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    // src-size 0 zero-fills the 16 bytes (positions past the last exact token)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait_group() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

template <bool BF16>
__device__ __forceinline__ void mma16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if (BF16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// --- shared-memory operand layouts (byte offsets inside a buffer) -----------------------------------
// mma.sync: padded rows. wgmma: core matrices of 8 rows x 16 bytes, contiguous; a matrix descriptor
// names the stride between core matrices along M/N (SBO) and along K (LBO), see wgmma_desc.
//   Q [BM][D] (A of S, K-major): per warpgroup a [64][D] block, core matrix (k / 8, r / 8)
//   tile K kd (c, t) (B of S, MN-major): core matrix (c / 8, t / 8), 8 channels x 8 consecutive tokens
//   exact K (t, c) (B of S, K-major): core matrix (c / 8, t / 8), 8 tokens x 8 consecutive channels
//   V (t, c), both phases (B of P.V, MN-major): core matrix (t / 8, c / 8), 8 tokens x 8 consecutive channels
// The last argument is the element index along the buffer's contiguous axis.
__device__ __forceinline__ int q_off(int r, int k) {
    if (!WGMMA) return (r * QS + k) * 2;
    return (r >> 6) * (64 * D * 2) + (k >> 3) * 1024 + ((r & 63) >> 3) * 128 + (r & 7) * 16 + (k & 7) * 2;
}
__device__ __forceinline__ int kd_off(int c, int t) {
    if (!WGMMA) return (c * KS + t) * 2;
    return (c >> 3) * (BN * 16) + (t >> 3) * 128 + (c & 7) * 16 + (t & 7) * 2;
}
__device__ __forceinline__ int ek_off(int t, int c) {
    if (!WGMMA) return (t * QS + c) * 2;
    return (c >> 3) * (BN * 16) + (t >> 3) * 128 + (t & 7) * 16 + (c & 7) * 2;
}
__device__ __forceinline__ int v_off(int t, int c) {
    if (!WGMMA) return (t * QS + c) * 2;
    return (t >> 3) * (D * 16) + (c >> 3) * 128 + (t & 7) * 16 + (c & 7) * 2;
}

// Makes this thread's generic-proxy shared-memory stores visible to wgmma (the async proxy); before the
// barrier that hands the buffer over.
__device__ __forceinline__ void fence_operands_for_wgmma() {
#if WGMMA
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

#if WGMMA
namespace gmma = cute::SM90::GMMA;
// No-swizzle matrix descriptor: start address, LBO (K direction) and SBO (M/N direction) in bytes.
__device__ __forceinline__ uint64_t wgmma_desc(u32 addr, u32 lbo, u32 sbo) {
    cute::GmmaDescriptor d;
    d.bitfield.start_address_ = (uint16_t)(addr >> 4);
    d.bitfield.leading_byte_offset_ = (uint16_t)(lbo >> 4);
    d.bitfield.stride_byte_offset_ = (uint16_t)(sbo >> 4);
    d.bitfield.base_offset_ = 0;
    d.bitfield.layout_type_ = 0;  // INTERLEAVE (no swizzle)
    return d.desc_;
}
// desc advanced by `units` of 16 bytes: the start-address field (bits 0-13, address / 16 < 2^14 for shared
// memory) never carries, so a 32-bit add of the low word is exact
__device__ __forceinline__ uint64_t desc_plus(uint64_t desc, u32 units) {
    return (desc & 0xFFFFFFFF00000000ull) | (u32)((u32)desc + units);
}
// The accumulator of m64nNk16 per thread: N / 8 groups of 4 floats, in mma.sync's m16n8 order.
template <class Op, int NG, size_t... I>
__device__ __forceinline__ void gmma_ss_(uint64_t da, uint64_t db, float (&d)[NG][4], gmma::ScaleOut sc,
                                         cuda::std::index_sequence<I...>) {
    Op::fma(da, db, d[I / 4][I % 4]..., sc);
}
template <class Op, int NG, size_t... I>
__device__ __forceinline__ void gmma_rs_(const u32 (&a)[4], uint64_t db, float (&d)[NG][4], gmma::ScaleOut sc,
                                         cuda::std::index_sequence<I...>) {
    Op::fma(a[0], a[1], a[2], a[3], db, d[I / 4][I % 4]..., sc);
}
template <class Op, int NG>
__device__ __forceinline__ void gmma_ss(uint64_t da, uint64_t db, float (&d)[NG][4], gmma::ScaleOut sc) {
    gmma_ss_<Op>(da, db, d, sc, cuda::std::make_index_sequence<NG * 4>{});
}
template <class Op, int NG>
__device__ __forceinline__ void gmma_rs(const u32 (&a)[4], uint64_t db, float (&d)[NG][4], gmma::ScaleOut sc) {
    gmma_rs_<Op>(a, db, d, sc, cuda::std::make_index_sequence<NG * 4>{});
}
// Keeps the compiler from moving register reads and writes of d across the asynchronous MMAs.
template <int NG>
__device__ __forceinline__ void fence_acc(float (&d)[NG][4]) {
#pragma unroll
    for (int i = 0; i < NG; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) cute::warpgroup_fence_operand(d[i][k]);
}
// S = Q . K^T for one block, N = BLOCK_N (f16 or bf16 operands; tile K is MN-major, exact K K-major)
template <bool BF16, bool K_MN>
struct ScoreMMA {
    static constexpr gmma::Major KM = K_MN ? gmma::Major::MN : gmma::Major::K;
    using Op64 = typename cuda::std::conditional<BF16, gmma::MMA_64x64x16_F32BF16BF16_SS<gmma::Major::K, KM>,
                                                 gmma::MMA_64x64x16_F32F16F16_SS<gmma::Major::K, KM>>::type;
    using Op32 = typename cuda::std::conditional<BF16, gmma::MMA_64x32x16_F32BF16BF16_SS<gmma::Major::K, KM>,
                                                 gmma::MMA_64x32x16_F32F16F16_SS<gmma::Major::K, KM>>::type;
    using Op = typename cuda::std::conditional<BN == 64, Op64, Op32>::type;
};
// The tile phase's S with Q from registers (Q_REGS; f16, tile K MN-major)
struct ScoreMMARegQ {
    using Op = typename cuda::std::conditional<BN == 64, gmma::MMA_64x64x16_F32F16F16_RS<gmma::Major::K, gmma::Major::MN>,
                                               gmma::MMA_64x32x16_F32F16F16_RS<gmma::Major::K, gmma::Major::MN>>::type;
};
// O += P . V over the head dimension, N = D in one instruction (P from registers, V MN-major)
template <bool BF16>
struct ValueMMA {
    using Op64 = typename cuda::std::conditional<BF16, gmma::MMA_64x64x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>,
                                                 gmma::MMA_64x64x16_F32F16F16_RS<gmma::Major::K, gmma::Major::MN>>::type;
    using Op128 = typename cuda::std::conditional<BF16, gmma::MMA_64x128x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>,
                                                  gmma::MMA_64x128x16_F32F16F16_RS<gmma::Major::K, gmma::Major::MN>>::type;
    using Op256 = typename cuda::std::conditional<BF16, gmma::MMA_64x256x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>,
                                                  gmma::MMA_64x256x16_F32F16F16_RS<gmma::Major::K, gmma::Major::MN>>::type;
    using Op = typename cuda::std::conditional<D == 64, Op64,
                                               typename cuda::std::conditional<D == 128, Op128, Op256>::type>::type;
};
#endif

// 2^x (ex2.approx: 2 ulp; -inf -> +0), the exponential of the online softmax
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}


// frexp's exponent of a positive finite float (x = m * 2^e, m in [0.5, 1)) from its bits; subnormals
// count as 2^-126 (the callers clamp their exponents far inside that range anyway).
__device__ __forceinline__ int frexp_exponent(float x) {
    return max(1, (__float_as_int(x) >> 23) & 0xff) - 126;
}
// 2^e, exactly, for an int e in [-126, 127]
__device__ __forceinline__ float exp2i(int e) { return __int_as_float((e + 127) << 23); }
// 2^e for any int e, as f32 rounds it (0 below -252, inf above 254: the range of two exp2i factors)
__device__ __forceinline__ float pow2f(int e) {
    if (e < -252) return 0.f;
    if (e > 254) return __int_as_float(0x7f800000);
    return exp2i(e >> 1) * exp2i(e - (e >> 1));
}

// Exponent that brings a bound into [2^14, 2^15): bound * 2^-e in that range (bound = 0 -> 0).
__device__ __forceinline__ int f16_range_exponent(float bound) {
    if (!(bound > 0.f)) return 0;
    return max(-100, min(100, frexp_exponent(bound) - 15));
}

#if LLOYD_MAX
__constant__ float k_codebook[16] = K_CODEBOOK;
__constant__ float v_codebook[1 << VB] = V_CODEBOOK;
#endif

// Per-row power-of-two scale: the exponent p with max|x| * 2^p in [2^7, 2^8) (0 for an all-zero row).
__device__ __forceinline__ int row_scale_exponent(float amax) {
    if (!(amax > 0.f)) return 0;
    int e;
    frexpf(amax, &e);  // frexp_exponent here makes ptxas spill the consumers (255 registers); once per row
    return max(-120, min(120, 8 - e));
}

// Loads one query row (lane holds D/32 consecutive elements) as f32.
constexpr int QE = D / 32;
__device__ __forceinline__ void load_q_row(float (&x)[QE], const q_t* row, int lane) {
    const q_t* p = row + lane * QE;
    if constexpr (QE == 2) {
        u32 w = *reinterpret_cast<const u32*>(p);
        const q_t* h = reinterpret_cast<const q_t*>(&w);
        x[0] = to_f32(h[0]); x[1] = to_f32(h[1]);
    } else if constexpr (QE == 4) {
        uint2 w = *reinterpret_cast<const uint2*>(p);
        const q_t* h = reinterpret_cast<const q_t*>(&w);
#pragma unroll
        for (int e = 0; e < 4; ++e) x[e] = to_f32(h[e]);
    } else {
        uint4 w = *reinterpret_cast<const uint4*>(p);
        const q_t* h = reinterpret_cast<const q_t*>(&w);
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] = to_f32(h[e]);
    }
}


// Stages the CTA's query rows into sQ (f16 rotated for phase A, or the cache dtype for phase B),
// scaled per row by a power of two; writes scale * log2(e) / s_r per row into sRowf. Consumer warps.
template <bool ROTATE>
__device__ __forceinline__ void stage_q(u8* sQ, float* sRowf, const q_t* q, long long q_sb, long long q_sh,
                                        long long q_sn, int b, int h, int G, int n, int r0, int M,
                                        float scale_log2, int warp, int lane) {
    for (int rr = warp; rr < BM; rr += NC) {  // consumer warps only (rows r0 .. M - 1 of the G * n folded rows)
        const int r = r0 + rr;
        float x[QE];
        if (r < M) {
            const int j = r / n, i = r - j * n;
            load_q_row(x, q + b * q_sb + (long long)(h * G + j) * q_sh + (long long)i * q_sn, lane);
            if (ROTATE) wht_lanes(x, lane);
        } else {
#pragma unroll
            for (int e = 0; e < QE; ++e) x[e] = 0.f;
        }
        float amax = 0.f;
#pragma unroll
        for (int e = 0; e < QE; ++e) amax = fmaxf(amax, fabsf(x[e]));
        const int p = row_scale_exponent(warp_max(amax));
        const float s = exp2i(p);
        u32 w[QE / 2];
#pragma unroll
        for (int e = 0; e < QE; e += 2) w[e / 2] = ROTATE ? pack_f16(x[e] * s, x[e + 1] * s) : pack_cache(x[e] * s, x[e + 1] * s);
        u8* dst = sQ + q_off(rr, lane * QE);
        if constexpr (QE == 2) *reinterpret_cast<u32*>(dst) = w[0];
        else if constexpr (QE == 4) *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
        else *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
        if (lane == 0) sRowf[rr] = scale_log2 * exp2i(-p);
    }
    fence_operands_for_wgmma();
}

// Online-softmax state and accumulator of one warp's rows. Thread layout of the m16n8 fragments:
// rows g and g + 8 (g = lane / 4) of each m16 tile, columns 2 * (lane % 4) + {0, 1} of each n8 tile.
struct RowState {
    float m[MT][2];    // running max, log2 units
    float l[MT][2];    // running sum (this thread's columns; reduced over the quad at the end)
    float rowf[MT][2];
    int qi[MT][2];     // query index i of the row (causal mask)
};

// Online softmax of one block's scores s (in place: s becomes P): the running max and sum, and a_acc, the
// factor of each row's accumulator (apply it with rescale_acc before the block's P . V). TILE: the scores'
// tile factor fk (a power of two; the row scales are in the K operand), no mask, and P' = p * 2^-kf (kf an
// integer >= 0 as a float, folded into the exponential's argument; lsc = 2^kf gives the row sum its p
// back); else the causal/end mask.
template <bool TILE>
__device__ __forceinline__ void softmax_scores(float (&s)[MT][SN][4], float fk, float kf, float lsc, float acc_rescale,
                                               RowState& st, int lane, int e0, int E, int E0, bool need_mask,
                                               float (&a_acc)[MT][2]) {
    const int tq = lane & 3;
    if (!TILE && need_mask) {
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int lim = min(E, E0 + st.qi[mi][hr] + 1);  // keys e < lim are visible
#pragma unroll
                for (int nt = 0; nt < SN; ++nt)
#pragma unroll
                    for (int c = 0; c < 2; ++c)
                        if (e0 + nt * 8 + 2 * tq + c >= lim) s[mi][nt][2 * hr + c] = NEG_INF;
            }
    }

    // online softmax per row (quad-reduced max; the sum stays per thread until the end)
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float mx = NEG_INF;
#pragma unroll
            for (int nt = 0; nt < SN; ++nt) mx = fmaxf(mx, fmaxf(s[mi][nt][2 * hr], s[mi][nt][2 * hr + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float rf = TILE ? st.rowf[mi][hr] * fk : st.rowf[mi][hr];  // exact: powers of two
            const float m_new = fmaxf(st.m[mi][hr], mx * rf);
            const float m_use = m_new == NEG_INF ? 0.f : m_new;  // a row that has seen only masked keys
            const float alpha = fast_exp2(st.m[mi][hr] - m_use);     // 0 for the first block (m = -inf)
            st.m[mi][hr] = m_new;
            const float m_exp = TILE ? m_use + kf : m_use;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < SN; ++nt)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float p = fast_exp2(fmaf(s[mi][nt][2 * hr + c], rf, -m_exp));
                    sum += p;
                    s[mi][nt][2 * hr + c] = p;
                }
            st.l[mi][hr] = fmaf(st.l[mi][hr], alpha, TILE ? sum * lsc : sum);
            a_acc[mi][hr] = alpha * acc_rescale;
        }
    }
}
// acc *= a_acc per row, skipped when no row of the warp changed its max (most blocks after the first)
__device__ __forceinline__ void rescale_acc(float (&acc)[MT][ON][4], const float (&a_acc)[MT][2]) {
    bool moved = false;
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) moved |= a_acc[mi][0] != 1.f || a_acc[mi][1] != 1.f;
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
            for (int dn = 0; dn < ON; ++dn) {
                acc[mi][dn][0] *= a_acc[mi][0];
                acc[mi][dn][1] *= a_acc[mi][0];
                acc[mi][dn][2] *= a_acc[mi][1];
                acc[mi][dn][3] *= a_acc[mi][1];
            }
    }
}
template <bool TILE>
__device__ __forceinline__ void online_softmax(float (&s)[MT][SN][4], float fk, float kf, float lsc, float acc_rescale,
                                               RowState& st, float (&acc)[MT][ON][4], int lane, int e0, int E, int E0,
                                               bool need_mask) {
    float a_acc[MT][2];
    softmax_scores<TILE>(s, fk, kf, lsc, acc_rescale, st, lane, e0, E, E0, need_mask, a_acc);
    rescale_acc(acc, a_acc);
}

#if WGMMA
// The warpgroup's S = Q . K^T for one block (D / 16 k-steps), issued, not waited for.
template <bool TILE>
__device__ __forceinline__ void issue_scores(u32 sQw, u32 sK, float (&s)[SN][4]) {
    using Op = typename ScoreMMA<TILE ? false : (bool)CACHE_BF16, TILE>::Op;
    // one descriptor per operand, advanced per k-step (desc_plus): building each k-step's descriptor from
    // its pointer put a dozen dependent instructions between consecutive wgmmas
    const uint64_t da = wgmma_desc(sQw, 1024, 128), db = wgmma_desc(sK, BN * 16, 128);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        gmma_ss<Op>(desc_plus(da, kk * (2048 >> 4)), desc_plus(db, kk * (2 * BN * 16 >> 4)), s,
                    kk == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One);
}
// The same with the warpgroup's rotated Q rows as register fragments qa (k16 step kk), tile K at sK.
__device__ __forceinline__ void issue_scores_regq(const u32 (&qa)[D / 16][4], u32 sK, float (&s)[SN][4]) {
    const uint64_t db = wgmma_desc(sK, BN * 16, 128);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        gmma_rs<ScoreMMARegQ::Op>(qa[kk], desc_plus(db, kk * (2 * BN * 16 >> 4)), s,
                                  kk == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One);
}
// This thread's A fragments of the warpgroup's Q rows (at sQw, layout q_off) for every k16 step: rows g and
// g + 8 of the warp's 16 (g = lane / 4), columns 2 (lane % 4) + {0, 1} and + 8, as pack_p packs P.
__device__ __forceinline__ void load_q_frags(const u8* sQw, int warp, int lane, u32 (&qa)[D / 16][4]) {
    const int r = (warp & 3) * 16 + (lane >> 2), c = 2 * (lane & 3);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        qa[kk][0] = *reinterpret_cast<const u32*>(sQw + q_off(r, kk * 16 + c));
        qa[kk][1] = *reinterpret_cast<const u32*>(sQw + q_off(r + 8, kk * 16 + c));
        qa[kk][2] = *reinterpret_cast<const u32*>(sQw + q_off(r, kk * 16 + 8 + c));
        qa[kk][3] = *reinterpret_cast<const u32*>(sQw + q_off(r + 8, kk * 16 + 8 + c));
    }
}
template <int N>
__device__ __forceinline__ void fence_frags(u32 (&a)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) cute::warpgroup_fence_operand(a[i][k]);
}
// acc += P . V for one block, P the packed A fragments (k16 step kt: score n8 tiles 2kt, 2kt + 1), issued.
template <bool TILE>
__device__ __forceinline__ void issue_pv(const u32 (&pa)[BN / 16][4], u32 sV, float (&acc)[ON][4]) {
    using Op = typename ValueMMA<TILE ? false : (bool)CACHE_BF16>::Op;
    const uint64_t dv = wgmma_desc(sV, D * 16, 128);  // advanced per k-step as in issue_scores
#pragma unroll
    for (int kt = 0; kt < BN / 16; ++kt) gmma_rs<Op>(pa[kt], desc_plus(dv, kt * (2 * D * 16 >> 4)), acc, gmma::ScaleOut::One);
}
template <bool BF16>
__device__ __forceinline__ void pack_p(const float (&s)[SN][4], u32 (&pa)[BN / 16][4]) {
#pragma unroll
    for (int kt = 0; kt < BN / 16; ++kt) {
        pa[kt][0] = pack2<BF16>(s[2 * kt][0], s[2 * kt][1]);
        pa[kt][1] = pack2<BF16>(s[2 * kt][2], s[2 * kt][3]);
        pa[kt][2] = pack2<BF16>(s[2 * kt + 1][0], s[2 * kt + 1][1]);
        pa[kt][3] = pack2<BF16>(s[2 * kt + 1][2], s[2 * kt + 1][3]);
    }
}
#else
// One BLOCK_N-token block with mma.sync: S = Q . K^T from ldmatrix fragments, online softmax, acc += P . V.
//   TILE: K channel-major f16 [D][KS] (ldmatrix.trans), V f16 [BN][QS]; else K and V token-major in the
//   cache dtype.
template <bool TILE>
__device__ __forceinline__ void attend_block(const u8* sQw, const u8* sK, const u8* sV, float fk, float kf,
                                             float lsc, float acc_rescale, RowState& st,
                                             float (&acc)[MT][ON][4], int lane, int e0, int E, int E0,
                                             bool need_mask) {
    constexpr bool BF = TILE ? false : (bool)CACHE_BF16;
    float s[MT][SN][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int nt = 0; nt < SN; ++nt)
#pragma unroll
            for (int k = 0; k < 4; ++k) s[mi][nt][k] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        u32 a[MT][4];
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
            const int row = mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            const int col = kk * 16 + (lane >> 4) * 8;
            ldsm_x4(a[mi], sQw + (row * QS + col) * 2);
        }
#pragma unroll
        for (int n2 = 0; n2 < SN / 2; ++n2) {
            u32 bfr[4];
            if (TILE) {  // kd[c][t]: matrices (c 0-7, t 0-7), (c 8-15, t 0-7), (c 0-7, t 8-15), (c 8-15, t 8-15)
                const int c = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                const int t = n2 * 16 + (lane >> 4) * 8;
                ldsm_x4_t(bfr, sK + (c * KS + t) * 2);
            } else {     // k[t][c]: matrices (t 0-7, c 0-7), (t 0-7, c 8-15), (t 8-15, c 0-7), (t 8-15, c 8-15)
                const int t = n2 * 16 + (lane & 7) + (lane >> 4) * 8;
                const int c = kk * 16 + ((lane >> 3) & 1) * 8;
                ldsm_x4(bfr, sK + (t * QS + c) * 2);
            }
#pragma unroll
            for (int mi = 0; mi < MT; ++mi) {
                mma16816<BF>(s[mi][2 * n2], a[mi], bfr[0], bfr[1]);
                mma16816<BF>(s[mi][2 * n2 + 1], a[mi], bfr[2], bfr[3]);
            }
        }
    }
    online_softmax<TILE>(s, fk, kf, lsc, acc_rescale, st, acc, lane, e0, E, E0, need_mask);

    // acc += P . V: the score fragments of n8 tiles (2k, 2k+1) are the A fragment of k16 step k
#pragma unroll
    for (int kt = 0; kt < BN / 16; ++kt) {
        u32 pa[MT][4];
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
            if (TILE) {
                pa[mi][0] = pack_f16(s[mi][2 * kt][0], s[mi][2 * kt][1]);
                pa[mi][1] = pack_f16(s[mi][2 * kt][2], s[mi][2 * kt][3]);
                pa[mi][2] = pack_f16(s[mi][2 * kt + 1][0], s[mi][2 * kt + 1][1]);
                pa[mi][3] = pack_f16(s[mi][2 * kt + 1][2], s[mi][2 * kt + 1][3]);
            } else {
                pa[mi][0] = pack_cache(s[mi][2 * kt][0], s[mi][2 * kt][1]);
                pa[mi][1] = pack_cache(s[mi][2 * kt][2], s[mi][2 * kt][3]);
                pa[mi][2] = pack_cache(s[mi][2 * kt + 1][0], s[mi][2 * kt + 1][1]);
                pa[mi][3] = pack_cache(s[mi][2 * kt + 1][2], s[mi][2 * kt + 1][3]);
            }
        }
#pragma unroll
        for (int d2 = 0; d2 < D / 16; ++d2) {
            // v[t][c]: matrices (t 0-7, c 0-7), (t 8-15, c 0-7), (t 0-7, c 8-15), (t 8-15, c 8-15), transposed
            u32 bfr[4];
            const int t = kt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            const int c = d2 * 16 + (lane >> 4) * 8;
            ldsm_x4_t(bfr, sV + (t * QS + c) * 2);
#pragma unroll
            for (int mi = 0; mi < MT; ++mi) {
                mma16816<BF>(acc[mi][2 * d2], pa[mi], bfr[0], bfr[1]);
                mma16816<BF>(acc[mi][2 * d2 + 1], pa[mi], bfr[2], bfr[3]);
            }
        }
    }
}
#endif


// FETCH_HALVES' parts of a record: B, the codes of the tile's second block (the second half of every channel's
// row of K codes, T / 2 bytes with tokens in order; the V code rows of the second half's tokens), and A, the rest.
// Each part is copied from explicit ranges: classifying every 16-byte chunk of the record cost ~20 instructions
// a chunk.
constexpr int K_CODES_END = OFF_K_CODES + D * T / 2, V_CODES_END = OFF_V_CODES + T * D * VB / 8;
constexpr int V_HALF_BYTES = T / 2 * D * VB / 8;
constexpr bool K_CODES_FIRST = OFF_K_CODES < OFF_V_CODES;
constexpr int CODES_LO1 = K_CODES_FIRST ? OFF_K_CODES : OFF_V_CODES, CODES_HI1 = K_CODES_FIRST ? K_CODES_END : V_CODES_END;
constexpr int CODES_LO2 = K_CODES_FIRST ? OFF_V_CODES : OFF_K_CODES, CODES_HI2 = K_CODES_FIRST ? V_CODES_END : K_CODES_END;
static_assert(CODES_HI1 <= CODES_LO2 && CODES_HI2 <= REC && REC % 16 == 0 && CODES_LO1 % 16 == 0 &&
              CODES_HI1 % 16 == 0 && CODES_LO2 % 16 == 0 && CODES_HI2 % 16 == 0 && V_HALF_BYTES % 16 == 0,
              "the record's code regions are whole 16-byte chunks, apart");
// bytes [lo, hi) of the record
__device__ __forceinline__ void copy_record_range(u8* dst, const u8* src, int lo, int hi, int gtid) {
#pragma unroll 1
    for (int o = lo + gtid * 16; o < hi; o += GT * 16) cp_async16(dst + o, src + o, true);
}
// half `half` of every channel's row of K codes
__device__ __forceinline__ void copy_k_code_halves(u8* dst, const u8* src, int half, int gtid) {
    constexpr int HC = T / 2 / 16 / 2;  // 16-byte chunks in half a row
    static_assert(!FETCH_HALVES || (HC >= 1 && BPT == 2), "FETCH_HALVES: two blocks a tile, whole chunks a half row");
#pragma unroll 1
    for (int j = gtid; j < D * HC; j += GT) {
        const int o = OFF_K_CODES + (j / HC) * (T / 2) + (half * HC + j % HC) * 16;
        cp_async16(dst + o, src + o, true);
    }
}
// part 1 (A) or 2 (B) of the record at src
__device__ __forceinline__ void copy_record_part(u8* dst, const u8* src, int part, int gtid) {
    if (part == 1) {
        copy_record_range(dst, src, 0, CODES_LO1, gtid);
        copy_record_range(dst, src, CODES_HI1, CODES_LO2, gtid);
        copy_record_range(dst, src, CODES_HI2, REC, gtid);
    }
    copy_k_code_halves(dst, src, part - 1, gtid);
    copy_record_range(dst, src, OFF_V_CODES + (part - 1) * V_HALF_BYTES, OFF_V_CODES + part * V_HALF_BYTES, gtid);
}

// --- synchronization ----------------------------------------------------------------------------
// Named barriers (0 is __syncthreads: with MBAR_HANDOFF, after the mbarriers' initialization, before the roles
// split; unused after).
constexpr int BAR_FULL = 1;             // + stage: producers arrive, consumers wait (named hand-off)
constexpr int BAR_EMPTY = 1 + NSTAGE;   // + stage: consumers arrive, producers wait (named hand-off)
constexpr int BAR_PROD = 1 + 2 * NSTAGE;  // producers only
constexpr int BAR_CONS = 2 + 2 * NSTAGE;  // consumers only
constexpr int BAR_GROUP = 3 + 2 * NSTAGE;  // + group: one producer group
constexpr int BAR_TURN = BAR_GROUP + NG;   // + warpgroup: its turn to issue MMAs (wgmma, 2 consumer warpgroups)
static_assert(BAR_TURN + 2 <= 16, "16 named barriers");
// threads on a stage's named FULL / EMPTY barrier: the consumers and the one producer group that owns the stage
constexpr int HANDOFF = NC * 32 + GT;
__device__ __forceinline__ void bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n.reg .pred done;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n@!done bra WAIT_%=;\n}\n"
        ::"r"(bar), "r"(parity) : "memory");
#else
    asm volatile(
        "{\n.reg .pred done;\nWAIT_%=:\nmbarrier.test_wait.parity.shared::cta.b64 done, [%0], %1;\n@!done bra WAIT_%=;\n}\n"
        ::"r"(bar), "r"(parity) : "memory");
#endif
}
// The stage hand-off between the roles, per stage a FULL barrier (the producer group that owns the stage
// arrives once its block is in shared memory; the consumers wait) and an EMPTY one (the consumers arrive once
// they are done reading it; the owning group waits before refilling it). Two forms, by the H100 measurement
// of docs/perf-notes.md (eighteenth session):
// * MBAR_HANDOFF (two producer groups: the tuned D=64 and D=128 configs): two mbarriers a stage in shared
//   memory, FULL expecting the group's GT threads, EMPTY the NC * 32 consumer threads. Block bi is the stage's
//   (bi / NSTAGE)-th use and a wait names that phase's parity; a waiter is never a whole phase behind (a stage
//   cannot be refilled before it was emptied, nor emptied before it was filled). An arrive releases and a
//   completed wait acquires the shared-memory writes before it (CTA scope). The consumer warps wait each on
//   their own, where a named barrier held all of them to the slowest: the D=128 prompts 1-3% faster, and
//   compute-sanitizer's racecheck models mbarriers (0 hazards on tools/ncu_targets.py prefill_small).
// * otherwise (one producer group, e.g. D=256's one producer warpgroup feeding two consumer ones) the named
//   barriers BAR_FULL / BAR_EMPTY + stage with HANDOFF threads: with mbarriers the D=256 prompt was 4% slower
//   (its producers set the pace, and the consumers' try_wait spins share their schedulers). racecheck does not
//   model bar.arrive / bar.sync pairs and flags this form's hand-offs of data it sees read (the tile factors).
struct StageHandoff {
    u32 full, empty;  // MBAR_HANDOFF: shared addresses of the FULL and EMPTY mbarriers of stage 0 (+ 8 a stage)
    static __device__ __forceinline__ u32 parity(int bi) { return (u32)(bi / NSTAGE) & 1u; }
    __device__ __forceinline__ void init(int tid) const {  // every thread, before the roles split
        if constexpr (MBAR_HANDOFF) {
            if (tid == 0)
                for (int st = 0; st < NSTAGE; ++st) {
                    mbar_init(full + 8 * st, GT);
                    mbar_init(empty + 8 * st, NC * 32);
                }
            __syncthreads();
        }
    }
    // producers: stage s holds its block
    __device__ __forceinline__ void fill_done(int s) const {
        if constexpr (MBAR_HANDOFF) mbar_arrive(full + 8 * s);
        else bar_arrive(BAR_FULL + s, HANDOFF);
    }
    // producers, before filling block bi (>= NSTAGE) into its stage s: the consumers are done with the stage's
    // previous block
    __device__ __forceinline__ void wait_empty(int s, int bi) const {
        if constexpr (MBAR_HANDOFF) mbar_wait(empty + 8 * s, parity(bi) ^ 1u);
        else bar_sync(BAR_EMPTY + s, HANDOFF);
    }
    // consumers: block bi is in its stage
    __device__ __forceinline__ void wait_full(int bi) const {
        if constexpr (MBAR_HANDOFF) mbar_wait(full + 8 * (bi % NSTAGE), parity(bi));
        else bar_sync(BAR_FULL + bi % NSTAGE, HANDOFF);
    }
    // consumers: done with block bi's stage
    __device__ __forceinline__ void release(int bi) const {
        if constexpr (MBAR_HANDOFF) mbar_arrive(empty + 8 * (bi % NSTAGE));
        else bar_arrive(BAR_EMPTY + bi % NSTAGE, HANDOFF);
    }
};

// --- phase A producers: per-tile parameters and dequantization ------------------------------------
// Tile factors: the maxima of the record's scales, reduced over a producer group (each thread takes a
// few channels and tokens, each warp reduces its lanes into Params::red, every thread combines the warps).
struct TileFactors {
    int ek, ev;
    int er;       // max_t row_scale * 2^-er in [1/2, 1)
    int ec;       // max_c col_scale * 2^-ec in [1/2, 1)
    float fk;     // 2^(ek + er), the scores' tile factor
    int e_v;      // ec + ev: fV = 2^e_v, the values' tile factor
};

// max |code value| of each codebook (the bound that picks ek, ev)
constexpr float K_CB_ABSMAX = K_CB_LIMIT;
constexpr float V_CB_ABSMAX = V_CB_LIMIT;

// scales 2i and 2i + 1 of the record array at p, in one shared-memory load (the record's sections start
// 16-byte aligned)
__device__ __forceinline__ float2 scale_pair_at(const u8* p, int i) {
#if SCALE_F32
    return reinterpret_cast<const float2*>(p)[i];
#else
    return __half22float2(reinterpret_cast<const __half2*>(p)[i]);
#endif
}
__device__ __forceinline__ float abs_max(float2 v) { return fmaxf(fabsf(v.x), fabsf(v.y)); }
// The maximum over the warp of a value >= 0 (not NaN), in one redux: such floats order as their bits do.
// (A butterfly of shuffles was 5 dependent round trips a value, and the producers' per-tile setup, which
// the consumers wait for at D=256, stalled mostly on them: docs/perf-notes.md, nineteenth session.)
__device__ __forceinline__ float warp_max_nonneg(float x) {
    return __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(x)));
}

// The six scale maxima of this thread's channel and token pairs (gtid, gtid + GT, ...), reduced over its warp into
// red[warp][0..5]; then a group barrier
__device__ __forceinline__ void tile_partial_max(const u8* rec, float* red, int gtid) {
    float m[6];
#pragma unroll
    for (int k = 0; k < 6; ++k) m[k] = 0.f;  // |chan_min|, |chan_step|, col_scale, |tok_min|, |tok_step|, row_scale
    for (int i = gtid; i < D / 2; i += GT) {
        m[0] = fmaxf(m[0], abs_max(scale_pair_at(rec + OFF_CHAN_MIN, i)));
        m[1] = fmaxf(m[1], abs_max(scale_pair_at(rec + OFF_CHAN_STEP, i)));
        m[2] = fmaxf(m[2], abs_max(scale_pair_at(rec + OFF_COL_SCALE, i)));  // (positive)
    }
    for (int i = gtid; i < T / 2; i += GT) {
        m[3] = fmaxf(m[3], abs_max(scale_pair_at(rec + OFF_TOK_MIN, i)));
        m[4] = fmaxf(m[4], abs_max(scale_pair_at(rec + OFF_TOK_STEP, i)));
        m[5] = fmaxf(m[5], abs_max(scale_pair_at(rec + OFF_ROW_SCALE, i)));  // (positive)
    }
#pragma unroll
    for (int k = 0; k < 6; ++k) m[k] = warp_max_nonneg(m[k]);
    if ((gtid & 31) == 0)
#pragma unroll
        for (int k = 0; k < 6; ++k) red[(gtid >> 5) * 8 + k] = m[k];
}
// The exponent e with x * 2^-e in [1/2, 1) (frexp's; 0 for x = 0), clamped to [lo, hi].
__device__ __forceinline__ int unit_exponent(float x, int lo, int hi) {
    return x > 0.f ? max(lo, min(hi, frexp_exponent(x))) : 0;
}
// the group's six maxima from its warps' (tile_partial_max, after the group barrier)
__device__ __forceinline__ void group_maxima(const float* red, float (&m)[6]) {
#pragma unroll
    for (int k = 0; k < 6; ++k) m[k] = 0.f;
#pragma unroll
    for (int w = 0; w < GT / 32; ++w)
#pragma unroll
        for (int k = 0; k < 6; ++k) m[k] = fmaxf(m[k], red[w * 8 + k]);
}
__device__ __forceinline__ TileFactors tile_factors(const float (&m)[6]) {
    TileFactors f;
    f.ek = f16_range_exponent(fmaf(K_CB_ABSMAX, m[1], m[0]));
    f.ev = f16_range_exponent(fmaf(V_CB_ABSMAX, m[4], m[3]));
    // the scales are positive (the codec clamps them); a subnormal f32 maximum counts as 2^-126, so the
    // normalized scales stay <= 1 down to the smallest f32
    f.er = unit_exponent(m[5], -100, 100);
    f.ec = unit_exponent(m[2], -125, 126);
    f.fk = exp2i(f.ek) * exp2i(f.er);
    f.e_v = f.ec + f.ev;
    return f;
}

__device__ __forceinline__ u32 h2u(__half2 h) { return *reinterpret_cast<u32*>(&h); }
__device__ __forceinline__ __half2 u2h(u32 u) { return *reinterpret_cast<__half2*>(&u); }
__device__ __forceinline__ __half2 bcast(float x) { return __float2half2_rn(x); }

// Producer-side parameter arrays of one tile (written by the producers after the record arrived):
//   kp[c] = (step', min') with chan_*' = chan_* * 2^-ek; cr[c] = col_scale[c] * 2^-ec;
//   vp[t] = (tok_step', tok_min') with tok_*' = tok_* * 2^-ev; rs[t] = row_scale[t] * 2^-er (f16 for f16
//   scales, exact unless f16-subnormal; f32 for f32 scales).
// f16 scales: kp, vp hold (half2 step', half2 min') broadcasts and cr is f16 (step', min' are then exact:
// the f16 scales times a power of two), and the dequantization runs in f16x2 (one fma rounding).
// f32 scales: kp, vp hold float2 (step', min') and cr f32, and it runs in f32 (one final rounding), so
// the scales keep their f32 precision.
struct Params {
    uint2* kp;
    void* cr;
    uint2* vp;
    void* rs;    // ratio_t's element type: f16 for f16 scales, f32 for f32 scales
    float* red;  // [GT / 32][8]: per-warp scale maxima (tile_partial_max)
};
__device__ __forceinline__ u32 f2u(float x) { return __float_as_uint(x); }

// Two parameter entries (step', min') = (step, min) * mul of channels or tokens 2i, 2i + 1, as one 16-byte store
__device__ __forceinline__ uint4 param_pair(float2 step, float2 mn, float mul) {
#if SCALE_F32
    return make_uint4(f2u(step.x * mul), f2u(mn.x * mul), f2u(step.y * mul), f2u(mn.y * mul));
#else
    return make_uint4(h2u(bcast(step.x * mul)), h2u(bcast(mn.x * mul)), h2u(bcast(step.y * mul)),
                      h2u(bcast(mn.y * mul)));
#endif
}
// Two scale ratios r * mul (col_scale or row_scale entries 2i, 2i + 1) into the ratio array at base
__device__ __forceinline__ void store_ratio_pair(void* base, int i, float2 r, float mul) {
#if SCALE_F32
    reinterpret_cast<float2*>(base)[i] = make_float2(r.x * mul, r.y * mul);
#else
    reinterpret_cast<__half2*>(base)[i] = __floats2half2_rn(r.x * mul, r.y * mul);
#endif
}

__device__ __forceinline__ void tile_params(const u8* rec, const TileFactors& f, const Params& P, int ptid) {
    const float kmul = exp2i(-f.ek), vmul = exp2i(-f.ev), rmul = exp2i(-f.er), cinv = exp2i(-f.ec);
    // channel and token pairs (2i, 2i + 1): one load per scale array and one store per parameter array a pair
    for (int i = ptid; i < D / 2; i += GT) {
        reinterpret_cast<uint4*>(P.kp)[i] =
            param_pair(scale_pair_at(rec + OFF_CHAN_STEP, i), scale_pair_at(rec + OFF_CHAN_MIN, i), kmul);
        store_ratio_pair(P.cr, i, scale_pair_at(rec + OFF_COL_SCALE, i), cinv);
    }
    for (int i = ptid; i < T / 2; i += GT) {
        reinterpret_cast<uint4*>(P.vp)[i] =
            param_pair(scale_pair_at(rec + OFF_TOK_STEP, i), scale_pair_at(rec + OFF_TOK_MIN, i), vmul);
        store_ratio_pair(P.rs, i, scale_pair_at(rec + OFF_ROW_SCALE, i), rmul);
    }
}

// The byte tables of lloyd_max codes (a byte holds 2 codes of 4 bits or 4 of 2 bits, lowest first):
// lut4[b] = half2 (cb4[b & 15], cb4[b >> 4]); lut2[b] = 4 halves (cb2[(b >> 2i) & 3]).
__device__ __forceinline__ void build_luts(u8* lut, int ptid) {
#if LLOYD_MAX
    u32* lut4 = reinterpret_cast<u32*>(lut);
    for (int b = ptid; b < 256; b += PT) lut4[b] = h2u(__floats2half2_rn(k_codebook[b & 15], k_codebook[b >> 4]));
    if (VB == 2) {
        uint2* lut2 = reinterpret_cast<uint2*>(lut + 256 * 4);
        for (int b = ptid; b < 256; b += PT)
            lut2[b] = make_uint2(h2u(__floats2half2_rn(v_codebook[b & 3], v_codebook[(b >> 2) & 3])),
                                 h2u(__floats2half2_rn(v_codebook[(b >> 4) & 3], v_codebook[b >> 6])));
    }
#endif
}

// (x & MASK) | 0x64006400 in one LOP3: with both constants immediates ptxas emits two (a LOP3 takes one
// immediate), so the magic number comes in a register
template <u32 MASK>
__device__ __forceinline__ u32 and_or_magic(u32 x) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(x), "n"(MASK), "r"(0x64006400u));
    return d;
}
// (1024 + code) pairs of the 4-bit fields k and k + 4 of w (f16: 0x6400 | code), minus 1024: exact.
__device__ __forceinline__ __half2 nib_pair(u32 w, int k) {
    return __hsub2(u2h(and_or_magic<0x000F000Fu>(w >> (4 * k))), bcast(1024.f));
}
__device__ __forceinline__ __half2 crumb_pair(u32 w, int k) {  // 2-bit fields k and k + 8
    return __hsub2(u2h(and_or_magic<0x00030003u>(w >> (2 * k))), bcast(1024.f));
}
__device__ __forceinline__ u32 lo_pair(__half2 a, __half2 b) { return __byte_perm(h2u(a), h2u(b), 0x5410); }
__device__ __forceinline__ u32 hi_pair(__half2 a, __half2 b) { return __byte_perm(h2u(a), h2u(b), 0x7632); }

// 8 consecutive 4-bit codes of w -> 4 half2 of consecutive code values (uniform: the codes; lloyd_max: centroids);
// INTERLEAVED (uniform only): the pairs of codes (k, k + 4) instead, as they come out of the word
template <bool INTERLEAVED = false>
__device__ __forceinline__ void values8(u32 w, __half2 (&v)[4], const u8* lut) {
#if LLOYD_MAX
    static_assert(!INTERLEAVED, "the lloyd_max tables give pairs of consecutive codes");
    const u32* lut4 = reinterpret_cast<const u32*>(lut);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = u2h(lut4[(w >> (8 * j)) & 0xFFu]);
#else
    const __half2 p0 = nib_pair(w, 0), p1 = nib_pair(w, 1), p2 = nib_pair(w, 2), p3 = nib_pair(w, 3);
    if constexpr (INTERLEAVED) {
        v[0] = p0; v[1] = p1; v[2] = p2; v[3] = p3;  // (t0, t4), (t1, t5), (t2, t6), (t3, t7)
    } else {
        v[0] = u2h(lo_pair(p0, p1)); v[1] = u2h(lo_pair(p2, p3));  // (t0, t1), (t2, t3)
        v[2] = u2h(hi_pair(p0, p1)); v[3] = u2h(hi_pair(p2, p3));  // (t4, t5), (t6, t7)
    }
#endif
}
// 16 consecutive 2-bit codes of w -> 8 half2 of consecutive code values
__device__ __forceinline__ void values16(u32 w, __half2 (&v)[8], const u8* lut) {
#if LLOYD_MAX
    const uint2* lut2 = reinterpret_cast<const uint2*>(lut + 256 * 4);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint2 e = lut2[(w >> (8 * j)) & 0xFFu];
        v[2 * j] = u2h(e.x);
        v[2 * j + 1] = u2h(e.y);
    }
#else
#pragma unroll
    for (int k = 0; k < 8; k += 2) {
        const __half2 a = crumb_pair(w, k), b = crumb_pair(w, k + 1);  // (k, k+8), (k+1, k+9)
        v[k / 2] = u2h(lo_pair(a, b));
        v[4 + k / 2] = u2h(hi_pair(a, b));
    }
#endif
}

// (step * v + min) * r for a pair of code values, as packed f16 (see Params for the two precisions): r the
// col_scale ratios of the pair's channels (V) or the row scales of the pair's tokens (K)
#if SCALE_F32
typedef float2 ratio_t;
#else
typedef __half2 ratio_t;
#endif
__device__ __forceinline__ u32 affine_scaled(__half2 v, uint2 p, ratio_t r) {
#if SCALE_F32
    const float2 f = __half22float2(v);
    return pack_f16(fmaf(__uint_as_float(p.x), f.x, __uint_as_float(p.y)) * r.x,
                    fmaf(__uint_as_float(p.x), f.y, __uint_as_float(p.y)) * r.y);
#else
    return h2u(__hmul2(__hfma2(v, u2h(p.x), u2h(p.y)), r));
#endif
}

// K codes of tokens [t0, t0 + BN) -> kd [D][KS] f16, channel-major: item = (channel, 8-token word), times
// the tokens' normalized row scales rs (see Params). Consecutive producer threads read consecutive words of
// one channel and write 16 contiguous bytes each. A thread's item i is channel c0 + i * CSTEP of its word wi
// (every mapping below is linear in i), so its loads and stores are one base address each plus compile-time
// offsets: computing each item's channel and word from its index cost ~24 instructions an item.
__device__ __forceinline__ void dequant_k(const u8* rec, const Params& P, const u8* lut, u8* sKd, int t0, int ptid) {
    constexpr int WPC = BN / 8;  // words per channel in a block
    constexpr int ITEMS = D * WPC;
    static_assert(ITEMS % GT == 0, "whole items per producer thread");
    // Items in batches whose loads are all issued before the first store: the compiler cannot move a
    // shared-memory load above a shared-memory store, so a plain loop pays two load latencies per item.
    // D=256 has one producer warpgroup, which its consumers wait for (a fifth of their stall samples at
    // FULL): all 8 of a thread's items in one batch, one load latency a block (f16 scales; with f32 scales,
    // and at D <= 128, 8 spill).
    constexpr int NI = ITEMS / GT, NB = NI < 4 ? NI : (D == 256 && !SCALE_F32 ? 8 : 4);
    static_assert(NI % NB == 0, "whole batches");
    static_assert(WPC == 4 || WPC == 8, "32- or 64-token blocks");
    // item ptid + i * GT is channel c0 + i * CSTEP, word wi: GT is a multiple of the period of the word index
    // in each mapping, so i moves only the channel
    constexpr int CSTEP = GT / WPC;
    static_assert(GT % (WGMMA ? 8 * WPC : WPC) == 0 && (!WGMMA || CSTEP % 8 == 0),
                  "a thread's items: one word, channels CSTEP apart (whole core matrices)");
    // the mapping from ptid is recomputed per block (a few instructions): hoisted out of the producers'
    // block loop it would hold registers across tile_params, where the producers have none to spare
    asm volatile("" : "+r"(ptid));
    int c0, wi;
#if WGMMA
    // 8 lanes of a store phase write rows of 8 different channels (distinct 16-byte slots of the core matrices)
    if constexpr (WPC == 8) {
        // 64-token blocks: a warp's code words fall on 16 banks twice (2-way) rather than 4 times
        const int j = ptid & 7, p = (ptid >> 3) & 3, hw = (ptid >> 5) & 1;
        c0 = (ptid >> 6) * 8 + j;
        wi = 4 * (((j >> 1) + hw) & 1) + p;
    } else {
        // 32-token blocks: a warp takes 8 channels x 4 words (128-token tiles put the channels' code rows
        // 64 bytes apart, so any 32 words of a block lie on 8 banks: 4-way, as in the mma.sync mapping)
        c0 = (ptid >> 5) * 8 + (ptid & 7);
        wi = (ptid >> 3) & 3;
    }
    constexpr int KD_STEP = (CSTEP / 8) * (BN * 16);  // kd_off(c + CSTEP, t) - kd_off(c, t)
#else
    c0 = ptid / WPC;
    wi = ptid - c0 * WPC;
    constexpr int KD_STEP = CSTEP * KS * 2;
#endif
    constexpr int CODE_STEP = CSTEP * (T / 2);
    // int offsets, not pointers, live across the batches (the producers have no registers to spare)
    const int code0 = OFF_K_CODES + c0 * (T / 2) + t0 / 2 + wi * 4, kd0 = kd_off(c0, wi * 8);
    const ratio_t* rs2 = reinterpret_cast<const ratio_t*>(P.rs) + (t0 + wi * 8) / 2;
#pragma unroll 1
    for (int i0 = 0; i0 < NI; i0 += NB) {
        const u8* codes = rec + code0 + i0 * CODE_STEP;
        const uint2* kp = P.kp + c0 + i0 * CSTEP;
        u8* dst = sKd + kd0 + i0 * KD_STEP;
        u32 w[NB];
        uint2 kpv[NB];
#pragma unroll
        for (int i = 0; i < NB; ++i) {
            w[i] = *reinterpret_cast<const u32*>(codes + i * CODE_STEP);
            kpv[i] = kp[i * CSTEP];
        }
        // the tokens' row scales (the same 8 tokens for every item of the thread), loaded with the batch's codes,
        // paired as the values are: rsv[j] those of the stage's columns 2j, 2j + 1 (stage_token)
        ratio_t rsv[4];
#if SCALE_F32
        const float4 ra = reinterpret_cast<const float4*>(rs2)[0], rb = reinterpret_cast<const float4*>(rs2)[1];
        if constexpr (K_WORD_INTERLEAVED) {
            rsv[0] = make_float2(ra.x, rb.x); rsv[1] = make_float2(ra.y, rb.y);
            rsv[2] = make_float2(ra.z, rb.z); rsv[3] = make_float2(ra.w, rb.w);
        } else {
            rsv[0] = make_float2(ra.x, ra.y); rsv[1] = make_float2(ra.z, ra.w);
            rsv[2] = make_float2(rb.x, rb.y); rsv[3] = make_float2(rb.z, rb.w);
        }
#else
        const uint4 r = *reinterpret_cast<const uint4*>(rs2);
        if constexpr (K_WORD_INTERLEAVED) {  // once a batch, not once an item
            rsv[0] = u2h(__byte_perm(r.x, r.z, 0x5410)); rsv[1] = u2h(__byte_perm(r.x, r.z, 0x7632));
            rsv[2] = u2h(__byte_perm(r.y, r.w, 0x5410)); rsv[3] = u2h(__byte_perm(r.y, r.w, 0x7632));
        } else {
            rsv[0] = u2h(r.x); rsv[1] = u2h(r.y); rsv[2] = u2h(r.z); rsv[3] = u2h(r.w);
        }
#endif
#pragma unroll
        for (int i = 0; i < NB; ++i) {
            __half2 v[4];
            values8<K_WORD_INTERLEAVED>(w[i], v, lut);
            u32 out[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) out[j] = affine_scaled(v[j], kpv[i], rsv[j]);  // stage columns 2j, 2j + 1
            *reinterpret_cast<uint4*>(dst + i * KD_STEP) = make_uint4(out[0], out[1], out[2], out[3]);
        }
    }
}

// V codes of tokens [t0, t0 + BN) -> vd [BN][QS] f16, token-major: item = (token, 32-bit word of codes);
// a producer thread always handles the same VW words (channels), so it loads their col_scale ratios once
// per block.
constexpr int CPW = 32 / VB;        // channels per V word
constexpr int WPT = D / CPW;        // V words per token
// Item -> (token, word): mma.sync, consecutive threads take consecutive words of a token; wgmma,
// consecutive threads take 8 consecutive tokens of one word (8 lanes of a store phase then write 8
// different core-matrix rows).
constexpr int V_LANES = WGMMA ? 8 : 1;
// words per producer thread: one, or where a token's words times V_LANES outnumber the group's threads
// (wgmma, D=256, 4-bit V: 32 words x 8 lanes over 128 threads) VW of them: the thread's item n takes word
// v_word(ptid) + (n % VW) * GT / V_LANES (v_word(ptid) < GT / V_LANES there, so no word wraps around)
constexpr int VW = WPT * V_LANES > GT ? WPT * V_LANES / GT : 1;
static_assert(GT % (WPT * V_LANES) == 0 || (WPT * V_LANES) % GT == 0, "a producer thread keeps its channels");
constexpr int VW_STEP = GT / V_LANES;  // words between a thread's words
__device__ __forceinline__ int v_word(int item) { return (item / V_LANES) % WPT; }
__device__ __forceinline__ int v_token(int item) { return (item / (V_LANES * WPT)) * V_LANES + item % V_LANES; }
// the col_scale ratios of the thread's words, word k's at cr[k * CPW / 2]
__device__ __forceinline__ void load_col_ratios(const Params& P, ratio_t (&cr)[VW * CPW / 2], int ptid) {
    const int c0 = v_word(ptid) * CPW;
#pragma unroll
    for (int k = 0; k < VW * CPW / 2; ++k)
        cr[k] = reinterpret_cast<const ratio_t*>(P.cr)[c0 / 2 + (k / (CPW / 2)) * VW_STEP * CPW / 2 + k % (CPW / 2)];
}
__device__ __forceinline__ void dequant_v(const u8* rec, const Params& P, const u8* lut, u8* sVd, int t0, int ptid) {
    // the thread's col_scale ratios, loaded per block (kept in registers across the blocks they made the
    // producers spill once the K operand took the row scales)
    ratio_t cr[VW * CPW / 2];
    load_col_ratios(P, cr, ptid);
    constexpr int ROWB = D * VB / 8;  // bytes per token of codes
    constexpr int ITEMS = BN * WPT;
    static_assert(ITEMS % GT == 0, "whole items per producer thread");
    constexpr int NI = ITEMS / GT, NB = NI < 4 ? NI : 4;  // batches of loads, as in dequant_k
    static_assert(NI % NB == 0 && NB % VW == 0, "whole batches, each starting at the thread's first word");
    // item n of the thread (ptid + n * GT) is word wi + (n % VW) * VW_STEP of stage row tt0 + (n / VW) * TT_STEP:
    // a batch's rows are a base and compile-time offsets (computed from each item's index they cost ~15
    // instructions an item)
    constexpr int TT_STEP = VW == 1 ? GT / (V_LANES * WPT) * V_LANES : V_LANES;
    const int tt0 = v_token(ptid), wi = v_word(ptid);
    // rows TT_STEP apart, TT_STEP a multiple of 8, share their place in their 8 rows: one shift (stage_token's)
    // serves them all
    constexpr bool ROW_PHASE_FIXED = TT_STEP % 8 == 0;
    const int tshift = stage_token(tt0) - tt0;
#pragma unroll 1
    for (int i0 = 0; i0 < NI; i0 += NB) {
        u32 w[NB];
        uint2 vp[NB];
        const int tb = tt0 + (i0 / VW) * TT_STEP;
#pragma unroll
        for (int i = 0; i < NB; ++i) {
            const int tt = tb + (i / VW) * TT_STEP;
            const int tr = t0 + (ROW_PHASE_FIXED ? tt + tshift : stage_token(tt));  // the record token of row tt
            w[i] = *reinterpret_cast<const u32*>(rec + OFF_V_CODES + tr * ROWB + (wi + (i % VW) * VW_STEP) * 4);
            vp[i] = P.vp[tr];
        }
#pragma unroll
        for (int i = 0; i < NB; ++i) {
            const int tt = tb + (i / VW) * TT_STEP, c0 = (wi + (i % VW) * VW_STEP) * CPW;
            const ratio_t* cri = cr + (i % VW) * (CPW / 2);
            u32 out[CPW / 2];
            if constexpr (VB == 2) {
                __half2 v[8];
                values16(w[i], v, lut);
#pragma unroll
                for (int k = 0; k < 8; ++k) out[k] = affine_scaled(v[k], vp[i], cri[k]);
            } else {
                __half2 v[4];
                values8(w[i], v, lut);
#pragma unroll
                for (int k = 0; k < 4; ++k) out[k] = affine_scaled(v[k], vp[i], cri[k]);
            }
#pragma unroll
            for (int k = 0; k < CPW / 2; k += 4)  // 8 channels c0 + 2k .. + 7 per 16-byte store
                *reinterpret_cast<uint4*>(sVd + v_off(tt, c0 + 2 * k)) =
                    make_uint4(out[k], out[k + 1], out[k + 2], out[k + 3]);
        }
    }
}

// --- phase B producers: one block of exact tokens --------------------------------------------------
struct ExactSource {
    const cache_t* sink_k; const cache_t* sink_v; int sink_cap; int sink_len;
    const cache_t* win_k; const cache_t* win_v; int win_cap; int win_len;
    const cache_t* chunk_k; const cache_t* chunk_v;
    long long ck_sb, ck_sh, ck_st, cv_sb, cv_sh, cv_st;
};

__device__ __forceinline__ void load_exact_block(const ExactSource& src, int b, int h, int Hkv, int e0, int E,
                                                 u8* sK, u8* sV, int ptid) {
    constexpr int CPR = D / 8;  // 16-byte chunks per token row
    constexpr int ITEMS = BN * CPR;
    static_assert(ITEMS % GT == 0, "whole items per producer thread");
    const int s0 = src.sink_len, s1 = src.sink_len + src.win_len;
    // Unrolled, ptxas hoists the items' offsets out of the producers' block loop and keeps them live across
    // it; with the 104 registers of a producer thread beside two D=256 consumer warpgroups that spilled both
    // roles, so there the loop stays rolled (the exact blocks are a few of a CTA's)
    constexpr int UNROLL = REG_TRADE && D == 256 ? 1 : ITEMS / GT;
#pragma unroll UNROLL
    for (int it = 0; it < ITEMS / GT; ++it) {
        const int item = ptid + it * GT;
        const int tt = item / CPR, ch = item - tt * CPR;
        const int e = e0 + tt;
        const cache_t* pk = src.chunk_k;
        const cache_t* pv = src.chunk_v;
        if (e < s0) {
            const long long base = ((long long)(b * Hkv + h) * src.sink_cap + e) * D;
            pk = src.sink_k + base; pv = src.sink_v + base;
        } else if (e < s1) {
            const long long base = ((long long)(b * Hkv + h) * src.win_cap + (e - s0)) * D;
            pk = src.win_k + base; pv = src.win_v + base;
        } else if (e < E) {
            const long long j = e - s1;
            pk = src.chunk_k + b * src.ck_sb + h * src.ck_sh + j * src.ck_st;
            pv = src.chunk_v + b * src.cv_sb + h * src.cv_sh + j * src.cv_st;
        }
        const bool valid = e < E;
        cp_async16(sK + ek_off(tt, ch * 8), pk + ch * 8, valid);
        cp_async16(sV + v_off(tt, ch * 8), pv + ch * 8, valid);
    }
    cp_async_commit();
}

// --- the output accumulator: rotation back and store ------------------------------------------------
// Inverse WHT of each accumulator row (columns 8 * dn + 2 * (lane % 4) + c of the thread's fragments):
// strides 1 and >= 8 are inside the thread, strides 2 and 4 across the quad (lane bits 0 and 1).
__device__ __forceinline__ void wht_acc(float (&acc)[MT][ON][4], int lane) {
    const float norm = rsqrtf((float)D);
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
#pragma unroll
            for (int dn = 0; dn < ON; ++dn) {  // stride 1
                const float a = acc[mi][dn][2 * hr], b = acc[mi][dn][2 * hr + 1];
                acc[mi][dn][2 * hr] = a + b;
                acc[mi][dn][2 * hr + 1] = a - b;
            }
#pragma unroll
            for (int ls = 1; ls <= 2; ls <<= 1) {  // strides 2, 4
                const bool upper = lane & ls;
#pragma unroll
                for (int dn = 0; dn < ON; ++dn)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const float x = acc[mi][dn][2 * hr + c];
                        const float o = __shfl_xor_sync(0xffffffffu, x, ls);
                        acc[mi][dn][2 * hr + c] = upper ? o - x : x + o;
                    }
            }
#pragma unroll
            for (int hs = 1; hs < ON; hs <<= 1)  // strides 8, 16, ...
#pragma unroll
                for (int dn = 0; dn < ON; ++dn)
                    if (!(dn & hs))
#pragma unroll
                        for (int c = 0; c < 2; ++c) {
                            const float a = acc[mi][dn][2 * hr + c], b = acc[mi][dn + hs][2 * hr + c];
                            acc[mi][dn][2 * hr + c] = a + b;
                            acc[mi][dn + hs][2 * hr + c] = a - b;
                        }
#pragma unroll
            for (int dn = 0; dn < ON; ++dn) {
                acc[mi][dn][2 * hr] *= norm;
                acc[mi][dn][2 * hr + 1] *= norm;
            }
        }
}


// Block schedule shared by both roles: NBA tile blocks (tile g = bi / BPT), then (exact_phase) the exact blocks
// up to the CTA's last visible key.
struct Schedule {
    int nba, nb, E0, E, e_end;
};

__device__ __forceinline__ Schedule schedule(int n_tiles, int sink_len, int win_len, int n, int M, int r0,
                                             bool exact_phase) {
    Schedule sc;
    sc.nba = n_tiles * BPT;
    sc.E0 = sink_len + win_len;
    sc.E = sc.E0 + n;
    // the CTA's last query: rows r0 .. min(M, r0 + BM) - 1; one head's rows unless the block straddles two
    const int r_last = min(M, r0 + BM) - 1;
    const int q_last = (r0 / n == r_last / n) ? r_last % n : n - 1;
    sc.e_end = min(sc.E, sc.E0 + q_last + 1) * (int)exact_phase;
    sc.nb = sc.nba + (sc.e_end + BN - 1) / BN;
    return sc;
}

#if K_INT8
#include "prefill_int8.cuh"
#endif

// The CTA's rows r0 .. min(M, r0 + BM) - 1 of the G * n folded rows (row j * n + i: query head h * G + j, token
// i), its KV head h and sequence b. Row order: grid (ceil(G n / BM), Hkv, B), blockIdx.x a block of BM consecutive
// folded rows, which may straddle two heads. heavy_first (one sequence, n >= BM): grid (Hkv, G, ceil(n / BM)),
// blockIdx.z one head's block of BM tokens counted from the chunk's end, so the CTAs that see the most keys launch
// first and the launch ends on its lightest instead of its heaviest (FA3's causal order; a chunk's exact phase is
// causal). Split tiles (splits > 1, one sequence, row order): grid (ceil(G n / BM), Hkv, splits), blockIdx.z the
// split. The maps read only blockIdx, gridDim and the arguments, so the late uses compute them again instead of
// holding them through the tile loop (a map with divisions, held, spilled the mma.sync r32 config at 255
// registers).
struct CtaRows {
    int h, b, r0, M;
};

__device__ __forceinline__ CtaRows cta_rows(int G, int n, int heavy_first, int batch) {
    CtaRows c;
    // one expression in every map (batch 1 in the heavy and split ones): a select between the maps spilled b
    c.b = min((int)blockIdx.z, batch - 1);
    if (heavy_first) {
        const int j = blockIdx.y;
        c.h = blockIdx.x;
        c.r0 = j * n + (gridDim.z - 1 - blockIdx.z) * BM;
        c.M = (j + 1) * n;
    } else {
        c.h = blockIdx.y;
        c.r0 = blockIdx.x * BM;
        c.M = G * n;
    }
    return c;
}

// --- the kernel ---------------------------------------------------------------------------------------
// grid (ceil(G * n / BM), Hkv, B), or heavy_first (B = 1) (Hkv, G, ceil(n / BM)), or split tiles (B = 1)
// (ceil(G * n / BM), Hkv, splits) (cta_rows); NT threads, kvarn_prefill_smem_bytes of dynamic shared memory.
//   splits > 1: split z takes tiles [z * split_tiles, (z + 1) * split_tiles) and, the last one, the exact
//         phase; instead of out it writes its rows unnormalized to ws (f32: [splits][Hkv][G * n][D] rows,
//         then [splits][Hkv][G * n] pairs (m, l): the row's running max in log2 units and its sum of
//         exp2(score - m)), which MERGE_NAME combines into out.
//   q, out: [B, G * Hkv, n, D] with element strides (D contiguous, rows 16-byte aligned)
//   pool: records; tile_table [B][table_stride] int32 slots: record (b, g, h) at
//         pool + (tile_table[b * table_stride + g] * Hkv + h) * RECORD_BYTES
//   sink/window buffers [B, Hkv, cap, D] (contiguous, live prefixes sink_len / win_len);
//   chunk k, v [B, Hkv, n, D] with element strides (D contiguous).
extern "C" __global__ void __launch_bounds__(NT, 1) KERNEL_NAME(
    const q_t* __restrict__ q, long long q_sb, long long q_sh, long long q_sn,
    q_t* __restrict__ out, long long o_sb, long long o_sh, long long o_sn,
    const u8* __restrict__ pool, const int* __restrict__ tile_table, int table_stride, int n_tiles,
    const cache_t* sink_k, const cache_t* sink_v, int sink_cap, int sink_len,
    const cache_t* win_k, const cache_t* win_v, int win_cap, int win_len,
    const cache_t* chunk_k, const cache_t* chunk_v, long long ck_sb, long long ck_sh, long long ck_st,
    long long cv_sb, long long cv_sh, long long cv_st,
    int Hkv, int G, int n, float scale_log2, int batch, int heavy_first, float* __restrict__ ws, int splits,
    int split_tiles) {
    extern __shared__ __align__(128) u8 smem[];
#if __CUDA_ARCH__ >= 900
    // The next kernel of the stream may launch once every CTA of this one runs, if it asked to (programmatic
    // dependent launch): the cache's append after a chunk (ops/append.py), whose compression then takes the SMs
    // this grid leaves idle and those its first CTAs free, instead of starting after the last one. A kernel that
    // asks must wait (griddepcontrol.wait) before it touches what this one reads or writes.
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
    u8* sQ = smem;
    u8* sRec = smem + OFF_SM_REC;
    u8* sLut = smem + OFF_SM_LUT;
    float* sRowf = reinterpret_cast<float*>(smem + OFF_SM_ROWF);
    u8* sStage = smem + OFF_SM_STAGE;
    const u32 mbars = smem_addr(smem + OFF_SM_MBAR);
    const StageHandoff stages{mbars, mbars + 8 * NSTAGE};

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    stages.init(tid);
    const CtaRows cr = cta_rows(G, n, heavy_first, batch);
    const int h = cr.h, b = cr.b, r0 = cr.r0, M = cr.M;
    if (splits > 1) {  // this split's tiles: the table's columns from its first on
        const int g0 = (int)blockIdx.z * split_tiles;
        tile_table += g0;
        n_tiles = max(0, min(split_tiles, n_tiles - g0));
    }
    const Schedule sc = schedule(n_tiles, sink_len, win_len, n, M, r0, (int)blockIdx.z == splits - 1 || splits <= 1);

    if (warp >= NC) {
        // ================= producers =================
#if WGMMA
        if (REG_TRADE) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
#endif
        const int ptid = tid - NC * 32;
        const int pg = ptid / GT, gtid = ptid - pg * GT;  // producer group, thread within it
        Params P;
        P.kp = reinterpret_cast<uint2*>(smem + OFF_SM_PAR + pg * SM_PAR1);
        P.cr = P.kp + D;
        P.vp = reinterpret_cast<uint2*>(reinterpret_cast<float*>(P.cr) + D);
        P.rs = P.vp + T;
        P.red = reinterpret_cast<float*>(P.vp + T) + T;
        const ExactSource src{sink_k, sink_v, sink_cap, sink_len, win_k, win_v, win_cap, win_len, chunk_k, chunk_v,
                              ck_sb, ck_sh, ck_st, cv_sb, cv_sh, cv_st};
        // records through a ring of RSLOTS slots (tile g in slot g % RSLOTS): a group fetches tile g + RSLOTS
        // as soon as it is done with tile g, so each record has at least one other tile's time to land
        // part: 0 the whole record, FETCH_HALVES' 1 (A) or 2 (B)
        auto fetch = [&](int g, int part) {
            const long long slot = tile_table[(long long)b * table_stride + g];
            const u8* srcp = pool + (slot * Hkv + h) * (long long)REC;
            u8* dst = sRec + (g % RSLOTS) * REC;
#if K_INT8
            for (int i = gtid; i < REC / 16; i += GT) cp_async16(dst + kint8_rec_chunk(i) * 16, srcp + i * 16, true);
#else
            if (part == 0) {
                for (int i = gtid; i < REC / 16; i += GT) cp_async16(dst + i * 16, srcp + i * 16, true);
            } else {
                copy_record_part(dst, srcp, part, gtid);
            }
#endif
            cp_async_commit();
        };
        if (n_tiles > 0) {
            build_luts(sLut, ptid);
            for (int g = 0; g < RSLOTS && g < n_tiles; ++g)
                if (g % NG == pg) {
                    if (FETCH_HALVES) {
                        fetch(g, 1);
                        fetch(g, 2);
                    } else {
                        fetch(g, 0);
                    }
                }
            bar_sync(BAR_PROD, PT);  // the byte tables are written
        }
        const u8* rec = sRec;
        // An exact block's copies are waited for (and its stage handed over) only after the group's next
        // block has been issued, so two of a group's blocks are in flight instead of one (a block's copies take
        // a memory latency to land, about as long as the consumers' MMAs on it). `pend`: the group's exact
        // block that is issued and not yet handed over (-1: none).
        int pend = -1;
        auto hand_over = [&](int stage, bool newest_in_flight) {
            if (newest_in_flight) cp_async_wait_group<1>();  // all but the block just issued have landed
            else cp_async_wait_all();
            fence_operands_for_wgmma();
            stages.fill_done(stage);
        };
        for (int bi = 0, s = 0; bi < sc.nb; ++bi, s = s + 1 == NSTAGE ? 0 : s + 1) {
            if (NG > 1 && s / BPT != pg) continue;  // another group's stage
            u8* st = sStage + s * ST_BYTES;
            if (bi < sc.nba) {
                const int g = bi / BPT, t0 = (bi - g * BPT) * BN;
                if (t0 == 0) {  // a new tile: its record, factors and parameters
                    // the group's next tile g + NG may stay in flight (FETCH_HALVES: tile g's part B)
                    if (FETCH_HALVES || (AHEAD == 1 && g + NG < n_tiles)) cp_async_wait_group<1>();
                    else cp_async_wait_all();
                    bar_sync(BAR_GROUP + pg, GT);  // record g landed (and the last tile's red was read)
                    rec = sRec + (g % RSLOTS) * REC;
                    tile_partial_max(rec, P.red, gtid);
                    bar_sync(BAR_GROUP + pg, GT);
                    float m[6];
                    group_maxima(P.red, m);
                    const TileFactors f = tile_factors(m);
                    tile_params(rec, f, P, gtid);
                    bar_sync(BAR_GROUP + pg, GT);  // parameters written
                    if (bi >= NSTAGE) stages.wait_empty(s, bi);  // the consumers are done with this stage
                    if (gtid == 0)  // the tile factors, read by the consumers at the tile's first block (the int8
                                    // K operand's scores carry no power of two: fK = 1)
                        *reinterpret_cast<float2*>(st + ST_KD + ST_VD) =
                            make_float2(K_INT8 ? 1.f : f.fk, __int_as_float(f.e_v));
                } else if (bi >= NSTAGE) {
                    stages.wait_empty(s, bi);
                }
#if K_INT8
                kint8_stage_k(rec, st, t0, gtid);  // also the block's row scales
#else
                dequant_k(rec, P, sLut, st, t0, gtid);
#endif
                dequant_v(rec, P, sLut, st + ST_KD, t0, gtid);
                fence_operands_for_wgmma();
                if (t0 + BN == T) {  // the tile's last block: its record's slot goes to tile g + RSLOTS
                    bar_sync(BAR_GROUP + pg, GT);
                    if (g + RSLOTS < n_tiles) fetch(g + RSLOTS, FETCH_HALVES ? 2 : 0);
                }
                stages.fill_done(s);
                if (FETCH_HALVES && t0 == 0) {  // part B of tile g landed, part A's regions are read: A of g + 1
                    cp_async_wait_all();
                    bar_sync(BAR_GROUP + pg, GT);
                    if (g + 1 < n_tiles) fetch(g + 1, 1);
                }
            } else {
                // The consumers free this stage's previous block (bi - NSTAGE) only after reading blocks up to
                // bi - NSTAGE + CONSUMER_HOLD (wgmma's consumers keep a block until the next one's scores are
                // issued with its P . V), so a pending block among those is handed over before the wait: with
                // one producer group it never is (its blocks are consecutive), with two it can be (a group's
                // blocks come in runs of BPT, NSTAGE - BPT apart).
                if (pend >= 0 && bi >= NSTAGE && pend <= bi - NSTAGE + CONSUMER_HOLD) {
                    hand_over(pend % NSTAGE, false);
                    pend = -1;
                }
                if (bi >= NSTAGE) stages.wait_empty(s, bi);
                load_exact_block(src, b, h, Hkv, (bi - sc.nba) * BN, sc.E, st, st + ST_EK, gtid);
                if (pend >= 0) hand_over(pend % NSTAGE, true);
                pend = bi;
            }
        }
        if (pend >= 0) hand_over(pend % NSTAGE, false);
        return;
    }

    // ================= consumers =================
#if WGMMA
    if (REG_TRADE) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
#endif
    // the rows this warp multiplies: its own (mma.sync) or its warpgroup's 64 (wgmma)
    constexpr int MMA_ROWS = WGMMA ? 64 : RPW;
    // the warpgroup index broadcast from lane 0 (as CUTLASS's canonical_warp_group_idx): the compiler then
    // knows it is warp-uniform and keeps the wgmma descriptors derived from it in uniform registers
    const int mma_row0 = WGMMA ? __shfl_sync(0xffffffffu, warp >> 2, 0) * 64 : warp * RPW;
    const u8* sQw = sQ + q_off(mma_row0, 0);
    RowState st;
    float acc[MT][ON][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            st.m[mi][hr] = NEG_INF;
            st.l[mi][hr] = 0.f;
            const int r = r0 + warp * RPW + mi * 16 + hr * 8 + (lane >> 2);
            st.qi[mi][hr] = r < M ? r % n : n - 1;
        }
#pragma unroll
        for (int dn = 0; dn < ON; ++dn)
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[mi][dn][k] = 0.f;
    }
    auto load_rowf = [&]() {
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) st.rowf[mi][hr] = sRowf[warp * RPW + mi * 16 + hr * 8 + (lane >> 2)];
    };
    // the MMA's rows, for skipping exact blocks none of them sees (uniform over a warpgroup for wgmma)
    const int wr0 = r0 + mma_row0, wr1 = min(M, wr0 + MMA_ROWS) - 1;
    const bool w_rows = wr0 < M;
    const bool w_one_head = w_rows && wr0 / n == wr1 / n;
    const int wq_last = !w_rows ? -1 : (w_one_head ? wr1 % n : n - 1);
    const int wq_first = !w_rows ? n : (w_one_head ? wr0 % n : 0);

    if (sc.nba > 0) stage_q<true>(sQ, sRowf, q, q_sb, q_sh, q_sn, b, h, G, n, r0, M, scale_log2, warp, lane);
    else stage_q<false>(sQ, sRowf, q, q_sb, q_sh, q_sn, b, h, G, n, r0, M, scale_log2, warp, lane);
    bar_sync(BAR_CONS, NC * 32);
    load_rowf();
    // the tile factors: fK of the block's tile, and its eV against the running max eV_run (see the header):
    // P' = p * 2^-kf, kf = min(eV_run - eV, KF_MAX) (a clamped kf makes P' 0 in f16 all the same: p <= 1)
    constexpr int KF_MAX = 64;
    int ev_run = -(1 << 20);  // no tile yet
    float fk = 1.f, kf = 0.f, lsc = 1.f;
    auto tile_factor = [&](int bi, const u8* stg) {
        float rescale = 1.f;
        if (bi % BPT == 0) {
            const float2 fac = *reinterpret_cast<const float2*>(stg + ST_KD + ST_VD);
            const int ev_g = __float_as_int(fac.y), ev_new = max(ev_run, ev_g);
            rescale = pow2f(ev_run - ev_new);  // exact; 0 on the first tile (the accumulator is still 0)
            const int k = min(ev_new - ev_g, KF_MAX);
            fk = K_INT8 ? 1.f : fac.x;  // (the int8 scores carry no power of two)
            kf = (float)k;
            lsc = exp2i(k);
            ev_run = ev_new;
        }
        return rescale;
    };
    // the tiles are done: back to the original domain, q unrotated
    auto end_of_tiles = [&]() {
        const float fv_run = pow2f(ev_run);
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
            for (int dn = 0; dn < ON; ++dn)
#pragma unroll
                for (int k = 0; k < 4; ++k) acc[mi][dn][k] *= fv_run;
        wht_acc(acc, lane);
        bar_sync(BAR_CONS, NC * 32);  // every consumer is done reading the rotated q
        const CtaRows late = cta_rows(G, n, heavy_first, batch);
        stage_q<false>(sQ, sRowf, q, q_sb, q_sh, q_sn, late.b, late.h, G, n, late.r0, late.M, scale_log2, warp,
                       lane);
        bar_sync(BAR_CONS, NC * 32);
        load_rowf();
    };
    auto release = [&](int bi) {
        if (bi + NSTAGE < sc.nb) stages.release(bi);
    };
#if WGMMA
    // A turn issues the block's S = Q . K^T together with the previous block's P . V and waits for the scores;
    // the block's softmax runs while the P . V finishes, which it waits for before rescaling the accumulator
    // and packing its P (FA3's intra-warpgroup overlap). With two
    // consumer warpgroups the turns alternate (FA3's ping-pong): one warpgroup's MMAs run while the other
    // does its softmax.
    constexpr bool PINGPONG = NC == 8;
    const int wg = mma_row0 / 64;
    if (PINGPONG && wg == 1) bar_arrive(BAR_TURN, 256);  // the first turn is warpgroup 0's
    float s[1][SN][4];
    u32 pa[BN / 16][4];
    // Q_REGS: the tile phase's A operand, this warpgroup's rotated rows staged above, read from shared memory
    // once (the exact phase re-stages sQ and reads it by descriptor)
    u32 qa[D / 16][4];
    if (Q_REGS && sc.nba > 0) load_q_frags(sQw, warp, lane, qa);
    int pv_bi = -1;  // the block whose P . V is pending (its P in pa), -1: none
    // SCORES: 0 none, 1 a tile block's, 2 an exact block's (K at sK); PV: 0 none, 1 a tile block's, 2 an
    // exact block's pending P . V. Each combination is one straight-line MMA sequence (a branch between
    // warpgroup_arrive and the MMAs would make ptxas serialize every wgmma).
    auto turn = [&](auto scores_kind, auto pv_kind, int kbi) {
        constexpr int SC = decltype(scores_kind)::value, PV = decltype(pv_kind)::value;
        if (PINGPONG) bar_sync(BAR_TURN + wg, 256);
        if (SC != 0 || PV != 0) {
            // the operands' shared-memory addresses from the dynamic buffer's symbol, read afresh per turn (a
            // volatile read): ptxas then builds the wgmma descriptors in uniform registers and advances them
            // by UIADD3; from the base it keeps in a vector register (the one stage_q and the row loads use)
            // it built each k-step's descriptor in vector registers and moved it over (4 R2UR per wgmma)
            u32 smem_base;
            asm volatile("mov.u32 %0, smem;\n" : "=r"(smem_base));
            const u32 aQw = smem_base + q_off(mma_row0, 0), aStage = smem_base + OFF_SM_STAGE;
            const u32 sK = aStage + (kbi % NSTAGE) * ST_BYTES;
            const u32 pst = aStage + (pv_bi % NSTAGE) * ST_BYTES;
            fence_acc(s[0]);
            fence_acc(acc[0]);
            if constexpr (Q_REGS && SC == 1) fence_frags(qa);  // the wgmma reads them asynchronously
            cute::warpgroup_arrive();
            if constexpr (SC == 1 && Q_REGS) issue_scores_regq(qa, sK, s[0]);
            if constexpr (SC == 1 && !Q_REGS) issue_scores<true>(aQw, sK, s[0]);
            if constexpr (SC == 2) issue_scores<false>(aQw, sK, s[0]);
            if constexpr (SC != 0 && PV != 0) cute::warpgroup_commit_batch();  // the scores, a batch of their own
            if constexpr (PV == 1) issue_pv<true>(pa, pst + ST_KD, acc[0]);
            if constexpr (PV == 2) issue_pv<false>(pa, pst + ST_EK, acc[0]);
            cute::warpgroup_commit_batch();
        }
        if (PINGPONG) bar_arrive(BAR_TURN + (wg ^ 1), 256);
        if constexpr (SC != 0 && PV != 0) {
            // only the scores: the P . V runs on beside this block's softmax (FA3's intra-warpgroup overlap);
            // finish_pv waits for it before the accumulator is rescaled and pa rewritten
            cute::warpgroup_wait<1>();
            fence_acc(s[0]);
            if constexpr (Q_REGS && SC == 1) fence_frags(qa);
        } else {
            cute::warpgroup_wait<0>();
            fence_acc(s[0]);
            fence_acc(acc[0]);
            if constexpr (Q_REGS && SC == 1) fence_frags(qa);
            if (PV != 0) release(pv_bi);
            pv_bi = -1;
        }
    };
    // after a turn that issued scores and a P . V: wait for the P . V, free its stage
    auto finish_pv = [&]() {
        cute::warpgroup_wait<0>();
        fence_acc(acc[0]);
        if constexpr (Q_REGS) fence_frags(qa);
        release(pv_bi);
        pv_bi = -1;
    };
    using K0 = cuda::std::integral_constant<int, 0>;
    using K1 = cuda::std::integral_constant<int, 1>;
    using K2 = cuda::std::integral_constant<int, 2>;
    // the pending P . V's kind: none, a tile block's or an exact block's
    auto pending = [&]() { return pv_bi < 0 ? 0 : pv_bi < sc.nba ? 1 : 2; };
    for (int bi = 0; bi < sc.nb; ++bi) {
        const u8* stg = sStage + (bi % NSTAGE) * ST_BYTES;
        stages.wait_full(bi);
        float a_acc[MT][2];
        if (bi < sc.nba) {
            const float rescale = tile_factor(bi, stg);
            // (each branch waits where it must: ptxas serializes every wgmma if any path could write an
            // operand of one in flight, and it does not see that two tests of one condition agree)
            if (pending() == 1) {
                turn(K1{}, K1{}, bi);
                softmax_scores<true>(s, fk, kf, lsc, rescale, st, lane, 0, 0, 0, false, a_acc);
                finish_pv();
            } else {
                turn(K1{}, K0{}, bi);
                softmax_scores<true>(s, fk, kf, lsc, rescale, st, lane, 0, 0, 0, false, a_acc);
            }
            rescale_acc(acc, a_acc);
            pack_p<false>(s[0], pa);
            pv_bi = bi;
            if (bi == sc.nba - 1) {
                turn(K0{}, K1{}, 0);
                end_of_tiles();
            }
        } else {
            const int e0 = (bi - sc.nba) * BN;
            if (e0 < sc.E0 + wq_last + 1) {  // some row of this warpgroup sees a key of the block
                const bool need_mask = e0 + BN > min(sc.E, sc.E0 + wq_first + 1);  // some key is hidden from some row
                if (pending() == 2) {
                    turn(K2{}, K2{}, bi);
                    softmax_scores<false>(s, 1.f, 0.f, 1.f, 1.f, st, lane, e0, sc.E, sc.E0, need_mask, a_acc);
                    finish_pv();
                } else {
                    turn(K2{}, K0{}, bi);
                    softmax_scores<false>(s, 1.f, 0.f, 1.f, 1.f, st, lane, e0, sc.E, sc.E0, need_mask, a_acc);
                }
                rescale_acc(acc, a_acc);
                pack_p<(bool)CACHE_BF16>(s[0], pa);
                pv_bi = bi;
            } else {  // no scores, but a turn all the same: the turns stay paired across the warpgroups
                if (pending() == 2) turn(K0{}, K2{}, 0);
                else turn(K0{}, K0{}, 0);
                release(bi);
            }
        }
    }
    // the last P . V (an exact block's: a tile block's was flushed at the end of the tiles)
    if (pending() == 2) turn(K0{}, K2{}, 0);
    else turn(K0{}, K0{}, 0);
    if (PINGPONG && wg == 0) bar_sync(BAR_TURN, 256);  // warpgroup 1's last arrival
#else
#if K_INT8
    KFold fold;
#endif
    for (int bi = 0; bi < sc.nb; ++bi) {
        const u8* stg = sStage + (bi % NSTAGE) * ST_BYTES;
        stages.wait_full(bi);
        if (bi < sc.nba) {
            const float rescale = tile_factor(bi, stg);
#if K_INT8
            if (bi % BPT == 0) kint8_fold(fold, sQw, stg, lane);
            attend_block_i8(fold, stg, stg + ST_KD, kf, rescale, st, acc, lane);
#else
            attend_block<true>(sQw, stg, stg + ST_KD, fk, kf, lsc, rescale, st, acc, lane, 0, 0, 0, false);
#endif
            release(bi);
            if (bi == sc.nba - 1) end_of_tiles();
        } else {
            const int e0 = (bi - sc.nba) * BN;
            if (e0 < sc.E0 + wq_last + 1) {  // some row of this warp sees a key of the block
                const bool need_mask = e0 + BN > min(sc.E, sc.E0 + wq_first + 1);  // some key is hidden from some row
                attend_block<false>(sQw, stg, stg + ST_EK, 1.f, 0.f, 1.f, 1.f, st, acc, lane, e0, sc.E, sc.E0,
                                    need_mask);
            }
            release(bi);
        }
    }
#endif

    // ---- normalize and store ----
    const int tq = lane & 3;
    const CtaRows fin = cta_rows(G, n, heavy_first, batch);
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float l = st.l[mi][hr];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float inv = 1.f / l;
            const int r = fin.r0 + warp * RPW + mi * 16 + hr * 8 + (lane >> 2);
            if (r < fin.M && splits > 1) {  // the split's row as it is, and its (m, l), for MERGE_NAME
                // 32-bit offsets: ops.prefill.split_plan splits only grids of at most half the SMs, so the
                // workspace stays far below 2^31 floats
                const int row = ((int)blockIdx.z * Hkv + fin.h) * (G * n) + r;
#pragma unroll
                for (int dn = 0; dn < ON; ++dn)
                    *reinterpret_cast<float2*>(ws + row * D + dn * 8 + 2 * tq) =
                        make_float2(acc[mi][dn][2 * hr], acc[mi][dn][2 * hr + 1]);
                if (tq == 0)
                    *reinterpret_cast<float2*>(ws + splits * Hkv * G * n * D + 2 * row) = make_float2(st.m[mi][hr], l);
            } else if (r < fin.M) {
                const int j = r / n, i = r - j * n;
                q_t* orow = out + fin.b * o_sb + (long long)(fin.h * G + j) * o_sh + (long long)i * o_sn;
#pragma unroll
                for (int dn = 0; dn < ON; ++dn)
                    *reinterpret_cast<u32*>(orow + dn * 8 + 2 * tq) =
                        pack_q(acc[mi][dn][2 * hr] * inv, acc[mi][dn][2 * hr + 1] * inv);
            }
        }
}


// --- the split-tile merge --------------------------------------------------------------------------------
// grid (ceil(G * n / 4), Hkv, 1), 128 threads: one warp per folded row r of KV head blockIdx.y. Combines the
// splits' rows in ws (the layout above): out = sum_z 2^(m_z - m) acc_z / sum_z 2^(m_z - m) l_z, m = max_z m_z
// (a split whose rows saw no key has m_z = -inf and weighs nothing).
extern "C" __global__ void __launch_bounds__(128) MERGE_NAME(const float* __restrict__ ws, q_t* __restrict__ out,
                                                             long long o_sh, long long o_sn, int Hkv, int G, int n,
                                                             int splits) {
    const int lane = threadIdx.x & 31, h = blockIdx.y;
    const long long rows = (long long)G * n, r = (long long)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (r >= rows) return;
    const float* ml = ws + (long long)splits * Hkv * rows * D;
    float m = NEG_INF;
    for (int z = 0; z < splits; ++z) m = fmaxf(m, ml[((z * Hkv + h) * rows + r) * 2]);
    float acc[D / 64][2] = {};
    float l = 0.f;
    for (int z = 0; z < splits; ++z) {
        const long long base = (z * Hkv + h) * rows + r;
        const float mz = ml[base * 2];
        const float w = mz == NEG_INF ? 0.f : exp2f(mz - m);
        l = fmaf(w, ml[base * 2 + 1], l);
        const float* prow = ws + base * D;
#pragma unroll
        for (int p = 0; p < D / 64; ++p) {
            const float2 a = *reinterpret_cast<const float2*>(prow + 2 * (lane + 32 * p));
            acc[p][0] = fmaf(w, a.x, acc[p][0]);
            acc[p][1] = fmaf(w, a.y, acc[p][1]);
        }
    }
    const float inv = 1.f / l;
    const int j = (int)(r / n), i = (int)(r - (long long)j * n);
    q_t* orow = out + (long long)(h * G + j) * o_sh + (long long)i * o_sn;
#pragma unroll
    for (int p = 0; p < D / 64; ++p)
        *reinterpret_cast<u32*>(orow + 2 * (lane + 32 * p)) = pack_q(acc[p][0] * inv, acc[p][1] * inv);
}
