#!/bin/bash
# Session 34: alternate two checkouts' forward_ab.py runs: bash ab.sh CODE_A:HOME_A CODE_B:HOME_B ROUNDS [args...]
# (each CODE a checkout, each HOME the SPECDEC_HOME holding the q4 cache that checkout's layout reads)
here=$(realpath "$(dirname "$0")")
a=$1 b=$2 rounds=$3
shift 3
for r in $(seq "$rounds"); do
  for pair in "$a" "$b"; do
    code=$(realpath "${pair%%:*}")
    (cd /tmp && SPECDEC_HOME="${pair#*:}" PYTHONPATH="$code" python "$here/forward_ab.py" "$@")
  done
done
