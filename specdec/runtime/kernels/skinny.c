/* Skinny GEMM with bf16 weights: y[n, out] = x[n, in] . W[out, in]^T (+ bias), fp32 in and out.
 * Two instruction sets, chosen per call (`skinny_bf16(isa, ...)`; kernels/__init__.py picks one per model):
 * AVX2 + FMA (below) and AVX512-BF16 (further down, its own comment). Each keeps its own fixed order.
 *
 * AVX2: W is stored in bf16 (2 bytes per weight, half of fp32). Sixteen weights at a time are loaded in one
 * 256-bit load and widened to fp32 in registers without a shuffle: a bf16 is the top half of an fp32,
 * so the even-indexed weights (the low half of each 32-bit word) are `word << 16` and the odd-indexed
 * ones are `word & 0xffff0000`. x is copied once per call into the matching order (per block of 16
 * inputs: the 8 even ones, then the 8 odd ones), so the FMAs line up.
 *
 * Built for small n (a decode step, a speculative verify over a few positions). The output dimension
 * is cut into groups of GROUP outputs, 4 groups per unit of work (UNIT) handed out to the threads; each
 * block of W is streamed from memory once for up to CHUNK rows of x (larger n: CHUNK rows at a time).
 * Within a group a register tile covers O outputs x R rows, R <= ROWS = 3 rows per pass (O = 8, 4, 3
 * for R = 1, 2, 3: 8 or 9 independent accumulators, enough to hide the FMA latency), and on the first
 * row pass over a group each tile prefetches the weights of the tile after it, so DRAM reads overlap
 * the arithmetic instead of alternating with it. Later passes find the group's weights in cache.
 * Measured on a 2-core Zen 3 against 8-wide widening with 2x4 tiles (median of 11, interleaved): 15%
 * faster at n = 1, 35% at n = 3, 25% at n = 4-8, 20% at n = 64 (prefill).
 *
 * Order-invariant sums: every y[i, o] is computed by the same sequence of floating-point
 * operations whatever n is, whichever row i it sits in, whichever tile covers it and whichever
 * thread runs it:
 *   acc (8 lanes) = 0;
 *   for each full block of 16 inputs k .. k+15, in order:
 *     acc = fma(w_even, x_even, acc); acc = fma(w_odd, x_odd, acc);
 *     (lane j of w_even / x_even holds input k + 2j, of w_odd / x_odd input k + 2j + 1)
 *   s = hsum(acc) in a fixed tree; for each leftover input (in % 16 of them), in order: s = fma(w, x, s);
 *   y = s + bias (when there is a bias).
 * So a forward over n positions gives bit-identical results to n single-position forwards.
 * Compile with -ffp-contract=off (no contraction beyond the explicit FMAs), never -ffast-math.
 */
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "amx.h"

#define GROUP 24  /* outputs per group: a multiple of every tile width below */
#define ROWS 3    /* rows of x per pass over a group: 3x3 tiles measured fastest (2x4: 25% slower) */
#define CHUNK 15  /* rows of x per pass over the groups of a block (a multiple of ROWS) */
#define MIN_WORK (1 << 17) /* weights per thread, at least */

/* The one reduction order used for every output element. */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* O outputs x R rows. W points at the first of the O weight rows, x at the first of the R input rows
 * (already in the even/odd order), y at y[row0, out0]; ldy = out. With pf, prefetch the next O weight
 * rows (the next tile) while streaming these. O, R and pf are compile-time constants at every call. */
