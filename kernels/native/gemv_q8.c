/* One row against an int8 weight with a float32 scale per group of 32 columns (kernels/q8's
 * format, llama.cpp's q8_0 idea) on the CPU, as llama.cpp's q8_0 dot product computes it:
 *
 *   the row x is quantised like a weight row (kernels.q8.quantise: per group of 32, scale
 *   d = max|x| / 127, xq = x / d rounded to nearest even), then for each weight row
 *   y[r] = sum over groups g of (sum of q[r, k] * xq[k] over the group, exact in int32)
 *          * (scales[r, g] * d[g])   (+ bias[r])
 *
 * so a group's products are integer dot products: AVX-512 VNNI's vpdpbusd takes 64 of them an
 * instruction (two groups a vector), AVX2's maddubs 32; the float path it replaces widened every
 * weight to float32 and was bound by instructions, not by the weight's bytes. The row's rounding
 * to int8 is the price (llama.cpp pays it too): kernels.q8.linear_q8_row is this contract in
 * torch (tests/test_native_gemv_q8.py compares them). A row holding a value that is not finite
 * has no int8 form: it takes the float path (the product of the dequantised weight with x as
 * given, NaN and infinity propagating as in the float reference, kernels.q8.linear).
 *
 * vpdpbusd multiplies unsigned by signed bytes: the row goes in as |xq| and its signs move onto
 * the weight bytes (negated where xq < 0; a weight byte is within +-127, so its negation is too).
 * Rows go four at a time (each piece of the row loaded once for four rows), split over `threads`
 * OpenMP threads of torch's own pool (libgomp.so.1, as gemv.c); each row is summed by one thread
 * in one order, so the result does not depend on the thread count. Paths: AVX-512 VNNI (+BW),
 * else AVX2, else portable C; groups left over by a path's vector width (an odd last pair, a last
 * group shorter than 32) are summed in C, in integers, on every path.
 *
 * q is row-major [N, K] (K contiguous), scales [N, G] with G = ceil(K / 32); x, bias (NULL: none)
 * and y contiguous float32. Returns 0, or -1 when the row's scratch cannot be allocated.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32

/* the row as quantised: |xq| per column (padded with zeros to whole groups), the signs as bits
 * (bit j of word g: column g * 32 + j negative), d per group */
typedef struct {
    uint8_t *mag;
    uint32_t *neg;
    float *d;
} Row;

/* quantise x into r; 0, or 1 when x holds a value that is not finite */
static int quantise_row(const float *x, long K, long G, Row *r) {
    for (long g = 0; g < G; g++) {
        const long k = g * GROUP, end = k + GROUP < K ? k + GROUP : K;
        float amax = 0.0f;
        for (long j = k; j < end; j++) {
            const float a = fabsf(x[j]);
            if (!(a <= 3.4028234663852886e38f)) return 1;  /* NaN or infinity */
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f;
        uint32_t neg = 0;
        for (long j = k; j < k + GROUP; j++) {
            long v = 0;
            if (j < end && d > 0.0f) {
                v = lrintf(x[j] / d);  /* the reference's division, rounded to nearest even */
                v = v > 127 ? 127 : v < -127 ? -127 : v;
            }
            r->mag[j] = (uint8_t)(v < 0 ? -v : v);
            if (v < 0) neg |= 1u << (j - k);
        }
        r->neg[g] = neg;
        r->d[g] = d;
    }
    return 0;
}

/* one group of one weight row against the row, in integers (C) */
static inline int32_t group_dot(const int8_t *q, const Row *r, long g, long K) {
    const long k = g * GROUP, end = k + GROUP < K ? k + GROUP : K;
    int32_t s = 0;
    for (long j = k; j < end; j++) {
        const int32_t m = r->mag[j];
        s += (int32_t)q[j] * ((r->neg[g] >> (j - k)) & 1u ? -m : m);
    }
    return s;
}

/* the groups from `from` on of one row, in C: their integer sums times their scales */
static inline float tail_groups(const int8_t *q, const float *scales, const Row *r, long from, long G, long K) {
    float s = 0.0f;
    for (long g = from; g < G; g++) s += (float)group_dot(q, r, g, K) * (scales[g] * r->d[g]);
    return s;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* two adjacent floats spread to lanes 0-7 and 8-15 (where a vector's two groups' sums lie) */
static inline __m512 pair(const float *p) {
    double both;
    memcpy(&both, p, sizeof both);
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(halves, _mm512_castpd_ps(_mm512_set1_pd(both)));
}

/* rows r..r+R-1 (R <= 4), two whole groups a 64-byte vector */
static inline __attribute__((always_inline)) void rows(const int8_t *q, const float *scales, const Row *x,
                                                       long K, long G, int R, float *out) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const __m512i zero = _mm512_setzero_si512();
    const long pairs = (K / GROUP) / 2;
    for (long p = 0; p < pairs; p++) {
        const long k = p * 2 * GROUP, g = 2 * p;
        const __m512i mag = _mm512_loadu_si512((const void *)(x->mag + k));
        const __mmask64 neg = (__mmask64)x->neg[g] | ((__mmask64)x->neg[g + 1] << 32);
        const __m512 d = pair(x->d + g);
        for (int r = 0; r < R; r++) {
            __m512i w = _mm512_loadu_si512((const void *)(q + r * K + k));
            w = _mm512_mask_sub_epi8(w, neg, zero, w);
            const __m512i dot = _mm512_dpbusd_epi32(zero, mag, w);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(pair(scales + r * G + g), d), acc[r]);
        }
    }
    for (int r = 0; r < R; r++)
        out[r] = _mm512_reduce_add_ps(acc[r]) + tail_groups(q + r * K, scales + r * G, x, 2 * pairs, G, K);
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* the 32 sign bits of a group as bytes of 0xFF (negative) or 0x01 (_mm256_sign_epi8's operand) */
static inline __m256i sign_bytes(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                                                 0x0101010101010101LL, 0x0000000000000000LL));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_or_si256(set, _mm256_set1_epi8(1));
}

