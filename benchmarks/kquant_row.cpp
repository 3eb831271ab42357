// One activation row against Q4_K weight rows (kernels/kquants.h, the decode of one stream) on
// one core: GB/s of weights and GMAC/s, for a matrix held in L2 (512 x 2048), one past it
// (2048 x 2048) and one past L2 and most of L3's share (8192 x 2048; 65536 x 2048 is from
// memory). Random blocks (finite fp16 scales); the bits are held by tests/product_digests.py
// and tests/test_stored.py, not here. Each size: the rows as stored, then (AVX-512 and AVX2
// builds) the same rows packed as the runner packs them at load (native.pack: mskq_p45 /
// mskq_p45x8), and with `8` as a second argument 8 activation rows instead of one (as stored:
// the AVX-512 build's tiles or the AVX2 build's 8-row loop).
//
//   c++ -O3 -std=c++17 -march=native -ffp-contract=off benchmarks/kquant_row.cpp -o /tmp/kq
//   for R in 512 2048 8192; do taskset -c 1 /tmp/kq $R; done
//
// One size a process: in one process, the matrices allocated after the first ran ~10% slower
// here (their pages, not the kernel), which hid a change's effect on them.
//
// Before and after a change to kquants.h: build against both versions (`-include OLD/kquants.h`,
// whose include guard then wins) and run them in turn.
#include "../miniserve/runners/kernels/kquants.h"

#include <algorithm>
#include <cstdlib>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

static uint16_t half(float f) {  // float -> IEEE half (normal range, truncated: any finite scale)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const int e = (int)((u >> 23) & 0xff) - 127 + 15;
    return (uint16_t)(((u >> 16) & 0x8000u) | (e > 0 ? (uint32_t)e << 10 | ((u >> 13) & 0x3ff) : 0));
}

static void rate(long R, long C, bool rows8, std::mt19937 &rng) {
    std::uniform_real_distribution<float> U(-1, 1);
    const long wrow = C / 256 * 144;
    std::vector<uint8_t> w(R * wrow);
    for (size_t i = 0; i < w.size(); i += 144) {
        for (int k = 0; k < 144; k++) w[i + k] = rng() & 0xff;
        const uint16_t d = half(U(rng) * 0.01f), m = half(U(rng) * 0.01f);
        std::memcpy(&w[i], &d, 2);
        std::memcpy(&w[i + 2], &m, 2);
    }
    const int NB = rows8 ? 8 : 1;
    std::vector<float> x(NB * C), y(NB * R);
    for (auto &v : x) v = U(rng);
    const long nb = C / 256, xs = nb * (long)sizeof(ms_a8k);
    std::vector<ms_a8k> xq(NB * nb);
    for (int j = 0; j < NB; j++) ms_quantize_a8k(x.data() + j * C, xq.data() + j * nb, C);
#if defined(MSKQ_AVX512)
    std::vector<mskq_t45> tile(nb);
    std::vector<float> state(16 * 64);
#endif
    auto stored = [&] {
        if (NB == 1)
            for (long r = 0; r < R; r++) ms_dot_q4_K<1>(C, w.data() + r * wrow, xq.data(), 0, y.data() + r, 1);
        else
#if defined(MSKQ_AVX512)
            for (long r = 0; r < R; r += 16) {
                ms_tile_q4_K(C, w.data() + r * wrow, wrow, tile.data());
                mskq_tile45_dot<8>(C, tile.data(), xq.data(), xs, y.data() + r, R, state.data(), 2);
            }
#elif defined(MSKQ_AVX2)
            for (long r = 0; r < R; r += 8) ms_dot8r_q4_K(C, w.data() + r * wrow, wrow, xq.data(), xs, y.data() + r, R);
#else
            for (long r = 0; r < R; r++) ms_dot_q4_K<8>(C, w.data() + r * wrow, xq.data(), xs, y.data() + r, R);
#endif
    };
    auto measure = [&](const char *what, auto &&run) {
        run();
        double best = 1e9;
        for (int rep = 0; rep < 7; rep++) {
            const int it = std::max(1L, 8192 * 64 / R / NB);
            auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < it; i++) run();
            best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / it);
        }
        std::printf("Q4_K %-7s %d row%s %5ld x %ld (%6ld KB): %5.1f GB/s of weights, %6.1f GMAC/s\n", what, NB,
                    NB > 1 ? "s," : ", ", R, C, R * wrow >> 10, R * wrow / best / 1e9, NB * R * C / best / 1e9);
    };
    measure("stored", stored);
#if defined(MSKQ_AVX512) || defined(MSKQ_AVX2)
#if defined(MSKQ_AVX512)
    const long strip = 16, sbytes = (long)sizeof(mskq_p45);
#else
    const long strip = 8, sbytes = (long)sizeof(mskq_p45x8);
#endif
    std::vector<uint8_t> raw(R / strip * nb * sbytes + 64);
    uint8_t *p = raw.data() + (64 - (uintptr_t)raw.data() % 64) % 64;
    for (long s = 0; s < R / strip; s++) {
#if defined(MSKQ_AVX512)
        mskq_pack45_rows(C, w.data() + strip * s * wrow, wrow, p + s * nb * sbytes);
#else
        mskq_pack45x8_rows(C, w.data() + strip * s * wrow, wrow, p + s * nb * sbytes);
#endif
    }
    measure("packed", [&] {
        for (long s = 0; s < R / strip; s++) {
#if defined(MSKQ_AVX512)
            if (NB == 1) mskq_dot_p45<1>(C, p + s * nb * sbytes, xq.data(), xs, y.data() + strip * s, R);
            else mskq_dot_p45<8>(C, p + s * nb * sbytes, xq.data(), xs, y.data() + strip * s, R);
#else
            if (NB == 1) mskq_dot_p45x8<1>(C, p + s * nb * sbytes, xq.data(), xs, y.data() + strip * s, R);
            else mskq_dot_p45x8<8>(C, p + s * nb * sbytes, xq.data(), xs, y.data() + strip * s, R);
#endif
        }
    });
#endif
}

int main(int argc, char **argv) {
    std::mt19937 rng(1);
    rate(argc > 1 ? std::atol(argv[1]) : 512, 2048, argc > 2 && std::atoi(argv[2]) == 8, rng);
}
