"""Code hygiene CI keeps: ruff's rules (pyproject.toml), and no commit hashes or measured times and rates in product
code's comments and docstrings (benchmark history lives in docs/benchmarks/, where git keeps it)."""

import importlib.util
import io
import pathlib
import re
import subprocess
import sys
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PRODUCT = ("rimuru", "models", "ops", "serving")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")  # hex words with letters and digits
FIGURE = re.compile(r"\b\d+(?:\.\d+)?\s?(?:us|ms|GB/s|TB/s|tok/s|tokens/s)(?![\w/])")  # a measured time or rate


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed")
def test_ruff_finds_nothing():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", "."], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def prose_hashes(source: str, pattern: re.Pattern = COMMIT) -> list[tuple[int, str]]:
    """(line, word) of every match of `pattern` (commit-like words) in the comments and docstrings of `source`."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        prose = token.type == tokenize.COMMENT or (token.type == tokenize.STRING and token.string[-3:] in ('"""', "'''"))
        found += [(token.start[0], m.group()) for m in pattern.finditer(token.string)] if prose else []
    return found


def test_the_hash_check_sees_comments_and_docstrings_only():
    source = '"""Measured at 7ed62cc."""\nx = "ab12cd34ef"  # fixed in a7ee043\n'
    assert prose_hashes(source) == [(1, "7ed62cc"), (2, "a7ee043")]


def test_product_code_carries_no_commit_hashes():
    files = [path for folder in PRODUCT for path in (ROOT / folder).rglob("*.py")]
    found = [f"{path.relative_to(ROOT)}:{line}: {word}" for path in files for line, word in prose_hashes(path.read_text())]
    assert not found, "commit hashes belong in docs/benchmarks/: " + ", ".join(found)


def test_the_figure_check_sees_times_and_rates():
    source = '"""Takes 62.4 us here, 3 ms a step."""\nx = "10 ms"  # 2,504 tok/s, 4.2 TB/s; 30 GiB, 8 rows\n'
    assert prose_hashes(source, FIGURE) == [(1, "62.4 us"), (1, "3 ms"), (2, "504 tok/s"), (2, "4.2 TB/s")]


def test_product_code_carries_no_measured_figures():
    files = [path for folder in PRODUCT for path in (ROOT / folder).rglob("*.py")]
    found = [f"{path.relative_to(ROOT)}:{line}: {word}" for path in files
             for line, word in prose_hashes(path.read_text(), FIGURE)]  # fmt: skip
    assert not found, "measured figures belong in docs/benchmarks/: " + ", ".join(found)
