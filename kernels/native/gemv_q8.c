/* One row against an int8 weight with a float32 scale per group of 32 columns (kernels/q8's
 * format, llama.cpp's q8_0 idea) on the CPU: y[N] = dequantise(q, scales)[N, K] @ x[K] (+ bias),
 * float32 throughout.
 *
 * The weight is dequantised on the fly and never stored: each group's 32 int8 values are widened
 * to float32, multiplied with x's 32 values, summed, and the sum scaled by the group's scale into
 * the row's accumulator; a weight byte is read once. Rows go four at a time (each x vector loaded
 * once for four rows), split over `threads` OpenMP threads of torch's own pool (libgomp.so.1, as
 * gemv.c). AVX-512F where the processor has it, else AVX2 with FMA, else portable C; the last
 * group of a row shorter than 32 (K not a multiple) is summed in C on every path.
 *
 * q is row-major [N, K] (K contiguous), scales [N, G] with G = ceil(K / 32); x, bias (NULL: none)
 * and y contiguous float32. The sum order differs from the reference's (dequantise, then one dot
 * product): a scale multiplies a group's sum instead of each product.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define GROUP 32
/* the next block of four rows is prefetched while this one is read, as in gemv.c (a 248K-row head
 * 16.6 -> 10.9 ms, 2 threads, AVX-512): widening each weight leaves too few loads in flight */
#define AHEAD 1

/* the part of a group from column `from` to `to` (< GROUP columns), in C */
static inline float partial(const int8_t *q, const float *x, long from, long to) {
    float s = 0.0f;
    for (long j = from; j < to; j++) s += (float)q[j] * x[j];
    return s;
}

#if defined(__AVX512F__)
static inline __m512 widen16(__m128i b) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

/* rows r..r+R-1 (R <= 4) of the weight against x */
static inline __attribute__((always_inline)) void rows(const int8_t *q, const float *scales, const float *x,
                                                       long K, long G, int R, float *out) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const long full = K / GROUP;
    const uintptr_t ahead = (uintptr_t)q + AHEAD * R * K;  /* may pass the end: a prefetch never faults */
    for (long g = 0; g < full; g++) {
        const long k = g * GROUP;
        _mm_prefetch((const char *)(ahead + g * R * GROUP), _MM_HINT_T0);
        if (R == 4) _mm_prefetch((const char *)(ahead + g * R * GROUP + 64), _MM_HINT_T0);
        const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
        for (int r = 0; r < R; r++) {
            const int8_t *p = q + r * K + k;
            __m512 d = _mm512_mul_ps(widen16(_mm_loadu_si128((const __m128i *)p)), x0);
            d = _mm512_fmadd_ps(widen16(_mm_loadu_si128((const __m128i *)(p + 16))), x1, d);
            acc[r] = _mm512_fmadd_ps(d, _mm512_set1_ps(scales[r * G + g]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float s = _mm512_reduce_add_ps(acc[r]);
        if (full < G) s += partial(q + r * K, x, full * GROUP, K) * scales[r * G + full];
        out[r] = s;
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* 8 int8 at p as float32: the load folds into the sign extension (no shuffles to split a wider load) */
static inline __m256 widen8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) void rows(const int8_t *q, const float *scales, const float *x,
                                                       long K, long G, int R, float *out) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const long full = K / GROUP;
    const uintptr_t ahead = (uintptr_t)q + AHEAD * R * K;  /* may pass the end: a prefetch never faults */
    for (long g = 0; g < full; g++) {
        const long k = g * GROUP;
        _mm_prefetch((const char *)(ahead + g * R * GROUP), _MM_HINT_T0);
        if (R == 4) _mm_prefetch((const char *)(ahead + g * R * GROUP + 64), _MM_HINT_T0);
        const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        const __m256 x2 = _mm256_loadu_ps(x + k + 16), x3 = _mm256_loadu_ps(x + k + 24);
        for (int r = 0; r < R; r++) {
            const int8_t *p = q + r * K + k;
            __m256 d = _mm256_mul_ps(widen8(p), x0);
            d = _mm256_fmadd_ps(widen8(p + 8), x1, d);
            d = _mm256_fmadd_ps(widen8(p + 16), x2, d);
            d = _mm256_fmadd_ps(widen8(p + 24), x3, d);
            acc[r] = _mm256_fmadd_ps(d, _mm256_set1_ps(scales[r * G + g]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float s = hsum8(acc[r]);
        if (full < G) s += partial(q + r * K, x, full * GROUP, K) * scales[r * G + full];
        out[r] = s;
    }
}
#else
static inline void rows(const int8_t *q, const float *scales, const float *x, long K, long G, int R, float *out) {
    for (int r = 0; r < R; r++) {
        float s = 0.0f;
        for (long g = 0; g < G; g++) {
            const long k = g * GROUP, end = k + GROUP < K ? k + GROUP : K;
            s += partial(q + r * K, x, k, end) * scales[r * G + g];
        }
        out[r] = s;
    }
}
#endif

/* which path this build takes: 2 AVX-512F, 1 AVX2, 0 portable C (the tests name the path they check) */
int hcw_gemv_q8_path(void) {
#if defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

void hcw_gemv_q8(const int8_t *p_q, const float *p_scales, const float *p_x, const float *p_bias, float *p_y,
                 long N, long K, int threads) {
    const long G = (K + GROUP - 1) / GROUP;
    const long blocks = (N + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (long b = 0; b < blocks; b++) {
        const long r0 = b * 4;
        const int R = N - r0 < 4 ? (int)(N - r0) : 4;
        float acc[4];
        const int8_t *q = p_q + r0 * K;
        const float *s = p_scales + r0 * G;
        /* R a constant in each call, so the accumulators stay in registers */
        if (R == 4) rows(q, s, p_x, K, G, 4, acc);
        else for (int r = 0; r < R; r++) rows(q + r * K, s + r * G, p_x, K, G, 1, acc + r);
        for (int r = 0; r < R; r++) p_y[r0 + r] = acc[r] + (p_bias != NULL ? p_bias[r0 + r] : 0.0f);
    }
}
