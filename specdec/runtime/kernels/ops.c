/* The small per-layer operations of a decoder block, one C call each instead of a dozen torch calls.
 *
 * A decode step of Qwen2.5-Coder-1.5B in q4 spends ~21 ms in matmuls and ~3 ms in the glue between them:
 * per layer two RMSNorms (~13 us each through eight torch ops) and the split / RoPE / KV-cache write of
 * q, k, v (~30 us through ~25 torch ops), mostly dispatch overhead. Here they are ~1-3 us each.
 *
 * rmsnorm: y[i] = w * (x[i] * (1 / sqrt(mean(x[i]^2) + eps))) per row i. The sum of squares runs in a fixed
 *   order that depends only on the row (8-lane partial sums over the row in chunks of 8, a scalar tail, the
 *   lanes folded pairwise), so a row's bits never depend on how many rows share the call.
 * rope_store: per row (b, i) of a fused q|k|v projection [B, n, (H + 2 Hk) D]: q's heads are rotated in
 *   place, k's heads rotated and written to the KV cache at slot start + i, v's copied there. The rotation
 *   is Hugging Face's half-split RoPE computed as torch computes `x * cos + rotate_half(x) * sin`: two
 *   products and a sum, each rounded once (no FMA: -ffp-contract=off), so it gives torch's bits.
 *
 * Worked example (D = 4, one head, cos = [c0 c1 c0 c1], sin = [s0 s1 s0 s1]): x = [a b c d] becomes
 * [a*c0 + (-c)*s0, b*c1 + (-d)*s1, c*c0 + a*s0, d*c1 + b*s1].
 * silu_mul: out[i, j] = silu(g) * u with g = gu[i, j], u = gu[i, I + j] (a fused gate|up projection's row):
 *   silu(g) = g / (1 + exp(-g)), exp from vexp.h (Cephes' expf, as attention's softmax), every element
 *   by the same instructions (a row's tail goes through the same 8-lane code), so its bits depend only on g, u.
 * argmax_rows: torch.argmax over each row (the first maximal index; a NaN counts as maximal, the first one
 *   wins): a greedy round's choice of token. torch's took 92 us for one row of SmolLM2's 49152 logits and 266
 *   for five (a round of k = 4: 4% of a q4 decoding step); two vector passes here (the max, then its first
 *   index), called from Python, take 20 and 58 (benchmarks/s18/argmax-bench.txt).
 * sample_rows: inverse-CDF sampling of probability rows at given uniforms (see there); kth_largest: top-k
 *   sampling's threshold.
 * forward_layers: a decoder's layers in one call (see there): the same C functions in the same order as
 *   `model.Block.forward` calls them one by one from Python, so the same bits, without ~150 us of Python and
 *   torch dispatch per layer (a 1.5B q4 decode step: ~5 ms of ~45).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vexp.h"

int ops_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* x, y [rows, d] (row strides ldx, ldy), w [d]. */
void rmsnorm(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t rows, int64_t d, float eps) {
    for (int64_t i = 0; i < rows; i++) {
        const float *xr = x + i * ldx;
        float *yr = y + i * ldy;
        __m256 acc = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= d; j += 8) {
            __m256 v = _mm256_loadu_ps(xr + j);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        for (; j < d; j++) lanes[j % 8] += xr[j] * xr[j];
        float ss = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        const float r = 1.0f / sqrtf(ss / (float)d + eps);
        const __m256 rv = _mm256_set1_ps(r);
        for (j = 0; j + 8 <= d; j += 8)
            _mm256_storeu_ps(yr + j, _mm256_mul_ps(_mm256_loadu_ps(w + j), _mm256_mul_ps(_mm256_loadu_ps(xr + j), rv)));
        for (; j < d; j++) yr[j] = w[j] * (xr[j] * r);
    }
}

