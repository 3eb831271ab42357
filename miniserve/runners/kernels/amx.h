// Q4_K / Q5_K products on Intel AMX tiles (Sapphire Rapids and later), for many activation rows
// (a prompt chunk, a batch of decode rows): the same bits as kquants.h's loops.
//
// kquants.h computes, per super-block and activation row, two exact integers -- A = sum over
// sub-blocks s of sc[s] * (q . xq over s), B = sum over s of m[s] * (xq's sum over s) -- and
// then, in float, fa += (float)A * (d * dx), fb += (float)B * (dmin * dx), y = fa - fb
// (mskq_k45_float). Here the same integers come from the tiles, for 16 weight rows x 16
// activation rows at a time: each weight row's super-block is unpacked to bytes with its
// sub-block's 6-bit scale folded in, in two parts that keep every byte below 256 (Q4_K:
// q * (sc & 15) and q * (sc >> 4); Q5_K: & 7 and >> 3), so that 4 tdpbusd of 64 (u8 weights x
// s8 activations) a part give A = low + (high << 4 or 3); B by vpdpwssd of the mins against
// the activations' sub-block sums. The float steps are mskq_k45_float's, 16 activation rows a
// vector. Integer sums are exact whichever way they are grouped, so a row's result is the one
// the AVX-512, AVX2 and plain loops give (tests/test_stored.py compares them in one process:
// ms_amx switches this off).
//
// Activation rows are laid out once per product (amx_k45_group: per 16 rows and super-block,
// 4 B tiles of 16 x 64 bytes in the order tdpbusd reads them, the sub-block sums as int16
// pairs, the 16 scales); a thread's weight rows, 16 at a time, are unpacked (amx_unpack_k45;
// a Q4_K or Q5_K matrix packed at load, 16 rows a strip, by amx_unpack_p45 from its strips) and meet
// every group of 16 activation rows. A group short of 16 rows is padded with zeros, a
// chunk short of 16 weight rows likewise; their results are not written.
//
// Linux only: the process asks the kernel for the tiles' state once (arch_prctl
// ARCH_REQ_XCOMP_PERM); where that fails, or MINISERVE_AMX=0, the AVX-512 loops run.

#ifndef MINISERVE_AMX_H
#define MINISERVE_AMX_H

#if defined(MSKQ_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define MS_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <vector>

static const long AMX_BLOCK = 4 * 1024 + 4 * 64 + 64;  // a group's bytes per super-block

// 0: off (MINISERVE_AMX=0 or ms_amx(0)); 1: on where the kernel grants the tiles
static std::atomic<int> amx_switch{-1};

