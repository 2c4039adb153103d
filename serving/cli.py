"""The `rimuru` command line: `serve` for the OpenAI-compatible server, `generate` for a quick try, `fabricate` for
a tiny test checkpoint.

Every engine option is a flag (`--gpu-memory-budget 30GiB`, `--max-num-seqs 64`, ...) derived from `EngineConfig`,
so the command line never falls behind the engine.
"""

import argparse
import dataclasses
import os
import sys

from rimuru.config import BENCHMARK_ONLY, CHOICES, EngineConfig, field_docs


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `EngineConfig` field but `model` and `progress`, its help the field's comment, its choices and
    default the config's; the flags only benchmarks need in a group of their own."""
    engine = parser.add_argument_group("engine")
    benchmark = parser.add_argument_group("benchmarks (random weights)")
    docs = field_docs()
    for field in dataclasses.fields(EngineConfig):
        if field.name in ("model", "progress"):
            continue
        group = benchmark if field.name in BENCHMARK_ONLY else engine
        flag, kind = "--" + field.name.replace("_", "-"), _flag_type(field.type)
        text = f"{docs.get(field.name, '')} (default: {field.default})".replace("%", "%%")
        if kind is bool:
            group.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=field.default,
                               help=text)  # fmt: skip
        else:
            group.add_argument(flag, dest=field.name, type=kind, default=field.default, help=text,
                               choices=CHOICES.get(field.name))  # fmt: skip


def _flag_type(annotation: str) -> type:
    """int for 'int | None', float for 'float'; str whenever a string is allowed (sizes, dtypes: parsed later)."""
    options = {part.strip() for part in annotation.split("|")}
    return next((t for t in (str, bool, int, float) if t.__name__ in options), str)


def engine_options(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.name != "model" and hasattr(args, f.name)}


def _generate(args: argparse.Namespace) -> None:
    from rimuru import LLM, SamplingParams

    llm = LLM(args.model, **engine_options(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.sample_seed)
    prompts = args.prompt or ["Hello, my name is"]
    for prompt, output in zip(prompts, llm.generate(prompts, params)):
        print(f"{prompt}{output.outputs[0].text}")


def _profile(args: argparse.Namespace) -> None:
    import json
    import os

    from rimuru.engine import Engine
    from rimuru.expert_ranking import RANKING_FILE
    from rimuru.profiler import profile_experts

    # eager passes: the observer reads every router's input, which graphs keep only for copied experts
    engine = Engine(EngineConfig(model=args.model, **(engine_options(args) | {"cuda_graphs": False})))
    if args.workload:
        with open(args.workload) as f:
            prompts = [json.loads(line)["prompt_token_ids"] for line in f if line.strip()][: args.num_prompts]
    else:
        prompts = [f"Sample prompt {i}: tell me about topic {i}." for i in range(args.num_prompts)]
    ranking = profile_experts(engine, prompts, args.max_tokens)
    out = args.output or os.path.join(engine.loaded.folder, RANKING_FILE)
    ranking.save(out)
    print(out)


def _bench(args: argparse.Namespace) -> None:
    import json

    import torch

    from rimuru.benchmark import read_stream, run_benchmark, source_commit
    from rimuru.engine import Engine

    requests = read_stream(args.stream, args.num_requests)
    if args.rate is not None:
        requests = _with_rate(requests, args.rate, args.seed)
    engine = Engine(EngineConfig(model=args.model, **engine_options(args)))
    warmup = [dict(r, id=f"warmup-{i}", arrival=0.0, max_tokens=2) for i, r in enumerate(requests[: args.warmup])]
    run_benchmark(engine, warmup, progress=False)  # kernel compilation and autotuning stay out of the numbers
    record = run_benchmark(engine, requests, progress=not args.quiet, time_limit_s=args.time_limit_s)
    record |= {"model": args.model, "stream": args.stream, "rate": args.rate, "engine": engine_options(args),
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "commit": source_commit(), "pool_bytes": engine.pool.num_bytes,
               "kv_pages_per_expert_page": engine.pool.sizes.kv_pages_per_expert_page,
               "kv_tokens": engine.kv_tokens_at_start, "step_reserve_bytes": engine.memory_plan.activation_bytes,
               "step_memory": dataclasses.asdict(engine.step_memory) if engine.step_memory else None}  # fmt: skip
    engine.close()  # the next run of a sweep in this process gets the memory
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1, default=str)
    summary = {k: v for k, v in record.items() if k not in ("series", "engine")}
    print(json.dumps(summary, indent=1, default=str))


def _with_rate(requests: list[dict], rate: float, seed: int) -> list[dict]:
    """Re-time a stream with Poisson arrivals at `rate` requests/s (0: all at once)."""
    import random

    rng, t, out = random.Random(seed), 0.0, []
    for request in requests:
        t += rng.expovariate(rate) if rate > 0 else 0.0
        out.append(dict(request, arrival=round(t, 4)))
    return out


