// The int8 K operand of the fused prefill kernel (K_INT8 = 1; FusedConfig(k_operand="int8")): tile K-scores
// on int8 tensor cores against the 4-bit codes, no dequantization of K. Included by prefill_fused.cu just
// before the kernel (it uses that file's helpers, layouts and RowState); V keeps the f16 path.
//
// Arithmetic (rotated domain, uniform quantizer: K[t][c] = row_scale[t] (chan_min[c] + chan_step[c] code[c][t])):
//   q_rot . K[t] = row_scale[t] (sum_c a[c] (code[c][t] - 8) + bias),  a[c] = q_rot[c] chan_step[c],
//                                                                    bias = sum_c q_rot[c] (chan_min[c] + 8 chan_step[c])
// q_rot is the f16 row of sQ (q_rot times a power of two per row, as the f16 path's; rowf undoes it).
// Per (row, tile) the consumers fold a in registers into two int8 levels (the decode kernel's two-level fold):
//   x = a * 127 / max|a|, hi = rint(x), lo = rint(254 (x - hi))   (|x - hi - lo / 254| <= 1/508 per channel)
// The producers write 16 (code - 8) as s8 (exact: the code's nibble moved to the byte's high half, XOR 0x80;
// one LOP3 for the odd token of a byte, a shift more for the even one), so
//   acc_hi = sum_c hi[c] 16 (code - 8), acc_lo likewise       (mma.sync m16n8k32 s8 x s8 -> s32, exact;
//                                                             |acc| <= 256 * 127 * 128 < 2^24, exact in f32)
//   score  = fa f32(254 acc_hi + acc_lo) + bias,  fa = max|a| / (127 * 16 * 254)
//   (one IMAD, one I2F, one FMA per score: |254 acc_hi + acc_lo| < 255 * 2^22 < 2^31, exact in int32)
// times row_scale[t] (the f16 operand carries the row scales; these integer codes cannot), then online_softmax
// multiplies by rowf (scale log2(e) / s_r) with the tile factor fK = 1 (the producers write it so).
// kvarn_cutlass.prefill._int8_tile_logits is the same arithmetic in torch.
//
// Layouts. Record ring: the K code section is copied with its 16-byte chunks permuted (decode.cu's swz), so
// that the producers' ldmatrix.trans of channel-major nibbles is bank-conflict-free. Stage (the f16 path's
// kd region, which is larger): the B fragments of the score MMA for the block, then chan_step and
// chan_min + 8 chan_step (f32 [D] each) and the block's row scales (f32 [BN]):
//   frag (k-step s of 32 channels, n8 tile nt, lane l of the consumer warp) = uint2 (b0, b1) at
//   ((s * SN + nt) * 32 + kint8_slot(nt, l)) * 8; b0 = channels 32 s + 4 (l % 4) + [0, 4) of token 8 nt + l / 4,
//   b1 the same + 16. kint8_slot permutes the 32 slots of an n8 tile so that the producers' stores (4 tokens x
//   8 channels per lane) and the consumers' loads (one LDS.64 per fragment) are both conflict-free.

#if !defined(K_INT8) || !K_INT8
#error "prefill_int8.cuh is the K_INT8 variant"
#endif
static_assert(!WGMMA, "the int8 K operand is an mma.sync variant");
static_assert(!LLOYD_MAX, "the int8 K operand needs integer code values (uniform quantizer)");
static_assert(MT == 1, "the int8 K operand keeps one m16 tile per warp (16 rows): its query levels live in registers");
static_assert(D % 32 == 0 && BN % 32 == 0, "32-channel k-steps, 32-token chunks");

constexpr int KI8_KST = D / 32;       // k-steps of the score MMA
constexpr int KI8_CH = BN / 32;       // 32-token chunks of a block
constexpr int KI8_CPR = T / 32;       // 16-byte chunks per channel of the K code section
constexpr int KI8_KCHUNKS = D * T / 2 / 16;
constexpr int KI8_LFOLD = 254;
constexpr int KI8_CS = D * BN;        // stage offsets (bytes) of chan_step and mid = chan_min + 8 chan_step
constexpr int KI8_MID = KI8_CS + 4 * D;
constexpr int KI8_RS = KI8_MID + 4 * D;
static_assert(KI8_RS + 4 * BN <= ST_KD, "the int8 operands fit the f16 kd region of a stage");