static inline __attribute__((always_inline)) void tile(const uint16_t *restrict W, const float *restrict x,
                                                       float *restrict y, const float *restrict bias,
                                                       int64_t in, int64_t ldy, const int O, const int R,
                                                       const int pf) {
    __m256 acc[8][3];
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int a = 0; a < O; a++)
        for (int r = 0; r < R; r++) acc[a][r] = _mm256_setzero_ps();
    const int64_t k16 = in & ~(int64_t)15;
    for (int64_t k = 0; k < k16; k += 16) {
        __m256i w[8];
        for (int a = 0; a < O; a++) {
            if (pf) _mm_prefetch((const char *)(W + (O + a) * in + k), _MM_HINT_T0);
            w[a] = _mm256_loadu_si256((const __m256i *)(W + a * in + k));
        }
        for (int a = 0; a < O; a++) {
            __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(w[a], 16));
            for (int r = 0; r < R; r++)
                acc[a][r] = _mm256_fmadd_ps(e, _mm256_loadu_ps(x + r * in + k), acc[a][r]);
        }
        for (int a = 0; a < O; a++) {
            __m256 od = _mm256_castsi256_ps(_mm256_and_si256(w[a], hi));
            for (int r = 0; r < R; r++)
                acc[a][r] = _mm256_fmadd_ps(od, _mm256_loadu_ps(x + r * in + k + 8), acc[a][r]);
        }
    }
    for (int a = 0; a < O; a++)
        for (int r = 0; r < R; r++) {
            float s = hsum(acc[a][r]);
            for (int64_t k = k16; k < in; k++) s = fmaf(bf16_to_f32(W[a * in + k]), x[r * in + k], s);
            if (bias) s = s + bias[a];
            y[r * ldy + a] = s;
        }
}

#define TILE_FN(NAME, O, R, PF)                                                                       \
    static void NAME(const uint16_t *W, const float *x, float *y, const float *bias, int64_t in,      \
                     int64_t ldy) {                                                                   \
        tile(W, x, y, bias, in, ldy, O, R, PF);                                                       \
    }
TILE_FN(tile_8x1_pf, 8, 1, 1)
TILE_FN(tile_4x2_pf, 4, 2, 1)
TILE_FN(tile_3x3_pf, 3, 3, 1)
TILE_FN(tile_8x1, 8, 1, 0)
TILE_FN(tile_4x2, 4, 2, 0)
TILE_FN(tile_3x3, 3, 3, 0)
TILE_FN(tile_1x1, 1, 1, 0)
TILE_FN(tile_1x2, 1, 2, 0)
TILE_FN(tile_1x3, 1, 3, 0)

typedef void (*tile_fn)(const uint16_t *, const float *, float *, const float *, int64_t, int64_t);

/* Outputs [o0, o0 + g) (g <= GROUP) for rows [i0, i0 + m) (m <= CHUNK), ROWS rows per pass. */
static void group(const uint16_t *W, const float *x, float *y, const float *bias, int64_t in, int64_t out,
                  int64_t o0, int64_t g, int64_t i0, int64_t m) {
    static const tile_fn first[ROWS + 1] = {0, tile_8x1_pf, tile_4x2_pf, tile_3x3_pf};
    static const tile_fn again[ROWS + 1] = {0, tile_8x1, tile_4x2, tile_3x3};
    static const int width[ROWS + 1] = {0, 8, 4, 3};
    static const tile_fn single[ROWS + 1] = {0, tile_1x1, tile_1x2, tile_1x3};
    for (int64_t i = i0; i < i0 + m; i += ROWS) {
        int R = (int)(i0 + m - i < ROWS ? i0 + m - i : ROWS);
        const tile_fn *full = i == i0 ? first : again; /* later passes find W in cache */
        const float *xr = x + i * in;
        float *yr = y + i * out;
        int64_t o = o0;
        for (; o + width[R] <= o0 + g; o += width[R])
            full[R](W + o * in, xr, yr + o, bias ? bias + o : 0, in, out);
        for (; o < o0 + g; o++) single[R](W + o * in, xr, yr + o, bias ? bias + o : 0, in, out);
    }
}

