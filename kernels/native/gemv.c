/* One row against a bf16 weight on the CPU: y[N] = W[N, K] @ x[K] (+ bias), fp32 accumulation.
 *
 * A decode step's projections are matrix-vector products whose weight has left the cache: the
 * time is the weight's bytes over the memory bandwidth. Each weight byte is read once, rows four
 * at a time (four streams in flight), rows split over `threads` OpenMP threads. The OpenMP
 * runtime is torch's own (libgomp.so.1, loaded by torch first), so the threads are its pool's.
 *
 *   x float32: W's bf16 widened to fp32 by a 16-bit shift, fused multiply-adds (exact products,
 *              the reference's arithmetic up to the summation order)
 *   x bf16:    AVX-512 BF16's dot product of bf16 pairs where the processor has it, else x widened
 *              once and the float32 path
 *
 * W is row-major as stored ([N, K], K contiguous); x, bias and y contiguous. bias (NULL: none) and
 * y are bf16 or float32 by their flags; a bf16 y is rounded to nearest even.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The rows of the next block of four are prefetched while this one is read, each at the point the
 * current block has reached: a row's few instructions per cache line leave the core too few loads
 * in flight to reach the memory's bandwidth from the hardware prefetcher alone (a 248K-row head
 * 25.0 -> 19.6 ms, 2 threads, AVX-512, bf16 x). One block ahead was measured at K = 1024 and 3584
 * (8 and 28 KB); a much wider row prefetches further than L1 holds, into L2 all the same */
#define AHEAD 1

#if defined(__AVX512F__)
static inline __m512 widen16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* rows r..r+R-1 (R <= 4) of W against float32 x */
static inline __attribute__((always_inline)) void rows_f32(const uint16_t *w, const float *x, long K, int R, float *acc_out) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    long k = 0;
    const uintptr_t ahead = (uintptr_t)w + 2 * AHEAD * R * K;  /* bytes; may pass the end: a prefetch never faults */
    for (; k + 16 <= K; k += 16) {
        const __m512 xv = _mm512_loadu_ps(x + k);
        _mm_prefetch((const char *)(ahead + 2 * R * k), _MM_HINT_T0);
        if (R == 4) _mm_prefetch((const char *)(ahead + 2 * R * k + 64), _MM_HINT_T0);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(widen16(_mm256_loadu_si256((const __m256i *)(w + r * K + k))), xv, acc[r]);
    }
    for (int r = 0; r < R; r++) {
        float s = _mm512_reduce_add_ps(acc[r]);
        for (long j = k; j < K; j++) s += bf16_to_float(w[r * K + j]) * x[j];
        acc_out[r] = s;
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 widen8(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) void rows_f32(const uint16_t *w, const float *x, long K, int R, float *acc_out) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    long k = 0;
    const uintptr_t ahead = (uintptr_t)w + 2 * AHEAD * R * K;  /* bytes; may pass the end: a prefetch never faults */
    for (; k + 8 <= K; k += 8) {
        const __m256 xv = _mm256_loadu_ps(x + k);
        if ((k & 31) == 0)
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)(ahead + 2 * R * k + 64 * r), _MM_HINT_T0);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(widen8(_mm_loadu_si128((const __m128i *)(w + r * K + k))), xv, acc[r]);
    }
    for (int r = 0; r < R; r++) {
        float s = hsum8(acc[r]);
        for (long j = k; j < K; j++) s += bf16_to_float(w[r * K + j]) * x[j];
        acc_out[r] = s;
    }
}
#else
static inline __attribute__((always_inline)) void rows_f32(const uint16_t *w, const float *x, long K, int R, float *acc_out) {
    for (int r = 0; r < R; r++) {
        float s = 0.0f;
        for (long j = 0; j < K; j++) s += bf16_to_float(w[r * K + j]) * x[j];
        acc_out[r] = s;
    }
}
#endif

#if defined(__AVX512BF16__)
/* rows against bf16 x: each dot product instruction multiplies 32 bf16 pairs into 16 fp32 sums */
static inline __attribute__((always_inline)) void rows_bf16(const uint16_t *w, const uint16_t *x, long K, int R, float *acc_out) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    long k = 0;
    const uintptr_t ahead = (uintptr_t)w + 2 * AHEAD * R * K;  /* bytes; may pass the end: a prefetch never faults */
    for (; k + 32 <= K; k += 32) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
        for (int r = 0; r < R; r++) _mm_prefetch((const char *)(ahead + 2 * R * k + 64 * r), _MM_HINT_T0);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(w + r * K + k), xv);
    }
    if (k < K) {
        const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + k);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_maskz_loadu_epi16(m, w + r * K + k), xv);
    }
    for (int r = 0; r < R; r++) acc_out[r] = _mm512_reduce_add_ps(acc[r]);
}
#endif

/* 1 when x bf16 takes the dot product instructions (the tests name the path they check) */
int hcw_gemv_bf16_dot(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* returns 0, or -1 when a bf16 x could not be widened (no memory) */
int hcw_gemv(const uint16_t *p_w, const void *p_x, const void *p_bias, void *p_y, long N, long K,
             int x_bf16, int bias_bf16, int y_bf16, int threads) {
    const float *xf = (const float *)p_x;
    float *widened = NULL;
#if !defined(__AVX512BF16__)
    if (x_bf16) {
        widened = malloc(sizeof(float) * (K > 0 ? K : 1));
        if (widened == NULL) return -1;
        for (long j = 0; j < K; j++) widened[j] = bf16_to_float(((const uint16_t *)p_x)[j]);
        xf = widened;
        x_bf16 = 0;
    }
#endif
    const long blocks = (N + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (long b = 0; b < blocks; b++) {
        const long r0 = b * 4;
        const int R = N - r0 < 4 ? (int)(N - r0) : 4;
        float acc[4];
        const uint16_t *w = p_w + r0 * K;
        /* R a constant in each call, so the accumulators stay in registers */
#if defined(__AVX512BF16__)
        if (x_bf16) {
            if (R == 4) rows_bf16(w, (const uint16_t *)p_x, K, 4, acc);
            else for (int r = 0; r < R; r++) rows_bf16(w + r * K, (const uint16_t *)p_x, K, 1, acc + r);
        } else
#endif
        if (R == 4) rows_f32(w, xf, K, 4, acc);
        else for (int r = 0; r < R; r++) rows_f32(w + r * K, xf, K, 1, acc + r);
        for (int r = 0; r < R; r++) {
            float v = acc[r];
            if (p_bias != NULL)
                v += bias_bf16 ? bf16_to_float(((const uint16_t *)p_bias)[r0 + r]) : ((const float *)p_bias)[r0 + r];
            if (y_bf16) ((uint16_t *)p_y)[r0 + r] = float_to_bf16(v);
            else ((float *)p_y)[r0 + r] = v;
        }
    }
    free(widened);
    return 0;
}
