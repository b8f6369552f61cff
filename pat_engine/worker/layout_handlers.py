"""Control calls about the layout: a live switch, and the diagnostics of groups, pool and links."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from pat_engine.parallel.group_pool import CommGroupPool
from pat_engine.protocol import SwitchReport
from pat_engine.protocol.calls import BandwidthProbe, Stats, Switch
from pat_engine.worker.device_memory import allocator_stats
from pat_engine.worker.infer_executor import InferExecutor
from pat_engine.worker.switch_executor import SwitchExecutor


class LayoutHandlers:
    def __init__(self, rank: int, world: int, cpu_world: object, groups: CommGroupPool, executor: InferExecutor):
        self.rank, self.world, self.cpu_world = rank, world, cpu_world
        self.groups, self.executor = groups, executor
        self.switcher = SwitchExecutor(rank, cpu_world, groups)

    def switch(self, call: Switch) -> SwitchReport:
        return self.switcher.run(call.plan, self.executor)

    def stats(self, call: Stats) -> dict:
        s, ex = self.groups.stats, self.executor
        return {"group_hits": s.hits, "group_misses": s.misses, "group_seconds": s.creation_seconds,
                "layouts": list(s.created_layouts), "kv_blocks": ex.kv.num_blocks,
                "graphs": {"captured": list(ex.graphs.captured), "capturable": ex.tp.graphs_capturable,
                           **ex.graphs.stats.to_dict()},
                "device": str(ex.device), "host_staged": self.groups.host_staged,
                "p2p": self.groups.p2p_path, "collectives": ex.tp.collectives,
                "device_memory": allocator_stats(ex.device, call.release_cached)}

    def bandwidth_probe(self, call: BandwidthProbe) -> float:
        # every rank sends and receives at once, the pattern of a KV or weight redistribution
        from pat_engine.parallel.p2p import exchange

        path = call.path or self.groups.p2p_path
        if self.world == 1:
            return 0.0
        device = self.executor.device
        out = torch.ones(max(1, call.nbytes // 4), dtype=torch.float32, device=device)
        inp = torch.empty_like(out)
        best = float("inf")
        for _ in range(call.repeats):
            dist.barrier(group=self.cpu_world)
            t = time.perf_counter()
            exchange({(self.rank + 1) % self.world: out}, {(self.rank - 1) % self.world: inp}, path)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return best