/* Output groups [g0, g1) for all n rows, CHUNK rows per pass over those groups' weights. */
static void run_block(const uint16_t *W, const float *x, float *y, const float *bias, int64_t n, int64_t in,
                      int64_t out, int64_t g0, int64_t g1) {
    for (int64_t i0 = 0; i0 < n; i0 += CHUNK) {
        int64_t m = n - i0 < CHUNK ? n - i0 : CHUNK;
        for (int64_t gi = g0; gi < g1; gi++) {
            int64_t o0 = gi * GROUP;
            int64_t g = out - o0 < GROUP ? out - o0 : GROUP;
            group(W, x, y, bias, in, out, o0, g, i0, m);
        }
    }
}

/* x [n, in] into the kernel's order: per full block of 16 inputs the 8 even ones then the 8 odd
 * ones; the leftover in % 16 inputs as they are. */
static void permute_x(const float *x, float *xp, int64_t n, int64_t in) {
    const int64_t k16 = in & ~(int64_t)15;
    for (int64_t i = 0; i < n; i++) {
        const float *s = x + i * in;
        float *d = xp + i * in;
        for (int64_t k = 0; k < k16; k += 16) {
            __m256 a = _mm256_loadu_ps(s + k), b = _mm256_loadu_ps(s + k + 8);
            /* shuffle_ps gives [a0 a2 b0 b2 | a4 a6 b4 b6]; swapping the middle 64-bit pairs orders it */
            __m256d ev = _mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88));
            __m256d od = _mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD));
            _mm256_storeu_ps(d + k, _mm256_castpd_ps(_mm256_permute4x64_pd(ev, 0xD8)));
            _mm256_storeu_ps(d + k + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(od, 0xD8)));
        }
        for (int64_t k = k16; k < in; k++) d[k] = s[k];
    }
}

/* ---- AVX512-BF16: vdpbf16ps on bf16 x and W in pairs, one output per lane ---------------------------
 * W is repacked once, when the model loads (kernels.pack_bf16): [out / 16][in / 2][16][2],
 * so one 64-byte load holds, for 16 consecutive outputs, one pair of inputs (2p, 2p + 1) each. x is rounded to
 * bf16 per element (round to nearest even, `vcvtneps2bf16`: a row's bf16 values depend only on that row) and
 * laid out per chunk of up to 16 rows as [pair p][row] 32-bit words, so a pass's rows for one pair sit side
 * by side. `vdpbf16ps(acc, w, broadcast(x pair))` then adds output lane j's two products to lane j's
 * accumulator: every lane is one y[i, o], and no horizontal sums are needed (the previous layout, one weight
 * row per 64-byte load, summed 16 lanes per output at the end of every tile: at in = 576 that epilogue cost a
 * third of the tile's time). A register tile covers 3 groups of 16 outputs x up to 8 rows (24 accumulators,
 * 3 weight registers, 1 broadcast), or one group x 9 to 16 rows (16 accumulators), so a chunk of up to 16 rows
 * takes each weight from memory once, in one pass; in L1 every tile shape runs at the core's `vdpbf16ps` peak
 * (112-118 of 114 GMAC/s nominal). Chunks past the first find the tile's weights in L2. A tile of 8 rows or more
 * prefetches its weights 4 KB ahead; units of one tile (of three at n <= 4, where the weights' stream sets the
 * time) go to the threads in runs of consecutive units.
 * Measured on a 2-core Zen 4 (family 25 model 17), 2 threads, weights from memory, against the previous layout
 * (benchmarks/kernel/kernel_ab.py, medians of interleaved sweeps; benchmarks/s17/ab-*.txt): SmolLM2-135M's
 * shapes n = 1 / 4 / 8 / 16 / 64 0.69 / 0.65 / 0.61 / 0.78 / 0.81 of its time, Qwen2.5-Coder-1.5B's n = 1 / 4 /
 * 8 / 16 0.85 / 0.76 / 0.69 / 0.71 (its n = 8 now 1.19 of n = 1, was 1.46). Session 25 (same CPU class), the
 * one-pass 16-row tile, the prefetch ahead and units of one tile against session 17's passes of 8 rows (which
 * prefetched the next tile), whole forwards at context 256 (benchmarks/kernel/step_ab.py, runs in benchmarks/s25/):
 * SmolLM2 n = 1 / 8 / 16 0.97-1.00 / 0.95-1.00 / 0.91-0.98 of the time, the 1.5B 1.00-1.02 / 0.89-0.94 / 0.86-0.87;
 * the matmuls alone, the 1.5B n = 16 0.75-0.82, SmolLM2's prefill (n = 64) 0.89-0.91.
 * Order per y[i, o], whatever n, row, tile, pass or thread:
 *   acc = 0;
 *   for each pair of inputs p = 0, 1, .., ceil(in / 2) - 1, in order (an odd in's last pair zero-padded):
 *     acc = vdpbf16ps(acc, (w[o][2p], w[o][2p + 1]), (bf16(x[2p]), bf16(x[2p + 1])));
 *   y = acc + bias (if any). */
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define GROUPS512 3 /* groups of 16 outputs per register tile */
#define ROWS512 8   /* rows at most for a tile of GROUPS512 groups */
#define CHUNK512 16 /* rows of x per chunk (one pair-packed block) */
#define PF512 64 /* pairs: how far ahead of its loads a tile prefetches its weights (4 KB per group) */

