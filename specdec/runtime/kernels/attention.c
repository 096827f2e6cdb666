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
 * of a task share every K and V load. Three cache formats (`fmt`, `--kv-dtype`): fp32 (0), fp16 (1; the exact CPU
 * paths' default) or bf16 (2), the last two widened to fp32 as they are loaded (F16C's `vcvtph2ps`, a shift;
 * exact), then the same operations: an fp16 cache gives the bits of an fp32 cache holding the same values, for
 * half the bytes a step reads (SmolLM2 q4, 2-core Zen 4, 16 requests of 1024 positions: a packed decoding step
 * 0.70-0.74x the fp32 cache's time). A third instruction set, AMX (`amx_attend`, below), takes bf16 caches only.
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

#include "amx.h"
#include "vexp.h"

#define BLK 64    /* keys per online-softmax block */
#define GMAX 8    /* query heads per task */
#define DMAX 256  /* largest head dimension */

static const float zero_row[DMAX] __attribute__((aligned(64)));  /* a zero key in either format */

/* A KV-cache element load (`fmt` a literal): 8 fp32 (0), 8 fp16 widened by F16C (1) or 8 bf16 widened by a shift (2);
 * exact: every fp16 and bf16 is an fp32. */
static inline __attribute__((always_inline)) __m256 ld8(const void *p, int64_t off, const int fmt) {
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + off));
    return fmt == 1 ? _mm256_cvtph_ps(h)
         : fmt == 2 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
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
                                                         const int nc, const int fmt) {
    __m256 r[2][4];
    for (int g = 0; g < gp; g++)
        for (int u = 0; u < nc; u++) r[g][u] = _mm256_mul_ps(_mm256_load_ps(acc[g] + c0 + 8 * u), f[g]);
    for (int t = 0; t < nb; t++) {
        __m256 x[4];
        for (int u = 0; u < nc; u++) x[u] = ld8(v[t], c0 + 8 * u, fmt);
        for (int g = 0; g < gp; g++) {
            __m256 pb = _mm256_set1_ps(p[g][t]);
            for (int u = 0; u < nc; u++) r[g][u] = _mm256_fmadd_ps(pb, x[u], r[g][u]);
        }
    }
    for (int g = 0; g < gp; g++)
        for (int u = 0; u < nc; u++) _mm256_store_ps(acc[g] + c0 + 8 * u, r[g][u]);
}

/* s[g][t] = qs[g] . k[t] for heads g < gp (<= 4) and keys t < nb8 (a multiple of 8); every K chunk is loaded
 * once for the gp heads. Called through `scores8` (`SCORES`) with literal gp and fmt, so the partial sums stay
 * in registers, and a literal nd for head dims 64 and 128 (as score16). */
static inline __attribute__((always_inline)) void score8(float (*qs)[DMAX], const void *const *kp, int nb8,
                                                         float (*s)[BLK], const int nd, const int gp,
                                                         const int fmt) {
    for (int t0 = 0; t0 < nb8; t0 += 8) {
        __m256 a[4][8];
        for (int u = 0; u < 8; u++) {
            const void *k = kp[t0 + u];
            __m256 x[4], kc = ld8(k, 0, fmt);
            for (int g = 0; g < gp; g++) x[g] = _mm256_mul_ps(_mm256_load_ps(qs[g]), kc);
            for (int c = 1; c < nd; c++) {
                kc = ld8(k, 8 * c, fmt);
                for (int g = 0; g < gp; g++) x[g] = _mm256_fmadd_ps(_mm256_load_ps(qs[g] + 8 * c), kc, x[g]);
            }
            for (int g = 0; g < gp; g++) a[g][u] = x[g];
        }
        for (int g = 0; g < gp; g++) _mm256_store_ps(s[g] + t0, hsum8x8(a[g]));
    }
}

/* The body of scores8 / scores16: `score` called with literal gp (1..4), fmt and, for head dims 64 and 128
 * (nd n64 and n128 chunks), literal nd, so its loops unroll and its partial sums stay in registers. */
#define SCORE_CASE(score, n64, n128, g, h)                                                            \
    if (gp == g && fmt == h) {                                                                       \
        if (nd == n64) score(qs, kp, nb8, s, n64, g, h);                                              \
        else if (nd == n128) score(qs, kp, nb8, s, n128, g, h);                                       \
        else score(qs, kp, nb8, s, nd, g, h);                                                         \
        return;                                                                                       \
    }
