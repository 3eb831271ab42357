// Dot products and row decoders for ggml's 32-weight block types (Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0, IQ4_NL) and for F16 weights, as stored in GGUF files (ggml-common.h's layouts), for decode.cpp.
//
// Activations: each row entering a product is quantized once to int8 blocks of 32 (x ~= d q,
// q in [-127, 127]), kept in groups of 8 blocks (ms_a8g: the 8 scales, the 8 sums d sum(q) and
// sum(q), then the 8 blocks' quants); a block's products are then one exact integer sum. The
// block formats, and the idea of an integer dot per block scaled by d_w d_x, follow llama.cpp's
// ggml-cpu; the code is ours.
//
// One canonical order of the float operations for a (weight row, activation row) pair, the
// same for every NB and every position j, and the same in the three builds (AVX-512 + VNNI,
// AVX2 + FMA, plain loops):
//   per block b: I = the exact int32 sum of the block's 32 products (q - OFF, or q for the
//                types with a min, or IQ4_NL's table value of q, times the activations' q);
//                p = (d_w * d_x) * float(I), plus m_w * s_x for the types with a min
//                (Q4_1, Q5_1): p = p + m_w * s_x;
//                acc[b & 7] = acc[b & 7] + p
//   then ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)).
// That is: lane k of 8 takes blocks 8g + k, one running sum a lane. One sum a lane (not two
// alternating by group, nor one more for the mins) keeps 8 activation rows' sums in registers
// beside the weights' 8 vectors (AVX-512 has 32; AVX2's 16 spill less); the chains stay short
// enough, as a group's integer work is many times an add's latency.
// The vector loops take a group of 8 blocks at once, block k in int32 lane k: the activations
// are stored by 4-byte pieces (ms_a8g), and each weight group is unpacked and transposed the
// same way once for all the activation rows of the call, so 8 integer dot steps (pmaddubsw,
// or vpdpbusd) leave the 8 block totals in the 8 lanes with no sum across lanes; then one
// convert, two multiplies and one add (a multiply and an add more for a min) serve the 8
// blocks. A last group short of 8 blocks has zeros in the missing lanes (d = 0, q = 0), which add
// exact zeros; one of at most 4 (2) blocks takes half (a quarter of) the steps: its pieces are
// packed into 4 (2) vectors, 2 (4) lanes a block, in the weights as in the activations (whose last group is
// stored so: msq_span), and each block's lanes are added as integers. Never a fused multiply-add
// in the float part (the generic build has none in hardware), so every build rounds alike.
// (This order replaced one with 8 float lanes a block: 8 blocks now cost the float work 1 did.)
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
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#define MSQ_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define MSQ_AVX2 1
#endif
#if defined(MSQ_AVX512) || defined(MSQ_AVX2) || defined(__F16C__)
#include <immintrin.h>
#endif

struct ms_a8g {  // 8 consecutive blocks of 32 activations
    float d[8];        // scales: x ~= d * qs
    float s[8];        // d * sum(qs), for the weight types with a min
    int32_t sum[8];    // sum(qs), for the types with an offset (Q4_0, Q5_0)
    // the quants by 4-byte pieces (piece p: quants 4 p .. 4 p + 3), in msq_piece_at's places:
    // in a whole group, a 32-byte load p has piece p of the 8 blocks, block k in int32 lane k
    int8_t qs[256];
};

// The span of a group of nbg blocks: 8 for a whole group (and a last one of 5-7 blocks), 4 or 2
// for a last group of at most 4 or 2 blocks, whose pieces are packed into 4 or 2 vectors (the
// vector loops' half- and quarter-width tails). With span S, 32-byte vector p % S holds piece p
// of block k in int32 lane S (p / S) + k.
static inline int msq_span(long nbg) { return nbg > 4 ? 8 : nbg > 2 ? 4 : 2; }
// f(std::integral_constant<int, span>()) for a span of 8, 4 or 2: code with the offsets fixed
template <class F>
static inline __attribute__((always_inline)) void msq_with_span(int span, F &&f) {
    if (span == 8)
        f(std::integral_constant<int, 8>());
    else if (span == 4)
        f(std::integral_constant<int, 4>());
    else
        f(std::integral_constant<int, 2>());
}
static inline int msq_piece_at(int span, int k, int p) {  // (span a power of two: shifts, not divisions)
    const int sh = span == 8 ? 3 : span == 4 ? 2 : 1;
    return 32 * (p & (span - 1)) + 4 * span * (p >> sh) + 4 * k;
}
static inline int msq_at(int span, int k, int i) { return msq_piece_at(span, k, i / 4) + i % 4; }  // quant i of block k

// How far ahead of the weight loads the loops prefetch (bytes), as decode.cpp does; not tuned
// (the machine measured on was too noisy to tell 1 KB from 4 KB).
#define MSQ_INLINE inline __attribute__((always_inline))
#define MSQ_INLINE_LAMBDA __attribute__((always_inline))

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

// The canonical end of a pair's sum: the 8 lanes in one order (decode.cpp's hsum8: halves,
// pairs, last two).
static inline float msq_sum8(const float *v) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

// ---------------------------------------------------------------- block types

// What tells the 32-weight types apart. BYTES: a block's size; QS: where its nibbles / bytes
// start; OFF: what is subtracted from the stored unsigned quant (0 for Q8_0, whose quants are
// signed, and for the types with a min); MIN: w = d q + m; BITS: 4, 5 or 8; LUT: the 4-bit
// index picks the weight's integer from a table (IQ4_NL: w = d * msq_iq4nl[q], signed values
// that the loops take as Q8_0's signed quants once looked up: msq_signed8).
enum MsqKind { MSQ_Q4_0, MSQ_Q4_1, MSQ_Q5_0, MSQ_Q5_1, MSQ_Q8_0, MSQ_IQ4_NL };
template <int K> struct MsqT;
template <> struct MsqT<MSQ_Q4_0> { static const int BYTES = 18, QS = 2, OFF = 8, MIN = 0, BITS = 4, LUT = 0; };
template <> struct MsqT<MSQ_Q4_1> { static const int BYTES = 20, QS = 4, OFF = 0, MIN = 1, BITS = 4, LUT = 0; };
template <> struct MsqT<MSQ_Q5_0> { static const int BYTES = 22, QS = 6, OFF = 16, MIN = 0, BITS = 5, LUT = 0; };
template <> struct MsqT<MSQ_Q5_1> { static const int BYTES = 24, QS = 8, OFF = 0, MIN = 1, BITS = 5, LUT = 0; };
template <> struct MsqT<MSQ_Q8_0> { static const int BYTES = 34, QS = 2, OFF = 0, MIN = 0, BITS = 8, LUT = 0; };
template <> struct MsqT<MSQ_IQ4_NL> { static const int BYTES = 18, QS = 2, OFF = 0, MIN = 0, BITS = 4, LUT = 1; };

