/* Session 14: what single AMX tile instructions cost on this machine (ns per instruction, 100000 in a row).
 * gcc -O2 benchmarks/s14/amx_tile_costs.c -o /tmp/amx_tile_costs && /tmp/amx_tile_costs */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
__attribute__((target("amx-tile,amx-int8,avx512f"))) int main(){
  syscall(SYS_arch_prctl, 0x1023, 18);
  uint8_t cfg[64] __attribute__((aligned(64))) = {1};
  const uint8_t colsb[8] = {64, 64, 32, 64, 32, 64, 64, 64}, rows[8] = {16, 16, 16, 8, 16, 8, 16, 16};
  for (int t = 0; t < 8; t++) cfg[16 + 2 * t] = colsb[t], cfg[48 + t] = rows[t];
  _tile_loadconfig(cfg);
  static uint8_t A[16*1536] __attribute__((aligned(64))), B[8*512] __attribute__((aligned(64)));
  static int32_t C[8][256] __attribute__((aligned(64)));
  memset(A,1,sizeof A); memset(B,1,sizeof B);
  const int N = 100000; double t;
  t=now(); for(int i=0;i<N;i++){ _tile_dpbsud(0,2,3); } printf("tdp dep chain       %.1f ns\n",(now()-t)/N*1e9);
  t=now(); for(int i=0;i<N;i++){ _tile_dpbsud(0,2,3); _tile_dpbsud(1,4,5);} printf("tdp 2 chains (per)  %.1f ns\n",(now()-t)/N/2*1e9);
  t=now(); for(int i=0;i<N;i++){ _tile_loadd(3,B+(i%8)*512,64);} printf("load B 8x64         %.1f ns\n",(now()-t)/N*1e9);
  t=now(); for(int i=0;i<N;i++){ _tile_loadd(2,A+(i%48)*32,1536);} printf("load A 16x32 s1536  %.1f ns\n",(now()-t)/N*1e9);
  t=now(); for(int i=0;i<N;i++){ _tile_stored(0,C[i%8],64);} printf("store C             %.1f ns\n",(now()-t)/N*1e9);
  t=now(); for(int i=0;i<N;i++){ _tile_zero(0);} printf("zero                %.1f ns\n",(now()-t)/N*1e9);
  t=now(); for(int i=0;i<N;i++){ int k=i%8; _tile_loadd(3,B+k*512,64); _tile_loadd(2,A+k*32,1536); _tile_zero(0); _tile_dpbsud(0,2,3); _tile_stored(0,C[k],64);} printf("block seq           %.1f ns\n",(now()-t)/N*1e9);
  t=now(); for(int i=0;i<N;i++){ int k=i%8; _tile_loadd(3,B+k*512,64); _tile_loadd(2,A+k*32,1536); _tile_dpbsud(0,2,3);} printf("block no zero/store %.1f ns\n",(now()-t)/N*1e9);
  t=now(); for(int i=0;i<N;i++){ int k=i%8; _tile_loadd(6,A+k*64,1536); _tile_loadd(7,B+k*512,64); _tile_dpbsud(0,6,7);} printf("K=64 A16x64 B16x64  %.1f ns\n",(now()-t)/N*1e9);
  _tile_release(); return 0; }
