/* AMX-BF16 tile machinery shared by skinny.c (bf16 weights), qgemm.c (quantized weights, prefill) and attention.c (bf16 caches).
 *
 * One `tdpbf16ps` multiplies a 16 x 32 bf16 tile A by a 32 x 16 tile B into a 16 x 16 fp32 tile C: 8192
 * multiply-adds. Here A is x (up to 16 positions x 32 inputs, its rows as they lie in memory, rounded to bf16) and
 * B is the weights (32 inputs x 16 outputs in the pair-interleaved order the instruction wants: one 64-byte row per
 * pair of inputs, the 16 outputs' pairs side by side; kernels.pack_bf16's layout, which skinny.c's weights are
 * packed in at load and qgemm.c dequantizes into per unit), so C[j][o] is y[j][o] and leaves the tile in one store
 * straight into y. Each C element sums its own row of A and column of B in the hardware's fixed order, never mixing
 * other rows or columns, so an output's bits do not depend on how many positions share the call. `amx_unit` runs
 * one unit of up to 32 outputs (2 C tiles sharing each A tile) over all positions, 16 at a time.
 * Linux hands out the tile registers only on request (arch_prctl ARCH_REQ_XCOMP_PERM, once per process); a
 * thread loads the tile configuration (`amx_configure`) before its units and releases the tiles after.
 * Session 12's first version had the roles the other way round (W's rows as A, x packed per call as B), so each
 * position's outputs left C in a gather: on a 2-core Xeon (family 6 model 167) the gathers were ~1.0 ms and the
 * packing of x ~0.6 ms of the 1.25 ms that 16 positions added to SmolLM2's bf16 matmuls (kernel_ab.py), and the
 * gathers 7% of the 1.5B's q4 prefill (qgemm_parts.py).
 *
 * Worked example: 40 positions, 64 inputs, 48 outputs: x is padded to 48 rows (3 chunks of 16, the last with 8
 * zero rows); units [0, 32) (2 C tiles) and [32, 48) (1 C tile); per unit and chunk 2 steps of (load A, load B per
 * tile, tdpbf16ps per tile), then each tile goes to y (the last chunk's 8 real rows through a copy).
 */
#ifndef SPECDEC_AMX_H
#define SPECDEC_AMX_H
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define AMX_FN __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define AMX_UNIT 32 /* outputs per unit: 2 C tiles of 16 */

/* This thread's contiguous run [u0, u1) of `units` units (inside a parallel region, or all of them outside one):
 * each thread streams through consecutive weight rows. */
static inline void amx_share(int64_t units, int64_t *u0, int64_t *u1) {
#ifdef _OPENMP
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int t = 0, nt = 1;
#endif
    *u0 = units * t / nt, *u1 = units * (t + 1) / nt;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* 1 once Linux lets this process use the tile registers (asked once; arch_prctl ARCH_REQ_XCOMP_PERM). */
static int amx_permitted(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}

static int amx_cpu(void) { /* CPUID.(7, 0):EDX bits 22 (AMX-BF16) and 24 (AMX-TILE); asked once (a VM traps CPUID) */
    static int state = -1;
    if (state < 0) {
        unsigned a, b, c, d;
        state = __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1) && ((d >> 24) & 1);
    }
    return state;
}

/* The bf16 rows x needs for n positions as A tiles: n up to 16 (the tiles then hold n rows), else n rounded up to a
 * multiple of 16 (`amx_pad` zeroes the rows past n). */
static inline int64_t amx_rows(int64_t n) { return n <= 16 ? n : (n + 15) / 16 * 16; }

/* Zero xb's rows n .. amx_rows(n) - 1 (in bf16 each). */
static inline void amx_pad(uint16_t *xb, int64_t n, int64_t in) {
    memset(xb + n * in, 0, (size_t)((amx_rows(n) - n) * in) * sizeof(uint16_t));
}

/* The tile configuration for a call over n positions (or query rows): the C tiles 0..3 and the A tile 4 with n rows
 * (16 when n >= 16), the B tiles 5..7 with 16 (pairs of inputs); all 64 bytes wide. */
