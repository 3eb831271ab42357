// The native forward pass of a Llama-family or Gemma 3 model on the CPU: any number of rows
// (tokens) in one call, each row with its own sequence, position and KV cache -- the decode rows
// of every running sequence and chunks of waiting prompts, all in one pass
// (miniserve/scheduler.py).
//
// The same computation as miniserve/lean.py (read that first; this file mirrors it), written
// as plain loops:
//
//   per row:     x = embed[token]
//   per layer:   x += Wo . attention(rope(Wqkv . rmsnorm(x)), this row's KV cache)
//                x += W2 . (silu(gate) * up),  gate|up = W13 . rmsnorm(x)
//   rows asked:  logits = Wlm . rmsnorm(x)
//
// Gemma 3 adds, where its weights are given (MsLayer): the embeddings scaled, q and k
// RMS-normed per head before RoPE, each branch's output RMS-normed before the residual sum,
// GELU (tanh) for SiLU, its own attention scale, and local layers that attend to a window of
// the last positions with RoPE tables of their own. Its norms' 1 + w is computed once, in
// lean.py: here every norm is weight * x / rms(x), with float32 weights.
//
// Batch invariance, by construction. Every number a row produces is computed by the same
// instructions in the same order whatever else is in the pass and however its prompt was cut
// into chunks: a dot product of a weight row and an activation row is one vector accumulator
// over the columns, reduced in one fixed way, whichever tile of rows it is computed in; a
// row's attention runs over fixed blocks of BLOCK positions (counted from position 0), each
// block's partial softmax computed alone, the blocks merged in order -- never a split that
// depends on the thread count or the batch. Library matrix products promise none of this.
// So a sequence yields the same tokens alone, beside seven others, or prefilled in pieces.
//
// Arithmetic (MsModel.math): 0 = float32 products and sums; 1 = bfloat16: the activations
// entering a matrix product are rounded to bfloat16 and the products summed in float32 -- with
// AVX512_BF16's vdpbf16ps where the CPU has it (two products per lane per instruction, no
// widening of the weights), else in the float32 loops on the rounded values. Weights are
// float32 or bfloat16; the residual stream, norms, RoPE, softmax and the KV cache are float32.
//
// KV cache, per sequence: K as (layers, kv_heads, capacity / 16, head_dim, 16) -- keys in tiles
// of 16 positions, transposed, so that 16 scores are one vector accumulated over head_dim
// with no horizontal sums -- and V as (layers, kv_heads, capacity, head_dim).
//
// Threads: a small pool of our own (the calling thread plus threads-1 helpers) runs the matrix
// products split by output rows, and attention as a list of (row, head, block) items. Not
// OpenMP: once two Python threads have used PyTorch's OpenMP pool, each parallel region wakes
// its threads through the kernel, which measured 30% slower per token here.
//
// Built at first use by miniserve/native.py with the system C++ compiler (-O3 and, by default,
// -march=native). Three versions of the inner loops, chosen when compiling: AVX-512 (16 floats
// a vector), AVX2 + FMA (8 floats), and plain loops written for the compiler to vectorize on
// any target (SSE2, NEON). ms_isa() says which one was built, ms_bf16_dot() whether vdpbf16ps
// was. -ffp-contract=off: the compiler may not fuse a multiply and an add on its own, which it
// could do differently where the same function is inlined twice.

#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <string>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define MS_BF16_DOT 1
#else
#define MS_BF16_DOT 0
#endif

typedef uint16_t bf16;

static inline float bf16_to_float(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

static inline float load(const float *p, long i) { return p[i]; }
static inline float load(const bf16 *p, long i) { return bf16_to_float(p[i]); }

// ---------------------------------------------------------------- the thread pool

class Pool {
  public:
    typedef void (*Fn)(void *ctx, int t, int n);

    explicit Pool(int helpers) {
        for (int i = 0; i < helpers; i++) threads_.emplace_back([this, i] { serve(i + 1); });
    }
    int size() const { return (int)threads_.size() + 1; }

    // Runs fn(ctx, t, n) for t = 0..n-1 (n = size()), t = 0 on the calling thread; returns
    // when all are done.
    void run(Fn fn, void *ctx) {
        int n = size();
        if (n <= 1) return fn(ctx, 0, 1);
        std::lock_guard<std::mutex> one_at_a_time(run_mutex_);  // callers on other threads wait
        fn_ = fn;
        ctx_ = ctx;
        n_ = n;
        pending_.store(n - 1, std::memory_order_relaxed);
        {
            std::lock_guard<std::mutex> lock(mutex_);
            generation_.fetch_add(1, std::memory_order_release);
        }
        if (sleepers_.load(std::memory_order_acquire) > 0) wake_.notify_all();
        fn(ctx, 0, n);
        while (pending_.load(std::memory_order_acquire) != 0) pause();
    }

  private:
    static inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        asm volatile("yield");
#endif
    }

    void serve(int t) {
        uint64_t seen = 0;
        for (;;) {
            // Spin for up to ~100 us (the Python between two passes takes ~0.1-1 ms per sequence);
            // past that the step is over and the core is better left to others.
            uint64_t g = generation_.load(std::memory_order_acquire);
            auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(100);
            for (long spins = 1; g == seen; spins++) {
                pause();
                g = generation_.load(std::memory_order_acquire);
                if (spins % 64 == 0 && std::chrono::steady_clock::now() > until) break;
            }
            if (g == seen) {  // no work for a while: sleep until the next step
                std::unique_lock<std::mutex> lock(mutex_);
                sleepers_.fetch_add(1);
                wake_.wait(lock, [&] { return generation_.load() != seen; });
                sleepers_.fetch_sub(1);
                g = generation_.load(std::memory_order_acquire);
            }
            seen = g;
            if (t < n_) {
                fn_(ctx_, t, n_);
                pending_.fetch_sub(1, std::memory_order_acq_rel);
            }
        }
    }

    std::vector<std::thread> threads_;
    std::atomic<uint64_t> generation_{0};
    std::atomic<int> pending_{0}, sleepers_{0};
    std::mutex mutex_, run_mutex_;
    std::condition_variable wake_;
    Fn fn_ = nullptr;
    void *ctx_ = nullptr;
    int n_ = 1;
};

// Made at the first call with that call's thread count, never destroyed (the helpers end with
// the process).
static Pool *pool_for(int threads) {
    static Pool *pool = new Pool(threads > 1 ? threads - 1 : 0);
    return pool;
}

// parallel(threads, [&](int t, int n) { ... }): the lambda runs once on each of n threads.
template <typename F>
static void parallel(int threads, F &&f) {
    typedef typename std::remove_reference<F>::type Lambda;
    pool_for(threads)->run(
        [](void *ctx, int t, int n) { (*static_cast<Lambda *>(ctx))(t, n); }, &f);
}


// ---------------------------------------------------------------- vector helpers

#if defined(__AVX512F__)
// The lanes of a 16-lane step with `left` >= 0 numbers still to go: all 16, or the first `left`.
static inline __mmask16 lanes16(long left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

static inline __m512 load16(const bf16 *p) {  // 16 bfloat16 -> 16 float32: widen, shift left
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The sum of a vector's 16 lanes: the two halves of 8 added, then of 4, then lanes 0 + 2 and
// 1 + 3, then the last two -- GCC's _mm512_reduce_add_ps, written out, since other compilers'
// headers leave the order of that reduction open (and batch invariance needs one order).
static inline float reduce1(__m512 a) {
    __m256 h = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)),
                             _mm512_castps512_ps256(a));
    __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
    __m128 p = _mm_add_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, _MM_SHUFFLE(1, 1, 1, 1))));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8(const bf16 *p) {  // 8 bfloat16 -> 8 float32: widen, shift left
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline __m256 wload8(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 wload8(const bf16 *p) { return load8(p); }

// The sum of the 8 lanes, always in the same order: halves, then pairs, then the last two.
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

// The loops the vector paths fall back to, for the shapes they skip, and the whole of the work
// on CPUs without AVX2: eight sums over columns in blocks of eight, added in a fixed order at
// the end, then the columns past the last block. The compiler vectorizes these without
// -ffast-math (which it may not do for a single running sum: that would reorder its
// additions); eight lanes are two SSE or NEON vectors.
static inline float sum8(const float *a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

template <typename W>
static inline float row_dot(const W *row, const float *x, long cols) {
    const long body = cols / 8 * 8;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (long c = 0; c < body; c += 8)
        for (int k = 0; k < 8; k++) acc[k] += load(row, c + k) * x[c + k];
    float total = sum8(acc);
    for (long c = body; c < cols; c++) total += load(row, c) * x[c];
    return total;
}

// ---------------------------------------------------------------- attention

#if defined(__AVX512F__)
// e^x for 16 floats (Cephes' expf: x = n ln2 + r, e^r by a degree-6 polynomial, 1-2 ulp).
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)),
                      _mm512_set1_ps(-103.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);  // p * 2^n, flushing to 0 below the float range
}
#elif defined(__AVX2__) && defined(__FMA__)
// e^x for 8 floats: exp16's arithmetic on 8 lanes.
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)),
                      _mm256_set1_ps(-103.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    // p * 2^n without scalef: n is in [-149, 128], past the exponents a float can hold
    // (-126..127), so in two factors 2^(n/2) and 2^(n - n/2) that it can. The first product is
    // exact; the second rounds once, as scalef does, to a subnormal, 0 or infinity at the ends.
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
#endif

static inline void axpy(float *y, float a, const float *x, long n) {  // y += a x
#if defined(__AVX512F__)
    if (n % 16 == 0) {
        __m512 av = _mm512_set1_ps(a);
        for (long i = 0; i < n; i += 16)
            _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i),
                                                    _mm512_loadu_ps(y + i)));
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (n % 8 == 0) {
        __m256 av = _mm256_set1_ps(a);
        for (long i = 0; i < n; i += 8)
            _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i),
                                                    _mm256_loadu_ps(y + i)));
        return;
    }
#endif
    const long body = n / 8 * 8;  // blocks of eight (vectorized), then the rest
    for (long i = 0; i < body; i += 8)
        for (int k = 0; k < 8; k++) y[i + k] += a * x[i + k];
    for (long i = body; i < n; i++) y[i] += a * x[i];
}

// s[j] = e^(s[j] - top) for j < n; returns their sum.
static inline float exp_shifted(float *s, long n, float top) {
    long j = 0;
    float total = 0.f;
#if defined(__AVX512F__)
    __m512 sum = _mm512_setzero_ps(), topv = _mm512_set1_ps(top);
    for (; j < n; j += 16) {
        __mmask16 m = lanes16(n - j);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), topv));
        _mm512_mask_storeu_ps(s + j, m, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
    }
    total = reduce1(sum);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 sum = _mm256_setzero_ps(), topv = _mm256_set1_ps(top);
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), topv));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (j < n) {  // the last 1-7: lanes j.. below n, loaded and stored under a mask
        __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - j)),
                                       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 e = exp8(_mm256_sub_ps(_mm256_maskload_ps(s + j, m), topv));
        _mm256_maskstore_ps(s + j, m, e);
        sum = _mm256_add_ps(sum, _mm256_and_ps(e, _mm256_castsi256_ps(m)));
        j = n;
    }
    total = hsum8(sum);
#endif
    for (; j < n; j++) total += (s[j] = std::exp(s[j] - top));
    return total;
}


// The largest of n floats (NaNs passed over; -inf for none), a vector's lanes at a time: the
// same number as the scalar scan, as max is exact (and max_ps(v, top) keeps top where v is a NaN,
// as the scan does).
static inline float max_of(const float *p, long n) {
    long j = 0;
    float top = -INFINITY;
#if defined(__AVX512F__)
    __m512 t = _mm512_set1_ps(-INFINITY);
    for (; j < n; j += 16) {
        const __mmask16 m = lanes16(n - j);
        t = _mm512_max_ps(_mm512_mask_loadu_ps(t, m, p + j), t);
    }
    top = _mm512_reduce_max_ps(t);
#elif defined(__AVX2__)
    __m256 t = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= n; j += 8) t = _mm256_max_ps(_mm256_loadu_ps(p + j), t);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    top = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#endif
    for (; j < n; j++) top = p[j] > top ? p[j] : top;
    return top;
}

// ---------------------------------------------------------------- matrix products, many rows

// y[b, r] = sum_c w[r, c] x[b, c]. One canonical order per (weight row, activation row) pair
// and build, whatever tile computes it:
//   AVX-512, float32 products (cols % 16 == 0): one 16-lane accumulator over the columns,
//     acc = fma(w[c..c+16), x[c..c+16), acc), then reduce1;
//   AVX-512 + AVX512_BF16, bfloat16 products (bf16 weights, cols % 32 == 0): one accumulator,
//     acc = vdpbf16ps(acc, x[c..c+32), w[c..c+32)), then reduce1;
//   AVX2 (cols % 8 or 16 == 0): two 8-lane accumulators taking alternate blocks of 8, added,
//     then hsum8;
//   otherwise: row_dot's eight running sums.
// Tiles (4 weight rows x 4 activation rows: each weight vector loaded once for four rows of
// activations, each activation vector once for four weight rows) only change how many such
// sums run side by side, never the order inside one.

#if defined(__AVX512F__)
static inline __m512 wload16(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 wload16(const bf16 *p) { return load16(p); }

// How far ahead of a weight row's loads the one-row loops prefetch. Measured on single-stream
// decoding (AMD EPYC Zen 4, 2 cores; bfloat16 weights): the bfloat16 dot loop takes a 64-byte
// line per iteration, too fast for 1 KB ahead (89 tokens/s); 4 KB: 102, 8 KB: 104; the float32
// loop, half a line per iteration, ~100 from 1 KB on.
static const long PREFETCH_AHEAD = 4096;
// Below this many activation rows a product is bound by reading the weights: one weight row at
// a time against up to 8 activation rows (several weight rows streamed side by side measured
// slower here: 17-20 GB/s against 25-35); from it on, 4x4 tiles over blocks of 64 rows.
#ifndef FEW_ROWS
#define FEW_ROWS 32
#endif

// The sums of the lanes of 16 vectors, each added exactly as reduce1 adds one --
// the two halves of 8, then of 4, then pairs, then the last two; which operand is on which
// side of an addition changes no bit -- but side by side, about a third of the instructions.
// a[j * 4 + i] -> y[j * ldy + i], for i, j < 4.
static inline void reduce16(const __m512 *a, float *y, long ldy) {
    __m512 u[8], v[4], t[4];
    for (int k = 0; k < 8; k++)  // 8 + 8 lanes: a[2k]'s and a[2k+1]'s halves added
        u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                             _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)));
    for (int k = 0; k < 4; k++)  // 4 lanes each of a[4k .. 4k+3]
        v[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                             _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)));
    for (int k = 0; k < 4; k++)  // lanes 0 + 2 and 1 + 3
        t[k] = _mm512_add_ps(v[k], _mm512_permute_ps(v[k], _MM_SHUFFLE(1, 0, 3, 2)));
    __m512 f[2];
    for (int k = 0; k < 2; k++) {  // the last two
        __m512 w = _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0));
        f[k] = _mm512_add_ps(w, _mm512_permute_ps(w, _MM_SHUFFLE(2, 3, 0, 1)));
    }
    // f[0]: a[j] in lane 4j, a[4 + j] in lane 4j + 2; f[1]: a[8 + j], a[12 + j] likewise
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 16, 20, 24, 28, 18, 22,
                                            26, 30);
    __m512 r = _mm512_permutex2var_ps(f[0], order, f[1]);
    _mm_storeu_ps(y, _mm512_extractf32x4_ps(r, 0));
    _mm_storeu_ps(y + ldy, _mm512_extractf32x4_ps(r, 1));
    _mm_storeu_ps(y + 2 * ldy, _mm512_extractf32x4_ps(r, 2));
    _mm_storeu_ps(y + 3 * ldy, _mm512_extractf32x4_ps(r, 3));
}

// A tile's NR x NB sums out: y[j * ldy + i] = the sum of acc[i][j]'s lanes.
template <int NR, int NB>
static inline void store_sums(__m512 (&acc)[NR][NB], float *y, long ldy) {
    if (NR == 4 && NB == 4) {
        __m512 a[16];
        for (int i = 0; i < NR; i++)
            for (int j = 0; j < NB; j++) a[j * 4 + i] = acc[i][j];
        return reduce16(a, y, ldy);
    }
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < NB; j++) y[j * ldy + i] = reduce1(acc[i][j]);
}

