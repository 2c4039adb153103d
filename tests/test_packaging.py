"""The four top-level folders install under one import name, from a regular (non-editable) install too."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORT_ALL = "import rimuru, rimuru.ops, rimuru.models, rimuru.serving, rimuru.memory; print(rimuru.ops.__file__)"


def test_editable_install_imports_all_four(tmp_path):
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()).parent == ROOT / "ops"


def test_regular_install_imports_all_four(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(ROOT)],
        check=True, capture_output=True,
    )
    assert (target / "rimuru" / "ops" / "reference.py").is_file()
    code = f"import sys; sys.path.insert(0, {str(target)!r}); " + IMPORT_ALL
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()).is_relative_to(target)
