"""Exact attention's kernel alone (session 21), SmolLM2's heads (9 query, 3 KV, D = 64) after 256 cached
positions, n rows in one call on 2 threads: the fp16 cache on AVX512 (exact fp32 attention, the default before),
the bf16 cache on AMX tiles (this session's default for bf16 weights on AMX CPUs) and the bf16 cache on AVX512.
Medians of 300 calls, microseconds a layer.

    PYTHONPATH=. .venv/bin/python benchmarks/s21/attention_amx.py
"""
import torch, time
from specdec.runtime.kernels import attention
torch.set_num_threads(2)
H,Hk,D,start=9,3,64,256
def t(n, dtype, use, reps=300):
    q=torch.randn(1,H,n,D); k=torch.randn(1,Hk,start+64,D).to(dtype); v=torch.randn(1,Hk,start+64,D).to(dtype)
    rows=attention.Rows.chain(n,start)
    for _ in range(20): attention.attend(q,k,v,rows,2,use)
    ts=[]
    for _ in range(reps):
        a=time.perf_counter(); attention.attend(q,k,v,rows,2,use); ts.append(time.perf_counter()-a)
    ts.sort(); return ts[len(ts)//2]*1e6
for n in (1,4,8,16,32):
    print(n, "fp16/avx512 %.1f us" % t(n, torch.float16, "avx512"), "bf16/amx %.1f us" % t(n, torch.bfloat16, "amx"), "bf16/avx512 %.1f" % t(n, torch.bfloat16, "avx512"))