static bool amx_granted() {
    static const bool granted = [] {
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return granted;
}

static bool amx_on() {
    int s = amx_switch.load(std::memory_order_relaxed);
    if (s < 0) {
        const char *e = std::getenv("MINISERVE_AMX");
        s = (e != nullptr && e[0] == '0') ? 0 : 1;
        amx_switch.store(s);
    }
    return s == 1 && amx_granted();
}

struct alignas(64) AmxConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static void amx_configure() {
    AmxConfig c = {};
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;  // C: 16 x 16 int32; A: 16 x 64
    _tile_loadconfig(&c);                                          // u8; B: 16 x (16 rows x 4 s8)
}

// Group g (activation rows 16g .. 16g + 16 of B; ms_a8k blocks, xs bytes a row) laid out for
// the tiles: per super-block, its 4 B tiles (64 activations each: row kk, activation row n,
// byte t holds element 4kk + t), the sub-block sums as int16 pairs (sub-blocks 2p, 2p + 1:
// 16 int32 lanes for p = 0..3), then the 16 rows' scales.
static void amx_k45_group(const char *xq, long xs, long B, long nb, long g, char *out) {
    for (long i = 0; i < nb; i++) {
        char *o = out + (g * nb + i) * AMX_BLOCK;
        int32_t *bsp = (int32_t *)(o + 4096);
        float *dxv = (float *)(o + 4096 + 256);
        for (long n = 0; n < 16; n++) {
            const long b = g * 16 + n;
            if (b >= B) {
                for (int kk = 0; kk < 64; kk++) std::memset(o + kk * 64 + n * 4, 0, 4);
                for (int p = 0; p < 4; p++) bsp[p * 16 + n] = 0;
                dxv[n] = 0.f;
                continue;
            }
            const uint8_t *xb = (const uint8_t *)(xq + b * xs + i * (long)sizeof(ms_a8k));
            for (int kk = 0; kk < 64; kk++) std::memcpy(o + kk * 64 + n * 4, xb + 4 + 4 * kk, 4);
            int16_t bs[16];
            std::memcpy(bs, xb + 260, 32);
            for (int p = 0; p < 4; p++) {  // each sum < 2^15 (32 x 128)
                const int16_t lo = (int16_t)(bs[4 * p] + bs[4 * p + 1]), hi = (int16_t)(bs[4 * p + 2] + bs[4 * p + 3]);
                bsp[p * 16 + n] = (int32_t)((uint32_t)(uint16_t)lo | (uint32_t)(uint16_t)hi << 16);
            }
            std::memcpy(&dxv[n], xb, 4);
        }
    }
}

// A weight row's super-block for the tiles (512 bytes): the 256 quants times the low part of
// their sub-block's 6-bit scale (sc & 15 for Q4_K, whose quants are < 16; sc & 7 for Q5_K's
// < 32: each product < 256), then times the high part (sc >> 4, sc >> 3) -- so that one tile
// product over the whole super-block gives each part's sum, A = lo + (hi << 4 or 3), exactly
// kquants.h's integer; the mins as int16 pairs (4 int32: sub-blocks 2p, 2p + 1), d and dmin.
template <bool HI>
static inline void amx_unpack_k45(const uint8_t *b, uint8_t *o, int32_t *mins, float *dd) {
    mskq_u45 u;
    mskq_unpack45<HI>(b, u);
    uint32_t uu[4];
    mskq_scales(b + 4, uu);
    const int shift = HI ? 3 : 4, low = (1 << shift) - 1;
    for (int k = 0; k < 4; k++) {  // wk[k]: sub-blocks 2k (bytes 0-31) and 2k + 1 (32-63)
        const int s0 = mskq_byte(uu, 2 * k), s1 = mskq_byte(uu, 2 * k + 1);
        const __m512i q = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(u.wk[k]));
        const __m512i q1 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(u.wk[k], 1));
        const __m512i lo = _mm512_set1_epi16((short)(s0 & low)), lo1 = _mm512_set1_epi16((short)(s1 & low));
        const __m512i hi = _mm512_set1_epi16((short)(s0 >> shift)), hi1 = _mm512_set1_epi16((short)(s1 >> shift));
        _mm256_storeu_si256((__m256i *)(o + 64 * k), _mm512_cvtepi16_epi8(_mm512_mullo_epi16(q, lo)));
        _mm256_storeu_si256((__m256i *)(o + 64 * k + 32), _mm512_cvtepi16_epi8(_mm512_mullo_epi16(q1, lo1)));
        _mm256_storeu_si256((__m256i *)(o + 256 + 64 * k), _mm512_cvtepi16_epi8(_mm512_mullo_epi16(q, hi)));
        _mm256_storeu_si256((__m256i *)(o + 256 + 64 * k + 32), _mm512_cvtepi16_epi8(_mm512_mullo_epi16(q1, hi1)));
    }
    for (int p = 0; p < 4; p++) mins[p] = (int32_t)(mskq_byte(uu, 8 + 2 * p) | (uint32_t)mskq_byte(uu, 9 + 2 * p) << 16);
    dd[0] = u.d, dd[1] = u.dmin;
}

