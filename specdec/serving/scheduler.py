"""The occupancy-aware scheduler (the lesson's Chapter 7): before every server step, grant each decoding
request a draft length k so that speculation spends only the idle budget the batch leaves.

A step over B decoding requests already fills B of the budget's positions (the budget: positions one
forward verifies for about the cost of one, `specdec probe`). Each request asks for the k its own
adaptive-k estimator chooses from its measured acceptance alpha and draft cost tau; a speculating
request spends k + 1 units of the headroom budget - B, the lesson's accounting
(`theory.speculation_cost`). An ask longer than the whole headroom allows is first shortened to fit
it (the request's best k within reach: its predicted speedup rises up to its chosen k). When the asks do
not fit together, headroom goes by priority rather than evenly: interactive requests before batch jobs,
and within a class the larger predicted gain first; each request gets its full k if it fits, else k = 0
for this step (`theory.allocate_headroom`).

Worked example (Ch. 7): budget 156, B = 120 -> 36 units; ten interactive requests asking k = 4 (5 units
each): seven get k = 4 (35 units), the other three and every batch job get k = 0. A small budget, as a
CPU's 3: alone (B = 1) a request asking k = 4 gets k = 1; at B = 2 nobody speculates.

Modes: auto (the above), always (every ask granted, budget ignored), never (k = 0: plain batching).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdec import theory

MODES = ("auto", "always", "never")
PRIORITIES = ("interactive", "batch")


@dataclass(frozen=True)
class Ask:
    name: str
    k: int                      # the draft length this request's estimator wants now
    priority: str = "interactive"
    gain: float = 0.0           # predicted speedup at that k: the larger first within a class


def grant(asks: list[Ask], budget: float, occupancy: float, mode: str = "auto") -> dict[str, int]:
    """k for every request this step. `occupancy`: positions the step already holds (B decoding requests,
    plus any prefill tokens scheduled beside them)."""
    if mode not in MODES:
        raise ValueError(f"speculation mode must be one of {', '.join(MODES)}, got {mode!r}")
    for a in asks:
        if a.priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {a.priority!r}")
    if mode == "never":
        return {a.name: 0 for a in asks}
    if mode == "always":
        return {a.name: a.k for a in asks}
    room = max(theory.headroom(budget, occupancy), 0.0)
    cap = max(math.floor(room + 1e-9) - 1, 0)  # the longest draft whose k + 1 units fit at all
    sessions = [theory.Session(a.name, min(a.k, cap), a.priority == "interactive", a.gain) for a in asks]
    return theory.allocate_headroom(sessions, room)

