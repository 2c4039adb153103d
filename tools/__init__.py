"""Rimuru's benchmark and measurement tooling: never installed, never imported by the engine.

    kernels/    the Triton ops alone: sweeps, breakdowns, tuning, register use
    engine/     the engine's parts and whole runs: scheduler, sampler, hook, adjuster, memory, profiles, sweeps
    serving/    the HTTP server under load
    vs_vllm/    vLLM replaying the same streams, and the side-by-side table
    reports/    tables and plots from `rimuru bench` records
    records.py  reading records back, and loading another version of a module for an A/B run
    scenarios.py  the GPU jobs, by name (what tools/device_session.sh runs)
    fabricate.py  `rimuru fabricate` from a source tree

Entry points: `python -m tools` lists every tool with its first docstring line; `python -m tools NAME ARGS` (or
`python -m tools.NAME ARGS`) runs one, e.g. `python -m tools kernels.bench --smoke`; `python -m tools rimuru ARGS`
is the `rimuru` command without an install; `python -m tools.scenarios` lists the GPU jobs.
"""
