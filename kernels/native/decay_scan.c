/* The decay statistics a cached Gated DeltaNet request records over a prefill chunk (decay_scan.py;
 * its reference is engine/cache/gdn_state.py's torch path): per (batch row, value head) the bound
 * N_t = e^{g_t} N_{t-1} + x_t carried in double, written rounded up by `up` beside g_t. A plain
 * scan: e^{g} <= 1 and x >= 0, so nothing overflows, where the torch path needs a logcumsumexp. */
#include <math.h>

void hcw_decay_scan(const float *g, const float *x, double *norm, float *rows, long rows_batch_stride,
                    int b, int t, int h, double up) {
    for (int i = 0; i < b; i++) {
        const float *gi = g + (long)i * t * h, *xi = x + (long)i * t * h;
        float *ri = rows + (long)i * rows_batch_stride;
        double *ni = norm + (long)i * h;
        for (int k = 0; k < h; k++) {
            double n = ni[k], scaled = n;
            for (int s = 0; s < t; s++) {
                long at = (long)s * h + k;
                n = exp((double)gi[at]) * n + (double)xi[at];
                scaled = n * up;
                ri[2 * at] = gi[at];
                ri[2 * at + 1] = (float)scaled;
            }
            if (t > 0)
                ni[k] = scaled;
        }
    }
}
