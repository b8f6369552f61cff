"""Configuration of the rollout layer: one dataclass per policy, each optional (None = off)."""

from __future__ import annotations

from dataclasses import dataclass

from pat_engine.errors import InvalidRequestError


@dataclass(frozen=True)
class TailBatchingConfig:
    """RollPacker's tail batching: short rounds over-provision, long rounds run the deferred prompts."""

    eta: float = 0.25  # short rounds launch P0*(1+eta) prompts x R0*(1+eta) responses (RollPacker's 1.25)
    resume_partials: bool = True  # resume a deferred partial output exactly when the weights did not change

    def __post_init__(self) -> None:
        if not 0 <= self.eta <= 4:
            raise InvalidRequestError(f"tail batching eta must be in [0, 4], got {self.eta!r}")


@dataclass(frozen=True)
class GroupSizingConfig:
    """SAGC: responses per prompt chosen online, responses per step fixed.

    The paper's symbols: straggler threshold kappa (max/median length ratio), target
    straggler rate delta, dual step eta, forgetting factor gamma of the Beta posteriors.
    """

    sizes: tuple[int, ...] = (4, 8, 16)
    straggler_threshold: float = 1.25  # a group straggles when max/median length exceeds this (SAGC Table 1)
    target_rate: float = 0.3  # long-run share of straggling groups the dual variable holds
    dual_step: float = 1.0
    dual_max: float = 20.0
    forgetting: float = 0.9  # discount of older observations in the Beta posteriors
    prior: tuple[float, float] = (1.0, 1.0)  # Beta(alpha, beta) before any observation
    neighbor_moves: bool = True  # move at most one size up or down per step (SAGC App. C.3)
    initial: int | None = None  # first size (default: the middle one)
    seed: int = 0  # Thompson sampling draws

    def __post_init__(self) -> None:
        sizes = tuple(sorted(set(int(s) for s in self.sizes)))
        if not sizes or sizes[0] < 1:
            raise InvalidRequestError(f"group sizes must be positive integers, got {self.sizes!r}")
        object.__setattr__(self, "sizes", sizes)
        if self.initial is not None and self.initial not in sizes:
            raise InvalidRequestError(f"initial group size {self.initial} is not one of {sizes}")
        if not 0 <= self.target_rate <= 1:
            raise InvalidRequestError(f"target straggler rate must be in [0, 1], got {self.target_rate!r}")
        if self.straggler_threshold < 1:
            raise InvalidRequestError(f"straggler threshold must be >= 1, got {self.straggler_threshold!r}")
        if not 0 < self.forgetting <= 1:
            raise InvalidRequestError(f"forgetting factor must be in (0, 1], got {self.forgetting!r}")


@dataclass(frozen=True)
class RolloutConfig:
    responses_per_step: int  # N = prompts x responses per prompt; fixed across steps (also under SAGC)
    group_size: int = 8  # responses per prompt when group sizing is off
    tail_batching: TailBatchingConfig | None = None
    group_sizing: GroupSizingConfig | None = None
    predictor_long_round_layout: bool = True  # long rounds start at the layout the predictor picks

    def __post_init__(self) -> None:
        if self.responses_per_step < 1:
            raise InvalidRequestError(f"responses_per_step must be positive, got {self.responses_per_step!r}")
        sizes = self.group_sizing.sizes if self.group_sizing else (self.group_size,)
        for g in sizes:
            if g < 1 or self.responses_per_step % g:
                raise InvalidRequestError(
                    f"responses_per_step ({self.responses_per_step}) must be a multiple of every group size, got {g}")
