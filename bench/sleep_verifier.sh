#!/bin/sh
# A sandbox-like verifier in the reward contract's command form (docs/pat-serve.md): reads one answer as
# JSON on stdin, waits 0.5-3 s (a function of the answer's token ids, so the same answer waits the same in
# every arm of bench/reward_overlap.py) and prints a reward. Small C tools only: a start costs the
# engine's shared CPU about a millisecond, the rest is waiting.
ids=$(sed -n 's/.*"token_ids": *\[\([^]]*\)\].*/\1/p')
ms=$(( 500 + $(printf '%s' "$ids" | cksum | cut -d' ' -f1) % 2500 ))
sleep "$((ms / 1000)).$(printf '%03d' $((ms % 1000)))"
echo 1.0