// IQ4_NL's 16 weight values (ggml-common.h's kvalues_iq4nl; IQ4_XS uses them too, kquants.h).
alignas(16) static const int8_t msq_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                 1,    13,   25,  38,  53,  69,  89,  113};

// Whether a type's integers, as the dot products take them, are signed bytes: Q8_0's stored
// quants (-128 .. 127), IQ4_NL's looked-up values (-127 .. 113).
template <int K>
constexpr bool msq_signed8() {
    return MsqT<K>::BITS == 8 || MsqT<K>::LUT;
}

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
        if (T::LUT) lo = msq_iq4nl[lo], hi = msq_iq4nl[hi];
        q[i] = lo - T::OFF;
        q[i + 16] = hi - T::OFF;
    }
}

// One row of n weights to floats: d * (q - OFF), d * q + m, or d * the looked-up value (gguf's
// own arithmetic).
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

// x -> int8 blocks: d = amax / 127, q = round-to-nearest-even(x * (1 / d)), s = d * sum(q).
// The vector paths round with cvtps2dq under the default mode; the plain loop with the
// 1.5 * 2^23 trick, which rounds the same float the same way (|x / d| <= 127.5 here).
// Block k of group g, whose span is `span`; a last partial block (n % 32) is padded with zeros,
// as are the blocks of a last group past the row's end.
static inline void msq_quantize_block_plain(const float *x, ms_a8g *g, int k, int span) {
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
        g->qs[msq_at(span, k, i)] = (int8_t)q;
        sum += q;
    }
    g->d[k] = d;
    g->s[k] = d * (float)sum;
    g->sum[k] = sum;
}

static inline void msq_quantize_block(const float *x, ms_a8g *g, int k, int span) {
#if defined(MSQ_AVX512)
    __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    const __m512 vid = _mm512_set1_ps(id);
    __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid));
    __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
    alignas(32) int8_t p[32];
    _mm_store_si128((__m128i *)p, _mm512_cvtepi32_epi8(q0));
    _mm_store_si128((__m128i *)(p + 16), _mm512_cvtepi32_epi8(q1));
    for (int i = 0; i < 8; i++) std::memcpy(g->qs + msq_piece_at(span, k, i), p + 4 * i, 4);
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    g->d[k] = d;
    g->s[k] = d * (float)sum;
    g->sum[k] = sum;
#elif defined(MSQ_AVX2)
    __m256 v[4];
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        m = _mm256_max_ps(m, _mm256_and_ps(v[i], absmask));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i q[4];
    for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    // int32 -> int8 (values within [-127, 127]): packs interleave 128-bit lanes; undo it
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    alignas(32) int8_t pb[32];
    _mm256_store_si256((__m256i *)pb, p);
    for (int i = 0; i < 8; i++) std::memcpy(g->qs + msq_piece_at(span, k, i), pb + 4 * i, 4);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    const int total = _mm_cvtsi128_si32(s4);
    g->d[k] = d;
    g->s[k] = d * (float)total;
    g->sum[k] = total;
#else
    msq_quantize_block_plain(x, g, k, span);
#endif
}

static void ms_quantize_a8(const float *x, ms_a8g *y, long n) {
    const long full = n / 32, nb = (n + 31) / 32;
    if (nb % 8) std::memset(y + nb / 8, 0, sizeof(ms_a8g));
    auto span = [&](long i) { return i / 8 == nb / 8 ? msq_span(nb % 8) : 8; };  // block i's group's
    for (long i = 0; i < full; i++) msq_quantize_block(x + 32 * i, y + i / 8, (int)(i % 8), span(i));
    if (n % 32) {
        float pad[32] = {0};
        for (long i = 0; i < n % 32; i++) pad[i] = x[32 * full + i];
        msq_quantize_block_plain(pad, y + full / 8, (int)(full % 8), span(full));
    }
}

// ---------------------------------------------------------------- the plain loops

// One pair (weight row, activation row) at a time; the canonical order spelled out.
template <int K>
static inline float msq_dot_plain(long n, const uint8_t *w, const char *x) {
    typedef MsqT<K> T;
    float acc[8] = {0.f};
    const ms_a8g *g = (const ms_a8g *)x;
    const long nb = n / 32;
    for (long b = 0; b < nb; b++, w += T::BYTES) {
        int q[32];
        msq_ints<K>(w, q);
        const ms_a8g &a = g[b / 8];
        const int k = (int)(b % 8), span = b / 8 == nb / 8 ? msq_span(nb % 8) : 8;
        int s = 0;
        for (int i = 0; i < 32; i++) s += q[i] * a.qs[msq_at(span, k, i)];
        float p = (msq_h2f(msq_u16(w)) * a.d[k]) * (float)s;
        if (T::MIN) p = p + msq_h2f(msq_u16(w + 2)) * a.s[k];
        acc[k] = acc[k] + p;
    }
    return msq_sum8(acc);
}

// ---------------------------------------------------------------- the vector loops
// AVX2, and the AVX-512 and AVX-VNNI builds (whose 256-bit vpdpbusd replaces pmaddubsw + pmaddwd).

#if defined(MSQ_AVX512) || defined(MSQ_AVX2)
static inline float msq_hsum8(__m256 v) {  // msq_sum8's order
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// The 4 bytes at byte `at` of each of a group's nbg <= 8 blocks (from wg), block k in lane k
// (0 past nbg).
template <int K>
static MSQ_INLINE __m256i msq_words8(const uint8_t *wg, int at, int nbg) {
    // inserted one by one: a vector load of 8 fresh stores (what a compiler may make of
    // _mm256_setr_epi32) would stall on each group
    const int B = MsqT<K>::BYTES;
    auto w = [&](int k) { return k < nbg ? (int)msq_u32(wg + k * B + at) : 0; };
    __m128i lo = _mm_cvtsi32_si128(w(0)), hi = _mm_cvtsi32_si128(w(4));
    lo = _mm_insert_epi32(lo, w(1), 1);
    hi = _mm_insert_epi32(hi, w(5), 1);
    lo = _mm_insert_epi32(lo, w(2), 2);
    hi = _mm_insert_epi32(hi, w(6), 2);
    lo = _mm_insert_epi32(lo, w(3), 3);
    hi = _mm_insert_epi32(hi, w(7), 3);
    return _mm256_set_m128i(hi, lo);
}

// r[k] lane i -> r[i] lane k within each 128-bit half (a 4 x 4 transpose of int32 per half).
static MSQ_INLINE void msq_transpose4(__m256i *r) {
    const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]),
                  t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    r[0] = _mm256_unpacklo_epi64(t0, t2);
    r[1] = _mm256_unpackhi_epi64(t0, t2);
    r[2] = _mm256_unpacklo_epi64(t1, t3);
    r[3] = _mm256_unpackhi_epi64(t1, t3);
}

