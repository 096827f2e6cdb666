"""Handing decoding to another thread without slowing it down: release the calling thread's OpenMP workers.

specdec's kernels and torch share one OpenMP runtime (libgomp), which keeps a pool of worker threads per thread
that has run parallel code. A server loads its model (and measures its cost curve) in the main thread, then
decodes in an engine thread: two pools. libgomp counts every pool's workers, and once they outnumber the CPUs it
stops spinning at the barriers of every parallel region and puts its workers to sleep instead (its "throttled"
spin), so each of a step's few hundred parallel regions pays a futex wake-up. Measured on a 2-vCPU AMD Zen 4,
SmolLM2 q4, 64 tokens decoded in a second thread after loading in the main one: 0.416 s, and 0.307 s once the
main thread had released its pool (0.305 s decoding in the main thread itself).

    release_threads()   # in the thread that loaded the model, before another thread takes over decoding

`specdec.LLM` does this itself after loading and after each generation.

The calling thread's pool comes back if it runs parallel code again; the other threads' pools are untouched.
"""

from __future__ import annotations

import ctypes
import re

LIBGOMP = re.compile(r"libgomp(-[0-9a-f]+)?\.so")  # libgomp.so.1, a wheel's libgomp-a34b3233.so.1; not its plugins
OMP_PAUSE_SOFT = 1  # OpenMP 5.0's omp_pause_soft: stop the threads, keep what can be restarted cheaply


_PAUSES: list = []  # each loaded libgomp's omp_pause_resource_all, found once (reading /proc/self/maps costs ~1 ms)


def _pause_functions() -> list:
    if not _PAUSES:
        try:
            with open("/proc/self/maps") as maps:
                paths = sorted({line.split()[-1] for line in maps if LIBGOMP.match(line.rstrip().rsplit("/", 1)[-1])})
        except OSError:
            return []
        for path in paths:
            try:
                pause = ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):
                continue
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            _PAUSES.append(pause)
    return _PAUSES


def release_threads() -> int:
    """Release the calling thread's OpenMP worker threads in every libgomp the process has loaded (`omp_pause_
    resource_all(omp_pause_soft)`). Returns how many runtimes took the call (1 with torch's libgomp, whether or not
    this thread had a pool; 0 where there is none: not Linux, or another OpenMP runtime). `specdec.LLM` calls it
    when it has loaded and when a generation ends, so the thread that decodes next, whichever it is, finds no
    idle pool beside its own; a new pool costs nothing measurable."""
    return sum(pause(OMP_PAUSE_SOFT) == 0 for pause in _pause_functions())
