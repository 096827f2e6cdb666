/* Quantized skinny GEMM: y[n, out] = x[n, in] . W[out, in]^T (+ bias), x and y fp32, W in blocks of 32.
 *
 * Weight formats (see kernels/quant.py; per output row, per block of 32 inputs):
 *   q8:  w = d * q,        q int8 in -127..127, stored as the unsigned byte q + 128, d fp16 (GGUF Q8_0);
 *   q4:  w = s * q - m,    q in 0..15, two per byte, s and m fp16 (GGUF Q4_1);
 *   q4k: GGUF Q4_K kept as it is: w = (d * sc) * q - (dmin * mn), q in 0..15, sc and mn 6-bit integers per
 *        block of 32, d and dmin fp32 (the file's fp16) per super-block of 256: 0.5625 + 0.0156 bytes a weight;
 *   q6k: GGUF Q6_K kept as it is: w = d * sc * (q - 32), q in 0..63, sc an int8 per sub-block of 16,
 *        d fp32 (the file's fp16) per super-block of 256: 0.8125 bytes a weight (q8: 1.125).
 * Activations are quantized here, per row, with one scale per block of 32 (q8, q4: GGUF Q8_0 style) or per
 * super-block of 256 (q4k, q6k: llama.cpp's Q8_K): dx = amax / 127, qx = round(x * (127 / amax)) in
 * -127..127 (ties to even), and the sums of qx: sx per block of 32 (q8, q4; dxs = dx * (float)sx for q4),
 * bs per block of 32 (q4k) or per half block of 16 (q6k). The scale depends only on that row's values, so a
 * row's quantized input never depends on n.
 *
 * Layout ("VNNI order"): outputs in groups of G = 16 (the 16 int32 lanes of a 512-bit register), and
 * per group and block the bytes are ordered so one 64-byte load holds 4 consecutive inputs of each of
 * the 16 outputs. `vpdpbusd` multiplies those unsigned bytes with the same 4 signed activation bytes
 * broadcast to every lane and adds the 4 products into each output's lane: no horizontal sums.
 *   q8, per group and block, 544 bytes: byte [t][k][e] = q[16g + k][32b + 4t + e] + 128  (t < 8), then d
 *        fp16 [k] (32 bytes);
 *   q4, per group and block, 320 bytes: 256 of nibbles, byte [c][k][e] = q[16g + k][32b + 8c + e]
 *        | q[16g + k][32b + 8c + 4 + e] << 4  (c < 4), then s fp16 [k] and m fp16 [k] (32 bytes each);
 *   q4k, per group and super-block, 2304 bytes: the 8 blocks' nibbles as q4 (2048), then sc [8][16] and
 *        mn [8][16] as bytes (block, lane);
 *   q6k, per group and super-block, 3328 bytes: the 8 blocks' low 4 bits as q4's nibbles (2048), then the
 *        high 2 bits, 128 bytes a block: byte [p][k][e] holds input 32b + 16p + 4j + e of output k at bits
 *        2j..2j+1 (j < 4), then sc [16][16] as int8 (sub-block, lane);
 *   q4k, q6k: scales fp32 [group][super-block][16] (d), mins the same for q4k (dmin). Rows past `out` and
 *   inputs past `in` are zero.
 * q8 and q4 keep their scales beside their bytes so a matrix is one stream: with fp32 scales and mins in
 * streams of their own a SmolLM2 q4 forward took 1.16-1.2x as long (BENCHMARKS.md session 34; modelled in
 * benchmarks/s33/q4_layouts.c). q4 chunks are 5 cache lines; q8's 8.5, so every other block's 64-byte
 * loads straddle two lines, each 32-byte half inside one.
 *
 * Exact integer part, whatever instructions compute it: vpdpbusd on the biased q8 bytes then minus 128 * sx,
 * or on nibbles (AVX512-VNNI); |q| times sign-adjusted qx with vpmaddubsw + vpmaddwd (AVX2, no saturation:
 * 2 * 127 * 127 < 2^15), or nibbles times qx the same way. Per output o and row i:
 *   q8, q4, per block b: isum = sum over the block of q * qx, |isum| <= 32 * 127 * 127 < 2^19.
 *   q4k, per super-block: isup = sum over its 8 blocks j of sc_j * (sum over block j of q * qx), |isup| <=
 *     8 * 63 * 32 * 15 * 127 = 30,723,840 < 2^25 (int32 exact; AVX512: vpmulld per block, AVX2: sc_j as the
 *     vpmaddwd multiplier); imin = sum over j of mn_j * bs_j, |imin| <= 8 * 63 * 32 * 127 < 2^21
 *     (vpdpwssd / vpmaddwd on int16 pairs of mn and bs).
 *   q6k, per super-block: isup = sum over its 16 sub-blocks s of sc_s * (sum of q * qx - 32 * bs_s), via
 *     sum of sc_s * (sum of q * qx) (<= 16 * 128 * 16 * 63 * 127 < 2^28) minus 32 * (sum of sc_s * bs_s)
 *     (int16 pairs as for q4k's mins); |isup| <= 16 * 128 * 16 * 32 * 127 = 133,169,152 < 2^28.
 * isum and imin are below 2^24, so their floats are exact. isup may pass 2^24: (float)isup is then the
 * round-to-nearest-even of a fixed integer (vcvtdq2ps under the default MXCSR; torch's int32 -> fp32 the
 * same), one rounding that depends only on the integer, so it is the same for any n, tile or ISA.
 * Fixed float part, identical on every ISA and in the torch fallback (kernels/quant.py), per output:
 *   acc = 0;
 *   q8, q4: for each block b in order:
 *     q8:  acc = acc + (d[o,b] * dx[b]) * (float)isum;
 *     q4:  acc = acc + (s[o,b] * dx[b]) * (float)isum;  acc = acc - m[o,b] * dxs[b];
 *   q4k, q6k: for each super-block S in order (dx[S] its activation scale):
 *     q4k: acc = acc + (d[o,S] * dx[S]) * (float)isup;  acc = acc - (dmin[o,S] * dx[S]) * (float)imin;
 *     q6k: acc = acc + (d[o,S] * dx[S]) * (float)isup;
 *   y = acc (+ bias[o]).
 * Each product and sum rounds once (compiled with -ffp-contract=off: no fused multiply-adds), so a
 * forward over n positions gives bit-identical outputs to n single-position forwards, on any ISA.
 * One float step per super-block instead of per block (and the activations quantized 8 at a time) is what
 * makes the k-formats cheap per position: Qwen2.5-Coder-1.5B's q4k/q6k parts, all layers and the head,
 * 2 threads, shared machine (benchmarks/kernel/qgemm_parts.py), per-32 float steps -> per-256:
 * n = 1 25.7 -> 22.2 ms, n = 4 35.4 -> 22.2, n = 8 49.5 -> 26.4, n = 64 370 -> 173.
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

#include "amx.h"

#define G 16
#define QB 32
#define BPS 8 /* blocks per super-block (q4k, q6k) */
#define ROWS 8
#define UNIT 4
#define MIN_WORK (1 << 17) /* weights per thread, at least */
#define UNROLL _Pragma("GCC unroll 16") /* rows and lanes in registers: a rolled loop keeps them on the stack */
#define PF_BLOCKS 16 /* software prefetch distance in blocks: 16-32 measured 1.2-1.7x faster than none */

