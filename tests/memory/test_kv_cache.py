"""`KVCacheManager`'s page tables: the layer-by-layer layout, and the device copy kept equal at each sync."""

import random

import torch

from rimuru.kv_cache import KVCacheManager
from rimuru.memory import PageAllocator
from tests.memory.test_allocator import tiny_sizes


def test_pages_are_dealt_out_layer_by_layer():
    """Two layers, 2-token pages: 5 tokens take 3 pages a layer, asked as one block of 6 and dealt a0 a1 | b0 b1..."""
    kv = KVCacheManager(PageAllocator(tiny_sizes(), pool_bytes=4 * 256), 2, 2, max_slots=2, max_model_len=8)
    assert kv.allocate("r", 5)
    slot = kv.slot("r")
    assert kv.tables[0, slot, :3].tolist() == [0, 2, 4] and kv.tables[1, slot, :3].tolist() == [1, 3, 5]
    assert kv.tables[:, slot, 3].tolist() == [-1, -1]
    tables = kv.tables.clone()
    assert kv.allocate("r", 6) and torch.equal(kv.tables, tables)  # 3 pages of 2 tokens hold 6: nothing taken
    assert kv.allocate("r", 7) and kv.tables[:, slot, 3].tolist() == [6, 7]


def test_the_device_copy_lags_until_a_sync_then_equals_the_host_tables():
    """Random allocations and frees (slots reused) with a CPU 'device' copy: it changes only at `sync_device`, and
    each sync leaves it equal to the host tables, whatever happened to a slot since the last one."""
    rng = random.Random(0)
    kv = KVCacheManager(PageAllocator(tiny_sizes(), pool_bytes=64 * 256), 3, 2, max_slots=4, max_model_len=16,
                        device_copy=torch.device("cpu"))  # fmt: skip
    held: dict[str, int] = {}
    for step in range(200):
        before = kv.device_tables.clone()
        for _ in range(rng.randint(1, 3)):
            request = f"r{rng.randint(0, 5)}"
            if request in held and rng.random() < 0.3:
                kv.free(request)
                del held[request]
            elif kv.allocate(request, tokens := min(16, held.get(request, 0) + rng.randint(1, 5))):
                held[request] = tokens
        assert torch.equal(kv.device_tables, before)  # no copy a page allocation
        kv.sync_device()
        assert torch.equal(kv.device_tables, kv.tables), f"step {step}"
    assert held  # the walk did hold pages at the end


def test_the_scheduler_benchmark_runs_rounds_and_keeps_the_copy_equal(capsys, monkeypatch):
    """`tools/engine/scheduler.py` on the CPU (against a second copy of this version): its rounds schedule every
    running request, and the device copy it syncs each round ends equal to the host tables."""
    import json
    import sys
    from pathlib import Path

    from tools.engine import scheduler as bench_scheduler

    package = Path(__file__).resolve().parents[2] / "rimuru"
    monkeypatch.setattr(sys, "argv", ["bench_scheduler.py", "--running", "8", "--rounds", "20", "--device", "cpu",
                                      "--against", str(package / "kv_cache.py"),
                                      "--against-runner", str(package / "model_runner.py")])  # fmt: skip
    bench_scheduler.main()
    result = json.loads(capsys.readouterr().out)
    assert result["running"] == 8 and 0 < result["round_us_median"] <= result["round_us_p99"]
    assert 0 < result["against"]["round_us_median"] and result["ratio_of_medians"] > 0 < result["prepare_ratio"]
    emulator = bench_scheduler.Emulator(8, 0, torch.device("cpu"))
    for _ in range(50):
        emulator.round()
    assert torch.equal(emulator.kv_cache.device_tables, emulator.kv_cache.tables)