/* out = x * c + rotate_half(x) * s over one head of D; out may be x. */
static inline void rotate(const float *x, const float *c, const float *s, float *out, int64_t D) {
    float t[512];
    const int64_t h = D / 2;
    for (int64_t j = 0; j < h; j++) {
        t[j] = x[j] * c[j] + (-x[j + h]) * s[j];
        t[j + h] = x[j + h] * c[j + h] + x[j] * s[j + h];
    }
    memcpy(out, t, (size_t)D * sizeof(float));
}

/* fp32 x[0 .. D) -> fp16 (round to nearest even: what torch's .half() gives), D a multiple of 8. */
static inline void store_f16(uint16_t *out, const float *x, int64_t D) {
    for (int64_t j = 0; j < D; j += 8)
        _mm_storeu_si128((__m128i *)(out + j), _mm256_cvtps_ph(_mm256_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT));
}

/* fp32 x[0 .. D) -> bf16 as torch's .to(torch.bfloat16) rounds: to nearest even; a NaN becomes the quiet NaN
 * 0x7fc0 (torch may keep another NaN's bits, e.g. 0xffff: a NaN all the same). */
static inline void store_bf16(uint16_t *out, const float *x, int64_t D) {
    for (int64_t j = 0; j < D; j++) {
        uint32_t u;
        memcpy(&u, x + j, sizeof u);
        out[j] = x[j] != x[j] ? 0x7fc0 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

/* qkv [B, n, (H + 2 Hk) * D] contiguous; cos, sin [B, n, D]; kc, vc [B, Hk, S, D], fp32, fp16 or bf16 (fmt 0, 1, 2).
 * Returns 1 if D > 512, D is odd, fmt is unknown, or fmt is 1 and D % 8. */
int rope_store(float *qkv, const float *cos, const float *sin, void *kc, void *vc, int64_t B, int64_t n,
               int64_t H, int64_t Hk, int64_t D, int64_t S, int64_t start, int fmt) {
    if (D > 512 || D % 2 || fmt < 0 || fmt > 2 || (fmt == 1 && D % 8)) return 1;
    const int64_t width = (H + 2 * Hk) * D;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < n; i++) {
            float *row = qkv + (b * n + i) * width;
            const float *c = cos + (b * n + i) * D, *s = sin + (b * n + i) * D;
            for (int64_t h = 0; h < H; h++) rotate(row + h * D, c, s, row + h * D, D);
            for (int64_t h = 0; h < Hk; h++) {
                int64_t slot = ((b * Hk + h) * S + start + i) * D;
                const float *v = row + (H + Hk + h) * D;
                if (fmt) {
                    float k[512];
                    rotate(row + (H + h) * D, c, s, k, D);
                    (fmt == 1 ? store_f16 : store_bf16)((uint16_t *)kc + slot, k, D);
                    (fmt == 1 ? store_f16 : store_bf16)((uint16_t *)vc + slot, v, D);
                } else {
                    rotate(row + (H + h) * D, c, s, (float *)kc + slot, D);
                    memcpy((float *)vc + slot, v, (size_t)D * sizeof(float));
                }
            }
        }
    return 0;
}

static inline __m256 silu_mul8(__m256 g, __m256 u) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

/* gu [rows, 2 I] (gate | up per row), out [rows, I]. */
void silu_mul(const float *gu, float *out, int64_t rows, int64_t I) {
    for (int64_t i = 0; i < rows; i++) {
        const float *g = gu + i * 2 * I, *u = g + I;
        float *o = out + i * I;
        int64_t j = 0;
        for (; j + 8 <= I; j += 8) _mm256_storeu_ps(o + j, silu_mul8(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
        if (j < I) { /* the tail through the same lanes' code */
            float tg[8] = {0}, tu[8] = {0}, to[8];
            memcpy(tg, g + j, (size_t)(I - j) * sizeof(float));
            memcpy(tu, u + j, (size_t)(I - j) * sizeof(float));
            _mm256_storeu_ps(to, silu_mul8(_mm256_loadu_ps(tg), _mm256_loadu_ps(tu)));
            memcpy(o + j, to, (size_t)(I - j) * sizeof(float));
        }
    }
}

/* out[i] = the first index of row i's maximum (of its first NaN, if it has one); x [rows, n] with row stride ld. */
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * ld;
        __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            const __m256 v = _mm256_loadu_ps(row + j);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            top = _mm256_max_ps(top, v);
        }
        float m = -INFINITY, lanes[8];
        int has_nan = !_mm256_testz_ps(nan, nan);
        _mm256_storeu_ps(lanes, top);
        for (int u = 0; u < 8; u++) m = lanes[u] > m ? lanes[u] : m;
        for (int64_t t = j; t < n; t++) {
            has_nan |= row[t] != row[t];
            m = row[t] > m ? row[t] : m;
        }
        int64_t at = 0;
        if (has_nan) {
            while (row[at] == row[at]) at++;
        } else {
            const __m256 mv = _mm256_set1_ps(m);
            for (at = 0; at + 8 <= n; at += 8) {
                const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + at), mv, _CMP_EQ_OQ));
                if (hit) {
                    at += __builtin_ctz(hit);
                    break;
                }
            }
            if (at + 8 > n)  /* not in the whole octets: the tail */
                while (at < n && row[at] != m) at++;
        }
        out[r] = n ? at : 0;
    }
}

