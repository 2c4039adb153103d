"""The `rimuru` command line: fabricate a checkpoint, generate from it, and fail cleanly on bad input."""

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