template <typename W, int NR, int NB>
static inline void tile16(const W *w, long cols, const float *x, long ldx, float *y, long ldy) {
    __m512 acc[NR][NB];
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    for (long c = 0; c < cols; c += 16) {
        __m512 wv[NR];
        for (int i = 0; i < NR; i++) {
            if ((c * sizeof(W)) % 64 == 0)  // streaming: a prefetch per line
                _mm_prefetch((const char *)(w + i * cols + c) + PREFETCH_AHEAD, _MM_HINT_T0);
            wv[i] = wload16(w + i * cols + c);
        }
        for (int j = 0; j < NB; j++) {
            __m512 xv = _mm512_loadu_ps(x + j * ldx + c);
            for (int i = 0; i < NR; i++) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
        }
    }
    store_sums<NR, NB>(acc, y, ldy);
}
#endif

#if MS_BF16_DOT
template <int NR, int NB>
static inline void tile32bh(const bf16 *w, long cols, const bf16 *x, long ldx, float *y,
                            long ldy) {
    __m512 acc[NR][NB];
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    for (long c = 0; c < cols; c += 32) {
        __m512bh wv[NR];
        for (int i = 0; i < NR; i++) {
            _mm_prefetch((const char *)(w + i * cols + c) + PREFETCH_AHEAD, _MM_HINT_T0);
            wv[i] = (__m512bh)_mm512_loadu_si512((const void *)(w + i * cols + c));
        }
        for (int j = 0; j < NB; j++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + j * ldx + c));
            for (int i = 0; i < NR; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[i]);
        }
    }
    store_sums<NR, NB>(acc, y, ldy);
}
#endif

// The canonical float32-product dot of one weight row and one activation row (see above).
template <typename W>
static inline float dot1(const W *w, const float *x, long cols) {
#if defined(__AVX512F__)
    if (cols % 16 == 0) {
        float y;
        tile16<W, 1, 1>(w, cols, x, 0, &y, 0);
        return y;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const long step = std::is_same<W, bf16>::value ? 16 : 8;
    if (cols % step == 0) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        long c = 0;
        for (; c + 16 <= cols; c += 16) {
            if (std::is_same<W, bf16>::value)
                _mm_prefetch((const char *)(w + c) + 1024, _MM_HINT_T0);
            a0 = _mm256_fmadd_ps(wload8(w + c), _mm256_loadu_ps(x + c), a0);
            a1 = _mm256_fmadd_ps(wload8(w + c + 8), _mm256_loadu_ps(x + c + 8), a1);
        }
        if (c < cols) a0 = _mm256_fmadd_ps(wload8(w + c), _mm256_loadu_ps(x + c), a0);
        return hsum8(_mm256_add_ps(a0, a1));
    }
#endif
    return row_dot(w, x, cols);
}

#if defined(__AVX512F__)
// The order tiles are taken in, for one thread's output rows [r0, r1) and activation rows
// [0, B): below FEW_ROWS rows one weight row at a time against blocks of 8, 4 and 1 rows;
// from it on, activation rows in blocks of 64 (kept in the L2 cache while the thread's weight
// rows stream past), 4x4 tiles and their remainders. tile.run<NR, NB>(r, b) computes one.
template <typename Tiles>
static void tile_loops(const Tiles &tile, long B, long r0, long r1) {
    if (B < FEW_ROWS) {
        for (long r = r0; r < r1; r++) {
            long b = 0;
            for (; b + 8 <= B; b += 8) tile.template run<1, 8>(r, b);
            for (; b + 4 <= B; b += 4) tile.template run<1, 4>(r, b);
            for (; b < B; b++) tile.template run<1, 1>(r, b);
        }
        return;
    }
    const long XB = 64;
    for (long b0 = 0; b0 < B; b0 += XB) {
        long b1 = b0 + XB < B ? b0 + XB : B, r = r0;
        for (; r + 4 <= r1; r += 4) {
            long b = b0;
            for (; b + 4 <= b1; b += 4) tile.template run<4, 4>(r, b);
            for (; b < b1; b++) tile.template run<4, 1>(r, b);
        }
        for (; r < r1; r++)
            for (long b = b0; b < b1; b++) tile.template run<1, 1>(r, b);
    }
}

template <typename W>
struct Float32Tiles {  // float32 products: weight rows of W, activation rows of float
    const W *w;
    const float *x;
    float *y;
    long R, C;
    template <int NR, int NB>
    void run(long r, long b) const {
        tile16<W, NR, NB>(w + r * C, C, x + b * C, C, y + b * R + r, R);
    }
};
#endif

#if MS_BF16_DOT
struct Bf16DotTiles {  // bfloat16 products on vdpbf16ps
    const bf16 *w, *x;
    float *y;
    long R, C;
    template <int NR, int NB>
    void run(long r, long b) const {
        tile32bh<NR, NB>(w + r * C, C, x + b * C, C, y + b * R + r, R);
    }
};
#endif

// One thread's share: output rows [r0, r1) for activation rows [0, B), written to y[b * ldy + r].
// x: float rows; xb: the same rows in bfloat16 (bfloat16 products) or null.
template <typename W>
static void matmul_part(const W *w, const float *x, const bf16 *xb, float *y, long B, long ldy,
                        long C, long r0, long r1) {
#if MS_BF16_DOT
    if (xb != nullptr && std::is_same<W, bf16>::value && C % 32 == 0)
        return tile_loops(Bf16DotTiles{(const bf16 *)w, xb, y, ldy, C}, B, r0, r1);
#endif
    (void)xb;
#if defined(__AVX512F__)
    if (C % 16 == 0) return tile_loops(Float32Tiles<W>{w, x, y, ldy, C}, B, r0, r1);
#endif
    for (long r = r0; r < r1; r++)
        for (long b = 0; b < B; b++) y[b * ldy + r] = dot1(w + r * C, x + b * C, C);
}

// Rounds to the nearest bfloat16 (ties to even): xr the value as a float, xb its 16 bits.
static inline void round_bf16(const float *x, float *xr, bf16 *xb, long n) {
    for (long i = 0; i < n; i++) {
        uint32_t u;
        std::memcpy(&u, &x[i], 4);
        u += 0x7fffu + ((u >> 16) & 1u);
        u &= 0xffff0000u;
        std::memcpy(&xr[i], &u, 4);
        xb[i] = (bf16)(u >> 16);
    }
}

// ---------------------------------------------------------------- weights as stored

// A GGUF file's tensors are used in place, in their own block formats (ggml's type ids; the
// block layouts are ggml-common.h's): quants.h holds the types of 32-weight blocks (Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0, IQ4_NL) and F16, kquants.h the K-quants of 256-weight super-blocks (Q2_K, Q3_K,
// Q4_K, Q5_K, Q6_K), IQ4_XS and the lattice types (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
// IQ3_S). Each activation row entering such a product is quantized once per product to int8
// blocks (ms_a8g groups for the 32-weight types, ms_a8k for the K-quants), then every weight row is an
// integer dot product per block, the blocks' results combined in one fixed order. That order
// is the same whichever number of activation rows (1, 4 or 8) a kernel call takes, so a row's
// result does not depend on what shares its pass (batch invariance, as above).
#include "quants.h"
#include "kquants.h"
#include "amx.h"

enum MsTypeId {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23,
    T_IQ2_XXS = 16, T_IQ2_XS = 17, T_IQ3_XXS = 18, T_IQ1_S = 19, T_IQ3_S = 21, T_IQ2_S = 22, T_IQ1_M = 29,
    T_BF16 = 30,
    // not ggml types: a matrix repacked at load (ms_pack). Q4_K 16 rows at a time for the
    // AVX-512 build (kquants.h's mskq_p45), 8 for the AVX2 one (mskq_p45x8); Q5_K 16 rows at a
    // time for the AVX-512 build (mskq_p5), 8 for the AVX2 one (mskq_p5x8); Q6_K 16 rows at a
    // time for the AVX-512 build (mskq_p6), 8 for the AVX2 one (mskq_p6x8); Q3_K, Q2_K and
    // IQ4_XS 16 rows at a time for the AVX-512 build (mskq_p3, mskq_p2, mskq_pxs), 8 for the AVX2
    // one (mskq_p3x8, mskq_p2x8, mskq_pxsx8);
    // a 32-weight type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) T_PACKED_32 + its own id, MSQ_STRIP rows
    // at a time: 16 in the AVX-512 build (quants.h's MsqPacked), 8 in the AVX2 one (MsqPacked8)
    T_Q4_K_P16 = 1012, T_Q4_K_P8 = 1013, T_Q6_K_P16 = 1014, T_Q6_K_P8 = 1015, T_Q5_K_P16 = 1016,
    T_IQ4_XS_P16 = 1017, T_Q3_K_P16 = 1018, T_Q2_K_P16 = 1019, T_Q5_K_P8 = 1020, T_Q3_K_P8 = 1021,
    T_Q2_K_P8 = 1022, T_IQ4_XS_P8 = 1023,
    T_PACKED_32 = 2000
};

// What the activations of a product over weights of a type are: float rows, or quantized.
enum Act { ACT_FLOAT = 0, ACT_A8 = 1, ACT_A8K = 2 };

typedef void (*DotFn)(long n, const void *w, const void *x, long xstride, float *y, long ystride);
typedef void (*DequantFn)(const void *w, float *y, long n);
typedef void (*UnpackFn)(long n, const void *w, void *out);
typedef void (*DotRFn)(long n, const void *w, long wrow, const void *x, long xstride, float *y,
                       long ystride);
typedef void (*TileFn)(long n, const void *w, long wrow, void *out);
typedef void (*DotUFn)(long n, const void *w, const void *x, long xstride, float *y, long ystride,
                       float *state, int phase);

struct Kernels {
    long block, bytes;  // weights a block holds, its bytes
    Act act;
    DotFn dot1, dot2, dot4, dot8;  // against 1, 2, 4 or 8 activation rows
    DequantFn dequant;       // one row to floats
    // where a type has them: a row's blocks unpacked once (ubytes each) for many activation
    // rows, and the products from such a row, whole or in pieces (the same bits as dot4 / dot8)
    long ubytes;
    UnpackFn unpack;
    DotUFn dot4u, dot8u;
    // where a type has it: 8 weight rows (wrow bytes apart) against 8 activation rows at once,
    // the same bits as dot8 over each of the 8 rows
    DotRFn dot8r = nullptr;
    // where a type has them: 16 weight rows (wrow bytes apart) laid out once as tiles (tbytes a
    // block), and the products of such a tile row against 1, 4 or 8 activation rows (the same
    // bits as dot1 / dot4 / dot8 over each of the 16 rows)
    TileFn tile = nullptr;
    long tbytes = 0;
    DotUFn tdot1 = nullptr, tdot4 = nullptr, tdot8 = nullptr;
    long tmin = 0;  // from this many activation rows (fewer: the one-off layout costs more than it saves)
    // weight rows a dot call covers: 1, or a packed type's strip (16, AVX2: 8), whose dot1 ..
    // dot8 take a strip's rows (y[j * ystride + r], r < strip), addressed only at multiples of
    // the strip (row r's strip at r * bytes-a-row, as for the rows as stored). Such a type has
    // no row decoder (dequant): only matrices that are multiplied are packed (a layer's, the
    // output layer), never a looked-up table (a tied embedding's rows stay as stored).
    long strip = 1;
    // a packed type's packer: a strip's stored rows (the first at w, wrow bytes apart, n weights
    // each) into its packed blocks (ms_pack)
    TileFn pack = nullptr;
};

