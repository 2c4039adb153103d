"""The decode step's state update of a hybrid model's linear layers, against the copy rate.

    python -m tools.kernels.linear_state --out linear_state.json          # on a CUDA GPU
    python -m tools.kernels.linear_state --smoke       # logic check on CPU (the references), times meaningless

Qwen3.5-35B-A3B's geometry (16 key heads, 32 value heads of 128, fp32 states of 2 MiB a request and layer) at 1, 64
and 256 requests, states at shuffled pages: `rimuru::gated_delta_step` reads and writes every state once, so its
achieved bandwidth is 2 x the states' bytes over its time; the copy rate is a device-to-device copy of the same bytes
(read and written once) in the same run. `rimuru::causal_conv1d_step` (8,192 channels, kernel 4) is timed beside it.
Times: medians of CUDA events (triton.testing.do_bench).
"""

import argparse
import json

import torch

from rimuru import ops
from tools.kernels.bench import time_ms

GEOMETRY = {"key_heads": 16, "value_heads": 32, "head_dim": 128, "conv_channels": 8192, "conv_width": 4}
REQUESTS = (1, 64, 256)


def case(num_requests: int, device: str, smoke: bool):
    hk, hv, d = (2, 4, 16) if smoke else (GEOMETRY["key_heads"], GEOMETRY["value_heads"], GEOMETRY["head_dim"])
    channels, width = (32 if smoke else GEOMETRY["conv_channels"]), GEOMETRY["conv_width"]
    gen = torch.Generator(device).manual_seed(num_requests)
    dtype = torch.float32 if smoke else torch.bfloat16
    q, k = (torch.randn(num_requests, hk, d, device=device, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(num_requests, hv, d, device=device, generator=gen).to(dtype)
    g = -torch.rand(num_requests, hv, device=device, generator=gen)
    beta = torch.rand(num_requests, hv, device=device, generator=gen).to(dtype)
    ssm = torch.randn(2 * num_requests, hv, d, d, device=device, generator=gen) * 0.1
    ids = torch.randperm(2 * num_requests, device=device, generator=gen)[:num_requests]
    x = torch.randn(num_requests, channels, device=device, generator=gen).to(dtype)
    conv = torch.randn(2 * num_requests, channels, width - 1, device=device, generator=gen).to(dtype)
    weight = torch.randn(channels, width, device=device, generator=gen).to(dtype)
    return (q, k, v, g, beta, ssm, ids), (x, conv, ids, weight, None)


def measure(num_requests: int, device: str, smoke: bool) -> dict:
    delta, conv = case(num_requests, device, smoke)
    state_bytes = num_requests * delta[5][0].nbytes
    source = torch.empty(state_bytes // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    delta_ms = time_ms(lambda: ops.gated_delta_step(*delta), smoke)
    copy_ms = time_ms(lambda: target.copy_(source), smoke)
    conv_ms = time_ms(lambda: ops.causal_conv1d_step(*conv), smoke)
    rate = 2 * state_bytes / (delta_ms * 1e-3) / 1e12
    copy_rate = 2 * state_bytes / (copy_ms * 1e-3) / 1e12
    return {"requests": num_requests, "state_bytes": state_bytes, "delta_ms": delta_ms, "copy_ms": copy_ms,
            "conv_ms": conv_ms, "delta_tb_s": rate, "copy_tb_s": copy_rate, "share_of_copy": rate / copy_rate}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, the references: a logic check")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    rows = [measure(n, device, args.smoke) for n in ((1, 2) if args.smoke else REQUESTS)]
    for row in rows:
        print(f"{row['requests']:4d} requests: delta rule {row['delta_ms']:.3f} ms ({row['delta_tb_s']:.2f} TB/s, "
              f"{row['share_of_copy']:.0%} of the copy's {row['copy_tb_s']:.2f}), conv {row['conv_ms']:.3f} ms")
    if args.out:
        device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        with open(args.out, "w") as f:
            json.dump({"gpu": device_name, "geometry": GEOMETRY, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
