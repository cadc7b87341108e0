"""bench/provenance.py: a result under bench/results/ comes from a clean tree at its commit, and
says so (commit, command, machine, load); a scratch result from a dirty tree lists what was
uncommitted. Against a real git repository in a temp dir."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from tests.support.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
provenance = load_script("bench_provenance", "bench/provenance.py")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    git(tmp_path, "init", "-q")
    for path in ("operator/a.py", "docs/x.md", "bench/b.py", "bench/results/old.json"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("1\n")
    (tmp_path / ".gitignore").write_text(".venv/\n")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "one")
    return tmp_path


def prov(repo: Path, out: str = "bench/results/r.json"):
    return provenance.Provenance("operator", "bench", out=repo / out, repo=repo,
                                 argv=[str(repo / "bench" / "b.py"), "--repeat", "3", "a b"])


def test_a_clean_tree_writes_its_result_with_commit_command_machine_and_load(repo):
    path = prov(repo).write({"ratio": 0.5})
    data = json.loads(path.read_text())
    got = data["provenance"]
    assert data["ratio"] == 0.5 and path == repo / "bench/results/r.json"
    assert got["commit"] == git(repo, "rev-parse", "HEAD")
    assert got["command"] == "bench/b.py --repeat 3 'a b'"
    assert got["measured_paths"] == ["operator", "bench"]
    assert got["machine"]["cpus"] >= 1 and got["machine"]["memory_gib"] > 0
    assert set(got["load_1min"]) == {"before", "after"} and "uncommitted" not in got


@pytest.mark.parametrize("change", ["operator/a.py", "operator/new.py", "bench/b.py"])
def test_an_uncommitted_change_under_a_measured_path_is_refused_before_the_bench_runs(repo, change):
    (repo / change).write_text("2\n")
    with pytest.raises(provenance.UncommittedChanges, match=change):
        prov(repo)


def test_changes_elsewhere_results_and_ignored_files_do_not_count(repo):
    (repo / "docs/x.md").write_text("2\n")                  # not measured
    (repo / "bench/results/old.json").write_text("2\n")     # what benches write
    (repo / ".venv").mkdir()
    (repo / ".venv/x.py").write_text("ignored\n")
    p = prov(repo)
    assert p.uncommitted() == []
    p.write({})


def test_a_change_made_while_the_bench_runs_refuses_the_write(repo):
    p = prov(repo)
    (repo / "operator/a.py").write_text("2\n")
    with pytest.raises(provenance.UncommittedChanges, match="operator/a.py"):
        p.write({})
    assert not (repo / "bench/results/r.json").exists()


def test_a_new_commit_while_the_bench_runs_refuses_the_write(repo):
    p = prov(repo)
    (repo / "docs/x.md").write_text("2\n")
    git(repo, "commit", "-qam", "two")
    with pytest.raises(provenance.UncommittedChanges, match="HEAD moved"):
        p.write({})


def test_a_scratch_result_from_a_dirty_tree_is_written_listing_the_changes(repo):
    (repo / "operator/a.py").write_text("2\n")
    data = json.loads(prov(repo, out="scratch/r.json").write({}).read_text())
    assert data["provenance"]["uncommitted"] == ["operator/a.py"]


def test_a_copy_without_git_names_its_commit_by_env(tmp_path, monkeypatch):
    (tmp_path / "bench").mkdir()
    monkeypatch.delenv(provenance.COMMIT_ENV, raising=False)
    with pytest.raises(provenance.UncommittedChanges, match=provenance.COMMIT_ENV):
        prov(tmp_path)
    monkeypatch.setenv(provenance.COMMIT_ENV, "abc123")
    got = json.loads(prov(tmp_path).write({}).read_text())["provenance"]
    assert got["commit"] == "abc123" and provenance.COMMIT_ENV in got["commit_from"]
