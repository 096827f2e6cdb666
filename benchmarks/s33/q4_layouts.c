/* Does the weights' layout or the threading limit a q4 (Q4_1-style) one-row matvec streaming from memory?
 * SmolLM2's layer shapes in a forward's order (30 x: 960x576, 576x576, 3072x576, 576x1536; 80 MB, over the 32 MB
 * L3), 2 threads, the arithmetic of qgemm.c's tile512 at R = 1 on constant data. Layouts:
 *   A: nibbles [group][block][256 B], scales and mins fp32 in arrays of their own (today's packed layout);
 *   B: per group and block one 384 B chunk: the nibbles, then 16 fp32 scales and 16 fp32 mins;
 *   C: the same with fp16 scales and mins (320 B; a GGUF's Q4_1 holds them in fp16, so it would be lossless there).
 * Threading, on layout A: one parallel region over all matrices with a barrier after each (against qgemm's fork a
 * call), and the same passing over a unit's 4 groups together (the activations' broadcasts shared). Build and run:
 *   gcc -O3 -march=native -fopenmp benchmarks/s33/q4_layouts.c -o /tmp/q4_layouts && /tmp/q4_layouts */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define G 16
#define QB 32
#define PF 16
typedef struct { int out, in; uint8_t *w; float *s, *m; } mat;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512fp16,f16c")))
static void group(int lay, const mat *M, int g, const int8_t *xq, const float *dx, const float *dxs, float *y) {
    const int nb = M->in / QB;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc = _mm512_setzero_ps();
    const int per = lay == 0 ? 256 : lay == 1 ? 384 : 320;
    const uint8_t *W = M->w + (size_t)g * nb * per;
    for (int b = 0; b < nb; b++) {
        const uint8_t *c = W + b * per;
        for (int l = 0; l < per / 64; l++) _mm_prefetch((const char *)(c + PF * per + 64 * l), _MM_HINT_T0);
        if (lay == 0) {
            _mm_prefetch((const char *)(M->s + ((size_t)g * nb + b + PF) * G), _MM_HINT_T0);
            _mm_prefetch((const char *)(M->m + ((size_t)g * nb + b + PF) * G), _MM_HINT_T0);
        }
        __m512i is = _mm512_setzero_si512();
        for (int t = 0; t < 4; t++) {
            __m512i v = _mm512_loadu_si512(c + 64 * t);
            int32_t x0, x1;
            memcpy(&x0, xq + b * QB + 8 * t, 4); memcpy(&x1, xq + b * QB + 8 * t + 4, 4);
            is = _mm512_dpbusd_epi32(is, _mm512_and_si512(v, low4), _mm512_set1_epi32(x0));
            is = _mm512_dpbusd_epi32(is, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4), _mm512_set1_epi32(x1));
        }
        __m512 sc, mn;
        if (lay == 0) { sc = _mm512_loadu_ps(M->s + ((size_t)g * nb + b) * G); mn = _mm512_loadu_ps(M->m + ((size_t)g * nb + b) * G); }
        else if (lay == 1) { sc = _mm512_loadu_ps((const float *)(c + 256)); mn = _mm512_loadu_ps((const float *)(c + 320)); }
        else { sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(c + 256))); mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(c + 288))); }
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_mul_ps(sc, _mm512_set1_ps(dx[b])), _mm512_cvtepi32_ps(is)));
        acc = _mm512_sub_ps(acc, _mm512_mul_ps(mn, _mm512_set1_ps(dxs[b])));
    }
    _mm512_storeu_ps(y + g * G, acc);
}


__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static void group4(const mat *M, int g0, const int8_t *xq, const float *dx, const float *dxs, float *y) {
    const int nb = M->in / QB;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int b = 0; b < nb; b++) {
        __m512i xb[8];
        for (int t = 0; t < 8; t++) { int32_t x; memcpy(&x, xq + b * QB + 4 * t, 4); xb[t] = _mm512_set1_epi32(x); }
        const __m512 vdx = _mm512_set1_ps(dx[b]), vdxs = _mm512_set1_ps(dxs[b]);
        for (int k = 0; k < 4; k++) {
            const size_t gb = (size_t)(g0 + k) * nb + b;
            const uint8_t *c = M->w + gb * 256;
            for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(c + PF * 256 + 64 * l), _MM_HINT_T0);
            _mm_prefetch((const char *)(M->s + (gb + PF) * G), _MM_HINT_T0);
            _mm_prefetch((const char *)(M->m + (gb + PF) * G), _MM_HINT_T0);
            __m512i is = _mm512_setzero_si512();
            for (int t = 0; t < 4; t++) {
                __m512i v = _mm512_loadu_si512(c + 64 * t);
                is = _mm512_dpbusd_epi32(is, _mm512_and_si512(v, low4), xb[2 * t]);
                is = _mm512_dpbusd_epi32(is, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4), xb[2 * t + 1]);
            }
            __m512 sc = _mm512_loadu_ps(M->s + gb * G), mn = _mm512_loadu_ps(M->m + gb * G);
            acc[k] = _mm512_add_ps(acc[k], _mm512_mul_ps(_mm512_mul_ps(sc, vdx), _mm512_cvtepi32_ps(is)));
            acc[k] = _mm512_sub_ps(acc[k], _mm512_mul_ps(mn, vdxs));
        }
    }
    for (int k = 0; k < 4; k++) _mm512_storeu_ps(y + (g0 + k) * G, acc[k]);
}

