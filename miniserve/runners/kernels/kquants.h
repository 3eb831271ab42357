// K-quant weight rows (ggml's Q4_K, Q5_K, Q6_K super-blocks of 256 weights, as stored in GGUF
// files; Q3_K's, Q2_K's and IQ4_XS's, their own sections at the end, in simpler orders) against activation rows quantized to int8 (ms_a8k, llama.cpp's block_q8_K): the
// activation quantizer, one-row dequantizers, and dot products of one weight row against NB
// activation rows.
//
// Formats (ggml-common.h; fp16 = IEEE half; q are unsigned quants, sc/m 6-bit scales/mins):
//   Q4_K, 144 bytes: {fp16 d, dmin; u8 scales[12]; u8 qs[128]}
//       8 sub-blocks of 32: w = d*sc[s] * q - dmin*m[s]; qs[32p + l]: low nibble = sub-block
//       2p element l, high nibble = sub-block 2p+1 element l.
//   Q5_K, 176 bytes: {fp16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}
//       as Q4_K with a 5th bit: bit s of qh[l] is bit 4 of sub-block s's element l.
//   Q6_K, 210 bytes: {u8 ql[128]; u8 qh[64]; i8 scales[16]; fp16 d}
//       16 groups of 16: w = d*sc[g] * (q - 32); per half h of 128 weights, element l < 32:
//       q[l] = ql[l] & 15 | (qh[l] & 3) << 4, q[l+32] = ql[l+32] & 15 | (qh[l] >> 2 & 3) << 4,
//       q[l+64] = ql[l] >> 4 | (qh[l] >> 4 & 3) << 4, q[l+96] = ql[l+32] >> 4 | (qh[l] >> 6) << 4
//       (ql, qh, scales offset by 64h, 32h, 8h).
//
// How a dot product is computed, in every build. Per super-block i and activation row, exact
// integer sums:
//   Q4_K, Q5_K: two totals, A = sum over sub-blocks s of sc[s] * (q . xq over s) and B = sum
//     over s of m[s] * (bsums[2s] + bsums[2s + 1]) -- the mins applied once per super-block
//     through the activation block sums, never per element. Then in float (mskq_k45_float):
//     fa = fa + (float)A * (d * dx), fb = fb + (float)B * (dmin * dx), and y = fa - fb. One
//     total a super-block (not lanes) so that AMX tiles (amx.h), which give whole sub-blocks'
//     dot products, find the same integers.
//   Q6_K: 16 "A" lanes, A lane (g0, h) = sum over groups g in {g0, g0 + 8} of sc[g] * (q . xq
//     over weights 8h .. 8h + 8 of g), q unsigned (0..63); B lane t = sc[2t] bsums[2t] +
//     sc[2t+1] bsums[2t+1], for the -32 offset. (mskq_lane6 gives the lane numbers: the order
//     vpdpwssd leaves them in.) Lanes L and L + 8 are added as integers (exact: every sum stays
//     below 2^31), leaving 8; 32 B[t] is taken from A lane t (its scale is the same d). Then
//     per lane, in float: fa[l] = fa[l] + (float)A8[l] * (d * dx), and y = tree8(fa).
// A fixed order, the same float operations whichever build, NB or slot j a row has -- so
// results are bit-identical across NB and across the AVX-512 (+ AMX), AVX2 and plain builds
// (with -ffp-contract=off, as decode.cpp is built: no multiply and add may be fused).
//
// The three builds differ only in how the integer lanes are found:
//   AVX-512 + VNNI: 64 weights a register; vpdpbusd (u8 weights x s8 activations, 4 products a
//     lane), pairs of such lane vectors packed to int16 (sums < 2^15: exact) and multiplied by
//     the scales with vpdpwssd; each unpacked weight register reused for all NB rows. From 8
//     activation rows (Q6_K: 16; decode.cpp's Kernels::tmin), rows are laid out 16 at a time
//     as tiles (mskq_t45, mskq_t6: a lane a weight row), where one vpdpbusd against 4
//     broadcast activation bytes is 64 products with no lanes to fold; the totals are the same
//     integers, so the bits are the same.
//   AVX2 + FMA: 32 weights a register; vpmaddubsw (pairs, no saturation: 2*63*127 < 2^15), then
//     vpmaddwd by the scales, as llama.cpp does; the 4-weight sums paired into the A lanes with
//     vphaddd. Matrices packed at load 8 rows a strip (Q4_K: mskq_p45x8, Q5_K: mskq_p5x8, Q6_K:
//     mskq_p6x8) hold a row a lane instead: 4 weights of each of 8 rows a register, nothing to
//     pair.
//   otherwise: plain integer loops over the unpacked quants.
// (Q3_K, Q2_K, IQ4_XS: one or two totals a super-block, vpmaddubsw + vpmaddwd on their rows as
// stored; Q3_K, Q2_K and IQ4_XS packed 16 rows a strip in the AVX-512 build, vpdpbusd, and 8
// in the AVX2 one, vpmaddubsw; see their sections. The lattice types IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S:
// each super-block decoded to signed bytes and scales, then one total, the last section.)

#ifndef MINISERVE_KQUANTS_H
#define MINISERVE_KQUANTS_H

#include <cmath>
#include <cstdint>
#include <cstring>

#include "quants.h"  // msq_iq4nl: IQ4_XS's values are IQ4_NL's

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#define MSKQ_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define MSKQ_AVX2 1
#endif
#if defined(MSKQ_AVX512) || defined(MSKQ_AVX2)
#define MSKQ_SIMD 1
#include <immintrin.h>
#endif

struct ms_a8k {  // 256 activations: x ~= d * qs, bsums[k] = sum of qs[16k .. 16k + 16)
    float d;
    int8_t qs[256];
    int16_t bsums[16];
};

#if defined(MSKQ_SIMD)
// Read-ahead: how many bytes past the weight block being read the SIMD loops ask for into L1 (a
// row streams from memory once per product), and whether the AVX2 build's packed strips ask at
// one activation row too. Chosen once, by the CPU's maker, from one-row passes over the 1B
// Q4_K_M shape in the AVX2 build (benchmarks/pass_time.py, best of 40):
//   AMD EPYC Zen 3: the strips on the hardware prefetchers alone 33-40 ms a pass; 4,096 ahead
//     25-28 ms; 8,192 ahead 20-26 ms (12,288 and 16,384 no better). The 1B Q6_K file went
//     53-59 -> 32-37 ms; the stored rows' loops gain too (Q5_K_M 38-63 -> 32-34 ms, IQ3_M
//     94-96 -> 60-69).
//   Intel Xeon (Sapphire Rapids, x86-64-v3 build): the strips' one row was faster on the
//     hardware alone (35.3-36.0 against 38.4-39.4 ms at 4,096 ahead).
// So AMD's CPUs take 8,192 and every row count; the rest, and the AVX-512 build (its one row
// always asks; tuned on Intel's and AMD's AVX-512 CPUs at 4,096), keep 4,096.
struct MskqAhead {
    int bytes;     // past the block being read
    bool one_row;  // the AVX2 build's K-quant strips (mskq_strip8_prefetch) ask at one row too
};
static MskqAhead mskq_choose_ahead() {
#if defined(MSKQ_AVX2) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    if (__builtin_cpu_is("amd")) return {8192, true};
#endif
    return {4096, false};
}
static const MskqAhead mskq_ahead = mskq_choose_ahead();
#endif

static inline float mskq_half(const uint8_t *p) {  // IEEE half -> float, exact
    uint16_t h;
    std::memcpy(&h, p, 2);
#if defined(MSKQ_SIMD) && defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3ffu;
    float f;
    if (e == 0) {  // zero or subnormal: m * 2^-24, exact
        f = (float)m * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    const uint32_t u = sign | (e == 31 ? 0x7f800000u | m << 13 : (e + 112) << 23 | m << 13);
    std::memcpy(&f, &u, 4);
    return f;
#endif
}

// Q4_K / Q5_K scales: 12 bytes -> u[0..1] = the 8 scales, u[2..3] = the 8 mins, one byte each.
//   bytes 0-3: sc[0..3] | sc[4..7] bits 4-5 << 6;  4-7: m[0..3] | m[4..7] bits 4-5 << 6;
//   8-11: sc[4..7] bits 0-3 | m[4..7] bits 0-3 << 4.
static inline void mskq_scales(const uint8_t *s, uint32_t *u) {
    uint32_t a[3];
    std::memcpy(a, s, 12);
    u[0] = a[0] & 0x3f3f3f3fu;
    u[1] = (a[2] & 0x0f0f0f0fu) | ((a[0] >> 6) & 0x03030303u) << 4;
    u[2] = a[1] & 0x3f3f3f3fu;
    u[3] = ((a[2] >> 4) & 0x0f0f0f0fu) | ((a[1] >> 6) & 0x03030303u) << 4;
}

static inline uint8_t mskq_byte(const uint32_t *u, int k) {  // byte k of u[], any endianness
    return (uint8_t)(u[k >> 2] >> (8 * (k & 3)));
}

static inline const uint8_t *mskq_xblock(const void *x, long xstride, int j, long i) {
    return (const uint8_t *)x + j * xstride + i * (long)sizeof(ms_a8k);
}

// ---------------------------------------------------------------- activations

// Per 256: d = amax / 127, q = nearest(x * (127 / amax)) (ties to even: cvtps2dq under the
// default rounding mode, and the 1.5 * 2^23 trick in the plain loop -- the same integers).
static void ms_quantize_a8k(const float *x, ms_a8k *y, long n) {
    for (long i = 0; i < n / 256; i++, x += 256) {
        ms_a8k *b = y + i;
        float amax = 0.f;
#if defined(MSKQ_AVX512)
        __m512 mx = _mm512_setzero_ps();
        for (int k = 0; k < 256; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
        amax = _mm512_reduce_max_ps(mx);
#elif defined(MSKQ_AVX2)
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 mx = _mm256_setzero_ps();
        for (int k = 0; k < 256; k += 8)
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        amax = _mm_cvtss_f32(m4);
#else
        for (int k = 0; k < 256; k++) {
            const float a = std::fabs(x[k]);
            amax = a > amax ? a : amax;
        }
#endif
        const float d = amax / 127.f, is = amax > 0.f ? 127.f / amax : 0.f;
        std::memcpy(&b->d, &d, 4);
#if defined(MSKQ_AVX512)
        const __m512 vs = _mm512_set1_ps(is);
        for (int k = 0; k < 16; k++) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * k), vs));
            _mm_storeu_si128((__m128i *)(b->qs + 16 * k), _mm512_cvtsepi32_epi8(q));
            b->bsums[k] = (int16_t)_mm512_reduce_add_epi32(q);
        }
#elif defined(MSKQ_AVX2)
        const __m256 vs = _mm256_set1_ps(is);
        for (int k = 0; k < 16; k++) {
            __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * k), vs));
            __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * k + 8), vs));
            __m256i w = _mm256_packs_epi32(q0, q1);  // per lane: q0 lo, q1 lo | q0 hi, q1 hi
            __m128i p = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
            // bytes now q0[0..4), q1[0..4), q0[4..8), q1[4..8): back to element order
            p = _mm_shuffle_epi32(p, _MM_SHUFFLE(3, 1, 2, 0));
            _mm_storeu_si128((__m128i *)(b->qs + 16 * k), p);
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(_mm256_add_epi32(q0, q1)),
                                      _mm256_extracti128_si256(_mm256_add_epi32(q0, q1), 1));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
            b->bsums[k] = (int16_t)_mm_cvtsi128_si32(s);
        }
#else
        for (int k = 0; k < 16; k++) {
            int sum = 0;
            for (int l = 0; l < 16; l++) {
                const float r = (x[16 * k + l] * is + 12582912.f) - 12582912.f;
                const int q = (int)r;
                b->qs[16 * k + l] = (int8_t)q;
                sum += q;
            }
            b->bsums[k] = (int16_t)sum;
        }
#endif
    }
}

// ---------------------------------------------------------------- dequantization (plain, exact)

static void ms_dequant_q4_K(const void *w, float *y, long n) {
    const uint8_t *b = (const uint8_t *)w;
    for (long i = 0; i < n / 256; i++, b += 144, y += 256) {
        const float d = mskq_half(b), dmin = mskq_half(b + 2);
        uint32_t u[4];
        mskq_scales(b + 4, u);
        const uint8_t *qs = b + 16;
        for (int p = 0; p < 4; p++) {
            const float d1 = d * mskq_byte(u, 2 * p), m1 = dmin * mskq_byte(u, 8 + 2 * p);
            const float d2 = d * mskq_byte(u, 2 * p + 1), m2 = dmin * mskq_byte(u, 9 + 2 * p);
            for (int l = 0; l < 32; l++) {
                y[64 * p + l] = d1 * (float)(qs[32 * p + l] & 15) - m1;
                y[64 * p + 32 + l] = d2 * (float)(qs[32 * p + l] >> 4) - m2;
            }
        }
    }
}

static void ms_dequant_q5_K(const void *w, float *y, long n) {
    const uint8_t *b = (const uint8_t *)w;
    for (long i = 0; i < n / 256; i++, b += 176, y += 256) {
        const float d = mskq_half(b), dmin = mskq_half(b + 2);
        uint32_t u[4];
        mskq_scales(b + 4, u);
        const uint8_t *qh = b + 16, *qs = b + 48;
        for (int p = 0; p < 4; p++) {
            const int s1 = 2 * p, s2 = 2 * p + 1;
            const float d1 = d * mskq_byte(u, s1), m1 = dmin * mskq_byte(u, 8 + s1);
            const float d2 = d * mskq_byte(u, s2), m2 = dmin * mskq_byte(u, 8 + s2);
            for (int l = 0; l < 32; l++) {
                const int q1 = (qs[32 * p + l] & 15) | ((qh[l] >> s1) & 1) << 4;
                const int q2 = (qs[32 * p + l] >> 4) | ((qh[l] >> s2) & 1) << 4;
                y[64 * p + l] = d1 * (float)q1 - m1;
                y[64 * p + 32 + l] = d2 * (float)q2 - m2;
            }
        }
    }
}

static inline void mskq_q6_unpack(const uint8_t *b, int8_t *q) {  // 256 quants, offset kept (0..63)
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        int8_t *o = q + 128 * h;
        for (int l = 0; l < 32; l++) {
            o[l] = (int8_t)((ql[l] & 15) | (qh[l] & 3) << 4);
            o[l + 32] = (int8_t)((ql[l + 32] & 15) | (qh[l] >> 2 & 3) << 4);
            o[l + 64] = (int8_t)((ql[l] >> 4) | (qh[l] >> 4 & 3) << 4);
            o[l + 96] = (int8_t)((ql[l + 32] >> 4) | (qh[l] >> 6) << 4);
        }
    }
}

static void ms_dequant_q6_K(const void *w, float *y, long n) {
    const uint8_t *b = (const uint8_t *)w;
    for (long i = 0; i < n / 256; i++, b += 210, y += 256) {
        const float d = mskq_half(b + 208);
        int8_t q[256];
        mskq_q6_unpack(b, q);
        for (int g = 0; g < 16; g++) {
            const float dg = d * (float)(int8_t)b[192 + g];
            for (int l = 0; l < 16; l++) y[16 * g + l] = dg * (float)(q[16 * g + l] - 32);
        }
    }
}

// ---------------------------------------------------------------- the float part, shared

// The fixed order a row's lane sums end in (the same in every build and for every NB).
static inline float mskq_tree8(const float *a) {
    float c[4];
    for (int k = 0; k < 4; k++) c[k] = a[k] + a[k + 4];
    return (c[0] + c[2]) + (c[1] + c[3]);
}

static inline float mskq_dx(const void *x, long xstride, int j, long i) {
    float d;
    std::memcpy(&d, mskq_xblock(x, xstride, j, i), 4);
    return d;
}

// Lane L = 4c + t of Q6_K's 16 "A" lanes, as vpdpwssd leaves them in the AVX-512 loop (c:
// 16-byte lane, t: int32 within it): groups g0 and g0 + 8, weights 8h .. 8h + 8 of each, with
// g0 = c + 4 (t >> 1), h = t & 1.
static inline int mskq_lane6(int g0, int h) { return 4 * (g0 & 3) + 2 * (g0 >> 2) + h; }

#if !defined(MSKQ_SIMD)
// The plain loops' products: dot[o] = q[8o .. 8o + 8) . x[8o .. 8o + 8), o < 32; q in 0..63
// (products fit int16: written so that the compiler vectorizes them).
template <typename Q>
static inline void mskq_dot8(const Q *q, const int8_t *x, int32_t *dot) {
    int16_t p[256];
    for (int k = 0; k < 256; k++) p[k] = (int16_t)(q[k] * x[k]);
    int32_t p2[128];
    for (int k = 0; k < 128; k++) p2[k] = (int32_t)p[2 * k] + p[2 * k + 1];
    for (int o = 0; o < 32; o++) dot[o] = (p2[4 * o] + p2[4 * o + 1]) + (p2[4 * o + 2] + p2[4 * o + 3]);
}
#endif

// ---------------------------------------------------------------- Q4_K and Q5_K

#if defined(MSKQ_SIMD)
static inline void mskq_prefetch(const uint8_t *p, int bytes) {
    const char *a = (const char *)p + mskq_ahead.bytes;
    for (int o = 0; o < bytes; o += 64) _mm_prefetch(a + o, _MM_HINT_T0);
}

// Which of 16 rows lane l of a tile (mskq_t45, mskq_t6) or a 16-row strip (mskq_p45s) holds: the
// order a 4 x 4 dword transpose leaves.
static inline int mskq_tile_row(int l) { return 4 * (l & 3) + (l >> 2); }

// A Q4_K (HI false) or Q5_K super-block of S rows side by side, repacked at load (mskq_p45 /
// mskq_p5: S = 16 for the AVX-512 build; mskq_p45x8 and mskq_p5x8: S = 8, for the AVX2 one;
// their comments say how the loops read them). q[p][m]'s lane holds its row's qs[32p + 4m .. +4]
// (low nibbles: sub-block 2p's weights 4m .. 4m + 3; high: sub-block 2p + 1's); Q5_K's h[m]'s
// lane its row's qh[4m .. +4] (byte e's bit s: sub-block s's weight 4m + e's fifth bit); the
// 6-bit scales and mins, d and dmin as stored.
template <int S, bool HI>
struct mskq_p45s {
    uint8_t q[4][8][4 * S];
    uint8_t h[HI ? 8 : 0][4 * S];
    uint8_t sc[8][S];      // [sub-block s][lane]
    uint8_t mn[4][2 * S];  // [t][2 lane + e]: min 2t + e (vpmovzxbw: int16 pairs)
    uint16_t d[S], dmin[S];
};

// S stored Q4_K (HI false) or Q5_K rows of n weights (w: the first, wrow bytes apart) -> n / 256
// packed blocks mskq_p45s<S, HI> (S = 16: lane l holding row mskq_tile_row(l); S = 8: lane r row r).
template <int S, bool HI>
static void mskq_pack45(long n, const void *w, long wrow, void *out) {
    const uint8_t *b = (const uint8_t *)w;
    mskq_p45s<S, HI> *o = (mskq_p45s<S, HI> *)out;
    const int bytes = HI ? 176 : 144, qs = HI ? 48 : 16;
    for (long i = 0; i < n / 256; i++) {
        mskq_p45s<S, HI> &p = o[i];
        for (int l = 0; l < S; l++) {
            const uint8_t *br = b + (S == 16 ? mskq_tile_row(l) : l) * wrow + i * bytes;
            uint32_t u[4];
            mskq_scales(br + 4, u);
            std::memcpy(&p.d[l], br, 2), std::memcpy(&p.dmin[l], br + 2, 2);
            for (int s = 0; s < 8; s++) p.sc[s][l] = mskq_byte(u, s), p.mn[s >> 1][2 * l + (s & 1)] = mskq_byte(u, 8 + s);
            for (int q = 0; q < 4; q++)
                for (int m = 0; m < 8; m++) std::memcpy(&p.q[q][m][4 * l], br + qs + 32 * q + 4 * m, 4);
            if constexpr (HI)
                for (int m = 0; m < 8; m++) std::memcpy(&p.h[m][4 * l], br + 16 + 4 * m, 4);
        }
    }
}

// Sub-block s's fifth bits from a Q5_K strip's h vector (bit s of each byte), at bit 4 of each
// byte (a 16-bit shift: the bit moved stays in its byte), to or into its masked nibbles.
template <typename V>
static inline V mskq_fifth(V h, int s);
#if defined(MSKQ_AVX512)
template <>
inline __m512i mskq_fifth(__m512i h, int s) {
    const __m512i v = s <= 4 ? _mm512_slli_epi16(h, (unsigned)(4 - s)) : _mm512_srli_epi16(h, (unsigned)(s - 4));
    return _mm512_and_si512(v, _mm512_set1_epi8(0x10));
}
#endif
template <>
inline __m256i mskq_fifth(__m256i h, int s) {
    const __m256i v = s <= 4 ? _mm256_slli_epi16(h, 4 - s) : _mm256_srli_epi16(h, s - 4);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

// An activation block's sub-block sums as int16 pairs (the packed rows' mins, AVX-512 and
// AVX2): dword t = (b_2t, b_2t+1), b_s the sum of
// sub-block s's 32 activations (bsums[2s] + bsums[2s + 1]; exact in int16: |b_s| <= 32 * 127).
static inline void mskq_bpairs(const uint8_t *xb, int32_t *bp) {
    const __m256i b32 = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xb + 260)), _mm256_set1_epi16(1));
    alignas(32) int32_t v[8];
    _mm256_store_si256((__m256i *)v, _mm256_packs_epi32(b32, b32));  // per 128-bit lane: b0-3 twice | b4-7 twice
    bp[0] = v[0], bp[1] = v[1], bp[2] = v[4], bp[3] = v[5];
}

// int16 pairs (k, k) as an int32 vpshufb control: bytes k (zero-extended, high byte zeroed)
#define MSKQ_W(k) ((int)(0x80008000u | (unsigned)(k) | (unsigned)(k) << 16))
// int16 word e of a 16-byte lane, repeated twice (for a sign-extended int16 source)
#define MSKQ_E(e) ((int)((unsigned)(2 * (e)) | (unsigned)(2 * (e) + 1) << 8 | \
                         (unsigned)(2 * (e)) << 16 | (unsigned)(2 * (e) + 1) << 24))
#endif

// The running sums a piece of a row leaves for the next (floats a weight row, for up to 8
// activation rows: Q4_K / Q5_K's 4 pairs x 16, Q6_K's 4 x 16).
#define MSKQ_STATE 128
// The same for a tile row (16 weight rows, up to 8 activation rows): Q6_K's 8 lane vectors a
// row, Q4_K / Q5_K's 2.
#define MSKQ_TILE_STATE (8 * 128)

#if defined(MSKQ_AVX512)
// A Q4_K / Q5_K super-block unpacked for the AVX-512 loop (what it computes from the block
// before meeting any activation row): kept for a chunk of weight rows when many activation rows
// pass, so that each block is unpacked once per product, not once per 8 rows.
struct mskq_u45 {
    __m512i wk[4], s01, s23;
    __m256i mins;
    float d, dmin;
};
static_assert(sizeof(mskq_u45) % 64 == 0 && alignof(mskq_u45) == 64, "unpacked blocks back to back, aligned");