// decode.cu's chunk swizzle of a code section (CPR chunks per row): chunk i of the section lives at i ^ f(i / 8);
// the ldmatrix rows r(m, k) = 16 (m / 2) + 2 (m % 2) + 4 (k / 2) + k % 2 of one chunk column then fall on
// 8 distinct 16-byte bank groups (tests/test_decode.py checks the function).
template <int CPR>
__device__ __forceinline__ constexpr int kint8_swz(int i) {
    const int L = i >> 3;
    const int f = CPR == 1 ? (L & 1) << 1 : CPR == 2 ? (L & 1) | ((L & 2) << 1) : CPR == 4 ? (L >> 1) & 3
                                                                                          : ((L >> 1) & 6) | (L & 1);
    return i ^ f;
}
// where record chunk i goes in its shared-memory slot (the K code section swizzled, the rest as is)
__device__ __forceinline__ int kint8_rec_chunk(int i) {
    const int k = i - OFF_K_CODES / 16;
    return (k >= 0 && k < KI8_KCHUNKS) ? OFF_K_CODES / 16 + kint8_swz<KI8_CPR>(k) : i;
}
__device__ __forceinline__ int kint8_ldsm_row(int lane) {
    const int m = lane >> 3, k = lane & 7;
    return 16 * (m >> 1) + 2 * (m & 1) + 4 * (k >> 1) + (k & 1);
}
__device__ __forceinline__ int kint8_slot(int nt, int l) { return l ^ (((nt & 1) << 3) | (((l >> 4) & 1) << 2)); }

// --- producers: one block's K operand, factors and row scales -------------------------------------------
// Unit = 32 channels (k-step s) x 32 tokens (chunk tc): one ldmatrix.x4.trans of the nibbles (rows = channels
// r(m, k)); lane (g, q) then holds channels 4q + [0, 4) (x0 / y0) and 16 + 4q + [0, 4) (x1 / y1) of tokens
// 4g, 4g + 1 (x) and 4g + 2, 4g + 3 (y), which are exactly the b0 / b1 words of those four tokens.
__device__ __forceinline__ void kint8_stage_k(const u8* rec, u8* st, int t0, int gtid) {
    constexpr int UNITS = KI8_KST * KI8_CH, GW = GT / 32, UPW = (UNITS + GW - 1) / GW;
    const int w = gtid >> 5, lane = gtid & 31, g = lane >> 2, q = lane & 3;
    const int lrow = kint8_ldsm_row(lane);
    constexpr u32 HM = 0xF0F0F0F0u, SX = 0x80808080u;
#pragma unroll
    for (int ui = 0; ui < UPW; ++ui) {
        const int u = w + ui * GW;
        if (UNITS % GW != 0 && u >= UNITS) break;  // D = 64 with 32-token blocks: 2 units for 4 warps
        const int s = u / KI8_CH, tc = u - s * KI8_CH;
        const int chunk = (32 * s + lrow) * KI8_CPR + (t0 >> 5) + tc;
        u32 r[4];
        ldsm_x4_t(r, rec + OFF_K_CODES + 16 * kint8_swz<KI8_CPR>(chunk));
        const u32 x0 = __byte_perm(r[0], r[1], 0x6420u), y0 = __byte_perm(r[0], r[1], 0x7531u);
        const u32 x1 = __byte_perm(r[2], r[3], 0x6420u), y1 = __byte_perm(r[2], r[3], 0x7531u);
        // 16 (code - 8) as s8 per byte: (16 code) ^ 0x80
        const u32 b0[4] = {((x0 << 4) & HM) ^ SX, (x0 & HM) ^ SX, ((y0 << 4) & HM) ^ SX, (y0 & HM) ^ SX};
        const u32 b1[4] = {((x1 << 4) & HM) ^ SX, (x1 & HM) ^ SX, ((y1 << 4) & HM) ^ SX, (y1 & HM) ^ SX};
        const int nt = tc * 4 + (g >> 1);
        u8* base = st + (s * SN + nt) * 256;
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // token 4g + j of the chunk: column 4 (g % 2) + j of n8 tile nt
            const int l = 16 * (g & 1) + 4 * j + q;
            *reinterpret_cast<uint2*>(base + kint8_slot(nt, l) * 8) = make_uint2(b0[j], b1[j]);
        }
    }
    float* cs = reinterpret_cast<float*>(st + KI8_CS);
    float* mid = reinterpret_cast<float*>(st + KI8_MID);
#pragma unroll
    for (int c = gtid; c < D; c += GT) {
        const float step = scale_at(rec + OFF_CHAN_STEP, c);
        cs[c] = step;
        mid[c] = fmaf(8.f, step, scale_at(rec + OFF_CHAN_MIN, c));
    }
    float* rs = reinterpret_cast<float*>(st + KI8_RS);
    for (int t = gtid; t < BN; t += GT) rs[t] = scale_at(rec + OFF_ROW_SCALE, t0 + t);
}