/* ---- Sampling -------------------------------------------------------------------------------------------
 * sample_rows: out[r] = the token row r of p [rows, n] (row stride ld) draws at its uniform u[r] in [0, 1): the
 * first index whose cumulative mass exceeds u[r] x the row's total, in float64. The mass is summed in blocks of
 * SAMPLE_BLOCK (each block in one fixed order, the blocks in order), so the draw is a fixed function of the row and
 * u, whatever else runs; a block whose sum passes the target is scanned token by token. Zero-mass tokens never
 * win; where rounding leaves the scan short, the last token with mass before the target wins. -1 for a row
 * that is not a distribution (a negative, NaN or infinite entry, or no mass). Rows need not sum to 1.
 * torch's inverse CDF (a float64 cumsum and a search) took 1.25 ms for a row of 151936 (Qwen2.5's vocabulary)
 * on a Zen 4; this takes one read of the row for the blocks' sums and part of a second. */
#define SAMPLE_BLOCK 64

static double block_sum(const float *x, int64_t m, int *ok) {
    const __m256 zero = _mm256_setzero_ps(), inf = _mm256_set1_ps(INFINITY);
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    __m256 good = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    int64_t j = 0;
    for (; j + 8 <= m; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        good = _mm256_and_ps(good, _mm256_and_ps(_mm256_cmp_ps(v, zero, _CMP_GE_OQ), _mm256_cmp_ps(v, inf, _CMP_LT_OQ)));
        a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
        a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(a0, a1));
    double s = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    *ok &= _mm256_movemask_ps(good) == 0xFF;
    for (; j < m; j++) {
        *ok &= x[j] >= 0 && x[j] < INFINITY;
        s += x[j];
    }
    return s;
}

int sample_rows(const float *p, int64_t rows, int64_t n, int64_t ld, const double *u, int64_t *out) {
    const int64_t nb = (n + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    double *bs = malloc((size_t)(nb ? nb : 1) * sizeof(double));
    if (!bs) return 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = p + r * ld;
        double total = 0;
        int ok = 1;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t lo = b * SAMPLE_BLOCK, m = n - lo < SAMPLE_BLOCK ? n - lo : SAMPLE_BLOCK;
            bs[b] = block_sum(row + lo, m, &ok);
            total += bs[b];
        }
        if (!ok || !(total > 0) || !(total < INFINITY)) {
            out[r] = -1;
            continue;
        }
        const double target = u[r] * total;
        double acc = 0;
        int64_t at = -1, last = -1;
        for (int64_t b = 0; b < nb && at < 0; b++) {
            if (acc + bs[b] > target) {
                const int64_t lo = b * SAMPLE_BLOCK, hi = n - lo < SAMPLE_BLOCK ? n : lo + SAMPLE_BLOCK;
                double c = acc;
                for (int64_t j = lo; j < hi; j++) {
                    if (row[j] > 0) last = j;
                    c += row[j];
                    if (c > target && row[j] > 0) {
                        at = j;
                        break;
                    }
                }
                if (at < 0 && last >= 0) at = last;
                break;
            }
            acc += bs[b];
        }
        if (at < 0) /* u x total rounded up to the total: the last token with mass */
            for (at = n - 1; at > 0 && !(row[at] > 0); at--) {}
        out[r] = at;
    }
    free(bs);
    return 0;
}

