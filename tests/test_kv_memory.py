"""A rank's memory: the CPU KV pool's default size, its lazily committed memory, and where a switch puts
the KV layers and the weight shards (the same memory, so the addresses decode graphs read stay put)."""

from __future__ import annotations

import pytest
import torch

from pat_engine.core import memory
from pat_engine.core.memory import CPU_MIN_KV_BYTES, MemoryPlan, default_cpu_kv_bytes
from pat_engine.model.arch import ModelArch
from pat_engine.parallel.layout import Layout
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model
from pat_engine.model.arch import load_model_arch
from pat_engine.worker.kv_pool import PagedKVPool, zeroed

# bench/common.PEER_SPEC: the checkpoint of the CPU peer benchmark (8 KB of KV per token in float32)
PEER = TinyModelSpec(arch="llama", vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=4,
                     num_heads=8, num_kv_heads=4, max_position=2048, seed=11)


def _arch(tmp_path, spec: TinyModelSpec) -> ModelArch:
    write_tiny_model(tmp_path / "m", spec)
    return load_model_arch(str(tmp_path / "m"))


def test_default_pool_holds_a_batch_of_64_long_requests(tmp_path, monkeypatch):
    """The benchmark's batch (64 requests of 32 + 128 tokens) fits one DP group on a machine with
    a few GiB free; the former fixed 64 MiB held 8192 tokens of it and ran it in two waves."""
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 4 << 30)
    arch, layout = _arch(tmp_path, PEER), Layout(1, 1)
    kv = default_cpu_kv_bytes(arch, torch.float32, 16, layout, max_num_seqs=256, max_len=2048)
    plan = MemoryPlan(arch, torch.float32, 16, kv, layout, device_budget=False)
    assert plan.tokens_per_group(layout) >= 64 * plan.slots_needed(32, 128)