#define SCORES(score, n64, n128)                                                                      \
    SCORE_CASE(score, n64, n128, 4, 0) SCORE_CASE(score, n64, n128, 3, 0)                             \
    SCORE_CASE(score, n64, n128, 2, 0) SCORE_CASE(score, n64, n128, 1, 0)                             \
    SCORE_CASE(score, n64, n128, 4, 1) SCORE_CASE(score, n64, n128, 3, 1)                             \
    SCORE_CASE(score, n64, n128, 2, 1) SCORE_CASE(score, n64, n128, 1, 1)                             \
    SCORE_CASE(score, n64, n128, 4, 2) SCORE_CASE(score, n64, n128, 3, 2)                             \
    SCORE_CASE(score, n64, n128, 2, 2) SCORE_CASE(score, n64, n128, 1, 2)

static void scores8(float (*qs)[DMAX], const void *const *kp, int nb8, float (*s)[BLK], int nd, int gp, int fmt) {
    SCORES(score8, 8, 16)
}

/* One task: heads h0 .. h0+gc-1 (all on kv head kh) of row i of batch b; kb, vb that KV head's keys and values,
 * fp32, fp16 or bf16 (`fmt`). */
static inline __attribute__((always_inline)) void task(const float *q, int64_t q_sb, int64_t q_sh, int64_t q_sn,
                                                       const void *kb, const void *vb, float *out, int64_t prefix,
                                                       const int64_t *extra, int64_t n_extra, int64_t b, int64_t i,
                                                       int64_t h0, int gc, int64_t n, int64_t H, int64_t D,
                                                       const int fmt) {
    float qs[GMAX][DMAX] __attribute__((aligned(32)));
    float acc[GMAX][DMAX] __attribute__((aligned(32)));
    float s[GMAX][BLK] __attribute__((aligned(32)));
    float m[GMAX];
    __m256 l[GMAX];
    const void *kp[BLK], *vp[BLK];
    const int nd = (int)(D / 8);
    const int64_t row = D * (fmt ? 2 : 4); /* bytes per key */
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
            scores8(qs + g0, kp, nb8, s + g0, nd, gp, fmt);
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
                if (nc == 4 && gp == 2) weigh8(acc + g0, f + g0, s + g0, vp, nb, (int)c0, 2, 4, fmt);
                else if (nc == 4) weigh8(acc + g0, f + g0, s + g0, vp, nb, (int)c0, 1, 4, fmt);
                else weigh8(acc + g0, f + g0, s + g0, vp, nb, (int)c0, gp, nc, fmt);
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
T512 static inline __attribute__((always_inline)) __m512 ld16(const void *p, int64_t off, const int fmt) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + off));
    return fmt == 1 ? _mm512_cvtph_ps(h)
         : fmt == 2 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                    : _mm512_loadu_ps((const float *)p + off);
}

T512 static inline __m256 half16(__m512 x) {  /* 16 lanes -> 8: lane u + lane u+8 */
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}

/* acc[g][c0 .. c0+16*nc) = acc * f[g] + sum_t p[g][t] * v[t][c0 ..), t in order, for heads g < gp; the V
 * loads are shared by the heads. Called with literal gp, nc so the accumulators stay in registers. */
