// One activation row against Q4_K weight rows (kernels/kquants.h, the decode of one stream) on
// one core: GB/s of weights and GMAC/s, for a matrix held in L2 (512 x 2048), one past it
// (2048 x 2048) and one past L2 and most of L3's share (8192 x 2048). Random blocks (finite
// fp16 scales); the bits are held by tests/product_digests.py, not here.
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

static void rate(long R, long C, std::mt19937 &rng) {
    std::uniform_real_distribution<float> U(-1, 1);
    const long wrow = C / 256 * 144;
    std::vector<uint8_t> w(R * wrow);
    for (size_t i = 0; i < w.size(); i += 144) {
        for (int k = 0; k < 144; k++) w[i + k] = rng() & 0xff;
        const uint16_t d = half(U(rng) * 0.01f), m = half(U(rng) * 0.01f);
        std::memcpy(&w[i], &d, 2);
        std::memcpy(&w[i + 2], &m, 2);
    }
    std::vector<float> x(C), y(R);
    for (auto &v : x) v = U(rng);
    std::vector<ms_a8k> xq(C / 256);
    ms_quantize_a8k(x.data(), xq.data(), C);
    auto run = [&] {
        for (long r = 0; r < R; r++) ms_dot_q4_K<1>(C, w.data() + r * wrow, xq.data(), 0, y.data() + r, 1);
    };
    run();
    double best = 1e9;
    for (int rep = 0; rep < 7; rep++) {
        const int it = 8192 * 64 / R;
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < it; i++) run();
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / it);
    }
    std::printf("Q4_K, 1 row, %5ld x %ld (%5ld KB): %5.1f GB/s of weights, %5.1f GMAC/s\n", R, C,
                R * wrow >> 10, R * wrow / best / 1e9, R * C / best / 1e9);
}

int main(int argc, char **argv) {
    std::mt19937 rng(1);
    rate(argc > 1 ? std::atol(argv[1]) : 512, 2048, rng);
}
