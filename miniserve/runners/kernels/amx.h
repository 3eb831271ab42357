// Q4_K / Q5_K products on Intel AMX tiles (Sapphire Rapids and later), for many activation rows
// (a prompt chunk, a batch of decode rows): the same bits as kquants.h's loops.
//
// kquants.h computes, per super-block and activation row, two exact integers -- A = sum over
// sub-blocks s of sc[s] * (q . xq over s), B = sum over s of m[s] * (xq's sum over s) -- and
// then, in float, fa += (float)A * (d * dx), fb += (float)B * (dmin * dx), y = fa - fb
// (mskq_k45_float). Here the same integers come from the tiles: for 16 weight rows x 16
// activation rows, one tdpbusd a sub-block (u8 weights x s8 activations, 32 of each: the
// sub-block's dot products for all 256 pairs), each pair's sum times its row's 6-bit scale
// and added (vpmulld); B by vpdpwssd of the mins against the activations' sub-block sums. The
// float steps are mskq_k45_float's, 16 activation rows a vector. Integer sums are exact
// whichever way they are grouped, so a row's result is the one the AVX-512, AVX2 and plain
// loops give (tests/test_stored.py compares them in one process: ms_amx switches this off).
//
// Activation rows are laid out once per product (amx_k45_acts: per 16 rows and super-block,
// 8 tiles of 8 x 64 bytes in the order tdpbusd reads them, the sub-block sums as int16 pairs,
// the 16 scales); a thread's weight rows, 16 at a time, are unpacked to bytes 0..31 and meet
// every group of 16 activation rows. A group short of 16 rows is padded with zeros, a chunk
// short of 16 weight rows likewise; their results are not written.
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

static const long AMX_BLOCK = 8 * 512 + 4 * 64 + 64;  // a group's bytes per super-block

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
    for (int t = 0; t < 4; t++) c.rows[t] = 16, c.colsb[t] = 64;  // C: 16 x 16 int32
    for (int t = 4; t < 6; t++) c.rows[t] = 16, c.colsb[t] = 32;  // A: 16 weight rows x 32 u8
    for (int t = 6; t < 8; t++) c.rows[t] = 8, c.colsb[t] = 64;   // B: 8 x (16 rows x 4 s8)
    _tile_loadconfig(&c);
}

// Group g (activation rows 16g .. 16g + 16 of B; ms_a8k blocks, xs bytes a row) laid out for
// the tiles: per super-block, the 8 sub-blocks' B tiles, the sub-block sums as int16 pairs
// (sub-blocks 2p, 2p + 1: 16 int32 lanes for p = 0..3), the 16 rows' scales.
static void amx_k45_group(const char *xq, long xs, long B, long nb, long g, char *out) {
    for (long i = 0; i < nb; i++) {
        char *o = out + (g * nb + i) * AMX_BLOCK;
        int32_t *bsp = (int32_t *)(o + 4096);
        float *dxv = (float *)(o + 4096 + 256);
        for (long n = 0; n < 16; n++) {
            const long b = g * 16 + n;
            if (b >= B) {
                for (int s = 0; s < 8; s++)
                    for (int kk = 0; kk < 8; kk++) std::memset(o + s * 512 + kk * 64 + n * 4, 0, 4);
                for (int p = 0; p < 4; p++) bsp[p * 16 + n] = 0;
                dxv[n] = 0.f;
                continue;
            }
            const uint8_t *xb = (const uint8_t *)(xq + b * xs + i * (long)sizeof(ms_a8k));
            const uint8_t *qs = xb + 4;
            for (int s = 0; s < 8; s++)
                for (int kk = 0; kk < 8; kk++) std::memcpy(o + s * 512 + kk * 64 + n * 4, qs + 32 * s + 4 * kk, 4);
            int16_t bs[16];
            std::memcpy(bs, xb + 260, 32);
            for (int p = 0; p < 4; p++) {
                const int16_t lo = (int16_t)(bs[4 * p] + bs[4 * p + 1]), hi = (int16_t)(bs[4 * p + 2] + bs[4 * p + 3]);
                bsp[p * 16 + n] = (int32_t)((uint32_t)(uint16_t)lo | (uint32_t)(uint16_t)hi << 16);
            }
            std::memcpy(&dxv[n], xb, 4);
        }
    }
}

