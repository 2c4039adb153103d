"""The operators one decode pass calls, a decoder layer at a time and outside the layers, sorted into what inductor
can and cannot fuse: rimuru's custom ops (opaque to it), GEMMs (cuBLAS either way), views (no kernel) and the rest.
CPU, a fabricated tiny checkpoint of the family: the counts follow the model code, not the sizes.

    python -m tools.engine.layer_ops [--arch qwen2_moe] [--dtype bfloat16]
"""

import argparse
import collections
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from rimuru.models import fabricate, from_pretrained
from tests.models.helpers import ResidentRunner

GEMMS = {"aten::linear", "aten::mm", "aten::addmm", "aten::matmul"}
VIEWS = {"aten::select", "aten::slice", "aten::flatten", "aten::view", "aten::reshape", "aten::unsqueeze",
         "aten::squeeze", "aten::t", "aten::transpose", "aten::as_strided", "aten::split", "aten::split_with_sizes"}  # fmt: skip
OUTSIDE = "outside the layers"


def kind(name: str) -> str:
    if name.startswith("rimuru::"):
        return "rimuru op"
    return "GEMM" if name in GEMMS else "view" if name in VIEWS else "other"


def tag_layers(model: torch.nn.Module) -> None:
    """Each decoder layer's forward and the whole pass in a named profiler scope (on the instances only)."""
    for i, layer in enumerate(model.model.layers):
        layer.forward = _scoped(layer.forward, f"layer {i}")
    model.forward = _scoped(model.forward, OUTSIDE)


def _scoped(forward, name: str):
    def scoped(*args, **kwargs):
        with record_function(name):
            return forward(*args, **kwargs)

    return scoped


def top_level_ops(events) -> dict[str, list[str]]:
    """scope -> the aten and rimuru ops called from no other op, in call order."""
    ops = collections.defaultdict(list)
    for event in events:
        if not event.name.startswith(("aten::", "rimuru::")):
            continue
        scope, parent, nested = None, event.cpu_parent, False
        while parent is not None:
            nested = nested or parent.name.startswith(("aten::", "rimuru::"))
            if scope is None and (parent.name.startswith("layer ") or parent.name == OUTSIDE):
                scope = parent.name
            parent = parent.cpu_parent
        if scope is not None and not nested:
            ops[scope].append(event.name)
    return ops


def decode_pass_ops(arch: str, dtype: torch.dtype) -> dict[str, list[str]]:
    """scope -> the top-level ops of a decode step of four requests on a fabricated checkpoint of `arch`."""
    with tempfile.TemporaryDirectory() as folder:
        loaded = from_pretrained(fabricate(folder, arch=arch, seed=0), device="cpu", dtype=dtype, progress=False)
    runner = ResidentRunner(loaded, records_routing=False)  # no routing hook: every expert resident
    prompts = {0: [5, 77, 301, 12, 9], 1: [400, 3, 3, 250], 2: [42], 3: [11, 12]}
    runner.step(prompts)
    tag_layers(loaded.model)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.step({row: [7] for row in prompts})
    return top_level_ops(prof.events())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen2_moe")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    for scope, names in sorted(decode_pass_ops(args.arch, getattr(torch, args.dtype)).items()):
        kinds = collections.Counter(map(kind, names))
        other = collections.Counter(name for name in names if kind(name) == "other")
        print(f"{scope}: {len(names)} ops: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
              + (f"; other: {dict(other)}" if other else ""))  # fmt: skip


if __name__ == "__main__":
    main()
