/* RMSNorm over the last dimension of a few rows on the CPU, float32, optionally after a residual
 * add: r = x (+ delta); out = r / sqrt(mean(r^2) + eps) * scale, r written to x_out when delta
 * is given. The torch path is engine/model/norm.py's RMSNorm (tests compare them): at decode
 * sizes its five ops cost ~8 us of dispatch for 256 numbers.
 */
#include <math.h>
#include <stddef.h>

void hcw_rms_norm(const float *p_x, const float *p_delta, float *p_x_out, const float *p_scale, float *p_out,
                  long rows, int D, float eps) {
    for (long r = 0; r < rows; r++) {
        const float *x = p_x + r * D;
        float *out = p_out + r * D;
        const float *src = x;
        if (p_delta != NULL) {
            const float *delta = p_delta + r * D;
            float *sum = p_x_out + r * D;
            for (int d = 0; d < D; d++) sum[d] = x[d] + delta[d];
            src = sum;
        }
        float ss = 0.0f;
        for (int d = 0; d < D; d++) ss += src[d] * src[d];
        const float inv = 1.0f / sqrtf(ss / D + eps);
        for (int d = 0; d < D; d++) out[d] = src[d] * inv * p_scale[d];
    }
}
