/* Exact attention for n query rows in one call: every row's output is the n = 1 call's, bit for bit.
 *
 * out[b, i, h, :] = softmax(q[b, h, i] . K[b, h / G, s] / sqrt(D) over s in keys(i)) . V[b, h / G, s]
 * with G = H / Hk query heads per KV head (GQA) and keys(i) = cache slots 0 .. prefix[i]-1, then the
 * slots extra[offs[i] .. offs[i+1]-1] (a tree node's ancestors and itself among the new positions).
 *
 * Order-invariant arithmetic. One (batch, row, head) is a fixed sequence of float operations that
 * depends only on its query vector and the key/value vectors of its key list, in list order:
 *   - q is scaled by 1/sqrt(D) first (one multiply per element);
 *   - a score q . k: one 8-lane vector of partial sums (a multiply, then an FMA per further chunk of 8
 *     of D), its lanes folded ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)) by `hsum8x8`, the same for every key;
 *   - keys go in blocks of BLK from the start of the list (online softmax, Milakov & Gimelshein 2018):
 *     per block the running max m, f = exp(m_old - m), p = exp(s - m) by `exp8` (pure arithmetic, no
 *     libm), the 8-lane exp-sum l = l*f + p octets in key order, acc = acc*f + p_j * V_j in key order;
 *   - out = acc / (l's lanes folded by the same tree).
 * Pad lanes of a last partial octet read a zero key and get p = 0 (adding +0 changes nothing); a max is
 * the same in any order. The rows
 * of a call, the heads sharing a task and the threads running the tasks never mix their sums, so which
 * row, which n and which thread count computes a (row, head) never changes its bits.
 *
 * Worked example: a chain of n = 3 new positions after start = 5 cached ones: prefix = [6, 7, 8], no
 * extras; row 2 walks slots 0..7, exactly what a single-position forward at that position walks. A tree
 * root -> a, b (new positions 0, 1, 2 in slots 5, 6, 7): prefix = [6, 7, 6], extra = [] [] [7]: node b
 * walks 0..4 (the cache), 5 (root), 7 (itself), the keys a single-position forward would have in 0..6.
 *
 * Two instruction sets: `task` (AVX2 + FMA, 8 lanes) and `task512` (AVX512F, 16 lanes); in both the heads
 * of a task share every K and V load. Two cache formats: fp32, or fp16 (`half`; the exact CPU paths' default,
 * `--kv-dtype`) widened to fp32 as it is loaded (F16C's `vcvtph2ps`, exact), then the same operations: an fp16
 * cache gives the bits of an fp32 cache holding the same values, for half the bytes a step reads (SmolLM2 q4,
 * 2-core Zen 4, 16 requests of 1024 positions: a packed decoding step 0.70-0.74x the fp32 cache's time).
 * `attend` runs the instruction set it is told (the Python side picks the best per CPU).
 * Threads: tasks are (batch, row, kv head, chunk of its G query heads), split finer only while some thread
 * would have none: the chunks of one KV head each stream its keys and values, so a split reads them twice.
 * At one row that was most of attention's cost (2-core Zen 4, context 256, one decoding step: SmolLM2 bf16
 * 1.33 -> 0.76 ms, its 3 KV heads no longer split for 2 threads; Qwen2.5-Coder-1.5B q4 2.31 -> 1.14 ms).
 * Compile with -ffp-contract=off (explicit FMAs only), never -ffast-math.
 *
 * Cost (SmolLM2-135M, 9 query / 3 KV heads of 64, 256 cached positions, one Zen 5 core, AVX512): 16 rows
 * in ~0.1 ms a layer against ~0.14 ms for one masked torch call and ~0.44 ms row by row; one row in
 * ~14 us against ~26 us (CPU time). */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "vexp.h"

#define BLK 64    /* keys per online-softmax block */
#define GMAX 8    /* query heads per task */
#define DMAX 256  /* largest head dimension */

static const float zero_row[DMAX] __attribute__((aligned(64)));  /* a zero key in either format */