// A packed Q4_K (HI false) or Q5_K strip's super-block (kquants.h's mskq_p45s: 16 rows side by
// side, the quants still 4-bit, Q5_K's fifth bits apart) as amx_unpack_k45 lays out each of its
// rows: row mskq_tile_row(l) from lane l, at ab + row * arow; its mins and d, dmin at
// mins[(row * nb + i) * 4], dd[(row * nb + i) * 2]. The same bytes and numbers as from the 16
// rows as stored.
template <bool HI>
static inline void amx_unpack_p45(const mskq_p45s<16, HI> &u, uint8_t *ab, long arow, long nb, long i,
                                  int32_t *mins, float *dd) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), at = _mm256_setr_epi32(0, 64, 128, 192, 256, 320, 384, 448);
    const int shift = HI ? 3 : 4, low = (1 << shift) - 1;
    for (int l = 0; l < 16; l++) {
        const long m = mskq_tile_row(l);
        uint8_t *o = ab + m * arow + i * 512;
        __m256i h = _mm256_setzero_si256();
        if constexpr (HI) h = _mm256_i32gather_epi32((const int *)&u.h[0][4 * l], at, 1);  // the row's qh
        for (int p = 0; p < 4; p++) {  // q[p][0..7]'s lane l: sub-blocks 2p (low nibbles), 2p + 1
            const __m256i v = _mm256_i32gather_epi32((const int *)&u.q[p][0][4 * l], at, 1);
            __m256i v0 = _mm256_and_si256(v, m4), v1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if constexpr (HI) v0 = _mm256_or_si256(v0, mskq_fifth(h, 2 * p)), v1 = _mm256_or_si256(v1, mskq_fifth(h, 2 * p + 1));
            const __m512i q0 = _mm512_cvtepu8_epi16(v0), q1 = _mm512_cvtepu8_epi16(v1);
            const int s0 = u.sc[2 * p][l], s1 = u.sc[2 * p + 1][l];
            _mm256_storeu_si256((__m256i *)(o + 64 * p), _mm512_cvtepi16_epi8(_mm512_mullo_epi16(q0, _mm512_set1_epi16((short)(s0 & low)))));
            _mm256_storeu_si256((__m256i *)(o + 64 * p + 32), _mm512_cvtepi16_epi8(_mm512_mullo_epi16(q1, _mm512_set1_epi16((short)(s1 & low)))));
            _mm256_storeu_si256((__m256i *)(o + 256 + 64 * p), _mm512_cvtepi16_epi8(_mm512_mullo_epi16(q0, _mm512_set1_epi16((short)(s0 >> shift)))));
            _mm256_storeu_si256((__m256i *)(o + 256 + 64 * p + 32), _mm512_cvtepi16_epi8(_mm512_mullo_epi16(q1, _mm512_set1_epi16((short)(s1 >> shift)))));
            mins[(m * nb + i) * 4 + p] = (int32_t)(u.mn[p][2 * l] | (uint32_t)u.mn[p][2 * l + 1] << 16);
        }
        dd[(m * nb + i) * 2] = mskq_half((const uint8_t *)&u.d[l]);
        dd[(m * nb + i) * 2 + 1] = mskq_half((const uint8_t *)&u.dmin[l]);
    }
}