/* x [n, in] fp32 -> bf16, round to nearest even per element. */
T512 static void round_x(const float *x, uint16_t *xb, int64_t count) {
    int64_t k = 0;
    for (; k + 16 <= count; k += 16)
        _mm256_storeu_si256((__m256i *)(xb + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + k)));
    if (k < count) {
        __mmask16 m = (__mmask16)((1u << (count - k)) - 1);
        _mm256_mask_storeu_epi16(xb + k, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + k)));
    }
}

/* O groups x R rows over all pairs: Wp at the first group, xq at the first row of a chunk of R rows, y at its
 * first output of its first row. With pf the tile prefetches its weights PF512 pairs ahead of its loads into L2. */
T512 static inline __attribute__((always_inline)) void tile512(const uint16_t *restrict Wp, const int32_t *restrict xq,
                                                               float *restrict y, const float *restrict bias,
                                                               int64_t pairs, int64_t ldy, const int O, const int R,
                                                               const int pf) {
    __m512 acc[GROUPS512 * ROWS512]; /* y[r, a] in acc[a * R + r]: O * R <= 24 */
    for (int a = 0; a < O; a++)
        for (int r = 0; r < R; r++) acc[a * R + r] = _mm512_setzero_ps();
    const int64_t gs = pairs * 32; /* uint16 per group */
    for (int64_t p = 0; p < pairs; p++, Wp += 32, xq += R) {
        __m512bh w[GROUPS512];
        for (int a = 0; a < O; a++) w[a] = (__m512bh)_mm512_loadu_si512((const void *)(Wp + a * gs));
        if (pf) /* past a group's end this reaches the next group's start, the next to be streamed */
            for (int a = 0; a < O; a++) _mm_prefetch((const char *)(Wp + a * gs + 32 * PF512), _MM_HINT_T1);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32(xq[r]);
#pragma GCC unroll 3
            for (int a = 0; a < O; a++) acc[a * R + r] = _mm512_dpbf16_ps(acc[a * R + r], w[a], b);
        }
    }
    for (int a = 0; a < O; a++)
        for (int r = 0; r < R; r++) {
            __m512 v = acc[a * R + r];
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * a));
            _mm512_storeu_ps(y + r * ldy + 16 * a, v);
        }
}

/* One tile call with O, R and pf as compile-time constants: O = 1 to 3 groups of up to 8 rows, or one group of 9
 * to 16 rows (16 accumulators: each weight load serves 16 rows, so one pass streams the weights once). */