def _fabricate(args: argparse.Namespace) -> None:
    from rimuru.models.fabricate import fabricate

    print(fabricate(args.out_dir, arch=args.arch, seed=args.seed, num_layers=args.num_layers,
                    mlp_only_layers=tuple(args.mlp_only_layers), expert_layout=args.expert_layout,
                    prefix=args.prefix, num_shards=args.num_shards))  # fmt: skip


def _serve(args: argparse.Namespace) -> None:
    import logging

    from rimuru.serving.server import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = {"served_model_names": args.served_model_name, "api_key": args.api_key or None,
                "max_queued_requests": args.max_queued_requests, "shutdown_timeout": args.shutdown_timeout,
                "max_body_bytes": args.max_body_bytes}  # fmt: skip
    serve(args.model, engine_options(args), settings, args.host, args.port, args.log_level)


def _add_serve_parser(commands) -> None:
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API, metrics and a memory dashboard")
    serve.add_argument("model", nargs="?", default=None,
                       help="checkpoint folder or Hugging Face repo id (default: the tiny model shipped with Rimuru)")
    group = serve.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    group.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    group.add_argument("--api-key", default=os.environ.get("RIMURU_API_KEY"),
                       help="require `Authorization: Bearer KEY` on /v1 routes (default: $RIMURU_API_KEY)")
    group.add_argument("--max-queued-requests", type=int, default=None,
                       help="requests the server holds at once (running and waiting); more get 429")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds SIGTERM waits for requests in flight before aborting them")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="names clients use for the model (default: the model argument)")
    group.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="larger request bodies get 413")
    group.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                       help="the server's and the engine's logging (default: info)")
    add_engine_arguments(serve)
    serve.set_defaults(run=_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rimuru", description="Serve Qwen MoE models on an elastic GPU page pool.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(commands)

    generate = commands.add_parser("generate", help="generate text for a few prompts")
    generate.add_argument("model", nargs="?", default="tiny-qwen-moe",
                          help="checkpoint folder or Hugging Face repo id (default: the tiny model shipped with Rimuru)")
    generate.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--sample-seed", type=int, default=None)
    add_engine_arguments(generate)
    generate.set_defaults(run=_generate)

    prof = commands.add_parser("profile", help="measure each layer's expert popularity into expert_ranking.json")
    prof.add_argument("model", help="checkpoint folder or Hugging Face repo id")
    prof.add_argument("--workload", help="a JSONL request stream whose prompt_token_ids are the samples")
    prof.add_argument("--num-prompts", type=int, default=64)
    prof.add_argument("--max-tokens", type=int, default=16, help="tokens generated per sample")
    prof.add_argument("--output", help="where to write the ranking (default: beside the checkpoint)")
    add_engine_arguments(prof)
    prof.set_defaults(run=_profile)

    bench = commands.add_parser("bench", help="replay a request stream offline and write a JSON record")
    bench.add_argument("model", help="checkpoint folder, or a folder with config.json for --load-format dummy")
    bench.add_argument("--stream", required=True, help="JSONL: id, arrival, prompt_token_ids, max_tokens a line")
    bench.add_argument("--num-requests", type=int, default=None, help="use the first N requests")
    bench.add_argument("--rate", type=float, default=None, help="re-time arrivals as Poisson at this rate (0: at once)")
    bench.add_argument("--out", default="bench.json", help="where to write the record")
    bench.add_argument("--warmup", type=int, default=8, help="short requests run before timing")
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    bench.add_argument("--time-limit-s", type=float, default=None,
                       help="stop the replay after this many seconds and record the part that ran (truncated_at_s)")
    add_engine_arguments(bench)
    bench.set_defaults(run=_bench)

    fab = commands.add_parser("fabricate", help="write a tiny random Qwen MoE checkpoint with a tokenizer")
    fab.add_argument("out_dir")
    fab.add_argument("--arch", default="qwen2_moe",
                     help="qwen2_moe, qwen3_moe, qwen3_next, qwen3_5_moe (composite) or qwen3_5_moe_text")
    fab.add_argument("--seed", type=int, default=0)
    fab.add_argument("--num-layers", type=int, default=3)
    fab.add_argument("--mlp-only-layers", type=int, nargs="*", default=[])
    fab.add_argument("--expert-layout", default="per_expert", help='"per_expert" (as Qwen releases) or "fused"')
    fab.add_argument("--prefix", default="model.", help='"model." or "model.language_model."')
    fab.add_argument("--num-shards", type=int, default=1)
    fab.set_defaults(run=_fabricate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (ValueError, FileNotFoundError, MemoryError) as error:
        print(f"rimuru {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
