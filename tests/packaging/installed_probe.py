"""Run by the fresh environment's Python (`python -I installed_probe.py`), never imported by the suite.

Prints one JSON object: where the rimuru packages were imported from and which package data the installed files
hold, read the way the code reads them (`importlib.resources`, `ops.configs.CONFIG_DIR`, the server's tiny model).
"""

import importlib
import json
from importlib import resources


def locations() -> dict:
    names = ("rimuru", "rimuru.ops", "rimuru.models", "rimuru.serving", "rimuru.memory")
    return {name: importlib.import_module(name).__file__ for name in names}


def package_data() -> dict:
    from rimuru.ops.configs import CONFIG_DIR, load_table
    from rimuru.serving.server import tiny_model_path

    serving = resources.files("rimuru.serving") / "assets"
    return {
        "tiny_model": sorted(p.name for p in (serving / "tiny-qwen-moe").iterdir()),
        "tiny_model_path": tiny_model_path(),
        "dashboard": sorted(p.name for p in (serving / "dashboard").iterdir()),
        "configs": sorted(p.name for p in (resources.files("rimuru.ops") / "configs").iterdir()),
        "config_dir": str(CONFIG_DIR),
        "h200_shapes": len(load_table("NVIDIA H200")),
    }


if __name__ == "__main__":
    print(json.dumps({"locations": locations(), "package_data": package_data()}))
