"""How the profiled decode steps draw their tokens: the profile should time the sampling the deployment
will run, since the draw is TP rank 0's alone and does not shrink with TP.

- ``greedy``: the argmax, no log-prob (the cheapest draw; what every table before this option timed);
- ``rl``: temperature 1 with each token's log-prob, as an RL rollout draws (the sampler's full pass over
  the vocabulary and its row sum every step).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Draw:
    temperature: float
    logprobs: bool


DRAWS = {"greedy": Draw(temperature=0.0, logprobs=False), "rl": Draw(temperature=1.0, logprobs=True)}