/* kth_largest: out[r] = the k-th largest value of row r of x [rows, n] (row stride ld), duplicates counted
 * (torch.topk's values[..., k - 1]), for top-k sampling's threshold; 1 <= k <= n, no NaN. One pass keeping a
 * min-heap of the k largest seen, eight values at a time compared with its least. torch.topk took 2.3 ms for
 * 4 rows of 151936 with k = 50 on a Zen 4. Returns 2 when out of memory. */
static void sift_down(float *h, int64_t k, int64_t i) {
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= k) return;
        if (c + 1 < k && h[c + 1] < h[c]) c++;
        if (!(h[c] < h[i])) return;
        const float t = h[c];
        h[c] = h[i], h[i] = t, i = c;
    }
}

int kth_largest(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t k, float *out) {
    float *heap = malloc((size_t)k * sizeof(float));
    if (!heap) return 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * ld;
        memcpy(heap, row, (size_t)k * sizeof(float));
        for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(heap, k, i);
        int64_t j = k;
        for (; j + 8 <= n; j += 8) {
            int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), _mm256_set1_ps(heap[0]), _CMP_GT_OQ));
            while (hit) {
                const float y = row[j + __builtin_ctz(hit)];
                hit &= hit - 1;
                if (y > heap[0]) heap[0] = y, sift_down(heap, k, 0);
            }
        }
        for (; j < n; j++)
            if (row[j] > heap[0]) heap[0] = row[j], sift_down(heap, k, 0);
        out[r] = heap[0];
    }
    free(heap);
    return 0;
}

/* out[r * k + i] = the index of row r's (i+1)-th largest entry, largest first, ties to the lower index, for x
 * [rows, n] with row stride ld and 1 <= k <= n: one pass keeping the best k in order, a comparison of 8 entries at a
 * time against the k-th best so far. NaN and -inf entries never enter; a row with fewer than k other entries
 * returns 1 (the caller asks torch). Two rows of SmolLM2's 49152 logits: 16-22 us on a Zen 4, torch's topk 86-125. */
int topk_rows(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t k, int64_t *out) {
    float *best = malloc((size_t)k * sizeof(float));
    if (!best) return 2;
    int short_row = 0;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * ld;
        int64_t *idx = out + r * k;
        for (int64_t i = 0; i < k; i++) best[i] = -INFINITY, idx[i] = -1;
        int64_t j = 0;
        for (;; j += 8) {
            int hit;
            if (j + 8 <= n)
                hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), _mm256_set1_ps(best[k - 1]), _CMP_GT_OQ));
            else if (j < n) {
                hit = 0;
                for (int64_t t = j; t < n; t++) hit |= (row[t] > best[k - 1]) << (t - j);
            } else
                break;
            while (hit) {
                const int64_t at = j + __builtin_ctz(hit);
                const float y = row[at];
                hit &= hit - 1;
                if (!(y > best[k - 1])) continue;  /* the k-th best rose since the comparison */
                int64_t i = k - 1;
                for (; i > 0 && best[i - 1] < y; i--) best[i] = best[i - 1], idx[i] = idx[i - 1];
                best[i] = y, idx[i] = at;
            }
        }
        short_row |= idx[k - 1] < 0;
    }
    free(best);
    return short_row;
}