template <bool HI>
static inline void mskq_unpack45(const uint8_t *b, mskq_u45 &o) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16),
                  nib = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
    // vpdpbusd of w[k] (below) gives sub-block 2k in lanes 0-7, 2k+1 in 8-15; vpackssdw of two
    // such puts, per 16-byte lane c, 4 words of one then 4 of the other: c < 2: sub-blocks 2k,
    // 2k + 2; c >= 2: 2k + 1, 2k + 3 -- the scales' words to match
    const __m512i c01 = _mm512_setr_epi32(MSKQ_W(0), MSKQ_W(0), MSKQ_W(2), MSKQ_W(2), MSKQ_W(0),
                                          MSKQ_W(0), MSKQ_W(2), MSKQ_W(2), MSKQ_W(1), MSKQ_W(1),
                                          MSKQ_W(3), MSKQ_W(3), MSKQ_W(1), MSKQ_W(1), MSKQ_W(3),
                                          MSKQ_W(3));
    const __m512i c23 = _mm512_add_epi32(c01, _mm512_set1_epi32(0x00040004));
    // the mins, each twice (the two bsums of its sub-block)
    const __m256i cm = _mm256_setr_epi32(MSKQ_W(0), MSKQ_W(1), MSKQ_W(2), MSKQ_W(3), MSKQ_W(4),
                                         MSKQ_W(5), MSKQ_W(6), MSKQ_W(7));
    uint32_t u[4];
    mskq_scales(b + 4, u);
    o.d = mskq_half(b), o.dmin = mskq_half(b + 2);
    const uint8_t *qs = b + (HI ? 48 : 16);
    // wk[k] = sub-blocks [2k | 2k + 1], the activations' order: qs[32k .. 32k + 32) in both
    // halves (a broadcast load: no shuffle), low nibbles kept in one, high in the other
    for (int k = 0; k < 4; k++)
        o.wk[k] = _mm512_and_si512(
            _mm512_srlv_epi64(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * k))), nib),
            m4);
    if (HI) {  // bit s of qh[l] -> bit 4 of sub-block s's weight l
        const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)));
        for (int k = 0; k < 4; k++) {
            const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << 2 * k)),
                                                   _mm256_set1_epi8((char)(1 << (2 * k + 1))), 1);
            o.wk[k] = _mm512_mask_add_epi8(o.wk[k], _mm512_test_epi8_mask(hb, bit), o.wk[k], sixteen);
        }
    }
    const __m512i scb = _mm512_set1_epi64((long long)(u[0] | (uint64_t)u[1] << 32));
    o.s01 = _mm512_shuffle_epi8(scb, c01), o.s23 = _mm512_shuffle_epi8(scb, c23);
    o.mins = _mm256_shuffle_epi8(_mm256_set1_epi64x((long long)(u[2] | (uint64_t)u[3] << 32)), cm);
}

// The 16 A lanes of one activation row (its ms_a8k block at xb) against a super-block's
// unpacked weights wk (64 a register) and the scales' words s01, s23 (per vpdpwssd's order):
// vpdpbusd, pairs packed to int16 (the lane sums stay below 2^15: exact), then the scales.
static inline __m512i mskq_lanes(const __m512i *wk, __m512i s01, __m512i s23, const uint8_t *xb) {
    const __m512i z = _mm512_setzero_si512();
    const __m512i p0 = _mm512_dpbusd_epi32(z, wk[0], _mm512_loadu_si512((const void *)(xb + 4)));
    const __m512i p1 = _mm512_dpbusd_epi32(z, wk[1], _mm512_loadu_si512((const void *)(xb + 68)));
    const __m512i p2 = _mm512_dpbusd_epi32(z, wk[2], _mm512_loadu_si512((const void *)(xb + 132)));
    const __m512i p3 = _mm512_dpbusd_epi32(z, wk[3], _mm512_loadu_si512((const void *)(xb + 196)));
    const __m512i s = _mm512_dpwssd_epi32(z, _mm512_packs_epi32(p0, p1), s01);
    return _mm512_dpwssd_epi32(s, _mm512_packs_epi32(p2, p3), s23);
}

// Two activation rows side by side (the first in lanes 0-7), for the loops that take rows in
// pairs: their A lanes L and L + 8 added (exact), their block sums' products with w (madd),
// and their scales dx.
static inline __m512i mskq_fold2(__m512i s0, __m512i s1) {
    return _mm512_add_epi32(_mm512_shuffle_i64x2(s0, s1, 0x44), _mm512_shuffle_i64x2(s0, s1, 0xEE));
}

static inline __m512i mskq_bsums2(const uint8_t *x0, const uint8_t *x1, __m512i w) {
    return _mm512_madd_epi16(
        _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(x0 + 260))),
                           _mm256_loadu_si256((const __m256i *)(x1 + 260)), 1),
        w);
}

static inline __m512 mskq_dx2(const uint8_t *x0, const uint8_t *x1) {
    float dx0, dx1;
    std::memcpy(&dx0, x0, 4);
    std::memcpy(&dx1, x1, 4);
    return _mm512_insertf32x8(_mm512_set1_ps(dx0), _mm256_set1_ps(dx1), 1);
}

// A row of n weights (n / 256 blocks) unpacked into `out`, an array of mskq_u45.
template <bool HI>
static void mskq_unpack45_row(long n, const void *w, void *out) {
    const uint8_t *b = (const uint8_t *)w;
    mskq_u45 *o = (mskq_u45 *)out;
    for (long i = 0; i < n / 256; i++) mskq_unpack45<HI>(b + i * (HI ? 176 : 144), o[i]);
}
#endif

// The float part of a Q4_K / Q5_K super-block, the same in every build and path (the AMX loop
// in decode.cpp too): A and B are the block's exact integer totals for one activation row,
// A = sum over sub-blocks s of sc[s] * (q . xq over s), B = sum over s of m[s] * (xq's sum over s).
static inline void mskq_k45_float(float &fa, float &fb, int32_t A, int32_t B, float d, float dmin, float dx) {
    fa = fa + (float)A * (d * dx);
    fb = fb + (float)B * (dmin * dx);
}

#if defined(MSKQ_AVX2)
// A Q4_K / Q5_K super-block for the AVX2 loops: sub-block s's 32 weights (wq[s], bytes 0..31)
// and its scale as int16 pairs (sv[s], for vpmaddwd), the 8 mins as int16 pairs (mins).
template <bool HI>
static inline void mskq_unpack45_v(const uint8_t *b, __m256i *wq, __m256i *sv, __m256i *mins) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(16);
    uint32_t u[4];
    mskq_scales(b + 4, u);
    const uint8_t *qs = b + (HI ? 48 : 16);
    const __m256i scb = _mm256_set1_epi64x((long long)(u[0] | (uint64_t)u[1] << 32));
    __m256i hb = HI ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
    for (int p = 0; p < 4; p++) {  // sub-blocks 2p, 2p + 1
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
        __m256i wl = _mm256_and_si256(q, m4), wh = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (HI) {  // bit 0 of each byte of hb is the current sub-block's; one shift per sub-block
            wl = _mm256_or_si256(wl, _mm256_and_si256(_mm256_slli_epi16(hb, 4), sixteen));
            hb = _mm256_srli_epi16(hb, 1);
            wh = _mm256_or_si256(wh, _mm256_and_si256(_mm256_slli_epi16(hb, 4), sixteen));
            hb = _mm256_srli_epi16(hb, 1);
        }
        wq[2 * p] = wl, wq[2 * p + 1] = wh;
        sv[2 * p] = _mm256_shuffle_epi8(scb, _mm256_set1_epi32(MSKQ_W(2 * p)));
        sv[2 * p + 1] = _mm256_shuffle_epi8(scb, _mm256_set1_epi32(MSKQ_W(2 * p + 1)));
    }
    const __m256i cm = _mm256_setr_epi32(MSKQ_W(0), MSKQ_W(1), MSKQ_W(2), MSKQ_W(3), MSKQ_W(4),
                                         MSKQ_W(5), MSKQ_W(6), MSKQ_W(7));
    *mins = _mm256_shuffle_epi8(_mm256_set1_epi64x((long long)(u[2] | (uint64_t)u[3] << 32)), cm);
}
#endif

#if defined(MSKQ_AVX512)
// Two rows' A lanes (a0: the first row's 16, a1 the second's) and B lanes (m: both rows' 8,
// the first in lanes 0-7) -> each 128-bit lane holds one total in all four of its ints:
// [A row 0 | B row 0 | A row 1 | B row 1]. Exact (integer sums).
static inline __m512i mskq_totals2(__m512i a0, __m512i a1, __m512i m) {
    const __m512i a = mskq_fold2(a0, a1);  // A lanes L and L + 8 added: row 0 in 0-7, row 1 in 8-15
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(4));
    const __m512i u = _mm512_add_epi32(_mm512_permutex2var_epi32(a, lo, m), _mm512_permutex2var_epi32(a, hi, m));
    const __m512i v = _mm512_add_epi32(u, _mm512_shuffle_epi32(u, (_MM_PERM_ENUM)0x4E));
    return _mm512_add_epi32(v, _mm512_shuffle_epi32(v, (_MM_PERM_ENUM)0xB1));
}

// [d | dmin | d | dmin] (dd, per 128-bit lane) x [dx0 | dx0 | dx1 | dx1]: the multipliers of
// mskq_totals2's lanes (each product as mskq_k45_float computes it).
static inline __m512 mskq_scales2(__m512 dd, const uint8_t *x0, const uint8_t *x1) {
    float dx0, dx1;
    std::memcpy(&dx0, x0, 4);
    std::memcpy(&dx1, x1, 4);
    return _mm512_mul_ps(dd, _mm512_insertf32x8(_mm512_set1_ps(dx0), _mm256_set1_ps(dx1), 1));
}
#endif

// PRE: w is the row unpacked (mskq_u45 blocks, AVX-512 only), else the row as stored. With
// PRE, a row may come in pieces of blocks: the running sums start from `state` (phase & 1,
// else from zero) and, unless phase & 2 (the last piece: y written), are left there -- the
// same float operations in the same order as one call over the whole row.
template <int NB, bool HI, bool PRE = false>
static inline void mskq_dot_k45(long n, const void *w, const void *x, long xstride, float *y,
                                long ystride, float *state = nullptr, int phase = 2) {
    const long bytes = HI ? 176 : 144, nb = n / 256;
    const uint8_t *b = (const uint8_t *)w;
    float fa[NB], fb[NB];  // per row: the A and B float sums
#if defined(MSKQ_AVX512)
    // NB == 1: the two sums as scalars; NB even: rows in pairs, one register a pair holding
    // [fa row 0 | fb row 0 | fa row 1 | fb row 1] (each four times)
    constexpr int NA = NB == 1 ? 1 : NB / 2;
    __m512 acc[NA];
    float fa1 = 0.f, fb1 = 0.f;
    for (int j = 0; j < NA; j++) acc[j] = PRE && (phase & 1) ? _mm512_loadu_ps(state + 16 * j) : _mm512_setzero_ps();
    if (NB == 1 && PRE && (phase & 1)) fa1 = state[0], fb1 = state[1];
    long i = 0;
    if constexpr (NB == 1) {
        // one row: its super-blocks two at a time, their totals found by one fold (as two
        // rows' are in the loop below), the float sums kept as [fa x4 | fb x4] and added block
        // by block in order: the same operations as mskq_k45_float's, a block's at a time
        __m256 acc1 = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(fa1)), _mm_set1_ps(fb1), 1);
        for (; i + 2 <= nb; i += 2, b += 2 * bytes) {
            mskq_u45 ub[2];
            if (!PRE) {
                mskq_prefetch(b, 2 * (int)bytes);
                mskq_unpack45<HI>(b, ub[0]);
                mskq_unpack45<HI>(b + bytes, ub[1]);
            }
            const mskq_u45 &u0 = PRE ? ((const mskq_u45 *)w)[i] : ub[0];
            const mskq_u45 &u1 = PRE ? ((const mskq_u45 *)w)[i + 1] : ub[1];
            const uint8_t *x0 = mskq_xblock(x, xstride, 0, i), *x1 = mskq_xblock(x, xstride, 0, i + 1);
            const __m512i mins = _mm512_inserti64x4(_mm512_castsi256_si512(u0.mins), u1.mins, 1);
            const __m512i t = mskq_totals2(mskq_lanes(u0.wk, u0.s01, u0.s23, x0),
                                           mskq_lanes(u1.wk, u1.s01, u1.s23, x1), mskq_bsums2(x0, x1, mins));
            const __m256 dd0 = _mm256_blend_ps(_mm256_set1_ps(u0.d), _mm256_set1_ps(u0.dmin), 0xF0);
            const __m256 dd1 = _mm256_blend_ps(_mm256_set1_ps(u1.d), _mm256_set1_ps(u1.dmin), 0xF0);
            const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(t),
                                           mskq_scales2(_mm512_insertf32x8(_mm512_castps256_ps512(dd0), dd1, 1), x0, x1));
            acc1 = _mm256_add_ps(acc1, _mm512_castps512_ps256(p));
            acc1 = _mm256_add_ps(acc1, _mm512_extractf32x8_ps(p, 1));
        }
        fa1 = _mm256_cvtss_f32(acc1);
        fb1 = _mm_cvtss_f32(_mm256_extractf128_ps(acc1, 1));
    }
    for (; i < nb; i++, b += bytes) {
        mskq_u45 ub;
        if (!PRE) {
            mskq_prefetch(b, (int)bytes);
            mskq_unpack45<HI>(b, ub);
        }
        const mskq_u45 &u = PRE ? ((const mskq_u45 *)w)[i] : ub;
        const __m512i *wk = u.wk, s01 = u.s01, s23 = u.s23;
        const __m256i mins = u.mins;
        const float d = u.d, dmin = u.dmin;
        // the 16 A lanes of a row (per vpdpwssd's order); lane sums < 4 * 31 * 127 < 2^15: the
        // int16 packing is exact
        auto lanes = [&](const uint8_t *xb) { return mskq_lanes(wk, s01, s23, xb); };
        if constexpr (NB == 1) {
            const uint8_t *xb = mskq_xblock(x, xstride, 0, i);
            const __m512i s = lanes(xb);
            const __m256i m = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xb + 260)), mins);
            const __m256i a8 = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
            // [A lanes 0-7 | B lanes 0-7] summed per half: lane 0 A, lane 8 B
            __m512i t = _mm512_inserti64x4(_mm512_castsi256_si512(a8), m, 1);
            t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(t, t, 0xB1));
            t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, (_MM_PERM_ENUM)0x4E));
            t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, (_MM_PERM_ENUM)0xB1));
            int32_t tv[16];
            _mm512_storeu_si512((void *)tv, t);
            float dx;
            std::memcpy(&dx, xb, 4);
            mskq_k45_float(fa1, fb1, tv[0], tv[8], d, dmin, dx);
        } else {
            const __m512i mins2 = _mm512_broadcast_i64x4(mins);
            const __m512 dd = _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(d), _mm512_set1_ps(dmin));
            for (int jp = 0; jp < NA; jp++) {
                const uint8_t *x0 = mskq_xblock(x, xstride, 2 * jp, i), *x1 = mskq_xblock(x, xstride, 2 * jp + 1, i);
                const __m512i t = mskq_totals2(lanes(x0), lanes(x1), mskq_bsums2(x0, x1, mins2));
                acc[jp] = _mm512_add_ps(acc[jp], _mm512_mul_ps(_mm512_cvtepi32_ps(t), mskq_scales2(dd, x0, x1)));
            }
        }
    }
    if (PRE && !(phase & 2)) {
        if (NB == 1)
            state[0] = fa1, state[1] = fb1;
        else
            for (int j = 0; j < NA; j++) _mm512_storeu_ps(state + 16 * j, acc[j]);
        return;
    }
    if constexpr (NB == 1) {
        fa[0] = fa1, fb[0] = fb1;
    } else {
        for (int jp = 0; jp < NA; jp++) {
            float a[16];
            _mm512_storeu_ps(a, acc[jp]);
            fa[2 * jp] = a[0], fb[2 * jp] = a[4], fa[2 * jp + 1] = a[8], fb[2 * jp + 1] = a[12];
        }
    }
#elif defined(MSKQ_AVX2)
    for (int j = 0; j < NB; j++) fa[j] = fb[j] = 0.f;
    for (long i = 0; i < nb; i++, b += bytes) {
        mskq_prefetch(b, (int)bytes);
        const float d = mskq_half(b), dmin = mskq_half(b + 2);
        __m256i wq[8], sv[8], mins;  // sub-block s's weights and scale (unpacked once for all rows)
        mskq_unpack45_v<HI>(b, wq, sv, &mins);
        for (int j = 0; j < NB; j++) {
            const uint8_t *xb = mskq_xblock(x, xstride, j, i);
            __m256i r = _mm256_setzero_si256();
            for (int s = 0; s < 8; s++)
                r = _mm256_add_epi32(r, _mm256_madd_epi16(
                    _mm256_maddubs_epi16(wq[s], _mm256_loadu_si256((const __m256i *)(xb + 4 + 32 * s))), sv[s]));
            const __m256i m = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xb + 260)), mins);
            // [A lanes | B lanes] summed per 128-bit half pair: A total in lane 0, B in lane 4
            __m256i t = _mm256_hadd_epi32(r, m);        // [r01 r23 m01 m23 | r45 r67 m45 m67]
            t = _mm256_hadd_epi32(t, t);                // [r0-3 m0-3 . . | r4-7 m4-7 . .]
            t = _mm256_add_epi32(t, _mm256_permute2x128_si256(t, t, 1));
            float dx;
            std::memcpy(&dx, xb, 4);
            mskq_k45_float(fa[j], fb[j], _mm256_extract_epi32(t, 0), _mm256_extract_epi32(t, 1), d, dmin, dx);
        }
    }
#else
    for (int j = 0; j < NB; j++) fa[j] = fb[j] = 0.f;
    for (long i = 0; i < nb; i++, b += bytes) {
        uint32_t u[4];
        mskq_scales(b + 4, u);
        const float d = mskq_half(b), dmin = mskq_half(b + 2);
        const uint8_t *qs = b + (HI ? 48 : 16), *qh = b + 16;
        uint8_t q[256];
        for (int p = 0; p < 4; p++)
            for (int l = 0; l < 32; l++) {
                q[64 * p + l] = qs[32 * p + l] & 15;
                q[64 * p + 32 + l] = qs[32 * p + l] >> 4;
            }
        if (HI)
            for (int s = 0; s < 8; s++)
                for (int l = 0; l < 32; l++) q[32 * s + l] |= (uint8_t)(((qh[l] >> s) & 1) << 4);
        for (int j = 0; j < NB; j++) {
            const uint8_t *xb = mskq_xblock(x, xstride, j, i);
            const int8_t *xq = (const int8_t *)(xb + 4);
            int16_t bs[16];
            std::memcpy(bs, xb + 260, 32);
            int32_t dot[8][4];  // sub-block, 8 weights
            mskq_dot8(q, xq, &dot[0][0]);
            int32_t A = 0, B = 0;
            for (int s = 0; s < 8; s++)
                A += (int32_t)mskq_byte(u, s) * ((dot[s][0] + dot[s][1]) + (dot[s][2] + dot[s][3]));
            for (int t = 0; t < 8; t++) B += (int32_t)mskq_byte(u, 8 + t) * (bs[2 * t] + bs[2 * t + 1]);
            mskq_k45_float(fa[j], fb[j], A, B, d, dmin, mskq_dx(x, xstride, j, i));
        }
    }
#endif
    for (int j = 0; j < NB; j++) y[j * ystride] = fa[j] - fb[j];
}

#if defined(MSKQ_AVX2)
// 8 int32 vectors -> one: lane w holds the sum of v[w]'s 8 lanes (exact: integers).
static inline __m256i mskq_sum8x8(const __m256i *v) {
    const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i g0 = _mm256_hadd_epi32(h01, h23), g1 = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20), _mm256_permute2x128_si256(g0, g1, 0x31));
}

// The AVX2 build, many activation rows: 8 weight rows (wrow bytes apart) against NB activation
// rows at once, y[j * ystride + r] for r < 8. Each pair's totals A and B are the same integers
// as in mskq_dot_k45 and its float sums the same operations in the same order, only carried
// out for 8 weight rows side by side (lane r: weight row r), so each block's totals need one
// transposing sum for the 8 rows instead of a horizontal sum and scalar arithmetic a pair.
template <int NB, bool HI>
static void mskq_dot_k45_r8(long n, const uint8_t *w, long wrow, const void *x, long xstride, float *y,
                            long ystride) {
    const long bytes = HI ? 176 : 144, nb = n / 256;
    __m256 fa[NB], fb[NB];
    for (int j = 0; j < NB; j++) fa[j] = fb[j] = _mm256_setzero_ps();
    __m256i ra[NB][8], rb[NB][8];  // per activation row, per weight row: A and B lanes
    for (long i = 0; i < nb; i++) {
        alignas(16) uint16_t dh[8], mh[8];
        for (int r = 0; r < 8; r++) {
            const uint8_t *b = w + r * wrow + i * bytes;
            mskq_prefetch(b, (int)bytes);
            std::memcpy(&dh[r], b, 2);
            std::memcpy(&mh[r], b + 2, 2);
            __m256i wq[8], sv[8], mins;
            mskq_unpack45_v<HI>(b, wq, sv, &mins);
            for (int j = 0; j < NB; j++) {
                const uint8_t *xb = mskq_xblock(x, xstride, j, i);
                __m256i acc = _mm256_setzero_si256();
                for (int s = 0; s < 8; s++)
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(
                        _mm256_maddubs_epi16(wq[s], _mm256_loadu_si256((const __m256i *)(xb + 4 + 32 * s))), sv[s]));
                ra[j][r] = acc;
                rb[j][r] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xb + 260)), mins);
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)dh));
        const __m256 dmin = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)mh));
        for (int j = 0; j < NB; j++) {  // mskq_k45_float, lane by lane
            float dx;
            std::memcpy(&dx, mskq_xblock(x, xstride, j, i), 4);
            const __m256 dxv = _mm256_set1_ps(dx);
            const __m256 a = _mm256_cvtepi32_ps(mskq_sum8x8(ra[j])), b = _mm256_cvtepi32_ps(mskq_sum8x8(rb[j]));
            fa[j] = _mm256_add_ps(fa[j], _mm256_mul_ps(a, _mm256_mul_ps(d, dxv)));
            fb[j] = _mm256_add_ps(fb[j], _mm256_mul_ps(b, _mm256_mul_ps(dmin, dxv)));
        }
    }
    for (int j = 0; j < NB; j++) _mm256_storeu_ps(y + j * ystride, _mm256_sub_ps(fa[j], fb[j]));
}

static void ms_dot8r_q4_K(long n, const void *w, long wrow, const void *x, long xstride, float *y, long ystride) {
    mskq_dot_k45_r8<8, false>(n, (const uint8_t *)w, wrow, x, xstride, y, ystride);
}
static void ms_dot8r_q5_K(long n, const void *w, long wrow, const void *x, long xstride, float *y, long ystride) {
    mskq_dot_k45_r8<8, true>(n, (const uint8_t *)w, wrow, x, xstride, y, ystride);
}

// Q4_K packed 8 rows at a time for the AVX2 build (decode.cpp's T_Q4_K_P8), as mskq_p45 for
// AVX-512 with 8 lanes: 8 rows' super-block i in 1,184 bytes (as stored: 1,152), lane r = row
// r. q[p][m]'s lane r holds that row's qs[32p + 4m .. +4] (low nibbles: sub-block 2p's weights
// 4m .. 4m + 3; high: sub-block 2p + 1's). vpmaddubsw against 4 broadcast activation bytes gives
// each row's pairs; a sub-block's 8 such (|sum| <= 8 * 2 * 15 * 127 < 2^15) add as int16, one
// vpmaddwd makes the row's int32 sum. The same integers A, B and float operations as
// mskq_dot_k45: the same bits.
// Q5_K likewise (T_Q5_K_P8, mskq_p5x8: 1,440 bytes, as stored 1,408), h[m]'s lane r holding row
// r's qh[4m .. +4] (mskq_fifth): the 5-bit pairs (|sum| <= 2 * 31 * 128) add as int16 4 at a
// time, two vpmaddwd a sub-block.
using mskq_p45x8 = mskq_p45s<8, false>;
using mskq_p5x8 = mskq_p45s<8, true>;
static_assert(sizeof(mskq_p45x8) == 1184 && sizeof(mskq_p45x8) % 32 == 0, "packed blocks back to back");
static_assert(sizeof(mskq_p5x8) == 1440 && sizeof(mskq_p5x8) % 32 == 0, "packed blocks back to back");
static void mskq_pack45x8_rows(long n, const void *w, long wrow, void *out) { mskq_pack45<8, false>(n, w, wrow, out); }
static void mskq_pack5x8_rows(long n, const void *w, long wrow, void *out) { mskq_pack45<8, true>(n, w, wrow, out); }

// Activation rows the packed AVX2 Q4_K strips (mskq_p45x8) take at once: 4 rows' integer sums
// and the unpacked weights fit AVX2's 16 registers; 8 rows' were spilled, a store each product
// step (8 rows of an L2-resident 256 x 2048 strip, one thread, Zen 3: 84-87 -> 77-79 us; Q6_K's
// strips, chunked alike, got slower: 148 -> 192 us).
constexpr int MSKQ_CHUNK = 4;

