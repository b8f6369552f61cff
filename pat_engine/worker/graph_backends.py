"""How a decode forward over persistent buffers becomes replayable: the ``GraphBackend`` protocol.

``CudaGraphBackend``: ``torch.cuda.CUDAGraph``. A capture first runs the forward on a side stream as
many times as its caller asks (lazy initialisations: cuBLAS workspaces, NCCL connections, Triton
compiles, must not be recorded), then records it; the graphs of one epoch share one memory pool. Only
built on CUDA. How many warm-ups a capture needs is the caller's rule (graph_capture.CaptureWarmups:
none for shapes this process has captured before).

``StandInGraphBackend``: CPU CI. Its capture runs the forward once and records the callable; a replay
runs it eagerly and copies the result into the output it kept, as a graph's static output is
rewritten. It has nothing to initialise, so it runs no warm-ups. Everything around it
(graph_capture.py: ladder, buffers, padding, copies, invalidation, the warm-up rule) then runs exactly
as with CUDA graphs, which is what the CPU tests check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch


class CapturedGraph(Protocol):
    # (B, hidden): the forward's result, rewritten by every replay; valid until the next replay of any
    # graph of the epoch (they share one pool, so another graph's intermediates may overlay it)
    output: torch.Tensor

    def replay(self) -> None: ...


@runtime_checkable
class GraphBackend(Protocol):
    """How a forward over persistent buffers becomes something replayable."""

    name: str

    def new_epoch(self) -> None:
        """Every graph was dropped or set aside: later captures start a fresh memory pool."""
        ...

    def epoch(self) -> object:
        """The current epoch's memory pool, to resume when graphs set aside with it are restored."""
        ...

    def resume_epoch(self, epoch: object) -> None:
        """Later captures join ``epoch``'s pool again (its graphs were restored)."""
        ...

    def capture(self, forward: Callable[[], torch.Tensor], warmups: int) -> CapturedGraph:
        """Run ``forward`` ``warmups`` times, then capture it.

        Args:
            forward: reads and writes only tensors that outlive the graph (the buffers, the weights,
                the KV pool); returns the hidden states.
            warmups: forwards to run first, unrecorded (a backend with nothing to initialise may skip them).
        Returns:
            The graph; ``replay`` reruns ``forward`` on whatever the buffers hold then.
        """
        ...


class _Recorded:
    def __init__(self, forward: Callable[[], torch.Tensor], output: torch.Tensor):
        self.forward, self.output = forward, output

    def replay(self) -> None:
        self.output.copy_(self.forward())  # copied out like a graph's static output


class StandInGraphBackend:
    """CPU CI: "captures" by running the forward once and recording it; replays run it eagerly."""

    name = "standin"

    def new_epoch(self) -> None:
        pass

    def epoch(self) -> object:
        return None

    def resume_epoch(self, epoch: object) -> None:
        pass

    def capture(self, forward: Callable[[], torch.Tensor], warmups: int) -> CapturedGraph:
        return _Recorded(forward, forward())


class _CudaCaptured:
    def __init__(self, graph: torch.cuda.CUDAGraph, output: torch.Tensor):
        self.graph, self.output = graph, output

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphBackend:
    """``torch.cuda.CUDAGraph``; the graphs of one epoch share one memory pool (captured largest first,
    so smaller sizes fit in what the largest reserved; one replays at a time, so sharing is safe)."""

    name = "cuda"

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.device = device
        self._pool: object | None = None
        # one warm-up stream for every capture: a new torch.cuda.Stream each time walks torch's pool of 32, and
        # cuBLAS keeps a workspace (32 MiB on an H100) for every stream it meets, ~1 GiB a rank at worst
        self._side = torch.cuda.Stream(device)

    def new_epoch(self) -> None:
        self._pool = None

    def epoch(self) -> object:
        return self._pool

    def resume_epoch(self, epoch: object) -> None:
        self._pool = epoch

    def capture(self, forward: Callable[[], torch.Tensor], warmups: int) -> CapturedGraph:
        if warmups:  # lazy initialisations must not be recorded
            side = self._side
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(warmups):
                    forward()
            torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = forward()
        if self._pool is None:
            self._pool = graph.pool()
        torch.cuda.synchronize(self.device)  # so the capture's time is measured whole
        return _CudaCaptured(graph, output)


def make_backend(name: str, device: torch.device) -> GraphBackend:
    return CudaGraphBackend(device) if name == "cuda" else StandInGraphBackend()
