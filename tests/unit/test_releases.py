"""The previous release's source, as the upgrade test builds it, is that release's tree.

tests/realpods/test_upgrade.py builds release PREVIOUS_RELEASE (hack/versions.env) from
tests/realpods/fixtures/ddpjob-<version>-src.tar.gz, so that a shallow clone (no tag, no old commit)
can still run it. This holds the archive equal to `git archive` of the recorded commit, file by
file, wherever the history is there to compare with.
"""
from __future__ import annotations

import io
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PINS = dict(re.findall(r"^([A-Z_]+)=(\S+)$", (REPO / "hack" / "versions.env").read_text(), re.M))
VERSION, COMMIT = PINS["PREVIOUS_RELEASE"], PINS["PREVIOUS_RELEASE_COMMIT"]
FIXTURE = REPO / "tests" / "realpods" / "fixtures" / f"ddpjob-{VERSION}-src.tar.gz"
# What an image build and the chart need (the Dockerfile's context, its allow-list, the chart).
PATHS = ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "LICENSE", "operator", "trainer", "cli",
         "requirements", "charts/ddpjob-operator")


def members(tar: tarfile.TarFile) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for m in tar.getmembers():
        if m.isfile():
            out[m.name] = tar.extractfile(m).read()
        elif m.issym():
            out[m.name] = "-> " + m.linkname
    return out


def test_the_fixture_is_the_previous_release_at_its_version():
    with tarfile.open(FIXTURE) as tar:
        files = members(tar)
    assert f'version = "{VERSION}"' in files[f"ddpjob-{VERSION}/pyproject.toml"].decode()
    assert f"appVersion: \"{VERSION}\"" in files[f"ddpjob-{VERSION}/charts/ddpjob-operator/Chart.yaml"].decode()


def test_the_fixture_is_the_tagged_tree():
    have = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{COMMIT}^{{commit}}"], capture_output=True)
    if have.returncode != 0:
        pytest.skip(f"commit {COMMIT} (release {VERSION}) is not in this clone (shallow): nothing to compare with")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", f"--prefix=ddpjob-{VERSION}/", COMMIT, *PATHS],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        want = members(tar)
    with tarfile.open(FIXTURE) as tar:
        got = members(tar)
    assert sorted(got) == sorted(want)
    assert [name for name in want if got[name] != want[name]] == []
