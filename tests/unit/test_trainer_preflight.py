"""The launcher's pre-flight: every feature a spec.trainer turns on is checked against the image
(imports, compilers, headers) before any rendezvous, and a missing piece names the field."""
from __future__ import annotations

import pytest

from ddpjob_trainer.launch import preflight
from ddpjob_trainer.config import parse_config
from ddpjob_trainer.errors import ConfigError

MLFLOW = {"mlflow": {"trackingUri": "file:///tmp/mlruns"}}
COMPILE = {"compile": True}
ALL_TOOLS = {"g++", "gcc", "clang", "cc"}
NO_MODULE = "ModuleNotFoundError: No module named"


def run(raw, *, broken=(), tools=ALL_TOOLS, header=True, environ=None):
    """problems() for spec.trainer `raw` in an image where the modules in `broken` fail to import,
    only `tools` are on PATH and Python.h exists when `header`; also what was probed."""
    probed = []

    def import_errors(mods):
        probed.extend(mods)
        return {m: f"{NO_MODULE} '{m}'" for m in mods if m in broken}

    found = preflight.problems(parse_config(raw), import_errors=import_errors,
                               which=lambda exe: f"/usr/bin/{exe}" if exe in tools else None,
                               exists=lambda _path: header, environ=environ or {})
    return found, probed


@pytest.mark.parametrize("raw,broken,tools,header,fields,says", [
    # Nothing optional turned on: nothing probed, nothing needed.
    ({}, {"mlflow", "torch._inductor"}, set(), False, [], []),
    ({"compile": False, "mlflow": None}, {"mlflow"}, set(), False, [], []),
    # mlflow
    (MLFLOW, set(), set(), False, [], []),
    (MLFLOW, {"mlflow"}, ALL_TOOLS, True, ["spec.trainer.mlflow"], ["mlflow does not import", "mlflow-skinny"]),
    # compile: the import, each compiler, the headers
    (COMPILE, set(), ALL_TOOLS, True, [], []),
    (COMPILE, set(), {"g++", "clang"}, True, [], []),          # triton takes clang when there is no gcc
    (COMPILE, {"torch._inductor"}, ALL_TOOLS, True, ["spec.trainer.compile"], ["torch._inductor does not import"]),
    (COMPILE, set(), {"gcc"}, True, ["spec.trainer.compile"], ["no C++ compiler", "g++ is not on PATH"]),
    (COMPILE, set(), {"g++"}, True, ["spec.trainer.compile"], ["no C compiler", "gcc or clang"]),
    (COMPILE, set(), ALL_TOOLS, False, ["spec.trainer.compile"], ["no Python headers", "Python.h"]),
    (COMPILE, set(), set(), False, ["spec.trainer.compile"], ["no C++ compiler", "no C compiler", "no Python headers"]),
    # both at once: one message per field, each naming it
    ({**MLFLOW, **COMPILE}, {"mlflow"}, set(), True, ["spec.trainer.mlflow", "spec.trainer.compile"],
     ["mlflow does not import", "no C++ compiler"]),
])
def test_each_feature_needs_what_it_imports_and_runs(raw, broken, tools, header, fields, says):
    found, probed = run(raw, broken=broken, tools=tools, header=header)
    assert [m.split(":", 1)[0] for m in found] == fields, found
    text = "\n".join(found)
    for words in says:
        assert words in text, found
    if not raw.get("mlflow") and not raw.get("compile"):
        assert probed == [], "a job that turns nothing on pays for no import"


def test_the_compilers_are_looked_up_as_inductor_and_triton_do():
    """CXX and CC win over the defaults, as they do for inductor and triton."""
    found, _ = run(COMPILE, tools={"clang++", "clang"}, environ={"CXX": "clang++", "CC": "clang"})
    assert found == []
    found, _ = run(COMPILE, tools=ALL_TOOLS, environ={"CXX": "/opt/gcc/bin/g++-13", "CC": "icx"})
    assert "/opt/gcc/bin/g++-13 is not on PATH" in found[0] and "icx is not on PATH" in found[0]


def test_check_raises_one_config_error_naming_every_field(monkeypatch):
    monkeypatch.setattr(preflight, "problems", lambda cfg: ["spec.trainer.mlflow: a", "spec.trainer.compile: b"])
    with pytest.raises(ConfigError, match=r"^spec.trainer.mlflow: a \| spec.trainer.compile: b$"):
        preflight.check(parse_config({}))


def test_import_errors_tries_each_module_in_a_fresh_interpreter():
    """The real probe: what imports is absent, what does not says why."""
    got = preflight.import_errors(["json", "ddpjob_no_such_module", "ddpjob_trainer.config"])
    assert got == {"ddpjob_no_such_module": f"{NO_MODULE} 'ddpjob_no_such_module'"}
    assert preflight.import_errors([]) == {}