/* ---- A decoder's layers in one call ----------------------------------------------------------------
 * Per layer, as `model.Block.forward`: h = rmsnorm(x); qkv = h W_qkv^T (+ bias); per segment, RoPE on q, k and
 * its cache write (rope_store); a = attention of every segment's rows over its own cache and key lists, in one
 * call (attention.c's attend_batch, the bits of `attend`); x = x + a W_o^T;
 * h = rmsnorm(x); gu = h W_gate|up^T; x = x + silu_mul(gu) W_down^T. Each matmul is one of the runtime's
 * kernels called through a pointer (qgemm.c's qgemm for quantized parts, skinny.c's skinny_bf16 for bf16
 * weights), attention is attention.c's attend_batch: the bits of the calls Python makes. The rows of x
 * may belong to several requests (segments, each with its own cache: the batched server's packed forward);
 * a single request is one segment.
 *
 * desc, per layer LAYER_WORDS int64: the two norms' weights, then the projections qkv, o, gate_up, down, each
 * [parts, then PARTS x (kind, fmt, weights, scales, mins, bias, rows)] (kind 0: qgemm, fmt its format code;
 * kind 1: skinny_bf16, one part). segs, per segment SEG_WORDS int64: its first row in x, rows n, cache start,
 * cache slots S, the attention plan's prefix, offs and extra (attention.c), its cos and sin [n, D], 1 when its rows
 * are prompt rows being prefilled (their quantized matmuls then run on isas[4], qgemm.c's prefill ISA, unless
 * that is 0: prompt processing is verified against nothing, so it may take a faster path). kv, per
 * segment and layer: the cache's k and v [1, Hk, S, D]. hidden: per layer 0 or an [N, d] buffer that receives
 * x after it. dims: d, H, Hk, D, I, N (rows of x), layers, segments. isas: qgemm's, skinny's, attend's,
 * threads, qgemm's for prefill rows (0: qgemm's), the caches' format (0 fp32, 1 fp16, 2 bf16). Returns 0, or the
 * first failing call's nonzero code (2: out of memory). */
typedef int (*qgemm_fn)(int, int, const float *, const uint8_t *, const float *, const float *, const float *,
                        float *, int64_t, int64_t, int64_t, int64_t, int);
typedef int (*skinny_fn)(int, const float *, const uint16_t *, const float *, float *, int64_t, int64_t, int64_t, int);
typedef int (*attend_fn)(const float *, int64_t, float *, int64_t, const int64_t *, int64_t, int64_t, int64_t,
                         int, int, int);
#define PARTS 3
#define PART_WORDS 7
#define PROJ_WORDS (1 + PARTS * PART_WORDS)
#define LAYER_WORDS (2 + 4 * PROJ_WORDS)
#define SEG_WORDS 10

/* y = x W^T over the rows of x, each projection part into its columns. Quantized parts take the rows in `runs`
 * (first row, rows, qgemm ISA per run of segments: prefill rows on the prefill ISA), bf16 parts all rows at once. */
static int project(const int64_t *p, const float *x, float *y, int64_t n, int64_t in, int64_t out,
                   qgemm_fn qgemm, skinny_fn skinny, const int *isas, const int64_t *runs, int64_t nruns) {
    int64_t col = 0;
    for (int64_t k = 0; k < p[0]; k++) {
        const int64_t *q = p + 1 + k * PART_WORDS;
        int rc = 0;
        if (q[0] == 0)
            for (int64_t r = 0; r < nruns && !rc; r++)
                rc = qgemm((int)q[1], (int)runs[3 * r + 2], x + runs[3 * r] * in, (const uint8_t *)q[2],
                           (const float *)q[3], (const float *)q[4], (const float *)q[5], y + runs[3 * r] * out + col,
                           out, runs[3 * r + 1], in, q[6], isas[3]);
        else
            rc = skinny(isas[1], x, (const uint16_t *)q[2], (const float *)q[5], y, n, in, q[6], isas[3]);
        if (rc) return rc;
        col += q[6];
    }
    return 0;
}

