/* One Gated DeltaNet decode token on the CPU, float32, everything between the input projection
 * and the output projection in one call:
 *
 *   qkv | z | b | a  (one row of in_proj's output)
 *   qkv -> causal depthwise conv over the K-1 previous inputs (conv state) + silu
 *       -> q, k L2-normalised per head (eps inside the root), q scaled by dk^-0.5; v
 *   beta = sigmoid(b), g = neg_a * softplus(a + dt_bias)
 *   S = e^g S;  u = (v - k S) beta;  S += k^T u;  o = q S     (per value head; key head = h / r)
 *   out = o / rms(o) * norm_w * silu(z)
 *
 * The torch path this replaces is engine/model/gdn.py's (the tests compare the two). States are
 * read from *_in and written to *_out, never updated in place: the caller's old tensors may be
 * shared with a cached snapshot. g and beta * |v| per head are written for the decay statistics
 * when p_g and p_bv are given (NULL: a request the cache does not record).
 * Each thread of work is one token of one sequence: at decode sizes a parallel region costs more
 * than it saves, so the caller's one thread runs it.
 */
#include <math.h>
#include <stddef.h>

static float silu(float x) { return x / (1.0f + expf(-x)); }

static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }  /* torch's threshold */

static void l2_normalise(float *x, int n, float eps, float scale) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = scale / sqrtf(ss + eps);
    for (int i = 0; i < n; i++) x[i] *= inv;
}

void hcw_gdn_decode(const float *p_proj, long proj_stride,
                    const float *p_conv_in, float *p_conv_out, const float *p_taps,
                    const float *p_neg_a, const float *p_dt_bias,
                    const float *p_s_in, float *p_s_out, const float *p_norm_w,
                    float *p_out, float *p_g, float *p_bv,
                    int B, int HK, int HV, int DK, int DV, int K, float l2_eps, float norm_eps) {
    const int key_dim = HK * DK, value_dim = HV * DV;
    const int C = 2 * key_dim + value_dim, R = HV / HK;
    const float q_scale = 1.0f / sqrtf((float)DK);
    float mixed[C], pred[DV], u[DV];
    for (int b = 0; b < B; b++) {
        const float *proj = p_proj + b * proj_stride;
        const float *conv_in = p_conv_in + (long)b * C * (K - 1);
        float *conv_out = p_conv_out + (long)b * C * (K - 1);
        /* conv: taps [C, K], the state's K-1 inputs oldest first, then this token's */
        for (int c = 0; c < C; c++) {
            const float *hist = conv_in + (long)c * (K - 1), *w = p_taps + (long)c * K;
            float acc = 0.0f;
            for (int j = 0; j < K - 1; j++) acc += hist[j] * w[j];
            acc += proj[c] * w[K - 1];
            mixed[c] = silu(acc);
            if (K > 1) {  /* a one-tap conv keeps no window */
                float *keep = conv_out + (long)c * (K - 1);
                for (int j = 0; j < K - 2; j++) keep[j] = hist[j + 1];
                keep[K - 2] = proj[c];
            }
        }
        for (int h = 0; h < HK; h++) {
            l2_normalise(mixed + h * DK, DK, l2_eps, q_scale);
            l2_normalise(mixed + key_dim + h * DK, DK, l2_eps, 1.0f);
        }
        const float *z = proj + C, *b_in = proj + C + value_dim, *a_in = proj + C + value_dim + HV;
        for (int h = 0; h < HV; h++) {
            const float *q = mixed + (h / R) * DK, *k = mixed + key_dim + (h / R) * DK;
            const float *v = mixed + 2 * key_dim + h * DV;
            const float beta = 1.0f / (1.0f + expf(-b_in[h]));
            const float g = p_neg_a[h] * softplus(a_in[h] + p_dt_bias[h]);
            const float decay = expf(g);
            const float *s_in = p_s_in + ((long)b * HV + h) * DK * DV;
            float *s = p_s_out + ((long)b * HV + h) * DK * DV;
            float *o = p_out + ((long)b * HV + h) * DV;
            for (int j = 0; j < DV; j++) { pred[j] = 0.0f; o[j] = 0.0f; }
            if (p_g != NULL) {
                float vv = 0.0f;
                for (int j = 0; j < DV; j++) vv += v[j] * v[j];
                p_g[b * HV + h] = g;
                p_bv[b * HV + h] = beta * sqrtf(vv);
            }
            for (int i = 0; i < DK; i++) {
                const float ki = k[i];
                const float *si = s_in + i * DV;
                float *so = s + i * DV;
                for (int j = 0; j < DV; j++) { so[j] = si[j] * decay; pred[j] += ki * so[j]; }
            }
            for (int j = 0; j < DV; j++) u[j] = (v[j] - pred[j]) * beta;
            for (int i = 0; i < DK; i++) {
                const float ki = k[i], qi = q[i];
                float *so = s + i * DV;
                for (int j = 0; j < DV; j++) { so[j] += ki * u[j]; o[j] += qi * so[j]; }
            }
            /* gated RMSNorm over the head's DV outputs */
            float ss = 0.0f;
            for (int j = 0; j < DV; j++) ss += o[j] * o[j];
            const float inv = 1.0f / sqrtf(ss / DV + norm_eps);
            const float *zh = z + h * DV;
            for (int j = 0; j < DV; j++) o[j] = o[j] * inv * p_norm_w[j] * silu(zh[j]);
        }
    }
}