// 16 bytes at byte `at` of the quants of a group's blocks k and k + 4 (low and high half of q[k],
// k < 4; zeros past nbg), transposed: int32 i of those bytes in lane k (lane k + 4) of q[i].
template <int K>
static MSQ_INLINE void msq_quads(const uint8_t *wg, int nbg, int at, __m256i *q) {
    typedef MsqT<K> T;
    for (int k = 0; k < 4; k++) {
        const uint8_t *b = wg + k * T::BYTES + T::QS + at;
        const __m128i lo = k < nbg ? _mm_loadu_si128((const __m128i *)b) : _mm_setzero_si128();
        const __m128i hi = k + 4 < nbg ? _mm_loadu_si128((const __m128i *)(b + 4 * T::BYTES)) : _mm_setzero_si128();
        q[k] = _mm256_set_m128i(hi, lo);
    }
    msq_transpose4(q);
}

// The fifth bits of 4 weights: the low 4 bits of each int32 of qh (bit m: weight m's), each to
// bit 4 of byte m (a multiply by 2^4 + 2^11 + 2^18 + 2^25 spreads the nibble without carries;
// the mask keeps the four wanted bits).
static MSQ_INLINE __m256i msq_fifth(__m256i qh) {
    const __m256i v = _mm256_and_si256(qh, _mm256_set1_epi32(0xf));
    return _mm256_and_si256(_mm256_mullo_epi32(v, _mm256_set1_epi32(0x02040810)), _mm256_set1_epi32(0x10101010));
}

// The 4- and 5-bit types: a group's weights (nbg <= 8 blocks from wg; zeros past them) as 8
// vectors, piece i (weights 4 i .. 4 i + 3) of block k in int32 lane k of q[i], the unsigned
// stored quants (OFF not subtracted). Byte m of the 16 holds weight m (low nibble) and m + 16
// (high), so piece i is int32 i's low nibbles (i < 4) or int32 i - 4's high ones.
template <int K>
static MSQ_INLINE void msq_group(const uint8_t *wg, int nbg, __m256i *q) {
    typedef MsqT<K> T;
    __m256i r[4];
    msq_quads<K>(wg, nbg, 0, r);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int i = 0; i < 4; i++) {
        q[i] = _mm256_and_si256(r[i], m4);
        q[i + 4] = _mm256_and_si256(_mm256_srli_epi16(r[i], 4), m4);
    }
    if (T::BITS == 5) {  // piece i takes qh's bits 4 i .. 4 i + 3
        const __m256i qh = msq_words8<K>(wg, T::QS - 4, nbg);
        for (int i = 0; i < 8; i++) q[i] = _mm256_or_si256(q[i], msq_fifth(_mm256_srli_epi32(qh, 4 * i)));
    }
}

// A last group of nbg <= 4 blocks, at half the work: q[i] holds piece i of blocks 0 .. 3 in
// lanes 0 .. 3 and piece i + 4 in lanes 4 .. 7 (Q8_0: signed bytes; else unsigned quants), as
// the activations of such a group are stored (span 4); the totals' two halves are then added.
template <int K>
static MSQ_INLINE void msq_tail(const uint8_t *wg, int nbg, __m256i *q) {
    typedef MsqT<K> T;
    for (int k = 0; k < 4; k++) {
        const uint8_t *b = wg + k * T::BYTES + T::QS;
        if (k >= nbg)
            q[k] = _mm256_setzero_si256();
        else if (T::BITS == 8)  // bytes 0 .. 15 low, 16 .. 31 high
            q[k] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(b + 16)), _mm_loadu_si128((const __m128i *)b));
        else  // the 16 bytes twice: low nibbles below, high nibbles above
            q[k] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)b));
    }
    msq_transpose4(q);
    if (T::BITS == 8) return;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int i = 0; i < 4; i++)
        q[i] = _mm256_and_si256(_mm256_blend_epi32(q[i], _mm256_srli_epi16(q[i], 4), 0xf0), m4);
    if (T::BITS == 5) {  // as in msq_group; lanes 4 .. 7 take qh's bits 16 higher
        const __m256i qh = msq_words8<K>(wg, T::QS - 4, nbg);
        const __m256i qh2 = _mm256_permute2x128_si256(qh, qh, 0x00);  // blocks 0 .. 3 twice
        for (int i = 0; i < 4; i++) {
            const __m256i by = _mm256_setr_epi32(4 * i, 4 * i, 4 * i, 4 * i, 4 * i + 16, 4 * i + 16, 4 * i + 16, 4 * i + 16);
            q[i] = _mm256_or_si256(q[i], msq_fifth(_mm256_srlv_epi32(qh2, by)));
        }
    }
}

// A last group of nbg <= 2 blocks, at a quarter of the work: q[v] (v < 2) holds piece 2 m + v
// of block k in lane 2 m + k (Q8_0: signed bytes; else unsigned quants), as the activations of
// such a group are stored (span 2); each block's four lanes are then added.
template <int K>
static MSQ_INLINE void msq_quarter(const uint8_t *wg, int nbg, __m256i *q) {
    typedef MsqT<K> T;
    const uint8_t *b0 = wg + T::QS, *b1 = wg + T::BYTES + T::QS;
    if (T::BITS == 8) {  // int32 p of a block is its piece p
        const __m256i y0 = _mm256_loadu_si256((const __m256i *)b0),
                      y1 = nbg > 1 ? _mm256_loadu_si256((const __m256i *)b1) : _mm256_setzero_si256();
        const __m256i lo = _mm256_unpacklo_epi32(y0, y1), hi = _mm256_unpackhi_epi32(y0, y1);
        q[0] = _mm256_unpacklo_epi64(lo, hi);  // pieces 0, 2 | 4, 6 of blocks 0 and 1
        q[1] = _mm256_unpackhi_epi64(lo, hi);  // pieces 1, 3 | 5, 7
        return;
    }
    // piece p < 4: int32 p's low nibbles; piece p + 4: its high ones
    const __m128i x0 = _mm_loadu_si128((const __m128i *)b0),
                  x1 = nbg > 1 ? _mm_loadu_si128((const __m128i *)b1) : _mm_setzero_si128();
    const __m128i lo = _mm_unpacklo_epi32(x0, x1), hi = _mm_unpackhi_epi32(x0, x1);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int v = 0; v < 2; v++) {
        const __m256i r = _mm256_broadcastsi128_si256(v ? _mm_unpackhi_epi64(lo, hi) : _mm_unpacklo_epi64(lo, hi));
        q[v] = _mm256_and_si256(_mm256_blend_epi32(r, _mm256_srli_epi16(r, 4), 0xf0), m4);
    }
    if (T::BITS == 5) {  // lane 2 m + k of q[v] takes block k's qh bits 4 (2 m + v) ..
        const __m256i qh = msq_words8<K>(wg, T::QS - 4, nbg);
        const __m256i qh2 = _mm256_permutevar8x32_epi32(qh, _mm256_setr_epi32(0, 1, 0, 1, 0, 1, 0, 1));
        for (int v = 0; v < 2; v++) {
            const __m256i by = _mm256_add_epi32(_mm256_setr_epi32(0, 0, 8, 8, 16, 16, 24, 24), _mm256_set1_epi32(4 * v));
            q[v] = _mm256_or_si256(q[v], msq_fifth(_mm256_srlv_epi32(qh2, by)));
        }
    }
}

