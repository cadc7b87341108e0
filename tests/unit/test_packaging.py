"""The package as a user gets it (issue 31): `pip install ddpjob` is the CLI and the operator without
torch, the trainer is the `trainer` extra, and the CRD travels in the wheel.

The release path is run for real: an sdist and a wheel built from a copy of the sources (a build
in the checkout would package build/lib's leftovers), installed into a fresh venv outside the
checkout with its dependencies resolved (the machine's uv cache first), then `ddpjob render`,
`ddpjob operator` and `ddpjob run --local` run from a folder of their own.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from tests.unit.test_dockerfile import stages

REPO = Path(__file__).resolve().parents[2]
CRD_RELPATH = Path("charts/ddpjob-operator/crds/ddpjobs.ddpjob.dev.yaml")
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
PACKAGES = {"ddpjob_api": "api", "ddpjob_operator": "operator", "ddpjob_trainer": "trainer", "ddpjob_cli": "cli"}
# The exit guard's sitecustomize imports the environment's own, whatever it is.
NOT_A_DEPENDENCY = {"sitecustomize"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def names(requirements: list[str]) -> set[str]:
    return {norm(re.match(r"[A-Za-z0-9._-]+", r).group(0)) for r in requirements}


CORE = names(PROJECT["dependencies"])
TRAINER = names(PROJECT["optional-dependencies"]["trainer"])


def third_party_imports(package: str) -> set[str]:
    """Distributions a package imports (function-local imports included), by the dev venv's map."""
    found: set[str] = set()
    for path in (REPO / PACKAGES[package] / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    found = {m for m in found if m not in sys.stdlib_module_names and m not in PACKAGES and m not in NOT_A_DEPENDENCY}
    dists = metadata.packages_distributions()
    declared = CORE.union(*(names(v) for v in PROJECT["optional-dependencies"].values()))
    out: set[str] = set()
    for m in found:
        # A namespace several distributions fill (mlflow: mlflow-skinny, mlflow, mlflow-tracing) is
        # there when one of them is declared.
        providers = {norm(d) for d in dists.get(m, [m])}
        out |= (providers & declared) or providers
    return out


def test_the_core_is_what_the_cli_and_operator_import_and_the_trainer_an_extra():
    for package in ("ddpjob_api", "ddpjob_operator", "ddpjob_cli"):
        assert third_party_imports(package) <= CORE, (package, third_party_imports(package) - CORE)
    optional = set().union(*(names(v) for v in PROJECT["optional-dependencies"].values()))
    assert third_party_imports("ddpjob_trainer") <= CORE | optional
    assert {"torch", "torchvision", "scikit-learn", "numpy"} <= TRAINER and not TRAINER & CORE


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel, venv) : the wheel built from an sdist of a source copy, installed in a fresh venv."""
    uv = Path(sys.executable).parent / "uv"
    if not uv.exists():
        pytest.skip("uv is not in the venv (make install puts it there)")
    tmp = tmp_path_factory.mktemp("packaging")

    def uv_run(*args: str) -> None:
        for offline in (["--offline"], []):          # machine cache first, PyPI if it lacks a wheel
            proc = subprocess.run([str(uv), *args, *offline], capture_output=True,
                                  text=True, timeout=300, cwd=tmp)
            if proc.returncode == 0:
                return
        raise AssertionError(f"uv {' '.join(args)}: {proc.stderr[-2000:]}")

    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    for package, folder in PACKAGES.items():
        shutil.copytree(REPO / folder / package, src / folder / package, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    # api/ddpjob_api/crds links to the chart's crds/.
    shutil.copytree(REPO / CRD_RELPATH.parent, src / CRD_RELPATH.parent)
    uv_run("build", "-q", "--out-dir", str(tmp / "dist"), str(src))
    (wheel,) = (tmp / "dist").glob("ddpjob-*.whl")
    venv = tmp / "venv"
    subprocess.run([str(uv), "venv", "-q", "--python", sys.executable, str(venv)], check=True, timeout=120)
    uv_run("pip", "install", "-q", "--python", str(venv / "bin" / "python"), str(wheel))
    return wheel, venv


def test_the_wheel_carries_the_crd_the_license_and_the_trainer_as_an_extra(installed):
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as z:
        files = set(z.namelist())
        meta = next(z.read(n).decode() for n in files if n.endswith(".dist-info/METADATA"))
    # The one packaged copy: the trainer and the operator validate with it (ddpjob_api.crdschema).
    assert f"ddpjob_api/crds/{CRD_RELPATH.name}" in files and any(n.endswith(".dist-info/licenses/LICENSE") for n in files)
    assert "License-Expression: Apache-2.0" in meta
    assert {"Homepage", "Documentation", "Issues"} <= set(re.findall(r"^Project-URL: (\w+),", meta, re.M))
    core = {norm(m) for m in re.findall(r"^Requires-Dist: ([A-Za-z0-9._-]+)[^;\n]*$", meta, re.M)}
    # `; extra == "trainer"`, or with a marker of its own: `; (python_version == ...) and extra == "trainer"`.
    trainer = {norm(m) for m in re.findall(r'^Requires-Dist: ([A-Za-z0-9._-]+).*;.*\bextra == "trainer"$', meta, re.M)}
    assert core == CORE and trainer == TRAINER


def test_pip_install_ddpjob_brings_no_torch(installed):
    _, venv = installed
    py = str(venv / "bin" / "python")
    probe = subprocess.run([py, "-c", "import torch"], capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr
    listed = subprocess.run([py, "-c", "import importlib.metadata as m\n"
                             "for d in m.distributions(): print(d.metadata['Name'])"],
                            capture_output=True, text=True, timeout=60, check=True).stdout.split()
    present = {norm(n) for n in listed}
    assert not present & TRAINER and not {n for n in present if n.startswith("nvidia-")}, present
    site = next((venv / "lib").glob("python*/site-packages"))
    size = sum(f.stat().st_size for f in site.rglob("*") if f.is_file() and not f.is_symlink())
    try:
        torch_dir = Path(metadata.distribution("torch").locate_file("torch"))
    except metadata.PackageNotFoundError:
        return
    # The whole install, next to torch alone (either build: CPU or CUDA).
    torch_size = sum(f.stat().st_size for f in torch_dir.rglob("*") if f.is_file())
    assert size * 4 < torch_size, (size, torch_size)


def run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    # Nothing may point back into the checkout: no CRD path, no PYTHONPATH, no active venv.
    env = {k: v for k, v in os.environ.items() if k not in ("DDPJOB_CRD_PATH", "PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(venv / "bin" / args[0]), *args[1:]], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


@pytest.fixture
def workdir(tmp_path):
    shutil.copy2(REPO / "examples" / "digits.yaml", tmp_path / "digits.yaml")
    return tmp_path


def test_render_outside_the_checkout_uses_the_packaged_crd(installed, workdir):
    _, venv = installed
    trainer = run(venv, "python", "-c", "from ddpjob_api import crdschema\n"
                  "print(crdschema.crd_path().resolve(), crdschema.trainer_schema()['type'])", cwd=workdir)
    assert trainer.returncode == 0 and trainer.stdout.split()[1] == "object", trainer
    assert Path(trainer.stdout.split()[0]).is_relative_to(venv), trainer
    rendered = run(venv, "ddpjob", "render", "digits.yaml", "-n", "x", cwd=workdir)
    assert rendered.returncode == 0, rendered.stderr[-2000:]
    kinds = re.findall(r"^kind: (\w+)$", rendered.stdout, re.M)
    assert kinds == ["Service", "Pod", "Pod"], kinds


def test_the_operator_entry_runs_without_torch(installed, workdir):
    _, venv = installed
    imported = run(venv, "python", "-c", "import ddpjob_operator.app.operator_main, ddpjob_operator.app.handlers, "
                   "ddpjob_operator.cluster.monitor", cwd=workdir)
    assert imported.returncode == 0, imported.stderr[-2000:]
    assert run(venv, "ddpjob", "operator", "--help", cwd=workdir).returncode == 0
    unnamed = run(venv, "ddpjob", "operator", cwd=workdir)  # the CLI's own refusal, past every import
    assert unnamed.returncode == 2 and "--all-namespaces" in unnamed.stderr, unnamed.stderr[-2000:]


def test_a_local_run_without_the_trainer_extra_says_what_to_install(installed, workdir):
    _, venv = installed
    ran = run(venv, "ddpjob", "run", "digits.yaml", "--local", "--no-progress", cwd=workdir)
    assert ran.returncode == 2 and "pip install 'ddpjob[trainer]'" in ran.stderr, ran.stderr[-2000:]
    assert "torch" in ran.stderr and "Traceback" not in ran.stderr


def test_the_images_build_the_same_package():
    """The wheel stage has what the build reads (LICENSE: license-files), and the trainer image
    installs the trainer extra (the operator's pins come from requirements/operator.txt)."""
    st = stages()
    assert any(line.startswith("COPY ") and "LICENSE" in line.split() for line in st["wheel"])
    # The packages' crds/ links resolve in the wheel stage: the trainer reads its config schema there.
    assert any(line.startswith("COPY ") and str(CRD_RELPATH) in line for line in st["wheel"])
    assert any("pip install" in line and "[trainer]" in line for line in st["trainer"])
