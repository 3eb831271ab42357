// One decode step of a Llama-family layer for a single new token, on the CPU.
//
// The same computation as miniserve/lean.py (read that first; this file mirrors it), written
// as plain loops so that a step costs what its weights cost to read from memory and little
// else: PyTorch spends ~10 us per small op, ~45 ops per layer, for vectors of 576 numbers.
//
//   attn_block:  x += Wo . attention(rope(Wqkv . rmsnorm(x)), KV cache)
//   mlp_block:   x += W2 . (silu(gate) * up),  gate|up = W13 . rmsnorm(x)
//   lm_head:     logits = Wlm . rmsnorm(x)
//
// Weights are float32 or bfloat16 (W); activations and the KV cache are float32. With
// bfloat16 weights this computes exactly what a float32 model holding those same (rounded)
// weights computes, which is what the tests compare it with. Sums use float32 accumulators
// in another order than PyTorch's: results agree to rounding, not bit for bit.
//
// Threads: the matrix-vector products (by rows) and attention (by positions) are split over a
// small pool of our own (the calling thread plus threads-1 helpers). A step hands out ~150
// pieces of work of 20-200 us each; helpers spin briefly between them, and sleep when no step
// is running. Not OpenMP: once two Python threads have used PyTorch's OpenMP pool (the web
// server loads the model on one thread and decodes on another), each parallel region wakes
// its threads through the kernel, which measured 30% slower per token here.
//
// Built at first use by miniserve/native.py with the system C++ compiler (-O3 and, by default,
// -march=native). Three versions of the inner loops, chosen when compiling: AVX-512 (16 floats
// a vector), AVX2 + FMA (8 floats), and plain loops written for the compiler to vectorize on
// any target (SSE2, NEON). ms_isa() says which one was built.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
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
            // Spin for up to ~100 us (the Python between two calls of a step takes ~10 us);
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


// ---------------------------------------------------------------- dot products, row by row

#if defined(__AVX512F__)
static inline __m512 load16(const bf16 *p) {  // 16 bfloat16 -> 16 float32: widen, shift left
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8(const bf16 *p) {  // 8 bfloat16 -> 8 float32: widen, shift left
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

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

// y[r] = sum_c w[r, c] * x[c] for rows [r0, r1). Measured on the model's matrices (2 cores,
// weights streamed from memory): float32 is fastest four rows per pass (x loaded once for four
// weight streams), ~23 GB/s; bfloat16 one row at a time with two accumulators and a software
// prefetch 1 KB ahead, ~19 GB/s (four rows per pass: ~16 GB/s).
// The AVX2 loops, measured the same way on an AVX-512 CPU built for AVX2: float32 one row at a
// time with two accumulators, ~28 GB/s (four rows per pass: ~20 GB/s; with the prefetch:
// ~25 GB/s); bfloat16 as above, ~25 GB/s (without the prefetch: ~23 GB/s). The plain loops
// below get ~27 GB/s (float32) and ~25 GB/s (bfloat16): reading the weights is the cost.
static void dot_rows(const float *w, const float *x, float *y, long r0, long r1, long cols) {
    long r = r0;
#if defined(__AVX512F__)
    if (cols % 16 == 0) {
        for (; r + 4 <= r1; r += 4) {
            const float *w0 = w + r * cols, *w1 = w0 + cols, *w2 = w1 + cols, *w3 = w2 + cols;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (long c = 0; c < cols; c += 16) {
                __m512 xv = _mm512_loadu_ps(x + c);
                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + c), xv, a0);
                a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w1 + c), xv, a1);
                a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w2 + c), xv, a2);
                a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w3 + c), xv, a3);
            }
            y[r] = _mm512_reduce_add_ps(a0);
            y[r + 1] = _mm512_reduce_add_ps(a1);
            y[r + 2] = _mm512_reduce_add_ps(a2);
            y[r + 3] = _mm512_reduce_add_ps(a3);
        }
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (cols % 8 == 0) {
        for (; r < r1; r++) {
            const float *row = w + r * cols;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0;
            long c = 0;
            for (; c + 16 <= cols; c += 16) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(row + c), _mm256_loadu_ps(x + c), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(row + c + 8), _mm256_loadu_ps(x + c + 8),
                                     a1);
            }
            if (c < cols)  // 8 left
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(row + c), _mm256_loadu_ps(x + c), a0);
            y[r] = hsum8(_mm256_add_ps(a0, a1));
        }
    }