// Weight rows [r0, r1) of a Q4_K (HI false) or Q5_K matrix against the laid-out activations
// (`acts`, B rows), into y[b * ldy + r]; P16: the matrix packed 16 rows a strip (wrow its
// packed row's bytes; r0 and r1 whole 16s), each strip's blocks unpacked by amx_unpack_p45.
template <bool HI, bool P16 = false>
static void amx_k45_rows(const char *w, long wrow, const char *acts, long B, long nb, float *y,
                         long ldy, long r0, long r1) {
    static thread_local std::vector<uint8_t> abuf;
    static thread_local std::vector<float> dd;  // per row and block: d, dmin
    static thread_local std::vector<int32_t> mins;  // per row and block: 4 pairs
    const long arow = nb * 512, shift = HI ? 3 : 4;
    if ((long)abuf.size() < 16 * arow + 64) abuf.resize(16 * arow + 64);
    if ((long)dd.size() < 16 * nb * 2) dd.resize(16 * nb * 2);
    if ((long)mins.size() < 16 * nb * 4) mins.resize(16 * nb * 4);
    uint8_t *ab = abuf.data() + (64 - (uintptr_t)abuf.data() % 64) % 64;
    const long groups = (B + 15) / 16;
    amx_configure();
    alignas(64) int32_t cbuf[2][16][16];
    for (long c0 = r0; c0 < r1; c0 += 16) {
        const long rows = std::min(16L, r1 - c0);
        if constexpr (P16) {
            const mskq_p45s<16, HI> *t = (const mskq_p45s<16, HI> *)(w + c0 * wrow);
            for (long i = 0; i < nb; i++) amx_unpack_p45(t[i], ab, arow, nb, i, mins.data(), dd.data());
        } else {
            for (long m = 0; m < 16; m++) {
                uint8_t *a = ab + m * arow;
                if (m >= rows) {
                    std::memset(a, 0, arow);
                    for (long i = 0; i < 2 * nb; i++) dd[m * nb * 2 + i] = 0.f;
                    for (long i = 0; i < 4 * nb; i++) mins[m * nb * 4 + i] = 0;
                    continue;
                }
                const uint8_t *b = (const uint8_t *)(w + (c0 + m) * wrow);
                for (long i = 0; i < nb; i++) amx_unpack_k45<HI>(b + i * (HI ? 176 : 144), a + i * 512, &mins[(m * nb + i) * 4], &dd[(m * nb + i) * 2]);
            }
        }
        for (long g = 0; g < groups; g++) {
            alignas(64) float fa[16][16], fb[16][16];
            std::memset(fa, 0, sizeof(fa));
            std::memset(fb, 0, sizeof(fb));
            for (long i = 0; i < nb; i++) {
                const char *o = acts + (g * nb + i) * AMX_BLOCK;
                const uint8_t *a = ab + i * 512;
                _tile_zero(0);
                _tile_zero(1);
#define MS_AMX_K(c, tb)                              \
    _tile_loadd(tb, o + 1024 * (c), 64);             \
    _tile_loadd(3, a + 64 * (c), arow);              \
    _tile_dpbusd(0, 3, tb);                          \
    _tile_loadd(4, a + 256 + 64 * (c), arow);        \
    _tile_dpbusd(1, 4, tb);
                MS_AMX_K(0, 6) MS_AMX_K(1, 7) MS_AMX_K(2, 6) MS_AMX_K(3, 7)
#undef MS_AMX_K
                _tile_stored(0, cbuf[0], 64);
                _tile_stored(1, cbuf[1], 64);
                const __m512i *bsp = (const __m512i *)(o + 4096);
                const __m512 dxv = _mm512_loadu_ps((const float *)(o + 4096 + 256));
                const float *di = &dd[i * 2];
                for (int m = 0; m < 16; m++) {
                    const __m512i A = _mm512_add_epi32(_mm512_load_si512((const void *)cbuf[0][m]),
                                                       _mm512_slli_epi32(_mm512_load_si512((const void *)cbuf[1][m]), (unsigned)shift));
                    const int32_t *mn = &mins[(m * nb + i) * 4];
                    __m512i Bm = _mm512_setzero_si512();
                    for (int p = 0; p < 4; p++)
                        Bm = _mm512_dpwssd_epi32(Bm, _mm512_load_si512((const void *)(bsp + p)), _mm512_set1_epi32(mn[p]));
                    const float d = di[m * nb * 2], dmin = di[m * nb * 2 + 1];
                    // mskq_k45_float, 16 activation rows at once
                    _mm512_store_ps(fa[m], _mm512_add_ps(_mm512_load_ps(fa[m]), _mm512_mul_ps(_mm512_cvtepi32_ps(A), _mm512_mul_ps(_mm512_set1_ps(d), dxv))));
                    _mm512_store_ps(fb[m], _mm512_add_ps(_mm512_load_ps(fb[m]), _mm512_mul_ps(_mm512_cvtepi32_ps(Bm), _mm512_mul_ps(_mm512_set1_ps(dmin), dxv))));
                }
            }
            for (int m = 0; m < rows; m++)
                for (long n = 0; n < 16 && g * 16 + n < B; n++) y[(g * 16 + n) * ldy + c0 + m] = fa[m][n] - fb[m][n];
        }
    }
    _tile_release();
}
#endif  // MS_AMX

#endif