enum { FMT_Q8 = 8, FMT_Q4 = 4, FMT_Q4K = 41, FMT_Q6K = 6 };
enum { ISA_AVX2 = 1, ISA_VNNI512 = 2, ISA_AMX = 3 };

/* Bytes per group and block (q8, q4), or per group and super-block (q4k, q6k). */
static inline __attribute__((always_inline)) int64_t chunk_bytes(const int fmt) {
    return fmt == FMT_Q8 ? 544 : fmt == FMT_Q4 ? 320 : fmt == FMT_Q4K ? 2304 : 3328;
}
/* Where a q8 or q4 block's fp16 scales start in its chunk (q4's mins 32 bytes after). */
#define SCALES_AT(fmt) ((fmt) == FMT_Q8 ? 512 : 256)
#define KFMT(fmt) ((fmt) == FMT_Q4K || (fmt) == FMT_Q6K)

typedef struct {
    const int8_t *xq;   /* [n][nb * 32] */
    const float *dx;    /* [n][ns]: one scale per block (q8, q4: ns = nb) or per super-block (q4k, q6k: nb / 8) */
    const int32_t *sx;  /* [n][nb]: the block's sum of qx (q8: the +128 bias) */
    const float *dxs;   /* [n][nb]: dx * (float)sx (q4: the min) */
    const int16_t *bs;  /* q4k: [n][nb] the block's sum of qx; q6k: [n][nb][2] each half's */
    int64_t nb, ns;
} acts;

/* The sums of the 16-byte halves of the 32 int8 at q. */
static inline __attribute__((always_inline)) void half_sums(const int8_t *q, int32_t half[2]) {
    __m256i v = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), _mm256_loadu_si256((const __m256i *)q)),
                                  _mm256_set1_epi16(1)); /* 8 int32, each the sum of 4 bytes */
    __m128i h[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
    for (int e = 0; e < 2; e++) {
        __m128i t = _mm_add_epi32(h[e], _mm_shuffle_epi32(h[e], 0x4E));
        half[e] = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
    }
}

/* Quantize each row of x: one scale per `span` = nb * 32 / ns inputs, then the sums of qx (see the top).
 * AVX2, 8 inputs at a time: the max of |x| is exact in any order, and each qx is the same one product and
 * one rounding (to nearest even, then clamped) as the scalar tail and the torch code. */
static void quantize_rows(int fmt, const float *x, int64_t n, int64_t in, int64_t nb, int64_t ns, int8_t *xq,
                          float *dx, int32_t *sx, float *dxs, int16_t *bs) {
    const int64_t span = nb * QB / ns;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    for (int64_t i = 0; i < n; i++) {
        for (int64_t s = 0; s < ns; s++) {
            const float *p = x + i * in + s * span;
            const int64_t len = in - s * span < span ? in - s * span : span, len8 = len & ~(int64_t)7;
            __m256 m = _mm256_setzero_ps();
            for (int64_t k = 0; k < len8; k += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(p + k), abs_mask));
            float lanes[8], amax = 0.0f;
            _mm256_storeu_ps(lanes, m);
            for (int k = 0; k < 8; k++) amax = lanes[k] > amax ? lanes[k] : amax;
            for (int64_t k = len8; k < len; k++) amax = fabsf(p[k]) > amax ? fabsf(p[k]) : amax;
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            const __m256 vi = _mm256_set1_ps(inv);
            int8_t *q = xq + i * nb * QB + s * span;
            for (int64_t k = 0; k < len8; k += 8) {
                __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(p + k), vi), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                __m256i v = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
                __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
                _mm_storel_epi64((__m128i *)(q + k), _mm_packs_epi16(w, w));
            }
            for (int64_t k = len8; k < span; k++) {
                float r = k < len ? nearbyintf(p[k] * inv) : 0.0f;
                q[k] = (int8_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
            }
            dx[i * ns + s] = amax / 127.0f;
        }
        for (int64_t b = 0; b < nb; b++) {
            const int64_t ib = i * nb + b;
            int32_t half[2];
            half_sums(xq + ib * QB, half);
            sx[ib] = half[0] + half[1];
            dxs[ib] = dx[i * ns + b * ns / nb] * (float)sx[ib];
            if (fmt == FMT_Q6K) {
                bs[2 * ib] = (int16_t)half[0];
                bs[2 * ib + 1] = (int16_t)half[1];
            } else {
                bs[ib] = (int16_t)sx[ib];
            }
        }
    }
}

