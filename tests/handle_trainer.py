"""A stand-in trainer process for the by-handle weight sync (``pat_engine.model.weight_handles``).

Run as a script: ``python handle_trainer.py CHECKPOINT BUCKET_BYTES``. It loads the checkpoint's
tensors (what an optimiser step leaves in a trainer), then writes one payload per bucket to stdout
(8-byte big-endian length, then the bytes) and waits for a line on stdin before it goes on, so a
bucket's memory lives until the engine has taken it. A zero length ends the stream. It is not a
child of the engine's driver: its multiprocessing authkey differs, as a Ray trainer's would.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Iterator


def main(checkpoint: str, bucket_bytes: int) -> None:
    from safetensors.torch import load_file

    from pat_engine.model.weight_handles import serialize_buckets

    weights = load_file(str(Path(checkpoint) / "model.safetensors"))
    out = sys.stdout.buffer
    for payload in serialize_buckets(weights.items(), bucket_bytes):
        out.write(struct.pack(">Q", len(payload)) + payload)
        out.flush()
        if not sys.stdin.readline():
            return  # the engine side went away
    out.write(struct.pack(">Q", 0))
    out.flush()


def payloads(proc) -> Iterator[bytes]:  # used by the tests, which start ``proc``
    """Read the trainer's payloads; asking for the next one tells the trainer the last one was taken."""
    first = True
    while True:
        if not first:
            proc.stdin.write(b"next\n")
            proc.stdin.flush()
        first = False
        (size,) = struct.unpack(">Q", proc.stdout.read(8))
        if size == 0:
            return
        yield proc.stdout.read(size)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