#endif
    for (; r < r1; r++) y[r] = row_dot(w + r * cols, x, cols);
}

static void dot_rows(const bf16 *w, const float *x, float *y, long r0, long r1, long cols) {
    long r = r0;
#if defined(__AVX512F__)
    if (cols % 32 == 0) {
        for (; r < r1; r++) {
            const bf16 *row = w + r * cols;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0;
            for (long c = 0; c < cols; c += 32) {  // 32 weights = one 64-byte cache line
                _mm_prefetch((const char *)(row + c) + 1024, _MM_HINT_T0);
                a0 = _mm512_fmadd_ps(load16(row + c), _mm512_loadu_ps(x + c), a0);
                a1 = _mm512_fmadd_ps(load16(row + c + 16), _mm512_loadu_ps(x + c + 16), a1);
            }
            y[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
        }
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (cols % 16 == 0) {
        for (; r < r1; r++) {
            const bf16 *row = w + r * cols;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0;
            long c = 0;
            for (; c + 32 <= cols; c += 32) {  // 32 weights = one 64-byte cache line
                _mm_prefetch((const char *)(row + c) + 1024, _MM_HINT_T0);
                a0 = _mm256_fmadd_ps(load8(row + c), _mm256_loadu_ps(x + c), a0);
                a1 = _mm256_fmadd_ps(load8(row + c + 8), _mm256_loadu_ps(x + c + 8), a1);
                a0 = _mm256_fmadd_ps(load8(row + c + 16), _mm256_loadu_ps(x + c + 16), a0);
                a1 = _mm256_fmadd_ps(load8(row + c + 24), _mm256_loadu_ps(x + c + 24), a1);
            }
            if (c < cols) {  // 16 left
                a0 = _mm256_fmadd_ps(load8(row + c), _mm256_loadu_ps(x + c), a0);
                a1 = _mm256_fmadd_ps(load8(row + c + 8), _mm256_loadu_ps(x + c + 8), a1);
            }
            y[r] = hsum8(_mm256_add_ps(a0, a1));
        }
    }
#endif
    for (; r < r1; r++) y[r] = row_dot(w + r * cols, x, cols);
}

// y = W x (+ b), W of shape (rows, cols), rows split evenly over the threads.
template <typename W>
static void matvec(const W *w, const W *bias, const float *x, float *y, long rows, long cols,
                   int threads) {
    parallel(threads, [&](int t, int n) {
        long per = ((rows + n - 1) / n + 3) / 4 * 4;  // a multiple of 4 rows per thread
        long r0 = t * per, r1 = r0 + per < rows ? r0 + per : rows;
        if (r0 < r1) {
            dot_rows(w, x, y, r0, r1, cols);
            if (bias)
                for (long r = r0; r < r1; r++) y[r] += load(bias, r);
        }
    });
}

// out = weight * x / sqrt(mean(x^2) + eps)
template <typename W>
static void rms_norm(const float *x, const W *weight, float eps, float *out, long n) {
    float ss = 0.f;
    for (long i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.f / std::sqrt(ss / n + eps);
    for (long i = 0; i < n; i++) out[i] = load(weight, i) * (x[i] * inv);
}

// In place: v = v * cos + rotate_half(v) * sin, for `heads` vectors of head_dim numbers.
static void rope(float *v, long heads, long hd, const float *cos, const float *sin) {
    long half = hd / 2;
    float tmp[1024];
    for (long h = 0; h < heads; h++) {
        float *p = v + h * hd;
        std::memcpy(tmp, p, hd * sizeof(float));
        for (long i = 0; i < hd; i++) {
            float rotated = i < half ? -tmp[i + half] : tmp[i - half];
            p[i] = tmp[i] * cos[i] + rotated * sin[i];
        }
    }
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

static inline float dot(const float *a, const float *b, long n) {
#if defined(__AVX512F__)
    if (n % 16 == 0) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
        for (long i = 16; i < n; i += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
        return _mm512_reduce_add_ps(acc);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (n % 8 == 0) {
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
        for (long i = 8; i < n; i += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        return hsum8(acc);
    }
#endif
    return row_dot(a, b, n);
}

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
        __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), topv));
        _mm512_mask_storeu_ps(s + j, m, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
    }
    total = _mm512_reduce_add_ps(sum);
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

// One thread's part of attention: positions [j0, j1) of one cached key/value head, for the
// `group` query heads that share it (each key and value is read once for all of them). Per
// head h: m[h] = the largest score, l[h] = sum of e^(score - m[h]), o[h] = sum of
// e^(score - m[h]) v_j (divided by the total only when the parts are merged).
// s: scratch for group * (j1 - j0) scores.
static void attend_part(const float *q, const float *k, const float *v, long group, long j0,
                        long j1, long hd, float scale, float *s, float *o, float *l, float *m) {
    const long len = j1 - j0;
    for (long h = 0; h < group; h++) {
        m[h] = -INFINITY;
        l[h] = 0.f;
        for (long i = 0; i < hd; i++) o[h * hd + i] = 0.f;
    }
    if (len <= 0) return;
    for (long j = j0; j < j1; j++)
        for (long h = 0; h < group; h++) {
            float score = dot(q + h * hd, k + j * hd, hd) * scale;
            s[h * len + j - j0] = score;
            m[h] = score > m[h] ? score : m[h];
        }
    for (long h = 0; h < group; h++) l[h] = exp_shifted(s + h * len, len, m[h]);
    for (long j = j0; j < j1; j++)
        for (long h = 0; h < group; h++) axpy(o + h * hd, s[h * len + j - j0], v + j * hd, hd);
}

// ---------------------------------------------------------------- the two halves of a layer

template <typename W>
static void attn_block(float *x, const W *norm_w, float eps, const W *wqkv, const W *bqkv,
                       const W *wo, const float *cos, const float *sin, float *k_cache,
                       float *v_cache, long capacity, long pos, long D, long H, long KV,
                       long hd, float *scratch, int threads) {
    float *h = scratch;                  // D
    float *qkv = h + D;                  // (H + 2 KV) hd
    float *att = qkv + (H + 2 * KV) * hd;  // H hd
    float *y = att + H * hd;             // D
    float *scores = y + D;  // H (pos + 1 + 2 threads), then the threads' parts (ms_threads)
    rms_norm(x, norm_w, eps, h, D);
    matvec(wqkv, bqkv, h, qkv, (H + 2 * KV) * hd, D, threads);
    float *q = qkv, *k = qkv + H * hd, *v = k + KV * hd;
    rope(q, H, hd, cos, sin);
    rope(k, KV, hd, cos, sin);
    for (long g = 0; g < KV; g++)  // append this position's keys and values to the cache
        for (long i = 0; i < hd; i++) {
            k_cache[(g * capacity + pos) * hd + i] = k[g * hd + i];
            v_cache[(g * capacity + pos) * hd + i] = v[g * hd + i];
        }
    // Attention, softmax(q k^T / sqrt(hd)) v per head: the positions are split over the
    // threads; each thread's part is merged by rescaling to the largest score (the softmax
    // of a split sequence, as flash-decoding does).
    const long S = pos + 1, group = H / KV;
    const float scale = 1.f / std::sqrt((float)hd);
    const int n_parts = pool_for(threads)->size();
    float *parts = scores + H * (S + 2 * n_parts);  // per thread: H hd outputs, H sums, H maxima
    parallel(threads, [&](int t, int n) {
        long per = (S + n - 1) / n;
        long j0 = t * per < S ? t * per : S, j1 = j0 + per < S ? j0 + per : S;
        float *o = parts + t * H * (hd + 2), *l = o + H * hd, *m = l + H;
        float *s = scores + t * group * (per + 1);
        for (long g = 0; g < KV; g++)
            attend_part(q + g * group * hd, k_cache + g * capacity * hd,
                        v_cache + g * capacity * hd, group, j0, j1, hd, scale, s,
                        o + g * group * hd, l + g * group, m + g * group);
    });
    for (long head = 0; head < H; head++) {
        float top = -INFINITY, total = 0.f, *out = att + head * hd;
        for (int t = 0; t < n_parts; t++) {
            float mt = parts[t * H * (hd + 2) + H * hd + H + head];
            top = mt > top ? mt : top;
        }
        for (long i = 0; i < hd; i++) out[i] = 0.f;
        for (int t = 0; t < n_parts; t++) {
            const float *o = parts + t * H * (hd + 2), *l = o + H * hd, *m = l + H;
            if (l[head] == 0.f) continue;  // a thread with no positions
            float c = std::exp(m[head] - top);
            total += c * l[head];
            axpy(out, c, o + head * hd, hd);
        }
        for (long i = 0; i < hd; i++) out[i] /= total;
    }
    matvec(wo, (const W *)nullptr, att, y, D, H * hd, threads);
    for (long i = 0; i < D; i++) x[i] += y[i];
}

template <typename W>
static void mlp_block(float *x, const W *norm_w, float eps, const W *w13, const W *w2, long D,
                      long I, float *scratch, int threads) {
    float *h = scratch, *gate_up = h + D, *act = gate_up + 2 * I, *y = act + I;
    rms_norm(x, norm_w, eps, h, D);
    matvec(w13, (const W *)nullptr, h, gate_up, 2 * I, D, threads);
    for (long i = 0; i < I; i++) {
        float g = gate_up[i];
        act[i] = g / (1.f + std::exp(-g)) * gate_up[I + i];
    }
    matvec(w2, (const W *)nullptr, act, y, D, I, threads);
    for (long i = 0; i < D; i++) x[i] += y[i];
}

template <typename W>
static void lm_head(const float *x, const W *norm_w, float eps, const W *w, float *logits,
                    long D, long V, float *scratch, int threads) {
    rms_norm(x, norm_w, eps, scratch, D);
    matvec(w, (const W *)nullptr, scratch, logits, V, D, threads);
}

// ---------------------------------------------------------------- C entry points (ctypes)
// wdtype, the weights' type: 0 = float32, 1 = bfloat16. Pointers are raw tensor data pointers.

extern "C" {

int ms_abi_version(void) { return 5; }

// Which inner loops were compiled: "avx512", "avx2" (with FMA) or "generic" (plain loops;
// "generic+neon" where the compiler could use NEON for them).
const char *ms_isa(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#elif defined(__ARM_NEON)
    return "generic+neon";
#else
    return "generic";
#endif
}

#define MS_DISPATCH(wdtype, call) \
    do {                          \
        if ((wdtype) == 0) {      \
            typedef float W;      \
            call;                 \
        } else {                  \
            typedef bf16 W;       \
            call;                 \
        }                         \
    } while (0)

void ms_attn_block(int wdtype, float *x, const void *norm_w, float eps, const void *wqkv,
                   const void *bqkv, const void *wo, const float *cos, const float *sin,
                   float *k_cache, float *v_cache, long capacity, long pos, long D, long H,
                   long KV, long hd, float *scratch, int threads) {
    MS_DISPATCH(wdtype, attn_block<W>(x, (const W *)norm_w, eps, (const W *)wqkv,
                                      (const W *)bqkv, (const W *)wo, cos, sin, k_cache,
                                      v_cache, capacity, pos, D, H, KV, hd, scratch, threads));
}

void ms_mlp_block(int wdtype, float *x, const void *norm_w, float eps, const void *w13,
                  const void *w2, long D, long I, float *scratch, int threads) {
    MS_DISPATCH(wdtype, mlp_block<W>(x, (const W *)norm_w, eps, (const W *)w13,
                                     (const W *)w2, D, I, scratch, threads));
}

void ms_lm_head(int wdtype, const float *x, const void *norm_w, float eps, const void *w,
                float *logits, long D, long V, float *scratch, int threads) {
    MS_DISPATCH(wdtype, lm_head<W>(x, (const W *)norm_w, eps, (const W *)w, logits, D, V,
                                   scratch, threads));
}

// The number of threads a step runs on (the pool is made by the first call).
int ms_threads(int threads) { return pool_for(threads)->size(); }

// y = W x: the kernel alone, for tests and measurements.
void ms_matvec(int wdtype, const void *w, const float *x, float *y, long rows, long cols,
               int threads) {
    MS_DISPATCH(wdtype, matvec<W>((const W *)w, nullptr, x, y, rows, cols, threads));
}

}  // extern "C"