// An AVX2 K-quant strip's (mskq_p45x8, mskq_p5x8, mskq_p6x8, mskq_p3x8, mskq_p2x8, mskq_pxsx8)
// read-ahead from block b: from 2 activation rows always; one row where mskq_ahead says so (on
// Intel's CPUs one row streams on the hardware prefetchers alone).
template <int NB, typename P>
static inline void mskq_strip8_prefetch(const P *b) {
    if (NB > 1 || mskq_ahead.one_row) mskq_prefetch((const uint8_t *)b, (int)sizeof(P));
}
// An 8-row strip's float steps for super-block i from NB activation rows' exact totals I (a row
// a lane) and the rows' d (or dmin) as stored: fa = fa + (float)I * (d * dx), lane by lane, as
// the rows as stored take them; then the 8 rows' results out.
template <int NB>
static inline void mskq_strip8_float(const uint16_t *d16, const __m256i *I, const void *x, long xstride, long i,
                                     __m256 *fa) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d16));
    for (int j = 0; j < NB; j++) {
        float dx;
        std::memcpy(&dx, mskq_xblock(x, xstride, j, i), 4);
        fa[j] = _mm256_add_ps(fa[j], _mm256_mul_ps(_mm256_cvtepi32_ps(I[j]), _mm256_mul_ps(d, _mm256_set1_ps(dx))));
    }
}
template <int NB>
static inline void mskq_strip8_store(const __m256 *fa, float *y, long ystride) {
    for (int j = 0; j < NB; j++) {
        alignas(32) float v[8];
        _mm256_store_ps(v, fa[j]);
        for (int r = 0; r < 8; r++) y[j * ystride + r] = v[r];
    }
}

// The 8 rows of a packed strip (n / 256 blocks at w) against NB activation rows (xstride bytes
// apart): y[j * ystride + r] for rows r < 8.
template <int NB, bool HI>
static inline void mskq_dot_p45s8(long n, const void *w, const void *x, long xstride, float *y, long ystride) {
    typedef mskq_p45s<8, HI> P;
    const P *t = (const P *)w;
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 fa[NB], fb[NB];
    for (int j = 0; j < NB; j++) fa[j] = fb[j] = _mm256_setzero_ps();
    for (long i = 0; i < n / 256; i++) {
        const P &u = t[i];
        mskq_strip8_prefetch<NB>(t + i);
        __m256i A[NB];
        for (int j = 0; j < NB; j++) A[j] = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            const __m256i s0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)u.sc[2 * p]));
            const __m256i s1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)u.sc[2 * p + 1]));
            // MSKQ_CHUNK rows at a time; Q5_K, whose int16 sums are twice as many, 8 rows half as
            // many at a time, its weights unpacked once for the 4 chunks (`once`)
            constexpr int CH = HI && NB > MSKQ_CHUNK ? MSKQ_CHUNK / 2 : MSKQ_CHUNK;
            auto unpack = [&](int m, __m256i &wl, __m256i &wh) MSQ_INLINE_LAMBDA {
                const __m256i v = _mm256_load_si256((const __m256i *)u.q[p][m]);
                wl = _mm256_and_si256(v, m4), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                if constexpr (HI) {
                    const __m256i h = _mm256_load_si256((const __m256i *)u.h[m]);
                    wl = _mm256_or_si256(wl, mskq_fifth(h, 2 * p)), wh = _mm256_or_si256(wh, mskq_fifth(h, 2 * p + 1));
                }
            };
            // Q5_K with more than one chunk: the weights unpacked once, read back by each chunk
            // (the vector units are the busy ones, not the loads)
            constexpr bool once = HI && NB > CH;
            alignas(32) __m256i wu[once ? 8 : 1][2];
            if constexpr (once)
                for (int m = 0; m < 8; m++) unpack(m, wu[m][0], wu[m][1]);
            for (int j0 = 0; j0 < NB; j0 += CH) {
                constexpr int C = NB < CH ? NB : CH;
                __m256i lo[C], hi[C], lo32[C], hi32[C];
                for (int c = 0; c < C; c++) lo[c] = hi[c] = lo32[c] = hi32[c] = _mm256_setzero_si256();
                for (int m = 0; m < 8; m++) {
                    __m256i wl, wh;
                    if constexpr (once)
                        wl = _mm256_load_si256(&wu[m][0]), wh = _mm256_load_si256(&wu[m][1]);
                    else
                        unpack(m, wl, wh);
                    if constexpr (HI) {
#if !defined(__AVXVNNI__)
                        if (m == 4)  // the first 4 pieces' int16 sums into int32
                            for (int c = 0; c < C; c++) {
                                lo32[c] = _mm256_madd_epi16(lo[c], ones), hi32[c] = _mm256_madd_epi16(hi[c], ones);
                                lo[c] = hi[c] = _mm256_setzero_si256();
                            }
#endif
                    }
                    for (int c = 0; c < C; c++) {
                        const uint8_t *xq = mskq_xblock(x, xstride, j0 + c, i) + 4 + 64 * p + 4 * m;
                        int32_t a, e;
                        std::memcpy(&a, xq, 4), std::memcpy(&e, xq + 32, 4);
#if defined(__AVXVNNI__)  // int32 totals at once (one vpdpbusd): the same as the int16 sums' below
                        lo[c] = _mm256_dpbusd_avx_epi32(lo[c], wl, _mm256_set1_epi32(a));
                        hi[c] = _mm256_dpbusd_avx_epi32(hi[c], wh, _mm256_set1_epi32(e));
#else
                        lo[c] = _mm256_add_epi16(lo[c], _mm256_maddubs_epi16(wl, _mm256_set1_epi32(a)));
                        hi[c] = _mm256_add_epi16(hi[c], _mm256_maddubs_epi16(wh, _mm256_set1_epi32(e)));
#endif
                    }
                }
                for (int c = 0; c < C; c++) {
#if defined(__AVXVNNI__)
                    const __m256i l32 = lo[c], h32 = hi[c];
#else
                    __m256i l32 = _mm256_madd_epi16(lo[c], ones), h32 = _mm256_madd_epi16(hi[c], ones);
                    if constexpr (HI) l32 = _mm256_add_epi32(lo32[c], l32), h32 = _mm256_add_epi32(hi32[c], h32);
#endif
                    A[j0 + c] = _mm256_add_epi32(A[j0 + c], _mm256_add_epi32(_mm256_mullo_epi32(l32, s0), _mm256_mullo_epi32(h32, s1)));
                }
            }
        }
        __m256i mn[4];
        for (int k = 0; k < 4; k++) mn[k] = _mm256_cvtepu8_epi16(_mm_load_si128((const __m128i *)u.mn[k]));
        const __m256 d = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)u.d));
        const __m256 dmin = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)u.dmin));
        for (int j = 0; j < NB; j++) {
            const uint8_t *xb = mskq_xblock(x, xstride, j, i);
            int32_t bp[4];
            mskq_bpairs(xb, bp);
            __m256i B = _mm256_setzero_si256();
            for (int k = 0; k < 4; k++) B = _mm256_add_epi32(B, _mm256_madd_epi16(mn[k], _mm256_set1_epi32(bp[k])));
            float dx;
            std::memcpy(&dx, xb, 4);
            const __m256 dxv = _mm256_set1_ps(dx);
            fa[j] = _mm256_add_ps(fa[j], _mm256_mul_ps(_mm256_cvtepi32_ps(A[j]), _mm256_mul_ps(d, dxv)));
            fb[j] = _mm256_add_ps(fb[j], _mm256_mul_ps(_mm256_cvtepi32_ps(B), _mm256_mul_ps(dmin, dxv)));
        }
    }
    for (int j = 0; j < NB; j++) fa[j] = _mm256_sub_ps(fa[j], fb[j]);
    mskq_strip8_store<NB>(fa, y, ystride);
}

template <int NB>
static void mskq_dot_p45x8(long n, const void *w, const void *x, long xstride, float *y, long ystride) {
    mskq_dot_p45s8<NB, false>(n, w, x, xstride, y, ystride);
}
template <int NB>
static void mskq_dot_p5x8(long n, const void *w, const void *x, long xstride, float *y, long ystride) {
    mskq_dot_p45s8<NB, true>(n, w, x, xstride, y, ystride);
}
#endif

template <int NB>
static void ms_dot_q4_K(long n, const void *w, const void *x, long xstride, float *y,
                        long ystride) {
    mskq_dot_k45<NB, false>(n, w, x, xstride, y, ystride);
}

template <int NB>
static void ms_dot_q5_K(long n, const void *w, const void *x, long xstride, float *y,
                        long ystride) {
    mskq_dot_k45<NB, true>(n, w, x, xstride, y, ystride);
}

#if defined(MSKQ_AVX512)
// The same products from rows unpacked by ms_unpack_q4_K / ms_unpack_q5_K (the same bits).
template <int NB>
static void ms_dotu_q4_K(long n, const void *w, const void *x, long xstride, float *y,
                         long ystride, float *state, int phase) {
    mskq_dot_k45<NB, false, true>(n, w, x, xstride, y, ystride, state, phase);
}

template <int NB>
static void ms_dotu_q5_K(long n, const void *w, const void *x, long xstride, float *y,
                         long ystride, float *state, int phase) {
    mskq_dot_k45<NB, true, true>(n, w, x, xstride, y, ystride, state, phase);
}

static void ms_unpack_q4_K(long n, const void *w, void *out) { mskq_unpack45_row<false>(n, w, out); }
static void ms_unpack_q5_K(long n, const void *w, void *out) { mskq_unpack45_row<true>(n, w, out); }
#endif

#if defined(MSKQ_AVX512)
// ---------------------------------------------------------------- Q4_K / Q5_K tiles

// 16 weight rows' super-block i laid out for many activation rows (a prompt): each 32-bit lane
// of a register holds 4 weights of one row, the 16 lanes 16 rows at the same 4 positions, so one
// vpdpbusd against 4 activation bytes broadcast is 64 products with nothing to sum across lanes
// (the per-row layout above needs vpackssdw, vpdpwssd and a lane fold for every 256 products).
// Lane l holds row mskq_tile_row(l) of the 16 (the order a 4 x 4 dword transpose leaves).
// A and B come out as the same exact integers as in mskq_dot_k45, and the float part is
// mskq_k45_float lane by lane: the same bits.
struct mskq_t45 {
    __m512i q[8][8];  // [sub-block s][k]: weights 32s + 4k .. 32s + 4k + 3 of each lane's row
    __m512i sc[8];    // sub-block s's scale, int32
    __m512i mn[8];    // sub-block s's min as an int16 pair (m, m): vpdpwssd with (bsums[2s], [2s + 1])
    __m512 d, dmin;
};
static_assert(sizeof(mskq_t45) % 64 == 0 && alignof(mskq_t45) == 64, "tiles back to back, aligned");


// 4 activation bytes at p as one int32, broadcast to 16 lanes.
static inline __m512i mskq_bcast4(const uint8_t *p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// The next 16 rows' block at b (wrow bytes apart), asked for while this tile is laid out: the
// rows are read 16 at a time, a pattern the hardware prefetchers do not follow from memory.
static inline void mskq_tile_prefetch(const uint8_t *b, long wrow, int bytes) {
    for (int r = 0; r < 16; r++) {  // into L2: a whole tile row is laid out before it is read
        const char *p = (const char *)b + r * wrow;
        for (int o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
        _mm_prefetch(p + bytes - 1, _MM_HINT_T1);  // the block's last line, where it starts mid-line
    }
}

// Per 128-bit lane c, the 4 x 4 dwords of a[0..3] transposed: out[k]'s dword Q of lane c is
// a[Q]'s dword k of lane c.
static inline void mskq_transpose4(const __m512i *a, __m512i *out) {
    const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2), out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3), out[3] = _mm512_unpackhi_epi64(t1, t3);
}

// 16 bytes at offset `off` of the blocks of rows 4Q .. 4Q + 3 (b: row 0's block, wrow apart),
// one row a 128-bit lane.
static inline __m512i mskq_quad(const uint8_t *b, long wrow, int Q, int off) {
    const uint8_t *r = b + 4 * Q * wrow + off;
    __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)r));
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(r + wrow)), 1);
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(r + 2 * wrow)), 2);
    return _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(r + 3 * wrow)), 3);
}

// Super-block i of 16 rows (b: row 0's block, the others wrow bytes apart) into a tile.
template <bool HI>
static inline void mskq_tile45(const uint8_t *b, long wrow, mskq_t45 &o) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16), ff = _mm512_set1_epi32(0xFF);
    alignas(64) uint32_t u[16][4];  // row r's scales and mins, one byte each (mskq_scales)
    alignas(32) uint16_t dh[16], mh[16];
    for (int l = 0; l < 16; l++) {
        const uint8_t *br = b + mskq_tile_row(l) * wrow;
        std::memcpy(&dh[l], br, 2), std::memcpy(&mh[l], br + 2, 2);
    }
    for (int r = 0; r < 16; r++) mskq_scales(b + r * wrow + 4, u[r]);
    o.d = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)dh));
    o.dmin = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)mh));
    __m512i z[4], t[4];
    for (int Q = 0; Q < 4; Q++) z[Q] = _mm512_load_si512((const void *)u[4 * Q]);
    mskq_transpose4(z, t);  // t[k]: u[k] of each lane's row
    for (int s = 0; s < 8; s++) {
        o.sc[s] = _mm512_and_si512(_mm512_srli_epi32(t[s >> 2], 8 * (s & 3)), ff);
        const __m512i m = _mm512_and_si512(_mm512_srli_epi32(t[2 + (s >> 2)], 8 * (s & 3)), ff);
        o.mn[s] = _mm512_or_si512(m, _mm512_slli_epi32(m, 16));
    }
    const int qs = HI ? 48 : 16;
    for (int p = 0; p < 4; p++)      // qs[32p + l]: sub-block 2p's weight l (low nibble), 2p + 1's (high)
        for (int h = 0; h < 2; h++) {  // weights 16h .. 16h + 15 of the two sub-blocks
            __m512i lo[4], hi[4];
            for (int Q = 0; Q < 4; Q++) {
                const __m512i v = mskq_quad(b, wrow, Q, qs + 32 * p + 16 * h);
                lo[Q] = _mm512_and_si512(v, m4);
                hi[Q] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                if (HI) {  // bit s of qh[l] -> bit 4 of sub-block s's weight l
                    const __m512i qh = mskq_quad(b, wrow, Q, 16 + 16 * h);
                    lo[Q] = _mm512_mask_add_epi8(lo[Q], _mm512_test_epi8_mask(qh, _mm512_set1_epi8((char)(1 << 2 * p))),
                                                 lo[Q], sixteen);
                    hi[Q] = _mm512_mask_add_epi8(hi[Q], _mm512_test_epi8_mask(qh, _mm512_set1_epi8((char)(1 << (2 * p + 1)))),
                                                 hi[Q], sixteen);
                }
            }
            mskq_transpose4(lo, &o.q[2 * p][4 * h]);
            mskq_transpose4(hi, &o.q[2 * p + 1][4 * h]);
        }
}

// Tiles of n / 256 super-blocks for 16 rows (w: the first row, wrow bytes apart): tile i at out[i].
template <bool HI>
static void mskq_tile45_rows(long n, const void *w, long wrow, void *out) {
    const uint8_t *b = (const uint8_t *)w;
    mskq_t45 *o = (mskq_t45 *)out;
    const long bytes = HI ? 176 : 144;
    for (long i = 0; i < n / 256; i++) {
        mskq_tile_prefetch(b + 16 * wrow + i * bytes, wrow, (int)bytes);
        mskq_tile45<HI>(b + i * bytes, wrow, o[i]);
    }
}

// The 16 rows of a tile row (n / 256 tiles at t) against NB activation rows (xstride bytes
// apart): y[j * ystride + r] for rows r < 16. A row may come in pieces of blocks, as in
// mskq_dot_k45: the running sums start from `state` (phase & 1, else from zero) and, unless
// phase & 2 (the last piece: y written), are left there (32 floats an activation row).
template <int NB>
static void mskq_tile45_dot(long n, const void *tiles, const void *x, long xstride, float *y, long ystride,
                            float *state, int phase) {
    const mskq_t45 *t = (const mskq_t45 *)tiles;
    __m512 fa[NB], fb[NB];
    for (int j = 0; j < NB; j++)
        if (phase & 1)
            fa[j] = _mm512_loadu_ps(state + 32 * j), fb[j] = _mm512_loadu_ps(state + 32 * j + 16);
        else
            fa[j] = fb[j] = _mm512_setzero_ps();
    for (long i = 0; i < n / 256; i++) {
        const mskq_t45 &u = t[i];
        __m512i A[NB];
        for (int j = 0; j < NB; j++) A[j] = _mm512_setzero_si512();
        for (int s = 0; s < 8; s++) {
            __m512i W[8];
            for (int k = 0; k < 8; k++) W[k] = _mm512_load_si512((const void *)&u.q[s][k]);
            const __m512i sc = u.sc[s];
            for (int j = 0; j < NB; j++) {
                const uint8_t *xq = mskq_xblock(x, xstride, j, i) + 4 + 32 * s;
                __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), W[0], mskq_bcast4(xq));
                __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), W[4], mskq_bcast4(xq + 16));
                for (int k = 1; k < 4; k++) {
                    d0 = _mm512_dpbusd_epi32(d0, W[k], mskq_bcast4(xq + 4 * k));
                    d1 = _mm512_dpbusd_epi32(d1, W[4 + k], mskq_bcast4(xq + 16 + 4 * k));
                }
                A[j] = _mm512_add_epi32(A[j], _mm512_mullo_epi32(_mm512_add_epi32(d0, d1), sc));
            }
        }
        for (int j = 0; j < NB; j++) {
            const uint8_t *xb = mskq_xblock(x, xstride, j, i);
            int32_t bs[8];  // (bsums[2s], bsums[2s + 1]) pairs
            std::memcpy(bs, xb + 260, 32);
            __m512i B = _mm512_setzero_si512();
            for (int s = 0; s < 8; s++) B = _mm512_dpwssd_epi32(B, u.mn[s], _mm512_set1_epi32(bs[s]));
            float dx;
            std::memcpy(&dx, xb, 4);
            const __m512 dxv = _mm512_set1_ps(dx);
            fa[j] = _mm512_add_ps(fa[j], _mm512_mul_ps(_mm512_cvtepi32_ps(A[j]), _mm512_mul_ps(u.d, dxv)));
            fb[j] = _mm512_add_ps(fb[j], _mm512_mul_ps(_mm512_cvtepi32_ps(B), _mm512_mul_ps(u.dmin, dxv)));
        }
    }
    if (!(phase & 2)) {
        for (int j = 0; j < NB; j++) _mm512_storeu_ps(state + 32 * j, fa[j]), _mm512_storeu_ps(state + 32 * j + 16, fb[j]);
        return;
    }
    for (int j = 0; j < NB; j++) {
        alignas(64) float v[16];
        _mm512_store_ps(v, _mm512_sub_ps(fa[j], fb[j]));
        for (int l = 0; l < 16; l++) y[j * ystride + mskq_tile_row(l)] = v[l];
    }
}

static void ms_tile_q4_K(long n, const void *w, long wrow, void *out) { mskq_tile45_rows<false>(n, w, wrow, out); }
static void ms_tile_q5_K(long n, const void *w, long wrow, void *out) { mskq_tile45_rows<true>(n, w, wrow, out); }

// ---------------------------------------------------------------- Q4_K and Q5_K packed 16 rows at a time

// A Q4_K matrix repacked once at load for the AVX-512 build (decode.cpp's T_Q4_K_P16): 16
// weight rows' super-block i in 2,368 bytes (the 16 blocks as stored: 2,304), the rows of a
// 16 one after another, block by block. The lanes are the tiles' (lane l: row mskq_tile_row(l)),
// but the quants stay 4-bit: q[p][m]'s lane l holds that row's qs[32p + 4m .. +4), whose low
// nibbles are sub-block 2p's weights 4m .. 4m + 3 and high nibbles sub-block 2p + 1's. One
// vpdpbusd of a masked register against 4 broadcast activation bytes is then 64 products with
// nothing to fold across lanes, where a stored row needs an unpacking, vpackssdw, vpdpwssd and a
// lane fold for every 256 (one core, weights in cache: ~58 against ~20 GB/s). A and B are the
// same exact integers as in mskq_dot_k45 and the float part is mskq_k45_float lane by lane: the
// same bits as the stored rows.
// Q5_K likewise (T_Q5_K_P16, mskq_p5: 2,880 bytes, as stored 2,816), its fifth bits in h[m]
// (mskq_pack45) or-ed into the masked nibbles.
using mskq_p45 = mskq_p45s<16, false>;
using mskq_p5 = mskq_p45s<16, true>;
static_assert(sizeof(mskq_p45) == 2368 && sizeof(mskq_p45) % 64 == 0 && sizeof(mskq_p5) == 2880 &&
                  sizeof(mskq_p5) % 64 == 0,
              "packed blocks back to back, 64-byte multiples");

static void mskq_pack45_rows(long n, const void *w, long wrow, void *out) { mskq_pack45<16, false>(n, w, wrow, out); }
static void mskq_pack5_rows(long n, const void *w, long wrow, void *out) { mskq_pack45<16, true>(n, w, wrow, out); }

// The block 4 ahead of b asked for into L2. From 2 activation rows on, the hardware prefetchers
// alone leave a strip waiting on memory (one core, 8 rows, from memory: 58-72 GMAC/s without,
// 126-131 with; in cache 120-137). One row asks mskq_ahead.bytes ahead into L1, as the
// stored rows do (that way 2 threads' worst passes were no slower than the stored rows', the
// best 13% faster; L2 4 blocks ahead was slower for one row).
// (Q4_K's and Q5_K's strips, mskq_p45 and mskq_p5, and Q6_K's, mskq_p6.)
template <typename P>
static inline void mskq_strip_prefetch(const P *b) {
    const char *p = (const char *)(b + 4);
    for (int o = 0; o < (int)sizeof(P); o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
}

// The 16 rows of a packed Q4_K (HI false) or Q5_K strip (n / 256 blocks at w) against NB
// activation rows (xstride bytes apart): y[j * ystride + r] for rows r < 16.
template <int NB, bool HI = false>
static void mskq_dot_p45(long n, const void *w, const void *x, long xstride, float *y, long ystride) {
    typedef mskq_p45s<16, HI> P;
    const P *t = (const P *)w;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 fa[NB], fb[NB];
    for (int j = 0; j < NB; j++) fa[j] = fb[j] = _mm512_setzero_ps();
    for (long i = 0; i < n / 256; i++) {
        const P &u = t[i];
        if constexpr (NB > 1)
            mskq_strip_prefetch(t + i);
        else
            mskq_prefetch((const uint8_t *)(t + i), (int)sizeof(P));
        __m512i A[NB];
        for (int j = 0; j < NB; j++) A[j] = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) {
            __m512i lo[NB], hi[NB];
            for (int j = 0; j < NB; j++) lo[j] = hi[j] = _mm512_setzero_si512();
            for (int m = 0; m < 8; m++) {
                const __m512i v = _mm512_load_si512((const void *)u.q[p][m]);
                __m512i wl = _mm512_and_si512(v, m4), wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                if constexpr (HI) {
                    const __m512i h = _mm512_load_si512((const void *)u.h[m]);
                    wl = _mm512_or_si512(wl, mskq_fifth(h, 2 * p)), wh = _mm512_or_si512(wh, mskq_fifth(h, 2 * p + 1));
                }
                for (int j = 0; j < NB; j++) {
                    const uint8_t *xq = mskq_xblock(x, xstride, j, i) + 4 + 64 * p + 4 * m;
                    lo[j] = _mm512_dpbusd_epi32(lo[j], wl, mskq_bcast4(xq));
                    hi[j] = _mm512_dpbusd_epi32(hi[j], wh, mskq_bcast4(xq + 32));
                }
            }
            const __m512i s0 = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)u.sc[2 * p]));
            const __m512i s1 = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)u.sc[2 * p + 1]));
            for (int j = 0; j < NB; j++)
                A[j] = _mm512_add_epi32(A[j], _mm512_add_epi32(_mm512_mullo_epi32(lo[j], s0), _mm512_mullo_epi32(hi[j], s1)));
        }
        __m512i mn[4];
        for (int k = 0; k < 4; k++) mn[k] = _mm512_cvtepu8_epi16(_mm256_load_si256((const __m256i *)u.mn[k]));
        const __m512 d = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)u.d));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)u.dmin));
        for (int j = 0; j < NB; j++) {
            const uint8_t *xb = mskq_xblock(x, xstride, j, i);
            int32_t bp[4];
            mskq_bpairs(xb, bp);
            __m512i B = _mm512_setzero_si512();
            for (int k = 0; k < 4; k++) B = _mm512_dpwssd_epi32(B, mn[k], _mm512_set1_epi32(bp[k]));
            float dx;
            std::memcpy(&dx, xb, 4);
            const __m512 dxv = _mm512_set1_ps(dx);
            fa[j] = _mm512_add_ps(fa[j], _mm512_mul_ps(_mm512_cvtepi32_ps(A[j]), _mm512_mul_ps(d, dxv)));
            fb[j] = _mm512_add_ps(fb[j], _mm512_mul_ps(_mm512_cvtepi32_ps(B), _mm512_mul_ps(dmin, dxv)));
        }
    }
    for (int j = 0; j < NB; j++) {
        alignas(64) float v[16];
        _mm512_store_ps(v, _mm512_sub_ps(fa[j], fb[j]));
        for (int l = 0; l < 16; l++) y[j * ystride + mskq_tile_row(l)] = v[l];
    }
}

