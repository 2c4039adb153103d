"""What the tools read back: `rimuru bench` records (`read_records`) and another version of one of rimuru's modules
(`load_version`), which an A/B benchmark runs beside this one. Benchmark tooling only: the engine never reads these."""

import gzip
import importlib.util
import json


def read_records(specs: list[str], label_of=lambda path: path) -> list[tuple[str, dict]]:
    """`LABEL=RECORD` specs (or bare paths, labelled by `label_of`) -> (label, record), in order. A record may be
    gzipped (`.json.gz`: docs/benchmarks keeps the long series that way, about 30x smaller)."""
    records = []
    for spec in specs:
        label, _, path = spec.rpartition("=")
        with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
            records.append((label or label_of(path), json.load(f)))
    return records


def load_version(path: str, name: str):
    """The module in `path`: another version of one of rimuru's files (`git show REV:rimuru/sampler.py > FILE`),
    which a tool runs beside this one (`python -m tools.engine.scheduler --against`, `tools.engine.sampler`)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
