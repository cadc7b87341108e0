"""What the image must hold for each feature a `spec.trainer` turns on, checked by the launcher
before any rendezvous. Missing, a feature would fail one rank after the whole group has met
(mlflow: rank 0's reporter) or at the first forward (compile: no compiler for the kernels), and
nobody can tell a bad image from a bad run; here it is a bad configuration (exit 78) naming the
field. Imports are tried in a fresh interpreter (same executable, same environment as the ranks):
mlflow and torch may start threads on import, and the launcher forks torchrun with none running.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from typing import Callable, Iterable, Mapping

from ..config import TrainerConfig
from ..errors import ConfigError

IMPORT_TIMEOUT = 180.0  # importing torch._inductor on a loaded 2-core node takes seconds, not minutes

_PROBE = """
import importlib, json, sys
failed = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(failed))
"""


def import_errors(modules: Iterable[str]) -> dict[str, str]:
    """module -> why `import module` fails in a fresh interpreter; those that import are absent.
    A probe that runs out of time proves nothing either way: the ranks will find out."""
    modules = list(modules)
    if not modules:
        return {}
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, *modules], capture_output=True, text=True,
                              timeout=IMPORT_TIMEOUT)
    except subprocess.TimeoutExpired:
        return {}
    try:
        return dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError):  # the interpreter died importing them (a crash, not an exception)
        why = f"importing crashed the interpreter (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"
        return {m: why for m in modules}


def python_header() -> str:
    """Where inductor and triton look for Python.h (they compile against this interpreter's headers)."""
    return os.path.join(sysconfig.get_path("include"), "Python.h")


def compile_tools(*, which: Callable[[str], str | None], exists: Callable[[str], bool],
                  environ: Mapping[str, str]) -> list[str]:
    """What torch.compile lacks here besides imports: the compilers, each looked up the way its user
    does (inductor's config.cpp.cxx, triton's build.py), and the headers both compile against."""
    out = []
    cxx = environ.get("CXX") or "g++"
    if not which(cxx):
        out.append(f"no C++ compiler for inductor ({cxx} is not on PATH; install g++ or set CXX)")
    cc = environ.get("CC")
    if not (which(cc) if cc else which("gcc") or which("clang")):
        out.append(f"no C compiler for triton ({cc or 'gcc or clang'} is not on PATH; install gcc or set CC)")
    header = python_header()
    if not exists(header):
        out.append(f"no Python headers ({header} is missing; install this interpreter's python3-dev)")
    return out


def problems(cfg: TrainerConfig, *, path: str = "spec.trainer",
             import_errors: Callable[[Iterable[str]], Mapping[str, str]] = import_errors,
             which: Callable[[str], str | None] = shutil.which,
             exists: Callable[[str], bool] = os.path.exists,
             environ: Mapping[str, str] = os.environ) -> list[str]:
    """One message per field whose feature this image cannot run, each starting with the field."""
    # field, the feature, the modules it imports, a hint when one does not, what else it lacks
    features: list[tuple[str, str, list[str], str, list[str]]] = []
    if cfg.mlflow:
        features.append((f"{path}.mlflow", "MLflow tracking", ["mlflow"],
                         "the ddpjob trainer image ships the client; elsewhere pip install mlflow-skinny", []))
    if cfg.compile:
        features.append((f"{path}.compile", "torch.compile", ["torch._inductor"], "",
                         compile_tools(which=which, exists=exists, environ=environ)))
    failed = import_errors([m for _, _, mods, _, _ in features for m in mods])
    out = []
    for field, what, mods, hint, lacking in features:
        broken = [f"{m} does not import ({failed[m]})" for m in mods if m in failed]
        missing = broken + ([hint] if broken and hint else []) + lacking
        if missing:
            out.append(f"{field}: this image cannot run {what}: " + "; ".join(missing))
    return out


def check(cfg: TrainerConfig) -> None:
    """Raise ConfigError naming every field whose feature this image lacks."""
    found = problems(cfg)
    if found:
        raise ConfigError(" | ".join(found))
