"""The names operator, local runner, launcher and trainer share are spelled once, in
ddpjob_trainer/contract.py: a second spelling could drift from the first without any test noticing
(the pod would get one env name and the launcher read another)."""
from __future__ import annotations

import io
import tokenize
from pathlib import Path

import pytest

from ddpjob_trainer import contract

REPO = Path(__file__).resolve().parents[2]
PRODUCT = sorted(p for d in ("operator/ddpjob_operator", "trainer/ddpjob_trainer", "cli/ddpjob_cli")
                 for p in (REPO / d).rglob("*.py") if p.name != "contract.py")
SHARED = {value: name for name, value in vars(contract).items()
          if name.startswith(("ENV_", "PET_", "METRIC_"))}


def literals(path: Path) -> list[tuple[int, str, str]]:
    """(line, token type, text) of every string and number literal in a source file."""
    toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [(t.start[0], tokenize.tok_name[t.type], t.string) for t in toks
            if t.type in (tokenize.STRING, tokenize.NUMBER)]


def test_the_product_files_are_found():
    assert len(PRODUCT) > 30 and REPO / "trainer/ddpjob_trainer/launch/node.py" in PRODUCT
    assert REPO / "cli/ddpjob_cli/local.py" in PRODUCT


@pytest.mark.parametrize("path", PRODUCT, ids=lambda p: str(p.relative_to(REPO)))
def test_no_shared_name_or_exit_code_is_spelled_outside_the_contract(path):
    found = []
    for line, kind, text in literals(path):
        value = text.strip("'\"")
        if kind == "STRING" and value in SHARED:
            found.append(f"line {line}: {text} (contract.{SHARED[value]})")
        if kind == "NUMBER" and text == str(contract.EXIT_BAD_CONFIG):
            found.append(f"line {line}: {text} (contract.EXIT_BAD_CONFIG)")
    assert not found, found


def test_the_pod_and_the_operator_do_not_share_a_metrics_port_variable():
    """One name meant two ports (the operator's own /metrics and a pod's launcher endpoint)."""
    from ddpjob_cli.main import operator

    envvars = {p.envvar for p in operator.params}
    assert contract.ENV_POD_METRICS_PORT not in envvars
    assert "DDPJOB_OPERATOR_METRICS_PORT" in envvars