/* A KV-cache element load: 8 fp32, or 8 fp16 widened by F16C (`half` a literal 1; exact: every fp16 is an fp32). */
static inline __attribute__((always_inline)) __m256 ld8(const void *p, int64_t off, const int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + off)))
                : _mm256_loadu_ps((const float *)p + off);
}

/* Eight 8-lane partial sums -> their eight totals, lane u = ((a_u0+a_u1)+(a_u2+a_u3))+((a_u4+a_u5)+(a_u6+a_u7)). */
static inline __m256 hsum8x8(const __m256 a[8]) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

static inline float fold8(__m256 a) {
    __m256 z = _mm256_setzero_ps();
    __m256 all[8] = {a, z, z, z, z, z, z, z};
    return _mm256_cvtss_f32(hsum8x8(all));
}

/* acc[g][c0 .. c0+8*nc) = acc * f[g] + sum_t p[g][t] * v[t][c0 ..), t in order, for heads g < gp (<= 2) and
 * nc <= 4 chunks of 8; the V loads are shared by the heads. Called with literal gp, nc (registers). */
static inline __attribute__((always_inline)) void weigh8(float (*acc)[DMAX], const __m256 *f, float (*p)[BLK],
                                                         const void *const *v, int nb, int c0, const int gp,
                                                         const int nc, const int half) {
    __m256 r[2][4];
    for (int g = 0; g < gp; g++)
        for (int u = 0; u < nc; u++) r[g][u] = _mm256_mul_ps(_mm256_load_ps(acc[g] + c0 + 8 * u), f[g]);
    for (int t = 0; t < nb; t++) {
        __m256 x[4];
        for (int u = 0; u < nc; u++) x[u] = ld8(v[t], c0 + 8 * u, half);
        for (int g = 0; g < gp; g++) {
            __m256 pb = _mm256_set1_ps(p[g][t]);
            for (int u = 0; u < nc; u++) r[g][u] = _mm256_fmadd_ps(pb, x[u], r[g][u]);
        }
    }
    for (int g = 0; g < gp; g++)
        for (int u = 0; u < nc; u++) _mm256_store_ps(acc[g] + c0 + 8 * u, r[g][u]);
}

/* s[g][t] = qs[g] . k[t] for heads g < gp (<= 4) and keys t < nb8 (a multiple of 8); every K chunk is loaded
 * once for the gp heads. Called through `scores8` (`SCORES`) with literal gp and half, so the partial sums stay
 * in registers, and a literal nd for head dims 64 and 128 (as score16). */
static inline __attribute__((always_inline)) void score8(float (*qs)[DMAX], const void *const *kp, int nb8,
                                                         float (*s)[BLK], const int nd, const int gp,
                                                         const int half) {
    for (int t0 = 0; t0 < nb8; t0 += 8) {
        __m256 a[4][8];
        for (int u = 0; u < 8; u++) {
            const void *k = kp[t0 + u];
            __m256 x[4], kc = ld8(k, 0, half);
            for (int g = 0; g < gp; g++) x[g] = _mm256_mul_ps(_mm256_load_ps(qs[g]), kc);
            for (int c = 1; c < nd; c++) {
                kc = ld8(k, 8 * c, half);
                for (int g = 0; g < gp; g++) x[g] = _mm256_fmadd_ps(_mm256_load_ps(qs[g] + 8 * c), kc, x[g]);
            }
            for (int g = 0; g < gp; g++) a[g][u] = x[g];
        }
        for (int g = 0; g < gp; g++) _mm256_store_ps(s[g] + t0, hsum8x8(a[g]));
    }
}

/* The body of scores8 / scores16: `score` called with literal gp (1..4), half and, for head dims 64 and 128
 * (nd n64 and n128 chunks), literal nd, so its loops unroll and its partial sums stay in registers. */
#define SCORE_CASE(score, n64, n128, g, h)                                                            \
    if (gp == g && half == h) {                                                                       \
        if (nd == n64) score(qs, kp, nb8, s, n64, g, h);                                              \
        else if (nd == n128) score(qs, kp, nb8, s, n128, g, h);                                       \
        else score(qs, kp, nb8, s, nd, g, h);                                                         \
        return;                                                                                       \
    }
