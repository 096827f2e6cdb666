/* Quantized skinny GEMM: y[n, out] = x[n, in] . W[out, in]^T (+ bias), x and y fp32, W in blocks of 32.
 *
 * Weight formats (see kernels/quant.py; per output row, per block of 32 inputs):
 *   q8:  w = d * q,        q int8 in -127..127, stored as the unsigned byte q + 128, d fp32;
 *   q4:  w = s * q - m,    q in 0..15, two per byte, s and m fp32;
 *   q4k: GGUF Q4_K kept as it is: w = (d * sc) * q - (dmin * mn), q in 0..15, sc and mn 6-bit integers per
 *        block of 32, d and dmin fp32 (the file's fp16) per super-block of 256. s = d * sc and m = dmin * mn
 *        are exact in fp32, so q4k gives q4's bits for the same weights, in 0.5625 + 0.0156 bytes a weight;
 *   q6k: GGUF Q6_K kept as it is: w = d * sc * (q - 32), q in 0..63, sc an int8 per sub-block of 16,
 *        d fp32 (the file's fp16) per super-block of 256: 0.8125 bytes a weight (q8: 1.125).
 * Activations are quantized here, per row and per block of 32 (GGUF Q8_0 style): dx = amax / 127,
 * qx = round(x * (127 / amax)) in -127..127 (ties to even), sx = the block's sum of qx, and sx16 the sums
 * of its two halves (for q6k). The scale depends only on that row's values, so a row's quantized input
 * never depends on n.
 *
 * Layout ("VNNI order"): outputs in groups of G = 16 (the 16 int32 lanes of a 512-bit register), and
 * per group and block the bytes are ordered so one 64-byte load holds 4 consecutive inputs of each of
 * the 16 outputs. `vpdpbusd` multiplies those unsigned bytes with the same 4 signed activation bytes
 * broadcast to every lane and adds the 4 products into each output's lane: no horizontal sums.
 *   q8, per group and block, 512 bytes: byte [t][k][e] = q[16g + k][32b + 4t + e] + 128  (t < 8);
 *   q4, per group and block, 256 bytes of nibbles: byte [c][k][e] = q[16g + k][32b + 8c + e]
 *                                                  | q[16g + k][32b + 8c + 4 + e] << 4  (c < 4);
 *   q4k, per group and super-block, 2304 bytes: the 8 blocks' nibbles as q4 (2048), then sc [8][16] and
 *        mn [8][16] as bytes (block, lane);
 *   q6k, per group and super-block, 3328 bytes: the 8 blocks' low 4 bits as q4's nibbles (2048), then the
 *        high 2 bits, 128 bytes a block: byte [p][k][e] holds input 32b + 16p + 4j + e of output k at bits
 *        2j..2j+1 (j < 4), then sc [16][16] as int8 (sub-block, lane);
 *   scales fp32 [group][block][16] (q8, q4: d or s) or [group][super-block][16] (q4k, q6k: d), mins the
 *   same for q4 (m) and q4k (dmin). Rows past `out` and inputs past `in` are zero.
 *
 * Exact integer part: per output o, row i and block b, isum = sum over the block of q * qx, an exact
 * int32 (|isum| < 2^21) whatever instructions compute it: vpdpbusd on the biased q8 bytes then minus
 * 128 * sx (AVX512-VNNI), or |q| times sign-adjusted qx with vpmaddubsw + vpmaddwd (AVX2, no
 * saturation: 2 * 127 * 127 < 2^15), or nibbles with either. q6k: per half h of the block,
 * i16 = sum of q * qx minus 32 * sx16 (|i16| <= 16 * 32 * 127), and isum = sc0 * i16_0 + sc1 * i16_1, an
 * int32 below 2^24 in magnitude, so its float is exact too.
 * Fixed float part, identical on every ISA and in the torch fallback (kernels/quant.py), per output:
 *   acc = 0;
 *   for each block b in order:
 *     q8:      acc = acc + (d[o,b] * dx[b]) * (float)isum;
 *     q4, q4k: acc = acc + (s[o,b] * dx[b]) * (float)isum;  acc = acc - m[o,b] * (dx[b] * (float)sx[b]);
 *     q6k:     acc = acc + (d[o,b/8] * dx[b]) * (float)isum;
 *   y = acc (+ bias[o]).
 * Each product and sum rounds once (compiled with -ffp-contract=off: no fused multiply-adds), so a
 * forward over n positions gives bit-identical outputs to n single-position forwards, on any ISA.
 *
 * Tiling: each unit of work is UNIT groups (64 outputs), handed to the threads in guided runs of
 * consecutive units (long contiguous streams first, short runs at the end; one unit at a time measured
 * slower at 2 threads, on a shared machine: best of 15, q6k 151936 x 1536 3.07 against 7.99 ms); within a
 * unit every block of weights is loaded once for up to ROWS = 8 rows (larger n: 8 rows per pass, the
 * unit's weights then come from L2). The AVX512 path prefetches the weights PF_BLOCKS blocks ahead:
 * a group's streams are short (48 blocks for 1536 inputs), too short for the hardware prefetcher alone
 * (one core, median of 32, interleaved: q4 n = 1 0.88 -> 0.70 ms, n = 4 1.13 -> 0.80 ms for 17920 x 1536).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define G 16
#define QB 32
#define BPS 8 /* blocks per super-block (q4k, q6k) */
#define ROWS 8
#define UNIT 4
#define MIN_WORK (1 << 17) /* weights per thread, at least */
#define PF_BLOCKS 16 /* software prefetch distance in blocks: 16-32 measured 1.2-1.7x faster than none */

