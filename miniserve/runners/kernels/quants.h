// Dot products and row decoders for ggml's 32-weight block types (Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0) and for F16 weights, as stored in GGUF files (ggml-common.h's layouts), for decode.cpp.
//
// Activations: each row entering a product is quantized once to ms_a8 blocks (x ~= d q, q in
// [-127, 127], s = d sum(q)); a block's products are then one exact integer sum. The block
// formats, and the idea of an integer dot per block scaled by d_w d_x, follow llama.cpp's
// ggml-cpu; the code is ours.
//
// One canonical order of the float operations for a (weight row, activation row) pair, the
// same for every NB and every position j, and the same in the three builds (AVX-512 + VNNI,
// AVX2 + FMA, plain loops):
//   per block b: i[k] = the exact int32 sum of the products of weights 4k .. 4k+3 (k < 8);
//                acc[b & 1][k] = acc[b & 1][k] + (d_w * d_x) * float(i[k])  (even, odd blocks)
//                types with a min (Q4_1, Q5_1): ms[b & 1] = ms[b & 1] + m_w * s_x
//   then v[k] = acc[0][k] + acc[1][k], ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)),
//   plus (ms[0] + ms[1]) for the types with a min.
// AVX-512 holds a pair of blocks in 16 lanes (acc[0] the low 8, acc[1] the high 8) and the
// pair's m_w * s_x in lanes 1 and 3 of a 4-lane sum; AVX2 one block in 8 lanes with two
// accumulators; the plain loop two arrays of 8. Never a fused multiply-add in that part (the
// generic build has none in hardware), so every build rounds alike. vpdpbusd and pmaddubsw + pmaddwd put the same four products in the same int32 lane.
//
// F16 weights against float32 activations: 32 running sums (AVX-512: two vectors of 16; AVX2:
// four of 8), acc = fma(w, x, acc) over columns in steps of 32, reduced as
// ((A + B)[0..8) + (A + B)[8..16)) then as above, the last n % 32 columns added one by one.
// The plain loop keeps the same 32 sums but multiplies and adds separately (a software fmaf
// would be far slower), so F16 results differ in the last bits between vector and plain
// builds; they never depend on NB.
//
// Requires n to be a multiple of 32 for the block types (any n for F16). No reads past the
// row's blocks other than prefetch hints; every load is unaligned-safe.

#ifndef MINISERVE_QUANTS_H
#define MINISERVE_QUANTS_H

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#define MSQ_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define MSQ_AVX2 1
#endif
#if defined(MSQ_AVX512) || defined(MSQ_AVX2) || defined(__F16C__)
#include <immintrin.h>
#endif

struct ms_a8 {
    float d;         // scale: x ~= d * qs
    float s;         // d * sum(qs), for the weight types with a min
    int8_t qs[32];
};

// How far ahead of the weight loads the loops prefetch (bytes), as decode.cpp does; not tuned
// (the machine measured on was too noisy to tell 1 KB from 4 KB).
#ifndef MSQ_PREFETCH
#define MSQ_PREFETCH 2048
#endif

// ---------------------------------------------------------------- scalars

