"""The one-line summary of a batch run, shared by the batch job, the demo and the report title."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RoundCounts:
    """Rounds of a tail-batched batch run (``pat-serve batch --tail-batching``)."""

    short: int = 0
    long: int = 0
    prompts: int = 0  # lines launched fresh in a short round (each line once)
    deferred: int = 0  # of those, lines that waited for a long round
    resumed: int = 0  # deferred responses continued from their partial output (or returned as they had finished)
    failed: int = 0  # rounds that ended in an error: their lines got error records

    @property
    def rounds(self) -> int:
        return self.short + self.long + self.failed

    @property
    def deferred_fraction(self) -> float:
        return self.deferred / self.prompts if self.prompts else 0.0

    def line(self) -> str:
        failed = f", {self.failed} failed" if self.failed else ""
        return (f"{self.rounds} rounds ({self.short} short, {self.long} long{failed}), {self.deferred} of "
                f"{self.prompts} prompts deferred ({self.deferred_fraction:.0%}), {self.resumed} responses resumed")

    def to_dict(self) -> dict:
        return {**asdict(self), "rounds": self.rounds, "deferred_fraction": self.deferred_fraction}


@dataclass
class RewardCounts:
    """Rewards of a batch run (``pat-serve batch --reward``)."""

    scored: int = 0
    failed: int = 0
    wait_s: float = 0.0  # spent waiting for rewards after the last answer was generated

    def line(self) -> str:
        return f"rewards: {self.scored} scored ({self.failed} failed), {self.wait_s:.1f} s after the last token"


@dataclass
class RunSummary:
    requests: int = 0  # results written this run (errors included)
    errors: int = 0
    skipped: int = 0  # already in the output (--resume)
    prompt_tokens: int = 0
    tokens: int = 0  # generated
    wall_s: float = 0.0
    switches: list[str] = field(default_factory=list)  # "TP1xDP4->TP4xDP1 (0.41 s, migrate)" per switch made
    rounds: RoundCounts | None = None  # with --tail-batching
    rewards: RewardCounts | None = None  # with --reward

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def line(self) -> str:
        extra = f", {self.skipped} skipped" if self.skipped else ""
        sw = f"{len(self.switches)} switches" + (f" ({'; '.join(self.switches)})" if self.switches else "")
        rounds = f"; {self.rounds.line()}" if self.rounds is not None else ""
        rewards = f"; {self.rewards.line()}" if self.rewards is not None else ""
        return (f"{self.requests} requests ({self.errors} errors{extra}), {self.tokens} tokens, "
                f"{self.wall_s:.1f} s wall, {self.tokens_per_s:.1f} tokens/s, {sw}{rounds}{rewards}")

    def to_dict(self) -> dict:
        out = {**asdict(self), "tokens_per_s": self.tokens_per_s}
        out["rounds"] = self.rounds.to_dict() if self.rounds is not None else None
        out["rewards"] = asdict(self.rewards) if self.rewards is not None else None
        return out