#define MS_KERNELS(block, bytes, act, t) \
    {block, bytes, act, ms_dot_##t<1>, ms_dot_##t<2>, ms_dot_##t<4>, ms_dot_##t<8>, ms_dequant_##t, 0, nullptr, nullptr, nullptr}
#if defined(MSKQ_AVX512)
#define MS_KERNELS_U(block, bytes, act, t, u)                                                      \
    {block, bytes, act, ms_dot_##t<1>, ms_dot_##t<2>, ms_dot_##t<4>, ms_dot_##t<8>, ms_dequant_##t,               \
     (long)sizeof(u), ms_unpack_##t, ms_dotu_##t<4>, ms_dotu_##t<8>}
// ... and tiles: their struct `tu`, their products `tdot`, from `tmin` activation rows
#define MS_KERNELS_T(block, bytes, act, t, u, tu, tdot, tmin)                                      \
    {block, bytes, act, ms_dot_##t<1>, ms_dot_##t<2>, ms_dot_##t<4>, ms_dot_##t<8>, ms_dequant_##t,               \
     (long)sizeof(u), ms_unpack_##t, ms_dotu_##t<4>, ms_dotu_##t<8>, nullptr, ms_tile_##t,          \
     (long)sizeof(tu), tdot<1>, tdot<4>, tdot<8>, tmin}
#elif defined(MSKQ_AVX2)
static const DotRFn ms_dot8r_q6_K = nullptr;  // Q6_K: no 8-weight-row form (yet)
#define MS_KERNELS_U(block, bytes, act, t, u)                                                      \
    {block, bytes, act, ms_dot_##t<1>, ms_dot_##t<2>, ms_dot_##t<4>, ms_dot_##t<8>, ms_dequant_##t, 0, nullptr,   \
     nullptr, nullptr, ms_dot8r_##t}
#define MS_KERNELS_T(block, bytes, act, t, u, tu, tdot, tmin) MS_KERNELS_U(block, bytes, act, t, u)
#else
#define MS_KERNELS_U(block, bytes, act, t, u) MS_KERNELS(block, bytes, act, t)
#define MS_KERNELS_T(block, bytes, act, t, u, tu, tdot, tmin) MS_KERNELS_U(block, bytes, act, t, u)
#endif

// A lattice type (IQ1/IQ2/IQ3, kquants.h's MskqIq): in the vector builds its rows are built
// once into registers' memory for many activation rows (qmatmul_unpacked, no tiles)
#if defined(MSKQ_SIMD)
#define MS_KERNELS_IQ(bytes, t)                                                                    \
    {256, bytes, ACT_A8K, ms_dot_##t<1>, ms_dot_##t<2>, ms_dot_##t<4>, ms_dot_##t<8>, ms_dequant_##t,      \
     (long)sizeof(MskqIqU), ms_unpack_##t, mskq_dotu_iq<4>, mskq_dotu_iq<8>}
#else
#define MS_KERNELS_IQ(bytes, t) MS_KERNELS(256, bytes, ACT_A8K, t)
#endif

// A K-quant (or IQ4_XS) packed S rows a strip (struct P), every product on its strips with the
// strips' own loop (no tiles), laid out by `packer`.
#define MS_KERNELS_STRIPS(P, S, dot, packer)                                                       \
    [] {                                                                                           \
        Kernels k = {256, (long)sizeof(P) / S, ACT_A8K, dot<1>, dot<2>, dot<4>, dot<8>, nullptr, 0,   \
                     nullptr, nullptr, nullptr};                                                   \
        k.strip = S;                                                                               \
        k.pack = packer;                                                                           \
        return k;                                                                                  \
    }()

// The kernels of a quantized (or F16) type; null for F32, BF16 (the float loops above) and
// the types we do not run in place.
static const Kernels *kernels_for(long type) {
    static const Kernels q4_0 = MS_KERNELS(32, 18, ACT_A8, q4_0),
                         q4_1 = MS_KERNELS(32, 20, ACT_A8, q4_1),
                         q5_0 = MS_KERNELS(32, 22, ACT_A8, q5_0),
                         q5_1 = MS_KERNELS(32, 24, ACT_A8, q5_1),
                         q8_0 = MS_KERNELS(32, 34, ACT_A8, q8_0),
                         q4_k = MS_KERNELS_T(256, 144, ACT_A8K, q4_K, mskq_u45, mskq_t45, mskq_tile45_dot, 8),
                         q5_k = MS_KERNELS_T(256, 176, ACT_A8K, q5_K, mskq_u45, mskq_t45, mskq_tile45_dot, 8),
                         q6_k = MS_KERNELS_T(256, 210, ACT_A8K, q6_K, mskq_u6, mskq_t6, mskq_tile6_dot, 16),
                         q3_k = MS_KERNELS(256, 110, ACT_A8K, q3_K),
                         q2_k = MS_KERNELS(256, 84, ACT_A8K, q2_K),
                         iq4_nl = MS_KERNELS(32, 18, ACT_A8, iq4_nl),
                         iq4_xs = MS_KERNELS(256, 136, ACT_A8K, iq4_xs),
                         iq2_xxs = MS_KERNELS_IQ(66, iq2_xxs), iq2_xs = MS_KERNELS_IQ(74, iq2_xs),
                         iq2_s = MS_KERNELS_IQ(82, iq2_s), iq3_xxs = MS_KERNELS_IQ(98, iq3_xxs),
                         iq3_s = MS_KERNELS_IQ(110, iq3_s), iq1_s = MS_KERNELS_IQ(50, iq1_s),
                         iq1_m = MS_KERNELS_IQ(56, iq1_m),
                         f16 = MS_KERNELS(1, 2, ACT_FLOAT, f16);
#if defined(MSKQ_AVX512)
    // A K-quant packed 16 rows a strip (struct P, its products dot<NB>); from 16 activation
    // rows the strips are widened to tiles (struct T, products tdot<NB>) once per chunk
#define MS_KERNELS_P16(P, dot, tile, T, tdot, packer)                                              \
    [] {                                                                                           \
        Kernels k = {256, (long)sizeof(P) / 16, ACT_A8K, dot<1>, dot<2>, dot<4>, dot<8>, nullptr, 0, \
                     nullptr, nullptr, nullptr, nullptr, tile, (long)sizeof(T), tdot<1>, tdot<4>,   \
                     tdot<8>, 16};                                                                 \
        k.strip = 16;                                                                              \
        k.pack = packer;                                                                           \
        return k;                                                                                  \
    }()
    // Q4_K: fewer than 16 activation rows meet the strips as packed (at 8 rows of Qwen3-1.7B's
    // gate matrices, 2 threads: 13.0 ms packed against 18.6 as stored, at 64 rows 81 and 81).
    // Q6_K: a 1B Q4_K_M shape's one-row pass, its Q6_K output layer, down projections and
    // values among it, on a Xeon: 41.7-46.8 -> 37.4-40.8 ms; 8 rows 72-82 -> 81-83 ms: there
    // the strips' loop no faster than the stored rows'.
    static const Kernels q4_k_p16 = MS_KERNELS_P16(mskq_p45, mskq_dot_p45, mskq_tile_p45<false>, mskq_t45,
                                                   mskq_tile45_dot, mskq_pack45_rows),
                         q5_k_p16 = MS_KERNELS_P16(mskq_p5, mskq_dot_p5, mskq_tile_p45<true>, mskq_t45,
                                                   mskq_tile45_dot, mskq_pack5_rows),
                         q6_k_p16 = MS_KERNELS_P16(mskq_p6, mskq_dot_p6, mskq_tile_p6, mskq_t6, mskq_tile6_dot,
                                                   mskq_pack6_rows);
    // IQ4_XS, Q3_K, Q2_K: their strips' own loops for every product (no tiles)
    static const Kernels iq4_xs_p16 = MS_KERNELS_STRIPS(mskq_pxs, 16, mskq_dot_pxs, mskq_pack_xs_rows),
                         q3_k_p16 = MS_KERNELS_STRIPS(mskq_p3, 16, mskq_dot_p3, mskq_pack3_rows),
                         q2_k_p16 = MS_KERNELS_STRIPS(mskq_p2, 16, mskq_dot_p2, mskq_pack2_rows);
    if (type == T_IQ4_XS_P16) return &iq4_xs_p16;
    if (type == T_Q3_K_P16) return &q3_k_p16;
    if (type == T_Q2_K_P16) return &q2_k_p16;
    if (type == T_Q4_K_P16) return &q4_k_p16;
    if (type == T_Q5_K_P16) return &q5_k_p16;
    if (type == T_Q6_K_P16) return &q6_k_p16;
#elif defined(MSKQ_AVX2)
    // Q4_K, Q5_K, Q6_K, Q3_K, Q2_K and IQ4_XS packed: strips of 8 rows (struct P), every
    // product on them (no tiles in this build)
    static const Kernels q4_k_p8 = MS_KERNELS_STRIPS(mskq_p45x8, 8, mskq_dot_p45x8, mskq_pack45x8_rows),
                         q5_k_p8 = MS_KERNELS_STRIPS(mskq_p5x8, 8, mskq_dot_p5x8, mskq_pack5x8_rows),
                         q6_k_p8 = MS_KERNELS_STRIPS(mskq_p6x8, 8, mskq_dot_p6x8, mskq_pack6x8_rows),
                         q3_k_p8 = MS_KERNELS_STRIPS(mskq_p3x8, 8, mskq_dot_p3x8, mskq_pack3x8_rows),
                         q2_k_p8 = MS_KERNELS_STRIPS(mskq_p2x8, 8, mskq_dot_p2x8, mskq_pack2x8_rows),
                         iq4_xs_p8 = MS_KERNELS_STRIPS(mskq_pxsx8, 8, mskq_dot_pxsx8, mskq_pack_xsx8_rows);
    if (type == T_Q2_K_P8) return &q2_k_p8;
    if (type == T_IQ4_XS_P8) return &iq4_xs_p8;
    if (type == T_Q4_K_P8) return &q4_k_p8;
    if (type == T_Q5_K_P8) return &q5_k_p8;
    if (type == T_Q3_K_P8) return &q3_k_p8;
    if (type == T_Q6_K_P8) return &q6_k_p8;
#endif
#if defined(MSQ_AVX512) || defined(MSQ_AVX2)
    // the 32-weight types packed: strips of MSQ_STRIP rows, every product on them (8 activation
    // rows of SmolLM2's 1536 x 576 Q4_1 matrix, one core, in cache, AVX-512: 131 against 82
    // GMAC/s as stored)
#define MS_KERNELS_STRIP(K, bytes)                                                                 \
    [] {                                                                                           \
        Kernels k = {32, bytes, ACT_A8, msq_dot_strip<K, 1>, msq_dot_strip<K, 2>, msq_dot_strip<K, 4>, \
                     msq_dot_strip<K, 8>, nullptr, 0, nullptr, nullptr, nullptr};                 \
        k.strip = MSQ_STRIP;                                                                       \
        k.pack = msq_pack_strip<K, MSQ_STRIP>;                                                     \
        return k;                                                                                  \
    }()
    static const Kernels q4_0_p = MS_KERNELS_STRIP(MSQ_Q4_0, 18), q4_1_p = MS_KERNELS_STRIP(MSQ_Q4_1, 20),
                         q5_0_p = MS_KERNELS_STRIP(MSQ_Q5_0, 22), q5_1_p = MS_KERNELS_STRIP(MSQ_Q5_1, 24),
                         q8_0_p = MS_KERNELS_STRIP(MSQ_Q8_0, 34), iq4_nl_p = MS_KERNELS_STRIP(MSQ_IQ4_NL, 18);
    switch (type - T_PACKED_32) {
        case T_Q4_0: return &q4_0_p;
        case T_Q4_1: return &q4_1_p;
        case T_Q5_0: return &q5_0_p;
        case T_Q5_1: return &q5_1_p;
        case T_Q8_0: return &q8_0_p;
        case T_IQ4_NL: return &iq4_nl_p;
        default: break;
    }
#endif
    switch (type) {
        case T_Q4_0: return &q4_0;
        case T_Q4_1: return &q4_1;
        case T_Q5_0: return &q5_0;
        case T_Q5_1: return &q5_1;
        case T_Q8_0: return &q8_0;
        case T_Q4_K: return &q4_k;
        case T_Q5_K: return &q5_k;
        case T_Q6_K: return &q6_k;
        case T_Q3_K: return &q3_k;
        case T_Q2_K: return &q2_k;
        case T_IQ4_NL: return &iq4_nl;
        case T_IQ4_XS: return &iq4_xs;
        case T_IQ2_XXS: return &iq2_xxs;
        case T_IQ2_XS: return &iq2_xs;
        case T_IQ2_S: return &iq2_s;
        case T_IQ3_XXS: return &iq3_xxs;
        case T_IQ3_S: return &iq3_s;
        case T_IQ1_S: return &iq1_s;
        case T_IQ1_M: return &iq1_m;
        case T_F16: return &f16;
        default: return nullptr;
    }
}

// Bytes of one row of `cols` weights of a type; -1 for a type not run here or a width that
// does not divide into its blocks.
static long row_bytes(long type, long cols) {
    if (type == T_F32) return cols * 4;
    if (type == T_BF16) return cols * 2;
    const Kernels *k = kernels_for(type);
    if (k == nullptr || cols % k->block != 0) return -1;
    return cols / k->block * k->bytes;
}

// Bytes of one activation row of `cols` numbers in a format.
static long act_row_bytes(Act act, long cols) {
    if (act == ACT_A8) return (cols + 255) / 256 * (long)sizeof(ms_a8g);  // groups of 8 blocks
    if (act == ACT_A8K) return (cols + 255) / 256 * (long)sizeof(ms_a8k);
    return cols * (long)sizeof(float);
}

// From this many activation rows a product is compute-bound: K-quant rows are laid out as
// tiles or unpacked once (qmatmul_tiles, qmatmul_unpacked) and weight rows are dealt to the
// threads as they are taken (linear). A type with tiles says from how many rows they pay
// (Kernels::tmin): Q4_K / Q5_K from 8 (8 rows of a 8192x2048 matrix read from memory: 0.86
// against 1.12 ms, Zen 4), Q6_K from 16 (its tiles keep 8 float lanes a row: at 8 rows 1.27
// against 1.07 ms).
static const long MANY_ROWS = 16;

// Whether a product of B activation rows over k's weights runs on tiles (qmatmul_tiles).
static bool tiled(const Kernels *k, long B) { return k->tile != nullptr && B >= k->tmin; }

// One weight row (wr) against activation rows [b, B): 4 at a time, then 2, then 1 (a row's
// product is the same bits whichever takes it), into y[b * ldy].
static inline void few_rows(const Kernels *k, const char *wr, const char *xq, long xs, float *y,
                            long ldy, long C, long b, long B) {
    for (; b + 4 <= B; b += 4) k->dot4(C, wr, xq + b * xs, xs, y + b * ldy, ldy);
    if (b + 2 <= B) k->dot2(C, wr, xq + b * xs, xs, y + b * ldy, ldy), b += 2;
    if (b < B) k->dot1(C, wr, xq + b * xs, xs, y + b * ldy, ldy);
}

// As qmatmul_part (below), for the rows of a tiled share past its last whole 16 (qmatmul_tiles,
// a type whose blocks unpack: the K-quants in the AVX-512 build): a chunk of weight rows is
// unpacked into this thread's buffer (it stays in L2), then each group of 8 (then 4)
// activation rows meets the chunk's unpacked rows, a piece of columns at a time (the group's
// piece of activations, 8 x 8 blocks, stays in L1 while the chunk's rows pass; their running
// sums wait in `state` between pieces); the 1-3 rows left use dot2 / dot1 on the rows as
// stored. The same bits as qmatmul_part.
static void qmatmul_unpacked(const Kernels *k, const char *w, long wrow, const char *xq, long xs,
                             float *y, long B, long ldy, long C, long r0, long r1) {
    static thread_local std::vector<char> buffer;
    static thread_local std::vector<float> sums;
    const long nb = C / k->block, urow = nb * k->ubytes;
    const long RC = std::min(r1 - r0, std::max(1L, (512L << 10) / urow));
    const long PB = 8;  // blocks a piece
    if ((long)buffer.size() < RC * urow + 64) buffer.resize(RC * urow + 64);
    if ((long)sums.size() < RC * MSKQ_STATE) sums.resize(RC * MSKQ_STATE);
    char *u = buffer.data() + (64 - (uintptr_t)buffer.data() % 64) % 64;  // 64-byte aligned
    const long ab = (long)sizeof(ms_a8k);
    for (long c0 = r0; c0 < r1; c0 += RC) {
        const long c1 = std::min(r1, c0 + RC);
        for (long r = c0; r < c1; r++) k->unpack(C, w + r * wrow, u + (r - c0) * urow);
        long b = 0;
        auto group = [&](DotUFn dot) {
            for (long p0 = 0; p0 < nb; p0 += PB) {
                const long p1 = std::min(nb, p0 + PB);
                const int phase = (p0 > 0 ? 1 : 0) | (p1 == nb ? 2 : 0);
                for (long r = c0; r < c1; r++)
                    dot((p1 - p0) * k->block, u + (r - c0) * urow + p0 * k->ubytes, xq + b * xs + p0 * ab,
                        xs, y + b * ldy + r, ldy, sums.data() + (r - c0) * MSKQ_STATE, phase);
            }
        };
        for (; b + 8 <= B; b += 8) group(k->dot8u);
        for (; b + 4 <= B; b += 4) group(k->dot4u);
        if (b < B)
            for (long r = c0; r < c1; r += k->strip) few_rows(k, w + r * wrow, xq, xs, y + r, ldy, C, b, B);
    }
}

// As qmatmul_unpacked, for a type with tiles (the K-quants in the AVX-512 build, from
// k->tmin activation rows): the share's rows 16 at a time laid out as tiles, a chunk of tile
// rows at a time (it stays in L2), then each group of 8 (then 4, then 1) activation rows meets
// the chunk's tile rows a piece of 8 blocks at a time (the group's piece of activations stays
// in L1; the running sums wait in `sums` between pieces). Rows past the last whole 16 go to
// qmatmul_unpacked. The same bits as qmatmul_part.
static void qmatmul_tiles(const Kernels *k, const char *w, long wrow, const char *xq, long xs,
                          float *y, long B, long ldy, long C, long r0, long r1) {
    static thread_local std::vector<char> buffer;
    static thread_local std::vector<float> sums;
    const long nb = C / k->block, trow = nb * k->tbytes, tiles = (r1 - r0) / 16;
    const long RC = std::max(1L, (512L << 10) / trow), PB = 8;  // tile rows a chunk, blocks a piece
    const long ab = (long)sizeof(ms_a8k), state = MSKQ_TILE_STATE;
    if ((long)buffer.size() < std::min(RC, tiles) * trow + 64) buffer.resize(std::min(RC, tiles) * trow + 64);
    if ((long)sums.size() < std::min(RC, tiles) * state) sums.resize(std::min(RC, tiles) * state);
    char *u = buffer.data() + (64 - (uintptr_t)buffer.data() % 64) % 64;  // 64-byte aligned
    for (long c0 = 0; c0 < tiles; c0 += RC) {
        const long c1 = std::min(tiles, c0 + RC);
        for (long t = c0; t < c1; t++) k->tile(C, w + (r0 + 16 * t) * wrow, wrow, u + (t - c0) * trow);
        // the next chunk's rows asked for into L2 a slice before each product, so that they
        // arrive while this chunk computes (laying them out is then not a wait on memory)
        const char *ahead = w + (r0 + 16 * c1) * wrow, *ahead_end = w + (r0 + 16 * std::min(tiles, c1 + RC)) * wrow;
        const long calls = (B / 8 + B % 8 / 4 + B % 4) * ((nb + PB - 1) / PB) * (c1 - c0);
        const long slice = ((ahead_end - ahead) / std::max(1L, calls) + 64) / 64 * 64;
        auto group = [&](DotUFn dot, long b) {
            for (long p0 = 0; p0 < nb; p0 += PB) {
                const long p1 = std::min(nb, p0 + PB);
                const int phase = (p0 > 0 ? 1 : 0) | (p1 == nb ? 2 : 0);
                for (long t = c0; t < c1; t++) {
                    for (const char *e = std::min(ahead_end, ahead + slice); ahead < e; ahead += 64)
                        __builtin_prefetch(ahead, 0, 2);  // into L2 (T1)
                    dot((p1 - p0) * k->block, u + (t - c0) * trow + p0 * k->tbytes, xq + b * xs + p0 * ab, xs,
                        y + b * ldy + r0 + 16 * t, ldy, sums.data() + (t - c0) * state, phase);
                }
            }
        };
        long b = 0;
        for (; b + 8 <= B; b += 8) group(k->tdot8, b);
        for (; b + 4 <= B; b += 4) group(k->tdot4, b);
        for (; b < B; b++) group(k->tdot1, b);
    }
    if (r0 + 16 * tiles < r1) qmatmul_unpacked(k, w, wrow, xq, xs, y, B, ldy, C, r0 + 16 * tiles, r1);
}

// One thread's share of a product over quantized weights: weight rows [r0, r1) (each `wrow`
// bytes) against activation rows [0, B) (each `xs` bytes of xq), into y[b * ldy + r]. Weight
// rows are taken in chunks that stay in the L2 cache; within a chunk, activation rows are taken
// 8 at a time, and every weight row of the chunk meets them while they sit in the L1 cache (the
// weight row, a fraction of their size, comes from L2); the rows left (and fewer than 8 in all)
// meet each weight row 4, 2 and 1 at a time as it passes. How many a call takes never changes a
// pair's result (see above).
static void qmatmul_part(const Kernels *k, const char *w, long wrow, const char *xq, long xs,
                         float *y, long B, long ldy, long C, long r0, long r1) {
    if (tiled(k, B) && C >= k->block) return qmatmul_tiles(k, w, wrow, xq, xs, y, B, ldy, C, r0, r1);
    // a type whose rows are built once for many rows, with no tiles: the lattice types (64
    // activation rows of a random 8192 x 2048 IQ3_S matrix, 2 threads, AVX2 on a Zen 3: 26-31
    // -> 13.5 ms, where each 8 rows built them again)
    if (k->unpack != nullptr && k->tile == nullptr && B >= MANY_ROWS)
        return qmatmul_unpacked(k, w, wrow, xq, xs, y, B, ldy, C, r0, r1);
    if (B < 8) {
        // few rows (decode of a few streams, a short draft's verification): one pass over the
        // weights, each row meeting every activation row while it is in L1. (All the rows for
        // 4 activation rows, then all again for each row left, read the weights once per
        // group, and 1-row products cost nearly what 4-row ones do: 3 rows cost more than 8.)
        for (long r = r0; r < r1; r += k->strip) few_rows(k, w + r * wrow, xq, xs, y + r, ldy, C, 0, B);
        return;
    }
    const long RC = std::max(k->strip, (256L << 10) / wrow / k->strip * k->strip);
    for (long c0 = r0; c0 < r1; c0 += RC) {
        const long c1 = std::min(r1, c0 + RC);
        long b = 0;
        for (; b + 8 <= B; b += 8) {
            long r = c0;
            if (k->dot8r != nullptr)
                for (; r + 8 <= c1; r += 8) k->dot8r(C, w + r * wrow, wrow, xq + b * xs, xs, y + b * ldy + r, ldy);
            for (; r < c1; r += k->strip) k->dot8(C, w + r * wrow, xq + b * xs, xs, y + b * ldy + r, ldy);
        }
        // fewer rows: one weight row at a time. 8 weight rows against 1 or 4 activation rows (as
        // dot8r) measured ~20% faster on weights in L3, but 10-15% slower in decode on a file's
        // mapped pages (Qwen3-1.7B Q4_K_M, AVX2, Zen 3): one row streams as the prefetchers like
        if (b < B)
            for (long r = c0; r < c1; r += k->strip) few_rows(k, w + r * wrow, xq, xs, y + r, ldy, C, b, B);
    }
}

// ---------------------------------------------------------------- row-wise pieces

// Runs f(b) for rows [0, n): on the threads when there are enough rows, else here.
template <typename F>
static void for_rows(int threads, long n, F &&f) {
    if (n < 8) {
        for (long b = 0; b < n; b++) f(b);
        return;
    }
    parallel(threads, [&](int t, int nt) {
        long per = (n + nt - 1) / nt, b0 = t * per, b1 = b0 + per < n ? b0 + per : n;
        for (long b = b0; b < b1; b++) f(b);
    });
}

// out = weight * x / sqrt(mean(x^2) + eps), the sum of squares in dot1's order; out may be x.
static void rms_norm(const float *x, const float *weight, float eps, float *out, long n) {
    float inv = 1.f / std::sqrt(dot1(x, x, n) / n + eps);
    for (long i = 0; i < n; i++) out[i] = weight[i] * (x[i] * inv);
}

// In place: v = v * cos + rotate_half(v) * sin, for `heads` vectors of head_dim numbers, of
// which the first `rot` turn (partial rotary, Phi-3's: the rest pass as they are); cos and sin
// hold one number an angle, rot / 2 a position. With `pairs`, each adjacent pair (2i, 2i + 1)
// rotated by angle i: the layout of a GGUF llama file's q and k rows, whose converter permuted
// them from halves to pairs; else NeoX's halves, i with i + rot / 2.
static void rope(float *v, long heads, long hd, long rot, const float *cos, const float *sin,
                 bool pairs = false) {
    long half = rot / 2;
    for (long h = 0; h < heads; h++) {
        float *p = v + h * hd;
        for (long i = 0; i < half; i++) {
            float *x = pairs ? p + 2 * i : p + i, *y = pairs ? p + 2 * i + 1 : p + i + half;
            float a = *x, b = *y;
            *x = a * cos[i] - b * sin[i];
            *y = b * cos[i] + a * sin[i];
        }
    }
}

// act[i] = silu(gate[i]) * up[i] = gate / (1 + e^-gate) * up, each element alike.
static void silu_mul(const float *gate, const float *up, float *act, long n) {
    long i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i < n; i += 16) {
        __mmask16 m = lanes16(n - i);
        __m512 g = _mm512_maskz_loadu_ps(m, gate + i), u = _mm512_maskz_loadu_ps(m, up + i);
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        _mm512_mask_storeu_ps(act + i, m,
                              _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= n; i += 8) {  // the AVX-512 loop's arithmetic on 8 lanes
        __m256 g = _mm256_loadu_ps(gate + i), u = _mm256_loadu_ps(up + i);
        __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u));
    }
#endif
    for (; i < n; i++) act[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// act[i] = gelu(gate[i]) * up[i], GELU's tanh approximation (PyTorch's gelu(approximate="tanh")):
// 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3) -- written as g / (1 + e^(-2u)), the
// same function, on the exponential the vector loops already have (and without the
// cancellation of 1 + tanh(u) for large negative g).
static const float GELU_C1 = 1.5957691216057308f;   // 2 sqrt(2 / pi)
static const float GELU_C3 = 0.07135481627159119f;  // 2 sqrt(2 / pi) 0.044715

static void gelu_mul(const float *gate, const float *up, float *act, long n) {
    long i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.f), c1 = _mm512_set1_ps(GELU_C1),
                 c3 = _mm512_set1_ps(GELU_C3);
    for (; i < n; i += 16) {
        __mmask16 m = lanes16(n - i);
        __m512 g = _mm512_maskz_loadu_ps(m, gate + i), u = _mm512_maskz_loadu_ps(m, up + i);
        __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
        __m512 two_u = _mm512_add_ps(_mm512_mul_ps(c1, g), _mm512_mul_ps(c3, g3));
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), two_u));
        _mm512_mask_storeu_ps(act + i, m,
                              _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.f), c1 = _mm256_set1_ps(GELU_C1),
                 c3 = _mm256_set1_ps(GELU_C3);
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i), u = _mm256_loadu_ps(up + i);
        __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
        __m256 two_u = _mm256_add_ps(_mm256_mul_ps(c1, g), _mm256_mul_ps(c3, g3));
        __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), two_u));
        _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u));
    }