T512 static inline __attribute__((always_inline)) void weigh16(float (*acc)[DMAX], const __m512 *f, float (*p)[BLK],
                                                               const void *const *v, int nb, int c0,
                                                               const int gp, const int nc, const int fmt) {
    __m512 r[4][4];
    for (int g = 0; g < gp; g++)
        for (int u = 0; u < nc; u++) r[g][u] = _mm512_mul_ps(_mm512_load_ps(acc[g] + c0 + 16 * u), f[g]);
    for (int t = 0; t < nb; t++) {
        __m512 x[4];
        for (int u = 0; u < nc; u++) x[u] = ld16(v[t], c0 + 16 * u, fmt);
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
                                                               const int fmt) {
    for (int t0 = 0; t0 < nb8; t0 += 8) {
        __m256 a[4][8];
        for (int u = 0; u < 8; u++) {
            const void *k = kp[t0 + u];
            __m512 x[4], kc = ld16(k, 0, fmt);
            for (int g = 0; g < gp; g++) x[g] = _mm512_mul_ps(_mm512_load_ps(qs[g]), kc);
            for (int c = 1; c < nd; c++) {
                kc = ld16(k, 16 * c, fmt);
                for (int g = 0; g < gp; g++) x[g] = _mm512_fmadd_ps(_mm512_load_ps(qs[g] + 16 * c), kc, x[g]);
            }
            for (int g = 0; g < gp; g++) a[g][u] = half16(x[g]);
        }
        for (int g = 0; g < gp; g++) _mm256_store_ps(s[g] + t0, hsum8x8(a[g]));
    }
}

T512 static void scores16(float (*qs)[DMAX], const void *const *kp, int nb8, float (*s)[BLK], int nd, int gp,
                          int fmt) {
    SCORES(score16, 4, 8)
}
#undef SCORES
#undef SCORE_CASE

T512 static inline __attribute__((always_inline)) void task512(const float *q, int64_t q_sb, int64_t q_sh,
                                                               int64_t q_sn, const void *kb, const void *vb,
                                                               float *out, int64_t prefix, const int64_t *extra,
                                                               int64_t n_extra, int64_t b, int64_t i, int64_t h0,
                                                               int gc, int64_t n, int64_t H, int64_t D,
                                                               const int fmt) {
    float qs[GMAX][DMAX] __attribute__((aligned(64)));
    float acc[GMAX][DMAX] __attribute__((aligned(64)));
    float s[GMAX][BLK] __attribute__((aligned(64)));
    float m[GMAX];
    __m512 l[GMAX], f[GMAX];
    const void *kp[BLK], *vp[BLK];
    const int nd = (int)(D / 16);
    const int64_t row = D * (fmt ? 2 : 4); /* bytes per key */
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
            scores16(qs + g0, kp, nb8, s + g0, nd, gp, fmt);
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
                if (nc == 4 && gp == 4) weigh16(ag, f + g0, pg, vp, nb, (int)c0, 4, 4, fmt);
                else if (nc == 4 && gp == 3) weigh16(ag, f + g0, pg, vp, nb, (int)c0, 3, 4, fmt);
                else if (nc == 4 && gp == 2) weigh16(ag, f + g0, pg, vp, nb, (int)c0, 2, 4, fmt);
                else if (nc == 4) weigh16(ag, f + g0, pg, vp, nb, (int)c0, 1, 4, fmt);
                else weigh16(ag, f + g0, pg, vp, nb, (int)c0, gp, nc, fmt);
            }
        }
    }
    for (int g = 0; g < gc; g++) {
        const __m512 tot = _mm512_set1_ps(fold8(half16(l[g])));
        float *o = out + ((b * n + i) * H + h0 + g) * D;
        for (int c = 0; c < nd; c++) _mm512_storeu_ps(o + 16 * c, _mm512_div_ps(_mm512_load_ps(acc[g] + 16 * c), tot));
    }
}

/* ---- AMX: attention on bf16 tiles (isa 3, bf16 caches, D a multiple of 32) ----------------------------
 * What torch's bf16 attention computes (bf16 q, k, p and v, fp32 sums), in an order that does not depend on n.
 * A task is a group of up to 16 query rows of one KV head (a row: a position and one of the KV head's G query
 * heads), the A tiles' rows. For it, block by block, the keys are laid out for the B tiles in a few KB that stay
 * in L1 (`amx_k_block`: 16 keys, one 64-byte row per pair of dims with the keys' pairs side by side;
 * `amx_v_block`: 32 keys, one row per pair of keys with 16 dims' pairs side by side) and used at once: laying
 * out the whole head first and reading it back went through L2 and cost more than the tiles' arithmetic.
 *   - q scaled by 1/sqrt(D) in fp32, rounded to bf16 (round to nearest even);
 *   - S = q K^T by slot, 16 keys a C tile, D/32 tdpbf16ps in dim order;
 *   - the row's scores in list order (its prefix, then its extras), m = their max;
 *   - p = exp16(S - m), 0 past the list, rounded to bf16; l = the rounded p summed in 16 lanes in list order,
 *     the lanes folded as `task512` folds them;
 *   - O = p V, 32 list positions a tdpbf16ps into 16 dims a C tile, in order; out = O / l.
 * List position t meets the t-th key of the row's list at position t of the V tiles, as in a single-position
 * call (whose list is slots 0..t): for positions before a row's first extra that is slot t, shared by the group;
 * a row with extras (a tree node) then adds its own V blocks, its C row loaded, added to and stored with the other
 * rows' A rows zero. Positions past a row's list add exact zeros. So a (row, head)'s bits depend only on its q and
 * its list's keys and values: not on n, the rows sharing its tiles, or the threads.
 * Worked example: SmolLM2 (9 query heads, 3 KV heads, D = 64), 16 new positions after 240 cached: 48 query rows
 * per KV head, 3 groups of 16 (9 tasks); per group 16 K blocks and 8 V blocks laid out, 32 tdpbf16ps for S, 32
 * for O. Cost (2-core Xeon, model 167, one layer): 16 rows ~60 us against ~145 us for exact fp32 attention over
 * the fp16 cache, one row ~26-30 us against ~19-28 (`benchmarks/s21/attention_amx.py`). */

