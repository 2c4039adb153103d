"""`python -m tools [NAME ARGS...]`: with no NAME, every tool and its first docstring line; with one, that tool run as
`python -m tools.NAME ARGS...` would run it. `rimuru` is the product's own command line, for a source tree without
an install (the GPU machine's, laid out by tools/device_env.sh)."""

import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).parent
ALIASES = {"rimuru": "rimuru.serving.cli"}


def tool_names() -> list[str]:
    """Every runnable module under tools/, dotted (`kernels.bench`), in order; packages and helpers without a
    `__main__` block are left out. Found by file, not by import: `pkgutil` would import `kernels` from site-packages."""
    paths = [*HERE.glob("*.py"), *HERE.glob("*/*.py")]
    runnable = [p for p in paths if not p.name.startswith("__") and "__main__" in p.read_text()]
    return sorted(".".join(p.relative_to(HERE).with_suffix("").parts) for p in runnable)


def summary(name: str) -> str:
    """The first line of a tool's docstring, read without importing it (most import torch, some vLLM)."""
    path = HERE.joinpath(*name.split(".")).with_suffix(".py")
    return (ast.get_docstring(ast.parse(path.read_text())) or "").split("\n", 1)[0]


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        names = tool_names()
        width = max(map(len, names))
        print("python -m tools NAME ARGS..., NAME one of:")
        print("\n".join(f"  {name:<{width}}  {summary(name)[:100]}" for name in names))
        print(f"  {'rimuru':<{width}}  the `rimuru` command (bench, serve, generate, fabricate, ...)")
        return 0
    name, *args = argv
    module = ALIASES.get(name, f"tools.{name}")
    if name not in ALIASES and name not in tool_names():
        print(f"no tool {name!r}: `python -m tools` lists them", file=sys.stderr)
        return 2
    sys.argv = [f"python -m {module}", *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
