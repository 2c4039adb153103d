"""The `rimuru` command line: fabricate a checkpoint, generate from it, and fail cleanly on bad input."""

import re
import socket

import pytest
import torch

from rimuru import LLM
from rimuru.config import parse_bytes
from rimuru.serving.cli import main


def test_fabricate_then_generate(tmp_path, capsys):
    folder = tmp_path / "tiny"
    assert main(["fabricate", str(folder), "--arch", "qwen3_moe"]) == 0
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    capsys.readouterr()
    assert main(["generate", str(folder), "--prompt", "Hello", "--prompt", "Once", "--max-tokens", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("Hello") and len(lines[0]) > len("Hello")


def test_errors_are_one_line_and_exit_2(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["fabricate", str(tmp_path / "x"), "--arch", "llama"]) == 2
    assert capsys.readouterr().err.strip().endswith("qwen3_5_moe_text, got 'llama'")


def test_a_hybrid_is_fabricated_and_generates(tmp_path, capsys):
    folder = tmp_path / "hybrid"
    assert main(["fabricate", str(folder), "--arch", "qwen3_5_moe", "--expert-layout", "fused"]) == 0
    capsys.readouterr()
    assert main(["generate", str(folder), "--prompt", "Once", "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("Once")


def test_serve_flags(capsys):
    from rimuru.serving.cli import build_parser
    from rimuru.serving.server import tiny_model_path

    args = build_parser().parse_args(["serve", "--max-num-seqs", "8", "--api-key", "k", "--max-queued-requests", "3"])
    assert args.model is None and args.host == "127.0.0.1" and args.port == 8000 and args.max_num_seqs == 8
    assert args.api_key == "k" and args.max_queued_requests == 3 and args.shutdown_timeout == 30.0
    import os

    assert os.path.isfile(os.path.join(tiny_model_path(), "model.safetensors"))
    assert os.path.isfile(os.path.join(tiny_model_path(), "tokenizer.json"))


def test_engine_flags_parse_to_the_config_types():
    from rimuru.serving.cli import build_parser, engine_options

    args = build_parser().parse_args(["generate", "m", "--expert-offload-limit", "8", "--router-skew", "1.5",
                                      "--gpu-memory-budget", "30GiB", "--no-prefetch", "--max-num-seqs", "4"])  # fmt: skip
    options = engine_options(args)
    assert options["expert_offload_limit"] == 8 and options["router_skew"] == 1.5 and options["max_num_seqs"] == 4
    assert options["gpu_memory_budget"] == "30GiB" and options["prefetch"] is False and options["offload_per_layer"] is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    assert main(["fabricate", str(folder), "--arch", "qwen2_moe"]) == 0
    return str(folder)


@pytest.mark.parametrize("flags, message", [
    (["--gpu-memory-budget", "100000TiB"], r"gpu_memory_budget 102400000\.00 GiB exceeds the .* GiB of cpu"),
    (["--gpu-memory-budget=-1GiB"], r"gpu_memory_budget must be bytes or a size such as '30GiB', got '-1GiB'"),
    (["--gpu-memory-budget", "0"], r"gpu_memory_budget must be positive, got 0 bytes"),
    (["--gpu-memory-budget", "30 GX"], r"gpu_memory_budget must be bytes or a size"),
    (["--device", "cuda"], r"device 'cuda' asked for, but torch .* finds no CUDA device"),
])  # fmt: skip
def test_what_users_get_wrong_is_one_line_and_exit_2(tiny, capsys, flags, message):
    if "cuda" in flags and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    capsys.readouterr()
    assert main(["generate", tiny, "--prompt", "Hi", "--max-tokens", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_a_size_with_a_space_is_read_as_users_write_it():
    assert parse_bytes("30 GB") == 30 * 10**9 and parse_bytes("30GiB") == 30 * 2**30


def test_a_port_in_use_is_refused_before_the_model_loads(capsys, monkeypatch):
    import rimuru.serving.server as server

    monkeypatch.setattr(server, "build_app", lambda *a: pytest.fail("the model was loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert re.search(rf"cannot serve on 127\.0\.0\.1:{port}: .*in use", capsys.readouterr().err)


def test_the_routed_experts_must_fit_host_memory(tiny, monkeypatch):
    import rimuru.engine as engine

    monkeypatch.setattr(engine, "host_memory", lambda available=False: 1024)
    monkeypatch.setattr(engine, "HOST_MEMORY_WAIT_S", 0.0)
    with pytest.raises(ValueError, match=r"routed experts need .* GiB of host memory .* 0\.00 GiB is available"):
        LLM(tiny, progress=False)


def test_a_short_host_memory_reading_is_read_again_before_refusing(monkeypatch):
    import rimuru.engine as engine

    readings = iter([10, 20, 50, 90])  # memory a process that just ended hands back
    monkeypatch.setattr(engine, "host_memory", lambda available=False: next(readings))
    monkeypatch.setattr(engine.time, "sleep", lambda s: None)
    assert engine._host_memory_within(50, wait_s=60.0) == 50
    assert engine._host_memory_within(100, wait_s=0.0) == 90


def test_the_parser_is_built_without_torch_and_every_engine_flag_has_help():
    """`rimuru --help` answers before torch loads; each flag says what it does, string options list their values."""
    import subprocess
    import sys

    probe = ("import sys; from rimuru.serving.cli import build_parser; build_parser().format_help(); "
             "print('torch' in sys.modules)")  # fmt: skip
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"
    from rimuru.serving.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {a.dest: a for a in serve._actions if a.option_strings and a.dest not in ("help",)}
    silent = [name for name, action in flags.items() if not action.help or action.help.startswith("(default")]
    assert not silent
    assert flags["preemption"].choices == ("swap", "recompute") and flags["expert_policy"].choices
    groups = {g.title: [a.dest for a in g._group_actions] for g in serve._action_groups}
    assert "router_skew" in groups["benchmarks (random weights)"] and "router_skew" not in groups["engine"]


def test_the_shipped_tiny_model_is_reachable_by_name_offline_and_from_generate(capsys):
    """`LLM("tiny-qwen-moe")` and `rimuru generate` without a model run the checkpoint `rimuru serve` serves."""
    from rimuru import LLM, SamplingParams
    from rimuru.serving.cli import main
    from rimuru.serving.server import tiny_model_path

    greedy = SamplingParams(temperature=0, max_tokens=6)
    by_name = LLM("tiny-qwen-moe", progress=False).generate(["Hello, my name is"], greedy, use_tqdm=False)
    by_path = LLM(tiny_model_path(), progress=False).generate(["Hello, my name is"], greedy, use_tqdm=False)
    assert by_name[0].outputs[0].token_ids == by_path[0].outputs[0].token_ids
    assert main(["generate", "--max-tokens", "6"]) == 0
    assert capsys.readouterr().out.strip() == "Hello, my name is" + by_name[0].outputs[0].text
