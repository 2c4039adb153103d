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