static inline __attribute__((always_inline)) void rows(const int8_t *q, const float *scales, const Row *x,
                                                       long K, long G, int R, float *out) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const __m256i ones = _mm256_set1_epi16(1);
    const long full = K / GROUP;
    for (long g = 0; g < full; g++) {
        const long k = g * GROUP;
        const __m256i mag = _mm256_loadu_si256((const __m256i *)(x->mag + k));
        const __m256i sign = sign_bytes(x->neg[g]);
        const float d = x->d[g];
        for (int r = 0; r < R; r++) {
            /* |xq| * (w with xq's sign): pairs into int16 (at most 2 * 127 * 127, no saturation), then int32 */
            const __m256i w = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(q + r * K + k)), sign);
            const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(mag, w), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scales[r * G + g] * d), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]) + tail_groups(q + r * K, scales + r * G, x, full, G, K);
}
#else
static inline void rows(const int8_t *q, const float *scales, const Row *x, long K, long G, int R, float *out) {
    for (int r = 0; r < R; r++) out[r] = tail_groups(q + r * K, scales + r * G, x, 0, G, K);
}
#endif

/* the float path, for a row that is not finite: each group's products in float32, its sum scaled */
static float float_row(const int8_t *q, const float *scales, const float *x, long K, long G) {
    float s = 0.0f;
    for (long g = 0; g < G; g++) {
        const long k = g * GROUP, end = k + GROUP < K ? k + GROUP : K;
        float t = 0.0f;
        for (long j = k; j < end; j++) t += (float)q[j] * x[j];
        s += t * scales[g];
    }
    return s;
}

/* which path this build takes: 2 AVX-512 VNNI, 1 AVX2, 0 portable C (the tests name the path they check) */
int hcw_gemv_q8_path(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

int hcw_gemv_q8(const int8_t *p_q, const float *p_scales, const float *p_x, const float *p_bias, float *p_y,
                long N, long K, int threads) {
    const long G = (K + GROUP - 1) / GROUP;
    Row x;
    x.mag = malloc((size_t)(G > 0 ? G : 1) * GROUP);
    x.neg = malloc(sizeof(uint32_t) * (size_t)(G > 0 ? G : 1));
    x.d = malloc(sizeof(float) * (size_t)(G > 0 ? G : 1));
    if (x.mag == NULL || x.neg == NULL || x.d == NULL) {
        free(x.mag), free(x.neg), free(x.d);
        return -1;
    }
    const int finite = quantise_row(p_x, K, G, &x) == 0;
    const long blocks = (N + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (long b = 0; b < blocks; b++) {
        const long r0 = b * 4;
        const int R = N - r0 < 4 ? (int)(N - r0) : 4;
        float acc[4];
        const int8_t *q = p_q + r0 * K;
        const float *s = p_scales + r0 * G;
        if (!finite) for (int r = 0; r < R; r++) acc[r] = float_row(q + r * K, s + r * G, p_x, K, G);
        /* R a constant in each call, so the accumulators stay in registers */
        else if (R == 4) rows(q, s, &x, K, G, 4, acc);
        else for (int r = 0; r < R; r++) rows(q + r * K, s + r * G, &x, K, G, 1, acc + r);
        for (int r = 0; r < R; r++) p_y[r0 + r] = acc[r] + (p_bias != NULL ? p_bias[r0 + r] : 0.0f);
    }
    free(x.mag), free(x.neg), free(x.d);
    return 0;
}