enum { FMT_Q8 = 8, FMT_Q4 = 4, FMT_Q4K = 41, FMT_Q6K = 6 };
enum { ISA_AVX2 = 1, ISA_VNNI512 = 2 };

/* Bytes per group and block (q8, q4), or per group and super-block (q4k, q6k). */
static inline __attribute__((always_inline)) int64_t chunk_bytes(const int fmt) {
    return fmt == FMT_Q8 ? 512 : fmt == FMT_Q4 ? 256 : fmt == FMT_Q4K ? 2304 : 3328;
}
#define KFMT(fmt) ((fmt) == FMT_Q4K || (fmt) == FMT_Q6K)

typedef struct {
    const int8_t *xq;    /* [n][nb * 32] */
    const float *dx;     /* [n][nb] */
    const int32_t *sx;   /* [n][nb] */
    const float *dxs;    /* [n][nb]: dx * (float)sx */
    const int32_t *sx16; /* [n][nb][2]: 32 * the sums of each half's qx (the q6k bias) */
    int64_t nb;
} acts;

static void quantize_rows(const float *x, int64_t n, int64_t in, int64_t nb, int8_t *xq, float *dx, int32_t *sx,
                          float *dxs, int32_t *sx16) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t b = 0; b < nb; b++) {
            const float *s = x + i * in + b * QB;
            int64_t len = in - b * QB < QB ? in - b * QB : QB;
            float amax = 0.0f;
            for (int64_t k = 0; k < len; k++) {
                float a = fabsf(s[k]);
                amax = a > amax ? a : amax;
            }
            float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t half[2] = {0, 0};
            int8_t *q = xq + (i * nb + b) * QB;
            for (int64_t k = 0; k < QB; k++) {
                int v = 0;
                if (k < len) {
                    v = (int)nearbyintf(s[k] * inv);
                    v = v > 127 ? 127 : (v < -127 ? -127 : v);
                }
                q[k] = (int8_t)v;
                half[k >= 16] += v;
            }
            dx[i * nb + b] = amax / 127.0f;
            sx[i * nb + b] = half[0] + half[1];
            dxs[i * nb + b] = dx[i * nb + b] * (float)(half[0] + half[1]);
            sx16[2 * (i * nb + b)] = 32 * half[0];
            sx16[2 * (i * nb + b) + 1] = 32 * half[1];
        }
}