AMX_FN static void amx_configure(int64_t n) {
    const int rows = n < 16 ? (int)n : 16;
    uint8_t cfg[64] __attribute__((aligned(64))) = {1};
    for (int t = 0; t < 8; t++) cfg[16 + 2 * t] = 64, cfg[48 + t] = t < 5 ? rows : 16;
    __asm__ volatile("" ::"r"(cfg) : "memory"); /* gcc 12 dropped the stores of a struct's fields before it */
    _tile_loadconfig(cfg);
}

/* y[i0 .. i0+m, og .. og+valid) from a C tile stored in c (16 floats a row): the leftover inputs k32 .. in-1
 * (W their group's pair rows), then the bias. */
static void amx_finish(const float *c, const uint16_t *W, const uint16_t *xb, const float *bias, float *y, int64_t ldy,
                       int64_t i0, int64_t m, int64_t og, int64_t valid, int64_t in, int64_t k32) {
    for (int64_t j = 0; j < m; j++)
        for (int64_t o = 0; o < valid; o++) {
            float v = c[16 * j + o];
            for (int64_t k = k32; k < in; k++)
                v = fmaf(bf16_to_f32(W[(k / 2 * 16 + o) * 2 + k % 2]), bf16_to_f32(xb[(i0 + j) * in + k]), v);
            if (bias) v = v + bias[og + o];
            y[(i0 + j) * ldy + og + o] = v;
        }
}

/* One unit: outputs [o0, o0 + 16 * groups) (groups <= 2) for all n positions into y (row stride ldy). xb: x in bf16,
 * amx_rows(n) rows of `in` (`amx_pad`). W: the unit's first group of 16 outputs in the
 * pair layout (pairs = ceil(in / 2) rows of 32 bf16 a group, the next group after it). The tiles cover the inputs
 * up to the last multiple of 32; the rest (none in the models here) go through scalar fmaf's after them. The
 * tiles are configured for n (`amx_configure`). */
AMX_FN static void amx_unit(const uint16_t *xb, const uint16_t *W, int groups, const float *bias, float *y, int64_t ldy,
                            int64_t n, int64_t in, int64_t out, int64_t o0) {
    const int64_t pairs = (in + 1) / 2, k32 = in & ~(int64_t)31, steps = k32 / 32, chunks = (n + 15) / 16;
    const uint16_t *B0 = W, *B1 = W + pairs * 32;
    float c[16 * 16] __attribute__((aligned(64)));
    for (int64_t ch = 0; ch < chunks; ch++) {
        const uint16_t *A = xb + 16 * ch * in;
        const int64_t m = n - 16 * ch < 16 ? n - 16 * ch : 16;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t s = 0; s < steps; s++) {
            _tile_loadd(4, A + 32 * s, in * 2);
            _tile_loadd(5, B0 + 16 * s * 32, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (groups > 1) {
                _tile_loadd(6, B1 + 16 * s * 32, 64);
                _tile_dpbf16ps(1, 4, 6);
            }
        }
        for (int g = 0; g < groups; g++) {
            const int64_t og = o0 + 16 * g, valid = out - og < 16 ? out - og : 16;
            float *dst = y + 16 * ch * ldy + og;
            if (valid == 16 && k32 == in && (m == 16 || n < 16)) { /* the tile holds exactly the m rows: into y */
                if (g == 0) _tile_stored(0, dst, ldy * 4);
                else _tile_stored(1, dst, ldy * 4);
                if (bias) {
                    const __m512 bv = _mm512_loadu_ps(bias + og);
                    for (int64_t j = 0; j < m; j++)
                        _mm512_storeu_ps(dst + j * ldy, _mm512_add_ps(_mm512_loadu_ps(dst + j * ldy), bv));
                }
            } else {
                if (g == 0) _tile_stored(0, c, 64);
                else _tile_stored(1, c, 64);
                amx_finish(c, g ? B1 : B0, xb, bias, y, ldy, 16 * ch, m, og, valid, in, k32);
            }
        }
    }
}

#endif
