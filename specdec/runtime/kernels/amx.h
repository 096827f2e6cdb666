/* AMX-BF16 tile machinery shared by skinny.c (bf16 weights) and qgemm.c (quantized weights, prefill).
 *
 * One `tdpbf16ps` multiplies a 16 x 32 bf16 tile A (16 outputs x 32 inputs) by a 32 x 16 tile B (32 inputs x 16
 * positions, pair-interleaved) into a 16 x 16 fp32 tile C: 8192 multiply-adds. Each C element sums its own row
 * of A and column of B in the hardware's fixed order, never mixing other rows or columns, so an output's bits
 * do not depend on how many positions share the call. `amx_unit` runs one unit of up to 32 outputs (2 C
 * tiles sharing each B tile) over all positions, 16 at a time; `amx_pack_x` lays x out as B tiles.
 * Linux hands out the tile registers only on request (arch_prctl ARCH_REQ_XCOMP_PERM, once per process); a
 * thread loads the tile configuration (`amx_configure`) before its units and releases the tiles after.
 *
 * Worked example: 40 positions, 64 inputs, 48 outputs: B holds 3 chunks of 16 positions (the last one 8 real
 * and 8 zero columns) x 2 steps of 32 inputs; units [0, 32) (2 C tiles) and [32, 48) (1 C tile); per unit and
 * chunk 2 steps of (load B, load A per tile, tdpbf16ps per tile), then each position's outputs leave C.
 */
#ifndef SPECDEC_AMX_H
#define SPECDEC_AMX_H
#include <cpuid.h>
#include <immintrin.h>
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

AMX_FN static void amx_configure(void) { /* palette 1, tiles 0-7 of 16 rows x 64 bytes (the 64-byte layout of ldtilecfg) */
    uint8_t cfg[64] __attribute__((aligned(64))) = {1};
    for (int t = 0; t < 8; t++) cfg[16 + 2 * t] = 64, cfg[48 + t] = 16; /* colsb (uint16, little-endian), rows */
    __asm__ volatile("" ::"r"(cfg) : "memory"); /* gcc 12 dropped the stores of a struct's fields before it */
    _tile_loadconfig(cfg);
}

/* x rounded to bf16 (xb [n, in]) into B tiles: [chunk of 16 positions][pair p < k32 / 2][position j], a
 * 32-bit word each (inputs 2p, 2p + 1 of position 16 chunk + j; zero past n). */
static void amx_pack_x(const uint16_t *xb, uint32_t *B, int64_t n, int64_t in, int64_t k32) {
    const int64_t pairs = k32 / 2, chunks = (n + 15) / 16;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t m = n - 16 * c < 16 ? n - 16 * c : 16;
        for (int64_t p = 0; p < pairs; p++) { /* one B row: 16 words, stored in order */
            uint32_t *row = B + (c * pairs + p) * 16;
            for (int64_t j = 0; j < m; j++) memcpy(row + j, xb + (16 * c + j) * in + 2 * p, 4);
            for (int64_t j = m; j < 16; j++) row[j] = 0;
        }
    }
}

/* One unit: outputs [o0, o0 + 16 * groups) for all n rows into y (row stride ldy). A[g]: the first bf16 weight row
 * of group g (W's rows, a padded copy of a last partial group, or rows dequantized for this unit), lda its row
 * stride in bytes. W and xb are read only for inputs past the last multiple of 32 (none when in % 32 == 0). */
AMX_FN static void amx_unit(const uint16_t *const A[2], int64_t lda, int groups, const uint32_t *B, const uint16_t *W,
                          const uint16_t *xb, const float *bias, float *y, int64_t ldy, int64_t n, int64_t in,
                          int64_t out, int64_t o0) {
    const int64_t k32 = in & ~(int64_t)31, steps = k32 / 32, chunks = (n + 15) / 16;
    float c[2][16 * 16] __attribute__((aligned(64)));
    const __m512i col = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
    for (int64_t ch = 0; ch < chunks; ch++) {
        _tile_zero(0); _tile_zero(1);
        const uint32_t *Bc = B + ch * (k32 / 2) * 16;
        for (int64_t s = 0; s < steps; s++) {
            _tile_loadd(6, Bc + s * 256, 64);
            _tile_loadd(4, A[0] + 32 * s, lda);
            _tile_dpbf16ps(0, 4, 6);
            if (groups > 1) { _tile_loadd(5, A[1] + 32 * s, lda); _tile_dpbf16ps(1, 5, 6); }
        }
        _tile_stored(0, c[0], 64);
        if (groups > 1) _tile_stored(1, c[1], 64);
        const int64_t m = n - 16 * ch < 16 ? n - 16 * ch : 16;
        for (int g = 0; g < groups; g++) {
            const int64_t og = o0 + 16 * g, valid = out - og < 16 ? out - og : 16;
            if (k32 == in) { /* column j of C (a gather at col + j) is position j's 16 outputs, stored in one go */
                const __mmask16 mask = (__mmask16)((1u << valid) - 1u);
                const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + og) : _mm512_setzero_ps();
                for (int64_t j = 0; j < m; j++) {
                    __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(col, _mm512_set1_epi32((int)j)), c[g], 4);
                    if (bias) v = _mm512_add_ps(v, bv);
                    _mm512_mask_storeu_ps(y + (16 * ch + j) * ldy + og, mask, v);
                }
                continue;
            }
            for (int64_t j = 0; j < m; j++) {
                const int64_t i = 16 * ch + j;
                for (int64_t o = 0; o < valid; o++) {
                    float v = c[g][16 * o + j];
                    for (int64_t k = k32; k < in; k++)
                        v = fmaf(bf16_to_f32(W[(og + o) * in + k]), bf16_to_f32(xb[i * in + k]), v);
                    if (bias) v = v + bias[og + o];
                    y[i * ldy + og + o] = v;
                }
            }
        }
    }
}

#endif
