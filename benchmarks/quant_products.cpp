// Products of the 32-weight block types (kernels/quants.h) on one core: GMAC/s of 1, 4 and 8
// activation rows against a weight matrix held in L2, for the shapes of the embedded model
// (576 columns: a last group of 2 blocks) and widths that end in each kind of last group.
// Random valid blocks (finite fp16 scales), so the figures are the kernels' own; the bits are
// held by tests/product_digests.py, not here.
//
//   c++ -O3 -std=c++17 -march=native -ffp-contract=off benchmarks/quant_products.cpp -o /tmp/qp
//   taskset -c 1 /tmp/qp            (-march=x86-64-v3: the AVX2 build; add -DMSQ_PREFETCH=N to try a distance)
//
// Before and after a change to quants.h: build this file against both versions (for example
// with `-include OLD/quants.h`, whose include guard then wins) and run them in turn.
#include "../miniserve/runners/kernels/quants.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

static uint16_t half(float f) {  // float -> IEEE half (normal range, round to nearest)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000u;
    int e = (int)((u >> 23) & 0xff) - 127 + 15;
    if (e <= 0) return (uint16_t)sign;
    const uint32_t m = u & 0x7fffff;
    uint32_t h = sign | ((uint32_t)e << 10) | (m >> 13);
    if ((m & 0x1fff) > 0x1000 || ((m & 0x1fff) == 0x1000 && (h & 1))) h++;
    return (uint16_t)h;
}

template <int K, int NB>
static double rate(long R, long C, std::mt19937 &rng) {
    const int B = MsqT<K>::BYTES;
    const long wrow = C / 32 * B;
    std::uniform_real_distribution<float> U(-1, 1);
    std::vector<uint8_t> w(R * wrow);
    for (size_t i = 0; i < w.size(); i += B) {
        for (int k = 0; k < B; k++) w[i + k] = rng() & 0xff;
        const uint16_t d = half(U(rng) * 0.02f), m = half(U(rng) * 0.1f);
        std::memcpy(&w[i], &d, 2);
        if (MsqT<K>::MIN) std::memcpy(&w[i + 2], &m, 2);
    }
    const long xs = (C + 255) / 256 * sizeof(ms_a8g);
    std::vector<char> xq(NB * xs);
    std::vector<float> x(C), y(NB * R);
    for (int j = 0; j < NB; j++) {
        for (auto &v : x) v = U(rng);
        ms_quantize_a8(x.data(), (ms_a8g *)(xq.data() + j * xs), C);
    }
    auto run = [&] {
        for (long r = 0; r < R; r++) msq_dot<K, NB>(C, w.data() + r * wrow, xq.data(), xs, y.data() + r, R);
    };
    run();
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        const int it = 200;
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < it; i++) run();
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::max(best, (double)R * C * NB * it / s / 1e9);
    }
    return best;
}

template <int K>
static void type(const char *name, std::mt19937 &rng) {
    // rows x columns: SmolLM2's up (last group: 2 blocks) and down projections, then widths
    // whose last group holds 1, 3, 4 and 8 blocks
    const long shapes[][2] = {{1536, 576}, {576, 1536}, {1536, 544}, {1536, 608}, {1536, 640}, {1536, 512}};
    for (auto &s : shapes)
        std::printf("%s %5ld x %-5ld  8 rows %6.1f  4 rows %6.1f  1 row %6.1f GMAC/s\n", name, s[0], s[1],
                    rate<K, 8>(s[0], s[1], rng), rate<K, 4>(s[0], s[1], rng), rate<K, 1>(s[0], s[1], rng));
}

int main() {
    std::mt19937 rng(1);
#if defined(MSQ_AVX512)
    std::printf("build: AVX-512 loops\n");
#elif defined(MSQ_AVX2)
    std::printf("build: AVX2 loops\n");
#else
    std::printf("build: plain loops\n");
#endif
    type<MSQ_Q4_1>("Q4_1", rng);
    type<MSQ_Q8_0>("Q8_0", rng);
}