static inline int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- AVX512-VNNI: one group of 16 outputs x R rows ------------------------------------------------ */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static inline __attribute__((always_inline)) void
tile512(const int fmt, const uint8_t *W, const float *S, const float *M, acts a, int64_t row0, float *y,
        int64_t ldy, const float *bias, int valid, const int R) {
    __m512 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F), hi2 = _mm512_set1_epi8(0x30);
    const int64_t nb = a.nb, per = KFMT(fmt) ? chunk_bytes(fmt) / BPS : chunk_bytes(fmt);
    for (int64_t b = 0; b < nb; b++) {
        __m512i is[ROWS], is1[ROWS];
        for (int r = 0; r < R; r++) is[r] = is1[r] = _mm512_setzero_si512();
        const int8_t *xb = a.xq + row0 * nb * QB + b * QB;
        { /* the weights PF_BLOCKS blocks ahead (past the group's end: the next group's, laid out after it) */
            const char *ahead = (const char *)(W + (b + PF_BLOCKS) * per);
            for (int l = 0; l < (per + 63) / 64; l++) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
            if (!KFMT(fmt) || (b & (BPS - 1)) == 0) {
                int64_t s = KFMT(fmt) ? b / BPS + PF_BLOCKS / BPS : b + PF_BLOCKS;
                _mm_prefetch((const char *)(S + s * G), _MM_HINT_T0);
                if (M) _mm_prefetch((const char *)(M + s * G), _MM_HINT_T0);
            }
        }
        const uint8_t *chunk = W + (KFMT(fmt) ? (b / BPS) * chunk_bytes(fmt) : b * per);
        const int j = (int)(b % BPS); /* the block within its super-block (q4k, q6k) */
        if (fmt == FMT_Q8) {
            for (int t = 0; t < 8; t++) {
                __m512i v = _mm512_loadu_si512((const void *)(chunk + 64 * t));
                for (int r = 0; r < R; r++)
                    is[r] = _mm512_dpbusd_epi32(is[r], v, _mm512_set1_epi32(load4(xb + r * nb * QB + 4 * t)));
            }
        } else {
            const uint8_t *w = KFMT(fmt) ? chunk + 256 * j : chunk;
            __m512i h[2];
            if (fmt == FMT_Q6K)
                for (int p = 0; p < 2; p++) h[p] = _mm512_loadu_si512((const void *)(chunk + 2048 + 128 * j + 64 * p));
            for (int c = 0; c < 4; c++) {
                __m512i v = _mm512_loadu_si512((const void *)(w + 64 * c));
                __m512i u[2] = {_mm512_and_si512(v, low4), _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)};
                for (int e = 0; e < 2; e++) {
                    const int t = 2 * c + e; /* inputs 4t .. 4t+3 */
                    if (fmt == FMT_Q6K) { /* bits 2(t%4) of h[t/4] to bits 4..5 */
                        const int sh = 2 * (t % 4);
                        __m512i hb = sh <= 4 ? _mm512_slli_epi16(h[t / 4], 4 - sh) : _mm512_srli_epi16(h[t / 4], 2);
                        u[e] = _mm512_or_si512(u[e], _mm512_and_si512(hb, hi2));
                    }
                    for (int r = 0; r < R; r++) {
                        __m512i xv = _mm512_set1_epi32(load4(xb + r * nb * QB + 4 * t));
                        if (fmt == FMT_Q6K && t >= 4) is1[r] = _mm512_dpbusd_epi32(is1[r], u[e], xv);
                        else is[r] = _mm512_dpbusd_epi32(is[r], u[e], xv);
                    }
                }
            }
        }
        if (fmt == FMT_Q8) {
            __m512 sc = _mm512_loadu_ps(S + b * G);
            for (int r = 0; r < R; r++) {
                int64_t i = (row0 + r) * nb + b;
                __m512i isum = _mm512_sub_epi32(is[r], _mm512_set1_epi32(128 * a.sx[i]));
                __m512 d = _mm512_mul_ps(sc, _mm512_set1_ps(a.dx[i]));
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(d, _mm512_cvtepi32_ps(isum)));
            }
        } else if (fmt == FMT_Q6K) {
            __m512 dv = _mm512_loadu_ps(S + (b / BPS) * G);
            const int8_t *sc = (const int8_t *)(chunk + 3072 + 32 * j);
            __m512i s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc));
            __m512i s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + 16)));
            for (int r = 0; r < R; r++) {
                int64_t i = (row0 + r) * nb + b;
                __m512i i0 = _mm512_sub_epi32(is[r], _mm512_set1_epi32(a.sx16[2 * i]));
                __m512i i1 = _mm512_sub_epi32(is1[r], _mm512_set1_epi32(a.sx16[2 * i + 1]));
                __m512i isum = _mm512_add_epi32(_mm512_mullo_epi32(s0, i0), _mm512_mullo_epi32(s1, i1));
                __m512 d = _mm512_mul_ps(dv, _mm512_set1_ps(a.dx[i]));
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(d, _mm512_cvtepi32_ps(isum)));
            }
        } else {
            __m512 sc, mn;
            if (fmt == FMT_Q4) {
                sc = _mm512_loadu_ps(S + b * G);
                mn = _mm512_loadu_ps(M + b * G);
            } else { /* s = d * sc, m = dmin * mn: exact */
                const uint8_t *k = chunk + 2048 + 16 * j;
                sc = _mm512_mul_ps(_mm512_loadu_ps(S + (b / BPS) * G),
                                   _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)k))));
                mn = _mm512_mul_ps(_mm512_loadu_ps(M + (b / BPS) * G),
                                   _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(k + 128)))));
            }
            for (int r = 0; r < R; r++) {
                int64_t i = (row0 + r) * nb + b;
                __m512 d = _mm512_mul_ps(sc, _mm512_set1_ps(a.dx[i]));
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(d, _mm512_cvtepi32_ps(is[r])));
                acc[r] = _mm512_sub_ps(acc[r], _mm512_mul_ps(mn, _mm512_set1_ps(a.dxs[i])));
            }
        }
    }
    __mmask16 mask = (__mmask16)((1u << valid) - 1u);
    __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {
        __m512 v = bias ? _mm512_add_ps(acc[r], bv) : acc[r];
        _mm512_mask_storeu_ps(y + r * ldy, mask, v);
    }
}