static inline int32_t load4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- AVX512-VNNI: one group of 16 outputs x R rows ------------------------------------------------ */
/* q8, q4: blocks of 32, one float step per block. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static inline __attribute__((always_inline)) void
tile512(const int fmt, const uint8_t *W, const float *S, const float *M, acts a, int64_t row0, float *y,
        int64_t ldy, const float *bias, int valid, const int R) {
    __m512 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const int64_t nb = a.nb, per = chunk_bytes(fmt);
    for (int64_t b = 0; b < nb; b++) {
        __m512i is[ROWS];
        for (int r = 0; r < R; r++) is[r] = _mm512_setzero_si512();
        const int8_t *xb = a.xq + row0 * nb * QB + b * QB;
        { /* the weights PF_BLOCKS blocks ahead (past the group's end: the next group's, laid out after it) */
            const char *ahead = (const char *)(W + (b + PF_BLOCKS) * per);
            for (int l = 0; l < (per + 63) / 64; l++) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
        }
        const uint8_t *chunk = W + b * per;
        if (fmt == FMT_Q8) {
            for (int t = 0; t < 8; t++) {
                __m512i v = _mm512_loadu_si512((const void *)(chunk + 64 * t));
                for (int r = 0; r < R; r++)
                    is[r] = _mm512_dpbusd_epi32(is[r], v, _mm512_set1_epi32(load4(xb + r * nb * QB + 4 * t)));
            }
        } else {
            for (int c = 0; c < 4; c++) {
                __m512i v = _mm512_loadu_si512((const void *)(chunk + 64 * c));
                __m512i u[2] = {_mm512_and_si512(v, low4), _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)};
                for (int e = 0; e < 2; e++)
                    for (int r = 0; r < R; r++)
                        is[r] = _mm512_dpbusd_epi32(is[r], u[e], _mm512_set1_epi32(load4(xb + r * nb * QB + 4 * (2 * c + e))));
            }
        }
        __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(chunk + SCALES_AT(fmt))));
        if (fmt == FMT_Q8) {
            for (int r = 0; r < R; r++) {
                int64_t i = (row0 + r) * nb + b;
                __m512i isum = _mm512_sub_epi32(is[r], _mm512_set1_epi32(128 * a.sx[i]));
                __m512 d = _mm512_mul_ps(sc, _mm512_set1_ps(a.dx[i]));
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(d, _mm512_cvtepi32_ps(isum)));
            }
        } else {
            __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(chunk + SCALES_AT(fmt) + 32)));
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

/* 16 lanes of int16 pairs (v[k] of block 2p, of block 2p + 1) from two rows of 16 bytes (q4k's mn, q6k's sc). */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static inline __attribute__((always_inline)) __m512i
pairs512(const uint8_t *p, const int is_signed) {
    __m128i lo = _mm_loadu_si128((const __m128i *)p), hi = _mm_loadu_si128((const __m128i *)(p + 16));
    __m256i v = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
    return is_signed ? _mm512_cvtepi8_epi16(v) : _mm512_cvtepu8_epi16(v);
}