#endif
    for (; i < n; i++) {
        float g = gate[i], two_u = GELU_C1 * g + GELU_C3 * (g * g * g);
        act[i] = g / (1.f + std::exp(-two_u)) * up[i];
    }
}

// One block of one row's attention, for the `group` query heads sharing one kv head: keys and
// values at positions [from, to), within one block of BLOCK positions (from is the block's
// first position, or later where a local layer's window starts inside the block). Writes per
// head h the block's largest score m, l = sum of e^(score - m) and o = sum of e^(score - m) v
// (its own partial softmax; merge_blocks combines them in order). kt: this kv head's key
// tiles; v: its values; s: scratch for group * BLOCK scores.
static const long BLOCK = 256;

// Keys and values as float32, or as float16 (kv_half: the cache of weights as stored): each
// loaded as float32 (exact), so a float16 cache sums the same products in the same order.
struct f16 {
    uint16_t bits;
};

static inline float kv1(const float *p) { return *p; }
static inline float kv1(const f16 *p) { return msq_h2f(p->bits); }
#if defined(__AVX512F__)
static inline __m512 kv16(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 kv16(const f16 *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 kv8(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 kv8(const f16 *p) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    float t[8];
    ms_dequant_f16(p, t, 8);
    return _mm256_loadu_ps(t);
#endif
}
#endif

// float -> IEEE half, rounded to nearest (ties to even), as F16C's vcvtps2ph rounds: the same
// bits on every build. Saturating: a finite value past the largest half (65,504), which
// rounding would make infinite, is kept as that largest half of its sign, so that one key or
// value out of range does not turn its head's attention into NaN (infinities and NaN stay).
static const float F16_MAX = 65504.f;
static inline f16 to_f16(float x) {
#if defined(__F16C__)
    const float a = std::fabs(x);
    if (a >= 65520.f && a <= FLT_MAX) x = std::copysign(F16_MAX, x);
    return {(uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
#else
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) return {(uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u))};
    if (a >= 0x477ff000u) return {(uint16_t)(sign | 0x7bffu)};  // 65520 and up: F16_MAX
    if (a < 0x38800000u) {  // under 2^-14: a multiple of 2^-24 (1024: the smallest normal)
        float f;
        std::memcpy(&f, &a, 4);
        return {(uint16_t)(sign | (uint32_t)std::nearbyint(f * 16777216.f))};
    }
    uint32_t h = (a - 0x38000000u) >> 13;  // exponent rebased, 10 bits of mantissa
    const uint32_t rest = a & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return {(uint16_t)(sign | h)};
#endif
}

static inline void kv_store(float *p, float x) { *p = x; }
static inline void kv_store(f16 *p, float x) { *p = to_f16(x); }

template <typename T>
static void block_scores(const float *q, const T *kt, long p0, long n, long hd, float scale,
                         float *s) {
    const long tiles = (n + 15) / 16;
    const T *base = kt + (p0 / 16) * hd * 16;
    long t = 0;
#if defined(__AVX512F__)
    for (; t + 4 <= tiles; t += 4) {  // four tiles side by side: four independent sums
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const T *k0 = base + t * hd * 16;
        for (long d = 0; d < hd; d++) {
            // the next four tiles' row d, as scores_bh (AVX-512 without bfloat16 dot products,
            // float16 cache: one row at 1,024 positions 4.19-4.55 -> 4.03-4.05 ms a pass)
            for (int i = 4; i < 8; i++) _mm_prefetch((const char *)(k0 + (i * hd + d) * 16), _MM_HINT_T0);
            __m512 qd = _mm512_set1_ps(q[d]);
            a0 = _mm512_fmadd_ps(qd, kv16(k0 + d * 16), a0);
            a1 = _mm512_fmadd_ps(qd, kv16(k0 + (hd + d) * 16), a1);
            a2 = _mm512_fmadd_ps(qd, kv16(k0 + (2 * hd + d) * 16), a2);
            a3 = _mm512_fmadd_ps(qd, kv16(k0 + (3 * hd + d) * 16), a3);
        }
        __m512 sc = _mm512_set1_ps(scale);
        _mm512_storeu_ps(s + t * 16, _mm512_mul_ps(a0, sc));
        _mm512_storeu_ps(s + t * 16 + 16, _mm512_mul_ps(a1, sc));
        _mm512_storeu_ps(s + t * 16 + 32, _mm512_mul_ps(a2, sc));
        _mm512_storeu_ps(s + t * 16 + 48, _mm512_mul_ps(a3, sc));
    }
    for (; t < tiles; t++) {
        __m512 a = _mm512_setzero_ps();
        const T *k0 = base + t * hd * 16;
        for (long d = 0; d < hd; d++)
            a = _mm512_fmadd_ps(_mm512_set1_ps(q[d]), kv16(k0 + d * 16), a);
        _mm512_storeu_ps(s + t * 16, _mm512_mul_ps(a, _mm512_set1_ps(scale)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; t + 4 <= tiles; t += 4) {  // four tiles side by side: eight independent sums
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
        const T *k0 = base + t * hd * 16;
        for (long d = 0; d < hd; d++) {
            // the next four tiles' row d (as the AVX-512 loop above: a head alone, as with a kv
            // head a query head, reads its keys from memory)
            for (int i = 4; i < 8; i++) _mm_prefetch((const char *)(k0 + (i * hd + d) * 16), _MM_HINT_T0);
            __m256 qd = _mm256_set1_ps(q[d]);
            for (int i = 0; i < 8; i++)
                a[i] = _mm256_fmadd_ps(qd, kv8(k0 + ((i / 2) * hd + d) * 16 + (i % 2) * 8), a[i]);
        }
        __m256 sc = _mm256_set1_ps(scale);
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(s + t * 16 + i * 8, _mm256_mul_ps(a[i], sc));
    }
    for (; t < tiles; t++) {
        __m256 lo = _mm256_setzero_ps(), hi = lo;
        const T *k0 = base + t * hd * 16;
        for (long d = 0; d < hd; d++) {
            __m256 qd = _mm256_set1_ps(q[d]);
            lo = _mm256_fmadd_ps(qd, kv8(k0 + d * 16), lo);
            hi = _mm256_fmadd_ps(qd, kv8(k0 + d * 16 + 8), hi);
        }
        __m256 sc = _mm256_set1_ps(scale);
        _mm256_storeu_ps(s + t * 16, _mm256_mul_ps(lo, sc));
        _mm256_storeu_ps(s + t * 16 + 8, _mm256_mul_ps(hi, sc));
    }
#endif
    for (; t < tiles; t++) {
        float a[16] = {0.f};
        const T *k0 = base + t * hd * 16;
        for (long d = 0; d < hd; d++)
            for (int l = 0; l < 16; l++) a[l] += q[d] * kv1(k0 + d * 16 + l);
        for (int l = 0; l < 16; l++) s[t * 16 + l] = a[l] * scale;
    }
}

#if defined(__AVX512F__)
template <int NV, typename T>  // o (NV x 16 numbers) held in registers over all n positions
static inline void weighted_sum_regs(const float *p, const T *v, long n, float *o) {
    __m512 acc[NV];
    for (int k = 0; k < NV; k++) acc[k] = _mm512_setzero_ps();
    for (long j = 0; j < n; j++) {
        for (int k = 0; k < NV; k += sizeof(T) == 2 ? 2 : 1)  // a line each: the row 16 ahead
            _mm_prefetch((const char *)(v + (j + 16) * NV * 16 + k * 16), _MM_HINT_T0);
        __m512 pj = _mm512_set1_ps(p[j]);
        for (int k = 0; k < NV; k++)
            acc[k] = _mm512_fmadd_ps(pj, kv16(v + j * NV * 16 + k * 16), acc[k]);
    }
    for (int k = 0; k < NV; k++) _mm512_storeu_ps(o + k * 16, acc[k]);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
template <int NV, typename T>  // o's NV x 8 numbers from column 0 of v's rows (stride hd)
static inline void weighted_sum_regs8(const float *p, const T *v, long n, long hd, float *o) {
    __m256 acc[NV];
    for (int k = 0; k < NV; k++) acc[k] = _mm256_setzero_ps();
    for (long j = 0; j < n; j++) {
        for (int k = 0; k < NV; k += 64 / (8 * (int)sizeof(T)))  // a line each: the row 16 ahead
            _mm_prefetch((const char *)(v + (j + 16) * hd + k * 8), _MM_HINT_T0);
        __m256 pj = _mm256_set1_ps(p[j]);
        for (int k = 0; k < NV; k++)
            acc[k] = _mm256_fmadd_ps(pj, kv8(v + j * hd + k * 8), acc[k]);
    }
    for (int k = 0; k < NV; k++) _mm256_storeu_ps(o + k * 8, acc[k]);
}
#endif

// o += a x over n numbers of a float16 row: axpy's arithmetic (the values widened exactly).
static inline void axpy(float *y, float a, const f16 *x, long n) {
    float row[256];
    for (long i0 = 0; i0 < n; i0 += 256) {
        const long m = n - i0 < 256 ? n - i0 : 256;
        ms_dequant_f16(x + i0, row, m);  // F16 weights' widening (quants.h): exact
        axpy(y + i0, a, row, m);
    }
}

// o = sum_j p[j] v[j], v of n rows of hd numbers: axpy's arithmetic, row after row (with o in
// registers where it fits, else in memory: the same operations either way).
template <typename T>
static inline void weighted_sum(const float *p, const T *v, long n, long hd, float *o) {
#if defined(__AVX512F__)
    if (hd == 64) return weighted_sum_regs<4>(p, v, n, o);
    if (hd == 128) return weighted_sum_regs<8>(p, v, n, o);
    if (hd == 32) return weighted_sum_regs<2>(p, v, n, o);
    if (hd == 256) return weighted_sum_regs<16>(p, v, n, o);
#elif defined(__AVX2__) && defined(__FMA__)
    if (hd == 32) return weighted_sum_regs8<4>(p, v, n, hd, o);
    if (hd % 64 == 0) {  // 64 numbers (8 accumulators) at a time
        for (long i = 0; i < hd; i += 64) weighted_sum_regs8<8>(p, v + i, n, hd, o + i);
        return;
    }
#endif
    for (long i = 0; i < hd; i++) o[i] = 0.f;
    for (long j = 0; j < n; j++) axpy(o, p[j], v + j * hd, hd);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// AVX2: the NH heads of a kv group at once, so that each key and value vector is loaded (and
// widened from float16) once for all of them, where a head at a time did it once a head: with
// SmolLM2's 3 heads a group, a third of the loads and conversions. Where the keys and values
// are in the cache -- a prompt's rows share them -- that is the work: a 1,024-token SmolLM2
// prompt 4% faster, a 2,048-token Gemma 3 270M one (4 heads a group, 256 dimensions) 9%; a
// decode row reads them from memory, at the same speed either way. Each score and each sum is
// the one a head alone makes -- the same fused multiply-adds from 0, in the same order -- so
// no bit changes. Registers: NH x NT x 2 (scores) or NH x NV (sums) accumulators, at most 12.

// NH heads' scores against NT tiles of 16 keys (k0: the first tile; q: the heads hd apart; s:
// the heads' scores BLOCK apart).
template <int NH, int NT, typename T>
static inline void scores_heads8(const float *q, long hd, const T *k0, __m256 scale, float *s) {
    __m256 acc[NH][NT][2];
    for (int h = 0; h < NH; h++)
        for (int t = 0; t < NT; t++) acc[h][t][0] = acc[h][t][1] = _mm256_setzero_ps();
    for (long d = 0; d < hd; d++) {
        __m256 kv[NT][2];
        // the next NT tiles' row d, and below the value row 16 ahead, asked for now (as
        // scores_bh: SmolLM2, one row at 1,024 positions 6.7-7.3 -> 6.2-6.6 ms a pass)
        for (int t = 0; t < NT; t++) _mm_prefetch((const char *)(k0 + ((t + NT) * hd + d) * 16), _MM_HINT_T0);
        for (int t = 0; t < NT; t++) {
            kv[t][0] = kv8(k0 + (t * hd + d) * 16);
            kv[t][1] = kv8(k0 + (t * hd + d) * 16 + 8);
        }
        for (int h = 0; h < NH; h++) {
            const __m256 qd = _mm256_set1_ps(q[h * hd + d]);
            for (int t = 0; t < NT; t++)
                for (int i = 0; i < 2; i++) acc[h][t][i] = _mm256_fmadd_ps(qd, kv[t][i], acc[h][t][i]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int t = 0; t < NT; t++)
            for (int i = 0; i < 2; i++)
                _mm256_storeu_ps(s + h * BLOCK + t * 16 + i * 8, _mm256_mul_ps(acc[h][t][i], scale));
}

// o_h (NV x 8 numbers from column 0 of v's rows, hd apart) = sum_j p_h[j] v[j] for NH heads:
// weighted_sum's products and order (p: the heads' weights BLOCK apart; o: ostride apart).
template <int NH, int NV, typename T>
static inline void weighted_heads8(const float *p, const T *v, long n, long hd, float *o,
                                   long ostride) {
    __m256 acc[NH][NV];
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < NV; c++) acc[h][c] = _mm256_setzero_ps();
    for (long j = 0; j < n; j++) {
        __m256 vv[NV];
        _mm_prefetch((const char *)(v + (j + 16) * hd), _MM_HINT_T0);
        for (int c = 0; c < NV; c++) vv[c] = kv8(v + j * hd + c * 8);
        for (int h = 0; h < NH; h++) {
            const __m256 pj = _mm256_set1_ps(p[h * BLOCK + j]);
            for (int c = 0; c < NV; c++) acc[h][c] = _mm256_fmadd_ps(pj, vv[c], acc[h][c]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < NV; c++) _mm256_storeu_ps(o + h * ostride + c * 8, acc[h][c]);
}

// attend_block's numbers for NH (2 to 4) heads, hd a multiple of 8.
template <int NH, typename T>
static void attend_heads8(const float *q, const T *kt, const T *v, long from, long to, long hd,
                          float scale, float *s, float *part) {
    constexpr int NT = NH == 2 ? 2 : 1, NV = NH == 2 ? 4 : 2;
    const long t0 = from / 16 * 16, skip = from - t0, n = to - from, tiles = (to - t0 + 15) / 16;
    const T *base = kt + (t0 / 16) * hd * 16;
    const __m256 sc = _mm256_set1_ps(scale);
    long t = 0;
    for (; t + NT <= tiles; t += NT) scores_heads8<NH, NT>(q, hd, base + t * hd * 16, sc, s + t * 16);
    for (; t < tiles; t++) scores_heads8<NH, 1>(q, hd, base + t * hd * 16, sc, s + t * 16);
    for (int h = 0; h < NH; h++) {  // part, per head: o (hd numbers), l, m
        float *p = s + h * BLOCK + skip, *o = part + h * (hd + 2);
        o[hd + 1] = max_of(p, n);
        o[hd] = exp_shifted(p, n, o[hd + 1]);
    }
    long c = 0;
    for (; c + 8 * NV <= hd; c += 8 * NV)
        weighted_heads8<NH, NV>(s + skip, v + from * hd + c, n, hd, part + c, hd + 2);
    for (; c < hd; c += 8) weighted_heads8<NH, 1>(s + skip, v + from * hd + c, n, hd, part + c, hd + 2);
}
#endif

template <typename T>
static void attend_block(const float *q, const T *kt, const T *v, long group, long from,
                         long to, long hd, float scale, float *s, float *part) {
    // scores from the tile of 16 that holds `from` (tiles are whole), used from `from` on
    const long t0 = from / 16 * 16, skip = from - t0, n = to - from;
    long h = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    for (; hd % 8 == 0 && group - h >= 2; h += 4) {  // 2 to 4 heads at once; a last one alone
        const float *qh = q + h * hd;
        float *sh = s + h * BLOCK, *ph = part + h * (hd + 2);
        switch (group - h < 4 ? group - h : 4) {
            case 2: attend_heads8<2>(qh, kt, v, from, to, hd, scale, sh, ph); break;
            case 3: attend_heads8<3>(qh, kt, v, from, to, hd, scale, sh, ph); break;
            default: attend_heads8<4>(qh, kt, v, from, to, hd, scale, sh, ph);
        }
    }
#endif
    for (; h < group; h++) {  // part, per head: o (hd numbers), l, m
        float *sh = s + h * BLOCK, *o = part + h * (hd + 2), *p = sh + skip;
        block_scores(q + h * hd, kt, t0, to - t0, hd, scale, sh);
        const float top = max_of(p, n);
        o[hd + 1] = top;
        o[hd] = exp_shifted(p, n, top);
        weighted_sum(p, v + from * hd, n, hd, o);
    }
}

#if MS_BF16_DOT
static inline bf16 to_bf16(float x) {  // round to nearest, ties to even
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Attention with bfloat16 keys, values, query and weights, for up to 4 query heads sharing one kv
// head at once: each key and value vector is loaded once for all of them, where one head at a
// time read a block's keys and values from the L2 cache once per head (measured: a 1,000-token
// Gemma 3 prompt, 4 heads a kv head, 13% faster). Each head's numbers are the sums a head alone
// would make, in the same order: running them side by side changes no bit.
static const int HEADS_AT_ONCE = 4;

// Scores of NH heads against NT tiles of 16 keys: keys as (hd / 2, 16, 2) per tile, pairs of
// dimensions side by side, so one vdpbf16ps adds two dimensions to 16 scores. q2: each head's
// query as `pairs` pairs of bfloat16; s: the heads' scores, BLOCK apart.
template <int NH, int NT>
static inline void scores_bh(const uint32_t *q2, long pairs, const bf16 *k0, __m512 scale,
                             float *s) {
    __m512 acc[NH][NT];
    for (int h = 0; h < NH; h++)
        for (int t = 0; t < NT; t++) acc[h][t] = _mm512_setzero_ps();
    for (long d = 0; d < pairs; d++) {
        __m512bh kv[NT];
        // the next NT tiles' row d asked for now: a decode row reads its keys from memory, a
        // block's tiles 2 KB apart, and the prefetchers alone fall behind (as the values'
        // below: SmolLM2, one row at 1,024 positions 5.6-5.8 -> 4.8-5.2 ms a pass, 8 rows at
        // 128 9.9-10.2 -> 9.4-9.5, on a Xeon)
        for (int t = 0; t < NT; t++) _mm_prefetch((const char *)(k0 + ((t + NT) * pairs + d) * 32), _MM_HINT_T0);
        for (int t = 0; t < NT; t++)
            kv[t] = (__m512bh)_mm512_loadu_si512(k0 + (t * pairs + d) * 32);
        for (int h = 0; h < NH; h++) {
            __m512bh qd = (__m512bh)_mm512_set1_epi32((int)q2[h * pairs + d]);
            for (int t = 0; t < NT; t++) acc[h][t] = _mm512_dpbf16_ps(acc[h][t], qd, kv[t]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int t = 0; t < NT; t++)
            _mm512_storeu_ps(s + h * BLOCK + t * 16, _mm512_mul_ps(acc[h][t], scale));
}

// The scores of NH heads at positions [p0, p0 + n), p0 a multiple of 16 (whole tiles).
template <int NH>
static void block_scores_bh(const uint32_t *q2, const bf16 *kt, long p0, long n, long hd,
                            float scale, float *s) {
    const long tiles = (n + 15) / 16, pairs = hd / 2;
    const bf16 *base = kt + (p0 / 16) * hd * 16;
    const __m512 sc = _mm512_set1_ps(scale);
    long t = 0;
    for (; t + 4 <= tiles; t += 4) scores_bh<NH, 4>(q2, pairs, base + t * hd * 16, sc, s + t * 16);
    for (; t < tiles; t++) scores_bh<NH, 1>(q2, pairs, base + t * hd * 16, sc, s + t * 16);
}

// o_h = sum_j w_h[j] v[j] for NH heads over NC x 16 dimensions: values in pairs of positions
// (hd, 2), so one vdpbf16ps adds two positions to 16 dimensions; w2: each head's weights as
// `pairs` pairs of bfloat16 (rows `stride` apart); o: each head's sums, `ostride` apart.
template <int NH, int NC>
static inline void weighted_bh(const uint32_t *w2, long stride, long pairs, const bf16 *v2,
                               long hd, float *o, long ostride) {
    __m512 acc[NH][NC];
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < NC; c++) acc[h][c] = _mm512_setzero_ps();
    for (long j = 0; j < pairs; j++) {
        __m512bh vv[NC];
        for (int c = 0; c < NC; c++) _mm_prefetch((const char *)(v2 + (j + 16) * hd * 2 + c * 32), _MM_HINT_T0);  // 16 pairs ahead
        for (int c = 0; c < NC; c++)
            vv[c] = (__m512bh)_mm512_loadu_si512(v2 + j * hd * 2 + c * 32);
        for (int h = 0; h < NH; h++) {
            __m512bh wj = (__m512bh)_mm512_set1_epi32((int)w2[h * stride + j]);
            for (int c = 0; c < NC; c++) acc[h][c] = _mm512_dpbf16_ps(acc[h][c], wj, vv[c]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(o + h * ostride + c * 16, acc[h][c]);
}

// All hd dimensions, 64 at a time (4 vectors a head, 16 sums side by side for 4 heads), or 32
// or 16 where hd is not a multiple of 64.
template <int NH>
static void weighted_sum_bh(const uint32_t *w2, long stride, long pairs, const bf16 *v2, long hd,
                            float *o, long ostride) {
    const long vectors = hd / 16;
    const long chunk = vectors % 4 == 0 ? 4 : vectors % 2 == 0 ? 2 : 1;
    for (long c = 0; c < vectors; c += chunk) {
        const bf16 *vc = v2 + c * 32;
        float *oc = o + c * 16;
        if (chunk == 4) weighted_bh<NH, 4>(w2, stride, pairs, vc, hd, oc, ostride);
        else if (chunk == 2) weighted_bh<NH, 2>(w2, stride, pairs, vc, hd, oc, ostride);
        else weighted_bh<NH, 1>(w2, stride, pairs, vc, hd, oc, ostride);
    }
}

// p[0 .. n) rounded to bfloat16 (to_bf16's rounding, 16 lanes at a time) into out, padded with
// a 0 to an even count (positions go in pairs); returns the sum of the rounded numbers, 16
// running sums (lane i: positions 16 k + i) then reduce1's order.
static inline float pack_bf16(const float *p, long n, bf16 *out) {
    __m512 sum = _mm512_setzero_ps();
    const __m512i ones = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
    const long even = n + n % 2;  // stored through the vector stores only (out may be words)
    for (long j = 0; j < even; j += 16) {
        const __m512i u = _mm512_castps_si512(_mm512_maskz_loadu_ps(lanes16(n - j), p + j));  // 0 past n
        const __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(u, half), _mm512_and_si512(_mm512_srli_epi32(u, 16), ones)), 16);
        _mm256_mask_storeu_epi16(out + j, lanes16(even - j), _mm512_cvtepi32_epi16(r));
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(r, 16)));
    }
    return reduce1(sum);
}

// NH heads of attend_block, in bfloat16: the query rounded, scores, the block's softmax
// numerators rounded to bfloat16 and paired (l is the sum of the rounded ones: the weights that
// are used sum to the total that divides them). Values come in pairs of positions, so an odd
// `from` is summed from the position before it, with a weight of 0; an odd count pairs its last
// position with a weight of 0.
template <int NH>
static void attend_heads_bh(const float *q, const bf16 *kt, const bf16 *v2, long from, long to,
                            long hd, float scale, float *s, float *part) {
    const long t0 = from / 16 * 16, skip = from - t0, n = to - from, odd = from % 2;
    const long pairs = (n + odd + 1) / 2;
    uint32_t q2[HEADS_AT_ONCE * 128], w2[HEADS_AT_ONCE * (BLOCK / 2 + 1)];
    bf16 qb[HEADS_AT_ONCE * 256];
    for (long i = 0; i < NH * hd; i++) qb[i] = to_bf16(q[i]);
    std::memcpy(q2, qb, NH * hd * sizeof(bf16));
    block_scores_bh<NH>(q2, kt, t0, to - t0, hd, scale, s);
    for (int h = 0; h < NH; h++) {
        float *p = s + h * BLOCK + skip - odd, *o = part + h * (hd + 2);
        o[hd + 1] = max_of(p + odd, n);
        exp_shifted(p + odd, n, o[hd + 1]);
        if (odd) p[0] = 0.f;
        o[hd] = pack_bf16(p, n + odd, (bf16 *)(w2 + h * (BLOCK / 2 + 1)));
    }
    weighted_sum_bh<NH>(w2, BLOCK / 2 + 1, pairs, v2 + (from / 2) * hd * 2, hd, part, hd + 2);
}

static void attend_block_bh(const float *q, const bf16 *kt, const bf16 *v2, long group,
                            long from, long to, long hd, float scale, float *s, float *part) {
    for (long h = 0; h < group; h += HEADS_AT_ONCE) {
        const float *qh = q + h * hd;
        float *sh = s + h * BLOCK, *ph = part + h * (hd + 2);
        switch (group - h < HEADS_AT_ONCE ? group - h : HEADS_AT_ONCE) {
            case 1: attend_heads_bh<1>(qh, kt, v2, from, to, hd, scale, sh, ph); break;
            case 2: attend_heads_bh<2>(qh, kt, v2, from, to, hd, scale, sh, ph); break;
            case 3: attend_heads_bh<3>(qh, kt, v2, from, to, hd, scale, sh, ph); break;
            default: attend_heads_bh<4>(qh, kt, v2, from, to, hd, scale, sh, ph);
        }
    }
}
#endif

// out = the blocks' partial softmaxes combined, first to last: rescaled to the running
// largest score, summed, divided by the total.
static void merge_blocks(const float *part, long blocks, long stride, long hd, float *out) {
    const float *o = part, *l = o + hd, *m = l + 1;  // one head's numbers within a block
    float top = *m, total = *l;
    for (long i = 0; i < hd; i++) out[i] = o[i];
    for (long j = 1; j < blocks; j++) {
        const float *oj = part + j * stride, lj = oj[hd], mj = oj[hd + 1];
        float new_top = mj > top ? mj : top, a = std::exp(top - new_top),
              c = std::exp(mj - new_top);
        for (long i = 0; i < hd; i++) out[i] = out[i] * a + oj[i] * c;
        total = total * a + lj * c;
        top = new_top;
    }
    for (long i = 0; i < hd; i++) out[i] /= total;
}

// ---------------------------------------------------------------- the forward pass

// The model, as ctypes builds it (miniserve/native.py mirrors these structs field by field).
// A matrix is an MsMat: its rows in one of the types above (float32 and bfloat16 copies, or a
// GGUF file's tensors in place); norm weights, biases and RoPE tables are float32.
struct MsMat {
    const void *data;  // null: absent (no rows)
    long type;         // ggml's type id (MsTypeId)
    long rows;         // its columns are the product's input width
};

struct MsLayer {
    const float *attn_norm;
    MsMat qkv[3];        // q | k | v rows, output side by side: one fused matrix, or three
    const float *bqkv;   // (H + 2 KV) hd, or null
    MsMat wo;
    const float *mlp_norm;
    MsMat gate_up[2];    // gate | up rows: one fused matrix, or two
    MsMat w2;
    const float *q_norm, *k_norm;              // Gemma: per head, before RoPE; else null
    const float *attn_out_norm, *mlp_out_norm;  // Gemma: on each branch's output; else null
    const float *cos, *sin;  // this layer's RoPE tables: (max positions, rot / 2), an angle each
    long window;             // a local layer's window (q - k < window); 0 = every position
    // experts (Qwen3 MoE) instead of gate_up / w2: the router (E rows), and the gate, up and
    // down matrices of all E experts one after another (E x F rows of D, E x D rows of F)
    MsMat router;
    MsMat experts[3];
};

struct MsModel {
    long layers, D, H, KV, hd, I, V;
    long rot;  // the dimensions of a head RoPE turns (partial rotary: fewer than hd)
    long E, K, F;  // experts, experts a token uses, an expert's feed-forward width (0: dense)
    MsMat embed, lm_head;  // V rows each (the embedding's rows are looked up, not multiplied)
    const float *final_norm;
    const MsLayer *layer;
    float eps;
    float embed_scale;  // the embeddings' factor (Gemma: sqrt(D)); 1 = none
    float attn_scale;   // the scores' factor (head_dim^-0.5, or Gemma's query_pre_attn_scalar's)
    int gelu;           // the MLP's activation: 0 = SiLU, 1 = GELU (tanh approximation)
    int rope_pairs;     // RoPE on adjacent pairs (GGUF's llama q/k rows), else on halves
    int math;           // float32 / bfloat16 matrices: 0 = float32 products, 1 = bfloat16
    int threads;
    int kv_half;        // 1: the KV cache holds float16 (where it is not bfloat16: kv_bf16)
    int embed_mapped;   // 1: embed lies in a read-only map of a file: its pages handed back
                        // once a pass has looked its rows up (embed_hand_back)
};

// One pass: n rows. Row b feeds token[b] at position pos[b] of the sequence whose cache is
// k[b] / v[b] (layer 0's keys and values; cap[b] positions each, a multiple of 16). Rows of
// one sequence must be consecutive positions; each sees its sequence up to itself. Logits
// (n_out x V) are computed for the rows listed in out.
struct MsRows {
    long n, n_out;
    const long *token, *pos, *cap, *out;
    void *const *k;  // float, float16 or bfloat16: ms_kv_type() (see attention())
    void *const *v;
    float *logits;
};

// The scratch a pass needs, in floats, carved in this order (one place for the layout).
struct Scratch {
    float *x, *h, *xr, *qkv, *att, *gu, *act, *y, *s, *part;
    bf16 *xb;
    char *xq8, *xq8k;  // activation rows quantized for a product (ms_a8g / ms_a8k blocks)
    long blocks;  // attention blocks of the longest row
};

// A prompt's feed-forward runs FFN_ROWS rows at a time: its two widest buffers (gate | up and
// the activation, 3 x I numbers a row: 72 KiB for Qwen3-1.7B) are then sized for a chunk, not
// the pass (at 512 rows: 36 MiB -> 9 MiB). Each chunk reads the feed-forward's weights again,
// ~0.3% of a 512-token prompt's time; a row's numbers are the same (each row is computed alone).
static const long FFN_ROWS = 128;

// The whole pages of an embedding that lies in a read-only map of a file, handed back to the
// system once a pass has copied its rows (Linux: MADV_DONTNEED; nothing is lost, a later lookup
// faults its page in again from the page cache). Each lookup maps the ~64 KB around its row
// (the kernel's fault-around): a 512-token prompt's ~27 MiB of Qwen3-1.7B's table, which
// would otherwise stay resident, and a session's tokens pile up to the whole table.
static void embed_hand_back(const MsMat &e, long D) {
#if defined(__linux__)
    const long page = sysconf(_SC_PAGESIZE);
    const uintptr_t start = (uintptr_t)e.data, end = start + e.rows * row_bytes(e.type, D);
    const uintptr_t first = (start + page - 1) / page * page, last = end / page * page;
    if (last > first) madvise((void *)first, last - first, MADV_DONTNEED);
#else
    (void)e, (void)D;
#endif
}

static long carve(const MsModel *m, long n, long max_len, float *base, Scratch *sc) {
    const long wide = std::max(std::max(m->D, m->H * m->hd), m->I), group = m->H / m->KV;
    const long blocks = (max_len + BLOCK - 1) / BLOCK;
    const long ffn = m->E > 0 ? n : std::min(n, FFN_ROWS);  // moe() takes every row at once
    const int threads = pool_for(m->threads)->size();
    const long sizes[] = {n * m->D, n * m->D, n * wide, n * (m->H + 2 * m->KV) * m->hd,
                          n * m->H * m->hd, ffn * 2 * m->I, ffn * m->I, n * m->D,
                          threads * group * BLOCK, n * m->KV * blocks * group * (m->hd + 2),
                          (n * wide + 1) / 2 + 16, (n * act_row_bytes(ACT_A8, wide) + 3) / 4,
                          (n * act_row_bytes(ACT_A8K, wide) + 3) / 4};
    float **slots[] = {&sc->x, &sc->h, &sc->xr, &sc->qkv, &sc->att, &sc->gu, &sc->act, &sc->y,
                       &sc->s, &sc->part};
    long total = 0;
    for (int i = 0; i < 13; i++) {
        if (base != nullptr) {
            if (i < 10) *slots[i] = base + total;
            else if (i == 10) sc->xb = (bf16 *)(base + total);
            else if (i == 11) sc->xq8 = (char *)(base + total);
            else sc->xq8k = (char *)(base + total);
        }
        total += (sizes[i] + 15) / 16 * 16;  // each 64-byte aligned from an aligned base
    }
    sc->blocks = blocks;
    return total;
}

#if defined(MS_AMX)
// From this many activation rows a Q4_K / Q5_K product runs on the AMX tiles (amx.h): with 8
// the tiles are half empty and the AVX-512 loops are faster.
static const long AMX_ROWS = 16;

// One Q4_K / Q5_K part of linear() on the tiles: the activation rows laid out once (in groups
// of 16, on the threads), then chunks of 16 weight rows dealt to the threads as they are taken.
static void amx_linear(const MsModel *m, const MsMat &p, const char *xq, long xs, long wrow, long B,
                       long C, float *yp, long R) {
    static thread_local std::vector<char> buffer;  // an engine thread each
    const long nb = C / 256, groups = (B + 15) / 16, bytes = groups * nb * AMX_BLOCK;
    if ((long)buffer.size() < bytes + 64) buffer.resize(bytes + 64);
    char *acts = buffer.data() + (64 - (uintptr_t)buffer.data() % 64) % 64;
    for_rows(m->threads, groups, [&](long g) { amx_k45_group(xq, xs, B, nb, g, acts); });
    std::atomic<long> next{0};
    parallel(m->threads, [&](int, int n) {
        const long chunk = std::max(16L, (p.rows / (8L * n) + 15) / 16 * 16);
        for (long r0; (r0 = next.fetch_add(chunk)) < p.rows;) {
            const long r1 = std::min(r0 + chunk, p.rows);
            if (p.type == T_Q5_K)
                amx_k45_rows<true>((const char *)p.data, wrow, acts, B, nb, yp, R, r0, r1);
            else if (p.type == T_Q5_K_P16)
                amx_k45_rows<true, true>((const char *)p.data, wrow, acts, B, nb, yp, R, r0, r1);
            else if (p.type == T_Q4_K_P16)
                amx_k45_rows<false, true>((const char *)p.data, wrow, acts, B, nb, yp, R, r0, r1);
            else
                amx_k45_rows<false>((const char *)p.data, wrow, acts, B, nb, yp, R, r0, r1);
        }
    });
}
#endif

// y (B x R) = x (B x C) [w_0 | w_1 | ...]^T (+ bias): the parts' output rows side by side
// (R = their rows together), each in its own type. Float32 and bfloat16 parts in the model's
// arithmetic (bfloat16 products: the activations rounded once); quantized parts on the
// activations quantized once per format the parts need.
static void linear(const MsModel *m, const MsMat *parts, int nparts, const float *bias,
                   const float *x, long B, long C, float *y, Scratch *sc) {
    long R = 0;
    for (int i = 0; i < nparts; i++) R += parts[i].data ? parts[i].rows : 0;
    const float *xf = x;
    const bf16 *xb = nullptr;
    bool rounded = false, quantized[3] = {false, false, false};
    long col = 0;
    for (int i = 0; i < nparts; i++) {
        const MsMat &p = parts[i];
        if (p.data == nullptr) continue;
        const Kernels *k = kernels_for(p.type);
        float *yp = y + col;
        if (k == nullptr) {  // float32 or bfloat16 rows: the float loops
            if (m->math == 1 && !rounded) {  // bfloat16 products: round the activations once
                for_rows(m->threads, B, [&](long b) {
                    round_bf16(x + b * C, sc->xr + b * C, sc->xb + b * C, C);
                });
                xf = sc->xr;
                xb = sc->xb;
                rounded = true;
            }
            parallel(m->threads, [&](int t, int n) {
                long per = ((p.rows + n - 1) / n + 3) / 4 * 4;  // a multiple of 4 rows a thread
                long r0 = t * per, r1 = std::min(r0 + per, p.rows);
                if (r0 >= r1) return;
                if (p.type == T_F32)
                    matmul_part((const float *)p.data, xf, xb, yp, B, R, C, r0, r1);
                else
                    matmul_part((const bf16 *)p.data, xf, xb, yp, B, R, C, r0, r1);
            });
        } else {
            const char *xq = (const char *)x;  // F16: float rows as they are
            const long xs = act_row_bytes(k->act, C);
            if (k->act != ACT_FLOAT) {
                char *buf = k->act == ACT_A8 ? sc->xq8 : sc->xq8k;
                if (!quantized[k->act]) {
                    for_rows(m->threads, B, [&](long b) {
                        if (k->act == ACT_A8)
                            ms_quantize_a8(x + b * C, (ms_a8g *)(buf + b * xs), C);
                        else
                            ms_quantize_a8k(x + b * C, (ms_a8k *)(buf + b * xs), C);
                    });
                    quantized[k->act] = true;
                }
                xq = buf;
            }
            const long wrow = row_bytes(p.type, C);
#if defined(MS_AMX)
            if ((p.type == T_Q4_K || p.type == T_Q4_K_P16 || p.type == T_Q5_K || p.type == T_Q5_K_P16) && B >= AMX_ROWS &&
                amx_on()) {
                amx_linear(m, p, xq, xs, wrow, B, C, yp, R);
                col += p.rows;
                continue;
            }
#endif
            // many activation rows (compute-bound): weight rows taken in chunks, each thread
            // the next free one, so that a thread the machine slows (another process, a busy
            // host) takes fewer instead of holding the others at the end of the product; few
            // (memory-bound): one contiguous share a thread, streamed. A row's result is the
            // same whoever computes it.
            std::atomic<long> next{0};
            parallel(m->threads, [&](int t, int n) {
                if (B < MANY_ROWS && !tiled(k, B)) {
                    const long a = std::max(4L, k->strip);  // rows a share is a multiple of
                    long per = ((p.rows + n - 1) / n + a - 1) / a * a;
                    long r0 = t * per, r1 = std::min(r0 + per, p.rows);
                    if (r0 < r1) qmatmul_part(k, (const char *)p.data, wrow, xq, xs, yp, B, R, C, r0, r1);
                    return;
                }
                const long chunk = std::max(16L, (p.rows / (8L * n) + 15) / 16 * 16);  // whole tiles
                for (long r0; (r0 = next.fetch_add(chunk)) < p.rows;)
                    qmatmul_part(k, (const char *)p.data, wrow, xq, xs, yp, B, R, C, r0,
                                 std::min(r0 + chunk, p.rows));
            });
        }
        col += p.rows;
    }
    if (bias)
        for (long b = 0; b < B; b++)
            for (long r = 0; r < R; r++) y[b * R + r] += bias[r];
}

// One row of a matrix as float32 (an embedding looked up): out = row * scale.
static void matrix_row(const MsMat &w, long row, long cols, float scale, float *out) {
    if (w.type == T_F32 || w.type == T_BF16) {
        for (long i = 0; i < cols; i++)
            out[i] = (w.type == T_F32 ? load((const float *)w.data, row * cols + i)
                                      : load((const bf16 *)w.data, row * cols + i)) * scale;
        return;
    }
    const Kernels *k = kernels_for(w.type);
    k->dequant((const char *)w.data + row * row_bytes(w.type, cols), out, cols);
    for (long i = 0; i < cols; i++) out[i] *= scale;
}

static void norm(const MsModel *m, const float *x, const float *weight, float *out, long n) {
    for_rows(m->threads, n, [&](long b) {
        rms_norm(x + b * m->D, weight, m->eps, out + b * m->D, m->D);
    });
}

// The KV cache holds bfloat16 where attention can use the dot instruction too: bfloat16
// products, AVX512_BF16, head_dim a multiple of 16 (up to 256). Keys then as (layers, kv_heads,
// capacity / 16, head_dim / 2, 16, 2) and values as (layers, kv_heads, capacity / 2, head_dim,
// 2): pairs for vdpbf16ps. Half the memory, half the bytes a decode row reads, half the
// instructions of a prompt's attention; scores, softmax and sums stay float32.
static inline bool kv_bf16(const MsModel *m) {
    return MS_BF16_DOT && m->math == 1 && m->hd % 16 == 0 && m->hd <= 256;
}

// Else float16 where the model asks (kv_half: weights as stored in block formats, whose
// products round their activations to int8 anyway), in float32's layout: half the memory and
// half the bytes attention reads; each key and value is widened exactly where it is read.
static inline bool kv_f16(const MsModel *m) { return !kv_bf16(m) && m->kv_half != 0; }

// Attention's work: one item per (row, kv head, block of BLOCK positions the row sees).
struct Item { long b, g, j; };

// The first position a row at position p sees: 0, or a local layer's window's start.
static inline long first_seen(long p, long window) {
    return window > 0 && p + 1 > window ? p + 1 - window : 0;
}

static std::vector<Item> attention_items(const MsModel *m, const MsRows *r, long window) {
    std::vector<Item> items;
    for (long b = 0; b < r->n; b++)
        for (long g = 0; g < m->KV; g++)
            for (long j = first_seen(r->pos[b], window) / BLOCK; j * BLOCK < r->pos[b] + 1; j++)
                items.push_back({b, g, j});
    return items;
}

static void attention(const MsModel *m, const MsRows *r, long layer, Scratch *sc,
                      const std::vector<Item> &items) {
    const long H = m->H, KV = m->KV, hd = m->hd, group = H / KV, QKV = (H + 2 * KV) * hd;
    const MsLayer &w = m->layer[layer];
    const float scale = m->attn_scale;
    const bool half = kv_bf16(m), f16s = kv_f16(m);
    (void)half;
    // this layer's keys and values into each row's cache
    for_rows(m->threads, r->n, [&](long b) {
        const long cap = r->cap[b], p = r->pos[b], at = layer * KV * cap * hd;
        float *q = sc->qkv + b * QKV, *k = q + H * hd, *v = k + KV * hd;
        const float *cos = w.cos + p * (m->rot / 2), *sin = w.sin + p * (m->rot / 2);
        if (w.q_norm != nullptr) {  // Gemma: each head's query and key, before RoPE
            for (long h = 0; h < H; h++) rms_norm(q + h * hd, w.q_norm, m->eps, q + h * hd, hd);
            for (long g = 0; g < KV; g++) rms_norm(k + g * hd, w.k_norm, m->eps, k + g * hd, hd);
        }
        rope(q, H, hd, m->rot, cos, sin, m->rope_pairs);
        rope(k, KV, hd, m->rot, cos, sin, m->rope_pairs);
        for (long g = 0; g < KV; g++) {
            const long tile = (g * (cap / 16) + p / 16) * hd * 16;
#if MS_BF16_DOT
            if (half) {
                bf16 *kt = (bf16 *)r->k[b] + at + tile + (p % 16) * 2;
                bf16 *vp = (bf16 *)r->v[b] + at + (g * (cap / 2) + p / 2) * hd * 2 + p % 2;
                for (long i = 0; i < hd; i++) {
                    kt[(i / 2) * 32 + i % 2] = to_bf16(k[g * hd + i]);
                    vp[i * 2] = to_bf16(v[g * hd + i]);
                }
                continue;
            }
#endif
            auto store = [&](auto *kc, auto *vc) {
                kc += at + tile + p % 16;
                vc += at + (g * cap + p) * hd;
                for (long i = 0; i < hd; i++) {
                    kv_store(kc + i * 16, k[g * hd + i]);
                    kv_store(vc + i, v[g * hd + i]);
                }
            };
            if (f16s) store((f16 *)r->k[b], (f16 *)r->v[b]);
            else store((float *)r->k[b], (float *)r->v[b]);
        }
    });
    // every (row, kv head, block) on whichever thread is free; each writes its own partial
    std::atomic<long> next{0};
    const long n_items = (long)items.size(), part_stride = group * (hd + 2);
    parallel(m->threads, [&](int t, int) {
        float *s = sc->s + t * group * BLOCK;
        for (long i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n_items;) {
            const Item it = items[i];
            const long cap = r->cap[it.b], p0 = it.j * BLOCK, len = r->pos[it.b] + 1;
            const long from = std::max(p0, first_seen(len - 1, w.window));
            const long to = len - p0 < BLOCK ? len : p0 + BLOCK;
            const long at = layer * KV * cap * hd + it.g * cap * hd;  // this kv head's start
            const float *q = sc->qkv + it.b * QKV + it.g * group * hd;
            float *part = sc->part + ((it.b * KV + it.g) * sc->blocks + it.j) * part_stride;
#if MS_BF16_DOT
            if (half) {
                attend_block_bh(q, (const bf16 *)r->k[it.b] + at, (const bf16 *)r->v[it.b] + at,
                                group, from, to, hd, scale, s, part);
                continue;
            }
#endif
            if (f16s)
                attend_block(q, (const f16 *)r->k[it.b] + at, (const f16 *)r->v[it.b] + at,
                             group, from, to, hd, scale, s, part);
            else
                attend_block(q, (const float *)r->k[it.b] + at, (const float *)r->v[it.b] + at,
                             group, from, to, hd, scale, s, part);
        }
    });
    for_rows(m->threads, r->n, [&](long b) {
        const long first = first_seen(r->pos[b], w.window) / BLOCK;
        const long blocks = (r->pos[b] + 1 + BLOCK - 1) / BLOCK - first;
        for (long head = 0; head < H; head++) {
            const long g = head / group, h = head % group;
            merge_blocks(sc->part + ((b * KV + g) * sc->blocks + first) * part_stride +
                             h * (hd + 2),
                         blocks, part_stride, hd, sc->att + (b * H + head) * hd);
        }
    });
}

// Expert e's rows of a matrix that holds every expert's `rows` rows one after another.
static MsMat expert(const MsMat &all, long e, long rows, long cols) {
    return {(const char *)all.data + e * rows * row_bytes(all.type, cols), all.type, rows};
}

// The experts' feed-forward of n rows (sc->h, normed) into sc->y. Each row: the router's
// softmax over E experts, the top K (ties to the lower id), their weights renormalised to sum
// to 1 (as llama.cpp does for Qwen3 MoE); each expert's SwiGLU; the outputs summed in
// ascending expert id, in float32. The rows are grouped by expert, so that each chosen
// expert's matrices are read once a pass, and a row's products are the same whatever else is
// in its group (linear() computes each row alone): a row's result does not depend on its
// batch.
static void moe(const MsModel *m, const MsLayer &w, long n, Scratch *sc) {
    const long D = m->D, E = m->E, K = m->K, F = m->F;
    // an engine thread each (the lambdas below use these pointers: a thread_local named in
    // them would be the pool thread's own)
    static thread_local std::vector<float> probs_, weight_, gathered_, outs_;
    static thread_local std::vector<long> chosen_;
    probs_.resize(n * E);
    weight_.resize(n * K);
    chosen_.resize(n * K);
    gathered_.resize(n * D);
    outs_.resize(n * K * D);
    float *probs = probs_.data(), *weight = weight_.data(), *gathered = gathered_.data();
    float *outs = outs_.data();
    long *chosen = chosen_.data();
    linear(m, &w.router, 1, nullptr, sc->h, n, D, probs, sc);
    for_rows(m->threads, n, [&](long b) {
        float *p = probs + b * E, top = p[0], sum = 0.f;
        for (long e = 1; e < E; e++) top = std::max(top, p[e]);
        for (long e = 0; e < E; e++) sum += p[e] = std::exp(p[e] - top);
        for (long e = 0; e < E; e++) p[e] /= sum;
        long *c = chosen + b * K;
        for (long k = 0; k < K; k++) {  // the k-th largest, the lower id among equals
            long best = -1;
            for (long e = 0; e < E; e++) {
                bool taken = false;
                for (long j = 0; j < k; j++) taken |= c[j] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            c[k] = best;
        }
        std::sort(c, c + K);
        float total = 0.f;
        for (long k = 0; k < K; k++) total += p[c[k]];
        for (long k = 0; k < K; k++) weight[b * K + k] = p[c[k]] / total;
    });
    std::vector<long> slots;  // (row, k) of the rows that chose expert e
    for (long e = 0; e < E; e++) {
        slots.clear();
        for (long i = 0; i < n * K; i++)
            if (chosen[i] == e) slots.push_back(i);
        const long cnt = (long)slots.size();
        if (cnt == 0) continue;
        for (long i = 0; i < cnt; i++)
            std::memcpy(gathered + i * D, sc->h + slots[i] / K * D, D * sizeof(float));
        const MsMat gate_up[2] = {expert(w.experts[0], e, F, D), expert(w.experts[1], e, F, D)};
        linear(m, gate_up, 2, nullptr, gathered, cnt, D, sc->gu, sc);
        for_rows(m->threads, cnt, [&](long i) {
            silu_mul(sc->gu + i * 2 * F, sc->gu + i * 2 * F + F, sc->act + i * F, F);
        });
        const MsMat down = expert(w.experts[2], e, D, F);
        linear(m, &down, 1, nullptr, sc->act, cnt, F, sc->y, sc);
        for (long i = 0; i < cnt; i++)
            std::memcpy(outs + slots[i] * D, sc->y + i * D, D * sizeof(float));
    }
    for_rows(m->threads, n, [&](long b) {
        float *y = sc->y + b * D;
        for (long i = 0; i < D; i++) y[i] = 0.f;
        for (long k = 0; k < K; k++) {  // ascending expert id
            const float a = weight[b * K + k], *o = outs + (b * K + k) * D;
            for (long i = 0; i < D; i++) y[i] += a * o[i];
        }
    });
}

static void forward(const MsModel *m, const MsRows *r, float *scratch) {
    const long n = r->n, D = m->D, I = m->I;
    long max_len = 0;
    for (long b = 0; b < n; b++) max_len = std::max(max_len, r->pos[b] + 1);
    Scratch sc;
    carve(m, n, max_len, scratch, &sc);
    // attention's work, made once for each window the layers have (Gemma: two)
    std::vector<std::pair<long, std::vector<Item>>> work;
    work.reserve(m->layers);  // so that a reference items_for returned stays valid
    auto items_for = [&](long window) -> const std::vector<Item> & {
        for (const auto &w : work)
            if (w.first == window) return w.second;
        work.emplace_back(window, attention_items(m, r, window));
        return work.back().second;
    };
    for_rows(m->threads, n, [&](long b) {
        matrix_row(m->embed, r->token[b], D, m->embed_scale, sc.x + b * D);
    });
    if (m->embed_mapped) embed_hand_back(m->embed, D);
    for (long l = 0; l < m->layers; l++) {
        const MsLayer &w = m->layer[l];
        norm(m, sc.x, w.attn_norm, sc.h, n);
        linear(m, w.qkv, 3, w.bqkv, sc.h, n, D, sc.qkv, &sc);
        attention(m, r, l, &sc, items_for(w.window));
        linear(m, &w.wo, 1, nullptr, sc.att, n, m->H * m->hd, sc.y, &sc);
        if (w.attn_out_norm != nullptr) norm(m, sc.y, w.attn_out_norm, sc.y, n);
        for (long i = 0; i < n * D; i++) sc.x[i] += sc.y[i];
        norm(m, sc.x, w.mlp_norm, sc.h, n);
        if (w.router.data != nullptr) {
            moe(m, w, n, &sc);
        } else {
            for (long c0 = 0; c0 < n; c0 += FFN_ROWS) {  // see FFN_ROWS
                const long cn = std::min(FFN_ROWS, n - c0);
                linear(m, w.gate_up, 2, nullptr, sc.h + c0 * D, cn, D, sc.gu, &sc);
                for_rows(m->threads, cn, [&](long b) {
                    const float *gate = sc.gu + b * 2 * I, *up = gate + I;
                    if (m->gelu) gelu_mul(gate, up, sc.act + b * I, I);
                    else silu_mul(gate, up, sc.act + b * I, I);
                });
                linear(m, &w.w2, 1, nullptr, sc.act, cn, I, sc.y + c0 * D, &sc);
            }
        }
        if (w.mlp_out_norm != nullptr) norm(m, sc.y, w.mlp_out_norm, sc.y, n);
        for (long i = 0; i < n * D; i++) sc.x[i] += sc.y[i];
    }
    for (long o = 0; o < r->n_out; o++)  // the rows asked for, side by side
        std::memcpy(sc.y + o * D, sc.x + r->out[o] * D, D * sizeof(float));
    norm(m, sc.y, m->final_norm, sc.h, r->n_out);
    linear(m, &m->lm_head, 1, nullptr, sc.h, r->n_out, D, r->logits, &sc);
}

// ---------------------------------------------------------------- C entry points (ctypes)

// ---------------------------------------------------------------- the sampler's top-k

// The k largest of n floats (0 < k < n), for a sampler's top-k over a row of logits: their
// positions, ascending, in ids and their values in vals. Returns 1; 0 where the row has a NaN,
// the k-th largest is not finite, or another value equals it (top-k keeps ties): the caller
// then filters the whole row. One pass keeps the values above a threshold that rises as
// candidates gather (nearly every logit is below it after the first few thousand), then one
// counts the values >= the k-th. The set is the same as any exact selection's (numpy's
// argpartition), since a tie at the k-th refuses.
static long top_k(const float *a, long n, long k, int64_t *ids, float *vals) {
    typedef std::pair<float, int64_t> Entry;
    if (k <= 0 || k >= n) return 0;
    auto greater = [](const Entry &x, const Entry &y) { return x.first > y.first; };
    std::vector<Entry> c;
    c.reserve(std::min(4 * k, n));
    float t = a[0];
    for (long i = 0; i < k; i++) {
        if (a[i] != a[i]) return 0;  // NaN (none reaches the selection: its order needs none)
        c.emplace_back(a[i], i);
        t = std::min(t, a[i]);
    }
    // 16 at a time: most runs of 16 hold nothing above the threshold (and no NaN), and
    // one comparison of the 16 (a vector one, compiled) skips them
    for (long i0 = k; i0 < n; i0 += 16) {
        const long end = std::min(n, i0 + 16);
        if (end - i0 == 16) {
            int above = 0;
            for (int j = 0; j < 16; j++) above |= !(a[i0 + j] <= t);
            if (!above) continue;
        }
        for (long i = i0; i < end; i++) {
            if (!(a[i] > t)) {
                if (a[i] != a[i]) return 0;
                continue;
            }
            c.emplace_back(a[i], i);
            if ((long)c.size() == 4 * k) {  // keep the k largest: the threshold is now the k-th
                std::nth_element(c.begin(), c.begin() + (k - 1), c.end(), greater);
                c.resize(k);
                t = c[k - 1].first;
            }
        }
    }
    std::nth_element(c.begin(), c.begin() + (k - 1), c.end(), greater);
    c.resize(k);
    const float kth = c[k - 1].first;
    if (!std::isfinite(kth)) return 0;
    long at_least = 0;
    for (long i = 0; i < n; i++) at_least += a[i] >= kth;
    if (at_least != k) return 0;
    std::sort(c.begin(), c.end(), [](const Entry &x, const Entry &y) { return x.second < y.second; });
    for (long j = 0; j < k; j++) ids[j] = c[j].second, vals[j] = c[j].first;
    return 1;
}

// ---------------------------------------------------------------- the sampler's top-p

// Top-p over a row of n logits: the tokens kept, their positions ascending in ids (room for
// n), and how many (at least 1); 0 where the caller filters the whole row (a NaN, a +inf, no
// finite logit). A token is kept while the tokens ranked above it (larger logit; among equal
// ones the lower position first) hold less than p of the probability, in float64 sums of the
// float32 exp(a - max) (exp_shifted's): the rule of engine/sampling.py's top_p_filter, without
// ranking the row. The probabilities' float32 bits sort as they do: their exponent (an
// octave) and then the mantissa's top 7 bits (128 buckets an octave) place the one bucket
// where the mass from the top reaches p; only that bucket's tokens are ranked.
static long top_p(const float *a, long n, double p, int64_t *ids) {
    if (n <= 0 || !(p > 0.0) || !(p < 1.0)) return 0;
    int nan = 0;
    for (long i = 0; i < n; i++) nan |= a[i] != a[i];
    const float top = max_of(a, n);
    if (nan || !std::isfinite(top)) return 0;
    // each token's probability (unnormalized, exp_shifted's as attention's softmax has them)
    // and its bucket: the float32 bits' top 16
    static thread_local std::vector<float> e_;
    static thread_local std::vector<uint16_t> b_;
    e_.assign(a, a + n);
    b_.resize(n);
    float *e = e_.data();
    uint16_t *bucket = b_.data();
    exp_shifted(e, n, top);
    for (long i = 0; i < n; i++) {
        uint32_t u;
        std::memcpy(&u, e + i, 4);
        bucket[i] = (uint16_t)(u >> 16);
    }
    // the octaves' masses (4 interleaved tables: no add waits for the one before)
    double oct[4][256] = {};
    for (long i = 0; i < n; i++) oct[i & 3][bucket[i] >> 7] += e[i];
    double mass[256], total = 0.0;
    for (int o = 255; o >= 0; o--) total += mass[o] = (oct[0][o] + oct[1][o]) + (oct[2][o] + oct[3][o]);
    const double need = p * total;
    // the octave where the mass from the top reaches need (its tokens may fall either side)
    double above = 0.0;
    int K = -1;
    for (int o = 255; o >= 0; o--) {
        if (mass[o] > 0.0) {
            K = o;
            if (above + mass[o] >= need) break;
        }
        above += mass[o];
    }
    if (K < 0) return 0;
    // within it, the bucket (7 bits more) where it does; the octave's tokens listed
    static thread_local std::vector<int32_t> in_k_;
    in_k_.resize(n);
    int32_t *in_k = in_k_.data();
    long nk = 0, i0 = 0;
#if defined(__AVX512BW__)
    const __m512i want = _mm512_set1_epi16((short)K);
    for (; i0 + 32 <= n; i0 += 32) {  // 32 buckets a compare: most runs hold none of the octave
        const __m512i b = _mm512_srli_epi16(_mm512_loadu_si512(bucket + i0), 7);
        const uint32_t m = _mm512_cmpeq_epi16_mask(b, want);
        if (!m) continue;
        const __m512i at = _mm512_add_epi32(_mm512_set1_epi32((int)i0), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        // compressed in a register and stored whole (a compressing store to memory is
        // microcoded on Zen 4): nk <= i0, so 16 lanes at nk stay inside the n of in_k
        _mm512_storeu_si512(in_k + nk, _mm512_maskz_compress_epi32((__mmask16)m, at));
        nk += __builtin_popcount(m & 0xffff);
        _mm512_storeu_si512(in_k + nk, _mm512_maskz_compress_epi32((__mmask16)(m >> 16), _mm512_add_epi32(at, _mm512_set1_epi32(16))));
        nk += __builtin_popcount(m >> 16);
    }
#endif
    for (long i = i0; i < n; i++) {
        in_k[nk] = (int32_t)i;
        nk += (bucket[i] >> 7) == K;
    }
    double sub[4][128] = {};
    for (long j = 0; j < nk; j++) sub[j & 3][bucket[in_k[j]] & 127] += e[in_k[j]];
    for (int t = 0; t < 128; t++) sub[0][t] = (sub[0][t] + sub[1][t]) + (sub[2][t] + sub[3][t]);
    int S = -1;
    for (int s = 127; s >= 0; s--) {
        if (sub[0][s] > 0.0) {
            S = s;
            if (above + sub[0][s] >= need) break;
        }
        above += sub[0][s];
    }
    if (S < 0) return 0;
    const uint16_t edge = (uint16_t)((K << 7) | S);
    // that bucket's tokens ranked (larger logit first, then the lower position), kept while
    // the mass above them is short of need
    std::vector<std::pair<float, int64_t>> ranked;
    for (long j = 0; j < nk; j++)
        if (bucket[in_k[j]] == edge) ranked.emplace_back(a[in_k[j]], in_k[j]);
    std::sort(ranked.begin(), ranked.end(), [](const std::pair<float, int64_t> &x, const std::pair<float, int64_t> &y) {
        return x.first > y.first || (x.first == y.first && x.second < y.second);
    });
    std::vector<int64_t> inside;
    for (const auto &t : ranked) {
        if (!(above < need)) break;
        above += e[t.second];
        inside.push_back(t.second);
    }
    std::sort(inside.begin(), inside.end());
    // every token of a bucket above the edge (no branch: the store is undone by not counting
    // it), then the edge's kept ones merged in, positions ascending
    long count = 0, i1 = 0;
#if defined(__AVX512BW__)
    const __m512i at_edge = _mm512_set1_epi16((short)edge);
    for (; i1 + 32 <= n; i1 += 32) {  // the positions of 32 buckets, those above the edge kept
        // (as above: count <= i1, so the 8 lanes stored at count stay inside ids' n)
        const uint32_t m = _mm512_cmpgt_epu16_mask(_mm512_loadu_si512(bucket + i1), at_edge);
        if (!m) continue;
        const __m512i base = _mm512_add_epi64(_mm512_set1_epi64(i1), _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7));
        for (int q = 0; q < 4; q++) {
            const __mmask8 part = (__mmask8)(m >> (8 * q));
            _mm512_storeu_si512(ids + count, _mm512_maskz_compress_epi64(part, _mm512_add_epi64(base, _mm512_set1_epi64(8 * q))));
            count += __builtin_popcount(part);
        }
    }
#endif
    for (long i = i1; i < n; i++) {
        ids[count] = i;
        count += bucket[i] > edge;
    }
    long from = count - 1, in = (long)inside.size() - 1, to = count + (long)inside.size() - 1;
    for (; in >= 0; to--)
        ids[to] = from >= 0 && ids[from] > inside[in] ? ids[from--] : inside[in--];
    return count + (long)inside.size();
}

extern "C" {

// Every struct ctypes mirrors (miniserve/runners/native.py), as "Struct=size Struct.field=offset
// ...": the library is refused where its mirror disagrees on any of them.
const char *ms_layout(void) {
    static const std::string layout = [] {
        std::string out;
        auto add = [&](const char *name, size_t value) {
            out += name;
            out += '=' + std::to_string(value) + ' ';
        };
#define MS_FIELD(S, f) add(#S "." #f, offsetof(S, f))
        add("MsMat", sizeof(MsMat));
        MS_FIELD(MsMat, data), MS_FIELD(MsMat, type), MS_FIELD(MsMat, rows);
        add("MsLayer", sizeof(MsLayer));
        MS_FIELD(MsLayer, attn_norm), MS_FIELD(MsLayer, qkv), MS_FIELD(MsLayer, bqkv);
        MS_FIELD(MsLayer, wo), MS_FIELD(MsLayer, mlp_norm), MS_FIELD(MsLayer, gate_up);
        MS_FIELD(MsLayer, w2), MS_FIELD(MsLayer, q_norm), MS_FIELD(MsLayer, k_norm);
        MS_FIELD(MsLayer, attn_out_norm), MS_FIELD(MsLayer, mlp_out_norm);
        MS_FIELD(MsLayer, cos), MS_FIELD(MsLayer, sin), MS_FIELD(MsLayer, window);
        MS_FIELD(MsLayer, router), MS_FIELD(MsLayer, experts);
        add("MsModel", sizeof(MsModel));
        MS_FIELD(MsModel, layers), MS_FIELD(MsModel, D), MS_FIELD(MsModel, H);
        MS_FIELD(MsModel, KV), MS_FIELD(MsModel, hd), MS_FIELD(MsModel, I);
        MS_FIELD(MsModel, V), MS_FIELD(MsModel, rot), MS_FIELD(MsModel, E);
        MS_FIELD(MsModel, K), MS_FIELD(MsModel, F), MS_FIELD(MsModel, embed);
        MS_FIELD(MsModel, lm_head), MS_FIELD(MsModel, final_norm), MS_FIELD(MsModel, layer);
        MS_FIELD(MsModel, eps), MS_FIELD(MsModel, embed_scale), MS_FIELD(MsModel, attn_scale);
        MS_FIELD(MsModel, gelu), MS_FIELD(MsModel, rope_pairs), MS_FIELD(MsModel, math);
        MS_FIELD(MsModel, threads), MS_FIELD(MsModel, kv_half), MS_FIELD(MsModel, embed_mapped);
        add("MsRows", sizeof(MsRows));
        MS_FIELD(MsRows, n), MS_FIELD(MsRows, n_out), MS_FIELD(MsRows, token);
        MS_FIELD(MsRows, pos), MS_FIELD(MsRows, cap), MS_FIELD(MsRows, out);
        MS_FIELD(MsRows, k), MS_FIELD(MsRows, v), MS_FIELD(MsRows, logits);
#undef MS_FIELD
        return out;
    }();
    return layout.c_str();
}

// Which inner loops were compiled: "avx512", "avx2" (with FMA; "avx2+vnni" with AVX-VNNI's
// int8 products) or "generic" (plain loops; "generic+neon" where the compiler could use NEON
// for them).
const char *ms_isa(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__AVXVNNI__)
    return "avx2+vnni";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#elif defined(__ARM_NEON)
    return "generic+neon";
#else
    return "generic";
#endif
}

// 1 where bfloat16 products run on AVX512_BF16's vdpbf16ps.
int ms_bf16_dot(void) { return MS_BF16_DOT; }

// What this model's KV cache holds: 2 bfloat16 (see kv_bf16), 1 float16 (kv_f16), 0 float32.
int ms_kv_type(const MsModel *m) { return kv_bf16(m) ? 2 : kv_f16(m) ? 1 : 0; }

// Floats of scratch a pass of n rows needs when its longest row ends at max_len positions.
long ms_scratch_floats(const MsModel *m, long n, long max_len) {
    Scratch sc;
    return carve(m, n, max_len, nullptr, &sc);
}

// scratch: ms_scratch_floats() floats, 64-byte aligned.
void ms_forward(const MsModel *m, const MsRows *r, float *scratch) { forward(m, r, scratch); }

// Bytes of a row of `cols` weights of a type (ggml's id); -1 where this library does not run
// that type in place, or the width does not divide into its blocks.
long ms_row_bytes(long type, long cols) { return row_bytes(type, cols); }

// top_k (above): 1 with the k largest of a[0..n) in ids / vals, 0 where the caller must filter
// the whole row.
long ms_top_k(const float *a, long n, long k, int64_t *ids, float *vals) { return top_k(a, n, k, ids, vals); }

// top_p (above): how many tokens top-p keeps of a[0..n), their positions ascending in ids (room
// for n); 0 where the caller must filter the whole row.
long ms_top_p(const float *a, long n, double p, int64_t *ids) { return top_p(a, n, p, ids); }

// y (B x w.rows) = x (B x C) w^T, math for float32 / bfloat16 weights: the kernel alone, for
// tests and measurements.
void ms_matmul(const MsMat *w, const float *x, float *y, long B, long C, int math, int threads) {
    MsModel m = {};
    m.math = math;
    m.threads = threads;
    std::vector<float> xr(B * C);
    std::vector<bf16> xb(B * C);
    std::vector<char> q8(B * act_row_bytes(ACT_A8, C)), q8k(B * act_row_bytes(ACT_A8K, C));
    Scratch sc = {};
    sc.xr = xr.data();
    sc.xb = xb.data();
    sc.xq8 = q8.data();
    sc.xq8k = q8k.data();
    linear(&m, w, 1, nullptr, x, B, C, y, &sc);
}

// Whether Q4_K / Q5_K products of many rows run on AMX tiles: on < 0 asks, 0 or 1 sets (where
// the build and the CPU have them; MINISERVE_AMX=0 sets 0 at start). Returns the state.
int ms_amx(int on) {
#if defined(MS_AMX)
    if (on >= 0) amx_switch.store(on ? 1 : 0);
    return amx_on() ? 1 : 0;
#else
    (void)on;
    return 0;
#endif
}

// The type a matrix of `rows` x `cols` weights of `type` repacks to for this build (ms_pack),
// or -1 where it stays as stored: Q4_K with rows in whole 16s in the AVX-512 build (with AMX
// tiles too: those unpack the strips, amx_unpack_p45; a Q4_K row as stored read one row at a
// time measured 15-20% slower a decoded token on a Xeon with AMX), and in whole 8s in the AVX2
// build; Q6_K with rows in whole 16s in the AVX-512 build, in whole 8s in the AVX2 one (the
// Llama 3.2 1B Q4_K_M shape's one-row pass on a Xeon, x86-64-v3: 45.9-46.5 -> 35.3-36.0 ms);
// Q5_K with rows in whole 16s in the AVX-512 build (the 1B Q5_K_M shape on a Xeon: one row
// 41.5-43.0 -> 35.4-35.8 ms, 8 rows 76.5-78.5 -> 63.1-63.8), in whole 8s in the AVX2 one (on a
// Xeon one row had measured 35.3 -> 38-39 ms that way, 8 rows 118 -> 95; on an AMD Zen 3 the
// 1B Q5_K_M file's decode 1.34-1.43x the rows as stored's, its 512-token prompt 1.25-1.9x);
// the 32-weight types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) with rows in whole 16s in the AVX-512
// build, 8s in the AVX2 one; IQ4_XS, Q3_K and Q2_K with rows in whole 16s in the AVX-512 build (the
// 1B IQ4_XS shape on a Xeon: 64 rows 738 -> 347 ms, 8 rows 94 -> 60, one row 29.6 -> 27.4; the
// 1B Q3_K_M shape: 64 rows 611 -> 326 ms, 8 rows 85 -> 54, one row 33.6 -> 27.5), in whole 8s
// in the AVX2 one (one thread, in L2, against the rows as stored on a Zen 3: 1.6-2.5x).
long ms_pack_type(long type, long rows, long cols) {
#if defined(MSKQ_AVX512)
    if (type == T_Q4_K && rows > 0 && rows % 16 == 0 && cols > 0 && cols % 256 == 0)
        return T_Q4_K_P16;
    if (type == T_Q5_K && rows > 0 && rows % 16 == 0 && cols > 0 && cols % 256 == 0) return T_Q5_K_P16;
    if (type == T_Q6_K && rows > 0 && rows % 16 == 0 && cols > 0 && cols % 256 == 0) return T_Q6_K_P16;
    if (type == T_IQ4_XS && rows > 0 && rows % 16 == 0 && cols > 0 && cols % 256 == 0) return T_IQ4_XS_P16;
    if (type == T_Q3_K && rows > 0 && rows % 16 == 0 && cols > 0 && cols % 256 == 0) return T_Q3_K_P16;
    if (type == T_Q2_K && rows > 0 && rows % 16 == 0 && cols > 0 && cols % 256 == 0) return T_Q2_K_P16;
#elif defined(MSKQ_AVX2)
    if (type == T_Q4_K && rows > 0 && rows % 8 == 0 && cols > 0 && cols % 256 == 0) return T_Q4_K_P8;
    if (type == T_Q5_K && rows > 0 && rows % 8 == 0 && cols > 0 && cols % 256 == 0) return T_Q5_K_P8;
    if (type == T_Q3_K && rows > 0 && rows % 8 == 0 && cols > 0 && cols % 256 == 0) return T_Q3_K_P8;
    if (type == T_Q2_K && rows > 0 && rows % 8 == 0 && cols > 0 && cols % 256 == 0) return T_Q2_K_P8;
    if (type == T_IQ4_XS && rows > 0 && rows % 8 == 0 && cols > 0 && cols % 256 == 0) return T_IQ4_XS_P8;
    if (type == T_Q6_K && rows > 0 && rows % 8 == 0 && cols > 0 && cols % 256 == 0) return T_Q6_K_P8;
#endif
#if defined(MSQ_AVX512) || defined(MSQ_AVX2)
    if ((type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 || type == T_Q8_0 || type == T_IQ4_NL) && rows > 0 &&
        rows % MSQ_STRIP == 0 && cols > 0 && cols % 32 == 0)
        return T_PACKED_32 + type;
#endif
    (void)type, (void)rows, (void)cols;
    return -1;
}

// w's rows (C weights each) repacked into out (w->rows * ms_row_bytes(ms_pack_type(...), C)
// bytes, 64-byte aligned), on the engine's threads; returns the new type, or -1 (out untouched)
// where ms_pack_type says none.
long ms_pack(const MsMat *w, long C, void *out, int threads) {
    const long type = ms_pack_type(w->type, w->rows, C);
    if (type < 0) return -1;
    const Kernels *k = kernels_for(type);
    const long wrow = row_bytes(w->type, C), prow = row_bytes(type, C);
    parallel(threads, [&](int t, int n) {
        for (long s = t; s < w->rows / k->strip; s += n)
            k->pack(C, (const char *)w->data + k->strip * s * wrow, wrow, (char *)out + k->strip * s * prow);
    });
    return type;
}

// Maps each page of [p, p + n) (`page` bytes apart) as a write to it would, changing no byte: an
// atomic add of 0 to one byte a page, so that other threads may write the memory meanwhile (a
// load faults its packed arena in on a thread of its own while it reads the tokenizer). Plain
// page faults, which the kernel serves under the one mapping's lock, where madvise's
// MADV_POPULATE_WRITE holds the process's map lock, stalling every mmap of the other threads.
// (An atomic add of 0 whose result is unused, compilers may turn into a load, which maps the
// shared zero page: x86 gets the instruction written out, elsewhere a volatile atomic.)
void ms_fault_in(void *p, long n, long page) {
    for (long i = 0; i < n; i += page) {
#if defined(__x86_64__) || defined(__i386__)
        __asm__ __volatile__("lock orb $0, %0" : "+m"(*((char *)p + i)) : : "memory");
#else
        __atomic_fetch_or((volatile char *)p + i, (char)0, __ATOMIC_RELAXED);
#endif
    }
}

// y (w.rows x C) = the matrix's rows as float32 (what the kernels read the blocks as).
void ms_dequant(const MsMat *w, long C, float *y) {
    for (long r = 0; r < w->rows; r++) matrix_row(*w, r, C, 1.f, y + r * C);
}

}  // extern "C"