#define SCORES(score, n64, n128)                                                                      \
    SCORE_CASE(score, n64, n128, 4, 0) SCORE_CASE(score, n64, n128, 3, 0)                             \
    SCORE_CASE(score, n64, n128, 2, 0) SCORE_CASE(score, n64, n128, 1, 0)                             \
    SCORE_CASE(score, n64, n128, 4, 1) SCORE_CASE(score, n64, n128, 3, 1)                             \
    SCORE_CASE(score, n64, n128, 2, 1) SCORE_CASE(score, n64, n128, 1, 1)

static void scores8(float (*qs)[DMAX], const void *const *kp, int nb8, float (*s)[BLK], int nd, int gp, int half) {
    SCORES(score8, 8, 16)
}

/* One task: heads h0 .. h0+gc-1 (all on kv head kh) of row i of batch b; kb, vb that KV head's keys and values,
 * fp32 or (half) fp16. */
static inline __attribute__((always_inline)) void task(const float *q, int64_t q_sb, int64_t q_sh, int64_t q_sn,
                                                       const void *kb, const void *vb, float *out, int64_t prefix,
                                                       const int64_t *extra, int64_t n_extra, int64_t b, int64_t i,
                                                       int64_t h0, int gc, int64_t n, int64_t H, int64_t D,
                                                       const int half) {
    float qs[GMAX][DMAX] __attribute__((aligned(32)));
    float acc[GMAX][DMAX] __attribute__((aligned(32)));
    float s[GMAX][BLK] __attribute__((aligned(32)));
    float m[GMAX];
    __m256 l[GMAX];
    const void *kp[BLK], *vp[BLK];
    const int nd = (int)(D / 8);
    const int64_t row = D * (half ? 2 : 4); /* bytes per key */
    const __m256 scale = _mm256_set1_ps(1.0f / sqrtf((float)D));
    for (int g = 0; g < gc; g++) {
        const float *qr = q + b * q_sb + (h0 + g) * q_sh + i * q_sn;
        for (int c = 0; c < nd; c++) _mm256_store_ps(qs[g] + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(qr + 8 * c), scale));
        memset(acc[g], 0, sizeof(float) * D);
        m[g] = -INFINITY;
        l[g] = _mm256_setzero_ps();
    }
    const int64_t L = prefix + n_extra;
    for (int64_t j0 = 0; j0 < L; j0 += BLK) {
        const int nb = (int)(L - j0 < BLK ? L - j0 : BLK);
        const int nb8 = (nb + 7) & ~7;
        for (int t = 0; t < nb8; t++) {
            if (t < nb) {
                int64_t j = j0 + t, slot = j < prefix ? j : extra[j - prefix];
                kp[t] = (const char *)kb + slot * row;
                vp[t] = (const char *)vb + slot * row;
            } else {
                kp[t] = vp[t] = zero_row;
            }
        }
        for (int g0 = 0; g0 < gc; g0 += 4) {
            const int gp = gc - g0 < 4 ? gc - g0 : 4;
            scores8(qs + g0, kp, nb8, s + g0, nd, gp, half);
        }
        __m256 f[GMAX];
        for (int g = 0; g < gc; g++) {
            float mb = m[g];
            for (int t = 0; t < nb; t++) mb = s[g][t] > mb ? s[g][t] : mb;
            f[g] = m[g] == -INFINITY ? _mm256_setzero_ps() : exp8(_mm256_set1_ps(m[g] - mb));
            m[g] = mb;
            const __m256 mv = _mm256_set1_ps(mb);
            __m256 sum = _mm256_mul_ps(l[g], f[g]);
            for (int t0 = 0; t0 < nb8; t0 += 8) {
                __m256 p = exp8(_mm256_sub_ps(_mm256_load_ps(s[g] + t0), mv));
                _mm256_store_ps(s[g] + t0, p);
            }
            for (int t = nb; t < nb8; t++) s[g][t] = 0.0f;
            for (int t0 = 0; t0 < nb8; t0 += 8) sum = _mm256_add_ps(sum, _mm256_load_ps(s[g] + t0));
            l[g] = sum;
        }
        for (int g0 = 0; g0 < gc; g0 += 2) {
            const int gp = gc - g0 < 2 ? gc - g0 : 2;
            for (int c0 = 0; c0 < D; c0 += 32) {
                const int nc = (int)((D - c0) / 8 < 4 ? (D - c0) / 8 : 4);
                if (nc == 4 && gp == 2) weigh8(acc + g0, f + g0, s + g0, vp, nb, (int)c0, 2, 4, half);
                else if (nc == 4) weigh8(acc + g0, f + g0, s + g0, vp, nb, (int)c0, 1, 4, half);
                else weigh8(acc + g0, f + g0, s + g0, vp, nb, (int)c0, gp, nc, half);
            }
        }
    }
    for (int g = 0; g < gc; g++) {
        const __m256 tot = _mm256_set1_ps(fold8(l[g]));
        float *o = out + ((b * n + i) * H + h0 + g) * D;
        for (int c = 0; c < nd; c++) _mm256_storeu_ps(o + 8 * c, _mm256_div_ps(_mm256_load_ps(acc[g] + 8 * c), tot));
    }
}