static inline float msq_h2f(uint16_t h) {  // IEEE half -> float, exact
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t u;
    if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float
        float f = (float)m * 5.9604644775390625e-8f;
        std::memcpy(&u, &f, 4);
        u |= sign;
    } else if (e == 31) {
        u = sign | 0x7f800000u | (m << 13);
    } else {
        u = sign | ((e + 112) << 23) | (m << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
#endif
}

static inline uint16_t msq_u16(const uint8_t *p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}
static inline uint32_t msq_u32(const uint8_t *p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}
static inline float msq_f32(const char *p) {
    float v;
    std::memcpy(&v, p, 4);
    return v;
}

// The canonical end of a pair's sum: acc[0] + acc[1] lane by lane, then the 8 lanes in one
// order (decode.cpp's hsum8: halves, pairs, last two).
static inline float msq_sum8(const float *v) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

// ---------------------------------------------------------------- block types

// What tells the 32-weight types apart. BYTES: a block's size; QS: where its nibbles / bytes
// start; OFF: what is subtracted from the stored unsigned quant (0 for Q8_0, whose quants are
// signed, and for the types with a min); MIN: w = d q + m; BITS: 4, 5 or 8.
enum MsqKind { MSQ_Q4_0, MSQ_Q4_1, MSQ_Q5_0, MSQ_Q5_1, MSQ_Q8_0 };
template <int K> struct MsqT;
template <> struct MsqT<MSQ_Q4_0> { static const int BYTES = 18, QS = 2, OFF = 8, MIN = 0, BITS = 4; };
template <> struct MsqT<MSQ_Q4_1> { static const int BYTES = 20, QS = 4, OFF = 0, MIN = 1, BITS = 4; };
template <> struct MsqT<MSQ_Q5_0> { static const int BYTES = 22, QS = 6, OFF = 16, MIN = 0, BITS = 5; };
template <> struct MsqT<MSQ_Q5_1> { static const int BYTES = 24, QS = 8, OFF = 0, MIN = 1, BITS = 5; };
template <> struct MsqT<MSQ_Q8_0> { static const int BYTES = 34, QS = 2, OFF = 0, MIN = 0, BITS = 8; };

// A block's 32 weights as the integers the dot product uses: q - OFF (signed types), q (types
// with a min), in the natural order (weight i at index i).
template <int K>
static inline void msq_ints(const uint8_t *b, int *q) {
    typedef MsqT<K> T;
    const uint8_t *qs = b + T::QS;
    if (T::BITS == 8) {
        for (int i = 0; i < 32; i++) q[i] = (int8_t)qs[i];
        return;
    }
    uint32_t qh = T::BITS == 5 ? msq_u32(b + T::QS - 4) : 0;
    for (int i = 0; i < 16; i++) {
        int lo = qs[i] & 0x0f, hi = qs[i] >> 4;
        if (T::BITS == 5) {
            lo |= (int)((qh >> i) & 1u) << 4;
            hi |= (int)((qh >> (i + 16)) & 1u) << 4;
        }
        q[i] = lo - T::OFF;
        q[i + 16] = hi - T::OFF;
    }
}

// One row of n weights to floats: d * (q - OFF), or d * q + m (gguf's own arithmetic).
template <int K>
static inline void msq_dequant(const void *w, float *y, long n) {
    typedef MsqT<K> T;
    const uint8_t *b = (const uint8_t *)w;
    for (long i = 0; i < n / 32; i++, b += T::BYTES, y += 32) {
        int q[32];
        msq_ints<K>(b, q);
        const float d = msq_h2f(msq_u16(b));
        if (T::MIN) {
            const float m = msq_h2f(msq_u16(b + 2));
            for (int k = 0; k < 32; k++) y[k] = d * (float)q[k] + m;
        } else {
            for (int k = 0; k < 32; k++) y[k] = d * (float)q[k];
        }
    }
}

// ---------------------------------------------------------------- activations

// x -> ms_a8 blocks: d = amax / 127, q = round-to-nearest-even(x * (1 / d)), s = d * sum(q).
// The vector paths round with cvtps2dq under the default mode; the plain loop with the
// 1.5 * 2^23 trick, which rounds the same float the same way (|x / d| <= 127.5 here).
// A last partial block (n % 32) is padded with zeros.
static inline void msq_quantize_block_plain(const float *x, ms_a8 *y) {
    float amax = 0.f;
    for (int i = 0; i < 32; i++) {
        float a = std::fabs(x[i]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int i = 0; i < 32; i++) {
        float v = x[i] * id;
        v = (v + 12582912.f) - 12582912.f;
        int q = (int)v;
        y->qs[i] = (int8_t)q;
        sum += q;
    }
    y->d = d;
    y->s = d * (float)sum;
}

static void ms_quantize_a8(const float *x, ms_a8 *y, long n) {
    const long nb = n / 32;
    for (long i = 0; i < nb; i++, x += 32, y++) {
#if defined(MSQ_AVX512)
        __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        const __m512 vid = _mm512_set1_ps(id);
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid));
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
        _mm_storeu_si128((__m128i *)y->qs, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(y->qs + 16), _mm512_cvtepi32_epi8(q1));
        y->d = d;
        y->s = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#elif defined(MSQ_AVX2)
        __m256 v[4];
        const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 m = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(x + 8 * k);
            m = _mm256_max_ps(m, _mm256_and_ps(v[k], absmask));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4];
        for (int k = 0; k < 4; k++) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], vid));
        __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        // int32 -> int8 (values within [-127, 127]): packs interleave 128-bit lanes; undo it
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)y->qs, p);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
        y->d = d;
        y->s = d * (float)_mm_cvtsi128_si32(s4);
#else
        msq_quantize_block_plain(x, y);