/* ---- AVX2: the same, one half-group of 8 outputs (lanes 8h .. 8h+7) at a time -------------------- */
static inline __attribute__((always_inline)) __m256i dot4_avx2(__m256i acc, __m256i u, __m256i x, const int fmt) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i p;
    if (fmt == FMT_Q8) { /* u = q + 128: |q| times qx with q's sign */
        __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80));
        p = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q));
    } else { /* u <= 63: 2 * 63 * 127 < 2^15 */
        p = _mm256_maddubs_epi16(u, x);
    }
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
}

static inline __attribute__((always_inline)) void tile256(const int fmt, const uint8_t *W, const float *S,
                                                          const float *M, acts a, int64_t row0, float *y,
                                                          int64_t ldy, const float *bias, int valid, const int R,
                                                          const int h) {
    __m256 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F), hi2 = _mm256_set1_epi8(0x30);
    const int64_t nb = a.nb;
    for (int64_t b = 0; b < nb; b++) {
        __m256i is[ROWS], is1[ROWS];
        for (int r = 0; r < R; r++) is[r] = is1[r] = _mm256_setzero_si256();
        const int8_t *xb = a.xq + row0 * nb * QB + b * QB;
        const uint8_t *chunk = W + (KFMT(fmt) ? (b / BPS) * chunk_bytes(fmt) : b * chunk_bytes(fmt));
        const int j = (int)(b % BPS);
        if (fmt == FMT_Q8) {
            const uint8_t *w = chunk + 32 * h;
            for (int t = 0; t < 8; t++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(w + 64 * t));
                for (int r = 0; r < R; r++)
                    is[r] = dot4_avx2(is[r], v, _mm256_set1_epi32(load4(xb + r * nb * QB + 4 * t)), fmt);
            }
        } else {
            const uint8_t *w = (KFMT(fmt) ? chunk + 256 * j : chunk) + 32 * h;
            __m256i hv[2];
            if (fmt == FMT_Q6K)
                for (int p = 0; p < 2; p++)
                    hv[p] = _mm256_loadu_si256((const __m256i *)(chunk + 2048 + 128 * j + 64 * p + 32 * h));
            for (int c = 0; c < 4; c++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(w + 64 * c));
                __m256i u[2] = {_mm256_and_si256(v, low4), _mm256_and_si256(_mm256_srli_epi16(v, 4), low4)};
                for (int e = 0; e < 2; e++) {
                    const int t = 2 * c + e;
                    if (fmt == FMT_Q6K) {
                        const int sh = 2 * (t % 4);
                        __m256i hb = sh <= 4 ? _mm256_slli_epi16(hv[t / 4], 4 - sh) : _mm256_srli_epi16(hv[t / 4], 2);
                        u[e] = _mm256_or_si256(u[e], _mm256_and_si256(hb, hi2));
                    }
                    for (int r = 0; r < R; r++) {
                        __m256i xv = _mm256_set1_epi32(load4(xb + r * nb * QB + 4 * t));
                        if (fmt == FMT_Q6K && t >= 4) is1[r] = dot4_avx2(is1[r], u[e], xv, fmt);
                        else is[r] = dot4_avx2(is[r], u[e], xv, fmt);
                    }
                }
            }
        }
        if (fmt == FMT_Q8) {
            __m256 sc = _mm256_loadu_ps(S + b * G + 8 * h);
            for (int r = 0; r < R; r++) {
                __m256 d = _mm256_mul_ps(sc, _mm256_set1_ps(a.dx[(row0 + r) * nb + b]));
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(d, _mm256_cvtepi32_ps(is[r])));
            }
        } else if (fmt == FMT_Q6K) {
            __m256 dv = _mm256_loadu_ps(S + (b / BPS) * G + 8 * h);
            const int8_t *sc = (const int8_t *)(chunk + 3072 + 32 * j + 8 * h);
            __m256i s0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc));
            __m256i s1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 16)));
            for (int r = 0; r < R; r++) {
                int64_t i = (row0 + r) * nb + b;
                __m256i i0 = _mm256_sub_epi32(is[r], _mm256_set1_epi32(a.sx16[2 * i]));
                __m256i i1 = _mm256_sub_epi32(is1[r], _mm256_set1_epi32(a.sx16[2 * i + 1]));
                __m256i isum = _mm256_add_epi32(_mm256_mullo_epi32(s0, i0), _mm256_mullo_epi32(s1, i1));
                __m256 d = _mm256_mul_ps(dv, _mm256_set1_ps(a.dx[i]));
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(d, _mm256_cvtepi32_ps(isum)));
            }
        } else {
            __m256 sc, mn;
            if (fmt == FMT_Q4) {
                sc = _mm256_loadu_ps(S + b * G + 8 * h);
                mn = _mm256_loadu_ps(M + b * G + 8 * h);
            } else {
                const uint8_t *k = chunk + 2048 + 16 * j + 8 * h;
                sc = _mm256_mul_ps(_mm256_loadu_ps(S + (b / BPS) * G + 8 * h),
                                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)k))));
                mn = _mm256_mul_ps(_mm256_loadu_ps(M + (b / BPS) * G + 8 * h),
                                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(k + 128)))));
            }
            for (int r = 0; r < R; r++) {
                int64_t i = (row0 + r) * nb + b;
                __m256 d = _mm256_mul_ps(sc, _mm256_set1_ps(a.dx[i]));
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(d, _mm256_cvtepi32_ps(is[r])));
                acc[r] = _mm256_sub_ps(acc[r], _mm256_mul_ps(mn, _mm256_set1_ps(a.dxs[i])));
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float tmp[8];
        _mm256_storeu_ps(tmp, acc[r]);
        for (int k = 0; k < valid; k++) y[r * ldy + k] = bias ? tmp[k] + bias[k] : tmp[k];
    }
}

