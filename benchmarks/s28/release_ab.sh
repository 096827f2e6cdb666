#!/bin/bash
# The engine thread with and without the main thread's OpenMP pool released (specdec.runtime.threads): two
# `specdec serve --speculation never` on SmolLM2 q4, one with release_threads() turned into a no-op, measured
# alternately by `specdec loadtest --url` (HumanEvalFix, 64 tokens), 4 rounds.
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
$PY -c "import sys; from specdec.cli import main; sys.exit(main(['serve','--speculation','never','--port','8801']))" 2>/dev/null &
A=$!
$PY -c "
import sys, specdec.runtime.threads as threads
threads.release_threads = lambda: 0  # the pool kept, as before
from specdec.cli import main; sys.exit(main(['serve','--speculation','never','--port','8802']))" 2>/dev/null &
B=$!
until curl -s localhost:8801/health >/dev/null && curl -s localhost:8802/health >/dev/null; do sleep 2; done
for r in 1 2 3 4; do
  for port in 8801 8802; do
    .venv/bin/specdec loadtest --url http://127.0.0.1:$port --concurrency 1,4 --requests 8 --max-tokens 64 \
      --prompts humanevalfix --out /tmp/release-ab-$port-$r > /dev/null 2>&1
    echo "$([ $port = 8801 ] && echo released || echo kept) run $r: $(grep '^| ' /tmp/release-ab-$port-$r/loadtest.md | tail -2 | cut -d'|' -f3,6,8,9 | tr '\n' ' ')"
  done
done
kill -INT $A $B; wait
