"""The typed spec (api/ddpjob_api/specgen.py) is what hack/gen-spec.py makes of the CRD now, and it
applies the CRD's defaults as the API server does: a DDPJob read from a cluster and one that never
met an API server (`ddpjob run --local`, `ddpjob render`) are the same job."""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import yaml

from ddpjob_api import specgen
from ddpjob_api.validation import apply_defaults
from tests.support.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
gen_spec = load_script("gen_spec", "hack/gen-spec.py")


def test_generated_spec_is_current():
    assert gen_spec.OUT.read_text() == gen_spec.generate(), \
        f"{gen_spec.OUT.relative_to(REPO)} is stale: run `make spec`"


def test_a_default_follows_the_crd():
    text = gen_spec.CRD.read_text().replace("default: 9400", "default: 9401", 1)
    assert text != gen_spec.CRD.read_text()
    assert "metrics_port: int = 9401" in gen_spec.generate(text)


def _defaulted_fields(node, path=()):
    for key, sub in (node.get("properties") or {}).items():
        if "default" in sub:
            yield path + (key,)
        yield from _defaulted_fields(sub, path + (key,))


def test_every_crd_default_is_a_typed_default():
    crd = yaml.load(gen_spec.CRD.read_text(), Loader=yaml.CSafeLoader)
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    # Every object that holds a default present, so that the API server fills in each one.
    given = {"image": "i", "rdma": {"resource": "r"}, "faultTolerance": {"mode": "perStep"}}
    bare = specgen.DDPJobSpec.from_dict(given)
    stored = apply_defaults({"spec": given})["spec"]
    checked = 0
    for path in _defaulted_fields(schema):
        typed, raw = bare, stored
        for key in path:
            typed, raw = getattr(typed, gen_spec.snake(key)), raw[key]
        if not dataclasses.is_dataclass(typed):
            assert typed == raw, path
            checked += 1
    assert checked >= 12


@pytest.mark.parametrize("spec", [
    {"image": "i"},
    {"image": "i", "failurePolicy": None, "suspend": None, "nodes": None},
    {"image": "i", "failurePolicy": {"maxRestarts": 0}, "rdma": {"resource": "r"}, "nprocPerNode": 2},
])
def test_from_dict_is_the_api_servers_defaulting(spec):
    """Absent and null both take the default (the API server prunes a null before defaulting)."""
    written = specgen.DDPJobSpec.from_dict(copy.deepcopy(spec))
    stored = specgen.DDPJobSpec.from_dict(apply_defaults({"spec": {k: v for k, v in spec.items() if v is not None}})["spec"])
    assert written == stored


def test_open_objects_stay_dicts():
    spec = specgen.DDPJobSpec.from_dict({"image": "i", "trainer": {"epochs": 2}, "nccl": {"X": 1},
                                         "template": {"spec": {"hostPID": True}}, "podLabels": {"a": "b"}})
    assert (spec.trainer, spec.nccl, spec.template, spec.pod_labels) == (
        {"epochs": 2}, {"X": 1}, {"spec": {"hostPID": True}}, {"a": "b"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.nodes = 2  # type: ignore[misc]


def test_the_trainers_master_port_fallback_is_the_crds_default():
    """The launcher's MASTER_PORT when the operator set none is spec.masterPort's default, written in
    the contract too because the trainer's pods do not read the CRD."""
    from ddpjob_api import contract

    assert specgen.DDPJobSpec.from_dict({"image": "i"}).master_port == contract.DEFAULT_MASTER_PORT


def test_a_required_field_absent_is_named():
    with pytest.raises(KeyError, match="image"):
        specgen.DDPJobSpec.from_dict({"nodes": 2})
    with pytest.raises(KeyError, match="resource"):
        specgen.DDPJobSpec.from_dict({"image": "i", "rdma": {"devicesPerNode": 2}})