/* q4k, q6k: integer sums over the super-block, one float step per super-block. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static inline __attribute__((always_inline)) void
tile512_k(const int fmt, const uint8_t *W, const float *S, const float *M, acts a, int64_t row0, float *y,
          int64_t ldy, const float *bias, int valid, const int R) {
    __m512 acc[ROWS];
    UNROLL for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F), hi2 = _mm512_set1_epi8(0x30);
    const int64_t nb = a.nb, ns = a.ns, per = chunk_bytes(fmt);
    for (int64_t s = 0; s < ns; s++) {
        const uint8_t *chunk = W + s * per;
        __m512i isup[ROWS];
        UNROLL for (int r = 0; r < R; r++) isup[r] = _mm512_setzero_si512();
        for (int j = 0; j < BPS; j++) {
            { /* the weights PF_BLOCKS blocks ahead (past the group's end: the next group's) */
                const char *ahead = (const char *)(chunk + (j + PF_BLOCKS) * (per / BPS));
                for (int l = 0; l < (per / BPS + 63) / 64; l++) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
                if (j == 0) {
                    _mm_prefetch((const char *)(S + (s + PF_BLOCKS / BPS) * G), _MM_HINT_T0);
                    if (M) _mm_prefetch((const char *)(M + (s + PF_BLOCKS / BPS) * G), _MM_HINT_T0);
                }
            }
            const int8_t *xb = a.xq + row0 * nb * QB + (s * BPS + j) * QB;
            __m512i u[8];
            UNROLL for (int c = 0; c < 4; c++) {
                __m512i v = _mm512_loadu_si512((const void *)(chunk + 256 * j + 64 * c));
                u[2 * c] = _mm512_and_si512(v, low4);
                u[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            }
            if (fmt == FMT_Q6K) { /* bits 2(t%4) of h[t/4] to bits 4..5 */
                __m512i h[2];
                UNROLL for (int p = 0; p < 2; p++) h[p] = _mm512_loadu_si512((const void *)(chunk + 2048 + 128 * j + 64 * p));
                UNROLL for (int t = 0; t < 8; t++) {
                    const int sh = 2 * (t % 4);
                    __m512i hb = sh <= 4 ? _mm512_slli_epi16(h[t / 4], 4 - sh) : _mm512_srli_epi16(h[t / 4], 2);
                    u[t] = _mm512_or_si512(u[t], _mm512_and_si512(hb, hi2));
                }
                const int8_t *sc = (const int8_t *)(chunk + 3072 + 32 * j);
                __m512i s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc));
                __m512i s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + 16)));
                UNROLL for (int r = 0; r < R; r++) {
                    __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
                    UNROLL for (int t = 0; t < 4; t++) {
                        i0 = _mm512_dpbusd_epi32(i0, u[t], _mm512_set1_epi32(load4(xb + r * nb * QB + 4 * t)));
                        i1 = _mm512_dpbusd_epi32(i1, u[t + 4], _mm512_set1_epi32(load4(xb + r * nb * QB + 16 + 4 * t)));
                    }
                    isup[r] = _mm512_add_epi32(isup[r], _mm512_add_epi32(_mm512_mullo_epi32(s0, i0), _mm512_mullo_epi32(s1, i1)));
                }
            } else {
                __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(chunk + 2048 + 16 * j)));
                UNROLL for (int r = 0; r < R; r++) { /* two chains of 4 (the integers are exact in any order) */
                    __m512i is[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
                    UNROLL for (int t = 0; t < 8; t++)
                        is[t % 2] = _mm512_dpbusd_epi32(is[t % 2], u[t], _mm512_set1_epi32(load4(xb + r * nb * QB + 4 * t)));
                    isup[r] = _mm512_add_epi32(isup[r], _mm512_mullo_epi32(sc, _mm512_add_epi32(is[0], is[1])));
                }
            }
        }
        const __m512 dv = _mm512_loadu_ps(S + s * G);
        if (fmt == FMT_Q6K) { /* the -32: sum over sub-blocks of sc * (their sum of qx), times 32 */
            __m512i sp[8];
            UNROLL for (int p = 0; p < 8; p++) sp[p] = pairs512(chunk + 3072 + 32 * p, 1);
            UNROLL for (int r = 0; r < R; r++) {
                const int16_t *bsr = a.bs + 2 * ((row0 + r) * nb + s * BPS);
                __m512i off = _mm512_setzero_si512();
                UNROLL for (int p = 0; p < 8; p++) off = _mm512_dpwssd_epi32(off, sp[p], _mm512_set1_epi32(load4(bsr + 2 * p)));
                __m512i isum = _mm512_sub_epi32(isup[r], _mm512_slli_epi32(off, 5));
                __m512 d = _mm512_mul_ps(dv, _mm512_set1_ps(a.dx[(row0 + r) * ns + s]));
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(d, _mm512_cvtepi32_ps(isum)));
            }
        } else { /* the mins: sum over blocks of mn * (their sum of qx) */
            const __m512 mv = _mm512_loadu_ps(M + s * G);
            __m512i mp[4];
            UNROLL for (int p = 0; p < 4; p++) mp[p] = pairs512(chunk + 2048 + 128 + 32 * p, 0);
            UNROLL for (int r = 0; r < R; r++) {
                const int16_t *bsr = a.bs + (row0 + r) * nb + s * BPS;
                __m512i imin = _mm512_setzero_si512();
                UNROLL for (int p = 0; p < 4; p++) imin = _mm512_dpwssd_epi32(imin, mp[p], _mm512_set1_epi32(load4(bsr + 2 * p)));
                __m512 dxr = _mm512_set1_ps(a.dx[(row0 + r) * ns + s]);
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(dv, dxr), _mm512_cvtepi32_ps(isup[r])));
                acc[r] = _mm512_sub_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(mv, dxr), _mm512_cvtepi32_ps(imin)));
            }
        }
    }
    __mmask16 mask = (__mmask16)((1u << valid) - 1u);
    __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    UNROLL for (int r = 0; r < R; r++) {
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
    } else { /* u <= 15: 2 * 15 * 127 < 2^15 */
        p = _mm256_maddubs_epi16(u, x);
    }
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
}

static inline __attribute__((always_inline)) void tile256(const int fmt, const uint8_t *W, const float *S,
                                                          const float *M, acts a, int64_t row0, float *y,
                                                          int64_t ldy, const float *bias, int valid, const int R,
                                                          const int h) {
    __m256 acc[ROWS];
    UNROLL for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const int64_t nb = a.nb;
    for (int64_t b = 0; b < nb; b++) {
        __m256i is[ROWS];
        UNROLL for (int r = 0; r < R; r++) is[r] = _mm256_setzero_si256();
        const int8_t *xb = a.xq + row0 * nb * QB + b * QB;
        const uint8_t *chunk = W + b * chunk_bytes(fmt), *w = chunk + 32 * h;
        if (fmt == FMT_Q8) {
            UNROLL for (int t = 0; t < 8; t++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(w + 64 * t));
                UNROLL for (int r = 0; r < R; r++)
                    is[r] = dot4_avx2(is[r], v, _mm256_set1_epi32(load4(xb + r * nb * QB + 4 * t)), fmt);
            }
        } else {
            UNROLL for (int c = 0; c < 4; c++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(w + 64 * c));
                __m256i u[2] = {_mm256_and_si256(v, low4), _mm256_and_si256(_mm256_srli_epi16(v, 4), low4)};
                for (int e = 0; e < 2; e++)
                    UNROLL for (int r = 0; r < R; r++)
                        is[r] = dot4_avx2(is[r], u[e], _mm256_set1_epi32(load4(xb + r * nb * QB + 4 * (2 * c + e))), fmt);
            }
        }
        __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(chunk + SCALES_AT(fmt) + 16 * h)));
        if (fmt == FMT_Q8) {
            UNROLL for (int r = 0; r < R; r++) {
                __m256 d = _mm256_mul_ps(sc, _mm256_set1_ps(a.dx[(row0 + r) * nb + b]));
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(d, _mm256_cvtepi32_ps(is[r])));
            }
        } else {
            __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(chunk + SCALES_AT(fmt) + 32 + 16 * h)));
            UNROLL for (int r = 0; r < R; r++) {
                int64_t i = (row0 + r) * nb + b;
                __m256 d = _mm256_mul_ps(sc, _mm256_set1_ps(a.dx[i]));
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(d, _mm256_cvtepi32_ps(is[r])));
                acc[r] = _mm256_sub_ps(acc[r], _mm256_mul_ps(mn, _mm256_set1_ps(a.dxs[i])));
            }
        }
    }
    UNROLL for (int r = 0; r < R; r++) {
        float tmp[8];
        _mm256_storeu_ps(tmp, acc[r]);
        for (int k = 0; k < valid; k++) y[r * ldy + k] = bias ? tmp[k] + bias[k] : tmp[k];
    }
}

