"""Reading the Dockerfile and .dockerignore the way the tests need, with no Docker engine.

Owns a small parser (continuation lines joined, comments and parser directives dropped, instructions kept per
stage) and the context filter (which files `.dockerignore` keeps). It handles what Rimuru's own files use; it is no
general Dockerfile parser.
"""

import fnmatch
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


@dataclass(frozen=True)
class Instruction:
    stage: int  # index of the FROM it follows
    keyword: str  # upper case: "RUN", "COPY", ...
    args: str  # the rest of the line, continuations joined

    def exec_form(self) -> list[str]:
        """The JSON array of an exec-form ENTRYPOINT, CMD or HEALTHCHECK CMD; ValueError for shell form."""
        text = self.args.split("CMD", 1)[1] if self.keyword == "HEALTHCHECK" else self.args
        value = json.loads(text.strip())
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise ValueError(f"{self.keyword} is not in exec form: {self.args}")
        return value

    def flags(self) -> dict[str, str]:
        """`--name=value` options before the arguments (HEALTHCHECK, COPY, RUN)."""
        options = {}
        for word in shlex.split(self.args.split("CMD", 1)[0] if self.keyword == "HEALTHCHECK" else self.args):
            if not word.startswith("--"):
                break
            name, _, value = word[2:].partition("=")
            options[name] = value
        return options


def instructions(path: Path = DOCKERFILE) -> list[Instruction]:
    out, stage, pending = [], -1, ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, args = (pending + stripped).partition(" ")
        pending = ""
        stage += keyword.upper() == "FROM"
        out.append(Instruction(stage, keyword.upper(), " ".join(args.split())))
    return out


def final_stage(items: list[Instruction]) -> list[Instruction]:
    return [item for item in items if item.stage == items[-1].stage]


def ignore_patterns(path: Path = DOCKERIGNORE) -> list[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line.rstrip("/") for line in lines if line and not line.startswith("#")]


def is_ignored(relative: str, patterns: list[str]) -> bool:
    """Whether the context drops `relative` (a POSIX path): a pattern matching the path or any folder above it."""
    parts = relative.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        bare = pattern.removeprefix("**/")
        for prefix in prefixes:
            if fnmatch.fnmatchcase(prefix, pattern):
                return True
            if pattern.startswith("**/") and fnmatch.fnmatchcase(prefix.rsplit("/", 1)[-1], bare):
                return True
    return False