#endif
    }
    if (n % 32) {
        float pad[32] = {0};
        for (long i = 0; i < n % 32; i++) pad[i] = x[i];
        msq_quantize_block_plain(pad, y);
    }
}

// ---------------------------------------------------------------- the plain loops

// One pair (weight row, activation row) at a time; the canonical order spelled out.
template <int K>
static inline float msq_dot_plain(long n, const uint8_t *w, const char *x) {
    typedef MsqT<K> T;
    float acc[2][8] = {{0.f}}, mins[2] = {0.f, 0.f};
    const long nb = n / 32;
    for (long b = 0; b < nb; b++, w += T::BYTES, x += sizeof(ms_a8)) {
        int q[32];
        msq_ints<K>(w, q);
        const int8_t *a = (const int8_t *)(x + 8);
        const float dd = msq_h2f(msq_u16(w)) * msq_f32(x);
        float *g = acc[b & 1];
        for (int k = 0; k < 8; k++) {
            int s = 0;
            for (int i = 4 * k; i < 4 * k + 4; i++) s += q[i] * a[i];
            g[k] = g[k] + dd * (float)s;
        }
        if (T::MIN) mins[b & 1] = mins[b & 1] + msq_h2f(msq_u16(w + 2)) * msq_f32(x + 4);
    }
    float v[8];
    for (int k = 0; k < 8; k++) v[k] = acc[0][k] + acc[1][k];
    return T::MIN ? msq_sum8(v) + (mins[0] + mins[1]) : msq_sum8(v);
}

// ---------------------------------------------------------------- 256-bit pieces
// One block in a 256-bit vector: AVX2's main loop, and AVX-512's last odd block.

#if defined(MSQ_AVX512) || defined(MSQ_AVX2)
static inline float msq_hsum8(__m256 v) {  // msq_sum8's order
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// unsigned u8 x signed s8 -> 8 int32 lanes, lane k the four products 4k .. 4k+3
static inline __m256i msq_dot_us8(__m256i u, __m256i s) {
#if defined(MSQ_AVX512)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    // pairs into int16 (at most 2 * 255 * 127 for the inputs used here: 8-bit weights reach
    // |w| = 128 only, so no saturation), then pairs of pairs into int32
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// 32 bits -> 32 bytes, 0xff where the bit is set (bit i -> byte i)
static inline __m256i msq_bits32(uint32_t bits) {
    const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101,
                                            0x0202020202020202, 0x0303030303030303);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

// A block's weights as bytes, natural order; signed (q - OFF, or Q8_0's) or unsigned (min types).
template <int K>
static inline __m256i msq_load1(const uint8_t *b) {
    typedef MsqT<K> T;
    if (T::BITS == 8) return _mm256_loadu_si256((const __m256i *)(b + T::QS));
    __m128i t = _mm_loadu_si128((const __m128i *)(b + T::QS));
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0f));
    if (T::BITS == 5) {
        __m256i h = msq_bits32(msq_u32(b + T::QS - 4));
        if (T::MIN) return _mm256_or_si256(q, _mm256_and_si256(h, _mm256_set1_epi8(0x10)));
        // q - 16 where the bit is clear: the high nibble 0xf0 set (two's complement)
        return _mm256_or_si256(q, _mm256_andnot_si256(h, _mm256_set1_epi8((char)0xf0)));
    }
    if (T::OFF) return _mm256_sub_epi8(q, _mm256_set1_epi8(T::OFF));
    return q;
}

// The 8 int32 lane sums of one block against one activation block's 32 int8.
template <int K>
static inline __m256i msq_isum1(__m256i w, __m256i a) {
    if (MsqT<K>::MIN) return msq_dot_us8(w, a);
    return msq_dot_us8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
}

// acc + (d_w d_x) float(i) for one block
static inline __m256 msq_term1(__m256 acc, __m256i isum, const uint8_t *b, const char *x) {
    const __m256 dd = _mm256_set1_ps(msq_h2f(msq_u16(b)) * msq_f32(x));
    return _mm256_add_ps(acc, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(isum)));
}
static inline float msq_min1(const uint8_t *b, const char *x) {  // m_w s_x
    return msq_h2f(msq_u16(b + 2)) * msq_f32(x + 4);
}
static inline __m128 msq_m1(const uint8_t *b) {  // m_w in every lane
    return _mm_set1_ps(msq_h2f(msq_u16(b + 2)));
}
// s_x of the same block of NB <= 4 activation rows (xs bytes apart), row j in lane j (0 past NB)
template <int NB>
static inline __m128 msq_s4(const char *x, long xs) {
    return _mm_setr_ps(msq_f32(x + 4), NB > 1 ? msq_f32(x + xs + 4) : 0.f,
                       NB > 2 ? msq_f32(x + 2 * xs + 4) : 0.f, NB > 3 ? msq_f32(x + 3 * xs + 4) : 0.f);
}
#endif