T512 static void tile512_call(int O, int R, int pf, const uint16_t *Wp, const int32_t *xq, float *y, const float *bias,
                              int64_t pairs, int64_t ldy) {
#define T(o, r)                                                                                      \
    if (O == o && R == r) {                                                                          \
        if (pf) tile512(Wp, xq, y, bias, pairs, ldy, o, r, 1);                                        \
        else tile512(Wp, xq, y, bias, pairs, ldy, o, r, 0);                                           \
        return;                                                                                      \
    }
#define TR(o) T(o, 1) T(o, 2) T(o, 3) T(o, 4) T(o, 5) T(o, 6) T(o, 7) T(o, 8)
    TR(1) TR(2) TR(3)
    T(1, 9) T(1, 10) T(1, 11) T(1, 12) T(1, 13) T(1, 14) T(1, 15) T(1, 16)
#undef TR
#undef T
    abort(); /* a shape the driver never asks for */
}

/* Outputs [o0, o1) (o0 a multiple of 16) for all n rows; xq the pair-packed chunks of x; y [n, ldy], ldy the
 * outputs rounded up to 16 (the caller's buffer when out % 16 == 0, else a padded one). Per tile of GROUPS512
 * groups, every chunk of rows in turn: a chunk of up to ROWS512 rows in one call over the tile, a larger one in
 * one call per group; the first chunk streams the tile's weights, the later ones find them in L2. With 8 rows or
 * more a tile's arithmetic paces its loads and it prefetches ahead (with fewer, the CPU's own prefetchers keep up,
 * and the instructions cost: 0.91-0.98x the 1.5B's forward at 2 and 4 positions without them, the same at 8). */
T512 static void run_block512(const uint16_t *Wp, const int32_t *xq, float *y, const float *bias, int64_t n,
                              int64_t pairs, int64_t ldy, int64_t o0, int64_t o1) {
    const int64_t g0 = o0 / 16, g1 = (o1 + 15) / 16;
    for (int64_t g = g0; g < g1; g += GROUPS512) {
        const int O = (int)(g1 - g < GROUPS512 ? g1 - g : GROUPS512);
        for (int64_t i0 = 0; i0 < n; i0 += CHUNK512) {
            const int R = (int)(n - i0 < CHUNK512 ? n - i0 : CHUNK512), pf = i0 == 0 && R >= ROWS512;
            const int32_t *xc = xq + i0 * pairs;
            if (R <= ROWS512)
                tile512_call(O, R, pf, Wp + g * pairs * 32, xc, y + i0 * ldy + 16 * g, bias ? bias + 16 * g : 0, pairs,
                             ldy);
            else
                for (int a = 0; a < O; a++)
                    tile512_call(1, R, pf, Wp + (g + a) * pairs * 32, xc, y + i0 * ldy + 16 * (g + a),
                                 bias ? bias + 16 * (g + a) : 0, pairs, ldy);
        }
    }
}

/* x [n, in] fp32 -> bf16 pairs, per chunk of CHUNK512 rows: xq[chunk first row * pairs + p * m + r] holds
 * row r's inputs 2p, 2p + 1 (round to nearest even per element; an odd in's last pair zero-padded). */
T512 static void pack_x512(const float *x, int32_t *xq, int64_t n, int64_t in) {
    const int64_t pairs = (in + 1) / 2;
    uint16_t *row = aligned_alloc(64, ((size_t)(2 * pairs) * 2 + 63) & ~(size_t)63);
    for (int64_t i = 0; i < n; i++) {
        const int64_t i0 = i - i % CHUNK512, m = n - i0 < CHUNK512 ? n - i0 : CHUNK512;
        round_x(x + i * in, row, in);
        if (in % 2) row[in] = 0;
        const int32_t *w = (const int32_t *)row;
        int32_t *d = xq + i0 * pairs + (i - i0);
        for (int64_t p = 0; p < pairs; p++) d[p * m] = w[p];
    }
    free(row);
}