/* 8 lanes (8h ..) of int16 pairs (v[k] of block 2p, of block 2p + 1) from two rows of 16 bytes. */
static inline __attribute__((always_inline)) __m256i pairs256(const uint8_t *p, const int is_signed) {
    __m128i v = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)p), _mm_loadl_epi64((const __m128i *)(p + 16)));
    return is_signed ? _mm256_cvtepi8_epi16(v) : _mm256_cvtepu8_epi16(v);
}

/* 8 lanes of (v, v) as int16 pairs, v the bytes at p (the scale of a block or sub-block, per lane). */
static inline __attribute__((always_inline)) __m256i twice256(const uint8_t *p, const int is_signed) {
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    b = _mm_unpacklo_epi8(b, b);
    return is_signed ? _mm256_cvtepi8_epi16(b) : _mm256_cvtepu8_epi16(b);
}

/* q4k, q6k: the block scale multiplies in vpmaddwd (in place of tile256's ones): sc * (p0 + p1). */
static inline __attribute__((always_inline)) void tile256_k(const int fmt, const uint8_t *W, const float *S,
                                                            const float *M, acts a, int64_t row0, float *y,
                                                            int64_t ldy, const float *bias, int valid,
                                                            const int R, const int h) {
    __m256 acc[ROWS];
    UNROLL for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F), hi2 = _mm256_set1_epi8(0x30);
    const int64_t nb = a.nb, ns = a.ns, per = chunk_bytes(fmt);
    for (int64_t s = 0; s < ns; s++) {
        const uint8_t *chunk = W + s * per;
        __m256i isup[ROWS];
        UNROLL for (int r = 0; r < R; r++) isup[r] = _mm256_setzero_si256();
        for (int j = 0; j < BPS; j++) {
            const int8_t *xb = a.xq + row0 * nb * QB + (s * BPS + j) * QB;
            __m256i u[8], sc[2];
            UNROLL for (int c = 0; c < 4; c++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(chunk + 256 * j + 64 * c + 32 * h));
                u[2 * c] = _mm256_and_si256(v, low4);
                u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            }
            if (fmt == FMT_Q6K) { /* u <= 63: 2 * 63 * 127 < 2^15 */
                __m256i hv[2];
                UNROLL for (int p = 0; p < 2; p++)
                    hv[p] = _mm256_loadu_si256((const __m256i *)(chunk + 2048 + 128 * j + 64 * p + 32 * h));
                UNROLL for (int t = 0; t < 8; t++) {
                    const int sh = 2 * (t % 4);
                    __m256i hb = sh <= 4 ? _mm256_slli_epi16(hv[t / 4], 4 - sh) : _mm256_srli_epi16(hv[t / 4], 2);
                    u[t] = _mm256_or_si256(u[t], _mm256_and_si256(hb, hi2));
                }
                sc[0] = twice256(chunk + 3072 + 32 * j + 8 * h, 1);
                sc[1] = twice256(chunk + 3072 + 32 * j + 16 + 8 * h, 1);
            } else {
                sc[0] = sc[1] = twice256(chunk + 2048 + 16 * j + 8 * h, 0);
            }
            /* the int16 pair sums of vpmaddubsw are added in int16 before the one vpmaddwd that applies the
             * scale: exact, as |q4k pair| <= 2 * 15 * 127 = 3810 (8 of them: 30480) and |q6k pair| <= 2 * 63 *
             * 127 = 16002 (2 of them: 32004) stay below 2^15; fewer multiplies, the same integers */
            const int group = fmt == FMT_Q6K ? 2 : 8;
            UNROLL for (int r = 0; r < R; r++)
                UNROLL for (int t0 = 0; t0 < 8; t0 += group) {
                    __m256i p = _mm256_maddubs_epi16(u[t0], _mm256_set1_epi32(load4(xb + r * nb * QB + 4 * t0)));
                    UNROLL for (int t = t0 + 1; t < t0 + group; t++)
                        p = _mm256_add_epi16(p, _mm256_maddubs_epi16(u[t], _mm256_set1_epi32(load4(xb + r * nb * QB + 4 * t))));
                    isup[r] = _mm256_add_epi32(isup[r], _mm256_madd_epi16(p, sc[t0 / 4]));
                }
        }
        const __m256 dv = _mm256_loadu_ps(S + s * G + 8 * h);
        if (fmt == FMT_Q6K) {
            __m256i sp[8];
            UNROLL for (int p = 0; p < 8; p++) sp[p] = pairs256(chunk + 3072 + 32 * p + 8 * h, 1);
            UNROLL for (int r = 0; r < R; r++) {
                const int16_t *bsr = a.bs + 2 * ((row0 + r) * nb + s * BPS);
                __m256i off = _mm256_setzero_si256();
                UNROLL for (int p = 0; p < 8; p++)
                    off = _mm256_add_epi32(off, _mm256_madd_epi16(sp[p], _mm256_set1_epi32(load4(bsr + 2 * p))));
                __m256i isum = _mm256_sub_epi32(isup[r], _mm256_slli_epi32(off, 5));
                __m256 d = _mm256_mul_ps(dv, _mm256_set1_ps(a.dx[(row0 + r) * ns + s]));
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(d, _mm256_cvtepi32_ps(isum)));
            }
        } else {
            const __m256 mv = _mm256_loadu_ps(M + s * G + 8 * h);
            __m256i mp[4];
            UNROLL for (int p = 0; p < 4; p++) mp[p] = pairs256(chunk + 2048 + 128 + 32 * p + 8 * h, 0);
            UNROLL for (int r = 0; r < R; r++) {
                const int16_t *bsr = a.bs + (row0 + r) * nb + s * BPS;
                __m256i imin = _mm256_setzero_si256();
                UNROLL for (int p = 0; p < 4; p++)
                    imin = _mm256_add_epi32(imin, _mm256_madd_epi16(mp[p], _mm256_set1_epi32(load4(bsr + 2 * p))));
                __m256 dxr = _mm256_set1_ps(a.dx[(row0 + r) * ns + s]);
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_mul_ps(dv, dxr), _mm256_cvtepi32_ps(isup[r])));
                acc[r] = _mm256_sub_ps(acc[r], _mm256_mul_ps(_mm256_mul_ps(mv, dxr), _mm256_cvtepi32_ps(imin)));
            }
        }
    }
    UNROLL for (int r = 0; r < R; r++) {
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
        if (KFMT(FMT)) tile512_k(FMT, W, S, M, a, row0, y, ldy, bias, valid, R);                          \
        else tile512(FMT, W, S, M, a, row0, y, ldy, bias, valid, R);                                       \
    }                                                                                                      \
    static void t256_##FMT##_##R(const uint8_t *W, const float *S, const float *M, acts a, int64_t row0,   \
                                 float *y, int64_t ldy, const float *bias, int valid) {                    \
        int v0 = valid < 8 ? valid : 8;                                                                    \
        for (int h = 0; h < 2 && (h == 0 || valid > 8); h++) {                                             \
            float *yh = y + 8 * h;                                                                         \
            const float *bh = bias ? bias + 8 * h : 0;                                                     \
            int vh = h ? valid - 8 : v0;                                                                   \
            if (KFMT(FMT)) tile256_k(FMT, W, S, M, a, row0, yh, ldy, bh, vh, R, h);                       \
            else tile256(FMT, W, S, M, a, row0, yh, ldy, bh, vh, R, h);                                    \
        }                                                                                                  \
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

/* ---- Prefill on AMX: each unit's weights dequantized to bf16, then tile multiplies -------------------
 * Prompt processing is not verified against anything, so it may take a faster path than decoding, as long as
 * that path is the same for every prompt position whatever the chunk (`ISA_AMX`, asked for by the fused
 * forward for prefill rows only). Per unit of 32 outputs (two groups of 16) each thread dequantizes the
 * unit's rows into its own bf16 buffer in amx.h's pair layout (L2-resident: 32 x in x 2 bytes, 96 KB at 1536
 * inputs), then amx.h's `amx_unit` multiplies all n positions by them, 16 at a time. A weight becomes
 * bf16(q * s - m) (one fused multiply-subtract, rounded once to fp32, then to bf16 to nearest even): q8 s = d, m = 128 d on the biased
 * byte; q4 s, m; q4k s = d * sc, m = dmin * mn; q6k s = d * sc, m = 32 s. Against the fp32 weights that is a
 * relative error of at most 2^-9 per weight, x's bf16 rounding another 2^-9, the same as the bf16 path's.
 * Order: within a block of 32 inputs the dequantized weights keep the packed layout's order, which for the
 * nibble formats (q4, q4k, q6k) is NIB_ORDER (the low nibbles of the 4 chunks, then the high ones); x's block
 * is permuted the same way when it is rounded to bf16, so each product pairs the right weight and input.
 * Each output is then c = tdpbf16ps over the blocks in order (+ bias), independent of n, the unit and the
 * thread: prefill rows are bit-identical whatever the chunking. Measured (Xeon family 6 model 207, 2 threads,
 * Qwen2.5-Coder-1.5B q4, `specdec probe`): see BENCHMARKS.md session 13. */
static const int NIB_ORDER[32] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27,
                                  4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};

