"""The wheel the image gets, built from the same files and installed into a fresh virtual environment, run from a
folder outside the source tree: package data inside, imports from the fresh site-packages, `rimuru --help`,
`fabricate` and one-prompt `generate`, and a served `/health` that answers the image's HEALTHCHECK.

Third-party packages are not installed again (torch alone is hundreds of MB): a `.pth` file in the fresh venv appends
a folder of links to exactly the distributions the wheel's Requires-Dist reach (`dependencies.py`): the core's for
`generate`, with the `serve` extra for the server. An undeclared dependency fails to import, as after a real install.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tests.packaging.dependencies import link_dependencies
from tests.packaging.dockerfile import ROOT, final_stage, ignore_patterns, instructions, is_ignored

PROBE = Path(__file__).with_name("installed_probe.py")
TINY_MODEL_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
DASHBOARD_FILES = {"dashboard.html", "dashboard.js", "dashboard.css"}
START_TIMEOUT_S = 120
SERVE_FLAGS = ["--host", "127.0.0.1", "--device", "cpu", "--max-model-len", "64", "--max-num-batched-tokens", "512",
               "--gpu-memory-budget", "8MiB", "--log-level", "warning"]  # fmt: skip


class Installed:
    """A fresh venv with the wheel installed; `run` calls its Python or scripts from an empty folder."""

    def __init__(self, base: Path):
        self.wheel = build_wheel(docker_context(base / "context"), base / "wheels")
        self.venv, self.cwd = base / "venv", base / "cwd"
        self.cwd.mkdir()
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(self.venv)], check=True)
        self.python, self.rimuru = self.venv / "bin" / "python", self.venv / "bin" / "rimuru"
        self.deps = {name: link_dependencies(self.wheel, extras, base / f"deps-{name}")
                     for name, extras in (("core", ()), ("serve", ("serve",)))}  # fmt: skip
        self.site = Path(self.run(self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"))
        # NOTE: appended, so the fresh site-packages (the wheel's rimuru) comes first on sys.path
        hook = "import os, sys; sys.path.append(os.environ['RIMURU_TEST_DEPS'])\n"
        (self.site / "_rimuru_test_deps.pth").write_text(hook)
        self.run(sys.executable, "-m", "pip", "--python", str(self.python), "install", "-q", "--no-deps",
                 "--no-index", "--ignore-installed", str(self.wheel))  # fmt: skip

    def env(self, deps: str = "serve") -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        return env | {"PATH": f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", "RIMURU_API_KEY": "",
                      "RIMURU_TEST_DEPS": str(self.deps[deps])}  # fmt: skip

    def run(self, *command, deps: str = "serve", timeout: float = 300) -> str:
        done = subprocess.run([str(part) for part in command], check=False, cwd=self.cwd, env=self.env(deps),
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip
        assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
        return done.stdout.strip()


def docker_context(dest: Path) -> Path:
    """The builder stage's COPY sources as the Docker context would hold them after .dockerignore."""
    patterns = ignore_patterns()
    sources = [word.rstrip("/") for item in instructions() if item.stage == 0 and item.keyword == "COPY"
               for word in item.args.split()[:-1]]  # fmt: skip
    for source in sources:
        for path in [ROOT / source] if (ROOT / source).is_file() else sorted((ROOT / source).rglob("*")):
            relative = path.relative_to(ROOT).as_posix()
            if path.is_file() and not is_ignored(relative, patterns):
                (dest / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, dest / relative)
    return dest


def build_wheel(context: Path, out: Path) -> Path:
    """`pip wheel` as the builder stage runs it, without build isolation (offline; this venv has setuptools)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--wheel-dir",
                    str(out), str(context)], check=True, capture_output=True, cwd=context)  # fmt: skip
    (wheel,) = out.glob("rimuru-*.whl")
    return wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    return Installed(tmp_path_factory.mktemp("wheel"))


def test_wheel_holds_package_data(installed):
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    assert {f"rimuru/serving/assets/tiny-qwen-moe/{name}" for name in TINY_MODEL_FILES} <= names
    assert {f"rimuru/serving/assets/dashboard/{name}" for name in DASHBOARD_FILES} <= names
    configs = {name for name in names if name.startswith("rimuru/ops/configs/") and name.endswith(".json")}
    assert configs == {f"rimuru/ops/configs/{path.name}" for path in (ROOT / "ops" / "configs").glob("*.json")}
    assert not any(name.startswith(("tests/", "tools/", "docs/")) or "__pycache__" in name for name in names)


def test_installed_wheel_runs_from_its_own_site_packages(installed):
    report = json.loads(installed.run(installed.python, "-I", PROBE).splitlines()[-1])
    for name, path in report["locations"].items():
        assert Path(path).is_relative_to(installed.site), f"{name} imported from {path}, not the fresh venv"
    data = report["package_data"]
    assert TINY_MODEL_FILES <= set(data["tiny_model"]) and Path(data["tiny_model_path"]).is_relative_to(installed.site)
    assert DASHBOARD_FILES <= set(data["dashboard"])
    assert {p.name for p in (ROOT / "ops/configs").glob("*.json")} <= set(data["configs"])
    assert Path(data["config_dir"]).is_relative_to(installed.site) and data["h200_shapes"] > 0


def test_installed_cli_help_and_generate_with_core_dependencies_only(installed):
    assert "serve" in installed.run(installed.rimuru, "--help", deps="core")
    model = installed.run(installed.rimuru, "fabricate", installed.cwd / "tiny", deps="core").splitlines()[-1]
    out = installed.run(installed.rimuru, "generate", model, "--prompt", "Hello", "--max-tokens", "4",
                        "--device", "cpu", "--max-model-len", "64", deps="core")  # fmt: skip
    assert out.startswith("Hello")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def healthcheck(installed: Installed, port: int) -> int:
    """The image's HEALTHCHECK command, with the fresh venv's Python and this test's port."""
    (check,) = [item for item in final_stage(instructions()) if item.keyword == "HEALTHCHECK"]
    _, flag, code = check.exec_form()
    probe = [str(installed.python), flag, code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")]
    done = subprocess.run(probe, check=False, cwd=installed.cwd, env=installed.env(), capture_output=True, timeout=30)
    return done.returncode


def test_installed_serve_passes_the_image_healthcheck(installed):
    """`rimuru serve` of the tiny model shipped in the wheel; after SIGTERM it exits 0 and the check fails."""
    port = free_port()
    assert healthcheck(installed, port) != 0, "nothing listens yet"
    log = installed.cwd / "serve.log"
    with open(log, "w") as sink:
        command = [str(installed.rimuru), "serve", "--port", str(port), *SERVE_FLAGS]
        server = subprocess.Popen(command, cwd=installed.cwd, env=installed.env(), stdout=sink, stderr=sink)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while healthcheck(installed, port) != 0:
            assert server.poll() is None, f"rimuru serve exited {server.returncode}: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "no healthy server within the start timeout"
            time.sleep(0.5)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert healthcheck(installed, port) != 0