// ---------------------------------------------------------------- AVX-512 + VNNI

#if defined(MSQ_AVX512)
// Two blocks' weights as 64 bytes (block b in bytes 0..31, b + 1 in 32..63), natural order,
// unsigned: q in [0, 16) or [0, 32) (the offset is applied later), or Q8_0's signed bytes.
template <int K>
static inline __m512i msq_load2(const uint8_t *b0) {
    typedef MsqT<K> T;
    const uint8_t *b1 = b0 + T::BYTES;
    if (T::BITS == 8)
        return _mm512_inserti64x4(
            _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + T::QS))),
            _mm256_loadu_si256((const __m256i *)(b1 + T::QS)), 1);
    // [qs0 qs0 qs1 qs1] in the four 128-bit lanes, lanes 1 and 3 shifted to their high nibbles
    __m512i t = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(b0 + T::QS)));
    t = _mm512_mask_broadcast_i32x4(t, 0xff00, _mm_loadu_si128((const __m128i *)(b1 + T::QS)));
    t = _mm512_mask_srli_epi16(t, 0xff00ff00u, t, 4);
    __m512i q = _mm512_and_si512(t, _mm512_set1_epi8(0x0f));
    if (T::BITS == 5) {
        const __mmask64 h = _cvtu64_mask64((uint64_t)msq_u32(b0 + T::QS - 4) |
                                           (uint64_t)msq_u32(b1 + T::QS - 4) << 32);
        q = _mm512_mask_add_epi8(q, h, q, _mm512_set1_epi8(0x10));
    }
    return q;
}

// Both activation blocks' 32 int8 as one vector.
static inline __m512i msq_act2(const char *x) {
    return _mm512_inserti64x4(_mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(x + 8))),
                              _mm256_loadu_si256((const __m256i *)(x + 8 + sizeof(ms_a8))), 1);
}

// [d0, m0 or 0, d1, m1 or 0] of two weight blocks, as floats
template <int K>
static inline __m128 msq_dm2(const uint8_t *b0) {
    const uint8_t *b1 = b0 + MsqT<K>::BYTES;
    __m128i h;
    if (MsqT<K>::MIN)
        h = _mm_insert_epi32(_mm_cvtsi32_si128((int)msq_u32(b0)), (int)msq_u32(b1), 1);
    else
        h = _mm_insert_epi16(_mm_cvtsi32_si128(msq_u16(b0)), msq_u16(b1), 2);
    return _mm_cvtph_ps(h);
}

// [dx0, s0, dx1, s1] of two activation blocks
static inline __m128 msq_ds2(const char *x) {
    long long a, b;
    std::memcpy(&a, x, 8);
    std::memcpy(&b, x + sizeof(ms_a8), 8);
    return _mm_castsi128_ps(_mm_insert_epi64(_mm_cvtsi64_si128(a), b, 1));
}