/* x [n, in] fp32 -> bf16 [n, in], each block of 32 inputs in `order` (NULL: as it is). in % 32 == 0. */
AMX_FN static void amx_round_x(const float *x, uint16_t *xb, int64_t n, int64_t in, const int *order) {
    __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), hi = _mm512_add_epi32(lo, _mm512_set1_epi32(16));
    if (order) lo = _mm512_loadu_si512(order), hi = _mm512_loadu_si512(order + 16);
    for (int64_t k = 0; k < n * in; k += 32) {
        const __m512 a = _mm512_loadu_ps(x + k), b = _mm512_loadu_ps(x + k + 16);
        const __m512 pa = _mm512_permutex2var_ps(a, lo, b), pb = _mm512_permutex2var_ps(a, hi, b);
        _mm512_storeu_si512(xb + k, (__m512i)_mm512_cvtne2ps_pbh(pb, pa));
    }
}

/* The 4 chunks of 64 bytes at c (each [output k][4 bytes], as q8's bytes, q4's nibbles or q6k's low bits and high
 * bits), with `shift_lo` (chunks 0, 2) or `shift_hi` (chunks 1, 3) and `mask` applied to every byte -> the pair rows
 * 8 half .. 8 half + 7 of the block in q: pair row p holds, for outputs k = 0..15, the bytes of block positions 2p and
 * 2p + 1 (q + 32 p + 2 k), where chunk t's bytes are positions 16 half + 4 t .. + 3. */
