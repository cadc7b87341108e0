"""The CRD file itself: names, structure, defaults, CEL rules and printer columns."""
from __future__ import annotations

import pytest

from ddpjob_api import crdschema as crd
from ddpjob_api.phases import Phase


@pytest.fixture(scope="module")
def doc():
    return crd.load_crd()


def test_names_and_scope(doc):
    names = doc["spec"]["names"]
    assert doc["metadata"]["name"] == "ddpjobs.ddpjob.dev"
    assert (doc["spec"]["group"], doc["spec"]["scope"]) == ("ddpjob.dev", "Namespaced")
    assert (names["kind"], names["plural"], names["shortNames"]) == ("DDPJob", "ddpjobs", ["ddpj"])


def test_status_subresource_and_declared_status(doc):
    (ver,) = doc["spec"]["versions"]
    assert ver["name"] == "v1alpha1" and ver["subresources"] == {"status": {}}
    status = ver["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert set(status["phase"]["enum"]) == {p.value for p in Phase}
    for key in ("conditions", "nodes", "restarts", "masterAddr", "progress", "startTime", "completionTime",
                "observedGeneration", "attempt"):
        assert key in status, key
    for key in ("epoch", "step", "totalSteps", "loss", "samplesPerSecond", "eta", "lastStepTime"):
        assert key in status["progress"]["properties"], key


def test_printer_columns(doc):
    cols = {c["name"]: c["jsonPath"] for c in doc["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert cols["Phase"] == ".status.phase" and cols["Restarts"] == ".status.restarts"
    assert cols["Ready"] == ".status.nodes.ready" and cols["Age"] == ".metadata.creationTimestamp"
    assert "Progress" in cols


def _rules(node, out):
    if isinstance(node, dict):
        for rule in node.get("x-kubernetes-validations", []):
            out.append(rule)
        for value in node.values():
            _rules(value, out)
    elif isinstance(node, list):
        for value in node:
            _rules(value, out)
    return out


def test_every_cel_rule_has_a_message_naming_a_field(doc):
    rules = _rules(doc["spec"]["versions"][0]["schema"], [])
    assert len(rules) >= 15
    for rule in rules:
        assert rule["message"].startswith(("spec.", "metadata.name")), rule


@pytest.mark.parametrize("field", ["nodes", "nprocPerNode", "gpusPerNode", "image", "command", "trainer",
                                   "elastic", "scheduling.gang"])
def test_immutable_fields_have_transition_rules(doc, field):
    rules = _rules(doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"], [])
    assert any("oldSelf" in r["rule"] and f"spec.{field} is immutable" in r["message"] for r in rules)
    assert not any("suspend" in r["rule"] and "oldSelf" in r["rule"] for r in rules)


def test_crd_path_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv(crd.CRD_ENV, str(tmp_path / "missing.yaml"))
    with pytest.raises(FileNotFoundError, match="DDPJOB_CRD_PATH"):
        crd.crd_path()
    copy = tmp_path / "crd.yaml"
    copy.write_text(crd.CRD_FILE.name)
    monkeypatch.setenv(crd.CRD_ENV, str(copy))
    assert crd.crd_path() == copy