// A group's fp16 scales d (and mins m, for the types with a min) as 8 floats, 0 past nbg.
template <int K>
static MSQ_INLINE void msq_scales(const uint8_t *wg, int nbg, __m256 *d, __m256 *m) {
    typedef MsqT<K> T;
    if (T::MIN) {  // d and m are one 32-bit word: [d, m] pairs -> d's, then m's
        const __m256i dm = msq_words8<K>(wg, 0, nbg);
        const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                               0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
        const __m256i h = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(dm, split), 0xd8);
        *d = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        *m = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
        return;
    }
    // in general registers (the vector units are the busy ones; a vector load of fresh
    // stores would stall)
    const int B = T::BYTES;
    uint64_t lo = 0, hi = 0;
    for (int k = 0; k < 4; k++) {
        lo |= (uint64_t)(k < nbg ? msq_u16(wg + k * B) : 0) << (16 * k);
        hi |= (uint64_t)(k + 4 < nbg ? msq_u16(wg + (k + 4) * B) : 0) << (16 * k);
    }
    const __m128i h = _mm_set_epi64x((long long)hi, (long long)lo);
    *d = _mm256_cvtph_ps(h);
    *m = _mm256_setzero_ps();
}

// vpdpbusd on 256 bits where the build has it: AVX-512 (VL + VNNI), or AVX-VNNI (Intel's
// desktops and laptops from Alder Lake: no AVX-512). It adds each lane's 4 unsigned x signed
// byte products into its int32 total in one step, where AVX2 alone takes vpmaddubsw + vpmaddwd
// through int16; the int16 sums below never saturate, so the totals, and the bits, are the
// same either way.
#if defined(MSQ_AVX512) || defined(__AVXVNNI__)
#define MSQ_DPBUSD 1
static MSQ_INLINE __m256i msq_dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(MSQ_AVX512)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#endif

// What msq_float takes out of a group's integer totals: the activations' sums times 1 << shift
// (-1: nothing). Q4_0 and Q5_0 enter as their unsigned stored quants (OFF = 8, 16). Where the
// build has vpdpbusd (AVX-512, or AVX-VNNI), Q8_0's signed quants enter it as the unsigned bytes
// q + 128 (one xor a group, for all the activation rows), so sum((q + 128) a) - 128 sum(a): the
// same integer, without the sign trick's instruction a piece and row. (AVX2's pmaddubsw would
// saturate on the pairs of (q + 128) a; without AVX-VNNI it keeps the sign trick.)
template <int K>
constexpr int msq_bias_shift() {
    typedef MsqT<K> T;
#if defined(MSQ_DPBUSD)
    if (msq_signed8<K>()) return 7;  // IQ4_NL likewise: its table's values + 128 (msq_lut)
#endif
    return T::OFF == 8 ? 3 : T::OFF == 16 ? 4 : -1;
}

// Whether this build takes the signed-byte types as q + 128 (msq_bias_shift): Q8_0's stored rows
// are xored once a group, its packed strips stored so; IQ4_NL's table is biased (msq_lut).
template <int K>
constexpr bool msq_biased() {
    return msq_signed8<K>() && msq_bias_shift<K>() >= 0;
}

// IQ4_NL: 4-bit indices (bytes 0..15) to their values, as this build's loops take them: + 128
// where it takes signed bytes biased (msq_biased), else signed.
template <int K>
static MSQ_INLINE __m256i msq_lut(__m256i idx) {
    const __m128i t = _mm_load_si128((const __m128i *)msq_iq4nl);
    const __m128i tb = msq_biased<K>() ? _mm_xor_si128(t, _mm_set1_epi8((char)0x80)) : t;
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(tb), idx);
}

// Q8_0 (AVX2 without AVX-VNNI): acc plus the products of P pieces (w[i]: the weights'
// magnitudes, sg[i]: their signed bytes) against the activation pieces act(0) .. act(P - 1),
// int32 lane by lane.
template <int P, class Act>
static MSQ_INLINE __m256i msq_totals_q8(__m256i acc, const __m256i *w, const __m256i *sg, Act act) {
    for (int i = 0; i < P; i++) {
        const __m256i a = _mm256_sign_epi8(act(i), sg[i]);
        // pairs of products up to 2 * 128 * 127: into int32 at once
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w[i], a), _mm256_set1_epi16(1)));
    }
    return acc;
}

// The 4- and 5-bit types (and, where the build has vpdpbusd, Q8_0 as q + 128: msq_bias_shift): the totals
// (int32 lane k: block k) of P pieces of weights (w[i], unsigned) against the activation
// pieces act(0) .. act(P - 1).
template <int K, int P, class Act>
static MSQ_INLINE __m256i msq_totals(const __m256i *w, Act act) {
    __m256i acc = _mm256_setzero_si256();
#if defined(MSQ_DPBUSD)
    if constexpr (P == 8) {  // two chains, then their sum (integers: the same total)
        __m256i b = msq_dpbusd(_mm256_setzero_si256(), w[1], act(1));
        acc = msq_dpbusd(acc, w[0], act(0));
        for (int i = 2; i < P; i += 2) {
            acc = msq_dpbusd(acc, w[i], act(i));
            b = msq_dpbusd(b, w[i + 1], act(i + 1));
        }
        return _mm256_add_epi32(acc, b);
    }
    for (int i = 0; i < P; i++) acc = msq_dpbusd(acc, w[i], act(i));
#else
    typedef MsqT<K> T;
    static_assert(!msq_signed8<K>(), "signed bytes take msq_totals_q8 here: their pairs reach 2^15");
    const __m256i ones = _mm256_set1_epi16(1);
    // 4-bit weights: up to 8 pieces' pairs in int16 (|sum| <= 8 * 2 * 15 * 127); 5-bit: 4 at a time
    const int run = T::BITS == 4 ? 8 : 4;
    for (int i0 = 0; i0 < P; i0 += run) {
        __m256i p = _mm256_maddubs_epi16(w[i0], act(i0));
        for (int i = i0 + 1; i < i0 + run && i < P; i++) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[i], act(i)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
    }
#endif
    return acc;
}

