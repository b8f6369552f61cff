"""The toy task's verifier as a separate program, the way code and math rewards run: reads one
response as JSON on stdin (``{"token_ids": [...]}``), prints its reward on stdout.

The reward is examples/grpo_tiny.py's: the fraction of response tokens in the target set (every
fourth id from 8). ``--work N`` adds N rounds of busy arithmetic per token, standing in for running
a response's test cases (the time a real verifier takes grows with what it checks).
"""

from __future__ import annotations

import argparse
import json
import sys


def in_target(token: int) -> bool:
    return token >= 8 and (token - 8) % 4 == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=int, default=0, help="busy arithmetic rounds per response token")
    args = ap.parse_args()
    tokens = json.load(sys.stdin)["token_ids"]
    checksum = 0
    for t in tokens:  # "running the tests"
        for i in range(args.work):
            checksum = (checksum * 31 + t + i) % 1_000_003
    print(sum(in_target(t) for t in tokens) / max(len(tokens), 1))


if __name__ == "__main__":
    main()
