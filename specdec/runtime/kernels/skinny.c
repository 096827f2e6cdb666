/* Skinny GEMM with bf16 weights: y[n, out] = x[n, in] . W[out, in]^T (+ bias), fp32 in and out.
 *
 * W is stored in bf16 (2 bytes per weight, half of fp32); eight weights at a time are widened to
 * fp32 in registers (zero-extend to 32 bits, shift left 16) and multiplied into fp32 AVX2 FMAs.
 * Built for small n (a decode step, a speculative verify over a few positions): the output
 * dimension is cut into blocks of BLOCK * GROUP outputs shared out among the threads, and each block
 * of W is streamed from memory once for up to CHUNK rows of x (larger n: CHUNK rows at a time).
 *
 * Order-invariant sums: every y[i, o] is computed by the same sequence of floating-point
 * operations whatever n is, whichever row i it sits in and whichever tile shape covers it:
 *   acc (8 lanes) = 0; for each full block of 8 inputs, in order: acc = fma(w, x, acc);
 *   s = hsum(acc) in a fixed tree; for each leftover input, in order: s = fma(w, x, s);
 *   y = s + bias (when there is a bias).
 * So a forward over n positions gives bit-identical results to n single-position forwards.
 * Compile with -ffp-contract=off (no contraction beyond the explicit FMAs), never -ffast-math.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define GROUP 8   /* outputs per group: the unit of work split across threads */
#define CHUNK 16  /* rows of x per pass over W */
#define BLOCK 8   /* groups per unit of work handed to a thread */
#define MIN_WORK (1 << 17) /* weights per thread, at least */

static inline __m256 load_bf16x8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The one reduction order used for every output element. */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* O outputs x R rows. W points at the first of the O weight rows, x at the first of the R input
 * rows, y at y[row0, out0]; ldy = out. O and R are compile-time constants at every call site. */
static inline __attribute__((always_inline)) void tile(const uint16_t *restrict W, const float *restrict x,
                                                       float *restrict y, const float *restrict bias,
                                                       int64_t in, int64_t ldy, const int O, const int R) {
    __m256 acc[8][8];
    for (int a = 0; a < O; a++)
        for (int r = 0; r < R; r++) acc[a][r] = _mm256_setzero_ps();
    const int64_t k8 = in & ~(int64_t)7;
    for (int64_t k = 0; k < k8; k += 8) {
        __m256 w[8];
        for (int a = 0; a < O; a++) w[a] = load_bf16x8(W + a * in + k);
        for (int r = 0; r < R; r++) {
            __m256 xv = _mm256_loadu_ps(x + r * in + k);
            for (int a = 0; a < O; a++) acc[a][r] = _mm256_fmadd_ps(w[a], xv, acc[a][r]);
        }
    }
    for (int a = 0; a < O; a++)
        for (int r = 0; r < R; r++) {
            float s = hsum(acc[a][r]);
            for (int64_t k = k8; k < in; k++) s = fmaf(bf16_to_f32(W[a * in + k]), x[r * in + k], s);
            if (bias) s = s + bias[a];
            y[r * ldy + a] = s;
        }
}

#define TILE_FN(O, R)                                                                                  \
    static void tile_##O##_##R(const uint16_t *W, const float *x, float *y, const float *bias, int64_t in, \
                               int64_t ldy) {                                                          \
        tile(W, x, y, bias, in, ldy, O, R);                                                            \
    }
TILE_FN(4, 1)
TILE_FN(4, 2)
TILE_FN(2, 3)
TILE_FN(2, 4)
TILE_FN(1, 1)
TILE_FN(1, 2)
TILE_FN(1, 3)
TILE_FN(1, 4)

typedef void (*tile_fn)(const uint16_t *, const float *, float *, const float *, int64_t, int64_t);

/* Outputs [o0, o0 + g) (g <= GROUP) for rows [i0, i0 + m) (m <= CHUNK). */
static void group(const uint16_t *W, const float *x, float *y, const float *bias, int64_t in, int64_t out,
                  int64_t o0, int64_t g, int64_t i0, int64_t m) {
    static const tile_fn full[5] = {0, tile_4_1, tile_4_2, tile_2_3, tile_2_4};
    static const int width[5] = {0, 4, 4, 2, 2};
    static const tile_fn single[5] = {0, tile_1_1, tile_1_2, tile_1_3, tile_1_4};
    for (int64_t i = i0; i < i0 + m; i += 4) {
        int R = (int)((i0 + m - i) < 4 ? (i0 + m - i) : 4);
        const float *xr = x + i * in;
        float *yr = y + i * out;
        int64_t o = o0;
        if (g == GROUP)
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

/* x [n, in] fp32, W [out, in] bf16 (raw uint16), bias [out] fp32 or NULL, y [n, out] fp32; all
 * contiguous. The output dimension is cut into blocks of BLOCK groups of GROUP outputs, handed out
 * to `threads` threads dynamically: on a loaded machine a descheduled thread then holds up one
 * block, not half of the matrix. Which thread computes an output never changes its value. */
void skinny_bf16(const float *x, const uint16_t *W, const float *bias, float *y, int64_t n, int64_t in,
                 int64_t out, int threads) {
    int64_t groups = (out + GROUP - 1) / GROUP;
    int64_t blocks = (groups + BLOCK - 1) / BLOCK;
    int64_t most = in * out / MIN_WORK; /* a tiny matrix is not worth waking a second thread */
    if (threads > most) threads = (int)most;
    if (threads > blocks) threads = (int)blocks;
    if (threads < 1) threads = 1;
    if (threads <= 1) {
        run_block(W, x, y, bias, n, in, out, 0, groups);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t g1 = (b + 1) * BLOCK < groups ? (b + 1) * BLOCK : groups;
        run_block(W, x, y, bias, n, in, out, b * BLOCK, g1);
    }
}

/* For the loader's self-check: the ABI version of this file. */
int skinny_version(void) { return 1; }