AMX_FN static inline void pairs_of(const __m512i c[4], int half, int shift_lo, int shift_hi, uint8_t *q,
                                   const __m512i mask) {
    for (int t = 0; t < 4; t++) {
        const __m512i v = _mm512_and_si512(_mm512_srli_epi32(c[t], (unsigned)(t % 2 ? shift_hi : shift_lo)), mask);
        const int64_t p = 8 * half + 2 * t;
        _mm256_storeu_si256((__m256i *)(q + 32 * p), _mm512_cvtepi32_epi16(v));
        _mm256_storeu_si256((__m256i *)(q + 32 * (p + 1)), _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
    }
}

/* The block's 16 pair rows from pairs_of's bytes into out, in amx.h's pair layout: row p is bf16(q * s - m) for
 * outputs k = 0..15 at positions 2p and 2p + 1, side by side. s, m: per output, one value for pair rows 0-3 and 8-11
 * (positions 0-7 and 16-23) and one for 4-7 and 12-15 (8-15 and 24-31): sa, ma and sb, mb (16 lanes, one an output);
 * the formats with one scale per block pass the same twice. */
AMX_FN static inline void put_pairs(const uint8_t *q, __m512 sa, __m512 ma, __m512 sb, __m512 mb, uint16_t *out) {
    const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    const __m512 s[2][2] = {{_mm512_permutexvar_ps(lo, sa), _mm512_permutexvar_ps(hi, sa)},
                            {_mm512_permutexvar_ps(lo, sb), _mm512_permutexvar_ps(hi, sb)}};
    const __m512 m[2][2] = {{_mm512_permutexvar_ps(lo, ma), _mm512_permutexvar_ps(hi, ma)},
                            {_mm512_permutexvar_ps(lo, mb), _mm512_permutexvar_ps(hi, mb)}};
    for (int p = 0; p < 16; p++) {
        const int w = (p / 4) % 2; /* which scale */
        const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * p))));
        const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * p + 16))));
        _mm512_storeu_si512(out + 32 * p, (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmsub_ps(b, s[w][1], m[w][1]),
                                                                       _mm512_fmsub_ps(a, s[w][0], m[w][0])));
    }
}

/* Group g's 16 rows of a q-format matrix, all `in` inputs, into out in the pair layout (in / 2 rows of 32 bf16). */
AMX_FN static void dequant_group(int fmt, const uint8_t *W, const float *S, const float *M, int64_t in, uint16_t *out) {
    const int64_t nb = in / QB;
    const __m512i m4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(3), all = _mm512_set1_epi8(-1);
    uint8_t q[16 * 32] __attribute__((aligned(64)));
    for (int64_t b = 0; b < nb; b++) {
        __m512i c[4];
        __m512 sa, ma, sb, mb;
        if (fmt == FMT_Q8) { /* [t < 8][k][e]: natural order, t < 4 the first 16 inputs */
            const uint8_t *p = W + b * chunk_bytes(fmt);
            for (int h = 0; h < 2; h++) {
                for (int t = 0; t < 4; t++) c[t] = _mm512_loadu_si512(p + 256 * h + 64 * t);
                pairs_of(c, h, 0, 0, q, all);
            }
            sa = sb = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + SCALES_AT(fmt))));
            ma = mb = _mm512_mul_ps(sa, _mm512_set1_ps(128.0f));
        } else {
            const int64_t S_ = b / BPS, j = b % BPS; /* super-block, block in it (k-formats) */
            const uint8_t *p = fmt == FMT_Q4 ? W + b * chunk_bytes(fmt) : W + S_ * chunk_bytes(fmt) + j * 256;
            for (int t = 0; t < 4; t++) c[t] = _mm512_loadu_si512(p + 64 * t);
            pairs_of(c, 0, 0, 0, q, m4);
            pairs_of(c, 1, 4, 4, q, m4);
            if (fmt == FMT_Q6K) { /* high 2 bits: [p < 2][k][e], input 16p + 4j + e at bits 2j; chunk c is p = c / 2,
                                     j = 2 (c % 2) for the low-nibble half, + 1 for the high one */
                const uint8_t *hb = W + S_ * 3328 + 2048 + j * 128;
                const __m512i h0 = _mm512_loadu_si512(hb), h1 = _mm512_loadu_si512(hb + 64);
                const __m512i hc[4] = {h0, h0, h1, h1};
                uint8_t hq[16 * 32] __attribute__((aligned(64)));
                pairs_of(hc, 0, 0, 4, hq, m2);
                pairs_of(hc, 1, 2, 6, hq, m2);
                for (int t = 0; t < 16 * 32; t += 64)
                    _mm512_store_si512(q + t, _mm512_or_si512(_mm512_load_si512(q + t),
                                                              _mm512_slli_epi16(_mm512_load_si512(hq + t), 4)));
            }
            if (fmt == FMT_Q4) {
                sa = sb = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + SCALES_AT(fmt))));
                ma = mb = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + SCALES_AT(fmt) + 32)));
            } else if (fmt == FMT_Q4K) {
                const uint8_t *scm = W + S_ * 2304 + 2048;
                sa = sb = _mm512_mul_ps(_mm512_loadu_ps(S + S_ * 16), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                                          _mm_loadu_si128((const __m128i *)(scm + j * 16)))));
                ma = mb = _mm512_mul_ps(_mm512_loadu_ps(M + S_ * 16), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                                          _mm_loadu_si128((const __m128i *)(scm + 128 + j * 16)))));
            } else { /* positions 0-7 and 16-23 are sub-block 2j, 8-15 and 24-31 sub-block 2j + 1 */
                const int8_t *sc = (const int8_t *)(W + S_ * 3328 + 3072);
                const __m512 d = _mm512_loadu_ps(S + S_ * 16);
                sa = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + 2 * j * 16)))));
                sb = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + (2 * j + 1) * 16)))));
                ma = _mm512_mul_ps(sa, _mm512_set1_ps(32.0f)), mb = _mm512_mul_ps(sb, _mm512_set1_ps(32.0f));
            }
        }
        put_pairs(q, sa, ma, sb, mb, out + b * QB * 16);
    }
}