#define AKEYS 32 /* keys per V block (a B tile's 16 rows of key pairs); K blocks hold 16 */

/* One request's part of an AMX call: row i's head h at q + h * q_sh + i * q_sn, its output at out + (i * H + h) * D;
 * k, v its cache [Hk, S, D] (bf16); rows m; the rows' key lists (prefix, offs, extra as `attend`'s). */
typedef struct {
    const float *q;
    int64_t q_sh, q_sn;
    float *out;
    const uint16_t *k, *v;
    int64_t S, m;
    const int64_t *prefix, *offs, *extra;
} aseg;

static int64_t seen_keys(const int64_t *prefix, const int64_t *offs, const int64_t *extra, int64_t m) {
    int64_t L = 0;
    for (int64_t i = 0; i < m; i++) {
        if (prefix[i] > L) L = prefix[i];
        for (int64_t e = offs[i]; e < offs[i + 1]; e++) L = extra[e] + 1 > L ? extra[e] + 1 : L;
    }
    return L;
}

static inline int64_t up32(int64_t x) { return (x + AKEYS - 1) / AKEYS * AKEYS; }

/* r[0..15] (16 dwords each) <- their transpose: lane i of r[j] becomes lane j of r[i]. */
AMX_FN static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* vt <- a V block as the B tiles of O = p V take it, for dims c0 .. c0+nd-1 (nd a multiple of 32, at most 64): one
 * 64-byte row per pair of positions (2p, 2p+1), 16 dims' pairs side by side, nd / 16 tiles of 512 bf16. Position t
 * holds v's slot list[t], zeros from position `len` on. The pairs are made by vpunpck{l,h}wd within 128-bit lanes,
 * so a 32-dim chunk s of a key pair gives the rows of tiles 2s and 2s+1 in two instructions, tile 2s holding dims
 * 32s + 8L + w and tile 2s+1 dims 32s + 8L + 4 + w in its columns 4L + w (L < 4, w < 4); `amx_unpermute` puts O's
 * columns back in dim order. */
AMX_FN static void amx_v_block(const uint16_t *v, const int64_t *list, int64_t len, int64_t D, int64_t c0, int64_t nd,
                               uint16_t *vt) {
    const __m512i z = _mm512_setzero_si512();
    for (int64_t p = 0; p < AKEYS / 2; p++) {
        const uint16_t *x = 2 * p < len ? v + list[2 * p] * D + c0 : NULL;
        const uint16_t *y = 2 * p + 1 < len ? v + list[2 * p + 1] * D + c0 : NULL;
        for (int64_t c = 0; c < nd; c += 32) {
            const __m512i a = x ? _mm512_loadu_si512(x + c) : z, b = y ? _mm512_loadu_si512(y + c) : z;
            _mm512_store_si512(vt + c * AKEYS + 32 * p, _mm512_unpacklo_epi16(a, b));
            _mm512_store_si512(vt + (c + 16) * AKEYS + 32 * p, _mm512_unpackhi_epi16(a, b));
        }
    }
}

/* kt (16 D bf16) <- keys t0 .. t0+15 of k [.., D] (zeros from key `keys` on) as a K block: pair row p holds dims
 * 2p, 2p+1 of the 16 keys side by side, 16 pair rows (one B tile) per 32 dims: a 16 x 16 transpose of dwords. */
AMX_FN static void amx_k_block(const uint16_t *k, int64_t keys, int64_t t0, int64_t D, uint16_t *kt) {
    for (int64_t c = 0; c < D; c += 32) {
        __m512i r[16];
        for (int u = 0; u < 16; u++)
            r[u] = t0 + u < keys ? _mm512_loadu_si512(k + (t0 + u) * D + c) : _mm512_setzero_si512();
        transpose16(r);
        for (int u = 0; u < 16; u++) _mm512_store_si512(kt + (c / 2 + u) * 32, r[u]);
    }
}

