"""Folders that hold only what a wheel declares: its Requires-Dist, followed through installed metadata.

The wheel test installs Rimuru into a fresh venv but reuses this venv's third-party packages rather than download
them again. Pointing the fresh venv at all of this venv's site-packages would hide a missing dependency (and libraries
import optional packages when they happen to be there), so it gets a folder of symlinks to the distributions the
wheel's metadata reaches, and nothing else: an import of an undeclared distribution fails there as in a real install.
"""

import email
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        message = email.message_from_bytes(archive.read(name))
    return [Requirement(line) for line in message.get_all("Requires-Dist") or ()]


def wanted(requirement: Requirement, extras: tuple[str, ...]) -> bool:
    return requirement.marker is None or any(requirement.marker.evaluate({"extra": e}) for e in ("", *extras))


def reached(wheel: Path, extras: tuple[str, ...]) -> list[metadata.Distribution]:
    """The installed distributions the wheel's requirements (with `extras`) reach, recursively."""
    todo = [r for r in wheel_requirements(wheel) if wanted(r, extras)]
    found: dict[str, metadata.Distribution] = {}
    while todo:
        requirement = todo.pop()
        key = canonicalize_name(requirement.name)
        if key in found:
            continue
        try:
            found[key] = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            continue  # not installed here: an import of it fails in the fresh venv, as it should
        more = [Requirement(line) for line in found[key].requires or ()]
        todo += [r for r in more if wanted(r, tuple(requirement.extras))]
    return list(found.values())


def link_dependencies(wheel: Path, extras: tuple[str, ...], dest: Path) -> Path:
    """`dest` filled with symlinks to the top-level files of every reached distribution (its dist-info too)."""
    dest.mkdir(parents=True)
    for dist in reached(wheel, extras):
        assert dist.files is not None, f"{dist.metadata['Name']} has no RECORD"
        for top in {file.parts[0] for file in dist.files if file.parts[0] not in ("..", "__pycache__")}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (dest / top).exists():
                (dest / top).symlink_to(source)
    return dest