/* ---- AVX512: 16 lanes -----------------------------------------------------------------------------
 * The same algorithm as `task`, in 16 lanes, with its own fixed order per (row, head): a score is D/16
 * chunks (a multiply, then FMAs), its 16 lanes folded to 8 (low half + high half), then `hsum8x8`; the
 * exp-sum keeps 16 lanes, folded the same way at the end. Used on CPUs with AVX512F when D % 16 == 0
 * (a machine always takes the same path, so its bits never depend on n). */

#define T512 __attribute__((target("avx512f")))

/* ld8's 16 lanes. */
T512 static inline __attribute__((always_inline)) __m512 ld16(const void *p, int64_t off, const int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + off)))
                : _mm512_loadu_ps((const float *)p + off);
}

T512 static inline __m256 half16(__m512 x) {  /* 16 lanes -> 8: lane u + lane u+8 */
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}

/* acc[g][c0 .. c0+16*nc) = acc * f[g] + sum_t p[g][t] * v[t][c0 ..), t in order, for heads g < gp; the V
 * loads are shared by the heads. Called with literal gp, nc so the accumulators stay in registers. */
T512 static inline __attribute__((always_inline)) void weigh16(float (*acc)[DMAX], const __m512 *f, float (*p)[BLK],
                                                               const void *const *v, int nb, int c0,
                                                               const int gp, const int nc, const int half) {
    __m512 r[4][4];
    for (int g = 0; g < gp; g++)
        for (int u = 0; u < nc; u++) r[g][u] = _mm512_mul_ps(_mm512_load_ps(acc[g] + c0 + 16 * u), f[g]);
    for (int t = 0; t < nb; t++) {
        __m512 x[4];
        for (int u = 0; u < nc; u++) x[u] = ld16(v[t], c0 + 16 * u, half);
        for (int g = 0; g < gp; g++) {
            __m512 pb = _mm512_set1_ps(p[g][t]);
            for (int u = 0; u < nc; u++) r[g][u] = _mm512_fmadd_ps(pb, x[u], r[g][u]);
        }
    }
    for (int g = 0; g < gp; g++)
        for (int u = 0; u < nc; u++) _mm512_store_ps(acc[g] + c0 + 16 * u, r[g][u]);
}

/* s[g][t] = qs[g] . k[t] for heads g < gp and keys t < nb8 (a multiple of 8); every K chunk is loaded once
 * for the gp heads. Called with literal gp so the partial sums stay in registers, and with a literal nd for the
 * common head dims (`scores16`): the chunk loop then unrolls and the compiler interleaves the 8 keys' chains of
 * dependent FMAs, which otherwise ran one key after another at the FMA's latency (the same operations in the
 * same order: the bits do not change). */
