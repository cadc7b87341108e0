"""The pods the operator renders are admitted by the real API server under Pod Security "restricted"."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.cluster import REPO_ROOT, create_namespace, delete_namespace

EXAMPLES = ["digits.yaml", "resnet-gpu.yaml", "custom-script.yaml"]
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}


@pytest.fixture
def restricted_ns(api):
    name = create_namespace(api, prefix="psa-", labels=RESTRICTED)
    yield name
    delete_namespace(api, name)


def render(path, namespace) -> str:
    """`ddpjob render` as a user runs it (the CLI, not the library)."""
    proc = subprocess.run([str(Path(sys.executable).with_name("ddpjob")), "render", str(path), "-n", namespace],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("example", EXAMPLES)
def test_builtin_examples_are_admitted_under_restricted(cluster, restricted_ns, example):
    objs = render(REPO_ROOT / "examples" / example, restricted_ns)
    proc = cluster.kubectl("create", "-n", restricted_ns, "-f", "-", input=objs, check=False)
    # PodSecurity refuses with 403 "violates PodSecurity"; a warning alone would also show on stderr.
    assert proc.returncode == 0 and "PodSecurity" not in proc.stderr, proc.stderr
    pods = [d for d in yaml.safe_load_all(objs) if d and d["kind"] == "Pod"]
    names = cluster.kubectl("get", "pods", "-n", restricted_ns, "-o", "name").stdout.split()
    assert sorted(names) == sorted(f"pod/{p['metadata']['name']}" for p in pods)


def test_a_per_step_jobs_lighthouse_is_admitted_under_restricted(cluster, restricted_ns, tmp_path):
    """The Lighthouse pod (and Service) a spec.faultTolerance job adds pass restricted like its training pods."""
    job = {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": "ft"},
           "spec": {"image": "reg/trainer:1", "nodes": 2, "faultTolerance": {"mode": "perStep"}}}
    path = tmp_path / "ft.yaml"
    path.write_text(yaml.safe_dump(job))
    objs = render(path, restricted_ns)
    assert "ddpjob_trainer.lighthouse" in objs
    proc = cluster.kubectl("create", "-n", restricted_ns, "-f", "-", input=objs, check=False)
    assert proc.returncode == 0 and "PodSecurity" not in proc.stderr, proc.stderr
    names = cluster.kubectl("get", "pods", "-n", restricted_ns, "-o", "name").stdout.split()
    assert sorted(names) == ["pod/ft-0", "pod/ft-1", "pod/ft-ft"]


def test_a_job_that_asks_for_privilege_is_refused_there(cluster, restricted_ns, tmp_path):
    """The control: the namespace really enforces, and the job's own securityContext wins over ours."""
    job = {"apiVersion": "ddpjob.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": "loud"},
           "spec": {"image": "reg/trainer:1", "nodes": 1,
                    "securityContext": {"allowPrivilegeEscalation": True}}}
    path = tmp_path / "loud.yaml"
    path.write_text(yaml.safe_dump(job))
    proc = cluster.kubectl("create", "-n", restricted_ns, "-f", "-", input=render(path, restricted_ns),
                           check=False)
    assert proc.returncode != 0 and "allowPrivilegeEscalation" in proc.stderr, proc.stderr