template <int K, int NB>
static inline void msq_dot_avx512(long n, const uint8_t *w, const char *x, long xs, float *y,
                                  long ys) {
    typedef MsqT<K> T;
    const long nb = n / 32;
    const bool sign = !T::MIN && (NB > 1 || T::BITS == 8);  // |w| x sign(a, w), else q . a - OFF sum(a)
    const __m512i off = _mm512_set1_epi8(T::OFF), zero = _mm512_setzero_si512();
    const __m512i lanes = _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(0), _mm512_set1_epi32(2));
    __m512 acc[NB];
    __m128 mins[NB];  // lanes 1 and 3: the min sums of even and odd blocks (0, 2: unused)
    for (int j = 0; j < NB; j++) acc[j] = _mm512_setzero_ps(), mins[j] = _mm_setzero_ps();
    long b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *wb = w + b * T::BYTES;
        _mm_prefetch((const char *)wb + MSQ_PREFETCH, _MM_HINT_T0);
        __m512i q = msq_load2<K>(wb), aw = q;
        __mmask64 neg = 0;
        if (sign) {
            if (T::OFF) q = _mm512_sub_epi8(q, off);
            aw = _mm512_abs_epi8(q);
            neg = _mm512_movepi8_mask(q);
        }
        const __m128 dm = msq_dm2<K>(wb);
        for (int j = 0; j < NB; j++) {
            const char *xb = x + j * xs + b * (long)sizeof(ms_a8);
            const __m512i a = msq_act2(xb);
            __m512i is;
            if (sign)
                is = _mm512_dpbusd_epi32(zero, aw, _mm512_mask_sub_epi8(a, neg, zero, a));
            else if (T::OFF)
                is = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, q, a), _mm512_dpbusd_epi32(zero, off, a));
            else
                is = _mm512_dpbusd_epi32(zero, q, a);
            const __m128 p = _mm_mul_ps(dm, msq_ds2(xb));  // [d_w d_x, m_w s_x] x 2 blocks
            const __m512 dd = _mm512_permutexvar_ps(lanes, _mm512_zextps128_ps512(p));
            acc[j] = _mm512_add_ps(acc[j], _mm512_mul_ps(dd, _mm512_cvtepi32_ps(is)));
            if (T::MIN) mins[j] = _mm_add_ps(mins[j], p);
        }
    }
    __m256i wl = _mm256_setzero_si256();
    const uint8_t *wb = w + b * T::BYTES;
    if (b < nb) wl = msq_load1<K>(wb);
    for (int j = 0; j < NB; j++) {
        __m256 lo = _mm512_castps512_ps256(acc[j]);
        const __m256 hi = _mm512_extractf32x8_ps(acc[j], 1);
        float me = 0.f, mo = 0.f;
        if (T::MIN) me = _mm_cvtss_f32(_mm_movehdup_ps(mins[j])), mo = _mm_cvtss_f32(_mm_permute_ps(mins[j], 3));
        if (b < nb) {  // an odd last block: into the even sums, as the order says
            const char *xb = x + j * xs + b * (long)sizeof(ms_a8);
            const __m256i a = _mm256_loadu_si256((const __m256i *)(xb + 8));
            lo = msq_term1(lo, msq_isum1<K>(wl, a), wb, xb);
            if (T::MIN) me = me + msq_min1(wb, xb);
        }
        const float total = msq_hsum8(_mm256_add_ps(lo, hi));
        y[j * ys] = T::MIN ? total + (me + mo) : total;
    }
}
#endif

// ---------------------------------------------------------------- AVX2 + FMA (and AVX-512's 256-bit loop)

#if defined(MSQ_AVX2) || defined(MSQ_AVX512)
// Up to 4 activation rows at a time (two accumulators each: 8 of the 16 registers).
template <int K, int NB>
static inline void msq_dot_avx2_4(long n, const uint8_t *w, const char *x, long xs, float *y,
                                  long ys) {
    typedef MsqT<K> T;
    const long nb = n / 32;
    __m256 acc[NB][2];
    // the min sums of even and odd blocks, lane j for activation row j: each row's own sums,
    // in its own lane, so one multiply and one add serve the group's rows
    __m128 min_even = _mm_setzero_ps(), min_odd = _mm_setzero_ps();
    for (int j = 0; j < NB; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    long b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *wb = w + b * T::BYTES;
        _mm_prefetch((const char *)wb + MSQ_PREFETCH, _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            const uint8_t *wh = wb + h * T::BYTES;
            __m256i q = msq_load1<K>(wh), aw = q;
            if (!T::MIN) aw = _mm256_sign_epi8(q, q);
            for (int j = 0; j < NB; j++) {
                const char *xb = x + j * xs + (b + h) * (long)sizeof(ms_a8);
                const __m256i a = _mm256_loadu_si256((const __m256i *)(xb + 8));
                const __m256i is = T::MIN ? msq_dot_us8(q, a) : msq_dot_us8(aw, _mm256_sign_epi8(a, q));
                acc[j][h] = msq_term1(acc[j][h], is, wh, xb);
            }
        }
        if (T::MIN) {
            const char *xb = x + b * (long)sizeof(ms_a8);
            min_even = _mm_add_ps(min_even, _mm_mul_ps(msq_m1(wb), msq_s4<NB>(xb, xs)));
            min_odd = _mm_add_ps(min_odd, _mm_mul_ps(msq_m1(wb + T::BYTES), msq_s4<NB>(xb + sizeof(ms_a8), xs)));
        }
    }
    if (T::MIN && b < nb)
        min_even = _mm_add_ps(min_even, _mm_mul_ps(msq_m1(w + b * T::BYTES), msq_s4<NB>(x + b * (long)sizeof(ms_a8), xs)));
    alignas(16) float even[4], odd[4];
    _mm_store_ps(even, min_even);
    _mm_store_ps(odd, min_odd);
    for (int j = 0; j < NB; j++) {
        if (b < nb) {
            const uint8_t *wb = w + b * T::BYTES;
            const char *xb = x + j * xs + b * (long)sizeof(ms_a8);
            const __m256i a = _mm256_loadu_si256((const __m256i *)(xb + 8));
            acc[j][0] = msq_term1(acc[j][0], msq_isum1<K>(msq_load1<K>(wb), a), wb, xb);
        }
        const float total = msq_hsum8(_mm256_add_ps(acc[j][0], acc[j][1]));
        y[j * ys] = T::MIN ? total + (even[j] + odd[j]) : total;
    }
}
#endif

