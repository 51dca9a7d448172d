/* A weight quantised to kernels/q8's int8 format on the CPU, as kernels.q8.quantise does it, in one
 * pass over the weight (the torch reference makes a float32 copy and several passes: most of an
 * int8 load's time at real size):
 *
 *   per row and group of 32 columns (the last one shorter when K is not a multiple):
 *   scale = max |w| over the group / 127 (float32); q = w / scale rounded to nearest even,
 *   clamped to [-127, 127]; a group of zeros has scale 0 and q 0
 *
 * The same float32 operations as the reference (one division for the scale, one per weight,
 * lrintf's rounding to nearest even), so q and scales are the reference's to the bit; the tests
 * compare them. w is float32 or bf16 (widened exactly), row r at w + r * ld; q [N, K] and scales
 * [N, ceil(K / 32)] contiguous. Rows are split over `threads` OpenMP threads of torch's own pool.
 * Returns 0, or 1 when the weight holds a value that is not finite (q and scales then hold
 * nothing meaningful: the caller refuses the weight, as the reference does).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define GROUP 32

static inline float widen(const void *w, int bf16, long i) {
    if (!bf16) return ((const float *)w)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

int hcw_quantise_q8(const void *p_w, int bf16, long N, long K, long ld, int8_t *p_q, float *p_scales, int threads) {
    const long G = (K + GROUP - 1) / GROUP;
    int bad = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1) reduction(| : bad)
    for (long r = 0; r < N; r++) {
        const long base = r * ld;
        for (long g = 0; g < G; g++) {
            const long k = g * GROUP, end = k + GROUP < K ? k + GROUP : K;
            float amax = 0.0f, v[GROUP];
            for (long j = k; j < end; j++) {
                v[j - k] = widen(p_w, bf16, base + j);
                const float a = fabsf(v[j - k]);
                if (!(a <= 3.4028234663852886e38f)) bad = 1;  /* NaN or infinity */
                amax = a > amax ? a : amax;
            }
            const float scale = amax / 127.0f;
            p_scales[r * G + g] = scale;
            int8_t *q = p_q + r * K;
            for (long j = k; j < end; j++) {
                long x = 0;
                if (scale > 0.0f) {
                    x = lrintf(v[j - k] / scale);
                    x = x > 127 ? 127 : x < -127 ? -127 : x;
                }
                q[j] = (int8_t)x;
            }
        }
    }
    return bad;
}