// --- consumers: the per-tile fold and one tile block ------------------------------------------------------
struct KFold {
    u32 hi[KI8_KST][4], lo[KI8_KST][4];  // A fragments of the two levels per k-step
    float fa[2], bias[2];                // rows g, g + 8: max|a| / (127 * 16 * 254), the centering bias
};

__device__ __forceinline__ u32 kint8_pack4(u32 a, u32 b, u32 c, u32 d) {
    return __byte_perm(__byte_perm(a, b, 0x0040u), __byte_perm(c, d, 0x0040u), 0x5410u);
}
constexpr float KI8_MAGIC = 12582912.f;  // 1.5 * 2^23: x + MAGIC holds rint(x) in its low mantissa bits

// The fold of the warp's 16 rows against one tile (factors from any block of it). Thread (g, q) takes rows
// g, g + 8 and channels 32 s + 16 h + 4 q + [0, 4) (the A fragment slots); rows reduce over the quad.
// head_dim <= 128: the products a stay in registers between the max and the quantization (2 D / 4 of them);
// D = 256 computes them twice (the registers would spill).
constexpr bool KI8_ONE_PASS = D <= 128;
__device__ __forceinline__ void kint8_fold(KFold& f, const u8* sQw, const u8* stg, int lane) {
    const float* cs = reinterpret_cast<const float*>(stg + KI8_CS);
    const float* mid = reinterpret_cast<const float*>(stg + KI8_MID);
    const int g = lane >> 2, q = lane & 3;
    auto qrow = [&](int s, int hr, int hh, float (&x)[4]) {
        const int c = 32 * s + 16 * hh + 4 * q;
        const uint2 w = *reinterpret_cast<const uint2*>(sQw + ((g + 8 * hr) * QS + c) * 2);
        const float2 a = __half22float2(u2h(w.x)), b = __half22float2(u2h(w.y));
        x[0] = a.x; x[1] = a.y; x[2] = b.x; x[3] = b.y;
    };
    float amax[2] = {0.f, 0.f}, bias[2] = {0.f, 0.f};
    float av[KI8_ONE_PASS ? KI8_KST : 1][2][2][4];  // [s][hh][hr][i]: a = q_rot * chan_step
#pragma unroll
    for (int s = 0; s < KI8_KST; ++s)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int c = 32 * s + 16 * hh + 4 * q;
            const float4 sv = *reinterpret_cast<const float4*>(cs + c);
            const float4 mv = *reinterpret_cast<const float4*>(mid + c);
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                float x[4];
                qrow(s, hr, hh, x);
                const float a[4] = {x[0] * sv.x, x[1] * sv.y, x[2] * sv.z, x[3] * sv.w};
                amax[hr] = fmaxf(amax[hr], fmaxf(fmaxf(fabsf(a[0]), fabsf(a[1])), fmaxf(fabsf(a[2]), fabsf(a[3]))));
                bias[hr] = fmaf(x[0], mv.x, fmaf(x[1], mv.y, fmaf(x[2], mv.z, fmaf(x[3], mv.w, bias[hr]))));
                if constexpr (KI8_ONE_PASS)
#pragma unroll
                    for (int i = 0; i < 4; ++i) av[KI8_ONE_PASS ? s : 0][hh][hr][i] = a[i];
            }
        }
    float inv[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        amax[hr] = fmaxf(amax[hr], __shfl_xor_sync(0xffffffffu, amax[hr], 1));
        amax[hr] = fmaxf(amax[hr], __shfl_xor_sync(0xffffffffu, amax[hr], 2));
        bias[hr] += __shfl_xor_sync(0xffffffffu, bias[hr], 1);
        bias[hr] += __shfl_xor_sync(0xffffffffu, bias[hr], 2);
        inv[hr] = amax[hr] > 0.f ? __frcp_rn(amax[hr]) * 127.f : 0.f;  // |x| <= 127 (1 + 2^-23) < 127.5
        f.fa[hr] = amax[hr] * (1.f / (127.f * 16.f * (float)KI8_LFOLD));
        f.bias[hr] = bias[hr];
    }