int main(int argc, char **argv) {
    const int shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    const int L = 30, reps = 40;
    int8_t *xq = malloc(1536); float dx[48], dxs[48], *y = malloc(3072 * 4);
    for (int i = 0; i < 1536; i++) xq[i] = (int8_t)(rand() % 255 - 127);
    for (int i = 0; i < 48; i++) dx[i] = 0.01f, dxs[i] = 0.5f;
    mat *all[3];
    size_t bytes[3] = {0, 0, 0};
    double times[3][64];
    for (int lay = 0; lay < 3; lay++) {
        all[lay] = calloc(4 * L, sizeof(mat));
        for (int i = 0; i < 4 * L; i++) {
            mat *M = &all[lay][i];
            M->out = shapes[i % 4][0]; M->in = shapes[i % 4][1];
            size_t chunks = (size_t)(M->out / G) * (M->in / QB), per = lay == 0 ? 256 : lay == 1 ? 384 : 320;
            M->w = aligned_alloc(64, (chunks * per + PF * 384 + 127) / 64 * 64); memset(M->w, 0x37, chunks * per + PF * 384);
            M->s = aligned_alloc(64, (chunks * 64 + PF * 64 + 127) / 64 * 64); M->m = aligned_alloc(64, (chunks * 64 + PF * 64 + 127) / 64 * 64);
            for (size_t k = 0; k < chunks * 16 + PF * 16; k++) M->s[k] = 1.0f, M->m[k] = 0.5f;
            bytes[lay] += chunks * (lay == 0 ? 384 : per);
        }
    }
    double tb[2][64];
    for (int r = 0; r < reps; r++)
        for (int v = 0; v < 2; v++) { /* layout A in one parallel region: a barrier a matrix (v 0), none (v 1) */
            double t = now();
#pragma omp parallel num_threads(2)
            for (int i = 0; i < 4 * L; i++) {
                const mat *M = &all[0][i];
                const int groups = M->out / G, units = groups / 4;
                if (v == 0) {
#pragma omp for schedule(guided, 1)
                    for (int u = 0; u < units; u++)
                        for (int g = 4 * u; g < 4 * u + 4; g++) group(0, M, g, xq, dx, dxs, y);
                } else {
#pragma omp for schedule(guided, 1)
                    for (int u = 0; u < units; u++) group4(M, 4 * u, xq, dx, dxs, y);
                }
            }
            tb[v][r] = now() - t;
        }
    for (int v = 0; v < 2; v++) {
        double *ts = tb[v];
        for (int a = 0; a < reps; a++) for (int b = a + 1; b < reps; b++) if (ts[b] < ts[a]) { double x = ts[a]; ts[a] = ts[b]; ts[b] = x; }
        printf("layout A, one parallel region, %s: median %.2f ms, %.1f GB/s\n", v ? "a barrier a matrix, 4 groups a pass" : "a barrier a matrix", ts[reps / 2] * 1e3, bytes[0] / ts[reps / 2] / 1e9);
    }
    for (int r = 0; r < reps; r++)
        for (int lay = 0; lay < 3; lay++) {
            double t = now();
            for (int i = 0; i < 4 * L; i++) {
                const mat *M = &all[lay][i];
                const int groups = M->out / G, units = groups / 4;
#pragma omp parallel for num_threads(2) schedule(guided, 1)
                for (int u = 0; u < units; u++)
                    for (int g = 4 * u; g < 4 * u + 4; g++) group(lay, M, g, xq, dx, dxs, y);
            }
            times[lay][r] = now() - t;
        }
    for (int lay = 0; lay < 3; lay++) {
        double *ts = times[lay];
        for (int a = 0; a < reps; a++) for (int b = a + 1; b < reps; b++) if (ts[b] < ts[a]) { double x = ts[a]; ts[a] = ts[b]; ts[b] = x; }
        printf("layout %c (%s): %.1f MB, median %.2f ms, %.1f GB/s\n", "ABC"[lay],
               lay == 0 ? "nibbles | fp32 scales | fp32 mins, 3 streams" : lay == 1 ? "one stream, fp32" : "one stream, fp16",
               bytes[lay] / 1e6, ts[reps / 2] * 1e3, bytes[lay] / ts[reps / 2] / 1e9);
    }
    return 0;
}