/* out[0 .. D) = O's columns o[0 .. D) (as `amx_v_block` orders them) in dim order, divided by tot. */
AMX_FN static inline void amx_unpermute(const float *o, float *out, int64_t D, __m512 tot) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t c = 0; c < D; c += 32) {
        const __m512 lo = _mm512_loadu_ps(o + c), hi = _mm512_loadu_ps(o + c + 16);
        _mm512_storeu_ps(out + c, _mm512_div_ps(_mm512_permutex2var_ps(lo, first, hi), tot));
        _mm512_storeu_ps(out + c + 16, _mm512_div_ps(_mm512_permutex2var_ps(lo, second, hi), tot));
    }
}

/* C tiles 0 .. nc-1 to / from o (16 dims each, rows D floats apart). */
AMX_FN static inline void amx_store_c(float *o, int64_t D, int nc) {
    _tile_stored(0, o, D * 4);
    if (nc > 1) _tile_stored(1, o + 16, D * 4);
    if (nc > 2) _tile_stored(2, o + 32, D * 4);
    if (nc > 3) _tile_stored(3, o + 48, D * 4);
}

AMX_FN static inline void amx_load_c(const float *o, int64_t D, int nc) {
    _tile_loadd(0, o, D * 4);
    if (nc > 1) _tile_loadd(1, o + 16, D * 4);
    if (nc > 2) _tile_loadd(2, o + 32, D * 4);
    if (nc > 3) _tile_loadd(3, o + 48, D * 4);
}

