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
 * A token's conv and norms run on the caller's thread; its value heads are split over `threads`
 * OpenMP threads (torch's own pool, as gemv.c's) when the caller asks for more than one: at a
 * real model's size (16 heads of 128 x 128) the state's bytes, read and written once a step, make
 * the heads memory-bound work worth splitting; at a small one a parallel region costs more than
 * it saves, and the caller passes 1. Each head is computed whole by one thread in one order, so
 * the result does not depend on the thread count. `hcw_gdn_decode` steps B sequences whose
 * states are rows of one tensor; `hcw_gdn_decode_rows` B sequences whose states are tensors of
 * their own (a batched decode step of independent requests), given as arrays of B pointers.
 */
#include <math.h>
#include <omp.h>
#include <stddef.h>

static float silu(float x) { return x / (1.0f + expf(-x)); }

static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }  /* torch's threshold */

static void l2_normalise(float *x, int n, float eps, float scale) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = scale / sqrtf(ss + eps);
    for (int i = 0; i < n; i++) x[i] *= inv;
}

/* one token of one sequence: proj one row of in_proj's output; conv [C, K-1]; s [HV, DK, DV];
 * out [HV * DV]; g, bv [HV] or NULL */
static void gdn_token(const float *proj, const float *conv_in, float *conv_out, const float *p_taps,
                      const float *p_neg_a, const float *p_dt_bias, const float *p_s_in, float *p_s_out,
                      const float *p_norm_w, float *p_out, float *p_g, float *p_bv,
                      int HK, int HV, int DK, int DV, int K, float l2_eps, float norm_eps, int threads) {
    const int key_dim = HK * DK, value_dim = HV * DV;
    const int C = 2 * key_dim + value_dim, R = HV / HK;
    const float q_scale = 1.0f / sqrtf((float)DK);
    float mixed[C];
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
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int h = 0; h < HV; h++) {
        float pred[DV], u[DV];
        const float *q = mixed + (h / R) * DK, *k = mixed + key_dim + (h / R) * DK;
        const float *v = mixed + 2 * key_dim + h * DV;
        const float beta = 1.0f / (1.0f + expf(-b_in[h]));
        const float g = p_neg_a[h] * softplus(a_in[h] + p_dt_bias[h]);
        const float decay = expf(g);
        const float *s_in = p_s_in + (long)h * DK * DV;
        float *s = p_s_out + (long)h * DK * DV;
        float *o = p_out + (long)h * DV;
        for (int j = 0; j < DV; j++) { pred[j] = 0.0f; o[j] = 0.0f; }
        if (p_g != NULL) {
            float vv = 0.0f;
            for (int j = 0; j < DV; j++) vv += v[j] * v[j];
            p_g[h] = g;
            p_bv[h] = beta * sqrtf(vv);
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

void hcw_gdn_decode(const float *p_proj, long proj_stride,
                    const float *p_conv_in, float *p_conv_out, const float *p_taps,
                    const float *p_neg_a, const float *p_dt_bias,
                    const float *p_s_in, float *p_s_out, const float *p_norm_w,
                    float *p_out, float *p_g, float *p_bv,
                    int B, int HK, int HV, int DK, int DV, int K, float l2_eps, float norm_eps, int threads) {
    const long conv = (long)(2 * HK * DK + HV * DV) * (K - 1), state = (long)HV * DK * DV;
    for (int b = 0; b < B; b++)
        gdn_token(p_proj + b * proj_stride, p_conv_in + b * conv, p_conv_out + b * conv, p_taps, p_neg_a,
                  p_dt_bias, p_s_in + b * state, p_s_out + b * state, p_norm_w, p_out + (long)b * HV * DV,
                  p_g == NULL ? NULL : p_g + b * HV, p_bv == NULL ? NULL : p_bv + b * HV,
                  HK, HV, DK, DV, K, l2_eps, norm_eps, threads);
}

void hcw_gdn_decode_rows(const float *p_proj, long proj_stride,
                         const float *const *conv_in, float *const *conv_out, const float *p_taps,
                         const float *p_neg_a, const float *p_dt_bias,
                         const float *const *s_in, float *const *s_out, const float *p_norm_w,
                         float *p_out, float *p_g, float *p_bv,
                         int B, int HK, int HV, int DK, int DV, int K, float l2_eps, float norm_eps,
                         int threads) {
    for (int b = 0; b < B; b++)
        gdn_token(p_proj + b * proj_stride, conv_in[b], conv_out[b], p_taps, p_neg_a, p_dt_bias, s_in[b], s_out[b],
                  p_norm_w, p_out + (long)b * HV * DV, p_g == NULL ? NULL : p_g + b * HV,
                  p_bv == NULL ? NULL : p_bv + b * HV, HK, HV, DK, DV, K, l2_eps, norm_eps, threads);
}