T512 static inline __attribute__((always_inline)) void score16(float (*qs)[DMAX], const void *const *kp, int nb8,
                                                               float (*s)[BLK], const int nd, const int gp,
                                                               const int half) {
    for (int t0 = 0; t0 < nb8; t0 += 8) {
        __m256 a[4][8];
        for (int u = 0; u < 8; u++) {
            const void *k = kp[t0 + u];
            __m512 x[4], kc = ld16(k, 0, half);
            for (int g = 0; g < gp; g++) x[g] = _mm512_mul_ps(_mm512_load_ps(qs[g]), kc);
            for (int c = 1; c < nd; c++) {
                kc = ld16(k, 16 * c, half);
                for (int g = 0; g < gp; g++) x[g] = _mm512_fmadd_ps(_mm512_load_ps(qs[g] + 16 * c), kc, x[g]);
            }
            for (int g = 0; g < gp; g++) a[g][u] = half16(x[g]);
        }
        for (int g = 0; g < gp; g++) _mm256_store_ps(s[g] + t0, hsum8x8(a[g]));
    }
}

T512 static void scores16(float (*qs)[DMAX], const void *const *kp, int nb8, float (*s)[BLK], int nd, int gp,
                          int half) {
    SCORES(score16, 4, 8)
}
#undef SCORES
#undef SCORE_CASE

T512 static inline __attribute__((always_inline)) void task512(const float *q, int64_t q_sb, int64_t q_sh,
                                                               int64_t q_sn, const void *kb, const void *vb,
                                                               float *out, int64_t prefix, const int64_t *extra,
                                                               int64_t n_extra, int64_t b, int64_t i, int64_t h0,
                                                               int gc, int64_t n, int64_t H, int64_t D,
                                                               const int half) {
    float qs[GMAX][DMAX] __attribute__((aligned(64)));
    float acc[GMAX][DMAX] __attribute__((aligned(64)));
    float s[GMAX][BLK] __attribute__((aligned(64)));
    float m[GMAX];
    __m512 l[GMAX], f[GMAX];
    const void *kp[BLK], *vp[BLK];
    const int nd = (int)(D / 16);
    const int64_t row = D * (half ? 2 : 4); /* bytes per key */
    const __m512 scale = _mm512_set1_ps(1.0f / sqrtf((float)D));
    for (int g = 0; g < gc; g++) {
        const float *qr = q + b * q_sb + (h0 + g) * q_sh + i * q_sn;
        for (int c = 0; c < nd; c++) _mm512_store_ps(qs[g] + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(qr + 16 * c), scale));
        memset(acc[g], 0, sizeof(float) * D);
        m[g] = -INFINITY;
        l[g] = _mm512_setzero_ps();
    }
    const int64_t L = prefix + n_extra;
    for (int64_t j0 = 0; j0 < L; j0 += BLK) {
        const int nb = (int)(L - j0 < BLK ? L - j0 : BLK);
        const int nb8 = (nb + 7) & ~7, nb16 = (nb + 15) & ~15;
        for (int t = 0; t < nb8; t++) {
            if (t < nb) {
                int64_t j = j0 + t, slot = j < prefix ? j : extra[j - prefix];
                kp[t] = (const char *)kb + slot * row;
                vp[t] = (const char *)vb + slot * row;
            } else {
                kp[t] = vp[t] = zero_row;
            }
        }
        const int per = (gc + (gc + 3) / 4 - 1) / ((gc + 3) / 4);  /* heads per pass, balanced: 6 -> 3 + 3 */
        for (int g0 = 0; g0 < gc; g0 += per) {
            const int gp = gc - g0 < per ? gc - g0 : per;
            scores16(qs + g0, kp, nb8, s + g0, nd, gp, half);
        }
        for (int g = 0; g < gc; g++) {
            for (int t = nb; t < nb16; t++) s[g][t] = -INFINITY;
            __m512 mx = _mm512_set1_ps(m[g]);
            for (int t0 = 0; t0 < nb16; t0 += 16) mx = _mm512_max_ps(mx, _mm512_load_ps(s[g] + t0));
            const float mb = _mm512_reduce_max_ps(mx);  /* a max is the same in any order */
            f[g] = m[g] == -INFINITY ? _mm512_setzero_ps() : exp16(_mm512_set1_ps(m[g] - mb));
            m[g] = mb;
            const __m512 mv = _mm512_set1_ps(mb);
            __m512 sum = _mm512_mul_ps(l[g], f[g]);
            for (int t0 = 0; t0 < nb16; t0 += 16) {
                __m512 p = exp16(_mm512_sub_ps(_mm512_load_ps(s[g] + t0), mv));
                _mm512_store_ps(s[g] + t0, p);
            }
            for (int t = nb; t < nb16; t++) s[g][t] = 0.0f;
            for (int t0 = 0; t0 < nb16; t0 += 16) sum = _mm512_add_ps(sum, _mm512_load_ps(s[g] + t0));
            l[g] = sum;
        }
        for (int g0 = 0; g0 < gc; g0 += per) {
            const int gp = gc - g0 < per ? gc - g0 : per;
            for (int c0 = 0; c0 < D; c0 += 64) {
                const int nc = (int)((D - c0) / 16 < 4 ? (D - c0) / 16 : 4);
                float (*ag)[DMAX] = acc + g0;
                float (*pg)[BLK] = s + g0;
                if (nc == 4 && gp == 4) weigh16(ag, f + g0, pg, vp, nb, (int)c0, 4, 4, half);
                else if (nc == 4 && gp == 3) weigh16(ag, f + g0, pg, vp, nb, (int)c0, 3, 4, half);
                else if (nc == 4 && gp == 2) weigh16(ag, f + g0, pg, vp, nb, (int)c0, 2, 4, half);
                else if (nc == 4) weigh16(ag, f + g0, pg, vp, nb, (int)c0, 1, 4, half);
                else weigh16(ag, f + g0, pg, vp, nb, (int)c0, gp, nc, half);
            }
        }
    }
    for (int g = 0; g < gc; g++) {
        const __m512 tot = _mm512_set1_ps(fold8(half16(l[g])));
        float *o = out + ((b * n + i) * H + h0 + g) * D;
        for (int c = 0; c < nd; c++) _mm512_storeu_ps(o + 16 * c, _mm512_div_ps(_mm512_load_ps(acc[g] + 16 * c), tot));
    }
}