typedef void (*tile_fn)(const uint8_t *, const float *, const float *, acts, int64_t, float *, int64_t,
                        const float *, int);

#define TILES(FMT, R)                                                                                      \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static void t512_##FMT##_##R(          \
        const uint8_t *W, const float *S, const float *M, acts a, int64_t row0, float *y, int64_t ldy,     \
        const float *bias, int valid) {                                                                    \
        tile512(FMT, W, S, M, a, row0, y, ldy, bias, valid, R);                                            \
    }                                                                                                      \
    static void t256_##FMT##_##R(const uint8_t *W, const float *S, const float *M, acts a, int64_t row0,   \
                                 float *y, int64_t ldy, const float *bias, int valid) {                    \
        int v0 = valid < 8 ? valid : 8;                                                                    \
        tile256(FMT, W, S, M, a, row0, y, ldy, bias, v0, R, 0);                                            \
        if (valid > 8) tile256(FMT, W, S, M, a, row0, y + 8, ldy, bias ? bias + 8 : 0, valid - 8, R, 1);   \
    }
#define ALL_ROWS(FMT) TILES(FMT, 1) TILES(FMT, 2) TILES(FMT, 3) TILES(FMT, 4) \
                      TILES(FMT, 5) TILES(FMT, 6) TILES(FMT, 7) TILES(FMT, 8)
ALL_ROWS(8)
ALL_ROWS(4)
ALL_ROWS(41)
ALL_ROWS(6)

#define LIST(PRE, FMT) {0, PRE##_##FMT##_1, PRE##_##FMT##_2, PRE##_##FMT##_3, PRE##_##FMT##_4, \
                        PRE##_##FMT##_5, PRE##_##FMT##_6, PRE##_##FMT##_7, PRE##_##FMT##_8}
