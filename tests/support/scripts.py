"""Import a script of the repository that is not a package module (hack/gen-*.py, bench/*.py)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str, path: str) -> ModuleType:
    """The script at REPO/`path` as module `name` (registered first: dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