def test_default_is_a_share_of_free_memory_bounded_by_what_the_scheduler_can_use(tmp_path, monkeypatch):
    arch = _arch(tmp_path, PEER)
    per_token = arch.kv_bytes_per_token(1, torch.float32)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 8 << 30)
    # the share: a quarter of 8 GiB over two ranks
    assert default_cpu_kv_bytes(arch, torch.float32, 16, Layout(1, 2), 256, 2048) == (8 << 30) // 4 // 2
    # the bound: 4 requests of 2048 tokens
    assert default_cpu_kv_bytes(arch, torch.float32, 16, Layout(1, 1), 4, 2048) == max(CPU_MIN_KV_BYTES, 4 * 2048 * per_token)
    # the floor, on a machine with almost nothing free
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1 << 20)
    assert default_cpu_kv_bytes(arch, torch.float32, 16, Layout(1, 1), 256, 2048) == CPU_MIN_KV_BYTES


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of the memory mapping holding ``t``'s data that are in RAM (/proc/self/smaps Rss).
    Read per mapping, not for the whole process, so memory other tests freed or kept resident
    cannot blur it."""
    address, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the tensor")


def test_a_large_lazy_cpu_layer_is_zero_and_costs_memory_only_where_written():
    layer = zeroed((2, 4096, 16, 4, 128), torch.float32, "cpu", lazy=True)  # 256 MiB
    assert resident_bytes(layer) < (32 << 20), "allocating the pool committed its memory"
    assert layer.shape == (2, 4096, 16, 4, 128) and layer.dtype == torch.float32
    layer[1, 7] = 1.5  # one block written
    assert layer.sum().item() == 1.5 * 16 * 4 * 128  # every other slot reads as zero
    assert resident_bytes(layer) < (300 << 20)


def test_a_pool_of_configured_size_is_committed_up_front():
    """An explicit ``kv_cache_bytes`` is claimed at start-up, where the user can see it."""
    layer = zeroed((2, 1024, 16, 4, 128), torch.float32, "cpu", lazy=False)  # 64 MiB
    assert resident_bytes(layer) > (48 << 20)
    assert not layer.any()


def test_pool_layers_are_zero_in_every_dtype():
    for lazy in (True, False):
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            pool = PagedKVPool(2, 300, 16, 2, 64, dtype, "cpu", lazy)  # over the lazy threshold in each dtype
            assert all(layer.dtype == dtype and not layer.any() for layer in pool.layers)
            pool.layers[0][0, 3] = 2
            assert not pool.layers[1].any()
            assert pool.regeometry(1, 600).lazy is lazy  # a switch's pool keeps the policy


def test_a_switch_layer_reuses_the_old_memory_or_frees_it_before_allocating(monkeypatch):
    """A layer is handed from the old pool to the new one: re-viewed when large enough, else freed and handed
    back to the device before the new layer is allocated. On the third co-located H100 run the old layer stayed
    referenced while a slightly larger one (TP2's freed weight bytes) was allocated beside it; on the fourth,
    at the default memory utilisation, one rank's allocator kept its freed layers cached while the rank beside
    it ran out of memory."""
    import weakref

    from pat_engine.worker import kv_pool

    old = PagedKVPool(2, 100, 16, 2, 8, torch.float32, "cpu")
    first = old.layers[0].data_ptr()
    smaller = PagedKVPool.filled_later(150, 16, 1, 8, torch.float32, "cpu")  # fewer bytes: a view of the old
    assert smaller.append_layer_from(old, 0).data_ptr() == first and old.layers[0] is None
    # and back: the view's storage is the old layer's whole memory, so the first geometry is seen there again,
    # at the same address (the decode graphs captured over it stay valid: worker/graph_capture.py)
    again = PagedKVPool.filled_later(100, 16, 2, 8, torch.float32, "cpu")
    back = again.append_layer_from(smaller, 0)
    assert back.data_ptr() == first and back.shape == again.layer_shape and back.is_contiguous()

    events = []
    real_zeroed = kv_pool.zeroed
    donor = weakref.ref(old.layers[1])

    def watching_zeroed(*args, **kw):
        events.append(("allocate", donor() is not None))
        return real_zeroed(*args, **kw)

    monkeypatch.setattr(kv_pool, "zeroed", watching_zeroed)
    monkeypatch.setattr(kv_pool, "release_cached", lambda device: events.append(("release", donor() is not None)))
    larger = PagedKVPool.filled_later(101, 16, 2, 8, torch.float32, "cpu")
    layer = larger.append_layer_from(old, 1)
    # freed, handed back to the device (a co-located rank may need it), then allocated
    assert events == [("release", False), ("allocate", False)]
    assert layer.shape == larger.layer_shape and not layer.any()
    assert old.layers == [None, None]


def test_only_the_cpu_derives_chunk_pieces_so_a_gpu_plan_counts_the_weights_alone(tmp_path):
    """The invariant mode's chunk pieces are a CPU thing (model/chunk_weights.py: on CUDA the Triton GEMM
    reads the weights in place), so a GPU plan's KV budget moves across layouts by the weights' bytes only:
    a layout with larger shards than the base's loses their extra bytes, one with smaller shards keeps the
    base's budget (its shards are written into the base's storage: worker/switch_executor.py)."""
    from pat_engine.model import chunk_weights
    from pat_engine.model.footprint import weight_bytes_per_rank
    from pat_engine.model.llama import CausalLM

    arch = load_model_arch(write_tiny_model(tmp_path / "m", TinyModelSpec(num_kv_heads=2)))
    assert chunk_weights.pack(CausalLM(arch, 1, torch.bfloat16, "cpu", row_chunks=8)) == 2 * arch.num_layers
    assert chunk_weights.pack(CausalLM(arch, 1, torch.bfloat16, "meta", row_chunks=8)) == 0  # not a CPU tensor
    plan = MemoryPlan(arch, torch.bfloat16, 16, 1 << 30, Layout(2, 1), device_budget=True)
    grown = weight_bytes_per_rank(arch, 1, torch.bfloat16) - weight_bytes_per_rank(arch, 2, torch.bfloat16)
    assert grown > 0 and (1 << 30) - plan.kv_budget(Layout(1, 2)) == grown
    low = MemoryPlan(arch, torch.bfloat16, 16, 1 << 30, Layout(1, 2), device_budget=True)
    assert low.kv_budget(Layout(2, 1)) == low.kv_budget(Layout(1, 2)) == 1 << 30


def test_a_switch_writes_a_shard_into_its_parameters_own_storage():
    """A smaller shard goes where the larger one was, and the way back finds the room; a shard that does not
    fit, or a tensor that does not start its storage, gets the fresh tensor instead."""
    from pat_engine.worker.switch_executor import into_own_storage

    full = torch.arange(12, dtype=torch.float32).view(4, 3)
    at = full.data_ptr()
    half = full[2:].clone()  # a TP2 rank's rows
    kept = into_own_storage(full, half)
    assert kept.data_ptr() == at and torch.equal(kept, half) and kept.is_contiguous() and kept.shape == (2, 3)
    whole = torch.ones(4, 3)
    back = into_own_storage(kept, whole)
    assert back.data_ptr() == at and torch.equal(back, whole)
    larger = torch.ones(5, 3)
    assert into_own_storage(back, larger) is larger
    assert into_own_storage(back[1:], half) is half  # not its storage's start: another tensor's memory
    assert into_own_storage(back, half.double()) is not back  # another dtype
