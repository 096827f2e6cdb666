#!/bin/bash
# Session 30: alternate two checkouts' step_ab.py runs, $3 rounds (default 4): bash step_ab.sh BASE NEW [ROUNDS]
here=$(realpath "$(dirname "$0")")
for r in $(seq "${3:-4}"); do
  for code in "$1" "$2"; do
    (cd /tmp && PYTHONPATH="$code" python "$here/step_ab.py")
  done
done