#define TASK_ARGS const float *q, int64_t q_sb, int64_t q_sh, int64_t q_sn, const void *kb, const void *vb, float *out, \
                  int64_t prefix, const int64_t *extra, int64_t n_extra, int64_t b, int64_t i, int64_t h0, int gc,   \
                  int64_t n, int64_t H, int64_t D
#define TASK_PASS q, q_sb, q_sh, q_sn, kb, vb, out, prefix, extra, n_extra, b, i, h0, gc, n, H, D
static void task_f32(TASK_ARGS) { task(TASK_PASS, 0); }
static void task_f16(TASK_ARGS) { task(TASK_PASS, 1); }
T512 static void task512_f32(TASK_ARGS) { task512(TASK_PASS, 0); }
T512 static void task512_f16(TASK_ARGS) { task512(TASK_PASS, 1); }

/* One task on instruction set `isa` over an fp32 (half 0) or fp16 (half 1) cache. */
static void run_task(int isa, int half, TASK_ARGS) {
    if (isa == 2) (half ? task512_f16 : task512_f32)(TASK_PASS);
    else (half ? task_f16 : task_f32)(TASK_PASS);
}
#undef TASK_ARGS
#undef TASK_PASS

/* 1 when the CPU runs `isa` (1: AVX2 + FMA + F16C; 2: AVX512F). */
int attend_supported(int isa) {
    __builtin_cpu_init();
    if (isa == 1)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa == 2) return __builtin_cpu_supports("avx512f");
    return 0;
}

/* q [B, H, n, D] (strides q_sb, q_sh, q_sn in floats, D contiguous); k, v the layer's cache [B, Hk, S, D]
 * contiguous, fp32 or (half 1) fp16; out [B, n, H, D] contiguous. Row i sees slots 0 .. prefix[i]-1 then extra[offs[i] ..
 * offs[i+1]-1] (the same lists for every batch); isa 2 (AVX512, D % 16 == 0) or 1 (AVX2). Returns 0, or 1
 * when D, H / Hk or isa are out of range. */