/* qgemm's ISA_AMX path (in % 32 == 0). Returns 0, or 2 when out of memory. */
AMX_FN static int qgemm_amx(int fmt, const float *x, const uint8_t *W, const float *S, const float *M, const float *bias,
                            float *y, int64_t ldy, int64_t n, int64_t in, int64_t out, int threads) {
    const int64_t nb = in / QB, groups = (out + G - 1) / G, units = (groups + 1) / 2;
    const int64_t wgroup = KFMT(fmt) ? nb / BPS * chunk_bytes(fmt) : nb * chunk_bytes(fmt);
    const int64_t sgroup = nb / BPS * G; /* q4k, q6k (q8, q4: S and M NULL, the scales in W) */
    uint16_t *xb = aligned_alloc(64, ((size_t)(amx_rows(n) * in) * 2 + 127) & ~(size_t)63);
    if (!xb) return 2;
    amx_round_x(x, xb, n, in, fmt == FMT_Q8 ? 0 : NIB_ORDER);
    amx_pad(xb, n, in);
    if (threads > units) threads = (int)units;
    int rc = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        uint16_t *A = aligned_alloc(64, (size_t)(2 * G * in) * 2);
        if (!A) {
#pragma omp atomic write
            rc = 2;
        } else {
            int64_t u0, u1;
            amx_share(units, &u0, &u1);
            amx_configure(n);
            for (int64_t u = u0; u < u1; u++) {
                const int gs = (int)(groups - 2 * u < 2 ? groups - 2 * u : 2);
                for (int g = 0; g < gs; g++)
                    dequant_group(fmt, W + (2 * u + g) * wgroup, S ? S + (2 * u + g) * sgroup : 0,
                                  M ? M + (2 * u + g) * sgroup : 0, in, A + g * G * in);
                amx_unit(xb, A, gs, bias, y, ldy, n, in, out, 2 * u * G);
            }
            _tile_release();
            free(A);
        }
    }
    free(xb);
    return rc;
}

/* 1 when the CPU runs `isa` (ISA_AVX2 needs AVX2; ISA_VNNI512 needs AVX512F/BW/VL and AVX512-VNNI; ISA_AMX, the
 * prefill path, AMX-BF16 with AVX512-BF16 and the tiles granted by Linux). */
int qgemm_supported(int isa) {
    __builtin_cpu_init();
    if (isa == ISA_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    if (isa == ISA_VNNI512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    if (isa == ISA_AMX)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512bf16") && amx_cpu() && amx_permitted();
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

/* x [n, in] fp32, W/S/M packed as above (S and M NULL for q8 and q4, M for q6k), bias [out] fp32 or NULL,
 * y [n, out] fp32 with row stride ldy (>= out: a part of a wider output); isa ISA_AVX2, ISA_VNNI512, or ISA_AMX
 * (the prefill path, `in` a multiple of 32). q4k and q6k need `in` a multiple of 256.
 * Returns 0, or 1 for an unsupported format, shape or ISA, 2 when out of memory. */
int qgemm(int fmt, int isa, const float *x, const uint8_t *W, const float *S, const float *M, const float *bias,
          float *y, int64_t ldy, int64_t n, int64_t in, int64_t out, int threads) {
    if (isa == ISA_AMX) {
        if (!qgemm_supported(isa) || in % QB || (KFMT(fmt) && in % (BPS * QB)) || !tiles_for(fmt, ISA_AVX2)) return 1;
        return qgemm_amx(fmt, x, W, S, M, bias, y, ldy, n, in, out, threads);
    }
    const tile_fn *tiles = tiles_for(fmt, isa);
    if (!tiles || !qgemm_supported(isa) || (KFMT(fmt) && in % (BPS * QB))) return 1;
    const int64_t nb = (in + QB - 1) / QB, groups = (out + G - 1) / G, units = (groups + UNIT - 1) / UNIT;
    const int64_t ns = KFMT(fmt) ? nb / BPS : nb; /* activation scales a row */
    const int64_t wgroup = KFMT(fmt) ? nb / BPS * chunk_bytes(fmt) : nb * chunk_bytes(fmt); /* bytes a group */
    const int64_t sgroup = nb / BPS * G; /* scales a group: q4k, q6k (q8, q4: S, M NULL, the scales in W) */
    int8_t *xq = malloc((size_t)(n * nb * QB) + 64);
    float *dx = malloc((size_t)(n * ns) * sizeof(float) + 64), *dxs = malloc((size_t)(n * nb) * sizeof(float) + 64);
    int32_t *sx = malloc((size_t)(n * nb) * sizeof(int32_t) + 64);
    int16_t *bs = malloc((size_t)(n * nb) * 2 * sizeof(int16_t) + 64);
    if (!xq || !dx || !dxs || !sx || !bs) {
        free(xq); free(dx); free(dxs); free(sx); free(bs);
        return 2;
    }
    quantize_rows(fmt, x, n, in, nb, ns, xq, dx, sx, dxs, bs);
    acts a = {xq, dx, sx, dxs, bs, nb, ns};
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
                tiles[R](W + g * wgroup, S ? S + g * sgroup : 0, M ? M + g * sgroup : 0, a, i0,
                         y + i0 * ldy + g * G, ldy, bias ? bias + g * G : 0, valid);
            }
        }
    }
    free(xq); free(dx); free(dxs); free(sx); free(bs);
    return 0;
}
