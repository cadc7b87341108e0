"""Which package may import which (issues 14, 49), and which layer of the operator may import which
(issue 33, docs/architecture.md).

Between packages: the API (ddpjob_api: the CRD and its evaluator, the typed spec, the contract,
phases and reasons, names) is the ground floor and imports none of the others. The operator and the
trainer are siblings on it: the operator does not run training processes and imports nothing from
the trainer; the trainer, which every pod runs, imports neither the operator nor the CLI. The CLI
sits on top: it drives the operator's pure pieces, and takes from the trainer only the launcher's
public surface (ddpjob_trainer.launch's __all__), since its local runner is the pod's launcher on
the host.

Inside the operator: every module lives in one layer, and a layer imports only itself and the layers
below it (base < builders < decisions < cluster < app), so the pure parts never reach the I/O or the
process that wires them. Inside the trainer: checkpointing is a world of its own under the loop, and
the in-pod launcher (launch/) one above the training side, which never imports it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"ddpjob_api": REPO / "api/ddpjob_api", "ddpjob_operator": REPO / "operator/ddpjob_operator",
            "ddpjob_trainer": REPO / "trainer/ddpjob_trainer", "ddpjob_cli": REPO / "cli/ddpjob_cli"}

# The operator's layers, bottom first.
LAYERS = ("base", "builders", "decisions", "cluster", "app")
# Imports that run up a layer, each with what removes it (none today). A new one fails the test below;
# one that is gone fails too, so this list only shrinks.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def module_name(package: str, path: Path) -> str:
    rel = path.relative_to(PACKAGES[package]).with_suffix("")
    parts = [package, *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(package: str) -> dict[str, set[str]]:
    """{module imported: files importing it (relative to the package)} over a package, `from X import
    name` as X.name, relative imports resolved, imports under TYPE_CHECKING or in functions included."""
    found: dict[str, set[str]] = {}
    for path in PACKAGES[package].rglob("*.py"):
        here = module_name(package, path).split(".")
        if path.name != "__init__.py":
            here = here[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                found.setdefault(name, set()).add(str(path.relative_to(PACKAGES[package])))
    return found


def ours(found: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    return {m: f for m, f in found.items() if m == package or m.startswith(package + ".")}


@pytest.mark.parametrize("package, forbidden", [
    ("ddpjob_api", "ddpjob_operator"),
    ("ddpjob_api", "ddpjob_trainer"),
    ("ddpjob_api", "ddpjob_cli"),
    ("ddpjob_operator", "ddpjob_trainer"),
    ("ddpjob_operator", "ddpjob_cli"),
    ("ddpjob_trainer", "ddpjob_cli"),
    ("ddpjob_trainer", "ddpjob_operator"),
])
def test_a_package_does_not_import_one_above_or_beside_it(package, forbidden):
    assert not ours(imports(package), forbidden)


def test_operator_trainer_and_cli_stand_on_the_api():
    for package in ("ddpjob_operator", "ddpjob_trainer", "ddpjob_cli"):
        assert "ddpjob_api.contract" in ours(imports(package), "ddpjob_api"), package


def test_the_cli_takes_from_the_trainer_only_its_launchers_public_surface():
    import ddpjob_trainer.launch as launch

    taken = ours(imports("ddpjob_cli"), "ddpjob_trainer")
    assert taken, "the scan found none of the local runner's launcher imports"
    public = {f"ddpjob_trainer.launch.{name}" for name in launch.__all__}
    assert set(taken) <= public, f"the CLI reaches into the trainer: {sorted(set(taken) - public)}"


def test_the_local_runner_uses_the_operators_decision_and_command():
    found = imports("ddpjob_cli")
    assert "ddpjob_operator.decisions.lifecycle.decide" in found and "ddpjob_operator.builders.pods" in found


def layer_of(file: str) -> str:
    return Path(file).parts[0]


def test_every_operator_module_lives_in_a_layer():
    root = PACKAGES["ddpjob_operator"]
    loose = sorted(p.name for p in root.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules at the package root, in no layer ({', '.join(LAYERS)}): {loose}"
    folders = sorted(p.name for p in root.iterdir() if (p / "__init__.py").exists())
    assert folders == sorted(LAYERS), f"the operator's subpackages are not its layers: {folders}"


def test_a_layer_imports_only_itself_and_the_layers_below():
    upward: dict[tuple[str, str], str] = {}
    for name, files in ours(imports("ddpjob_operator"), "ddpjob_operator").items():
        target = name.split(".")[1]
        assert target in LAYERS, f"{sorted(files)} import {name}, which is in no layer"
        for file in files:
            if LAYERS.index(target) > LAYERS.index(layer_of(file)):
                upward[(file, name)] = f"{layer_of(file)} -> {target}"
    new = {k: v for k, v in upward.items() if k not in KNOWN_UPWARD}
    assert not new, "imports that run up the layers (" + " < ".join(LAYERS) + "): " + \
        "; ".join(f"{file} imports {name} ({how})" for (file, name), how in sorted(new.items()))
    gone = set(KNOWN_UPWARD) - set(upward)
    assert not gone, f"no longer imported upwards, strike from KNOWN_UPWARD: {sorted(gone)}"


def test_checkpointing_does_not_reach_back_into_the_loop():
    found = ours(imports("ddpjob_trainer"), "ddpjob_trainer")
    # The trainer's modules that use checkpointing (the loop and whatever imports it) sit above it.
    users = {Path(f).with_suffix("").parts[0] for name, files in found.items()
             if name.startswith("ddpjob_trainer.checkpointing") for f in files if not f.startswith("checkpointing/")}
    assert "loop" in users, "the scan found none of the loop's checkpoint imports"
    back = {name: files for name, files in found.items()
            if name.split(".")[1] in users | {"launch", "__main__"}
            and any(f.startswith("checkpointing/") for f in files)}
    assert not back, f"checkpointing imports what sits above it: {back}"


def test_the_training_side_never_imports_the_launcher():
    """The launcher (launch/) starts the ranks and watches them from outside; what runs in a rank
    does not reach back into it (the launcher may use the training side's telemetry and config)."""
    found = ours(imports("ddpjob_trainer"), "ddpjob_trainer")
    assert any(f.startswith("launch/") for files in found.values() for f in files), "no launcher import found"
    back = {name: sorted(f for f in files if not f.startswith("launch/"))
            for name, files in found.items() if name.startswith("ddpjob_trainer.launch")}
    back = {name: files for name, files in back.items() if files}
    assert not back, f"the training side imports the launcher: {back}"