// ---------------------------------------------------------------- the entry points

template <int K, int NB>
static inline void msq_dot(long n, const void *w, const void *x, long xs, float *y, long ys) {
    const uint8_t *wb = (const uint8_t *)w;
    const char *xb = (const char *)x;
#if defined(MSQ_AVX512)
    // Q8_0 against one row streams faster one block per 256-bit vector (measured: 27 GB/s
    // against 22 from L2); both loops keep the canonical order, so results are identical.
    if (K == MSQ_Q8_0 && NB == 1) return msq_dot_avx2_4<K, 1>(n, wb, xb, xs, y, ys);
    msq_dot_avx512<K, NB>(n, wb, xb, xs, y, ys);
#elif defined(MSQ_AVX2)
    if (NB <= 4) return msq_dot_avx2_4<K, (NB <= 4 ? NB : 4)>(n, wb, xb, xs, y, ys);
    int j = 0;  // a weight row from L1 again for each further 4 rows
    for (; j + 4 <= NB; j += 4) msq_dot_avx2_4<K, 4>(n, wb, xb + j * xs, xs, y + j * ys, ys);
    for (; j < NB; j++) msq_dot_avx2_4<K, 1>(n, wb, xb + j * xs, xs, y + j * ys, ys);
#else
    for (int j = 0; j < NB; j++) y[j * ys] = msq_dot_plain<K>(n, wb, xb + j * xs);
#endif
}

template <int NB>
static void ms_dot_q4_0(long n, const void *w, const void *x, long xs, float *y, long ys) {
    msq_dot<MSQ_Q4_0, NB>(n, w, x, xs, y, ys);
}
template <int NB>
static void ms_dot_q4_1(long n, const void *w, const void *x, long xs, float *y, long ys) {
    msq_dot<MSQ_Q4_1, NB>(n, w, x, xs, y, ys);
}
template <int NB>
static void ms_dot_q5_0(long n, const void *w, const void *x, long xs, float *y, long ys) {
    msq_dot<MSQ_Q5_0, NB>(n, w, x, xs, y, ys);
}
template <int NB>
static void ms_dot_q5_1(long n, const void *w, const void *x, long xs, float *y, long ys) {
    msq_dot<MSQ_Q5_1, NB>(n, w, x, xs, y, ys);
}
template <int NB>
static void ms_dot_q8_0(long n, const void *w, const void *x, long xs, float *y, long ys) {
    msq_dot<MSQ_Q8_0, NB>(n, w, x, xs, y, ys);
}

static void ms_dequant_q4_0(const void *w, float *y, long n) { msq_dequant<MSQ_Q4_0>(w, y, n); }
static void ms_dequant_q4_1(const void *w, float *y, long n) { msq_dequant<MSQ_Q4_1>(w, y, n); }
static void ms_dequant_q5_0(const void *w, float *y, long n) { msq_dequant<MSQ_Q5_0>(w, y, n); }
static void ms_dequant_q5_1(const void *w, float *y, long n) { msq_dequant<MSQ_Q5_1>(w, y, n); }
static void ms_dequant_q8_0(const void *w, float *y, long n) { msq_dequant<MSQ_Q8_0>(w, y, n); }

// ---------------------------------------------------------------- F16 weights

// One row of n halves to floats (exact).
static void ms_dequant_f16(const void *w, float *y, long n) {
    const uint8_t *h = (const uint8_t *)w;
    long i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 2 * i))));
