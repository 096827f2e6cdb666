/* qgemm.c's AVX512 q4k tile alone: one group of 16 outputs x 1536 inputs (6 super-blocks) for R = 1, 2, 4, 8 rows,
 * over `groups` groups of random weights (1: L1, 40: L2, 4000: memory), one core. Session 26 (2-core Zen 4), R = 8:
 * 2.9-3.0 ns a block-row (170-177 GMAC/s, 74-77% of vpdpbusd's peak) from L1 or L2, 3.5-3.7 ns (138-147) from memory.
 *     gcc -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fopenmp -I specdec/runtime/kernels \
 *         benchmarks/s26/qgemm_tile.c -o /tmp/qgemm_tile && /tmp/qgemm_tile 40 */
#include "qgemm.c"
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv){
  int groups = argc > 1 ? atoi(argv[1]) : 1;  /* weights = groups * 13.8 KB */
  const int64_t in = 1536, nb = in/32, ns = nb/8, n = 8;
  uint8_t *W = aligned_alloc(64, groups * ns * 2304 + 8192); for (long i=0;i<groups*ns*2304+8192;i++) W[i]=rand();
  float *S = aligned_alloc(64, (groups*ns*16+1024)*4), *M = aligned_alloc(64, (groups*ns*16+1024)*4);
  for (int i=0;i<groups*ns*16+1024;i++){S[i]=0.01f;M[i]=0.02f;}
  float *x = malloc(n*in*4); for (int i=0;i<n*in;i++) x[i]=(rand()%200-100)/50.0f;
  int8_t *xq = malloc(n*in+64); float *dx = malloc(n*ns*4+64), *dxs = malloc(n*nb*4+64); int32_t *sx = malloc(n*nb*4+64); int16_t *bs = malloc(n*nb*4+64);
  quantize_rows(FMT_Q4K, x, n, in, nb, ns, xq, dx, sx, dxs, bs);
  acts a = {xq, dx, sx, dxs, bs, nb, ns};
  float y[8*16*64];
  for (int R = 1; R <= 8; R *= 2) {
    long reps = 2000000 / groups / R; double best = 1e9;
    for (int t = 0; t < 5; t++) {
      double t0 = now();
      for (long i = 0; i < reps; i++) for (int g = 0; g < groups; g++) T512_Q4K[R](W + g*ns*2304, S + g*ns*16, M + g*ns*16, a, 0, y + 16*(g%64), 16*64, 0, 16);
      double dt = (now() - t0) / reps / groups; if (dt < best) best = dt;
    }
    printf("groups %d R=%d: %.1f ns per group-call, %.1f GMAC/s, %.2f ns per block-row\n", groups, R, best*1e9, R*16.0*in/best/1e9, best*1e9/(nb*R));
  }
}
