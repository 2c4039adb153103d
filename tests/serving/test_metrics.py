"""/metrics names (vLLM's, under `rimuru:`), the pool split and expert traffic; /v1/memory's time series; /version."""

import httpx
from prometheus_client import REGISTRY

from rimuru.serving.metrics import Metrics, read_expert_stats

NAMES = ["rimuru:num_requests_running", "rimuru:num_requests_waiting", "rimuru:kv_cache_usage_perc",
         "rimuru:time_to_first_token_seconds_bucket", "rimuru:time_per_output_token_seconds_bucket",
         "rimuru:e2e_request_latency_seconds_bucket", "rimuru:prompt_tokens_total", "rimuru:generation_tokens_total",
         "rimuru:num_preemptions_total", "rimuru:expert_evictions_total", "rimuru:expert_additions_total",
         "rimuru:expert_bytes_copied_total", "rimuru:expert_prefetch_hits_total", "rimuru:expert_prefetch_misses_total",
         "rimuru:expert_swaps_total", "rimuru:expert_direct_reads_total", "rimuru:offloaded_experts",
         "rimuru:adjuster_estimate"]  # fmt: skip


def test_metrics_after_traffic(server):
    before = _value(httpx.get(f"{server.url}/metrics").text, "rimuru:generation_tokens_total")
    body = {"prompt": "Hello", "max_tokens": 7, "ignore_eos": True}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
    response = httpx.get(f"{server.url}/metrics")
    text = response.text
    assert response.headers["content-type"].count("charset") == 1, response.headers["content-type"]
    for name in NAMES:
        assert f"\n{name}{{" in text, name
    for kind in ("expert", "kv", "free", "trapped"):
        assert f'rimuru:pool_pages{{kind="{kind}",model_name="tiny-qwen-moe"}}' in text
    assert _value(text, "rimuru:generation_tokens_total") == before + 7
    assert _value(text, 'rimuru:pool_pages{kind="expert"') > 0


def test_memory_series_and_version(server):
    memory = server.memory()
    series, current = memory["series"], memory["current"]
    assert len(series["t"]) >= 2 and series["t"] == sorted(series["t"])
    assert {"expert_pages", "kv_pages", "free_pages", "trapped_pages", "running", "waiting", "tokens_per_s",
            "offloaded_experts", "predicted_copy_ms", "measured_copy_ms", "compute_ms"} <= set(series)
    assert all(len(values) == len(series["t"]) for values in series.values())
    assert current["expert_pages"] > 0 and memory["pool_bytes"] > 0
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_a_registry_per_app():
    first, second = Metrics("a"), Metrics("b")  # the global registry would refuse the second set of names
    assert first.registry is not second.registry and REGISTRY.get_sample_value("rimuru:prompt_tokens_total") is None
    assert read_expert_stats(object()) == {} and read_expert_stats(type("E", (), {"expert_stats": {"evictions": 3}})()) == {"evictions": 3}


def _value(text: str, prefix: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(prefix))
    return float(line.rsplit(" ", 1)[1])


def test_the_cost_adjusters_estimates_reach_the_metrics_and_the_timeline():
    """What `Engine.expert_stats` holds under `adjuster="cost"` shows as gauges and as timeline fields."""
    from types import SimpleNamespace

    from rimuru.serving.timeline import Timeline, adjuster_state

    stats = {"offloaded_experts": 12, "swaps": 2, "direct_reads": 7, "cost_predicted_copy_ms": 0.8, "cost_measured_copy_ms": 0.6,
             "cost_compute_ms": 14.5, "cost_touch_p_mean": 0.05}  # fmt: skip
    engine = SimpleNamespace(scheduler=SimpleNamespace(running=[], waiting=[], num_preemptions=0), expert_stats=stats)
    metrics = Metrics("m")
    split = {f"{kind}_{unit}": 1 for kind in ("expert", "kv", "state", "free", "trapped") for unit in ("pages", "bytes")}
    metrics.update_engine(engine, split, 0.5)
    text = metrics.render().decode()
    assert _value(text, 'rimuru:adjuster_estimate{estimate="predicted_copy_ms"') == 0.8
    assert _value(text, 'rimuru:adjuster_estimate{estimate="compute_ms"') == 14.5
    assert _value(text, "rimuru:offloaded_experts") == 12 and _value(text, "rimuru:expert_swaps_total") == 2
    assert _value(text, "rimuru:expert_direct_reads_total") == 7
    timeline = Timeline()
    timeline.record(split | adjuster_state(stats), running=3, waiting=0)
    assert timeline.snapshot()["current"]["measured_copy_ms"] == 0.6
    assert adjuster_state({}) == dict.fromkeys(adjuster_state(stats), 0.0)