/* C tiles 0..3 (16 dims each from c0, nc of them) += A tile 4 (loaded from a, row stride lda) times the V block vb. */
AMX_FN static inline void amx_pv(const uint16_t *a, int64_t lda, const uint16_t *vb, int nc) {
    _tile_loadd(4, a, lda * 2);
    _tile_loadd(5, vb, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (nc > 1) { _tile_loadd(6, vb + 16 * AKEYS, 64); _tile_dpbf16ps(1, 4, 6); }
    if (nc > 2) { _tile_loadd(7, vb + 32 * AKEYS, 64); _tile_dpbf16ps(2, 4, 7); }
    if (nc > 3) { _tile_loadd(5, vb + 48 * AKEYS, 64); _tile_dpbf16ps(3, 4, 5); }
}

/* Rows r0 .. r0+m-1 (row r: position r / G, query head kh * G + r % G) of segment a's KV head kh, as the section's
 * comment says: S by slot, softmax in each row's list order, O from V blocks with slot t at position t up to a row's
 * first extra's block, then that row's own V blocks. Scratch: qb [16 D], pb (the shared pass's p: zero from a row's
 * own blocks on) and pl (each row's p) [16 L] bf16, s [16 L] and ob [16 D] fp32; kt two K blocks (32 D bf16), vt
 * one V block's 64 dims (32 x 64 bf16); L = the rows' slots rounded up to 32. */
AMX_FN static void amx_group(const aseg *a, int64_t H, int64_t D, int64_t G, int64_t kh, int64_t r0, int m,
                             uint16_t *qb, float *s, uint16_t *pb, uint16_t *pl, float *ob, uint16_t *kt, uint16_t *vt) {
    const __m512 scale = _mm512_set1_ps(1.0f / sqrtf((float)D));
    const uint16_t *k = a->k + kh * a->S * D, *v = a->v + kh * a->S * D;
    int64_t L = 0; /* the slots these rows see (keys), then rounded up to a V block */
    for (int j = 0; j < m; j++) {
        const int64_t i = (r0 + j) / G, h = kh * G + (r0 + j) % G;
        const float *q = a->q + h * a->q_sh + i * a->q_sn;
        for (int64_t c = 0; c < D; c += 32)
            _mm512_storeu_si512(qb + j * D + c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(q + c + 16), scale),
                                                                             _mm512_mul_ps(_mm512_loadu_ps(q + c), scale)));
        const int64_t li = seen_keys(a->prefix + i, a->offs + i, a->extra, 1);
        L = li > L ? li : L;
    }
    const int64_t keys = L, steps = D / 32;
    L = up32(L);
    amx_configure(m);
    for (int64_t t0 = 0; t0 < L; t0 += 32) { /* S by slot, two K blocks of 16 keys at a time */
        amx_k_block(k, keys, t0, D, kt);
        amx_k_block(k, keys, t0 + 16, D, kt + 16 * D);
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t c = 0; c < steps; c++) {
            _tile_loadd(4, qb + 32 * c, D * 2);
            _tile_loadd(6, kt + 16 * c * 32, 64);
            _tile_loadd(7, kt + 16 * D + 16 * c * 32, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
        _tile_stored(0, s + t0, L * 4);
        _tile_stored(1, s + t0 + 16, L * 4);
    }
    float l[16];
    for (int j = 0; j < m; j++) { /* softmax over the row's list, in list order */
        const int64_t i = (r0 + j) / G, pre = a->prefix[i], *ex = a->extra + a->offs[i], ne = a->offs[i + 1] - a->offs[i];
        float *sr = s + j * L;
        for (int64_t e = 0; e < ne; e++) sr[pre + e] = sr[ex[e]]; /* in place: extras ascend from slot pre on */
        const int64_t len = pre + ne, own = ne ? pre / AKEYS * AKEYS : L; /* shared V blocks serve < own */
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < L; t += 16) /* positions from len on are masked out (vector masks, not stores) */
            mx = _mm512_mask_max_ps(mx, _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32((int)(len - t))), mx,
                                    _mm512_loadu_ps(sr + t));
        const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < L; t += 16) {
            const __m512 x = _mm512_loadu_ps(sr + t);
            const __m512 p = _mm512_maskz_mov_ps(_mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32((int)(len - t))),
                                                 exp16(_mm512_sub_ps(x, mv)));
            const __m256i b = (__m256i)_mm512_cvtneps_pbh(p);
            _mm256_storeu_si256((__m256i *)(pl + j * L + t), b);
            _mm256_storeu_si256((__m256i *)(pb + j * L + t), t < own ? b : _mm256_setzero_si256());
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
        }
        l[j] = fold8(half16(sum));
    }
    int64_t list[AKEYS];
    for (int64_t c0 = 0; c0 < D; c0 += 64) { /* O = p V, slot t at position t, 4 C tiles of 16 dims */
        const int nc = (int)((D - c0) / 16 < 4 ? (D - c0) / 16 : 4);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t t0 = 0; t0 < L; t0 += AKEYS) {
            for (int64_t t = 0; t < AKEYS; t++) list[t] = t0 + t;
            amx_v_block(v, list, keys - t0, D, c0, 16 * nc, vt);
            amx_pv(pb + t0, L, vt, nc);
        }
        amx_store_c(ob + c0, D, nc);
    }
    uint16_t ab[16 * AKEYS] __attribute__((aligned(64)));
    for (int j = 0; j < m; j++) { /* rows with extras: their own V blocks from their first extra's block on */
        const int64_t i = (r0 + j) / G, pre = a->prefix[i], ne = a->offs[i + 1] - a->offs[i], len = pre + ne;
        if (!ne) continue;
        for (int64_t t0 = pre / AKEYS * AKEYS; t0 < len; t0 += AKEYS) {
            for (int64_t t = 0; t < AKEYS && t0 + t < len; t++)
                list[t] = t0 + t < pre ? t0 + t : a->extra[a->offs[i] + t0 + t - pre];
            memset(ab, 0, sizeof ab);
            memcpy(ab + j * AKEYS, pl + j * L + t0, AKEYS * sizeof(uint16_t));
            for (int64_t c0 = 0; c0 < D; c0 += 64) {
                const int nc = (int)((D - c0) / 16 < 4 ? (D - c0) / 16 : 4);
                amx_v_block(v, list, len - t0, D, c0, 16 * nc, vt);
                amx_load_c(ob + c0, D, nc);
                amx_pv(ab, AKEYS, vt, nc);
                amx_store_c(ob + c0, D, nc);
            }
        }
    }
    _tile_release();
    for (int j = 0; j < m; j++) {
        const int64_t i = (r0 + j) / G, h = kh * G + (r0 + j) % G;
        amx_unpermute(ob + j * D, a->out + (i * H + h) * D, D, _mm512_set1_ps(l[j]));
    }
}

/* A buffer of at least `bytes` for this thread, 64-byte aligned, kept for its next calls (growing when asked for more):
 * no allocation per call. */