/* ---- AMX-BF16: tile matrix multiplies on bf16 x and the packed bf16 W ------------------------------
 * Sapphire Rapids and later (Intel's Advanced Matrix Extensions): amx.h's tiles, x rounded to bf16 per element
 * (as the AVX512-BF16 path) as the A tiles, W in kernels.pack_bf16's layout (the AVX512-BF16 path's) as the B
 * tiles, each C tile stored straight into y. A unit of 32 outputs keeps 2 C tiles; each thread takes a
 * contiguous run of units and streams their weights in order. Order per y[i, o], whatever n, row, unit or thread:
 *   c = tdpbf16ps over the 32-input steps in order (16 pairs per step; the tile's per-element order is
 *       the hardware's, fixed, and never depends on the other rows or columns of the tile);
 *   for each leftover input k (in % 32 of them), in order: c = fmaf(w[k], bf16(x[k]), c);
 *   y = c + bias (if any).
 * So a forward over n positions gives bit-identical results to n single-position forwards. Not the same
 * bits as the AVX512-BF16 path (another order): a model keeps the path it was loaded with.
 * Measured on a 2-core Xeon (family 6 model 207), the 1.5B's shapes, 8 layers + LM head, weights from
 * memory (benchmarks/kernel/kernel_ab.py, medians of interleaved sweeps): against the AVX512-BF16 path
 * n = 1 1.03x its time, n = 8 0.63x, n = 16 0.37x, n = 64 0.20x (session 12, W's rows as the A tiles; units of
 * 64 outputs were 20% slower than 32, units of 16 the same). With x as A and the weights packed (session 20,
 * family 6 model 167, benchmarks/s20/ab-skinny-amx.txt), against session 12's tiles: SmolLM2's shapes 0.88-0.90x
 * the time at n = 1 to 16 and 0.84x at 64, the 1.5B's 0.92-0.95x and 0.90x. */
/* The AMX path of skinny_bf16: xb x rounded to bf16, amx_rows(n) rows (`amx_pad`), Wp kernels.pack_bf16's layout. */
AMX_FN static void amx_bf16(const uint16_t *xb, const uint16_t *Wp, const float *bias, float *y, int64_t n,
                            int64_t in, int64_t out, int threads) {
    const int64_t pairs = (in + 1) / 2, groups = (out + 15) / 16, units = (groups + 1) / 2;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t u0, u1;
        amx_share(units, &u0, &u1);
        amx_configure(n);
        for (int64_t u = u0; u < u1; u++)
            amx_unit(xb, Wp + 2 * u * pairs * 32, (int)(groups - 2 * u < 2 ? groups - 2 * u : 2), bias, y, out, n, in,
                     out, AMX_UNIT * u);
        _tile_release();
    }
}

/* ---- The entry point ------------------------------------------------------------------------------ */
enum { ISA_AVX2 = 1, ISA_AVX512BF16 = 2, ISA_AMX = 3 };
#define UNIT (4 * GROUP) /* outputs per unit of work handed to a thread (a multiple of every tile width) */

