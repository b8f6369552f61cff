"""The one-line summary of a batch run, shared by the batch job, the demo and the report title."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RunSummary:
    requests: int = 0  # results written this run (errors included)
    errors: int = 0
    skipped: int = 0  # already in the output (--resume)
    prompt_tokens: int = 0
    tokens: int = 0  # generated
    wall_s: float = 0.0
    switches: list[str] = field(default_factory=list)  # "TP1xDP4->TP4xDP1 (0.41 s, migrate)" per switch made

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def line(self) -> str:
        extra = f", {self.skipped} skipped" if self.skipped else ""
        sw = f"{len(self.switches)} switches" + (f" ({'; '.join(self.switches)})" if self.switches else "")
        return (f"{self.requests} requests ({self.errors} errors{extra}), {self.tokens} tokens, "
                f"{self.wall_s:.1f} s wall, {self.tokens_per_s:.1f} tokens/s, {sw}")

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}
