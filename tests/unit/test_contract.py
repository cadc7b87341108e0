"""The names operator, local runner, launcher and trainer share are spelled once, in
api/ddpjob_api/contract.py (the API package none of them owns): a second spelling could drift from the first without any test noticing
(the pod would get one env name and the launcher read another). Each side of the contract's other
parts (the launcher's path, the stages, the run's result) is held to it here; the metric names
by tests/unit/test_scrape.py (every series the scraper reads is in a real rank's exposition)."""
from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import tokenize
from pathlib import Path

import pytest

from ddpjob_api import contract

REPO = Path(__file__).resolve().parents[2]
PRODUCT = sorted(p for d in ("operator/ddpjob_operator", "trainer/ddpjob_trainer", "cli/ddpjob_cli")
                 for p in (REPO / d).rglob("*.py"))
SHARED = {value: name for name, value in vars(contract).items()
          if name.startswith(("ENV_", "PET_", "METRIC_", "LAUNCHER_MODULE"))}


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


def test_the_pods_command_is_the_contracts_launcher_and_runs_as_a_module():
    from ddpjob_operator.builders import pods

    assert list(contract.LAUNCHER) == pods.LAUNCHER
    assert contract.LAUNCHER[:2] == ("python", "-m") and contract.LAUNCHER[-1] == "--"
    # `python -m` runs a package through its __main__ (tests/unit/test_dockerfile.py: the image's ENTRYPOINT).
    assert importlib.util.find_spec(contract.LAUNCHER_MODULE + ".__main__") is not None


@pytest.mark.parametrize("stage", contract.STAGES)
def test_every_stage_a_rank_may_enter_is_one_the_operator_reads(stage):
    from ddpjob_operator.decisions.samples import parse_metrics
    from ddpjob_trainer.telemetry import Telemetry

    Telemetry(labels={}, enabled=False).set_stage(stage)  # the trainer refuses any other
    text = f'{contract.METRIC_PREFIX}{contract.STAGE}{{rank="0",stage="{stage}"}} 1\n'
    assert parse_metrics(text)[0].stage == stage


def test_a_stage_outside_the_contract_is_refused_by_the_trainer():
    from ddpjob_trainer.telemetry import Telemetry

    with pytest.raises(ValueError, match="unknown stage 'warming_up'; one of waiting_for_master, "):
        Telemetry(labels={}, enabled=False).set_stage("warming_up")


def test_the_result_the_trainer_writes_is_what_the_operator_reads_into_status():
    from ddpjob_api import crdschema as crd
    from ddpjob_operator.decisions.result import RESULT_FIELDS, parse_result

    written = {f.name for f in dataclasses.fields(contract.RunResult)}
    # Every number of the result reaches status.result; the last checkpoint is a path, the run id an id.
    assert set(RESULT_FIELDS) == written - {"last_checkpoint"}
    status = crd.version_schema()["properties"]["status"]["properties"]["result"]["properties"]
    assert set(RESULT_FIELDS.values()) == set(status)
    result = contract.RunResult(steps=10, total_steps=10, epochs_completed=2, world_size=4, resumed_from_step=5,
                                train_samples_per_second=99.5, eval_accuracy=0.75, eval_loss=0.5, eval_samples=40,
                                eval_dataset_size=40, last_checkpoint="/ckpt/step-10")
    message = json.dumps({**dataclasses.asdict(result), contract.RESULT_MLFLOW_RUN_ID: "r1"})
    assert set(parse_result(message)) == set(status)
    # An integer of the trainer's is an integer of the status (result.py derives which from RunResult).
    assert {k: type(v) for k, v in parse_result(message).items()} == \
        {k: int if s["type"] == "integer" else float for k, s in status.items()}


@pytest.mark.parametrize("code, step, head", [
    (1, 43, "training exited with code 1 at step 43"),
    (-9, None, "training exited with code -9"),
    (2, 0, "training exited with code 2 at step 0"),
])
def test_a_failed_nodes_step_goes_out_on_its_termination_message_and_comes_back(code, step, head):
    from ddpjob_api import contract
    from ddpjob_trainer.launch.report import failure_message

    assert contract.failure_head(code, step) == head
    msg = failure_message(code, ["rank 1 failed:\nTraceback ...\nRuntimeError: boom"], step=step)
    assert msg.startswith(head + "\n") and contract.failure_step(msg) == step


@pytest.mark.parametrize("message", [None, "", "rank 1 failed", "training exited with code 1 at step x",
                                     "Traceback\ntraining exited with code 1 at step 5"])
def test_a_message_without_the_head_names_no_step(message):
    from ddpjob_api import contract

    assert contract.failure_step(message) is None


def _reason_words() -> dict[str, str]:
    """The operator's own reasons, by value: those no other vocabulary shares (a phase, a condition
    type and Kubernetes' own pod words are spelled the same, so a literal of theirs proves nothing)."""
    from ddpjob_api import phases

    # Kubernetes says Unschedulable (PodScheduled) and NodeLost (a pod's status.reason) too.
    shared = {w.value for e in (phases.Phase, phases.Cond) for w in e} | {"Unschedulable", "NodeLost"}
    return {w.value: f"{e.__name__}.{w.name}" for e in (phases.FailReason, phases.Recovery, phases.Signal,
                                                          phases.RestartReason, phases.Reason)
            for w in e if w.value not in shared}


def test_the_reason_words_are_found():
    words = _reason_words()
    assert {"BadConfiguration", "Straggler", "RestartingInPlace", "Replace"} <= set(words)


@pytest.mark.parametrize("path", PRODUCT, ids=lambda p: str(p.relative_to(REPO)))
def test_no_reason_is_spelled_outside_the_api(path):
    """A reason the operator writes is an Enum member of ddpjob_api.phases, never a second spelling."""
    words = _reason_words()
    found = [f"line {line}: {text} ({words[text.strip(chr(34) + chr(39))]})" for line, kind, text in literals(path)
             if kind == "STRING" and text.strip("'\"") in words]
    assert not found, found


def test_the_alerts_hang_default_is_the_contracts():
    """The stall alert's threshold for a job that sets no spec.hangTimeoutSeconds is the operator's
    and the agents' (contract.STARTUP_HANG_TIMEOUT); Prometheus' rule file cannot import it."""
    import re

    import yaml

    rules = yaml.safe_load((REPO / "charts/ddpjob-operator/rules/ddpjob-alerts.yaml").read_text())
    (expr,) = [r["expr"] for g in rules["groups"] for r in g["rules"] if r.get("record") == "ddpjob:hang_timeout_seconds"]
    assert [float(s) for s in re.findall(r"\* 0 \+ (\d+)\)", expr)] == [contract.STARTUP_HANG_TIMEOUT], expr
