"""Online serving benchmark, like `vllm bench serve`: a JSONL request stream replayed over HTTP with its arrival
times (Poisson), streamed completions, TTFT / TPOT / ITL (mean, median, p99) and request and token throughput.

The stream is `shared/workloads/sharegpt_synth.py`'s format, read from any path: one JSON object a line with
`prompt_token_ids`, `max_tokens` and `arrival` (seconds). Outputs are generated with EOS ignored so every request
produces exactly its `max_tokens`; `--max-model-len` cuts prompts and outputs to fit a small model's context.

    rimuru serve &                      # the tiny model on 127.0.0.1:8000
    python3 shared/workloads/sharegpt_synth.py --num 50 --rate 5 --seed 0 --vocab-size 512 > stream.jsonl
    python -m tools.serving.bench --stream stream.jsonl --max-model-len 512 --out result.json
"""

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Result:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks after the first
    error: str = ""


def read_stream(path: str, limit: int | None, max_model_len: int | None, max_prompt_len: int | None) -> list[dict]:
    """The stream's requests, prompts cut to `max_prompt_len` and outputs to fit `max_model_len`."""
    with open(path) as f:
        requests = [json.loads(line) for line in f if line.strip()][:limit]
    for r in requests:
        if max_prompt_len:
            r["prompt_token_ids"] = r["prompt_token_ids"][:max_prompt_len]
        if max_model_len:
            r["prompt_token_ids"] = r["prompt_token_ids"][: max_model_len // 2]
            r["max_tokens"] = max(1, min(r["max_tokens"], max_model_len - len(r["prompt_token_ids"]) - 1))
    return requests


async def send(client: httpx.AsyncClient, request: dict, model: str | None) -> Result:
    body = {"prompt": request["prompt_token_ids"], "max_tokens": request["max_tokens"], "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}  # fmt: skip  (a chunk a step even where no text is ready, or no tokenizer)
    if model:
        body["model"] = model
    result, start = Result(), time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk, now = json.loads(line[6:]), time.perf_counter()
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk["choices"]:
                    continue
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens == request["max_tokens"]
        result.error = "" if result.ok else f"{result.output_tokens} of {request['max_tokens']} tokens"
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
    return result


async def replay(base_url: str, requests: list[dict], model: str | None,
                 rate_scale: float) -> tuple[list[Result], float]:  # fmt: skip
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600), limits=limits) as client:
        start = time.perf_counter()

        async def at_arrival(request: dict) -> Result:
            await asyncio.sleep(max(0.0, request.get("arrival", 0.0) * rate_scale - (time.perf_counter() - start)))
            return await send(client, request, model)

        results = await asyncio.gather(*(at_arrival(r) for r in requests))
        return results, time.perf_counter() - start


def summarize(results: list[Result], duration: float) -> dict:
    done = [r for r in results if r.ok]

    def ms(xs: list[float]) -> dict:
        if not xs:
            return {}
        return {"mean": _r(statistics.fmean(xs) * 1e3), "median": _r(statistics.median(xs) * 1e3),
                "p99": _r(_percentile(xs, 99) * 1e3)}  # fmt: skip

    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    output = sum(r.output_tokens for r in done)
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": _r(duration),
        "request_throughput": _r(len(done) / duration),
        "output_token_throughput": _r(output / duration),
        "total_token_throughput": _r((output + sum(r.prompt_tokens for r in done)) / duration),
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": output,
        "ttft_ms": ms([r.ttft for r in done]),
        "tpot_ms": ms(tpot),
        "itl_ms": ms([gap for r in done for gap in r.itl]),
        "e2e_latency_ms": ms([r.latency for r in done]),
    }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _r(x: float) -> float:
    return round(x, 2)


def print_table(summary: dict) -> None:
    print(f"{'completed / failed':<32}{summary['completed']} / {summary['failed']}")
    for key in ("duration_s", "request_throughput", "output_token_throughput", "total_token_throughput"):
        print(f"{key:<32}{summary[key]}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        stats = summary[key]
        print(f"{key:<32}" + "  ".join(f"{k} {v}" for k, v in stats.items()))
    for error in summary["errors"]:
        print(f"error: {error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--stream", required=True, help="JSONL in sharegpt_synth.py's format")
    parser.add_argument("--num", type=int, default=None, help="first N requests only")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="cut prompts to half of it and outputs so prompt + output < it")
    parser.add_argument("--max-prompt-len", type=int, default=None)
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply arrival times (0: all at once)")
    parser.add_argument("--out", default=None, help="write the summary as JSON here")
    args = parser.parse_args()
    requests = read_stream(args.stream, args.num, args.max_model_len, args.max_prompt_len)
    results, duration = asyncio.run(replay(args.base_url, requests, args.model, args.rate_scale))
    summary = summarize(results, duration) | {"requests": len(requests), "stream": args.stream}
    print_table(summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