int forward_layers(const int64_t *desc, const int64_t *segs, const int64_t *kv, const int64_t *hidden, float *x,
                   const int64_t *dims, float eps, const int *isas, const int64_t *fns) {
    const int64_t d = dims[0], H = dims[1], Hk = dims[2], D = dims[3], I = dims[4], n = dims[5], L = dims[6],
                  nseg = dims[7], wq = (H + 2 * Hk) * D;
    qgemm_fn qgemm = (qgemm_fn)fns[0];
    skinny_fn skinny = (skinny_fn)fns[1];
    attend_fn attend = (attend_fn)fns[2];
    float *h = malloc((size_t)(n * d) * sizeof(float)), *t = malloc((size_t)(n * d) * sizeof(float));
    float *qkv = malloc((size_t)(n * wq) * sizeof(float)), *a = malloc((size_t)(n * H * D) * sizeof(float));
    float *gu = malloc((size_t)(n * 2 * I) * sizeof(float)), *act = malloc((size_t)(n * I) * sizeof(float));
    int64_t *att = malloc((size_t)(nseg * 8) * sizeof(int64_t));  /* attend_batch's segments, k and v per layer */
    int64_t *runs = malloc((size_t)(nseg * 3) * sizeof(int64_t)), nruns = 0; /* consecutive segments, one qgemm ISA */
    int rc = (!h || !t || !qkv || !a || !gu || !act || !att || !runs) ? 2 : 0;
    for (int64_t g = 0; g < nseg && !rc; g++) {
        const int64_t *sg = segs + g * SEG_WORDS, isa = sg[9] && isas[4] ? isas[4] : isas[0];
        if (nruns && runs[3 * nruns - 1] == isa) runs[3 * nruns - 2] += sg[1];
        else runs[3 * nruns] = sg[0], runs[3 * nruns + 1] = sg[1], runs[3 * nruns + 2] = isa, nruns++;
    }
    for (int64_t g = 0; g < nseg && !rc; g++) {
        const int64_t *sg = segs + g * SEG_WORDS;
        int64_t *ag = att + 8 * g;
        ag[0] = sg[0]; ag[1] = sg[1]; ag[2] = sg[3]; ag[3] = sg[4]; ag[4] = sg[5]; ag[5] = sg[6];
    }
    for (int64_t l = 0; l < L && !rc; l++) {
        const int64_t *w = desc + l * LAYER_WORDS, *proj = w + 2;
        rmsnorm(x, d, (const float *)w[0], h, d, n, d, eps);
        if ((rc = project(proj, h, qkv, n, d, wq, qgemm, skinny, isas, runs, nruns))) break;
        for (int64_t g = 0; g < nseg && !rc; g++) {
            const int64_t *sg = segs + g * SEG_WORDS, r0 = sg[0], m = sg[1], start = sg[2], S = sg[3];
            void *kc = (void *)kv[2 * (g * L + l)], *vc = (void *)kv[2 * (g * L + l) + 1];
            rc = rope_store(qkv + r0 * wq, (const float *)sg[7], (const float *)sg[8], kc, vc, 1, m, H, Hk, D, S, start,
                            isas[5]);
            att[8 * g + 6] = (int64_t)kc;
            att[8 * g + 7] = (int64_t)vc;
        }
        /* q: row r's head h at qkv + r * wq + h * D */
        if (rc || (rc = attend(qkv, wq, a, nseg, att, H, Hk, D, isas[2], isas[5], isas[3]))) break;
        if ((rc = project(proj + PROJ_WORDS, a, t, n, H * D, d, qgemm, skinny, isas, runs, nruns))) break;
        for (int64_t i = 0; i < n * d; i++) x[i] = x[i] + t[i];
        rmsnorm(x, d, (const float *)w[1], h, d, n, d, eps);
        if ((rc = project(proj + 2 * PROJ_WORDS, h, gu, n, d, 2 * I, qgemm, skinny, isas, runs, nruns))) break;
        silu_mul(gu, act, n, I);
        if ((rc = project(proj + 3 * PROJ_WORDS, act, t, n, I, d, qgemm, skinny, isas, runs, nruns))) break;
        for (int64_t i = 0; i < n * d; i++) x[i] = x[i] + t[i];
        if (hidden[l]) memcpy((float *)hidden[l], x, (size_t)(n * d) * sizeof(float));
    }
    free(h); free(t); free(qkv); free(a); free(gu); free(act); free(att); free(runs);
    return rc;
}
