"""The packed forward's cost against one request's: B requests of one new position each (the server's plain
step, every request attending over its own 250-position cache) against one request of B new positions.
Usage: python benchmarks/s11/packed_forward.py [MODEL] [DTYPE]   (medians of 15 forwards, milliseconds)"""

import statistics
import sys
import time

from specdec.api import LLM
from specdec.serving.batch import Segment, packed_forward

llm = LLM(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m", dtype=sys.argv[2] if len(sys.argv) > 2 else "auto")
model, context = llm.model, 250


def cache():
    c = model.new_cache(context + 80)
    packed_forward(model, [Segment(c, list(range(100, 100 + context)), logits=False)])
    return c


caches = [cache() for _ in range(16)]


def median_ms(segments, reps=15):
    times = []
    for _ in range(reps):
        segs = segments()
        t0 = time.perf_counter()
        packed_forward(model, segs)
        times.append(time.perf_counter() - t0)
        for s in segs:
            s.cache.length = context
    return 1000 * statistics.median(times)


one = median_ms(lambda: [Segment(caches[0], [5])])
print(f"one request, one position: {one:.2f} ms")
for b in (2, 4, 8, 16):
    packed = median_ms(lambda: [Segment(caches[i], [5]) for i in range(b)])
    single = median_ms(lambda: [Segment(caches[0], [5] * b)])
    print(f"B={b:2d}: {b} requests x 1 position {packed:6.2f} ms ({packed / one:.2f}x)   "
          f"1 request x {b} positions {single:6.2f} ms ({single / one:.2f}x)")
