"""A remote reward model's call in the reward contract's Python form: an async function that waits
0.5-3 s (a function of the answer's tokens, so the same answer waits the same in every arm of
bench/reward_overlap.py) and returns a reward, using no CPU while it waits.

    pat-serve batch ... --reward remote_judge:judge      # with bench/ on the path
"""

import asyncio
import hashlib

WAIT_S = (0.5, 3.0)


async def judge(item) -> float:
    tokens = list(item.output.token_ids)
    u = int.from_bytes(hashlib.blake2b(repr(tokens).encode(), digest_size=4).digest(), "little") / 2**32
    await asyncio.sleep(WAIT_S[0] + (WAIT_S[1] - WAIT_S[0]) * u)
    return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)