// The integer totals of group g (nbg blocks) for NB rows (xs bytes apart), each handed to
// use(j, total) as soon as it is known (so that few totals are live at once): the group's
// weights unpacked and transposed once for the NB rows.
template <int K, int NB, class Use>
static MSQ_INLINE void msq_group_totals(const uint8_t *w, const char *x, long xs, long g, int nbg, Use use) {
    typedef MsqT<K> T;
    const uint8_t *wg = w + 8 * g * T::BYTES;
    auto qs = [&](int j) { return ((const ms_a8g *)(x + j * xs) + g)->qs; };
    constexpr bool biased = msq_biased<K>();  // Q8_0 as q + 128
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    // a last group of at most 4 (2) blocks: half (a quarter of) the work, its pieces packed into
    // 4 (2) vectors as its activations are (msq_span); each block's lanes are then added. Past
    // nbg, a block's totals are 0 (quarter) or copies (half: lanes 4 .. 7), which meet scales of 0.
    auto short_group = [&](auto pieces) MSQ_INLINE_LAMBDA {
        constexpr int P = decltype(pieces)::value;
        __m256i q[P], aq[P];
        if constexpr (P == 4) msq_tail<K>(wg, nbg, q);
        else msq_quarter<K>(wg, nbg, q);
        for (int i = 0; T::LUT && i < P; i++) q[i] = msq_lut<K>(q[i]);  // biased already where so
        for (int i = 0; msq_signed8<K>() && i < P; i++)
            aq[i] = biased ? (T::LUT ? q[i] : _mm256_xor_si256(q[i], bias)) : _mm256_sign_epi8(q[i], q[i]);
        for (int j = 0; j < NB; j++) {
            const int8_t *a = qs(j);
            auto act = [&](int i) { return _mm256_loadu_si256((const __m256i *)(a + 32 * i)); };
            __m256i t;
            if constexpr (msq_signed8<K>() && !biased)
                t = msq_totals_q8<P>(_mm256_setzero_si256(), aq, q, act);
            else
                t = msq_totals<K, P>(biased ? aq : q, act);
            t = _mm256_add_epi32(t, _mm256_permute2x128_si256(t, t, 0x01));
            if constexpr (P == 2)  // lanes 0, 1 (and 4, 5): blocks 0 and 1; 2, 3, 6, 7: 0
                t = _mm256_blend_epi32(_mm256_setzero_si256(), _mm256_add_epi32(t, _mm256_shuffle_epi32(t, 0x4e)), 0x33);
            use(j, t);
        }
    };
    if (nbg <= 2) {
        short_group(std::integral_constant<int, 2>());
    } else if (nbg <= 4) {
        short_group(std::integral_constant<int, 4>());
    } else if constexpr (T::LUT && !biased) {  // IQ4_NL, signed: the magnitudes' trick, as Q8_0's
        __m256i q[8], aq[8];
        msq_group<K>(wg, nbg, q);
        for (int i = 0; i < 8; i++) q[i] = msq_lut<K>(q[i]), aq[i] = _mm256_sign_epi8(q[i], q[i]);
        for (int j = 0; j < NB; j++) {
            const int8_t *a = qs(j);
            use(j, msq_totals_q8<8>(_mm256_setzero_si256(), aq, q, [&](int i) { return _mm256_loadu_si256((const __m256i *)(a + 32 * i)); }));
        }
    } else if constexpr (T::BITS == 8 && !biased) {  // a half of the pieces at a time: 8 vectors of weights live, not 16
        __m256i totals[NB];
        for (int p = 0; p < 2; p++) {
            __m256i q[4], aq[4];
            msq_quads<K>(wg, nbg, 16 * p, q);
            for (int i = 0; i < 4; i++) aq[i] = _mm256_sign_epi8(q[i], q[i]);
            for (int j = 0; j < NB; j++) {
                const int8_t *a = qs(j) + 128 * p;
                auto act = [&](int i) { return _mm256_loadu_si256((const __m256i *)(a + 32 * i)); };
                totals[j] = msq_totals_q8<4>(p ? totals[j] : _mm256_setzero_si256(), aq, q, act);
                if (p) use(j, totals[j]);
            }
        }
    } else {
        __m256i q[8];
        if constexpr (T::BITS == 8) {  // biased: the magnitudes' trick needs no second copy
            msq_quads<K>(wg, nbg, 0, q);
            msq_quads<K>(wg, nbg, 16, q + 4);
            for (int i = 0; i < 8; i++) q[i] = _mm256_xor_si256(q[i], bias);
        } else {
            msq_group<K>(wg, nbg, q);
            for (int i = 0; T::LUT && i < 8; i++) q[i] = msq_lut<K>(q[i]);  // IQ4_NL's values + 128
        }
        for (int j = 0; j < NB; j++) {
            const int8_t *a = qs(j);
            use(j, msq_totals<K, 8>(q, [&](int i) { return _mm256_loadu_si256((const __m256i *)(a + 32 * i)); }));
        }
    }
}

// The float part of a group for one row (its activations a) from its integer totals (int32
// lane k: block k) and the weights' scales dw and mins mw, into the row's running sums acc.
template <int K>
static MSQ_INLINE void msq_float(const ms_a8g *a, __m256i total, __m256 dw, __m256 mw, __m256 &acc) {
    typedef MsqT<K> T;
    constexpr int shift = msq_bias_shift<K>();
    if constexpr (shift >= 0)
        total = _mm256_sub_epi32(total, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)a->sum), shift));
    const __m256 dd = _mm256_mul_ps(dw, _mm256_loadu_ps(a->d));
    __m256 p = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(total));
    if (T::MIN) p = _mm256_add_ps(p, _mm256_mul_ps(mw, _mm256_loadu_ps(a->s)));
    acc = _mm256_add_ps(acc, p);
}

// Group g (nbg blocks) of NB rows (xs bytes apart) into their running sums acc.
template <int K, int NB>
static MSQ_INLINE void msq_group_sums(const uint8_t *w, const char *x, long xs, long g, int nbg, __m256 *acc) {
    __m256 dw, mw;
    msq_scales<K>(w + 8 * g * MsqT<K>::BYTES, nbg, &dw, &mw);
    msq_group_totals<K, NB>(w, x, xs, g, nbg, [&](int j, __m256i total) MSQ_INLINE_LAMBDA {
        msq_float<K>((const ms_a8g *)(x + j * xs) + g, total, dw, mw, acc[j]);
    });
}

