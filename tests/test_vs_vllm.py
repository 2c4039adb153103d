"""The side-by-side's bookkeeping: vLLM's memory read from its log, and the table marking a run over its budget."""

from tools.vs_vllm.table import run_of, table
from tools.vs_vllm.vllm_memory import vllm_memory

# vLLM 0.26's line from a 30 GiB run on the H200 (docs/benchmarks/vs-vllm.md, call L), its prefix as logged
USAGE = (
    "INFO 12-06 22:42:28 [gpu_worker.py:857] Free memory on device (139.29/139.8 GiB) on startup. Desired GPU memory "
    "utilization is (0.21459116915775847, 30.0 GiB). Actual usage is 26.67 GiB for weight, 0.6 GiB for peak "
    "activation, 0.22 GiB for non-torch memory, and 0.64 GiB for CUDAGraph memory. Replace gpu_memory_utilization "
    "config with `--kv-cache-memory=1855712256` (1.73 GiB) to fit into requested memory, or "
    "`--kv-cache-memory=119200934912` (111.01 GiB) to fully utilize gpu memory. Current kv cache memory in use is "
    "2.51 GiB."
)


def test_vllm_memory_sums_the_parts_its_log_gives():
    memory = vllm_memory("INFO loading\n" + USAGE + "\nINFO serving\n")
    assert memory == {"weights_gib": 26.67, "activation_gib": 0.6, "non_torch_gib": 0.22, "graphs_gib": 0.64,
                      "kv_gib": 2.51, "reserved_gib": 30.64}  # fmt: skip


def test_vllm_memory_takes_the_last_start_up_and_none_without_one():
    second = USAGE.replace("use is 2.51", "use is 2.89")
    assert vllm_memory(USAGE + "\n" + second)["reserved_gib"] == 31.02  # 26.67 + 0.6 + 0.22 + 0.64 + 2.89
    assert vllm_memory(second + "\n" + USAGE)["reserved_gib"] == 30.64
    assert vllm_memory("INFO GPU KV cache size: 13,712 tokens\n") is None


def _vllm_record(memory):
    return {"model": "/tmp/m/qwen1.5", "budget_gib": 30.0, "stream": ".bench/stream-200-r0.jsonl", "rate": None,
            "output_tokens_per_s": 3839.27, "ttft_s": {"mean": 5.2, "p99": 12.1}, "tpot_s": {"mean": 0.009},
            "preemptions": 240, "kv_tokens": 13712, "peak_concurrency": 66, "requests": 200, "memory": memory}  # fmt: skip


def _rimuru_record(peak_bytes):
    return {"model": "/tmp/m/qwen1.5", "engine": {"gpu_memory_budget": 30 * 2**30}, "stream": "stream-200-r0.jsonl",
            "output_tokens_per_s": 5956.3, "ttft_s": {"mean": 0.63, "p99": 1.69}, "tpot_s": {"mean": 0.0107},
            "preemptions": 0, "kv_tokens": 14864, "peak_concurrency": 170, "requests": 200,
            "peak_reserved_bytes": peak_bytes, "commit": "abc1234"}  # fmt: skip


def test_the_table_marks_the_run_that_passed_its_budget():
    runs = [run_of("vllm", _vllm_record(vllm_memory(USAGE)), "L"),
            run_of("default", _rimuru_record(32050774016), "L")]  # fmt: skip
    rows = {line.split(" | ")[1]: line for line in table({"runs": runs}).splitlines() if line.startswith("| L |")}
    assert rows["vllm"].endswith("| 30.64 (over) |")
    assert rows["rimuru"].endswith("| 29.85 |")  # 32,050,774,016 bytes
    assert "| 1.55 |" in rows["rimuru"]


def test_a_vllm_record_without_its_memory_shows_none():
    (run,) = [run_of("vllm", _vllm_record(None), "A")]
    assert run["peak_reserved_gib"] is None
    (row,) = [line for line in table({"runs": [run]}).splitlines() if line.startswith("| A |")]
    assert row.endswith("| - |")


def test_trace_layers_spans_are_measured_from_the_markers_kernels():
    """Two layers of hand-placed kernels (us): the layer period runs KV write to KV write, the attention from its
    kernel's start to its merge's end, the MoE from the sort's start to the sum's end; other kernels do not count."""
    from tools.vs_vllm.trace_layers import MARKERS, spans

    write, attention, merge, sort, total = MARKERS["rimuru"]
    layer = [(write, 0, 3), (attention, 4, 20), (merge, 25, 2), ("_gate_up_kernel", 30, 100), (sort, 28, 1),
             (total, 140, 5)]  # fmt: skip
    events = [{"name": name, "ts": start + offset, "dur": dur} for offset in (0, 300) for name, start, dur in layer]
    assert spans(sorted(events, key=lambda e: e["ts"]), MARKERS["rimuru"]) == {"layer": 300, "attention": 23,
                                                                               "moe": 117}  # fmt: skip


def test_attention_probe_rows_compute_what_the_engine_call_does():
    """`tools/engine/attention_probe.py`: its compacted pages (fresh, in table order) and its widened tables give the
    recorded call's output; a compaction that lost the table order would not."""
    import torch

    from rimuru.ops import reference
    from tests.ops.ops_cases import attention_case
    from tools.engine.attention_probe import compacted, widened

    args = attention_case([(37, 1), (5, 1), (64, 1)], 8, 2, 16, page_tokens=16, seed=1).args()
    want = reference.paged_attention(*args)
    assert torch.equal(reference.paged_attention(*compacted(args)), want)
    assert torch.equal(reference.paged_attention(*widened(args, 40)), want)
    query, pages, table, *rest = compacted(args)
    shuffled = torch.where(table >= 0, table.flip(1).sort(1, descending=True).values, table)
    assert not torch.allclose(reference.paged_attention(query, pages, shuffled, *rest), want)