#pragma unroll
    for (int s = 0; s < KI8_KST; ++s)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float sva[4];
            if constexpr (!KI8_ONE_PASS) {
                const float4 sv = *reinterpret_cast<const float4*>(cs + 32 * s + 16 * hh + 4 * q);
                sva[0] = sv.x; sva[1] = sv.y; sva[2] = sv.z; sva[3] = sv.w;
            }
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                float a[4];
                if constexpr (KI8_ONE_PASS) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) a[i] = av[KI8_ONE_PASS ? s : 0][hh][hr][i];
                } else {
                    float x[4];
                    qrow(s, hr, hh, x);
#pragma unroll
                    for (int i = 0; i < 4; ++i) a[i] = x[i] * sva[i];
                }
                u32 hb[4], lb[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    // h = MAGIC + rint(x); t = MAGIC - 254 rint(x) (exact: 255 MAGIC is an f32, the FMA rounds an
                    // exact integer); lo = rint(254 x + t - MAGIC) in the low byte of MAGIC + ...
                    const float xv = a[i] * inv[hr];
                    const float h = __fadd_rn(xv, KI8_MAGIC);
                    const float t = __fmaf_rn(h, -(float)KI8_LFOLD, 255.f * KI8_MAGIC);
                    hb[i] = __float_as_uint(h);
                    lb[i] = __float_as_uint(__fmaf_rn(xv, (float)KI8_LFOLD, t));
                }
                f.hi[s][hr + 2 * hh] = kint8_pack4(hb[0], hb[1], hb[2], hb[3]);
                f.lo[s][hr + 2 * hh] = kint8_pack4(lb[0], lb[1], lb[2], lb[3]);
            }
        }
}

__device__ __forceinline__ void kint8_mma(int (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One tile block: S from the int8 operands, online softmax, acc += P . V (V as attend_block<true>).
// kf: the tile factor exponent folded into the exponential (an integer >= 0 as a float; online_softmax's
// 2^kf is rebuilt from it here: one register less across the block loop, which head_dim 256 needs).
__device__ __forceinline__ void attend_block_i8(const KFold& f, const u8* sK, const u8* sV, float kf,
                                                float acc_rescale, RowState& st, float (&acc)[MT][ON][4], int lane) {
    const float* rs = reinterpret_cast<const float*>(sK + KI8_RS);
    // n8 tile by n8 tile (its two integer accumulators become its 4 scores at once: 8 live integer registers
    // instead of 16 SN, which keeps the 384-thread and head_dim 256 configs free of spills)
    float s[MT][SN][4];
#pragma unroll
    for (int nt = 0; nt < SN; ++nt) {
        int ah[4] = {0, 0, 0, 0}, al[4] = {0, 0, 0, 0};
#pragma unroll
        for (int ks = 0; ks < KI8_KST; ++ks) {
            const uint2 b = *reinterpret_cast<const uint2*>(sK + ((ks * SN + nt) * 32 + kint8_slot(nt, lane)) * 8);
            kint8_mma(ah, f.hi[ks], b.x, b.y);
            kint8_mma(al, f.lo[ks], b.x, b.y);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int hr = k >> 1;
            s[0][nt][k] = fmaf(f.fa[hr], (float)(ah[k] * KI8_LFOLD + al[k]), f.bias[hr]);
        }
    }
    // the row scales after all scores (inside the n8 loop their loads raised the D = 256 build past 255 registers)
#pragma unroll
    for (int nt = 0; nt < SN; ++nt) {
        const float2 r = *reinterpret_cast<const float2*>(rs + nt * 8 + 2 * (lane & 3));  // columns 2q, 2q + 1
        s[0][nt][0] *= r.x; s[0][nt][1] *= r.y;
        s[0][nt][2] *= r.x; s[0][nt][3] *= r.y;
    }
    online_softmax<true>(s, 1.f, kf, exp2i((int)kf), acc_rescale, st, acc, lane, 0, 0, 0, false);

#pragma unroll
    for (int kt = 0; kt < BN / 16; ++kt) {
        u32 pa[4];
        pa[0] = pack_f16(s[0][2 * kt][0], s[0][2 * kt][1]);
        pa[1] = pack_f16(s[0][2 * kt][2], s[0][2 * kt][3]);
        pa[2] = pack_f16(s[0][2 * kt + 1][0], s[0][2 * kt + 1][1]);
        pa[3] = pack_f16(s[0][2 * kt + 1][2], s[0][2 * kt + 1][3]);
#pragma unroll
        for (int d2 = 0; d2 < D / 16; ++d2) {
            u32 bfr[4];
            const int t = kt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            const int c = d2 * 16 + (lane >> 4) * 8;
            ldsm_x4_t(bfr, sV + (t * QS + c) * 2);
            mma16816<false>(acc[0][2 * d2], pa, bfr[0], bfr[1]);
            mma16816<false>(acc[0][2 * d2 + 1], pa, bfr[2], bfr[3]);
        }
    }
}