// NB activation rows (xs bytes apart) against one weight row, a group of 8 blocks at a time.
template <int K, int NB>
static inline void msq_dot_vec(long n, const uint8_t *w, const char *x, long xs, float *y, long ys) {
    typedef MsqT<K> T;
    const long nb = n / 32;
    __m256 acc[NB];
    for (int j = 0; j < NB; j++) acc[j] = _mm256_setzero_ps();
    long g = 0;
    for (; 8 * g + 8 <= nb; g++) {  // whole groups (the short one's cases fold away: nbg = 8)
        const uint8_t *wg = w + 8 * g * T::BYTES;
        for (int o = 0; o < 8 * T::BYTES; o += 64)
            _mm_prefetch((const char *)wg + MSQ_PREFETCH + o, _MM_HINT_T0);
        msq_group_sums<K, NB>(w, x, xs, g, 8, acc);
    }
    if (nb > 8 * g) msq_group_sums<K, NB>(w, x, xs, g, (int)(nb - 8 * g), acc);  // a last, short group: its lanes past nbg are zeros
    for (int j = 0; j < NB; j++) y[j * ys] = msq_hsum8(acc[j]);
}
#endif

// ---------------------------------------------------------------- the entry points

template <int K, int NB>
static inline void msq_dot(long n, const void *w, const void *x, long xs, float *y, long ys) {
    const uint8_t *wb = (const uint8_t *)w;
    const char *xb = (const char *)x;
#if defined(MSQ_AVX512) || defined(MSQ_AVX2)
    msq_dot_vec<K, NB>(n, wb, xb, xs, y, ys);
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
template <int NB>
static void ms_dot_iq4_nl(long n, const void *w, const void *x, long xs, float *y, long ys) {
    msq_dot<MSQ_IQ4_NL, NB>(n, w, x, xs, y, ys);
}

#if defined(MSQ_AVX512) || defined(MSQ_AVX2)
// A 5-bit block's high bits (qh: bit i is weight i's) rearranged for the packed layouts: byte
// i's bit p is weight 4p + i's, so that piece p's 4 high bits reach bit 4 of its 4 bytes with
// one shift and one mask (msq_high_bits).
static inline uint32_t msq_pack_high_bits(const uint8_t *block_qh) {
    const uint32_t qh = msq_u32(block_qh);
    uint32_t hb = 0;
    for (int i = 0; i < 4; i++)
        for (int p = 0; p < 8; p++) hb |= ((qh >> (4 * p + i)) & 1u) << (8 * i + p);
    return hb;
}

// A packed block of S weight rows (AVX-512: MsqPacked, S = 16; AVX2: MsqPacked8, S = 8): q[v]'s
// lane l (row l) holds 4 bytes of that row's quants, the 5-bit types' fifth bits in h
// (msq_pack_high_bits), then d[S] (and the min types' m[S]) as stored: S x the stored block's
// bytes.
template <int K, int S>
struct MsqStrip {
    static constexpr int QV = MsqT<K>::BITS == 8 ? 8 : 4;  // quant vectors a block
    uint8_t q[QV][4 * S];
    uint32_t h[MsqT<K>::BITS == 5 ? S : 0];
    uint16_t d[S];
    uint16_t m[MsqT<K>::MIN ? S : 0];
};

// S stored rows of n weights (w: the first, wrow bytes apart) -> n / 32 packed blocks; Q8_0's
// quants as q + 128 where this build's loop takes them so (msq_bias_shift), else as stored.
template <int K, int S>
static void msq_pack_strip(long n, const void *w, long wrow, void *out) {
    typedef MsqT<K> T;
    typedef MsqStrip<K, S> P;
    constexpr bool biased = msq_biased<K>();
    const uint8_t *rows = (const uint8_t *)w;
    uint8_t *o = (uint8_t *)out;
    for (long b = 0; b < n / 32; b++) {
        P p;
        for (int l = 0; l < S; l++) {
            const uint8_t *br = rows + l * wrow + b * T::BYTES;
            std::memcpy(&p.d[l], br, 2);
            if constexpr (T::MIN) std::memcpy(&p.m[l], br + 2, 2);
            if constexpr (T::BITS == 5) p.h[l] = msq_pack_high_bits(br + T::QS - 4);
            for (int v = 0; v < P::QV; v++) {
                std::memcpy(&p.q[v][4 * l], br + T::QS + 4 * v, 4);
                if constexpr (biased && T::BITS == 8)
                    for (int e = 0; e < 4; e++) p.q[v][4 * l + e] ^= 0x80;  // q + 128
            }
        }
        std::memcpy(o + b * sizeof(P), &p, sizeof(P));
    }
}
#endif

#if defined(MSQ_AVX512)
// ---------------------------------------------------------------- packed 16 rows at a time

// A Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 or IQ4_NL matrix laid out anew at load for the AVX-512 build
// (decode.cpp's T_PACKED_32; IQ4_NL's indices as stored, looked up as biased values in the loop,
// msq_lut): 16 weight rows' block b in 16 x the stored block's bytes,
// the rows of a 16 one after another, block by block. q[v]'s lane l (row l) holds 4 bytes of
// that row's quants: for the 4-bit types qs[4v .. 4v + 3] (low nibbles: piece v, quants 4v ..
// 4v + 3; high nibbles: piece v + 4; the 5-bit types' fifth bits in h, msq_pack_high_bits);
// for Q8_0 piece v itself, stored as q + 128 (the unsigned bytes the AVX-512 loop gives
// vpdpbusd, msq_bias_shift). Then d[16] (and the min types' m[16]) as stored. One vpdpbusd against 4 broadcast activation bytes is 64 products, the block's total
// for 16 rows in 16 lanes, where the rows as stored are transposed into lanes (8 blocks of one
// row) at every product. The float part is the canonical order's, lane by lane: the offset's
// sum taken out of the total as msq_float does, p = (d_w * d_x) * float(I) (+ m_w * s_x),
// acc[b & 7] += p, then msq_sum8's order -- the same bits as the rows as stored. (A last
// group's missing blocks add nothing here, where the stored loop adds +0 to a sum that starts
// at +0: the same bits.)
template <int K>
using MsqPacked = MsqStrip<K, 16>;
constexpr int MSQ_STRIP = 16;  // weight rows a packed strip holds in this build
static_assert(sizeof(MsqPacked<MSQ_Q4_1>) == 16 * 20 && sizeof(MsqPacked<MSQ_Q4_0>) == 16 * 18 &&
                  sizeof(MsqPacked<MSQ_Q5_0>) == 16 * 22 && sizeof(MsqPacked<MSQ_Q5_1>) == 16 * 24 &&
                  sizeof(MsqPacked<MSQ_Q8_0>) == 16 * 34 && sizeof(MsqPacked<MSQ_IQ4_NL>) == 16 * 18,
              "a packed block is its 16 stored blocks' size");

// The 16 rows of a packed strip (n / 32 blocks at w) against NB activation rows (ms_a8g rows,
// xs bytes apart): y[j * ys + r] for rows r < 16.
template <int K, int NB>
static void msq_dot_packed(long n, const void *w, const void *x, long xs, float *y, long ys) {
    typedef MsqT<K> T;
    typedef MsqPacked<K> P;
    constexpr int shift = msq_bias_shift<K>();
    const uint8_t *t = (const uint8_t *)w;
    const long nb = n / 32;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[NB][8];
    for (int j = 0; j < NB; j++)
        for (int k = 0; k < 8; k++) acc[j][k] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const P &u = *(const P *)(t + b * sizeof(P));
        // (as the K-quant strips: from memory the prefetchers alone fall behind); one row too:
        // SmolLM2's one-row pass on a Xeon 5.3-5.6 -> 3.9-4.0 ms (the AVX2 build's: 6.1-6.3 ->
        // 5.0-5.2), where the K-quants' one-row strips are faster without (kquants.h)
        if (b % 4 == 0)
            for (int o = 0; o < 4 * (int)sizeof(P); o += 64) _mm_prefetch((const char *)(t + (b + 8) * sizeof(P)) + o, _MM_HINT_T1);
        const long g = b / 8;
        const int k = (int)(b % 8);
        __m512i W[8];
        for (int v = 0; v < P::QV; v++) {
            const __m512i q = _mm512_loadu_si512((const void *)u.q[v]);
            if constexpr (T::BITS == 8)
                W[v] = q;
            else
                W[v] = _mm512_and_si512(q, m4), W[v + 4] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
        }
        if constexpr (T::BITS == 5) {  // piece p's fifth bits: bit p of each byte of h, to bit 4
            const __m512i h = _mm512_loadu_si512((const void *)u.h), b4 = _mm512_set1_epi8(0x10);
            for (int p = 0; p < 8; p++)
                W[p] = _mm512_or_si512(W[p], _mm512_and_si512(p <= 4 ? _mm512_slli_epi32(h, 4 - p) : _mm512_srli_epi32(h, p - 4), b4));
        }
        if constexpr (T::LUT) {  // IQ4_NL: the indices' values + 128 (msq_lut)
            const __m512i lut = _mm512_broadcast_i32x4(_mm_xor_si128(_mm_load_si128((const __m128i *)msq_iq4nl), _mm_set1_epi8((char)0x80)));
            for (int p = 0; p < 8; p++) W[p] = _mm512_shuffle_epi8(lut, W[p]);
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)u.d));
        __m512 mw = _mm512_setzero_ps();
        if constexpr (T::MIN) mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)u.m));
        auto rows = [&](auto sp) MSQ_INLINE_LAMBDA {  // the group's span a constant: fixed offsets
            constexpr int span = decltype(sp)::value;
            for (int j = 0; j < NB; j++) {
                const ms_a8g *a = (const ms_a8g *)((const char *)x + j * xs) + g;
                // block k's pieces: a constant offset each from its first (an address's own
                // displacement, not a sum a piece)
                const int8_t *ak = a->qs + msq_piece_at(span, k, 0);
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
                for (int p = 0; p < 8; p += 2) {  // two chains, then their sum (integers: the same total)
                    int32_t v0, v1;
                    std::memcpy(&v0, ak + msq_piece_at(span, 0, p), 4);
                    std::memcpy(&v1, ak + msq_piece_at(span, 0, p + 1), 4);
                    s0 = _mm512_dpbusd_epi32(s0, W[p], _mm512_set1_epi32(v0));
                    s1 = _mm512_dpbusd_epi32(s1, W[p + 1], _mm512_set1_epi32(v1));
                }
                __m512i total = _mm512_add_epi32(s0, s1);
                if constexpr (shift >= 0) total = _mm512_sub_epi32(total, _mm512_set1_epi32((int32_t)((uint32_t)a->sum[k] << shift)));
                const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(a->d[k]));
                __m512 p = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(total));
                if constexpr (T::MIN) p = _mm512_add_ps(p, _mm512_mul_ps(mw, _mm512_set1_ps(a->s[k])));
                acc[j][k] = _mm512_add_ps(acc[j][k], p);
            }
        };
        msq_with_span(msq_span(nb - 8 * g < 8 ? nb - 8 * g : 8), rows);
    }
    for (int j = 0; j < NB; j++) {  // msq_sum8's order, lane by lane
        const __m512 lo = _mm512_add_ps(_mm512_add_ps(acc[j][0], acc[j][4]), _mm512_add_ps(acc[j][2], acc[j][6]));
        const __m512 hi = _mm512_add_ps(_mm512_add_ps(acc[j][1], acc[j][5]), _mm512_add_ps(acc[j][3], acc[j][7]));
        alignas(64) float v[16];
        _mm512_store_ps(v, _mm512_add_ps(lo, hi));
        for (int l = 0; l < 16; l++) y[j * ys + l] = v[l];
    }
}
#endif

