/* Paged decode attention on the CPU: one new token per sequence attending to its keys and values
 * where they lie in the pool, through its block table (no gather). The contract is
 * kernels/paged_attention/reference.py's `paged_decode`, which the tests compare this with:
 *
 *   q      [B, H, D]            one query token per sequence (fp32 or bf16, as the pools)
 *   pools  [N, HKV, BS, D]      keys and values; H a multiple of HKV (GQA)
 *   table  [B, M] int32         pool block of each of a sequence's blocks
 *   lengths [B] int32           positions held; window > 0: only the last `window` of them
 *   out    [B, H, D]            softmax(q.k * scale) v, in q's dtype
 *
 * One pass per (sequence, key-value head) serves the group of H / HKV query heads that share it.
 * A pair attending to at least SPLIT_MIN positions is split into partitions of PART positions
 * from the first one it attends (flash-decoding's split-K), so one long sequence of one key-value
 * head still fills every thread; each partition's running softmax is merged into the output in
 * partition order with the log-sum-exp rescale. The partitions depend only on the pair's length
 * and window, never on the thread count, and each is computed whole by one thread in one order,
 * so the result does not depend on the thread count (nor on the other sequences of the batch).
 * The partitions are split over `threads` OpenMP threads (torch's own pool, as gemv.c's).
 * Positions are taken in tiles of TILE positions (at multiples of TILE, whatever the block size, so
 * the result's bits do not depend on it): the tile's scores, then the
 * running (max, sum, weighted values) of kernels/online_softmax.py folded in float32, so no row
 * of scores is ever stored. Where D is a multiple of 8 the products run on 8-float vectors (the
 * compilers' vector extension): scores 8 rows at a time, their partial sums reduced together by
 * shuffles; the weighted values with the accumulator in registers. Every sum runs in a fixed
 * order (nothing reassociated), and exp is a polynomial the compiler vectorises (`exp_neg`).
 * bf16 rows are widened tile by tile into float scratch; the output rounds to nearest even.
 *
 * Returns 0, or -1 when a length does not fit the table (or is negative), -2 when a block id the
 * lengths reach lies outside the pool, -3 for shapes past the limits below (nothing is read
 * outside the pools either way), -4 when the split's scratch cannot be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16  /* partial sums of `dot`, the path for D not a multiple of 8 */
#define TILE 64
#define MAX_D 512
#define MAX_GROUP_D 16384  /* G * D: the group's queries and accumulators live on the stack */
/* below this many products of a query with a key (positions x query heads x D, over the batch) a
 * call takes microseconds, about what waking a second thread costs: it runs on one */
#define MIN_THREADED (1L << 14)
/* split-K: a partition's PART positions take about as long as a few thread wake-ups, and below
 * SPLIT_MIN positions the pair stays whole */
#define PART 512
#define SPLIT_MIN 1024

static inline float bf16_float(uint16_t x) {
    union { uint32_t u; float f; } c = { .u = (uint32_t)x << 16 };
    return c.f;
}