template <int NB>
static void mskq_dot_p5(long n, const void *w, const void *x, long xstride, float *y, long ystride) {
    mskq_dot_p45<NB, true>(n, w, x, xstride, y, ystride);
}

// A packed Q4_K (HI false) or Q5_K strip (n / 256 blocks at w) as the tiles many activation
// rows meet (mskq_t45): the nibbles masked apart (Q5_K's fifth bits or-ed in), the scales and
// mins widened. (The stored rows' layout also transposes.)
template <bool HI = false>
static void mskq_tile_p45(long n, const void *w, long, void *out) {
    typedef mskq_p45s<16, HI> P;
    const P *t = (const P *)w;
    mskq_t45 *o = (mskq_t45 *)out;
    const __m512i m4 = _mm512_set1_epi8(0x0F), lo16 = _mm512_set1_epi32(0xFFFF);
    for (long i = 0; i < n / 256; i++) {
        const P &u = t[i];
        mskq_t45 &g = o[i];
        mskq_strip_prefetch(t + i);
        for (int p = 0; p < 4; p++)
            for (int m = 0; m < 8; m++) {
                const __m512i v = _mm512_load_si512((const void *)u.q[p][m]);
                g.q[2 * p][m] = _mm512_and_si512(v, m4);
                g.q[2 * p + 1][m] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                if constexpr (HI) {
                    const __m512i h = _mm512_load_si512((const void *)u.h[m]);
                    g.q[2 * p][m] = _mm512_or_si512(g.q[2 * p][m], mskq_fifth(h, 2 * p));
                    g.q[2 * p + 1][m] = _mm512_or_si512(g.q[2 * p + 1][m], mskq_fifth(h, 2 * p + 1));
                }
            }
        for (int s = 0; s < 8; s++) g.sc[s] = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)u.sc[s]));
        for (int k = 0; k < 4; k++) {
            const __m512i v = _mm512_cvtepu8_epi16(_mm256_load_si256((const __m256i *)u.mn[k]));
            const __m512i e = _mm512_and_si512(v, lo16), o1 = _mm512_srli_epi32(v, 16);
            g.mn[2 * k] = _mm512_or_si512(e, _mm512_slli_epi32(e, 16));
            g.mn[2 * k + 1] = _mm512_or_si512(o1, _mm512_slli_epi32(o1, 16));
        }
        g.d = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)u.d));
        g.dmin = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)u.dmin));
    }
}
#endif

// ---------------------------------------------------------------- Q6_K

// A lanes: the unsigned quants (0..63) times the activations, per mskq_lane6; B lanes: t =
// sc[2t] bsums[2t] + sc[2t+1] bsums[2t+1], for the -32 offset: result = A - 32 B.
#if defined(MSKQ_AVX512)
// A Q6_K super-block unpacked for the AVX-512 loop (as mskq_u45).
struct mskq_u6 {
    __m512i wk[4], s01, s23;
    __m256i sc16;
    float d;
};
static_assert(sizeof(mskq_u6) % 64 == 0 && alignof(mskq_u6) == 64, "unpacked blocks back to back, aligned");

static inline void mskq_unpack6(const uint8_t *b, mskq_u6 &o) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i shl = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2), shr = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
    // vpdpbusd of w[k] has group 4k + c in 16-byte lane c; vpackssdw of w[0]'s and w[1]'s: per
    // lane c, 4 words of group c, then 4 of group 4 + c (w[2], w[3]: 8 + c, 12 + c)
    const __m512i i01 = _mm512_setr_epi32(0x00000000, 0x00000000, 0x00040004, 0x00040004,
                                          0x00010001, 0x00010001, 0x00050005, 0x00050005,
                                          0x00020002, 0x00020002, 0x00060006, 0x00060006,
                                          0x00030003, 0x00030003, 0x00070007, 0x00070007);
    const __m512i i23 = _mm512_add_epi32(i01, _mm512_set1_epi32(0x00080008));
    o.d = mskq_half(b + 208);
    for (int h = 0; h < 2; h++) {  // wk[k]: weights 64k .. 64k + 64 (groups 4k .. 4k + 4)
        const __m512i lo = _mm512_loadu_si512((const void *)(b + 64 * h));
        const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
        // bits 4-5 of each byte from qh bits 0-1 | 2-3 (weights l, l + 32), 4-5 | 6-7 (l + 64, + 96)
        o.wk[2 * h] = _mm512_or_si512(_mm512_and_si512(lo, m4), _mm512_and_si512(_mm512_sllv_epi64(hb, shl), m30));
        o.wk[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo, 4), m4),
                                          _mm512_and_si512(_mm512_srlv_epi64(hb, shr), m30));
    }
    o.sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
    o.s01 = _mm512_permutexvar_epi16(i01, _mm512_castsi256_si512(o.sc16));
    o.s23 = _mm512_permutexvar_epi16(i23, _mm512_castsi256_si512(o.sc16));
}

static void ms_unpack_q6_K(long n, const void *w, void *out) {
    const uint8_t *b = (const uint8_t *)w;
    mskq_u6 *o = (mskq_u6 *)out;
    for (long i = 0; i < n / 256; i++) mskq_unpack6(b + i * 210, o[i]);
}
#endif

// PRE: w is the row unpacked (mskq_u6 blocks, AVX-512 only), else the row as stored; state and
// phase as in mskq_dot_k45.
template <int NB, bool PRE>
static void mskq_dot_q6(long n, const void *w, const void *x, long xstride, float *y,
                        long ystride, float *state = nullptr, int phase = 2) {
    const long nb = n / 256;
    const uint8_t *b = (const uint8_t *)w;
    float fa[NB][8];
#if defined(MSKQ_AVX512)
    constexpr int NA = NB == 1 ? 1 : NB / 2;  // NB even: rows in pairs, the first row's in 0-7
    __m512 aa[NA];
    for (int j = 0; j < NA; j++) aa[j] = PRE && (phase & 1) ? _mm512_loadu_ps(state + 16 * j) : _mm512_setzero_ps();
    for (long i = 0; i < nb; i++, b += 210) {
        mskq_u6 ub;
        if (!PRE) {
            mskq_prefetch(b, 256);
            mskq_unpack6(b, ub);
        }
        const mskq_u6 &u = PRE ? ((const mskq_u6 *)w)[i] : ub;
        const __m512i *wk = u.wk, s01 = u.s01, s23 = u.s23;
        const __m256i sc16 = u.sc16;
        const float d = u.d;
        // the 16 A lanes of a row; lane sums < 4 * 63 * 128 < 2^15: the int16 packing is exact
        auto lanes = [&](const uint8_t *xb) { return mskq_lanes(wk, s01, s23, xb); };
        if constexpr (NB == 1) {  // A lanes L and L + 8, less 32 B lanes: exact integers, one float update
            const uint8_t *xb = mskq_xblock(x, xstride, 0, i);
            const __m512i s = lanes(xb);
            const __m256i m = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xb + 260)), sc16);
            const __m256i t = _mm256_sub_epi32(
                _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1)),
                _mm256_slli_epi32(m, 5));
            float dx;
            std::memcpy(&dx, xb, 4);
            const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(d * dx));
            aa[0] = _mm512_castps256_ps512(_mm256_add_ps(_mm512_castps512_ps256(aa[0]), u));
        } else {
            const __m512 dv = _mm512_set1_ps(d);
            const __m512i sc2 = _mm512_broadcast_i64x4(sc16);
            for (int jp = 0; jp < NA; jp++) {
                const uint8_t *x0 = mskq_xblock(x, xstride, 2 * jp, i), *x1 = mskq_xblock(x, xstride, 2 * jp + 1, i);
                const __m512i t = _mm512_sub_epi32(mskq_fold2(lanes(x0), lanes(x1)),
                                                   _mm512_slli_epi32(mskq_bsums2(x0, x1, sc2), 5));
                const __m512 dx = mskq_dx2(x0, x1);
                aa[jp] = _mm512_add_ps(aa[jp], _mm512_mul_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dx, dv)));
            }
        }
    }
    if (PRE && !(phase & 2)) {
        for (int j = 0; j < NA; j++) _mm512_storeu_ps(state + 16 * j, aa[j]);
        return;
    }
    if constexpr (NB == 1) {
        _mm256_storeu_ps(fa[0], _mm512_castps512_ps256(aa[0]));
    } else {
        for (int jp = 0; jp < NA; jp++) {
            float a[16];
            _mm512_storeu_ps(a, aa[jp]);
            std::memcpy(fa[2 * jp], a, 32), std::memcpy(fa[2 * jp + 1], a + 8, 32);
        }
    }
#elif defined(MSKQ_AVX2)
    __m256 aa[NB];
    for (int j = 0; j < NB; j++) aa[j] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    for (long i = 0; i < nb; i++, b += 210) {
        mskq_prefetch(b, 256);
        const float d = mskq_half(b + 208);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
        __m256i wq[8], sv[8];  // weights 32u .. 32u + 32 (groups 2u, 2u + 1) and their scales
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            const __m256i sx = h ? _mm256_permute2x128_si256(sc16, sc16, 0x11)  // 8 scales, twice
                                 : _mm256_permute2x128_si256(sc16, sc16, 0x00);
            wq[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
            wq[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
            wq[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m30));
            wq[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                            _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
            for (int k = 0; k < 4; k++)  // groups 8h + 2k (low 16 bytes), 8h + 2k + 1
                sv[4 * h + k] = _mm256_shuffle_epi8(
                    sx, _mm256_setr_epi32(MSKQ_E(2 * k), MSKQ_E(2 * k), MSKQ_E(2 * k), MSKQ_E(2 * k),
                                          MSKQ_E(2 * k + 1), MSKQ_E(2 * k + 1), MSKQ_E(2 * k + 1),
                                          MSKQ_E(2 * k + 1)));
        }
        for (int j = 0; j < NB; j++) {
            const uint8_t *xb = mskq_xblock(x, xstride, j, i);
            __m256i r[4];  // r[k]: groups 2k, 2k + 1 and 2k + 8, 2k + 9, per 4 weights
            for (int u = 0; u < 8; u++) {
                const __m256i t = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(wq[u], _mm256_loadu_si256((const __m256i *)(xb + 4 + 32 * u))), sv[u]);
                r[u & 3] = u < 4 ? t : _mm256_add_epi32(r[u & 3], t);
            }
            const __m256i a0 = _mm256_hadd_epi32(r[0], r[2]);  // A lanes 0-7 (groups 0, 1, 4, 5)
            const __m256i a1 = _mm256_hadd_epi32(r[1], r[3]);  // 8-15 (2, 3, 6, 7)
            const __m256i m = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xb + 260)), sc16);
            const __m256i t = _mm256_sub_epi32(_mm256_add_epi32(a0, a1), _mm256_slli_epi32(m, 5));
            float dx;
            std::memcpy(&dx, xb, 4);
            aa[j] = _mm256_add_ps(aa[j], _mm256_mul_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(d * dx)));
        }
    }
    for (int j = 0; j < NB; j++) _mm256_storeu_ps(fa[j], aa[j]);
#else
    for (int j = 0; j < NB; j++)
        for (int l = 0; l < 8; l++) fa[j][l] = 0.f;
    for (long i = 0; i < nb; i++, b += 210) {
        const float d = mskq_half(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        int8_t q[256];
        mskq_q6_unpack(b, q);
        for (int j = 0; j < NB; j++) {
            const uint8_t *xb = mskq_xblock(x, xstride, j, i);
            const int8_t *xq = (const int8_t *)(xb + 4);
            int16_t bs[16];
            std::memcpy(bs, xb + 260, 32);
            int32_t dot[16][2];  // group, 8 weights
            mskq_dot8(q, xq, &dot[0][0]);
            const float da = d * mskq_dx(x, xstride, j, i);
            int32_t a[16], m[8];
            for (int g0 = 0; g0 < 8; g0++)
                for (int h = 0; h < 2; h++)
                    a[mskq_lane6(g0, h)] = (int32_t)sc[g0] * dot[g0][h] + (int32_t)sc[g0 + 8] * dot[g0 + 8][h];
            for (int t = 0; t < 8; t++) m[t] = (int32_t)sc[2 * t] * bs[2 * t] + (int32_t)sc[2 * t + 1] * bs[2 * t + 1];
            for (int l = 0; l < 8; l++) fa[j][l] = fa[j][l] + (float)(a[l] + a[l + 8] - 32 * m[l]) * da;
        }
    }
#endif
    for (int j = 0; j < NB; j++) y[j * ystride] = mskq_tree8(fa[j]);
}

template <int NB>
static void ms_dot_q6_K(long n, const void *w, const void *x, long xstride, float *y,
                        long ystride) {
    mskq_dot_q6<NB, false>(n, w, x, xstride, y, ystride);
}

#if defined(MSKQ_AVX512)
template <int NB>
static void ms_dotu_q6_K(long n, const void *w, const void *x, long xstride, float *y,
                         long ystride, float *state, int phase) {
    mskq_dot_q6<NB, true>(n, w, x, xstride, y, ystride, state, phase);
}
#endif

// A Q6_K super-block of S weight rows packed (mskq_p6: S = 16, AVX-512; mskq_p6x8: S = 8,
// AVX2), lane r holding row r: ql[hh][j][m]'s lane r holds that row's ql[64hh + 32j + 4m .. +4),
// qh[hh][m]'s its qh[32hh + 4m .. +4); the scales and d as stored, a row each; pad to whole
// vectors (64 bytes, 32).
template <int S>
struct mskq_p6s {
    uint8_t ql[2][2][8][4 * S];
    uint8_t qh[2][8][4 * S];
    int8_t sc[16][S];  // [group][row]
    uint16_t d[S];     // IEEE halves, as stored
    uint16_t pad[S];
};

// S stored Q6_K rows of n weights (w: the first, wrow bytes apart) -> n / 256 packed blocks.
template <int S>
static void mskq_pack6(long n, const void *w, long wrow, void *out) {
    typedef mskq_p6s<S> P;
    const uint8_t *b = (const uint8_t *)w;
    P *o = (P *)out;
    for (long i = 0; i < n / 256; i++) {
        P &p = o[i];
        std::memset(p.pad, 0, sizeof(p.pad));
        for (int r = 0; r < S; r++) {
            const uint8_t *br = b + r * wrow + i * 210;
            for (int hh = 0; hh < 2; hh++)
                for (int m = 0; m < 8; m++) {
                    for (int j = 0; j < 2; j++) std::memcpy(&p.ql[hh][j][m][4 * r], br + 64 * hh + 32 * j + 4 * m, 4);
                    std::memcpy(&p.qh[hh][m][4 * r], br + 128 + 32 * hh + 4 * m, 4);
                }
            for (int g = 0; g < 16; g++) p.sc[g][r] = (int8_t)br[192 + g];
            std::memcpy(&p.d[r], br + 208, 2);
        }
    }
}

#if defined(MSKQ_AVX512)
// ---------------------------------------------------------------- Q6_K packed 16 rows at a time

// A Q6_K matrix repacked once at load for the AVX-512 build (decode.cpp's T_Q6_K_P16): 16
// weight rows' super-block i in 3,392 bytes (the 16 blocks as stored: 3,360), lane r holding
// row r. ql[hh][j][m]'s lane r holds that row's ql[64hh + 32j + 4m .. +4) (low nibbles: weights
// 128hh + 32j + 4m .., high nibbles: 64 further), qh[hh][m]'s lane r its qh[32hh + 4m .. +4)
// (bits 2k, 2k + 1: the high bits of weight 128hh + 32k + 4m ..): each 64 weights of 16 rows
// are a mask, a shift and an or away, and one vpmaddubsw against 4 broadcast activation bytes
// makes 64 products (two int16 sums a row) with nothing to fold across lanes (as stored, a
// row's 256 weights take an unpacking and two permutes of its scales). The integers are the stored loop's per lane
// (a[l] + a[l + 8] - 32 m[l], mskq_lane6's lanes; the plain loop's reference in mskq_dot_q6),
// and the float steps the same, lane by lane: the same bits as the rows as stored.
using mskq_p6 = mskq_p6s<16>;
static_assert(sizeof(mskq_p6) == 3392 && sizeof(mskq_p6) % 64 == 0, "packed blocks back to back, 64-byte multiples");

static void mskq_pack6_rows(long n, const void *w, long wrow, void *out) { mskq_pack6<16>(n, w, wrow, out); }

// Each byte shifted left by S bits (right for S < 0), what crosses in from a neighbouring byte
// left for the caller to mask or override: with VBMI, vpmultishiftqb (byte i of a qword takes
// the 8 bits from bit 8i - S, rotating), which runs on port 5; else 16-bit shifts, which 512-bit
// code runs on port 0 only, as it does vpdpbusd.
template <int S>
static inline __m512i mskq_shift_bytes(__m512i v) {
#if defined(__AVX512VBMI__)
    unsigned long long c = 0;
    for (int i = 0; i < 8; i++) c |= (unsigned long long)((8 * i - S) & 63) << (8 * i);
    return _mm512_multishift_epi64_epi8(_mm512_set1_epi64((long long)c), v);
#else
    if constexpr (S > 0)
        return _mm512_slli_epi16(v, S);
    else
        return _mm512_srli_epi16(v, -S);
#endif
}

// The 4 weight registers (k = 0..3: weights 128hh + 32k + 4m .. + 4 of each lane's row, 0..63)
// of a packed block's ql / qh m-th 4 bytes in half hh: bits 0-3 from the ql nibble, 4-5 from
// qh's pair, 6-7 zero. qh is masked to the pairs of k = 0, 2 (bits 0-1, 4-5) or of k = 1, 3
// (2-3, 6-7) so that no shift brings a neighbour into bits 4-7; vpternlogd 0xE4 takes bits 0-3
// from the first operand, the rest from the second.
static inline void mskq_p6_weights(const mskq_p6 &u, int hh, int m, __m512i *W) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m33 = _mm512_set1_epi8(0x33), mcc = _mm512_set1_epi8((char)0xCC);
    const __m512i h = _mm512_load_si512((const void *)u.qh[hh][m]);
    const __m512i l0 = _mm512_load_si512((const void *)u.ql[hh][0][m]);
    const __m512i l1 = _mm512_load_si512((const void *)u.ql[hh][1][m]);
    const __m512i ha = _mm512_and_si512(h, m33), hb = _mm512_and_si512(h, mcc);
    W[0] = _mm512_ternarylogic_epi32(l0, mskq_shift_bytes<4>(ha), m4, 0xE4);
    W[1] = _mm512_ternarylogic_epi32(l1, mskq_shift_bytes<2>(hb), m4, 0xE4);
    W[2] = _mm512_ternarylogic_epi32(mskq_shift_bytes<-4>(l0), ha, m4, 0xE4);
    W[3] = _mm512_ternarylogic_epi32(mskq_shift_bytes<-4>(l1), mskq_shift_bytes<-2>(hb), m4, 0xE4);
}

// The 16 rows of a packed strip (n / 256 blocks at w) against NB activation rows (xstride bytes
// apart): y[j * ystride + r] for rows r < 16. Per block and activation row: 8 integer lanes a
// row (the stored loop's l = 0..7), each 4 weights' two vpmaddubsw sums times their group's
// scale pair by vpdpwssd (1 row, one core, in L2: 5% faster than as the sums of vpdpbusd
// pairs packed to int16 pairs), less 32 x the scales against the activations' group sums;
// then fa[l] += (float)T[l] * (d * dx).
template <int NB>
static void mskq_dot_p6(long n, const void *w, const void *x, long xstride, float *y, long ystride) {
    const mskq_p6 *t = (const mskq_p6 *)w;
    __m512 fa[NB][8];
    for (int j = 0; j < NB; j++)
        for (int l = 0; l < 8; l++) fa[j][l] = _mm512_setzero_ps();
    // from 2 activation rows, a block's 64 weight registers are made once into `wb` (L1) and
    // read back for each row
    alignas(64) __m512i wb[NB > 1 ? 2 * 4 * 2 * 4 : 1];
    alignas(64) __m512i sp[16];  // each group's scale as an int16 pair (s, s) a row
    for (long i = 0; i < n / 256; i++) {
        const mskq_p6 &u = t[i];
        if constexpr (NB > 1)
            mskq_strip_prefetch(t + i);
        else
            mskq_prefetch((const uint8_t *)(t + i), (int)sizeof(mskq_p6));
#pragma GCC unroll 16
        for (int g = 0; g < 16; g++) {
            const __m128i s8 = _mm_load_si128((const __m128i *)u.sc[g]);
            sp[g] = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(s8, s8), _mm_unpacklo_epi8(s8, s8)));
        }
        if constexpr (NB > 1)
            for (int hh = 0; hh < 2; hh++)
                for (int m = 0; m < 8; m++) mskq_p6_weights(u, hh, m, &wb[(hh * 8 + m) * 4]);
        const __m512 d = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)u.d));
        for (int j = 0; j < NB; j++) {
            const uint8_t *xb = mskq_xblock(x, xstride, j, i);
            __m512i I[8];
            for (int l = 0; l < 8; l++) I[l] = _mm512_setzero_si512();
#pragma GCC unroll 2
            for (int hh = 0; hh < 2; hh++)
#pragma GCC unroll 4
                for (int mp = 0; mp < 4; mp++) {  // weights 8mp .. 8mp + 8 of each 32 (m = 2mp, 2mp + 1)
                    __m512i W0[4], W1[4];
                    const __m512i *w0 = W0, *w1 = W1;
                    if constexpr (NB > 1) {
                        w0 = &wb[(hh * 8 + 2 * mp) * 4], w1 = &wb[(hh * 8 + 2 * mp + 1) * 4];
                    } else {
                        mskq_p6_weights(u, hh, 2 * mp, W0), mskq_p6_weights(u, hh, 2 * mp + 1, W1);
                    }
#pragma GCC unroll 4
                    for (int k = 0; k < 4; k++) {  // weights 128hh + 32k + 8mp ..: group g, lane l
                        const int g = 8 * hh + 2 * k + (mp >> 1), l = 4 * (mp >> 1) + 2 * (k >> 1) + (mp & 1);
                        const uint8_t *xq = xb + 4 + 128 * hh + 32 * k + 8 * mp;
                        // vpmaddubsw: each 2 products' sum as int16 (|.| <= 2 x 63 x 128: no
                        // saturation), then times the group's scale pair by vpdpwssd
                        I[l] = _mm512_dpwssd_epi32(I[l], _mm512_maddubs_epi16(w0[k], mskq_bcast4(xq)), sp[g]);
                        I[l] = _mm512_dpwssd_epi32(I[l], _mm512_maddubs_epi16(w1[k], mskq_bcast4(xq + 4)), sp[g]);
                    }
                }
            float dx;
            std::memcpy(&dx, xb, 4);
            const __m512 da = _mm512_mul_ps(d, _mm512_set1_ps(dx));
#pragma GCC unroll 8
            for (int l = 0; l < 8; l++) {  // m[l] = sc[2l] bsums[2l] + sc[2l + 1] bsums[2l + 1]
                const __m512i pr = _mm512_mask_blend_epi16(0xAAAAAAAA, sp[2 * l], sp[2 * l + 1]);
                const __m512i mm = _mm512_dpwssd_epi32(_mm512_setzero_si512(), pr, mskq_bcast4(xb + 260 + 4 * l));
                const __m512i tt = _mm512_sub_epi32(I[l], _mm512_slli_epi32(mm, 5));
                fa[j][l] = _mm512_add_ps(fa[j][l], _mm512_mul_ps(_mm512_cvtepi32_ps(tt), da));
            }
        }
    }
    for (int j = 0; j < NB; j++) {  // mskq_tree8, 16 rows at once
        const __m512 c0 = _mm512_add_ps(fa[j][0], fa[j][4]), c1 = _mm512_add_ps(fa[j][1], fa[j][5]);
        const __m512 c2 = _mm512_add_ps(fa[j][2], fa[j][6]), c3 = _mm512_add_ps(fa[j][3], fa[j][7]);
        alignas(64) float v[16];
        _mm512_store_ps(v, _mm512_add_ps(_mm512_add_ps(c0, c2), _mm512_add_ps(c1, c3)));
        for (int r = 0; r < 16; r++) y[j * ystride + r] = v[r];
    }
}
#endif