#if defined(MSQ_AVX2)
// ---------------------------------------------------------------- packed 8 rows at a time (AVX2)

// A Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 or IQ4_NL matrix laid out anew at load for the AVX2 build
// (decode.cpp's T_PACKED_32; IQ4_NL's indices as stored, looked up in the loop and then taken as
// Q8_0's signed bytes are, msq_lut), as MsqPacked with 8 lanes: 8 weight rows' block b in 8 x
// the stored block's bytes; q[v]'s lane l (row l) holds 4 bytes of that row's quants (the
// 4-bit types: qs[4v .. 4v + 3], low nibbles piece v, high nibbles piece v + 4; Q8_0: piece v,
// signed as stored, or as q + 128 with AVX-VNNI (msq_bias_shift); the 5-bit types' fifth bits
// in h, msq_pack_high_bits), then d[8] (and the
// min types' m[8]) as stored. pmaddubsw against 4 broadcast activation bytes gives each row's
// pairs: a 4-bit block's 8 pieces (|pair| <= 2 * 15 * 128, 8 of them < 2^15) add as int16 and
// one pmaddwd makes the row's int32 total; a 5-bit block's in two chains of 4 (4 * 2 * 31 * 128
// < 2^15), a pmaddwd each; Q8_0 keeps the stored loop's sign trick (pairs up to 2 * 128 * 127:
// into int32 at once). With AVX-VNNI, vpdpbusd takes every piece straight into int32 (Q8_0's as
// q + 128, its sum taken out after). The integer
// totals and the float part (p = (d_w * d_x) * float(I) (+ m_w * s_x), acc[b & 7] += p, then
// msq_sum8's order) are the stored loop's, lane by lane: the same bits.
template <int K>
using MsqPacked8 = MsqStrip<K, 8>;
constexpr int MSQ_STRIP = 8;  // weight rows a packed strip holds in this build
static_assert(sizeof(MsqPacked8<MSQ_Q4_1>) == 8 * 20 && sizeof(MsqPacked8<MSQ_Q4_0>) == 8 * 18 &&
                  sizeof(MsqPacked8<MSQ_Q5_0>) == 8 * 22 && sizeof(MsqPacked8<MSQ_Q5_1>) == 8 * 24 &&
                  sizeof(MsqPacked8<MSQ_Q8_0>) == 8 * 34 && sizeof(MsqPacked8<MSQ_IQ4_NL>) == 8 * 18,
              "a packed block is its 8 stored blocks' size");