static void *scratch(void **buf, size_t *size, size_t bytes) {
    if (bytes > *size) {
        free(*buf);
        if (posix_memalign(buf, 64, bytes)) *buf = NULL; /* 64-byte rows for the tiles and 512-bit stores */
        *size = *buf ? bytes : 0;
    }
    return *buf;
}

/* All rows of nseg segments, as groups of up to 16 query rows of one KV head, on `threads` threads. Returns 0, or 2
 * when out of memory. */
AMX_FN static int amx_attend(const aseg *segs, int64_t nseg, int64_t H, int64_t Hk, int64_t D, int threads) {
    const int64_t G = H / Hk;
    int64_t *grp = malloc((size_t)(nseg + 1) * sizeof(int64_t)), L = 0;
    if (!grp) return 2;
    grp[0] = 0;
    for (int64_t g = 0; g < nseg; g++) {
        const aseg *a = segs + g;
        const int64_t keys = up32(seen_keys(a->prefix, a->offs, a->extra, a->m));
        L = keys > L ? keys : L;
        grp[g + 1] = grp[g] + Hk * ((a->m * G + 15) / 16);
    }
    int rc = 0;
#pragma omp parallel num_threads(threads)
    {
        static __thread void *buf;
        static __thread size_t size;
        /* qb 16 D, pb and pl 16 L, kt 32 D, vt 32 * 64 (bf16); s 16 L, ob 16 D (fp32): 64-byte aligned pieces */
        uint16_t *qb = scratch(&buf, &size, (size_t)(16 * D + 32 * L + 32 * D + 32 * 64) * 2 + (size_t)(16 * L + 16 * D) * 4);
        if (!qb) {
#pragma omp atomic write
            rc = 2;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < grp[nseg]; t++) {
            if (!qb) continue;
            int64_t g = 0;
            while (grp[g + 1] <= t) g++;
            const aseg *a = segs + g;
            const int64_t u = t - grp[g], per = (a->m * G + 15) / 16, kh = u / per, r0 = 16 * (u % per);
            const int m = (int)(a->m * G - r0 < 16 ? a->m * G - r0 : 16);
            uint16_t *pb = qb + 16 * D, *pl = pb + 16 * L, *kt = pl + 16 * L, *vt = kt + 32 * D;
            float *s = (float *)(vt + 32 * 64), *ob = s + 16 * L;
            amx_group(a, H, D, G, kh, r0, m, qb, s, pb, pl, ob, kt, vt);
        }
    }
    free(grp);
    return rc;
}

#define TASK_ARGS const float *q, int64_t q_sb, int64_t q_sh, int64_t q_sn, const void *kb, const void *vb, float *out, \
                  int64_t prefix, const int64_t *extra, int64_t n_extra, int64_t b, int64_t i, int64_t h0, int gc,   \
                  int64_t n, int64_t H, int64_t D
#define TASK_PASS q, q_sb, q_sh, q_sn, kb, vb, out, prefix, extra, n_extra, b, i, h0, gc, n, H, D
static void task_f32(TASK_ARGS) { task(TASK_PASS, 0); }
static void task_f16(TASK_ARGS) { task(TASK_PASS, 1); }
static void task_bf16(TASK_ARGS) { task(TASK_PASS, 2); }
T512 static void task512_f32(TASK_ARGS) { task512(TASK_PASS, 0); }
T512 static void task512_f16(TASK_ARGS) { task512(TASK_PASS, 1); }
T512 static void task512_bf16(TASK_ARGS) { task512(TASK_PASS, 2); }

/* One task on instruction set `isa` (1, 2) over an fp32 (fmt 0), fp16 (1) or bf16 (2) cache. */
static void run_task(int isa, int fmt, TASK_ARGS) {
    if (isa == 2) (fmt == 2 ? task512_bf16 : fmt ? task512_f16 : task512_f32)(TASK_PASS);
    else (fmt == 2 ? task_bf16 : fmt ? task_f16 : task_f32)(TASK_PASS);
}
#undef TASK_ARGS
#undef TASK_PASS

/* 1 when the CPU runs `isa` (1: AVX2 + FMA + F16C; 2: AVX512F; 3: AMX-BF16 with AVX512-BF16, the tiles granted). */
int attend_supported(int isa) {
    __builtin_cpu_init();
    if (isa == 1)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa == 2) return __builtin_cpu_supports("avx512f");
    if (isa == 3)
        return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") && amx_cpu() && amx_permitted();
    return 0;
}

