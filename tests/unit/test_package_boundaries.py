"""Which package may import which (issue 14): the operator does not run training processes, so it
imports from the trainer only the shared contract and the stage names its scraper reads, and
nothing from the CLI/local runner; the trainer, which every pod runs, imports neither."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"ddpjob_operator": REPO / "operator/ddpjob_operator", "ddpjob_trainer": REPO / "trainer/ddpjob_trainer",
            "ddpjob_cli": REPO / "cli/ddpjob_cli"}


def imports(package: str) -> dict[str, set[str]]:
    """{module imported: files importing it} over a package, `from X import name` as X.name."""
    found: dict[str, set[str]] = {}
    for path in PACKAGES[package].rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                found.setdefault(name, set()).add(path.name)
    return found


def ours(found: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    return {m: f for m, f in found.items() if m == package or m.startswith(package + ".")}


def test_the_operator_takes_only_the_contract_and_stage_names_from_the_trainer():
    found = imports("ddpjob_operator")
    allowed = ("ddpjob_trainer.contract", "ddpjob_trainer.telemetry.STAGES")
    extra = {m: f for m, f in ours(found, "ddpjob_trainer").items() if not m.startswith(allowed)}
    assert not extra, f"the operator imports more of the trainer than its contract: {extra}"
    assert ours(found, "ddpjob_trainer"), "the scan found none of the operator's known imports"


@pytest.mark.parametrize("package, forbidden", [
    ("ddpjob_operator", "ddpjob_cli"),
    ("ddpjob_trainer", "ddpjob_cli"),
    ("ddpjob_trainer", "ddpjob_operator"),
])
def test_a_package_does_not_import_one_above_it(package, forbidden):
    assert not ours(imports(package), forbidden)


def test_the_local_runner_uses_the_operators_decision_and_command():
    found = imports("ddpjob_cli")
    assert "ddpjob_operator.decisions.lifecycle.decide" in found and "ddpjob_operator.builders.pods" in found