// Weight rows [r0, r1) of a Q4_K (HI false) or Q5_K matrix against the laid-out activations
// (`acts`, B rows), into y[b * ldy + r].
template <bool HI>
static void amx_k45_rows(const char *w, long wrow, const char *acts, long B, long nb, float *y,
                         long ldy, long r0, long r1) {
    static thread_local std::vector<uint8_t> abuf;
    static thread_local std::vector<uint8_t> scales;  // per row and block: sc[8], m[8]
    static thread_local std::vector<float> dd;         // per row and block: d, dmin
    const long arow = nb * 256;
    if ((long)abuf.size() < 16 * arow) abuf.resize(16 * arow);
    if ((long)scales.size() < 16 * nb * 16) scales.resize(16 * nb * 16);
    if ((long)dd.size() < 16 * nb * 2) dd.resize(16 * nb * 2);
    const long groups = (B + 15) / 16;
    amx_configure();
    alignas(64) int32_t cbuf[8][16][16];
    for (long c0 = r0; c0 < r1; c0 += 16) {
        const long rows = std::min(16L, r1 - c0);
        for (long m = 0; m < 16; m++) {  // unpack: bytes 0..31 by sub-block, the scales apart
            uint8_t *a = abuf.data() + m * arow;
            if (m >= rows) {
                std::memset(a, 0, arow);
                std::memset(scales.data() + m * nb * 16, 0, nb * 16);
                for (long i = 0; i < nb; i++) dd[(m * nb + i) * 2] = dd[(m * nb + i) * 2 + 1] = 0.f;
                continue;
            }
            const uint8_t *b = (const uint8_t *)(w + (c0 + m) * wrow);
            for (long i = 0; i < nb; i++, b += HI ? 176 : 144) {
                mskq_u45 u;
                mskq_unpack45<HI>(b, u);
                for (int k = 0; k < 4; k++) _mm512_storeu_si512((void *)(a + i * 256 + 64 * k), u.wk[k]);
                uint32_t uu[4];
                mskq_scales(b + 4, uu);
                uint8_t *sc = scales.data() + (m * nb + i) * 16;
                for (int t = 0; t < 16; t++) sc[t] = mskq_byte(uu, t);
                dd[(m * nb + i) * 2] = u.d, dd[(m * nb + i) * 2 + 1] = u.dmin;
            }
        }
        for (long g = 0; g < groups; g++) {
            __m512 fa[16], fb[16];
            for (int m = 0; m < 16; m++) fa[m] = fb[m] = _mm512_setzero_ps();
            for (long i = 0; i < nb; i++) {
                const char *o = acts + (g * nb + i) * AMX_BLOCK;
                const uint8_t *a = abuf.data() + i * 256;
#define MS_AMX_SUB(s, c, ta, tb)                                   \
    _tile_zero(c);                                                 \
    _tile_loadd(ta, a + 32 * (s), arow);                           \
    _tile_loadd(tb, o + 512 * (s), 64);                            \
    _tile_dpbusd(c, ta, tb);
                MS_AMX_SUB(0, 0, 4, 6) MS_AMX_SUB(1, 1, 5, 7) MS_AMX_SUB(2, 2, 4, 6) MS_AMX_SUB(3, 3, 5, 7)
                _tile_stored(0, cbuf[0], 64);
                _tile_stored(1, cbuf[1], 64);
                _tile_stored(2, cbuf[2], 64);
                _tile_stored(3, cbuf[3], 64);
                MS_AMX_SUB(4, 0, 4, 6) MS_AMX_SUB(5, 1, 5, 7) MS_AMX_SUB(6, 2, 4, 6) MS_AMX_SUB(7, 3, 5, 7)
                _tile_stored(0, cbuf[4], 64);
                _tile_stored(1, cbuf[5], 64);
                _tile_stored(2, cbuf[6], 64);
                _tile_stored(3, cbuf[7], 64);
#undef MS_AMX_SUB
                const __m512i *bsp = (const __m512i *)(o + 4096);
                const __m512 dxv = _mm512_loadu_ps((const float *)(o + 4096 + 256));
                for (int m = 0; m < 16; m++) {
                    const uint8_t *sc = scales.data() + (m * nb + i) * 16;
                    __m512i A = _mm512_setzero_si512(), Bm = _mm512_setzero_si512();
                    for (int s = 0; s < 8; s++)
                        A = _mm512_add_epi32(A, _mm512_mullo_epi32(_mm512_load_si512((const void *)cbuf[s][m]),
                                                                   _mm512_set1_epi32(sc[s])));
                    for (int p = 0; p < 4; p++)
                        Bm = _mm512_dpwssd_epi32(Bm, _mm512_load_si512((const void *)(bsp + p)),
                                                 _mm512_set1_epi32((int)(sc[8 + 2 * p] | (uint32_t)sc[9 + 2 * p] << 16)));
                    const float d = dd[(m * nb + i) * 2], dmin = dd[(m * nb + i) * 2 + 1];
                    // mskq_k45_float, 16 activation rows at once
                    fa[m] = _mm512_add_ps(fa[m], _mm512_mul_ps(_mm512_cvtepi32_ps(A), _mm512_mul_ps(_mm512_set1_ps(d), dxv)));
                    fb[m] = _mm512_add_ps(fb[m], _mm512_mul_ps(_mm512_cvtepi32_ps(Bm), _mm512_mul_ps(_mm512_set1_ps(dmin), dxv)));
                }
            }
            for (int m = 0; m < rows; m++) {
                float out[16];
                _mm512_storeu_ps(out, _mm512_sub_ps(fa[m], fb[m]));
                for (long n = 0; n < 16 && g * 16 + n < B; n++) y[(g * 16 + n) * ldy + c0 + m] = out[n];
            }
        }
    }
    _tile_release();
}
#endif  // MS_AMX

#endif