#if defined(MSKQ_AVX2)
// ---------------------------------------------------------------- Q6_K packed 8 rows at a time (AVX2)

// A Q6_K matrix repacked once at load for the AVX2 build (decode.cpp's T_Q6_K_P8), as mskq_p6
// for AVX-512 with 8 lanes (mskq_p6s): 8 weight rows' super-block i in 1,696 bytes (the 8
// blocks as stored: 1,680), lane r holding row r. Each 32 weights of 8 rows are a mask, a shift
// and an or away, and one vpmaddubsw against 4 broadcast activation bytes makes 32 products
// with nothing to fold across lanes (as stored, a row's 256 weights take their scales shuffled
// into place and the lanes paired with vphaddd). The integer lanes are mskq_p6's (the stored
// loop's a[l] + a[l + 8] - 32 m[l]), the float steps the same, lane by lane: the same bits as
// the rows as stored.
using mskq_p6x8 = mskq_p6s<8>;
static_assert(sizeof(mskq_p6x8) == 1696 && sizeof(mskq_p6x8) % 32 == 0, "packed blocks back to back, 32-byte multiples");

static void mskq_pack6x8_rows(long n, const void *w, long wrow, void *out) { mskq_pack6<8>(n, w, wrow, out); }

// The 8 rows of a packed strip (n / 256 blocks at w) against NB activation rows (xstride bytes
// apart): y[j * ystride + r] for rows r < 8. A lane at a time (8 int32 lanes of 8 rows would
// not leave registers for the rest): lane l's 8 pieces of 4 weights -- halves hh, k = 2c and
// 2c + 1 (c = bit 1 of l), m = 2mp and 2mp + 1 (mp = 2 (l >> 2) + (l & 1)) -- each vpmaddubsw'd
// against its 4 activation bytes, the two m of one group added as int16 and vpmaddwd'd by the
// group's scale pair (8 rows of an L2-resident 256 x 2048 strip, one thread, Zen 3: 147-154 ->
// 114-119 us against a vpmaddwd a piece), then less 32 x the
// scales against the activations' group sums, then fa[l] += (float)T * (d * dx); mskq_tree8's
// order at the end.
template <int NB>
static void mskq_dot_p6x8(long n, const void *w, const void *x, long xstride, float *y, long ystride) {
    const mskq_p6x8 *t = (const mskq_p6x8 *)w;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    __m256 fa[NB][8];
    for (int j = 0; j < NB; j++)
        for (int l = 0; l < 8; l++) fa[j][l] = _mm256_setzero_ps();
    for (long i = 0; i < n / 256; i++) {
        const mskq_p6x8 &u = t[i];
        mskq_strip8_prefetch<NB>(t + i);  // (the 1B Q4_K_M shape, 8 rows: 103-106 -> 95-98 ms a pass)
        const __m256 d = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)u.d));
        __m256 da[NB];
        for (int j = 0; j < NB; j++) {
            float dx;
            std::memcpy(&dx, mskq_xblock(x, xstride, j, i), 4);
            da[j] = _mm256_mul_ps(d, _mm256_set1_ps(dx));
        }
        auto pair = [&](int g) {  // group g's scale as an int16 pair (s, s) a row
            const __m128i s8 = _mm_loadl_epi64((const __m128i *)u.sc[g]);
            return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s8, s8));
        };
        auto lane = [&](int l) MSQ_INLINE_LAMBDA {
            const int c = (l >> 1) & 1, mp = 2 * (l >> 2) + (l & 1);
            __m256i I[NB];
            for (int j = 0; j < NB; j++) I[j] = _mm256_setzero_si256();
#pragma GCC unroll 2
            for (int hh = 0; hh < 2; hh++) {
                __m256i W[2][2];  // [e][k - 2c]: m = 2mp + e; the low nibbles and qh bits 0-3, or the high and 4-7
#pragma GCC unroll 2
                for (int e = 0; e < 2; e++) {
                    const int m = 2 * mp + e;
                    const __m256i h = _mm256_load_si256((const __m256i *)u.qh[hh][m]);
                    const __m256i l0 = _mm256_load_si256((const __m256i *)u.ql[hh][0][m]);
                    const __m256i l1 = _mm256_load_si256((const __m256i *)u.ql[hh][1][m]);
                    if (c == 0) {
                        W[e][0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
                        W[e][1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
                    } else {
                        W[e][0] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(h, m30));
                        W[e][1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                                  _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
                    }
                }
                // m = 2mp and 2mp + 1 lie in one group: their pairs added as int16 (each |pair| <=
                // 2 * 63 * 128, two < 2^15), one vpmaddwd by the scale
#pragma GCC unroll 2
                for (int kk = 0; kk < 2; kk++) {
                    const int k = 2 * c + kk, g = 8 * hh + 2 * k + (mp >> 1);
                    const __m256i sp = pair(g);
                    for (int j = 0; j < NB; j++) {
                        const uint8_t *xq = mskq_xblock(x, xstride, j, i) + 4 + 128 * hh + 32 * k + 8 * mp;
                        int32_t a0, a1;
                        std::memcpy(&a0, xq, 4), std::memcpy(&a1, xq + 4, 4);
                        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(W[0][kk], _mm256_set1_epi32(a0)),
                                                           _mm256_maddubs_epi16(W[1][kk], _mm256_set1_epi32(a1)));
#if defined(__AVXVNNI__)
                        I[j] = _mm256_dpwssd_avx_epi32(I[j], p, sp);
#else
                        I[j] = _mm256_add_epi32(I[j], _mm256_madd_epi16(p, sp));
#endif
                    }
                }
            }
            // m[l] = sc[2l] bsums[2l] + sc[2l + 1] bsums[2l + 1]
            const __m256i pr = _mm256_blend_epi16(pair(2 * l), pair(2 * l + 1), 0xAA);
            for (int j = 0; j < NB; j++) {
                int32_t bs;
                std::memcpy(&bs, mskq_xblock(x, xstride, j, i) + 260 + 4 * l, 4);
                const __m256i mm = _mm256_madd_epi16(pr, _mm256_set1_epi32(bs));
                const __m256i tt = _mm256_sub_epi32(I[j], _mm256_slli_epi32(mm, 5));
                fa[j][l] = _mm256_add_ps(fa[j][l], _mm256_mul_ps(_mm256_cvtepi32_ps(tt), da[j]));
            }
        };
        // one row: the 8 lanes unrolled; more rows: a lane at a time (unrolled, GCC hoisted the
        // 8 lanes' products and spilled them: 8 rows of an L2-resident 256 x 2048 strip, one
        // thread, Zen 3: 117-148 -> 87-89 us; one row the other way round, 28-32 against 34-64)
        if constexpr (NB == 1) {
#pragma GCC unroll 8
            for (int l = 0; l < 8; l++) lane(l);
        } else {
            for (int l = 0; l < 8; l++) lane(l);
        }
    }
    for (int j = 0; j < NB; j++) {  // mskq_tree8, 8 rows at once
        const __m256 c0 = _mm256_add_ps(fa[j][0], fa[j][4]), c1 = _mm256_add_ps(fa[j][1], fa[j][5]);
        const __m256 c2 = _mm256_add_ps(fa[j][2], fa[j][6]), c3 = _mm256_add_ps(fa[j][3], fa[j][7]);
        alignas(32) float v[8];
        _mm256_store_ps(v, _mm256_add_ps(_mm256_add_ps(c0, c2), _mm256_add_ps(c1, c3)));
        for (int r = 0; r < 8; r++) y[j * ystride + r] = v[r];
    }
}
#endif

#if defined(MSKQ_AVX512)
// 16 Q6_K rows' super-block laid out as a tile (as mskq_t45: lane l holds row mskq_tile_row(l)).
// The A8 lanes of the order above come out as the same integers per row (lane l's 4 group
// halves, each dot product times its scale), so the float part, lane by lane, is the same.
struct mskq_t6 {
    __m512i q[16][4];  // [group g][k]: weights 16g + 4k .. 16g + 4k + 3 (0..63) of each lane's row
    __m512i sc[16];    // group g's scale, int32
    __m512i scp[8];    // (sc[2t], sc[2t + 1]) as int16 pairs: vpdpwssd with (bsums[2t], [2t + 1])
    __m512 d;
};
static_assert(sizeof(mskq_t6) % 64 == 0 && alignof(mskq_t6) == 64, "tiles back to back, aligned");

static inline void mskq_tile6(const uint8_t *b, long wrow, mskq_t6 &o) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    alignas(32) uint16_t dh[16];
    for (int l = 0; l < 16; l++) std::memcpy(&dh[l], b + mskq_tile_row(l) * wrow + 208, 2);
    o.d = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)dh));
    __m512i z[4], t[4];
    for (int Q = 0; Q < 4; Q++) z[Q] = mskq_quad(b, wrow, Q, 192);
    mskq_transpose4(z, t);  // t[k]: scales 4k .. 4k + 3 of each lane's row
    for (int g = 0; g < 16; g++)
        o.sc[g] = _mm512_srai_epi32(_mm512_slli_epi32(t[g >> 2], 24 - 8 * (g & 3)), 24);
    for (int p = 0; p < 8; p++)
        o.scp[p] = _mm512_or_si512(_mm512_and_si512(o.sc[2 * p], _mm512_set1_epi32(0xFFFF)),
                                   _mm512_slli_epi32(o.sc[2 * p + 1], 16));
    // weights 128H + 32r + 16lh + i (i < 16): group 8H + 2r + lh, from ql[64H + 32 (r & 1) + 16lh + i]
    // (low nibble for r < 2, high for r >= 2) and bits 2r, 2r + 1 of qh[32H + 16lh + i]
    for (int H = 0; H < 2; H++)
        for (int lh = 0; lh < 2; lh++) {
            __m512i w[4][4];  // [r][quad]
            for (int Q = 0; Q < 4; Q++) {
                const __m512i l0 = mskq_quad(b, wrow, Q, 64 * H + 16 * lh);
                const __m512i l1 = mskq_quad(b, wrow, Q, 64 * H + 32 + 16 * lh);
                const __m512i qh = mskq_quad(b, wrow, Q, 128 + 32 * H + 16 * lh);
                w[0][Q] = _mm512_or_si512(_mm512_and_si512(l0, m4), _mm512_and_si512(_mm512_slli_epi16(qh, 4), m30));
                w[1][Q] = _mm512_or_si512(_mm512_and_si512(l1, m4), _mm512_and_si512(_mm512_slli_epi16(qh, 2), m30));
                w[2][Q] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4), _mm512_and_si512(qh, m30));
                w[3][Q] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4),
                                          _mm512_and_si512(_mm512_srli_epi16(qh, 2), m30));
            }
            for (int r = 0; r < 4; r++) mskq_transpose4(w[r], o.q[8 * H + 2 * r + lh]);
        }
}

static void ms_tile_q6_K(long n, const void *w, long wrow, void *out) {
    const uint8_t *b = (const uint8_t *)w;
    mskq_t6 *o = (mskq_t6 *)out;
    for (long i = 0; i < n / 256; i++) {
        mskq_tile_prefetch(b + 16 * wrow + i * 210, wrow, 210);
        mskq_tile6(b + i * 210, wrow, o[i]);
    }
}

// A packed Q6_K strip (n / 256 blocks at w) as the tiles many activation rows meet (mskq_t6,
// whose lane l holds row mskq_tile_row(l): each register's rows permuted into that order).
static void mskq_tile_p6(long n, const void *w, long, void *out) {
    const mskq_p6 *t = (const mskq_p6 *)w;
    mskq_t6 *o = (mskq_t6 *)out;
    alignas(64) int32_t order[16];
    for (int l = 0; l < 16; l++) order[l] = mskq_tile_row(l);
    const __m512i idx = _mm512_load_si512((const void *)order);
    for (long i = 0; i < n / 256; i++) {
        const mskq_p6 &u = t[i];
        mskq_t6 &g = o[i];
        mskq_strip_prefetch(t + i);
        for (int hh = 0; hh < 2; hh++)
            for (int m = 0; m < 8; m++) {  // weights 128hh + 32k + 4m ..: group 8hh + 2k + m / 4
                __m512i W[4];
                mskq_p6_weights(u, hh, m, W);
                for (int k = 0; k < 4; k++) g.q[8 * hh + 2 * k + (m >> 2)][m & 3] = _mm512_permutexvar_epi32(idx, W[k]);
            }
        for (int s = 0; s < 16; s++)
            g.sc[s] = _mm512_permutexvar_epi32(idx, _mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)u.sc[s])));
        for (int q = 0; q < 8; q++)
            g.scp[q] = _mm512_or_si512(_mm512_and_si512(g.sc[2 * q], _mm512_set1_epi32(0xFFFF)),
                                       _mm512_slli_epi32(g.sc[2 * q + 1], 16));
        g.d = _mm512_permutexvar_ps(idx, _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)u.d)));
    }
}

// As mskq_tile45_dot, for Q6_K tiles (the state: 128 floats an activation row).
template <int NB>
static void mskq_tile6_dot(long n, const void *tiles, const void *x, long xstride, float *y, long ystride,
                           float *state, int phase) {
    const mskq_t6 *t = (const mskq_t6 *)tiles;
    __m512 fa[NB][8];
    for (int j = 0; j < NB; j++)
        for (int l = 0; l < 8; l++)
            fa[j][l] = phase & 1 ? _mm512_loadu_ps(state + 128 * j + 16 * l) : _mm512_setzero_ps();
    for (long i = 0; i < n / 256; i++) {
        const mskq_t6 &u = t[i];
        __m512 ddx[NB];
        for (int j = 0; j < NB; j++) {
            float dx;
            std::memcpy(&dx, mskq_xblock(x, xstride, j, i), 4);
            ddx[j] = _mm512_mul_ps(_mm512_set1_ps(dx), u.d);
        }
        for (int l = 0; l < 8; l++) {  // A8 lane l = 4c + 2e + h: groups c + 4e, c + 2 + 4e and 8 on, half h
            const int c = l >> 2, e = (l >> 1) & 1, h = l & 1;
            const int G[4] = {c + 4 * e, c + 2 + 4 * e, c + 4 * e + 8, c + 2 + 4 * e + 8};
            __m512i W[8];
            for (int m = 0; m < 4; m++)
                W[2 * m] = _mm512_load_si512((const void *)&u.q[G[m]][2 * h]),
                W[2 * m + 1] = _mm512_load_si512((const void *)&u.q[G[m]][2 * h + 1]);
            for (int j = 0; j < NB; j++) {
                const uint8_t *xb = mskq_xblock(x, xstride, j, i);
                const uint8_t *xq = xb + 4;
                __m512i T = _mm512_setzero_si512();
                for (int m = 0; m < 4; m++) {
                    const int o = 16 * G[m] + 8 * h;  // weight 16g + 8h
                    __m512i D = _mm512_dpbusd_epi32(_mm512_setzero_si512(), W[2 * m], mskq_bcast4(xq + o));
                    D = _mm512_dpbusd_epi32(D, W[2 * m + 1], mskq_bcast4(xq + o + 4));
                    T = _mm512_add_epi32(T, _mm512_mullo_epi32(D, u.sc[G[m]]));
                }
                int32_t bs;
                std::memcpy(&bs, xb + 260 + 4 * l, 4);
                const __m512i M = _mm512_dpwssd_epi32(_mm512_setzero_si512(), u.scp[l], _mm512_set1_epi32(bs));
                const __m512i V = _mm512_sub_epi32(T, _mm512_slli_epi32(M, 5));
                fa[j][l] = _mm512_add_ps(fa[j][l], _mm512_mul_ps(_mm512_cvtepi32_ps(V), ddx[j]));
            }
        }
    }
    if (!(phase & 2)) {
        for (int j = 0; j < NB; j++)
            for (int l = 0; l < 8; l++) _mm512_storeu_ps(state + 128 * j + 16 * l, fa[j][l]);
        return;
    }
    for (int j = 0; j < NB; j++) {  // mskq_tree8, lane by lane
        __m512 c[4];
        for (int k = 0; k < 4; k++) c[k] = _mm512_add_ps(fa[j][k], fa[j][k + 4]);
        alignas(64) float v[16];
        _mm512_store_ps(v, _mm512_add_ps(_mm512_add_ps(c[0], c[2]), _mm512_add_ps(c[1], c[3])));
        for (int r = 0; r < 16; r++) y[j * ystride + mskq_tile_row(r)] = v[r];
    }
}
#endif

// ---------------------------------------------------------------- Q3_K
// Q3_K, 110 bytes: {u8 hmask[32]; u8 qs[64]; u8 scales[12]; fp16 d}: 16 groups of 16 weights,
// w = d * (sc[g] - 32) * q, q in -4..3. Weight 128n + 32k + l (n < 2, k < 4, l < 32): its low
// two bits are qs[32n + l] >> 2k, its third bit (weight = low - 4 where it is 0) bit 4n + k of
// hmask[l]; its group 8n + 2k + (l >> 4). The scales' 6 bits: groups 0-7's low 4 bits are
// bytes 0-7's low nibbles, groups 8-15's their high nibbles; bits 4-5 are bytes 8-11's pairs.
//
// A dot product, in every build (one total a super-block, as Q4_K's A): with u = q + 4 (0..7)
// and sc = the 6-bit scale - 32, exactly A = sum over groups g of sc[g] * (u . xq over g), B = sum
// over g of sc[g] * bsums[g], I = A - 4 B; then fa = fa + (float)I * (d * dx), y = fa.

// The 16 scales, minus 32 (ggml's word-at-a-time unpacking: 4 bytes a step).
static inline void mskq_scales3(const uint8_t *s, int *sc) {
    uint32_t a[3], u[4];
    std::memcpy(a, s, 12);
    u[0] = (a[0] & 0x0f0f0f0fu) | ((a[2] & 0x03030303u) << 4);
    u[1] = (a[1] & 0x0f0f0f0fu) | (((a[2] >> 2) & 0x03030303u) << 4);
    u[2] = ((a[0] >> 4) & 0x0f0f0f0fu) | (((a[2] >> 4) & 0x03030303u) << 4);
    u[3] = ((a[1] >> 4) & 0x0f0f0f0fu) | (((a[2] >> 6) & 0x03030303u) << 4);
    for (int g = 0; g < 16; g++) sc[g] = (int)mskq_byte(u, g) - 32;
}

// A super-block's 256 quants plus 4 (0..7), weight order.
static inline void mskq_unpack3_plain(const uint8_t *b, uint8_t *u) {
    for (int n = 0; n < 2; n++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < 32; l++)
                u[128 * n + 32 * k + l] = (uint8_t)(((b[32 + 32 * n + l] >> (2 * k)) & 3) | ((b[l] >> (4 * n + k)) & 1) << 2);
}

static void ms_dequant_q3_K(const void *w, float *y, long n) {
    const uint8_t *b = (const uint8_t *)w;
    for (long i = 0; i < n / 256; i++, b += 110, y += 256) {
        const float d = mskq_half(b + 108);
        int sc[16];
        uint8_t u[256];
        mskq_scales3(b + 96, sc);
        mskq_unpack3_plain(b, u);
        for (int g = 0; g < 16; g++) {
            const float dg = d * (float)sc[g];
            for (int l = 0; l < 16; l++) y[16 * g + l] = dg * (float)((int)u[16 * g + l] - 4);
        }
    }
}

#if defined(MSKQ_SIMD)
// Q3_K's and Q2_K's vector loops. The 8 int32 lane sums of one activation row (xb: its ms_a8k
// block) against a super-block's 256 weights as 8 vectors of 32 (W[c]: weights 32c .., 0..7,
// unsigned; groups 2c and 2c + 1), each group's products times its scale (S[c]: 8 words of
// each): vpmaddubsw pairs (< 2^15: 2 x 7 x 127), then vpmaddwd.
static inline __m256i mskq_dot16_scaled(const __m256i *W, const __m256i *S, const uint8_t *xb) {
    __m256i acc = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {
        const __m256i xq = _mm256_loadu_si256((const __m256i *)(xb + 4 + 32 * c));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(W[c], xq), S[c]));
    }
    return acc;
}

// S[c] for groups g and g + 1: g's scale in the low 8 words, g + 1's in the high.
static inline __m256i mskq_scale_pair(int s0, int s1) {
    return _mm256_setr_m128i(_mm_set1_epi16((short)s0), _mm_set1_epi16((short)s1));
}

static inline int32_t mskq_hsum_epi32(__m256i v) {  // exact: integers
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    return _mm_cvtsi128_si32(h);
}
#endif

// One weight row (n / 256 super-blocks at w) against NB activation rows (xstride bytes apart):
// y[j * ystride] (the order above).
template <int NB>
static void ms_dot_q3_K(long n, const void *w, const void *x, long xstride, float *y, long ystride) {
    const uint8_t *b = (const uint8_t *)w;
    float fa[NB];
    for (int j = 0; j < NB; j++) fa[j] = 0.f;
    for (long i = 0; i < n / 256; i++, b += 110) {
        int sc[16];
        mskq_scales3(b + 96, sc);
        const float d = mskq_half(b + 108);
#if defined(MSKQ_SIMD)
        mskq_prefetch(b, 110);
        // 8 vectors of 32 weights (128n + 32k ..), two groups each (mskq_dot16_scaled)
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b), three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
        __m256i W[8], S[8];
        for (int nn = 0; nn < 2; nn++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * nn));
            for (int k = 0; k < 4; k++) {
                const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(q, 2 * k), three);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * nn + k), one);
                W[4 * nn + k] = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 2));
                const int g = 8 * nn + 2 * k;
                S[4 * nn + k] = mskq_scale_pair(sc[g], sc[g + 1]);
            }
        }
        alignas(32) int16_t sc16[16];
        for (int g = 0; g < 16; g++) sc16[g] = (int16_t)sc[g];
        const __m256i scv = _mm256_load_si256((const __m256i *)sc16);
        for (int j = 0; j < NB; j++) {
            const uint8_t *xb = mskq_xblock(x, xstride, j, i);
            const __m256i bs = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xb + 260)), scv);
            // A - 4B, lane by lane
            const __m256i t = _mm256_sub_epi32(mskq_dot16_scaled(W, S, xb), _mm256_slli_epi32(bs, 2));
            float dx;
            std::memcpy(&dx, xb, 4);
            fa[j] = fa[j] + (float)mskq_hsum_epi32(t) * (d * dx);
        }
#else
        uint8_t u[256];
        mskq_unpack3_plain(b, u);
        for (int j = 0; j < NB; j++) {
            const uint8_t *xb = mskq_xblock(x, xstride, j, i);
            const int8_t *xq = (const int8_t *)(xb + 4);
            int16_t bsums[16];
            std::memcpy(bsums, xb + 260, 32);
            int32_t total = 0;
            for (int g = 0; g < 16; g++) {
                int32_t dot = 0;
                for (int l = 0; l < 16; l++) dot += (int32_t)u[16 * g + l] * xq[16 * g + l];
                total += sc[g] * (dot - 4 * bsums[g]);
            }
            float dx;
            std::memcpy(&dx, xb, 4);
            fa[j] = fa[j] + (float)total * (d * dx);
        }
#endif
    }
    for (int j = 0; j < NB; j++) y[j * ystride] = fa[j];
}

// A strip type P's packer (S rows a strip: 16 in the AVX-512 build, 8 in the AVX2 one): for each
// of the n / 256 super-blocks, fill(p, r, b) puts row r's stored super-block b (STORED bytes)
// into the packed block p (zeroed first: its padding).
template <class P, int S, int STORED, class Fill>
static inline void mskq_pack_rows(long n, const void *w, long wrow, void *out, Fill fill) {
    const uint8_t *rows = (const uint8_t *)w;
    for (long i = 0; i < n / 256; i++) {
        P p;
        std::memset(&p, 0, sizeof p);
        for (int r = 0; r < S; r++) fill(p, r, rows + r * wrow + i * STORED);
        std::memcpy((char *)out + i * sizeof(P), &p, sizeof p);
    }
}

