#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define R12(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)
int main(){
  long N=50000000; double t, dt;
#define DECL(i) __m512i a##i=_mm512_set1_epi32(i);
  R12(DECL)
  __m512i u=_mm512_set1_epi8(3), x=_mm512_set1_epi8(5);
  t=now();
  for(long i=0;i<N;i++){
#define DP(i) a##i=_mm512_dpbusd_epi32(a##i,u,x);
    R12(DP)
    __asm__ volatile("" :: "v"(a0),"v"(a1),"v"(a2),"v"(a3),"v"(a4),"v"(a5),"v"(a6),"v"(a7),"v"(a8),"v"(a9),"v"(a10),"v"(a11));
  }
  dt=now()-t;
  printf("dpbusd zmm: %.2f G/s => %.1f GMAC/s\n", N*12/dt/1e9, N*12*64/dt/1e9);
  t=now();
  for(long i=0;i<N;i++){
#define ML(i) a##i=_mm512_mullo_epi32(a##i,u);
    R12(ML)
    __asm__ volatile("" :: "v"(a0),"v"(a1),"v"(a2),"v"(a3),"v"(a4),"v"(a5),"v"(a6),"v"(a7),"v"(a8),"v"(a9),"v"(a10),"v"(a11));
  }
  dt=now()-t; printf("mullo zmm: %.2f G/s\n", N*12/dt/1e9);
  t=now();
  for(long i=0;i<N;i++){
#define MIX(i) a##i=_mm512_dpbusd_epi32(a##i,u,x); if(i%4==0) a##i=_mm512_mullo_epi32(a##i,u);
    R12(MIX)
    __asm__ volatile("" :: "v"(a0),"v"(a1),"v"(a2),"v"(a3),"v"(a4),"v"(a5),"v"(a6),"v"(a7),"v"(a8),"v"(a9),"v"(a10),"v"(a11));
  }
  dt=now()-t; printf("12 dpbusd + 3 mullo: %.2f G dpbusd/s\n", N*12/dt/1e9);
  __m512 f0=_mm512_set1_ps(1),f1=f0,f2=f0,f3=f0,f4=f0,f5=f0,f6=f0,f7=f0; __m512 fm=_mm512_set1_ps(1.0000001f);
  t=now();
  for(long i=0;i<N;i++){
    f0=_mm512_fmadd_ps(f0,fm,fm);f1=_mm512_fmadd_ps(f1,fm,fm);f2=_mm512_fmadd_ps(f2,fm,fm);f3=_mm512_fmadd_ps(f3,fm,fm);
    f4=_mm512_fmadd_ps(f4,fm,fm);f5=_mm512_fmadd_ps(f5,fm,fm);f6=_mm512_fmadd_ps(f6,fm,fm);f7=_mm512_fmadd_ps(f7,fm,fm);
    __asm__ volatile("" :: "v"(f0),"v"(f1),"v"(f2),"v"(f3),"v"(f4),"v"(f5),"v"(f6),"v"(f7));
  }
  dt=now()-t; printf("fma zmm: %.2f G/s\n", N*8/dt/1e9);
  return 0;
}