#endif
    for (; i < n; i++) y[i] = msq_h2f(msq_u16(h + 2 * i));
}

#if defined(MSQ_AVX2)
template <int NB>  // NB <= 2: four accumulators each
static inline void msq_dot_f16_avx2(long n, const uint8_t *w, const char *x, long xs, float *y,
                                    long ys) {
    const long body = n / 32 * 32;
    __m256 acc[NB][4];
    for (int j = 0; j < NB; j++)
        for (int k = 0; k < 4; k++) acc[j][k] = _mm256_setzero_ps();
    for (long c = 0; c < body; c += 32) {
        _mm_prefetch((const char *)w + 2 * c + MSQ_PREFETCH, _MM_HINT_T0);
        __m256 wv[4];
        for (int k = 0; k < 4; k++)
            wv[k] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * (c + 8 * k))));
        for (int j = 0; j < NB; j++) {
            const float *xr = (const float *)(x + j * xs) + c;
            for (int k = 0; k < 4; k++)
                acc[j][k] = _mm256_fmadd_ps(wv[k], _mm256_loadu_ps(xr + 8 * k), acc[j][k]);
        }
    }
    for (int j = 0; j < NB; j++) {
        const float *xr = (const float *)(x + j * xs);
        float total = msq_hsum8(_mm256_add_ps(_mm256_add_ps(acc[j][0], acc[j][2]),
                                              _mm256_add_ps(acc[j][1], acc[j][3])));
        for (long c = body; c < n; c++) total = total + msq_h2f(msq_u16(w + 2 * c)) * xr[c];
        y[j * ys] = total;
    }
}
#endif

template <int NB>
static void ms_dot_f16(long n, const void *w, const void *x, long xs, float *y, long ys) {
    const uint8_t *wb = (const uint8_t *)w;
    const char *xb = (const char *)x;
    const long body = n / 32 * 32;
#if defined(MSQ_AVX512)
    __m512 A[NB], B[NB];
    for (int j = 0; j < NB; j++) A[j] = B[j] = _mm512_setzero_ps();
    for (long c = 0; c < body; c += 32) {
        _mm_prefetch((const char *)wb + 2 * c + MSQ_PREFETCH, _MM_HINT_T0);
        const __m512 wa = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + 2 * c)));
        const __m512 wc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + 2 * c + 32)));
        for (int j = 0; j < NB; j++) {
            const float *xr = (const float *)(xb + j * xs) + c;
            A[j] = _mm512_fmadd_ps(wa, _mm512_loadu_ps(xr), A[j]);
            B[j] = _mm512_fmadd_ps(wc, _mm512_loadu_ps(xr + 16), B[j]);
        }
    }
    for (int j = 0; j < NB; j++) {
        const float *xr = (const float *)(xb + j * xs);
        const __m512 s = _mm512_add_ps(A[j], B[j]);
        float total = msq_hsum8(_mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1)));
        for (long c = body; c < n; c++) total = total + msq_h2f(msq_u16(wb + 2 * c)) * xr[c];
        y[j * ys] = total;
    }
#elif defined(MSQ_AVX2)
    (void)body;
    int j = 0;  // two rows at a time; the weight row from L1 again for further pairs
    for (; j + 2 <= NB; j += 2) msq_dot_f16_avx2<2>(n, wb, xb + j * xs, xs, y + j * ys, ys);
    for (; j < NB; j++) msq_dot_f16_avx2<1>(n, wb, xb + j * xs, xs, y + j * ys, ys);
#else
    for (int j = 0; j < NB; j++) {
        const float *xr = (const float *)(xb + j * xs);
        float acc[32] = {0.f};
        for (long c = 0; c < body; c += 32) {
            float wf[32];
            for (int i = 0; i < 32; i++) wf[i] = msq_h2f(msq_u16(wb + 2 * (c + i)));
            for (int i = 0; i < 32; i++) acc[i] = acc[i] + wf[i] * xr[c + i];
        }
        float v[8];
        for (int l = 0; l < 8; l++) v[l] = (acc[l] + acc[16 + l]) + (acc[8 + l] + acc[24 + l]);
        float total = msq_sum8(v);
        for (long c = body; c < n; c++) total = total + msq_h2f(msq_u16(wb + 2 * c)) * xr[c];
        y[j * ys] = total;
    }
#endif
}

#endif  // MINISERVE_QUANTS_H