int attend(const float *q, int64_t q_sb, int64_t q_sh, int64_t q_sn, const void *k, const void *v, float *out,
           const int64_t *prefix, const int64_t *offs, const int64_t *extra,
           int64_t B, int64_t n, int64_t H, int64_t Hk, int64_t S, int64_t D, int isa, int half, int threads) {
    if (D % 8 || D > DMAX || D <= 0 || Hk <= 0 || H % Hk || !attend_supported(isa) || (isa == 2 && D % 16)) return 1;
    const int64_t G = H / Hk, units = B * n * Hk;
    int64_t chunks = (G + GMAX - 1) / GMAX;
    while (chunks < G && units * chunks < threads) chunks++;  /* split heads only to feed idle threads */
    const int64_t gc = (G + chunks - 1) / chunks, per = (G + gc - 1) / gc, tasks = units * per;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t c = t % per, kh = (t / per) % Hk, i = (t / per / Hk) % n, b = t / per / Hk / n;
        const int64_t h0 = kh * G + c * gc;
        const int g = (int)(h0 + gc <= (kh + 1) * G ? gc : (kh + 1) * G - h0);
        const int64_t at = (b * Hk + kh) * S * D * (half ? 2 : 4); /* bytes */
        run_task(isa, half, q, q_sb, q_sh, q_sn, (const char *)k + at, (const char *)v + at, out, prefix[i],
                 extra + offs[i], offs[i + 1] - offs[i], b, i, h0, g, n, H, D);
    }
    return 0;
}

/* Several requests' rows in one parallel region: the batched server's packed forward (ops.c's forward_layers),
 * where one `attend` call per request would open a parallel region per request and layer (at 16 one-row
 * SmolLM2 requests that overhead was 45% of the forward). Segment g is 8 words of seg: its first row r0 and
 * rows m in q and out, its cache's slots S, its rows' prefix, offs and extra (as `attend`'s), its cache's k and
 * v [Hk, S, D]. Row r's head h is at q + r * q_sn + h * D; out is [N, H, D]. Every (row, head) runs the same
 * task as `attend` computes it, so the bits are `attend`'s. Returns as `attend`; 2 when out of memory. */
int attend_batch(const float *q, int64_t q_sn, float *out, int64_t nseg, const int64_t *seg,
                 int64_t H, int64_t Hk, int64_t D, int isa, int half, int threads) {
    if (D % 8 || D > DMAX || D <= 0 || Hk <= 0 || H % Hk || !attend_supported(isa) || (isa == 2 && D % 16)) return 1;
    int64_t *first = malloc((size_t)(nseg + 1) * sizeof(int64_t));  /* segment g's first task */
    if (!first) return 2;
    int64_t rows = 0;
    for (int64_t g = 0; g < nseg; g++) rows += seg[8 * g + 1];
    const int64_t G = H / Hk, units = rows * Hk;
    int64_t chunks = (G + GMAX - 1) / GMAX;
    while (chunks < G && units * chunks < threads) chunks++;  /* as `attend` */
    const int64_t gc = (G + chunks - 1) / chunks, per = (G + gc - 1) / gc;
    first[0] = 0;
    for (int64_t g = 0; g < nseg; g++) first[g + 1] = first[g] + seg[8 * g + 1] * Hk * per;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t t = 0; t < first[nseg]; t++) {
        int64_t g = 0;
        while (first[g + 1] <= t) g++;
        const int64_t *sg = seg + 8 * g, u = t - first[g], m = sg[1], S = sg[2];
        const int64_t c = u % per, kh = (u / per) % Hk, i = u / per / Hk;
        const int64_t *prefix = (const int64_t *)sg[3], *offs = (const int64_t *)sg[4], *extra = (const int64_t *)sg[5];
        const int64_t h0 = kh * G + c * gc;
        const int gn = (int)(h0 + gc <= (kh + 1) * G ? gc : (kh + 1) * G - h0);
        const int64_t at = kh * S * D * (half ? 2 : 4); /* bytes */
        run_task(isa, half, q + sg[0] * q_sn, 0, D, q_sn, (const char *)sg[6] + at, (const char *)sg[7] + at,
                 out + sg[0] * H * D, prefix[i], extra + offs[i], offs[i + 1] - offs[i], 0, i, h0, gn, m, H, D);
    }
    free(first);
    return 0;
}
