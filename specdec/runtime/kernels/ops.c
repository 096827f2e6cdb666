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
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* qkv [B, n, (H + 2 Hk) * D] contiguous; cos, sin [B, n, D]; kc, vc [B, Hk, S, D]. Returns 1 if D > 512. */
int rope_store(float *qkv, const float *cos, const float *sin, float *kc, float *vc, int64_t B, int64_t n,
               int64_t H, int64_t Hk, int64_t D, int64_t S, int64_t start) {
    if (D > 512 || D % 2) return 1;
    const int64_t width = (H + 2 * Hk) * D;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < n; i++) {
            float *row = qkv + (b * n + i) * width;
            const float *c = cos + (b * n + i) * D, *s = sin + (b * n + i) * D;
            for (int64_t h = 0; h < H; h++) rotate(row + h * D, c, s, row + h * D, D);
            for (int64_t h = 0; h < Hk; h++) {
                int64_t slot = ((b * Hk + h) * S + start + i) * D;
                rotate(row + (H + h) * D, c, s, kc + slot, D);
                memcpy(vc + slot, row + (H + Hk + h) * D, (size_t)D * sizeof(float));
            }
        }
    return 0;
}