// Row r's stored super-block b into a packed strip block p (lane r: row r), for the strips of
// both builds (mskq_p3 / mskq_p3x8, mskq_p2 / mskq_p2x8; IQ4_XS's below; their comments give
// the layouts).
template <class P>
static inline void mskq_fill3(P &p, int r, const uint8_t *b) {
    int sc[16];
    mskq_scales3(b + 96, sc);
    std::memcpy(&p.d[r], b + 108, 2);
    for (int c = 0; c < 8; c++) p.sc[c][2 * r] = (int8_t)sc[2 * c], p.sc[c][2 * r + 1] = (int8_t)sc[2 * c + 1];
    for (int pc = 0; pc < 8; pc++) {
        std::memcpy(&p.h[pc][4 * r], b + 4 * pc, 4);
        for (int nn = 0; nn < 2; nn++) std::memcpy(&p.q[nn][pc][4 * r], b + 32 + 32 * nn + 4 * pc, 4);
    }
}
template <class P>
static inline void mskq_fill2(P &p, int r, const uint8_t *b) {
    std::memcpy(&p.d[r], b + 80, 2);
    std::memcpy(&p.dmin[r], b + 82, 2);
    for (int c = 0; c < 8; c++) p.sm[c][2 * r] = b[2 * c], p.sm[c][2 * r + 1] = b[2 * c + 1];
    for (int pc = 0; pc < 8; pc++)
        for (int nn = 0; nn < 2; nn++) std::memcpy(&p.q[nn][pc][4 * r], b + 16 + 32 * nn + 4 * pc, 4);
}


#if defined(MSKQ_AVX512)
// A 16-row strip's float steps for super-block i from NB activation rows' exact totals I (a row
// a lane) and the rows' d as stored: fa = fa + (float)I * (d * dx), lane by lane, as the rows as
// stored take them; then the 16 rows' results out.
template <int NB>
static inline void mskq_strip_float(const uint16_t *d16, const __m512i *I, const void *x, long xstride, long i,
                                    __m512 *fa) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d16));
    for (int j = 0; j < NB; j++) {
        float dx;
        std::memcpy(&dx, mskq_xblock(x, xstride, j, i), 4);
        fa[j] = _mm512_add_ps(fa[j], _mm512_mul_ps(_mm512_cvtepi32_ps(I[j]), _mm512_mul_ps(d, _mm512_set1_ps(dx))));
    }
}

// One activation row (xb: its ms_a8k block) against chunk c of a 16-row strip (W[pc]: 16 rows'
// 4 weights 32c + 4pc .. as bytes): the totals of groups 2c (pieces 0..3, t0) and 2c + 1 (4..7,
// t1), a row a lane, one vpdpbusd a piece against 4 broadcast activation bytes.
static inline void mskq_group_pair(const __m512i *W, const uint8_t *xb, int c, __m512i &t0, __m512i &t1) {
    const uint8_t *xq = xb + 4 + 32 * c;
    t0 = _mm512_setzero_si512(), t1 = _mm512_setzero_si512();
    for (int pc = 0; pc < 4; pc++) {  // two chains
        int32_t a0, a1;
        std::memcpy(&a0, xq + 4 * pc, 4);
        std::memcpy(&a1, xq + 16 + 4 * pc, 4);
        t0 = _mm512_dpbusd_epi32(t0, W[pc], _mm512_set1_epi32(a0));
        t1 = _mm512_dpbusd_epi32(t1, W[pc + 4], _mm512_set1_epi32(a1));
    }
}
// Two lanes' values below 2^15 in magnitude as an int16 pair a lane (t0 low, t1 high), for
// vpdpwssd by a pair of scales.
static inline __m512i mskq_int16_pairs(__m512i t0, __m512i t1) {
    return _mm512_mask_blend_epi16(0xAAAAAAAAu, t0, _mm512_slli_epi32(t1, 16));
}
template <int NB>
static inline void mskq_strip_store(const __m512 *fa, float *y, long ystride) {
    for (int j = 0; j < NB; j++) {
        alignas(64) float v[16];
        _mm512_store_ps(v, fa[j]);
        for (int r = 0; r < 16; r++) y[j * ystride + r] = v[r];
    }
}

// Q3_K packed at load, 16 rows a strip (decode.cpp's T_Q3_K_P16, AVX-512). Per super-block, for
// the 16 rows (lane r: row r's 4 bytes): q[n][p] = qs[32n + 4p .. 4p + 3] (the low bit pairs of
// weights 128n + 32k + 4p .., k = 0..3, at bits 2k), h[p] = hmask[4p .. 4p + 3] (their third bits at
// bit 4n + k); the group pairs' scales minus 32 as bytes, row by row (sc[c][2r], sc[c][2r + 1]:
// groups 2c and 2c + 1 of row r); the rows' d as stored: 16 x the stored bytes, plus 64. A
// chunk of 32 weights (n, k) is groups 2c, 2c + 1 (c = 4n + k): u = q + 4 (0..7) by two shifts
// and masks a piece, then per activation row one vpdpbusd a piece against 4 broadcast bytes;
// each group's total less 4 x its activation sum fits 16 bits (|.| < 2^15), the pair is packed
// to int16 pairs and vpdpwssd by its two scales adds sc . (u . xq - 4 bsum) into the lane's
// exact total I, as the rows as stored's; then their float step lane by lane: the same bits.
struct mskq_p3 {
    uint8_t q[2][8][64];
    uint8_t h[8][64];
    int8_t sc[8][32];
    uint16_t d[16];
};
static_assert(sizeof(mskq_p3) == 16 * 110 + 64, "16 stored super-blocks and 16 scales' bytes");

// 16 stored rows of n weights (the first at w, wrow bytes apart) -> n / 256 packed blocks.
static void mskq_pack3_rows(long n, const void *w, long wrow, void *out) {
    mskq_pack_rows<mskq_p3, 16, 110>(n, w, wrow, out, mskq_fill3<mskq_p3>);
}

// The 16 rows of a packed strip (n / 256 blocks at w) against NB activation rows (ms_a8k rows,
// xstride bytes apart): y[j * ystride + r] for rows r < 16.
template <int NB>
static void mskq_dot_p3(long n, const void *w, const void *x, long xstride, float *y, long ystride) {
    const mskq_p3 *u = (const mskq_p3 *)w;
    const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
    __m512 fa[NB];
    for (int j = 0; j < NB; j++) fa[j] = _mm512_setzero_ps();
    const long nb = n / 256;
    for (long i = 0; i < nb; i++) {
        const mskq_p3 &p = u[i];
        if (i + 1 < nb)  // (as the other strips: from memory the prefetchers alone fall behind)
            for (int o = 0; o < (int)sizeof(mskq_p3); o += 64) _mm_prefetch((const char *)(u + i + 1) + o, _MM_HINT_T0);
        __m512i I[NB];
        for (int j = 0; j < NB; j++) I[j] = _mm512_setzero_si512();
        for (int nn = 0; nn < 2; nn++)
            for (int k = 0; k < 4; k++) {
                const int c = 4 * nn + k, hb = 4 * nn + k;  // groups 2c, 2c + 1; the third bits' place
                __m512i W[8];
                for (int pc = 0; pc < 8; pc++) {
                    const __m512i lo = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512((const void *)p.q[nn][pc]), 2 * k), three);
                    const __m512i h = _mm512_loadu_si512((const void *)p.h[pc]);
                    const __m512i hi = _mm512_and_si512(hb >= 2 ? _mm512_srli_epi16(h, hb - 2) : _mm512_slli_epi16(h, 2 - hb), four);
                    W[pc] = _mm512_or_si512(lo, hi);
                }
                const __m512i sc = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p.sc[c]));
                for (int j = 0; j < NB; j++) {
                    const uint8_t *xb = mskq_xblock(x, xstride, j, i);
                    __m512i t0, t1;
                    mskq_group_pair(W, xb, c, t0, t1);
                    int16_t bs[2];
                    std::memcpy(bs, xb + 260 + 4 * c, 4);
                    t0 = _mm512_sub_epi32(t0, _mm512_set1_epi32(4 * (int32_t)bs[0]));
                    t1 = _mm512_sub_epi32(t1, _mm512_set1_epi32(4 * (int32_t)bs[1]));
                    I[j] = _mm512_dpwssd_epi32(I[j], mskq_int16_pairs(t0, t1), sc);
                }
            }
        mskq_strip_float<NB>(p.d, I, x, xstride, i, fa);
    }
    mskq_strip_store<NB>(fa, y, ystride);
}
#endif

#if defined(MSKQ_AVX2)
// Q3_K packed at load, 8 rows a strip, for the AVX2 build (decode.cpp's T_Q3_K_P8): mskq_p3 with
// 8 lanes (lane r: row r's 4 bytes; sc[c][2r], sc[c][2r + 1]: row r's groups 2c and 2c + 1), d as
// stored, then 16 bytes of padding (928 bytes: 8 x the stored 110, plus 48; whole 32-byte lines).
// A chunk of 32 weights (n, k) is groups 2c, 2c + 1 (c = 4n + k): u = q + 4 (0..7) by two shifts
// and masks a piece, then per activation row a vpmaddubsw a piece against 4 broadcast bytes, a
// group's 4 pieces' pairs added as int16 (4 x 2 x 7 x 128 < 2^15), one vpmaddwd into int32; the
// group's total less 4 x its activation sum (< 2^15 in magnitude) goes into an int16 pair with
// the other group's, and one vpmaddwd by the two scales adds sc . (u . xq - 4 bsum) into the
// lane's exact total I, as mskq_dot_p3 and the rows as stored do; then the same float step lane
// by lane: the same bits.
struct mskq_p3x8 {
    uint8_t q[2][8][32];
    uint8_t h[8][32];
    int8_t sc[8][16];
    uint16_t d[8];
    uint8_t pad[16];
};
static_assert(sizeof(mskq_p3x8) == 8 * 110 + 48 && sizeof(mskq_p3x8) % 32 == 0, "packed blocks back to back");

// 8 stored rows of n weights (the first at w, wrow bytes apart) -> n / 256 packed blocks.
static void mskq_pack3x8_rows(long n, const void *w, long wrow, void *out) {
    mskq_pack_rows<mskq_p3x8, 8, 110>(n, w, wrow, out, mskq_fill3<mskq_p3x8>);
}

// The 8 rows of a packed strip (n / 256 blocks at w) against NB activation rows (ms_a8k rows,
// xstride bytes apart): y[j * ystride + r] for rows r < 8.
template <int NB>
static void mskq_dot_p3x8(long n, const void *w, const void *x, long xstride, float *y, long ystride) {
    const mskq_p3x8 *u = (const mskq_p3x8 *)w;
    const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4), ones = _mm256_set1_epi16(1);
    __m256 fa[NB];
    for (int j = 0; j < NB; j++) fa[j] = _mm256_setzero_ps();
    for (long i = 0; i < n / 256; i++) {
        const mskq_p3x8 &p = u[i];
        mskq_strip8_prefetch<NB>(u + i);
        __m256i I[NB];
        for (int j = 0; j < NB; j++) I[j] = _mm256_setzero_si256();
        for (int nn = 0; nn < 2; nn++)
            for (int k = 0; k < 4; k++) {
                const int c = 4 * nn + k, hb = 4 * nn + k;  // groups 2c, 2c + 1; the third bits' place
                __m256i W[8];
                for (int pc = 0; pc < 8; pc++) {
                    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(_mm256_load_si256((const __m256i *)p.q[nn][pc]), 2 * k), three);
                    const __m256i h = _mm256_load_si256((const __m256i *)p.h[pc]);
                    const __m256i hi = _mm256_and_si256(hb >= 2 ? _mm256_srli_epi16(h, hb - 2) : _mm256_slli_epi16(h, 2 - hb), four);
                    W[pc] = _mm256_or_si256(lo, hi);
                }
                const __m256i sc = _mm256_cvtepi8_epi16(_mm_load_si128((const __m128i *)p.sc[c]));
                for (int j = 0; j < NB; j++) {
                    const uint8_t *xb = mskq_xblock(x, xstride, j, i), *xq = xb + 4 + 32 * c;
                    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
                    for (int pc = 0; pc < 4; pc++) {
                        int32_t a0, a1;
                        std::memcpy(&a0, xq + 4 * pc, 4);
                        std::memcpy(&a1, xq + 16 + 4 * pc, 4);
                        s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(W[pc], _mm256_set1_epi32(a0)));
                        s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(W[pc + 4], _mm256_set1_epi32(a1)));
                    }
                    int16_t bs[2];
                    std::memcpy(bs, xb + 260 + 4 * c, 4);
                    const __m256i t0 = _mm256_sub_epi32(_mm256_madd_epi16(s0, ones), _mm256_set1_epi32(4 * (int32_t)bs[0]));
                    const __m256i t1 = _mm256_sub_epi32(_mm256_madd_epi16(s1, ones), _mm256_set1_epi32(4 * (int32_t)bs[1]));
                    const __m256i pairs = _mm256_blend_epi16(t0, _mm256_slli_epi32(t1, 16), 0xAA);
                    I[j] = _mm256_add_epi32(I[j], _mm256_madd_epi16(pairs, sc));
                }
            }
        mskq_strip8_float<NB>(p.d, I, x, xstride, i, fa);
    }
    mskq_strip8_store<NB>(fa, y, ystride);
}
#endif

// ---------------------------------------------------------------- Q2_K
// Q2_K, 84 bytes: {u8 scales[16]; u8 qs[64]; fp16 d, dmin}: 16 groups of 16 weights, w = d *
// (scales[g] & 15) * q - dmin * (scales[g] >> 4), q in 0..3. Weight 128n + 32k + l (n < 2, k < 4,
// l < 32) is qs[32n + l] >> 2k (two bits), in group 8n + 2k + (l >> 4), as Q3_K's low bits.
//
// A dot product, in every build, as Q4_K's (mskq_k45_float): exactly A = sum over groups g of
// (scales[g] & 15) * (q . xq over g), B = sum over g of (scales[g] >> 4) * bsums[g]; then
// fa = fa + (float)A * (d * dx), fb = fb + (float)B * (dmin * dx), y = fa - fb.

static void ms_dequant_q2_K(const void *w, float *y, long n) {
    const uint8_t *b = (const uint8_t *)w;
    for (long i = 0; i < n / 256; i++, b += 84, y += 256) {
        const float d = mskq_half(b + 80), dmin = mskq_half(b + 82);
        for (int nn = 0; nn < 2; nn++)
            for (int k = 0; k < 4; k++)
                for (int h = 0; h < 2; h++) {
                    const int g = 8 * nn + 2 * k + h;
                    const float dl = d * (float)(b[g] & 15), ml = dmin * (float)(b[g] >> 4);
                    for (int l = 16 * h; l < 16 * h + 16; l++)
                        y[128 * nn + 32 * k + l] = dl * (float)((b[16 + 32 * nn + l] >> (2 * k)) & 3) - ml;
                }
    }
}

// One weight row (n / 256 super-blocks at w) against NB activation rows (xstride bytes apart):
// y[j * ystride] (the order above).
template <int NB>
static void ms_dot_q2_K(long n, const void *w, const void *x, long xstride, float *y, long ystride) {
    const uint8_t *b = (const uint8_t *)w;
    float fa[NB], fb[NB];
    for (int j = 0; j < NB; j++) fa[j] = fb[j] = 0.f;
    for (long i = 0; i < n / 256; i++, b += 84) {
        const float d = mskq_half(b + 80), dmin = mskq_half(b + 82);
#if defined(MSKQ_SIMD)
        mskq_prefetch(b, 84);
        // 8 vectors of 32 weights (128n + 32k ..), two groups each (mskq_dot16_scaled); the mins
        // against the group sums
        const __m256i three = _mm256_set1_epi8(3);
        __m256i W[8], S[8];
        for (int nn = 0; nn < 2; nn++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * nn));
            for (int k = 0; k < 4; k++) {
                const int g = 8 * nn + 2 * k;
                W[4 * nn + k] = _mm256_and_si256(_mm256_srli_epi16(q, 2 * k), three);
                S[4 * nn + k] = mskq_scale_pair(b[g] & 15, b[g + 1] & 15);
            }
        }
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_srli_epi16(_mm_and_si128(_mm_loadu_si128((const __m128i *)b), _mm_set1_epi8((char)0xF0)), 4));
        for (int j = 0; j < NB; j++) {
            const uint8_t *xb = mskq_xblock(x, xstride, j, i);
            const int32_t A = mskq_hsum_epi32(mskq_dot16_scaled(W, S, xb));
            const int32_t B = mskq_hsum_epi32(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xb + 260)), mins));
            float dx;
            std::memcpy(&dx, xb, 4);
            fa[j] = fa[j] + (float)A * (d * dx);
            fb[j] = fb[j] + (float)B * (dmin * dx);
        }
#else
        for (int j = 0; j < NB; j++) {
            const uint8_t *xb = mskq_xblock(x, xstride, j, i);
            const int8_t *xq = (const int8_t *)(xb + 4);
            int16_t bsums[16];
            std::memcpy(bsums, xb + 260, 32);
            int32_t A = 0, B = 0;
            for (int nn = 0; nn < 2; nn++)
                for (int k = 0; k < 4; k++)
                    for (int h = 0; h < 2; h++) {
                        const int g = 8 * nn + 2 * k + h;
                        int32_t dot = 0;
                        for (int l = 16 * h; l < 16 * h + 16; l++)
                            dot += (int32_t)((b[16 + 32 * nn + l] >> (2 * k)) & 3) * xq[128 * nn + 32 * k + l];
                        A += (b[g] & 15) * dot;
                        B += (b[g] >> 4) * bsums[g];
                    }
            float dx;
            std::memcpy(&dx, xb, 4);
            fa[j] = fa[j] + (float)A * (d * dx);
            fb[j] = fb[j] + (float)B * (dmin * dx);
        }
#endif
    }
    for (int j = 0; j < NB; j++) y[j * ystride] = fa[j] - fb[j];
}

#if defined(MSKQ_AVX512)
// Q2_K packed at load, 16 rows a strip (decode.cpp's T_Q2_K_P16, AVX-512): per super-block, for
// the 16 rows (lane r: row r's 4 bytes), q[n][p] = qs[32n + 4p .. 4p + 3] (the bit pairs of
// weights 128n + 32k + 4p .., k = 0..3, at bits 2k, as mskq_p3's); the group pairs' scale bytes
// as stored, row by row (sm[c][2r], sm[c][2r + 1]: groups 2c and 2c + 1 of row r, scale in the
// low nibble, min in the high); the rows' d and dmin as stored: 16 x the stored bytes. A chunk
// of 32 weights (n, k) is groups 2c, 2c + 1 (c = 4n + k): q by a shift and a mask a piece, one
// vpdpbusd a piece against 4 broadcast activation bytes; each group's total fits 16 bits (<= 16
// x 3 x 127), the pair is packed to int16 pairs and vpdpwssd by the two scales adds it into the
// lane's A, and vpdpwssd of the two mins by the groups' activation sums into its B: the rows as
// stored's exact totals, then their float steps lane by lane (y = fa - fb): the same bits.
struct mskq_p2 {
    uint8_t q[2][8][64];
    uint8_t sm[8][32];
    uint16_t d[16], dmin[16];
};
static_assert(sizeof(mskq_p2) == 16 * 84, "16 stored super-blocks");

// 16 stored rows of n weights (the first at w, wrow bytes apart) -> n / 256 packed blocks.
static void mskq_pack2_rows(long n, const void *w, long wrow, void *out) {
    mskq_pack_rows<mskq_p2, 16, 84>(n, w, wrow, out, mskq_fill2<mskq_p2>);
}

// The 16 rows of a packed strip (n / 256 blocks at w) against NB activation rows (ms_a8k rows,
// xstride bytes apart): y[j * ystride + r] for rows r < 16.
template <int NB>
static void mskq_dot_p2(long n, const void *w, const void *x, long xstride, float *y, long ystride) {
    const mskq_p2 *u = (const mskq_p2 *)w;
    const __m512i three = _mm512_set1_epi8(3), m15 = _mm512_set1_epi16(15);
    __m512 fa[NB], fb[NB];
    for (int j = 0; j < NB; j++) fa[j] = fb[j] = _mm512_setzero_ps();
    const long nb = n / 256;
    for (long i = 0; i < nb; i++) {
        const mskq_p2 &p = u[i];
        if (i + 1 < nb)  // (as the other strips: from memory the prefetchers alone fall behind)
            for (int o = 0; o < (int)sizeof(mskq_p2); o += 64) _mm_prefetch((const char *)(u + i + 1) + o, _MM_HINT_T0);
        __m512i A[NB], B[NB];
        for (int j = 0; j < NB; j++) A[j] = B[j] = _mm512_setzero_si512();
        for (int nn = 0; nn < 2; nn++)
            for (int k = 0; k < 4; k++) {
                const int c = 4 * nn + k;  // groups 2c, 2c + 1
                __m512i W[8];
                for (int pc = 0; pc < 8; pc++)
                    W[pc] = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512((const void *)p.q[nn][pc]), 2 * k), three);
                const __m512i sm = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p.sm[c]));
                const __m512i sc = _mm512_and_si512(sm, m15), mn = _mm512_srli_epi16(sm, 4);
                for (int j = 0; j < NB; j++) {
                    const uint8_t *xb = mskq_xblock(x, xstride, j, i);
                    __m512i t0, t1;
                    mskq_group_pair(W, xb, c, t0, t1);
                    A[j] = _mm512_dpwssd_epi32(A[j], mskq_int16_pairs(t0, t1), sc);
                    int32_t bs;  // the two groups' activation sums, an int16 pair
                    std::memcpy(&bs, xb + 260 + 4 * c, 4);
                    B[j] = _mm512_dpwssd_epi32(B[j], mn, _mm512_set1_epi32(bs));
                }
            }
        mskq_strip_float<NB>(p.d, A, x, xstride, i, fa);
        mskq_strip_float<NB>(p.dmin, B, x, xstride, i, fb);
    }
    for (int j = 0; j < NB; j++) fa[j] = _mm512_sub_ps(fa[j], fb[j]);
    mskq_strip_store<NB>(fa, y, ystride);
}
#endif

#if defined(MSKQ_AVX2)
// Q2_K packed at load, 8 rows a strip, for the AVX2 build (decode.cpp's T_Q2_K_P8): mskq_p2 with
// 8 lanes (lane r: row r's 4 bytes; sm[c][2r], sm[c][2r + 1]: row r's groups 2c and 2c + 1), d
// and dmin as stored: 8 x the stored bytes. A piece by a shift and a mask, then per activation
// row a vpmaddubsw a piece against 4 broadcast bytes, a group's 4 pieces' pairs added as int16
// (4 x 2 x 3 x 128 < 2^15) and one vpmaddwd by the group's scale (an int16 pair (s, s) a lane)
// into the lane's A; vpmaddwd of the two mins by the groups' activation sums into its B: the
// rows as stored's exact totals, then their float steps lane by lane (y = fa - fb): the same
// bits.
struct mskq_p2x8 {
    uint8_t q[2][8][32];
    uint8_t sm[8][16];
    uint16_t d[8], dmin[8];
};
static_assert(sizeof(mskq_p2x8) == 8 * 84 && sizeof(mskq_p2x8) % 32 == 0, "packed blocks back to back");

// 8 stored rows of n weights (the first at w, wrow bytes apart) -> n / 256 packed blocks.
static void mskq_pack2x8_rows(long n, const void *w, long wrow, void *out) {
    mskq_pack_rows<mskq_p2x8, 8, 84>(n, w, wrow, out, mskq_fill2<mskq_p2x8>);
}