int skinny_supported(int isa) {
    __builtin_cpu_init();
    if (isa == ISA_AVX2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (isa == ISA_AVX512BF16)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512bf16");
    if (isa == ISA_AMX) return skinny_supported(ISA_AVX512BF16) && amx_cpu() && amx_permitted();
    return 0;
}

/* The AVX512-BF16 path: Wp as kernels.pack_bf16 lays it out. When out is not a multiple of 16, y and the bias go through
 * copies padded to whole groups (a tile stores 16 lanes). Returns 0, or 2 when out of memory. */
static int skinny512(const float *x, const uint16_t *Wp, const float *bias, float *y, int64_t n, int64_t in,
                     int64_t out, int threads) {
    /* outputs per unit of work handed to a thread: a tile, or three when the weights' stream sets the time (n <= 4:
     * a thread then streams adjacent weights for longer) */
    const int64_t unit = (n <= 4 ? 3 : 1) * GROUPS512 * 16;
    const int64_t pairs = (in + 1) / 2, ldy = (out + 15) / 16 * 16, units = (out + unit - 1) / unit;
    int32_t *xq = aligned_alloc(64, ((size_t)(n * pairs) * 4 + 63) & ~(size_t)63);
    float *yp = ldy == out ? y : malloc((size_t)(n * ldy) * sizeof(float)), *bp = 0;
    if (bias && ldy != out && (bp = calloc((size_t)ldy, sizeof(float)))) memcpy(bp, bias, (size_t)out * sizeof(float));
    if (!xq || !yp || (bias && ldy != out && !bp)) {
        free(xq); if (yp != y) free(yp); free(bp);
        return 2;
    }
    const float *b = bp ? bp : bias;
    pack_x512(x, xq, n, in);
    if (threads > units) threads = (int)units;
    if (threads <= 1) {
        run_block512(Wp, xq, yp, b, n, pairs, ldy, 0, out);
    } else {
        /* runs of consecutive units, about eight a thread: a thread streams adjacent weights, and the last runs
         * still even out the threads' finishing times (one unit at a time: 1.02-1.05x SmolLM2's forward) */
        const int run = units / (8 * threads) > 1 ? (int)(units / (8 * threads)) : 1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, run)
        for (int64_t u = 0; u < units; u++)
            run_block512(Wp, xq, yp, b, n, pairs, ldy, u * unit, (u + 1) * unit < out ? (u + 1) * unit : out);
    }
    if (yp != y)
        for (int64_t i = 0; i < n; i++) memcpy(y + i * out, yp + i * ldy, (size_t)out * sizeof(float));
    free(xq); if (yp != y) free(yp); free(bp);
    return 0;
}

/* x [n, in] fp32, W bf16 (raw uint16): [out, in] for ISA_AVX2, kernels.pack_bf16's layout for ISA_AVX512BF16 and
 * ISA_AMX; bias [out] fp32 or NULL, y [n, out] fp32; all contiguous. The outputs are cut into units
 * handed out to `threads` threads dynamically: on a loaded machine a descheduled thread then holds up one unit,
 * not half of the matrix. Which thread computes an output never changes its value.
 * Returns 0, 1 for an ISA this CPU lacks, 2 when out of memory. */
int skinny_bf16(int isa, const float *x, const uint16_t *W, const float *bias, float *y, int64_t n, int64_t in,
                int64_t out, int threads) {
    if (!skinny_supported(isa)) return 1;
    int64_t most = in * out / MIN_WORK; /* a tiny matrix is not worth waking a second thread */
    if (threads > most) threads = (int)most;
    if (threads < 1) threads = 1;
    if (isa == ISA_AVX512BF16) return skinny512(x, W, bias, y, n, in, out, threads);
    int64_t units = (out + UNIT - 1) / UNIT;
    if (threads > units) threads = (int)units;
    size_t size = (size_t)(isa == ISA_AVX2 ? n * in * sizeof(float) : amx_rows(n) * in * sizeof(uint16_t));
    void *xp = aligned_alloc(64, (size + 127) & ~(size_t)63);
    if (!xp) return 2;
    if (isa == ISA_AMX) {
        round_x(x, (uint16_t *)xp, n * in);
        amx_pad((uint16_t *)xp, n, in);
        amx_bf16((const uint16_t *)xp, W, bias, y, n, in, out, threads);
        free(xp);
        return 0;
    }
    permute_x(x, (float *)xp, n, in);
    if (threads <= 1) {
        run_block(W, (const float *)xp, y, bias, n, in, out, 0, (out + GROUP - 1) / GROUP);
    } else {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++) {
            int64_t o1 = (u + 1) * UNIT < out ? (u + 1) * UNIT : out;
            run_block(W, (const float *)xp, y, bias, n, in, out, u * UNIT / GROUP, (o1 + GROUP - 1) / GROUP);
        }
    }
    free(xp);
    return 0;
}
