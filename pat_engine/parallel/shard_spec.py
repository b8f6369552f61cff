"""How a parameter is split across tensor-parallel ranks, as pure data.

A ``ShardSpec`` answers "which rows (or columns) of the full tensor does TP
rank ``r`` of ``tp`` hold, and where do they sit in its local shard?". The
loader uses it to read a rank's shard straight from the checkpoint and the
resharder uses it to work out what each rank lacks after a layout change, so
both always agree on the canonical rank -> shard mapping.

Fused tensors (qkv, gate_up) list several components along the split dim;
each component is split on its own, then the local pieces are concatenated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Piece(NamedTuple):
    """Rows ``[start, stop)`` of the full tensor stored at ``local_start`` of the shard."""

    start: int
    stop: int
    local_start: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Component:
    """One logical block along the split dim (e.g. the K part of a fused qkv).

    ``unit``: a shard never cuts a unit (a head has ``head_dim`` rows).
    ``replicate``: when ``tp`` exceeds the number of units, ranks share units
    (KV heads with ``tp > num_kv_heads``).
    ``pad``: when ``tp`` does not divide the size, every rank holds
    ``ceil(size / tp)`` rows and the tail of the last shards is zero padding
    (vocabulary).
    """

    size: int
    unit: int = 1
    replicate: bool = False
    pad: bool = False

    def local_size(self, tp: int) -> int:
        units = self.size // self.unit
        if units % tp == 0:
            return self.size // tp
        if self.replicate and tp % units == 0:
            return self.unit
        if self.pad:
            return -(-self.size // tp)
        raise ValueError(f"cannot split {units} units of size {self.unit} over tp={tp}")

    def range_for(self, rank: int, tp: int) -> tuple[int, int]:
        """Full-tensor rows ``[start, stop)`` of this component held by ``rank`` (before padding)."""
        units = self.size // self.unit
        if units % tp == 0:
            per = self.size // tp
            return rank * per, (rank + 1) * per
        if self.replicate and tp % units == 0:
            unit_index = rank // (tp // units)
            return unit_index * self.unit, (unit_index + 1) * self.unit
        per = self.local_size(tp)
        return min(rank * per, self.size), min((rank + 1) * per, self.size)


@dataclass(frozen=True)
class ShardSpec:
    full_shape: tuple[int, ...]
    split_dim: int | None = None  # None: replicated on every rank
    components: tuple[Component, ...] = ()

    @property
    def replicated(self) -> bool:
        return self.split_dim is None

    def local_shape(self, tp: int) -> tuple[int, ...]:
        if self.split_dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.split_dim] = sum(c.local_size(tp) for c in self.components)
        return tuple(shape)

    def pieces(self, rank: int, tp: int) -> tuple[Piece, ...]:
        """Where each row range of the full tensor lands in ``rank``'s shard (along ``split_dim``)."""
        if self.split_dim is None:
            return (Piece(0, self.full_shape[0] if self.full_shape else 1, 0),)
        out: list[Piece] = []
        full_offset = local_offset = 0
        for comp in self.components:
            start, stop = comp.range_for(rank, tp)
            if stop > start:
                out.append(Piece(full_offset + start, full_offset + stop, local_offset))
            full_offset += comp.size
            local_offset += comp.local_size(tp)
        return tuple(out)


# ---- constructors for the layer kinds -------------------------------------------------


def replicated(*shape: int) -> ShardSpec:
    return ShardSpec(full_shape=tuple(shape))


def column_parallel(in_features: int, *components: Component) -> ShardSpec:
    """Weight ``[out, in]`` split on the output dim; ``components`` partition ``out``."""
    out = sum(c.size for c in components)
    return ShardSpec(full_shape=(out, in_features), split_dim=0, components=tuple(components))


def column_bias(*components: Component) -> ShardSpec:
    return ShardSpec(full_shape=(sum(c.size for c in components),), split_dim=0, components=tuple(components))


def row_parallel(out_features: int, in_features: int, unit: int = 1) -> ShardSpec:
    """Weight ``[out, in]`` split on the input dim (an all-reduce follows the matmul)."""
    return ShardSpec(full_shape=(out_features, in_features), split_dim=1, components=(Component(in_features, unit),))


def vocab_parallel(vocab_size: int, hidden_size: int) -> ShardSpec:
    """Embedding / LM head ``[vocab, hidden]`` split on the vocab dim, padded when tp does not divide it."""
    return ShardSpec(full_shape=(vocab_size, hidden_size), split_dim=0, components=(Component(vocab_size, pad=True),))