// The 8 rows of a packed strip (n / 256 blocks at w) against NB activation rows (ms_a8k rows,
// xstride bytes apart): y[j * ystride + r] for rows r < 8.
template <int NB>
static void mskq_dot_p2x8(long n, const void *w, const void *x, long xstride, float *y, long ystride) {
    const mskq_p2x8 *u = (const mskq_p2x8 *)w;
    const __m256i three = _mm256_set1_epi8(3), m15 = _mm256_set1_epi16(15);
    // int16 words 0, 2, 4, .. (1, 3, ..) of each 32-bit lane twice: a group's scale as a pair
    const __m256i even = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
    const __m256i odd = _mm256_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15, 2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15);
    __m256 fa[NB], fb[NB];
    for (int j = 0; j < NB; j++) fa[j] = fb[j] = _mm256_setzero_ps();
    for (long i = 0; i < n / 256; i++) {
        const mskq_p2x8 &p = u[i];
        mskq_strip8_prefetch<NB>(u + i);
        __m256i A[NB], B[NB];
        for (int j = 0; j < NB; j++) A[j] = B[j] = _mm256_setzero_si256();
        for (int nn = 0; nn < 2; nn++)
            for (int k = 0; k < 4; k++) {
                const int c = 4 * nn + k;  // groups 2c, 2c + 1
                __m256i W[8];
                for (int pc = 0; pc < 8; pc++)
                    W[pc] = _mm256_and_si256(_mm256_srli_epi16(_mm256_load_si256((const __m256i *)p.q[nn][pc]), 2 * k), three);
                const __m256i sm = _mm256_cvtepu8_epi16(_mm_load_si128((const __m128i *)p.sm[c]));
                const __m256i sc = _mm256_and_si256(sm, m15), mn = _mm256_srli_epi16(sm, 4);
                const __m256i sc0 = _mm256_shuffle_epi8(sc, even), sc1 = _mm256_shuffle_epi8(sc, odd);
                for (int j = 0; j < NB; j++) {
                    const uint8_t *xb = mskq_xblock(x, xstride, j, i), *xq = xb + 4 + 32 * c;
                    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
                    for (int pc = 0; pc < 4; pc++) {
                        int32_t a0, a1;
                        std::memcpy(&a0, xq + 4 * pc, 4);
                        std::memcpy(&a1, xq + 16 + 4 * pc, 4);
                        s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(W[pc], _mm256_set1_epi32(a0)));
                        s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(W[pc + 4], _mm256_set1_epi32(a1)));
                    }
                    A[j] = _mm256_add_epi32(A[j], _mm256_add_epi32(_mm256_madd_epi16(s0, sc0), _mm256_madd_epi16(s1, sc1)));
                    int32_t bs;  // the two groups' activation sums, an int16 pair
                    std::memcpy(&bs, xb + 260 + 4 * c, 4);
                    B[j] = _mm256_add_epi32(B[j], _mm256_madd_epi16(mn, _mm256_set1_epi32(bs)));
                }
            }
        mskq_strip8_float<NB>(p.d, A, x, xstride, i, fa);
        mskq_strip8_float<NB>(p.dmin, B, x, xstride, i, fb);
    }
    for (int j = 0; j < NB; j++) fa[j] = _mm256_sub_ps(fa[j], fb[j]);
    mskq_strip8_store<NB>(fa, y, ystride);
}
#endif

// ---------------------------------------------------------------- IQ4_XS
// IQ4_XS, 136 bytes: {fp16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]}: 8 sub-blocks of 32
// weights, w = d * (ls[s] - 32) * v[q], v = IQ4_NL's 16 values (msq_iq4nl, -127..113), q a
// 4-bit index: weight 32s + l's is qs[16s + l]'s low nibble (l < 16) or qs[16s + l - 16]'s
// high one. Sub-block s's 6-bit ls: its low 4 bits are scales_l[s / 2]'s nibble s % 2, its
// high 2 bits scales_h's bits 2s, 2s + 1.
//
// A dot product, in every build (one total a super-block, as Q3_K's): with sc = ls - 32,
// exactly I = sum over sub-blocks s of sc[s] * (v . xq over s); then fa = fa + (float)I * (d *
// dx), y = fa. The vector builds: |v| . (xq with v's signs) by vpmaddubsw (pairs < 2^15: 2 x
// 127 x 127), then times the scale into int32 lanes: AVX-512, two sub-blocks a register and
// vpdpwssd (the signs by a masked subtract: no 512-bit vpsignb); AVX2, one and vpmaddwd, as
// llama.cpp's AVX2 loop.

// The 8 sub-blocks' scales, minus 32.
static inline void mskq_scales_iq4xs(const uint8_t *b, int *sc) {
    const uint16_t h = (uint16_t)(b[2] | b[3] << 8);
    for (int s = 0; s < 8; s++) sc[s] = (int)(((b[4 + s / 2] >> (4 * (s % 2))) & 15) | (((h >> (2 * s)) & 3) << 4)) - 32;
}

// Row r's stored super-block b into a packed strip block p (mskq_pxs, mskq_pxsx8).
template <class P>
static inline void mskq_fill_xs(P &p, int r, const uint8_t *b) {
    int sc[8];
    mskq_scales_iq4xs(b, sc);
    std::memcpy(&p.d[r], b, 2);
    for (int s = 0; s < 8; s++) {
        p.sc[s][r] = (int8_t)sc[s];
        for (int v = 0; v < 4; v++) std::memcpy(&p.q[s][v][4 * r], b + 8 + 16 * s + 4 * v, 4);
    }
}

static void ms_dequant_iq4_xs(const void *w, float *y, long n) {
    const uint8_t *b = (const uint8_t *)w;
    for (long i = 0; i < n / 256; i++, b += 136, y += 256) {
        const float d = mskq_half(b);
        int sc[8];
        mskq_scales_iq4xs(b, sc);
        for (int s = 0; s < 8; s++) {
            const float dl = d * (float)sc[s];
            const uint8_t *q = b + 8 + 16 * s;
            for (int l = 0; l < 16; l++) {
                y[32 * s + l] = dl * (float)msq_iq4nl[q[l] & 15];
                y[32 * s + 16 + l] = dl * (float)msq_iq4nl[q[l] >> 4];
            }
        }
    }
}

// One weight row (n / 256 super-blocks at w) against NB activation rows (xstride bytes apart):
// y[j * ystride] (the order above).
template <int NB>
static void ms_dot_iq4_xs(long n, const void *w, const void *x, long xstride, float *y, long ystride) {
    const uint8_t *b = (const uint8_t *)w;
    float fa[NB];
    for (int j = 0; j < NB; j++) fa[j] = 0.f;
#if defined(MSKQ_AVX512)
    const __m512i values = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)msq_iq4nl));
    const __m256i m4 = _mm256_set1_epi8(0x0f);
#elif defined(MSKQ_SIMD)
    const __m256i values = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)msq_iq4nl));
    const __m128i m4 = _mm_set1_epi8(0x0f);
#endif
    for (long i = 0; i < n / 256; i++, b += 136) {
        int sc[8];
        mskq_scales_iq4xs(b, sc);
        const float d = mskq_half(b);
#if defined(MSKQ_AVX512)
        mskq_prefetch(b, 136);
        // sub-blocks 2t and 2t + 1 as 64 signed values in weight order: their magnitudes (M),
        // where they are negative (N), the two scales (S: 16 words each)
        __m512i M[4], S[4];
        __mmask64 N[4];
        for (int t = 0; t < 4; t++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 8 + 32 * t));
            const __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            // [lo 2t | lo 2t+1 | hi 2t | hi 2t+1] -> [lo 2t | hi 2t | lo 2t+1 | hi 2t+1]
            const __m512i idx = _mm512_shuffle_i64x2(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1),
                                                     _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), 0xd8);
            const __m512i v = _mm512_shuffle_epi8(values, idx);
            M[t] = _mm512_abs_epi8(v);
            N[t] = _mm512_movepi8_mask(v);
            S[t] = _mm512_inserti64x4(_mm512_set1_epi16((short)sc[2 * t]), _mm256_set1_epi16((short)sc[2 * t + 1]), 1);
        }
        for (int j = 0; j < NB; j++) {
            const uint8_t *xb = mskq_xblock(x, xstride, j, i);
            __m512i acc = _mm512_setzero_si512();
            for (int t = 0; t < 4; t++) {
                const __m512i xq = _mm512_loadu_si512((const void *)(xb + 4 + 64 * t));
                const __m512i xs = _mm512_mask_sub_epi8(xq, N[t], _mm512_setzero_si512(), xq);
                acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(M[t], xs), S[t]);
            }
            float dx;
            std::memcpy(&dx, xb, 4);
            fa[j] = fa[j] + (float)_mm512_reduce_add_epi32(acc) * (d * dx);
        }
#elif defined(MSKQ_SIMD)
        mskq_prefetch(b, 136);
        // sub-block s as 32 signed values in weight order (V), their magnitudes (M), its scale (S)
        __m256i V[8], M[8], S[8];
        for (int s = 0; s < 8; s++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + 8 + 16 * s));
            const __m256i idx = _mm256_setr_m128i(_mm_and_si128(q, m4), _mm_and_si128(_mm_srli_epi16(q, 4), m4));
            V[s] = _mm256_shuffle_epi8(values, idx);
            M[s] = _mm256_sign_epi8(V[s], V[s]);
            S[s] = _mm256_set1_epi16((short)sc[s]);
        }
        for (int j = 0; j < NB; j++) {
            const uint8_t *xb = mskq_xblock(x, xstride, j, i);
            __m256i acc = _mm256_setzero_si256();
            for (int s = 0; s < 8; s++) {
                const __m256i xq = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xb + 4 + 32 * s)), V[s]);
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(M[s], xq), S[s]));
            }
            float dx;
            std::memcpy(&dx, xb, 4);
            fa[j] = fa[j] + (float)mskq_hsum_epi32(acc) * (d * dx);
        }
#else
        int8_t v[256];
        for (int s = 0; s < 8; s++)
            for (int l = 0; l < 16; l++) {
                const uint8_t q = b[8 + 16 * s + l];
                v[32 * s + l] = msq_iq4nl[q & 15];
                v[32 * s + 16 + l] = msq_iq4nl[q >> 4];
            }
        for (int j = 0; j < NB; j++) {
            const uint8_t *xb = mskq_xblock(x, xstride, j, i);
            const int8_t *xq = (const int8_t *)(xb + 4);
            int32_t total = 0;
            for (int s = 0; s < 8; s++) {
                int32_t dot = 0;
                for (int l = 0; l < 32; l++) dot += (int32_t)v[32 * s + l] * xq[32 * s + l];
                total += sc[s] * dot;
            }
            float dx;
            std::memcpy(&dx, xb, 4);
            fa[j] = fa[j] + (float)total * (d * dx);
        }
#endif
    }
    for (int j = 0; j < NB; j++) y[j * ystride] = fa[j];
}

#if defined(MSKQ_AVX512)
// IQ4_XS packed at load, 16 rows a strip (decode.cpp's T_IQ4_XS_P16, AVX-512): per super-block,
// sub-block s's quants of the 16 rows in MsqStrip's 4-bit layout (q[s][v]: lane l holds bytes
// 4v .. 4v + 3 of row l's 16 bytes of sub-block s -- low nibbles weights 4v .., high nibbles
// 16 + 4v ..), then the rows' scales minus 32 (sc[s][l]) and their d as stored: 16 x the stored
// super-block's bytes, plus 32. One vpdpbusd of 16 rows' 4 values (+ 128, as IQ4_NL's: msq_lut)
// against 4 broadcast activation bytes is 64 products; per sub-block and lane (a row), T = the
// 32 products less 128 x the sub-block's activation sum (bsums), I = I + sc x T (vpmulld): the
// rows as stored's exact total, then their float step lane by lane -- the same bits.
struct mskq_pxs {
    uint8_t q[8][4][64];
    int8_t sc[8][16];
    uint16_t d[16];
};
static_assert(sizeof(mskq_pxs) == 16 * 136 + 32, "16 stored super-blocks and 16 scales' bytes");

// 16 stored rows of n weights (the first at w, wrow bytes apart) -> n / 256 packed blocks.
static void mskq_pack_xs_rows(long n, const void *w, long wrow, void *out) {
    mskq_pack_rows<mskq_pxs, 16, 136>(n, w, wrow, out, mskq_fill_xs<mskq_pxs>);
}

// The 16 rows of a packed strip (n / 256 blocks at w) against NB activation rows (ms_a8k rows,
// xstride bytes apart): y[j * ystride + r] for rows r < 16.
template <int NB>
static void mskq_dot_pxs(long n, const void *w, const void *x, long xstride, float *y, long ystride) {
    const mskq_pxs *u = (const mskq_pxs *)w;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_xor_si128(_mm_load_si128((const __m128i *)msq_iq4nl), _mm_set1_epi8((char)0x80)));
    __m512 fa[NB];
    for (int j = 0; j < NB; j++) fa[j] = _mm512_setzero_ps();
    const long nb = n / 256;
    for (long i = 0; i < nb; i++) {
        const mskq_pxs &p = u[i];
        if (i + 1 < nb)  // (as the 32-weight strips: from memory the prefetchers alone fall behind)
            for (int o = 0; o < (int)sizeof(mskq_pxs); o += 64) _mm_prefetch((const char *)(u + i + 1) + o, _MM_HINT_T0);
        __m512i I[NB];
        for (int j = 0; j < NB; j++) I[j] = _mm512_setzero_si512();
        for (int s = 0; s < 8; s++) {
            __m512i W[8];
            for (int v = 0; v < 4; v++) {
                const __m512i q = _mm512_loadu_si512((const void *)p.q[s][v]);
                W[v] = _mm512_shuffle_epi8(lut, _mm512_and_si512(q, m4));
                W[v + 4] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(q, 4), m4));
            }
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p.sc[s]));
            for (int j = 0; j < NB; j++) {
                const uint8_t *xb = mskq_xblock(x, xstride, j, i);
                const uint8_t *xq = xb + 4 + 32 * s;  // piece pp (W[pp]): weights 4 pp .. of the sub-block
                __m512i t0 = _mm512_setzero_si512(), t1 = _mm512_setzero_si512();
                for (int pp = 0; pp < 8; pp += 2) {  // two chains, then their sum (integers: the same total)
                    int32_t a0, a1;
                    std::memcpy(&a0, xq + 4 * pp, 4);
                    std::memcpy(&a1, xq + 4 * pp + 4, 4);
                    t0 = _mm512_dpbusd_epi32(t0, W[pp], _mm512_set1_epi32(a0));
                    t1 = _mm512_dpbusd_epi32(t1, W[pp + 1], _mm512_set1_epi32(a1));
                }
                int16_t bs[2];
                std::memcpy(bs, xb + 260 + 4 * s, 4);
                const __m512i t = _mm512_sub_epi32(_mm512_add_epi32(t0, t1), _mm512_set1_epi32(((int32_t)bs[0] + bs[1]) * 128));
                I[j] = _mm512_add_epi32(I[j], _mm512_mullo_epi32(t, sc));
            }
        }
        mskq_strip_float<NB>(p.d, I, x, xstride, i, fa);
    }
    mskq_strip_store<NB>(fa, y, ystride);
}
#endif

#if defined(MSKQ_AVX2)
// IQ4_XS packed at load, 8 rows a strip, for the AVX2 build (decode.cpp's T_IQ4_XS_P8): mskq_pxs
// with 8 lanes (q[s][v]'s lane r: row r's qs[16s + 4v .. +3]; sc[s][r]: row r's sub-block s's
// scale minus 32), d as stored, then 16 bytes of padding (1,120 bytes: 8 x the stored 136, plus
// 32; whole 32-byte lines). A sub-block's values looked up once for the activation rows (their
// magnitudes and the values themselves); per activation row a piece is vpmaddubsw of the
// magnitudes against 4 broadcast bytes given the values' signs (pairs <= 2 x 127 x 128 < 2^15,
// as the rows as stored's loop), then vpmaddwd by the sub-block's scale (an int16 pair (s, s)
// a lane) into the lane's exact total I = sum over s of sc[s] * (v . xq over s); then
// fa = fa + (float)I * (d * dx) lane by lane, as the rows as stored: the same bits.
struct mskq_pxsx8 {
    uint8_t q[8][4][32];
    int8_t sc[8][8];
    uint16_t d[8];
    uint8_t pad[16];
};
static_assert(sizeof(mskq_pxsx8) == 8 * 136 + 32 && sizeof(mskq_pxsx8) % 32 == 0, "packed blocks back to back");

// 8 stored rows of n weights (the first at w, wrow bytes apart) -> n / 256 packed blocks.
static void mskq_pack_xsx8_rows(long n, const void *w, long wrow, void *out) {
    mskq_pack_rows<mskq_pxsx8, 8, 136>(n, w, wrow, out, mskq_fill_xs<mskq_pxsx8>);
}

// The 8 rows of a packed strip (n / 256 blocks at w) against NB activation rows (ms_a8k rows,
// xstride bytes apart): y[j * ystride + r] for rows r < 8.
template <int NB>
static void mskq_dot_pxsx8(long n, const void *w, const void *x, long xstride, float *y, long ystride) {
    const mskq_pxsx8 *u = (const mskq_pxsx8 *)w;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)msq_iq4nl));
    __m256 fa[NB];
    for (int j = 0; j < NB; j++) fa[j] = _mm256_setzero_ps();
    for (long i = 0; i < n / 256; i++) {
        const mskq_pxsx8 &p = u[i];
        mskq_strip8_prefetch<NB>(u + i);
        __m256i I[NB];
        for (int j = 0; j < NB; j++) I[j] = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
            __m256i V[8], M[8];  // piece pc: weights 4 pc .. 4 pc + 3 of the sub-block, values and magnitudes
            for (int v = 0; v < 4; v++) {
                const __m256i q = _mm256_load_si256((const __m256i *)p.q[s][v]);
                V[v] = _mm256_shuffle_epi8(lut, _mm256_and_si256(q, m4));
                V[v + 4] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
            }
            for (int pc = 0; pc < 8; pc++) M[pc] = _mm256_abs_epi8(V[pc]);
            const __m256i s32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p.sc[s]));
            const __m256i sp = _mm256_or_si256(_mm256_and_si256(s32, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(s32, 16));
            for (int j = 0; j < NB; j++) {
                const uint8_t *xq = mskq_xblock(x, xstride, j, i) + 4 + 32 * s;
                __m256i t = _mm256_setzero_si256();
                for (int pc = 0; pc < 8; pc++) {
                    int32_t a;
                    std::memcpy(&a, xq + 4 * pc, 4);
                    const __m256i pr = _mm256_maddubs_epi16(M[pc], _mm256_sign_epi8(_mm256_set1_epi32(a), V[pc]));
                    t = _mm256_add_epi32(t, _mm256_madd_epi16(pr, sp));
                }
                I[j] = _mm256_add_epi32(I[j], t);
            }
        }
        mskq_strip8_float<NB>(p.d, I, x, xstride, i, fa);
    }
    mskq_strip8_store<NB>(fa, y, ystride);
}
#endif

// ---------------------------------------------------------------- IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S
// The lattice types (ggml-common.h's layouts): 8 or 4 weights' magnitudes at a time are an
// entry of a table (iqgrids.h), their signs are bits beside it, and a small odd integer scales
// each 16 or 32 weights. Every weight of a super-block is then exactly
//     dc * sc[i / 16] * v[i],
// v a signed integer (|v| <= 62), sc an odd integer <= 31 and dc the fp16 d times a power of
// two (IQ2: 1/8, d * (0.5 + ls) * 0.25 = d * (2 ls + 1) / 8; IQ3_XXS: 1/4; IQ3_S: 1; IQ1:
// 1/8, the grid's -1 / 0 / 1 plus a delta of +-1/8 being v = 8 g +- 1). A type's decoder
// (mskq_iq_<type>) writes one super-block so (MskqIq); then one loop serves them all, as
// IQ4_XS's: I = sum over the 16s of sc * (v . xq), exact, and fa = fa + (float)I * (dc * dx)
// in every build (the vector builds take v as magnitudes and signs, vpmaddubsw, then the scales
// by vpmaddwd, 256 bits wide in the AVX-512 build too). The dequantized weights are (d * sc * c) * v, c the power of two:
// gguf's float32 bits (d * (0.5 + ls) * 0.25 rounds as d * (2 ls + 1) / 8 does).
#include "iqgrids.h"

struct MskqIq {
    uint64_t e[32];  // v: entry k weights 8k .. 8k + 7, byte i weight 8k + i's (int8)
    int32_t sc[16];
    float d;  // the fp16 d (as float)
};

// 8 bits -> 8 bytes, 0xff where the bit is set (bit i, byte i)
struct MskqSignBytes {
    uint64_t m[256];
    constexpr MskqSignBytes() : m() {
        for (int s = 0; s < 256; s++)
            for (int i = 0; i < 8; i++)
                if ((s >> i) & 1) m[s] |= (uint64_t)0xff << (8 * i);
    }
};
static constexpr MskqSignBytes mskq_sign_bytes{};

// 8 magnitudes (bytes of g, each 1..127) with the signs of `signs` (bit i: byte i negative),
// as 8 int8: -g = (g ^ 0xff) + 1 byte by byte, which carries into no neighbour while no
// magnitude is 0
static inline uint64_t mskq_iq_signed8(uint64_t g, uint8_t signs) {
    const uint64_t m = mskq_sign_bytes.m[signs];
    return (g ^ m) + (m & 0x0101010101010101ull);
}

// IQ2_XS's and IQ2_S's 16 scales: 8 bytes, byte s's low nibble ls scaling weights 32s ..
// 32s + 15 by 2 ls + 1, its high one the next 16
static inline void mskq_iq_nibble_scales(const uint8_t *s8, int32_t *sc) {
    for (int s = 0; s < 8; s++) {
        sc[2 * s] = 2 * (s8[s] & 15) + 1;
        sc[2 * s + 1] = 2 * (s8[s] >> 4) + 1;
    }
}

// 8 of IQ1's grid values g (bytes -1 / 0 / 1) as 8 g + 1 a byte: g << 3 with the bits each
// byte pushes into the next masked off, then the low bit set
static inline uint64_t mskq_iq1_plus(uint64_t g) {
    return ((g << 3) & 0xf8f8f8f8f8f8f8f8ull) | 0x0101010101010101ull;
}

#if defined(MSKQ_SIMD)
// The vector builds' form of a group of 32 weights (MskqIq's dot): G their magnitudes (u8), S
// their signs as bytes 0xff (negative) or 0x01, SC the scales of its two 16s as 8 int16 each;
// a row's products are then vpmaddubsw(G, vpsignb(xq, S)) by SC (vpmaddwd). Built straight
// from the block, with no store between: the types' `group` functions.
struct MskqIqGroup {
    __m256i G, S, SC;
};

// A 32-bit sign word (bit p: weight p negative) as S (0xff / 0x01 a byte)
static inline __m256i mskq_iq_signs32(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                            3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread), bit);
    return _mm256_or_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(1));
}

static inline __m256i mskq_iq_scales2(int lo, int hi) {
    return _mm256_setr_m128i(_mm_set1_epi16((short)lo), _mm_set1_epi16((short)hi));
}

// IQ2_XXS / IQ2_XS / IQ3_XXS's 7-bit sign indices as S's 8 bytes (0xff / 0x01): each bit of
// the index's sign byte (mskq_ksigns) a byte
struct MskqKsigns64 {
    uint64_t m[128];
    constexpr MskqKsigns64() : m() {
        for (int k = 0; k < 128; k++)
            for (int i = 0; i < 8; i++) m[k] |= (uint64_t)((mskq_ksigns[k] >> i) & 1 ? 0xff : 0x01) << (8 * i);
    }
};
static constexpr MskqKsigns64 mskq_ksigns64{};

// 4 such indices (bits 7l of a, or the words' high 7: masked here) as S
static inline __m256i mskq_ksigns4(uint32_t k0, uint32_t k1, uint32_t k2, uint32_t k3) {
    return _mm256_set_epi64x((long long)mskq_ksigns64.m[k3 & 127], (long long)mskq_ksigns64.m[k2 & 127],
                             (long long)mskq_ksigns64.m[k1 & 127], (long long)mskq_ksigns64.m[k0 & 127]);
}

// 4 of IQ1's entries as 8 g + 1 (mskq_iq1_plus) less `twos` (2 in the bytes whose delta is
// -1) as a group: 8 g + delta, its magnitudes and signs (it is never 0)
static inline MskqIqGroup mskq_iq1_group(uint64_t e0, uint64_t e1, uint64_t e2, uint64_t e3, __m256i twos, int lo,
                                         int hi) {
    const __m256i v = _mm256_sub_epi8(_mm256_set_epi64x((long long)e3, (long long)e2, (long long)e1, (long long)e0), twos);
    return {_mm256_sign_epi8(v, v), _mm256_or_si256(v, _mm256_set1_epi8(1)), mskq_iq_scales2(lo, hi)};
}
#endif

// What the types share: d an fp16 at the block's start (IQ1_M overrides), nothing to work out
// before the groups (IQ3_S overrides)
struct MskqIqBase {
    static float scale(const uint8_t *b) { return mskq_half(b); }
#if defined(MSKQ_SIMD)
    struct Prep {};
    static void prepare(const uint8_t *, Prep &) {}
#endif
};