static inline uint16_t float_bf16(float f) {
    union { float f; uint32_t u; } c = { .f = f };
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

static inline float dot(const float *restrict a, const float *restrict b, int D) {
    float part[LANES] = {0};
    int d = 0;
    for (; d + LANES <= D; d += LANES)
        for (int j = 0; j < LANES; j++) part[j] += a[d + j] * b[d + j];
    for (int j = 0; d < D; d++, j++) part[j] += a[d] * b[d];
    float s = 0.0f;
    for (int j = 0; j < LANES; j++) s += part[j];
    return s;
}

/* exp(x) for x <= 0 in float32 arithmetic the compiler vectorises (libm's expf is a call per
 * element): x = n ln2 + r, |r| <= ln2/2 (Cody-Waite, ln2 in two parts), exp(r) by its degree-7
 * Taylor polynomial (truncation below 1e-8 relative), times 2^n built in the exponent bits.
 * Below -87 (2^-126, the smallest normal) it holds at ~1.6e-38 rather than becoming a denormal,
 * which the processor computes many times slower: far below float32 resolution of any row sum */
static inline float exp_neg(float x) {
    x = x > -87.0f ? x : -87.0f;
    const float shifter = 12582912.0f;  /* 1.5 * 2^23: adding it rounds to an integer */
    const float t = x * 1.44269504088896341f + shifter;
    const float n = t - shifter;
    const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { float f; int32_t i; } scale = { .i = ((int32_t)n + 127) << 23 };
    return p * scale.f;
}

/* eight floats as one value (GCC's and clang's vector extension: AVX's register on x86, two
 * NEON registers on arm64) */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

static inline v8 load8(const float *p) {
    v8 x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* lanes of a and b summed in pairs: a01 a23 b01 b23 a45 a67 b45 b67 */
static inline v8 pairs(v8 a, v8 b) {
    return SHUFFLE(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

/* scores of 8 rows of k ([8, D], D a multiple of 8) against q: per row 8 partial sums along D,
 * then the 8 rows' sums reduced together (a transpose by shuffles, not 8 horizontal sums, each
 * of which would cost as much as the row's products) */
static inline void dot8(const float *restrict q, const float *restrict k, int D, float *restrict s) {
    v8 a[8] = {0};
    for (int d = 0; d < D; d += 8) {
        const v8 qv = load8(q + d);
        for (int p = 0; p < 8; p++) a[p] += qv * load8(k + (long)p * D + d);
    }
    const v8 u0 = pairs(pairs(a[0], a[1]), pairs(a[2], a[3]));  /* rows 0-3 over lanes 0-3, then 4-7 */
    const v8 u1 = pairs(pairs(a[4], a[5]), pairs(a[6], a[7]));
    const v8 out = SHUFFLE(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
    memcpy(s, &out, sizeof out);
}

static inline v8 splat(float x) {
    return (v8){x, x, x, x, x, x, x, x};
}

static inline v8 vmax(v8 a, v8 b) {
    const v8i more = a > b;
    return (v8)(((v8i)a & more) | ((v8i)b & ~more));
}

static inline float lanes_max(v8 x) {
    float top = x[0];
    for (int j = 1; j < 8; j++) top = x[j] > top ? x[j] : top;
    return top;
}

/* fold n rows of keys k / values v ([n, D] float, n <= TILE) into the running softmax of G
 * queries q [G, D]: (max m, sum l, weighted values acc) per query */
static void fold(const float *restrict q, const float *restrict k, const float *restrict v, int n, int G, int D,
                 float scale, float *restrict m, float *restrict l, float *restrict acc) {
    float s[TILE] __attribute__((aligned(32)));
    const int n8 = (n + 7) & ~7;
    for (int g = 0; g < G; g++) {
        const float *qg = q + (long)g * D;
        int p = 0;
        if (D % 8 == 0)
            for (; p + 8 <= n; p += 8) dot8(qg, k + (long)p * D, D, s + p);
        for (; p < n; p++) s[p] = dot(qg, k + (long)p * D, D);
        for (; p < n8; p++) s[p] = -INFINITY;  /* padding to whole vectors: weighs 0 below */
        v8 top8 = splat(-INFINITY);
        for (p = 0; p < n8; p += 8) {
            const v8 x = load8(s + p) * scale;
            memcpy(s + p, &x, sizeof x);
            top8 = vmax(top8, x);
        }
        const float top = lanes_max(vmax(top8, splat(m[g])));
        const float alpha = exp_neg(m[g] - top);  /* m[g] = -inf before the first tile: ~0 */
        for (p = 0; p < n8; p++) s[p] = exp_neg(s[p] - top);
        for (p = n; p < n8; p++) s[p] = 0.0f;
        v8 sum8 = splat(0.0f);
        for (p = 0; p < n8; p += 8) sum8 += load8(s + p);
        float sum = 0.0f;
        for (int j = 0; j < 8; j++) sum += sum8[j];
        l[g] = l[g] * alpha + sum;
        float *restrict a = acc + (long)g * D;
        for (int d = 0; d < D; d++) a[d] *= alpha;
        if (D % 8 == 0) {
            /* four vectors of the accumulator held in registers through the tile's rows */
            int d = 0;
            for (; d + 32 <= D; d += 32) {
                v8 a0 = load8(a + d), a1 = load8(a + d + 8), a2 = load8(a + d + 16), a3 = load8(a + d + 24);
                v8 b0 = splat(0.0f), b1 = b0, b2 = b0, b3 = b0;  /* odd rows: eight chains, not four */
                for (p = 0; p + 2 <= n; p += 2) {
                    const v8 w = splat(s[p]), x = splat(s[p + 1]);
                    const float *vp = v + (long)p * D + d, *vq = vp + D;
                    a0 += w * load8(vp), a1 += w * load8(vp + 8), a2 += w * load8(vp + 16), a3 += w * load8(vp + 24);
                    b0 += x * load8(vq), b1 += x * load8(vq + 8), b2 += x * load8(vq + 16), b3 += x * load8(vq + 24);
                }
                for (; p < n; p++) {
                    const v8 w = splat(s[p]);
                    const float *vp = v + (long)p * D + d;
                    a0 += w * load8(vp), a1 += w * load8(vp + 8), a2 += w * load8(vp + 16), a3 += w * load8(vp + 24);
                }
                a0 += b0, a1 += b1, a2 += b2, a3 += b3;
                memcpy(a + d, &a0, sizeof a0), memcpy(a + d + 8, &a1, sizeof a1);
                memcpy(a + d + 16, &a2, sizeof a2), memcpy(a + d + 24, &a3, sizeof a3);
            }
            for (; d < D; d += 8) {
                v8 a0 = load8(a + d);
                for (p = 0; p < n; p++) a0 += splat(s[p]) * load8(v + (long)p * D + d);
                memcpy(a + d, &a0, sizeof a0);
            }
        } else {
            for (p = 0; p < n; p++) {
                const float w = s[p];
                const float *restrict vp = v + (long)p * D;
                for (int d = 0; d < D; d++) a[d] += w * vp[d];
            }
        }
        m[g] = top;
    }
}

static void widen(const uint16_t *restrict x, float *restrict out, long n) {
    for (long i = 0; i < n; i++) out[i] = bf16_float(x[i]);
}

/* the partitions of a pair attending to positions [lo, n) */
static inline long parts_of(long lo, long n) {
    return n - lo >= SPLIT_MIN ? (n - lo + PART - 1) / PART : 1;
}

static inline long first_attended(long n, int window) {
    return window > 0 && n > window ? n - window : 0;
}

/* the running softmax (m, l, acc) of the group of G query heads that share key-value head h of
 * sequence b over its positions [from, to): one pass, reading nothing another item writes */
static void attend(const void *p_q, const void *p_k, const void *p_v, const int32_t *p_table, int bf16, long from,
                   long to, long M, int b, int h, int H, int HKV, int BS, int D, float scale, float *restrict m,
                   float *restrict l, float *restrict acc) {
    const int G = H / HKV;
    const long row = (long)BS * D, block = (long)HKV * row;
    float qs[G * D];
    /* scratch for a tile that is bf16 or spans blocks (BS not a multiple of TILE) */
    const int scratch = bf16 || BS % TILE;
    float kt[scratch ? TILE * D : 1], vt[scratch ? TILE * D : 1];
    const long at = ((long)b * H + (long)h * G) * D;  /* the group's first query head */
    if (bf16) widen((const uint16_t *)p_q + at, qs, (long)G * D);
    else memcpy(qs, (const float *)p_q + at, sizeof(float) * G * D);
    for (int g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.0f; }
    memset(acc, 0, sizeof(float) * G * D);
    /* tiles at multiples of TILE positions (the first from `from`), whatever the block size: the
     * folds, and so the result's bits, are those of any other block size */
    for (long t = from; t < to;) {
        const long tile_end = (t / TILE + 1) * TILE < to ? (t / TILE + 1) * TILE : to;
        const int cnt = (int)(tile_end - t);
        const float *k, *v;
        if (!bf16 && t / BS == (tile_end - 1) / BS) {  /* f32 rows of one block: read in place */
            const long j = t / BS;
            const long off = (long)p_table[b * M + j] * block + (long)h * row + (t - j * BS) * D;
            k = (const float *)p_k + off;
            v = (const float *)p_v + off;
        } else {  /* gathered block by block into the scratch, widened where bf16 */
            for (long u = t; u < tile_end;) {
                const long j = u / BS, stop = (j + 1) * BS < tile_end ? (j + 1) * BS : tile_end;
                const long off = (long)p_table[b * M + j] * block + (long)h * row + (u - j * BS) * D;
                const long n = (stop - u) * D, at_tile = (u - t) * D;
                if (bf16) {
                    widen((const uint16_t *)p_k + off, kt + at_tile, n);
                    widen((const uint16_t *)p_v + off, vt + at_tile, n);
                } else {
                    memcpy(kt + at_tile, (const float *)p_k + off, sizeof(float) * n);
                    memcpy(vt + at_tile, (const float *)p_v + off, sizeof(float) * n);
                }
                u = stop;
            }
            k = kt, v = vt;
        }
        fold(qs, k, v, cnt, G, D, scale, m, l, acc);
        t = tile_end;
    }
}

/* acc / l of the group's G query heads into the output at `at` */
static void finish(const float *restrict l, const float *restrict acc, void *p_out, int bf16, long at, int G, int D) {
    for (int g = 0; g < G; g++) {
        const float inv = 1.0f / l[g];  /* no position attended: 0 / 0, NaN as the reference */
        for (int d = 0; d < D; d++) {
            const float o = acc[(long)g * D + d] * inv;
            if (bf16) ((uint16_t *)p_out)[at + (long)g * D + d] = float_bf16(o);
            else ((float *)p_out)[at + (long)g * D + d] = o;
        }
    }
}

/* the P partitions' (m, l, acc) of one pair (each [G + G + G * D] floats, in order) merged: every
 * partition rescaled to the largest maximum, summed in partition order */
static void merge(const float *restrict parts, long P, int G, int D, float *restrict l, float *restrict acc) {
    const long stride = 2L * G + (long)G * D;
    for (int g = 0; g < G; g++) {
        float top = -INFINITY;
        for (long p = 0; p < P; p++) top = parts[p * stride + g] > top ? parts[p * stride + g] : top;
        float sum = 0.0f;
        float *restrict a = acc + (long)g * D;
        memset(a, 0, sizeof(float) * D);
        for (long p = 0; p < P; p++) {
            const float *part = parts + p * stride;
            const float w = exp_neg(part[g] - top);
            sum += part[G + g] * w;
            const float *restrict pa = part + 2 * G + (long)g * D;
            for (int d = 0; d < D; d++) a[d] += pa[d] * w;
        }
        l[g] = sum;
    }
}

/* the pair whose partitions hold item i: the last with base[pair] <= i */
static long owner(const long *base, long pairs, long i) {
    long lo = 0, hi = pairs;
    while (hi - lo > 1) {
        const long mid = (lo + hi) / 2;
        if (base[mid] <= i) lo = mid;
        else hi = mid;
    }
    return lo;
}

/* the partitions a call computes (lengths already checked) */
static long items_of(const int32_t *p_lengths, int B, int HKV, int window) {
    long items = 0;
    for (int b = 0; b < B; b++) items += HKV * parts_of(first_attended(p_lengths[b], window), p_lengths[b]);
    return items;
}

/* the threads a call takes: at most `threads`, no more than there are partitions, one below
 * MIN_THREADED (lengths already checked) */
int hcw_paged_decode_team(const int32_t *p_lengths, int B, int H, int HKV, int D, int window, int threads) {
    long work = 0;  /* positions attended over the batch */
    for (int b = 0; b < B; b++) work += p_lengths[b] - first_attended(p_lengths[b], window);
    const long items = items_of(p_lengths, B, HKV, window);
    if (work * H * D < MIN_THREADED || threads < 1) return 1;
    return threads < items ? threads : (int)items;
}

/* bf16: nonzero when q, the pools and out are bf16 (else float32); threads: at most this many
 * OpenMP threads. Returns -4 when the partitions' scratch cannot be allocated. */
int hcw_paged_decode(const void *p_q, const void *p_k, const void *p_v, const int32_t *p_table,
                     const int32_t *p_lengths, void *p_out, int bf16, long N, long M, int B, int H, int HKV,
                     int BS, int D, int window, float scale, int threads) {
    if (HKV < 1 || H % HKV || D < 1 || D > MAX_D || (long)(H / HKV) * D > MAX_GROUP_D || BS < 1) return -3;
    for (int b = 0; b < B; b++) {
        const long n = p_lengths[b];
        if (n < 0 || n > M * BS) return -1;
        for (long j = 0; j < (n + BS - 1) / BS; j++) {
            const long blk = p_table[b * M + j];
            if (blk < 0 || blk >= N) return -2;
        }
    }
    const int G = H / HKV;
    const long pairs = (long)B * HKV, items = items_of(p_lengths, B, HKV, window);
    const long stride = 2L * G + (long)G * D;  /* one partition's (m, l, acc) */
    threads = hcw_paged_decode_team(p_lengths, B, H, HKV, D, window, threads);
    /* item i: partition i - base[pair] of its pair; a pair of one partition writes its output
     * itself, the partitions of a split pair their (m, l, acc) at scratch + i * stride */
    long *base = malloc(sizeof(long) * (pairs + 1));
    float *scratch = items > pairs ? malloc(sizeof(float) * items * stride) : NULL;
    if (!base || (items > pairs && !scratch)) {
        free(base), free(scratch);
        return -4;
    }
    base[0] = 0;
    for (long i = 0; i < pairs; i++) {
        const long n = p_lengths[i / HKV];
        base[i + 1] = base[i] + parts_of(first_attended(n, window), n);
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float m[G], l[G], acc[G * D];
#pragma omp for schedule(dynamic, 1)
        for (long i = 0; i < items; i++) {
            const long pair = owner(base, pairs, i);
            const int b = (int)(pair / HKV), h = (int)(pair % HKV);
            const long n = p_lengths[b], lo = first_attended(n, window), P = base[pair + 1] - base[pair];
            const long from = lo + (i - base[pair]) * PART, to = P == 1 || from + PART > n ? n : from + PART;
            if (P == 1) {
                attend(p_q, p_k, p_v, p_table, bf16, from, to, M, b, h, H, HKV, BS, D, scale, m, l, acc);
                finish(l, acc, p_out, bf16, ((long)b * H + (long)h * G) * D, G, D);
            } else {
                float *part = scratch + i * stride;
                attend(p_q, p_k, p_v, p_table, bf16, from, to, M, b, h, H, HKV, BS, D, scale, part, part + G,
                       part + 2 * G);
            }
        }
#pragma omp for schedule(static)
        for (long pair = 0; pair < pairs; pair++) {
            const long P = base[pair + 1] - base[pair];
            if (P == 1) continue;
            merge(scratch + base[pair] * stride, P, G, D, l, acc);
            const int b = (int)(pair / HKV), h = (int)(pair % HKV);
            finish(l, acc, p_out, bf16, ((long)b * H + (long)h * G) * D, G, D);
        }
    }
    free(base), free(scratch);
    return 0;
}