/* Whether `attend` takes these sizes, instruction set and cache format. */
static int attend_ok(int64_t D, int64_t H, int64_t Hk, int isa, int fmt) {
    return !(D % 8 || D > DMAX || D <= 0 || Hk <= 0 || H % Hk || fmt < 0 || fmt > 2 || !attend_supported(isa)
             || (isa == 2 && D % 16) || (isa == 3 && (D % 32 || fmt != 2)));
}

/* q [B, H, n, D] (strides q_sb, q_sh, q_sn in floats, D contiguous); k, v the layer's cache [B, Hk, S, D]
 * contiguous, fp32, fp16 or bf16 (fmt 0, 1, 2); out [B, n, H, D] contiguous. Row i sees slots 0 .. prefix[i]-1 then
 * extra[offs[i] .. offs[i+1]-1] (the same lists for every batch); isa 3 (AMX, bf16 caches, D % 32 == 0), 2 (AVX512,
 * D % 16 == 0) or 1 (AVX2). Returns 0, 1 when D, H / Hk, isa or fmt are out of range, 2 when out of memory. */
int attend(const float *q, int64_t q_sb, int64_t q_sh, int64_t q_sn, const void *k, const void *v, float *out,
           const int64_t *prefix, const int64_t *offs, const int64_t *extra,
           int64_t B, int64_t n, int64_t H, int64_t Hk, int64_t S, int64_t D, int isa, int fmt, int threads) {
    if (!attend_ok(D, H, Hk, isa, fmt)) return 1;
    if (isa == 3) {
        aseg *segs = malloc((size_t)B * sizeof(aseg));
        if (!segs) return 2;
        for (int64_t b = 0; b < B; b++)
            segs[b] = (aseg){q + b * q_sb, q_sh, q_sn, out + b * n * H * D, (const uint16_t *)k + b * Hk * S * D,
                             (const uint16_t *)v + b * Hk * S * D, S, n, prefix, offs, extra};
        const int rc = amx_attend(segs, B, H, Hk, D, threads);
        free(segs);
        return rc;
    }
    const int64_t G = H / Hk, units = B * n * Hk;
    int64_t chunks = (G + GMAX - 1) / GMAX;
    while (chunks < G && units * chunks < threads) chunks++;  /* split heads only to feed idle threads */
    const int64_t gc = (G + chunks - 1) / chunks, per = (G + gc - 1) / gc, tasks = units * per;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t c = t % per, kh = (t / per) % Hk, i = (t / per / Hk) % n, b = t / per / Hk / n;
        const int64_t h0 = kh * G + c * gc;
        const int g = (int)(h0 + gc <= (kh + 1) * G ? gc : (kh + 1) * G - h0);
        const int64_t at = (b * Hk + kh) * S * D * (fmt ? 2 : 4); /* bytes */
        run_task(isa, fmt, q, q_sb, q_sh, q_sn, (const char *)k + at, (const char *)v + at, out, prefix[i],
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
                 int64_t H, int64_t Hk, int64_t D, int isa, int fmt, int threads) {
    if (!attend_ok(D, H, Hk, isa, fmt)) return 1;
    if (isa == 3) {
        aseg *segs = malloc((size_t)(nseg ? nseg : 1) * sizeof(aseg));
        if (!segs) return 2;
        for (int64_t g = 0; g < nseg; g++) {
            const int64_t *sg = seg + 8 * g;
            segs[g] = (aseg){q + sg[0] * q_sn, D, q_sn, out + sg[0] * H * D, (const uint16_t *)sg[6],
                             (const uint16_t *)sg[7], sg[2], sg[1], (const int64_t *)sg[3], (const int64_t *)sg[4],
                             (const int64_t *)sg[5]};
        }
        const int rc = amx_attend(segs, nseg, H, Hk, D, threads);
        free(segs);
        return rc;
    }
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
        const int64_t at = kh * S * D * (fmt ? 2 : 4); /* bytes */
        run_task(isa, fmt, q + sg[0] * q_sn, 0, D, q_sn, (const char *)sg[6] + at, (const char *)sg[7] + at,
                 out + sg[0] * H * D, prefix[i], extra + offs[i], offs[i + 1] - offs[i], 0, i, h0, gn, m, H, D);
    }
    free(first);
    return 0;
}