// IQ2_XXS, 66 bytes: {fp16 d; u32 pairs[8][2]}: a pair serves 32 weights: its first word's
// bytes index 4 entries of iq2xxs_grid (8 weights each), its second's bits 7l .. 7l + 6 the
// sign bytes (mskq_ksigns) of entry l, bits 28-31 ls (scale 2 ls + 1).
struct MskqIq2xxs : MskqIqBase {
    static constexpr int BYTES = 66;
    static constexpr float C = 0.125f;
#if defined(MSKQ_SIMD)
    static MskqIqGroup group(const uint8_t *b, const Prep &, int s) {
        const uint32_t a1 = msq_u32(b + 6 + 8 * s);
        const int sc = (int)(2 * (a1 >> 28) + 1);
        const uint8_t *k = b + 2 + 8 * s;  // (a0's bytes)
        return {_mm256_set_epi64x((long long)mskq_iq2xxs_grid[k[3]], (long long)mskq_iq2xxs_grid[k[2]],
                                  (long long)mskq_iq2xxs_grid[k[1]], (long long)mskq_iq2xxs_grid[k[0]]),
                (mskq_ksigns4(a1, a1 >> 7, a1 >> 14, a1 >> 21)), mskq_iq_scales2(sc, sc)};
    }
#endif
    static void decode(const uint8_t *b, MskqIq &q) {
        q.d = scale(b);
        for (int s = 0; s < 8; s++) {
            const uint32_t a0 = msq_u32(b + 2 + 8 * s), a1 = msq_u32(b + 6 + 8 * s);
            q.sc[2 * s] = q.sc[2 * s + 1] = (int32_t)(2 * (a1 >> 28) + 1);
            for (int l = 0; l < 4; l++)
                q.e[4 * s + l] = mskq_iq_signed8(mskq_iq2xxs_grid[(a0 >> (8 * l)) & 255], mskq_ksigns[(a1 >> (7 * l)) & 127]);
        }
    }
};

// IQ2_XS, 74 bytes: {fp16 d; u16 qs[32]; u8 scales[8]}: qs[k]'s low 9 bits index iq2xs_grid
// (weights 8k .. 8k + 7), its high 7 the sign byte; scales: mskq_iq_nibble_scales.
struct MskqIq2xs : MskqIqBase {
    static constexpr int BYTES = 74;
    static constexpr float C = 0.125f;
#if defined(MSKQ_SIMD)
    static MskqIqGroup group(const uint8_t *b, const Prep &, int s) {
        const uint32_t u0 = msq_u16(b + 2 + 8 * s), u1 = msq_u16(b + 4 + 8 * s), u2 = msq_u16(b + 6 + 8 * s),
                       u3 = msq_u16(b + 8 + 8 * s);
        return {_mm256_set_epi64x((long long)mskq_iq2xs_grid[u3 & 511], (long long)mskq_iq2xs_grid[u2 & 511],
                                  (long long)mskq_iq2xs_grid[u1 & 511], (long long)mskq_iq2xs_grid[u0 & 511]),
                (mskq_ksigns4(u0 >> 9, u1 >> 9, u2 >> 9, u3 >> 9)),
                mskq_iq_scales2(2 * (b[66 + s] & 15) + 1, 2 * (b[66 + s] >> 4) + 1)};
    }
#endif
    static void decode(const uint8_t *b, MskqIq &q) {
        q.d = scale(b);
        mskq_iq_nibble_scales(b + 66, q.sc);
        for (int k = 0; k < 32; k++) {
            const uint16_t u = msq_u16(b + 2 + 2 * k);
            q.e[k] = mskq_iq_signed8(mskq_iq2xs_grid[u & 511], mskq_ksigns[u >> 9]);
        }
    }
};

// IQ2_S, 82 bytes: {fp16 d; u8 qs[32]; u8 signs[32]; u8 qh[8]; u8 scales[8]}: entry k of
// iq2s_grid is qs[k] | (qh[k / 4]'s bits 2 (k % 4), + 1) << 8, its signs signs[k] (bit i:
// weight 8k + i); scales as IQ2_XS's.
struct MskqIq2s : MskqIqBase {
    static constexpr int BYTES = 82;
    static constexpr float C = 0.125f;
#if defined(MSKQ_SIMD)
    static MskqIqGroup group(const uint8_t *b, const Prep &, int s) {
        const uint32_t h = b[66 + s];
        const uint8_t *qs = b + 2 + 4 * s;
        return {_mm256_set_epi64x((long long)mskq_iq2s_grid[qs[3] | (h << 2 & 0x300)],
                                  (long long)mskq_iq2s_grid[qs[2] | (h << 4 & 0x300)],
                                  (long long)mskq_iq2s_grid[qs[1] | (h << 6 & 0x300)],
                                  (long long)mskq_iq2s_grid[qs[0] | (h << 8 & 0x300)]),
                mskq_iq_signs32(msq_u32(b + 34 + 4 * s)),
                mskq_iq_scales2(2 * (b[74 + s] & 15) + 1, 2 * (b[74 + s] >> 4) + 1)};
    }
#endif
    static void decode(const uint8_t *b, MskqIq &q) {
        q.d = scale(b);
        mskq_iq_nibble_scales(b + 74, q.sc);
        for (int k = 0; k < 32; k++) {
            const int idx = b[2 + k] | ((b[66 + k / 4] >> (2 * (k % 4))) & 3) << 8;
            q.e[k] = mskq_iq_signed8(mskq_iq2s_grid[idx], b[34 + k]);
        }
    }
};

// IQ3_XXS, 98 bytes: {fp16 d; u8 qs[64]; u32 scales_and_signs[8]}: qs[k] indexes iq3xxs_grid
// (weights 4k .. 4k + 3); word s serves weights 32s .. 32s + 31: bits 7l .. 7l + 6 the sign
// byte of its weights 8l .. 8l + 7, bits 28-31 ls (d * (0.5 + ls) * 0.5: 2 ls + 1, 1/4).
struct MskqIq3xxs : MskqIqBase {
    static constexpr int BYTES = 98;
    static constexpr float C = 0.25f;
#if defined(MSKQ_SIMD)
    static MskqIqGroup group(const uint8_t *b, const Prep &, int s) {
        const uint8_t *qs = b + 2 + 8 * s;
        const uint32_t a = msq_u32(b + 66 + 4 * s);
        const int sc = (int)(2 * (a >> 28) + 1);
        return {_mm256_setr_epi32((int)mskq_iq3xxs_grid[qs[0]], (int)mskq_iq3xxs_grid[qs[1]], (int)mskq_iq3xxs_grid[qs[2]],
                                  (int)mskq_iq3xxs_grid[qs[3]], (int)mskq_iq3xxs_grid[qs[4]], (int)mskq_iq3xxs_grid[qs[5]],
                                  (int)mskq_iq3xxs_grid[qs[6]], (int)mskq_iq3xxs_grid[qs[7]]),
                (mskq_ksigns4(a, a >> 7, a >> 14, a >> 21)), mskq_iq_scales2(sc, sc)};
    }
#endif
    static void decode(const uint8_t *b, MskqIq &q) {
        q.d = scale(b);
        for (int s = 0; s < 8; s++) {
            const uint32_t a = msq_u32(b + 66 + 4 * s);
            q.sc[2 * s] = q.sc[2 * s + 1] = (int32_t)(2 * (a >> 28) + 1);
            for (int l = 0; l < 4; l++) {
                const int k = 8 * s + 2 * l;
                const uint64_t g = mskq_iq3xxs_grid[b[2 + k]] | (uint64_t)mskq_iq3xxs_grid[b[3 + k]] << 32;
                q.e[4 * s + l] = mskq_iq_signed8(g, mskq_ksigns[(a >> (7 * l)) & 127]);
            }
        }
    }
};

// IQ3_S, 110 bytes: {fp16 d; u8 qs[64]; u8 qh[8]; u8 signs[32]; u8 scales[4]}: entry k of
// iq3s_grid is qs[k] | (qh[k / 8]'s bit k % 8) << 8 (weights 4k .. 4k + 3); signs[j] bit i:
// weight 8j + i; scales[t]'s low nibble s scales weights 64t .. 64t + 31 by 2 s + 1, its high
// one the next 32 (d * (1 + 2 s): c = 1).
struct MskqIq3s : MskqIqBase {
    static constexpr int BYTES = 110;
    static constexpr float C = 1.f;
#if defined(MSKQ_SIMD)
    // The 64 entries' 9-bit indices, 16 a vector: qs's bytes widened, qh's bit k (a 16-bit word
    // broadcast, each lane's own bit tested) to bit 8
    struct Prep {
        alignas(32) uint16_t idx[64];
    };
    static void prepare(const uint8_t *b, Prep &p) {
        const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                              (short)0x8000);
        for (int t = 0; t < 4; t++) {
            const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * t)));
            const __m256i h = _mm256_and_si256(_mm256_set1_epi16((short)msq_u16(b + 66 + 2 * t)), bit);
            const __m256i hi = _mm256_and_si256(_mm256_cmpeq_epi16(h, bit), _mm256_set1_epi16(256));
            _mm256_store_si256((__m256i *)(p.idx + 16 * t), _mm256_or_si256(lo, hi));
        }
    }
    static MskqIqGroup group(const uint8_t *b, const Prep &p, int s) {
        const uint16_t *k = p.idx + 8 * s;
        const int sc = 2 * ((b[106 + s / 2] >> (4 * (s % 2))) & 15) + 1;
        return {_mm256_setr_epi32((int)mskq_iq3s_grid[k[0]], (int)mskq_iq3s_grid[k[1]], (int)mskq_iq3s_grid[k[2]],
                                  (int)mskq_iq3s_grid[k[3]], (int)mskq_iq3s_grid[k[4]], (int)mskq_iq3s_grid[k[5]],
                                  (int)mskq_iq3s_grid[k[6]], (int)mskq_iq3s_grid[k[7]]),
                mskq_iq_signs32(msq_u32(b + 74 + 4 * s)), mskq_iq_scales2(sc, sc)};
    }
#endif
    static void decode(const uint8_t *b, MskqIq &q) {
        q.d = scale(b);
        for (int t = 0; t < 4; t++) {
            const int32_t lo = 2 * (b[106 + t] & 15) + 1, hi = 2 * (b[106 + t] >> 4) + 1;
            q.sc[4 * t] = q.sc[4 * t + 1] = lo;
            q.sc[4 * t + 2] = q.sc[4 * t + 3] = hi;
        }
        for (int h = 0; h < 8; h++) {  // qh[h]: the high bits of entries 8h .. 8h + 7
            const uint32_t hb = b[66 + h];
            for (int e = 0; e < 8; e += 2) {
                const uint32_t i0 = b[2 + 8 * h + e] | ((hb >> e) & 1) << 8;
                const uint32_t i1 = b[3 + 8 * h + e] | ((hb >> (e + 1)) & 1) << 8;
                const uint64_t g = mskq_iq3s_grid[i0] | (uint64_t)mskq_iq3s_grid[i1] << 32;
                q.e[4 * h + e / 2] = mskq_iq_signed8(g, b[74 + 4 * h + e / 2]);
            }
        }
    }
};

// 8 of IQ1's grid values g (bytes -1 / 0 / 1: 0xff, 0, 1) plus the delta (+1, or -1 where
// `minus`), as 8 int8 8 g + delta, byte by byte: + 1 is mskq_iq1_plus; - 1 is ~(8 (-g))
// (-x - 1 = ~x), -g swapping 0xff and 1, 8 (-g) masked as there. No branch: the delta's sign
// is a coin toss for the predictor.
static inline uint64_t mskq_iq1_values(uint64_t g, bool minus) {
    constexpr uint64_t ones = 0x0101010101010101ull, high5 = 0xf8f8f8f8f8f8f8f8ull;
    const uint64_t plus = mskq_iq1_plus(g), less = ~(((g ^ ((g & ones) * 0xfe)) << 3) & high5);
    const uint64_t pick = (uint64_t)0 - (uint64_t)minus;
    return plus ^ ((plus ^ less) & pick);
}

// IQ1_S, 50 bytes: {fp16 d; u8 qs[32]; u16 qh[8]}: qh[s] serves weights 32s .. 32s + 31: entry
// l (weights 8l ..) of iq1s_grid is qs[4s + l] | (qh's bits 3l .. 3l + 2) << 8, bits 12-14 ls
// (d * (2 ls + 1)), bit 15 the delta's sign (set: -1/8).
struct MskqIq1s : MskqIqBase {
    static constexpr int BYTES = 50;
    static constexpr float C = 0.125f;
#if defined(MSKQ_SIMD)
    static MskqIqGroup group(const uint8_t *b, const Prep &, int s) {
        const uint32_t h = msq_u16(b + 34 + 2 * s);
        const uint8_t *qs = b + 2 + 4 * s;
        const int sc = (int)(2 * ((h >> 12) & 7) + 1);
        return mskq_iq1_group(mskq_iq1_plus(mskq_iq1s_grid[qs[0] | (h << 8 & 0x700)]),
                              mskq_iq1_plus(mskq_iq1s_grid[qs[1] | (h << 5 & 0x700)]),
                              mskq_iq1_plus(mskq_iq1s_grid[qs[2] | (h << 2 & 0x700)]),
                              mskq_iq1_plus(mskq_iq1s_grid[qs[3] | (h >> 1 & 0x700)]),
                              _mm256_set1_epi8((char)(h >> 14 & 2)), sc, sc);
    }
#endif
    static void decode(const uint8_t *b, MskqIq &q) {
        q.d = scale(b);
        for (int s = 0; s < 8; s++) {
            const uint16_t h = msq_u16(b + 34 + 2 * s);
            q.sc[2 * s] = q.sc[2 * s + 1] = 2 * ((h >> 12) & 7) + 1;
            for (int l = 0; l < 4; l++)
                q.e[4 * s + l] = mskq_iq1_values(mskq_iq1s_grid[b[2 + 4 * s + l] | ((h >> (3 * l)) & 7) << 8], h >> 15);
        }
    }
};

// IQ1_M, 56 bytes: {u8 qs[32]; u8 qh[16]; u16 scales[4]}: the fp16 d is the 4 scale words'
// top nibbles (word 0's the lowest); word w's 12 low bits are 4 scales of 3 bits (weights 64w +
// 16k ..: d * (2 s + 1)). Entry k of iq1s_grid is qs[k] | (qh[k / 2]'s nibble k % 2, low 3 bits)
// << 8, that nibble's bit 3 its delta's sign.
struct MskqIq1m : MskqIqBase {
    static constexpr int BYTES = 56;
    static constexpr float C = 0.125f;
    static float scale(const uint8_t *b) {  // the 4 scale words' top nibbles, word 0's lowest
        const uint16_t dh = (uint16_t)((msq_u16(b + 48) >> 12) | ((msq_u16(b + 50) >> 8) & 0x00f0) |
                                       ((msq_u16(b + 52) >> 4) & 0x0f00) | (msq_u16(b + 54) & 0xf000));
        const uint8_t db[2] = {(uint8_t)dh, (uint8_t)(dh >> 8)};
        return mskq_half(db);
    }
#if defined(MSKQ_SIMD)
    // group s: entries 4s .. 4s + 3 (qh[2s], qh[2s + 1]), the scales of 16s 2s and 2s + 1
    static MskqIqGroup group(const uint8_t *b, const Prep &, int s) {
        const uint8_t *qs = b + 4 * s;
        const uint32_t h0 = b[32 + 2 * s], h1 = b[33 + 2 * s], w = msq_u16(b + 48 + 2 * (s / 2)) >> (6 * (s % 2));
        // the deltas' signs, bits 3 and 7 of h0 and h1, as 2 in each of their entry's bytes
        const uint64_t two = 0x0202020202020202ull;
        const __m256i twos = _mm256_set_epi64x((long long)(two * (h1 >> 7 & 1)), (long long)(two * (h1 >> 3 & 1)),
                                               (long long)(two * (h0 >> 7 & 1)), (long long)(two * (h0 >> 3 & 1)));
        return mskq_iq1_group(mskq_iq1_plus(mskq_iq1s_grid[qs[0] | (h0 << 8 & 0x700)]),
                              mskq_iq1_plus(mskq_iq1s_grid[qs[1] | (h0 << 4 & 0x700)]),
                              mskq_iq1_plus(mskq_iq1s_grid[qs[2] | (h1 << 8 & 0x700)]),
                              mskq_iq1_plus(mskq_iq1s_grid[qs[3] | (h1 << 4 & 0x700)]), twos, (int)(2 * (w & 7) + 1),
                              (int)(2 * ((w >> 3) & 7) + 1));
    }
#endif
    static void decode(const uint8_t *b, MskqIq &q) {
        uint16_t w[4];
        for (int t = 0; t < 4; t++) w[t] = msq_u16(b + 48 + 2 * t);
        q.d = scale(b);
        for (int k = 0; k < 16; k++) q.sc[k] = 2 * ((w[k / 4] >> (3 * (k % 4))) & 7) + 1;
        for (int k = 0; k < 32; k++) {
            const int nib = (b[32 + k / 2] >> (4 * (k % 2))) & 15;
            q.e[k] = mskq_iq1_values(mskq_iq1s_grid[b[k] | (nib & 7) << 8], nib >> 3);
        }
    }
};

static inline int mskq_iq_value(const MskqIq &q, int i) { return (int8_t)(uint8_t)(q.e[i / 8] >> (8 * (i % 8))); }

template <class D>
static void mskq_dequant_iq(const void *w, float *y, long n) {
    const uint8_t *b = (const uint8_t *)w;
    MskqIq q;
    for (long i = 0; i < n / 256; i++, b += D::BYTES, y += 256) {
        D::decode(b, q);
        for (int s = 0; s < 16; s++) {
            const float dl = q.d * (float)q.sc[s] * D::C;
            for (int l = 0; l < 16; l++) y[16 * s + l] = dl * (float)mskq_iq_value(q, 16 * s + l);
        }
    }
}

// One weight row (n / 256 super-blocks at w) against NB activation rows (xstride bytes apart):
// y[j * ystride] (the order above). The vector builds (the AVX-512 one too, 32 weights a
// register) take |v| by xq with v's signs (vpmaddubsw: pairs <= 2 x 62 x 127), then each 16's
// 8 pairs times its scale (vpmaddwd); a super-block's registers are built once from the
// decoded entries (8 bytes each: no wider load of narrower stores) for all NB rows.
template <class D, int NB>
static void mskq_dot_iq(long n, const void *w, const void *x, long xstride, float *y, long ystride) {
    const uint8_t *b = (const uint8_t *)w;
    float fa[NB];
    for (int j = 0; j < NB; j++) fa[j] = 0.f;
    for (long i = 0; i < n / 256; i++, b += D::BYTES) {
#if defined(MSKQ_SIMD)
        const float dc = D::scale(b) * D::C;
        mskq_prefetch(b, D::BYTES);
        // group by group, each meeting every row as it is built (the rows' sums in registers)
        __m256i acc[NB];
        for (int j = 0; j < NB; j++) acc[j] = _mm256_setzero_si256();
        typename D::Prep prep;
        D::prepare(b, prep);
        for (int s = 0; s < 8; s++) {
            const MskqIqGroup g = D::group(b, prep, s);
            for (int j = 0; j < NB; j++) {
                const uint8_t *xb = mskq_xblock(x, xstride, j, i);
                const __m256i xq = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xb + 4 + 32 * s)), g.S);
                acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(g.G, xq), g.SC));
            }
        }
        for (int j = 0; j < NB; j++) {
            float dx;
            std::memcpy(&dx, mskq_xblock(x, xstride, j, i), 4);
            fa[j] = fa[j] + (float)mskq_hsum_epi32(acc[j]) * (dc * dx);
        }
#else
        MskqIq q;
        D::decode(b, q);
        const float dc = q.d * D::C;
        for (int j = 0; j < NB; j++) {
            const uint8_t *xb = mskq_xblock(x, xstride, j, i);
            const int8_t *xq = (const int8_t *)(xb + 4);
            int32_t total = 0;
            for (int s = 0; s < 16; s++) {
                int32_t dot = 0;
                for (int l = 0; l < 16; l++) dot += mskq_iq_value(q, 16 * s + l) * xq[16 * s + l];
                total += q.sc[s] * dot;
            }
            float dx;
            std::memcpy(&dx, xb, 4);
            fa[j] = fa[j] + (float)total * (dc * dx);
        }
#endif
    }
    for (int j = 0; j < NB; j++) y[j * ystride] = fa[j];
}

#if defined(MSKQ_SIMD)
// A prompt's many activation rows (decode.cpp's qmatmul_unpacked): a row's super-blocks built
// once into their groups' registers as memory (MskqIqU), then every 4 or 8 activation rows read
// them -- rather than building them again for each 8. The same integers and float steps as
// mskq_dot_iq, so the same bits; a row may come in pieces of super-blocks (the running sums in
// `state` between them, phase as in mskq_dot_k45).
struct MskqIqU {
    __m256i G[8], S[8], SC[8];
    float dc;
    float pad[7];
};

template <class D>
static void mskq_unpack_iq(long n, const void *w, void *out) {
    const uint8_t *b = (const uint8_t *)w;
    MskqIqU *u = (MskqIqU *)out;
    for (long i = 0; i < n / 256; i++, b += D::BYTES, u++) {
        typename D::Prep prep;
        D::prepare(b, prep);
        for (int s = 0; s < 8; s++) {
            const MskqIqGroup g = D::group(b, prep, s);
            _mm256_store_si256(&u->G[s], g.G);
            _mm256_store_si256(&u->S[s], g.S);
            _mm256_store_si256(&u->SC[s], g.SC);
        }
        u->dc = D::scale(b) * D::C;
    }
}

template <int NB>
static void mskq_dotu_iq(long n, const void *w, const void *x, long xstride, float *y, long ystride, float *state,
                         int phase) {
    const MskqIqU *u = (const MskqIqU *)w;
    float fa[NB];
    for (int j = 0; j < NB; j++) fa[j] = (phase & 1) ? state[j] : 0.f;
    for (long i = 0; i < n / 256; i++, u++) {
        __m256i acc[NB];
        for (int j = 0; j < NB; j++) acc[j] = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
            const __m256i G = _mm256_load_si256(&u->G[s]), S = _mm256_load_si256(&u->S[s]), SC = _mm256_load_si256(&u->SC[s]);
            for (int j = 0; j < NB; j++) {
                const uint8_t *xb = mskq_xblock(x, xstride, j, i);
                const __m256i xq = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xb + 4 + 32 * s)), S);
                acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(G, xq), SC));
            }
        }
        for (int j = 0; j < NB; j++) {
            float dx;
            std::memcpy(&dx, mskq_xblock(x, xstride, j, i), 4);
            fa[j] = fa[j] + (float)mskq_hsum_epi32(acc[j]) * (u->dc * dx);
        }
    }
    for (int j = 0; j < NB; j++) {
        if (phase & 2)
            y[j * ystride] = fa[j];
        else
            state[j] = fa[j];
    }
}
#define MSKQ_IQ_UNPACK(t, D)                                                                        \
    static void ms_unpack_##t(long n, const void *w, void *out) { mskq_unpack_iq<D>(n, w, out); }
#else
#define MSKQ_IQ_UNPACK(t, D)
#endif

#define MSKQ_IQ_TYPE(t, D)                                                                         \
    MSKQ_IQ_UNPACK(t, D)                                                                           \
    static void ms_dequant_##t(const void *w, float *y, long n) { mskq_dequant_iq<D>(w, y, n); }      \
    template <int NB>                                                                              \
    static void ms_dot_##t(long n, const void *w, const void *x, long xs, float *y, long ys) {     \
        mskq_dot_iq<D, NB>(n, w, x, xs, y, ys);                                                    \
    }
MSKQ_IQ_TYPE(iq2_xxs, MskqIq2xxs)
MSKQ_IQ_TYPE(iq2_xs, MskqIq2xs)
MSKQ_IQ_TYPE(iq2_s, MskqIq2s)
MSKQ_IQ_TYPE(iq3_xxs, MskqIq3xxs)
MSKQ_IQ_TYPE(iq3_s, MskqIq3s)
MSKQ_IQ_TYPE(iq1_s, MskqIq1s)
MSKQ_IQ_TYPE(iq1_m, MskqIq1m)


#endif  // MINISERVE_KQUANTS_H