// The 8 rows of a packed strip (n / 32 blocks at w) against NB activation rows (ms_a8g rows,
// xs bytes apart): y[j * ys + r] for rows r < 8.
template <int K, int NB>
static void msq_dot_packed8(long n, const void *w, const void *x, long xs, float *y, long ys) {
    typedef MsqT<K> T;
    typedef MsqPacked8<K> P;
    constexpr int shift = msq_bias_shift<K>();
    const uint8_t *t = (const uint8_t *)w;
    const long nb = n / 32;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[NB][8];
    for (int j = 0; j < NB; j++)
        for (int k = 0; k < 8; k++) acc[j][k] = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const P &u = *(const P *)(t + b * sizeof(P));
        if (b % 4 == 0)  // (as the 16-row strips, one row too)
            for (int o = 0; o < 4 * (int)sizeof(P); o += 64) _mm_prefetch((const char *)(t + (b + 8) * sizeof(P)) + o, _MM_HINT_T1);
        const long g = b / 8;
        const int k = (int)(b % 8);
        constexpr bool biased = msq_biased<K>();  // Q8_0 packed as q + 128
        __m256i W[8], S[msq_signed8<K>() ? 8 : 1];
        for (int v = 0; v < P::QV; v++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)u.q[v]);
            if constexpr (biased && T::BITS == 8)
                W[v] = q;
            else if constexpr (T::BITS == 8)
                S[v] = q, W[v] = _mm256_sign_epi8(q, q);
            else
                W[v] = _mm256_and_si256(q, m4), W[v + 4] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        }
        if constexpr (T::BITS == 5) {  // piece p's fifth bits: bit p of each byte of h, to bit 4
            const __m256i h = _mm256_loadu_si256((const __m256i *)u.h), b4 = _mm256_set1_epi8(0x10);
            for (int p = 0; p < 8; p++)
                W[p] = _mm256_or_si256(W[p], _mm256_and_si256(p <= 4 ? _mm256_slli_epi32(h, 4 - p) : _mm256_srli_epi32(h, p - 4), b4));
        }
        if constexpr (T::LUT) {  // IQ4_NL: the indices' values (+ 128 where biased: msq_lut)
            for (int p = 0; p < 8; p++) {
                W[p] = msq_lut<K>(W[p]);
                if constexpr (!biased) S[p] = W[p], W[p] = _mm256_sign_epi8(W[p], W[p]);
            }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)u.d));
        __m256 mw = _mm256_setzero_ps();
        if constexpr (T::MIN) mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)u.m));
        auto rows = [&](auto sp) MSQ_INLINE_LAMBDA {  // the group's span a constant: fixed offsets
            constexpr int span = decltype(sp)::value;
            for (int j = 0; j < NB; j++) {
                const ms_a8g *a = (const ms_a8g *)((const char *)x + j * xs) + g;
                const int8_t *ak = a->qs + msq_piece_at(span, k, 0);  // (as msq_dot_packed)
                auto act = [&](int p) MSQ_INLINE_LAMBDA {
                    int32_t v;
                    std::memcpy(&v, ak + msq_piece_at(span, 0, p), 4);
                    return _mm256_set1_epi32(v);
                };
                __m256i total;
                if constexpr (msq_signed8<K>() && !biased)
                    total = msq_totals_q8<8>(_mm256_setzero_si256(), W, S, act);
                else
                    total = msq_totals<K, 8>(W, act);
                if constexpr (shift >= 0) total = _mm256_sub_epi32(total, _mm256_set1_epi32((int32_t)((uint32_t)a->sum[k] << shift)));
                const __m256 dd = _mm256_mul_ps(dw, _mm256_set1_ps(a->d[k]));
                __m256 p = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(total));
                if constexpr (T::MIN) p = _mm256_add_ps(p, _mm256_mul_ps(mw, _mm256_set1_ps(a->s[k])));
                acc[j][k] = _mm256_add_ps(acc[j][k], p);
            }
        };
        msq_with_span(msq_span(nb - 8 * g < 8 ? nb - 8 * g : 8), rows);
    }
    for (int j = 0; j < NB; j++) {  // msq_sum8's order, lane by lane
        const __m256 lo = _mm256_add_ps(_mm256_add_ps(acc[j][0], acc[j][4]), _mm256_add_ps(acc[j][2], acc[j][6]));
        const __m256 hi = _mm256_add_ps(_mm256_add_ps(acc[j][1], acc[j][5]), _mm256_add_ps(acc[j][3], acc[j][7]));
        alignas(32) float v[8];
        _mm256_store_ps(v, _mm256_add_ps(lo, hi));
        for (int l = 0; l < 8; l++) y[j * ys + l] = v[l];
    }
}
#endif

#if defined(MSQ_AVX512) || defined(MSQ_AVX2)
// The products on this build's packed strips (MSQ_STRIP rows), for decode.cpp's table.
template <int K, int NB>
static void msq_dot_strip(long n, const void *w, const void *x, long xs, float *y, long ys) {
#if defined(MSQ_AVX512)
    msq_dot_packed<K, NB>(n, w, x, xs, y, ys);
#else
    msq_dot_packed8<K, NB>(n, w, x, xs, y, ys);
#endif
}
#endif

static void ms_dequant_q4_0(const void *w, float *y, long n) { msq_dequant<MSQ_Q4_0>(w, y, n); }
static void ms_dequant_q4_1(const void *w, float *y, long n) { msq_dequant<MSQ_Q4_1>(w, y, n); }
static void ms_dequant_q5_0(const void *w, float *y, long n) { msq_dequant<MSQ_Q5_0>(w, y, n); }
static void ms_dequant_q5_1(const void *w, float *y, long n) { msq_dequant<MSQ_Q5_1>(w, y, n); }
static void ms_dequant_q8_0(const void *w, float *y, long n) { msq_dequant<MSQ_Q8_0>(w, y, n); }
static void ms_dequant_iq4_nl(const void *w, float *y, long n) { msq_dequant<MSQ_IQ4_NL>(w, y, n); }

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
