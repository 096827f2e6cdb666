/* The vpdpbusd (AVX512-VNNI, 64 int8 products a zmm) and vpmulld peaks of one core: 12 independent chains.
 * Session 26 (2-core Zen 4): 3.59 vpdpbusd a ns (229 GMAC/s a core), both cores at once the same; vpmulld 3.6 a ns.
 *     gcc -O2 benchmarks/s26/vnni_peak.c -o /tmp/vnni_peak && /tmp/vnni_peak */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
__attribute__((target("avx512f,avx512bw,avx512vnni"))) int main(){
  __m512i a[12]; for(int i=0;i<12;i++) a[i]=_mm512_set1_epi32(i);
  __m512i u=_mm512_set1_epi8(3), x=_mm512_set1_epi8(5);
  long N=200000000; double t=now();
  for(long i=0;i<N;i++){
    #pragma GCC unroll 12
    for(int r=0;r<12;r++) a[r]=_mm512_dpbusd_epi32(a[r],u,x);
    __asm__ volatile("" : "+v"(u));
  }
  double dt=now()-t; int s=0; for(int i=0;i<12;i++) s+=_mm512_reduce_add_epi32(a[i]);
  printf("dpbusd zmm: %.2f per ns, %.1f GMAC/s (%d)\n", N*12/dt/1e9, N*12*64/dt/1e9, s);
  __m512i m[12]; for(int i=0;i<12;i++) m[i]=_mm512_set1_epi32(i);
  t=now();
  for(long i=0;i<N/4;i++){
    #pragma GCC unroll 12
    for(int r=0;r<12;r++) m[r]=_mm512_mullo_epi32(m[r],u);
    __asm__ volatile("" : "+v"(u));
  }
  dt=now()-t; s=0; for(int i=0;i<12;i++) s+=_mm512_reduce_add_epi32(m[i]);
  printf("mullo zmm: %.2f per ns (%d)\n", N/4*12/dt/1e9, s);
}
