/* A gated full-attention layer's decode token on the CPU, float32: what comes between the fused
 * q|gate, k, v projection and the attention itself, in one call:
 *
 *   per query head: q RMSNorm'd (scale q_w) and rotated; sigmoid of its output gate
 *   per key-value head: k RMSNorm'd (scale k_w) and rotated, written with v into the KV buffers
 *   at position `pos`
 *
 * The rotation is the half-split partial RoPE of engine/model/rope.py: over the first
 * `rotary_dim` channels, x * cos + x[partner] * sin, the partner the channel in the other half,
 * with this position's rows of the tables (sin's first half already negated). The torch path in
 * engine/model/attention.py is the reference (tests compare them).
 */
#include <math.h>

static void norm_rotate(const float *x, float *out, const float *w, const float *cos_row, const float *sin_row,
                        int rotary_dim, int D, float eps) {
    float ss = 0.0f;
    for (int d = 0; d < D; d++) ss += x[d] * x[d];
    const float inv = 1.0f / sqrtf(ss / D + eps);
    float normed[D];
    for (int d = 0; d < D; d++) normed[d] = x[d] * inv * w[d];
    const int half = rotary_dim / 2;
    for (int d = 0; d < half; d++) out[d] = normed[d] * cos_row[d] + normed[d + half] * sin_row[d];
    for (int d = half; d < rotary_dim; d++) out[d] = normed[d] * cos_row[d] + normed[d - half] * sin_row[d];
    for (int d = rotary_dim; d < D; d++) out[d] = normed[d];
}

void hcw_attn_decode(const float *p_proj, long proj_stride, const float *p_qw, const float *p_kw,
                     const float *p_cos, const float *p_sin, int rotary_dim,
                     float *p_q, float *p_gate, float *p_k, float *p_v, long kv_stride_b, long kv_stride_h,
                     long pos, int B, int H, int HKV, int D, float eps) {
    for (int b = 0; b < B; b++) {
        const float *proj = p_proj + b * proj_stride;
        for (int h = 0; h < H; h++) {
            const float *qg = proj + (long)h * 2 * D;  /* the query, then its gate */
            norm_rotate(qg, p_q + ((long)b * H + h) * D, p_qw, p_cos, p_sin, rotary_dim, D, eps);
            float *gate = p_gate + ((long)b * H + h) * D;
            for (int d = 0; d < D; d++) gate[d] = 1.0f / (1.0f + expf(-qg[D + d]));
        }
        const float *k = proj + (long)H * 2 * D, *v = k + (long)HKV * D;
        for (int h = 0; h < HKV; h++) {
            const long at = b * kv_stride_b + h * kv_stride_h + pos * D;
            norm_rotate(k + (long)h * D, p_k + at, p_kw, p_cos, p_sin, rotary_dim, D, eps);
            for (int d = 0; d < D; d++) p_v[at + d] = v[(long)h * D + d];
        }
    }
}