static const tile_fn T512_Q8[ROWS + 1] = LIST(t512, 8), T512_Q4[ROWS + 1] = LIST(t512, 4);
static const tile_fn T512_Q4K[ROWS + 1] = LIST(t512, 41), T512_Q6K[ROWS + 1] = LIST(t512, 6);
static const tile_fn T256_Q8[ROWS + 1] = LIST(t256, 8), T256_Q4[ROWS + 1] = LIST(t256, 4);
static const tile_fn T256_Q4K[ROWS + 1] = LIST(t256, 41), T256_Q6K[ROWS + 1] = LIST(t256, 6);

/* 1 when the CPU runs `isa` (ISA_AVX2 needs AVX2; ISA_VNNI512 needs AVX512F/BW/VL and AVX512-VNNI). */
int qgemm_supported(int isa) {
    __builtin_cpu_init();
    if (isa == ISA_AVX2) return __builtin_cpu_supports("avx2");
    if (isa == ISA_VNNI512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    return 0;
}

static const tile_fn *tiles_for(int fmt, int isa) {
    int v = isa == ISA_VNNI512;
    switch (fmt) {
    case FMT_Q8: return v ? T512_Q8 : T256_Q8;
    case FMT_Q4: return v ? T512_Q4 : T256_Q4;
    case FMT_Q4K: return v ? T512_Q4K : T256_Q4K;
    case FMT_Q6K: return v ? T512_Q6K : T256_Q6K;
    }
    return 0;
}

/* x [n, in] fp32, W/S/M packed as above (M NULL for q8 and q6k), bias [out] fp32 or NULL, y [n, out] fp32
 * with row stride ldy (>= out: a part of a wider output). q4k and q6k need `in` a multiple of 256.
 * Returns 0, or 1 for an unsupported format, shape or ISA, 2 when out of memory. */
int qgemm(int fmt, int isa, const float *x, const uint8_t *W, const float *S, const float *M, const float *bias,
          float *y, int64_t ldy, int64_t n, int64_t in, int64_t out, int threads) {
    const tile_fn *tiles = tiles_for(fmt, isa);
    if (!tiles || !qgemm_supported(isa) || (KFMT(fmt) && in % (BPS * QB))) return 1;
    const int64_t nb = (in + QB - 1) / QB, groups = (out + G - 1) / G, units = (groups + UNIT - 1) / UNIT;
    const int64_t wgroup = KFMT(fmt) ? nb / BPS * chunk_bytes(fmt) : nb * chunk_bytes(fmt); /* bytes a group */
    const int64_t sgroup = KFMT(fmt) ? nb / BPS * G : nb * G;                                /* scales a group */
    int8_t *xq = malloc((size_t)(n * nb * QB) + 64);
    float *dx = malloc((size_t)(n * nb) * sizeof(float) + 64), *dxs = malloc((size_t)(n * nb) * sizeof(float) + 64);
    int32_t *sx = malloc((size_t)(n * nb) * sizeof(int32_t) + 64), *sx16 = malloc((size_t)(n * nb) * 8 + 64);
    if (!xq || !dx || !dxs || !sx || !sx16) {
        free(xq); free(dx); free(dxs); free(sx); free(sx16);
        return 2;
    }
    quantize_rows(x, n, in, nb, xq, dx, sx, dxs, sx16);
    acts a = {xq, dx, sx, dxs, sx16, nb};
    int64_t most = in * out / MIN_WORK; /* a tiny matrix is not worth waking a second thread */
    if (threads > most) threads = (int)most;
    if (threads > units) threads = (int)units;
    if (threads < 1) threads = 1;
    /* guided: long runs of consecutive units first (each thread streams through contiguous weights, and a
     * unit's last blocks prefetch the next one's first), shorter ones at the end to balance the threads */
#pragma omp parallel for num_threads(threads) schedule(guided, 1) if (threads > 1)
    for (int64_t u = 0; u < units; u++) {
        int64_t g1 = (u + 1) * UNIT < groups ? (u + 1) * UNIT : groups;
        for (int64_t i0 = 0; i0 < n; i0 += ROWS) {
            int R = (int)(n - i0 < ROWS ? n - i0 : ROWS);
            for (int64_t g = u * UNIT; g < g1; g++) {
                int valid = (int)(out - g * G < G ? out - g * G : G);
                tiles[R](W + g * wgroup, S + g * sgroup, M ? M + g * sgroup : 0, a, i0, y + i0 * ldy + g * G,
                         ldy, bias ? bias + g * G : 0, valid);
            }
        }
    }
    free(xq); free(dx); free(dxs); free(sx); free(sx16);
    return 0;
}
