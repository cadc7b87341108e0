"""A pass classifies a job's pods once (base/group.py): by attempt, by rank, being deleted or not,
and the last state of those that vanished; nothing else reads a pod's attempt."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ddpjob_api import labels
from ddpjob_operator.base import podinfo
from ddpjob_operator.base.group import Group
from tests.support.builders import make_pod

REPO = Path(__file__).resolve().parents[2]


def unlabelled(rank: int) -> dict:
    pod = make_pod(rank, name=f"x-{rank}")
    del pod["metadata"]["labels"][labels.ATTEMPT]
    return pod


def names(pods) -> list[str]:
    return [podinfo.name(p) for p in pods]


# A restarted job as a pass lists it: attempt 0's failed rank kept for its logs, its other rank
# still terminating, attempt 1 running, and a pod without an attempt label.
POD_LIST = [make_pod(0, attempt=0, phase="Failed", exit_code=1), make_pod(1, attempt=0, deleting=True),
            make_pod(1, attempt=1), make_pod(0, attempt=1, phase="Pending"), unlabelled(0)]


@pytest.mark.parametrize(("attempt", "pods", "active", "ranks"), [
    (1, ["j-1-a1", "j-0-a1"], ["j-1-a1", "j-0-a1"], {1: "j-1-a1", 0: "j-0-a1"}),
    (0, ["j-0", "j-1"], ["j-0"], {0: "j-0", 1: "j-1"}),      # a terminating pod keeps its rank
    (-1, ["x-0"], ["x-0"], {0: "x-0"}),                        # no label: attempt -1
    (2, [], [], {}),                                           # no pod yet
])
def test_each_attempt_has_its_pods_by_rank_and_state(attempt, pods, active, ranks):
    at = Group.of(POD_LIST).at(attempt)
    assert at.number == attempt and names(at.pods) == pods and names(at.active) == active
    assert {r: podinfo.name(p) for r, p in at.by_rank.items()} == ranks


def test_the_whole_group():
    group = Group.of(POD_LIST)
    assert names(group.pods) == names(POD_LIST)
    assert group.names == set(names(POD_LIST))
    assert names(group.live) == ["j-0", "j-1-a1", "j-0-a1", "x-0"]
    assert sorted(group.attempts) == [-1, 0, 1] and group.newest == 1


@pytest.mark.parametrize(("pods", "departed", "newest"), [
    ([], [], None),
    ([unlabelled(0)], [], None),
    ([make_pod(0, attempt=3), make_pod(1, attempt=1)], [], 3),
    ([make_pod(0, attempt=1)], [make_pod(0, attempt=4)], 1),   # a vanished pod's attempt is no claim
])
def test_newest_is_the_newest_listed_attempt(pods, departed, newest):
    assert Group.of(pods, departed=departed).newest == newest


def test_the_first_listed_pod_of_a_rank_is_the_rank():
    stray = make_pod(0, attempt=1, name="stray")
    assert podinfo.name(Group.of([stray, make_pod(0, attempt=1)]).at(1).by_rank[0]) == "stray"
    assert podinfo.name(Group.of([make_pod(0, attempt=1), stray]).at(1).by_rank[0]) == "j-0-a1"


def test_departed_pods_count_under_their_attempt_unless_listed_again():
    lost = make_pod(1, attempt=1, disruption="DeletionByPodGC")
    group = Group.of([make_pod(0, attempt=1), make_pod(0)], departed=[lost, make_pod(0, attempt=1),
                                                                        make_pod(1, attempt=0)])
    assert dict(group.at(1).departed) == {"j-1-a1": lost}
    assert list(group.at(0).departed) == ["j-1"] and group.at(0).pods == (make_pod(0),)
    assert names(group.pods) == ["j-0-a1", "j-0"]   # departed pods are no pods of the group


@pytest.mark.parametrize(("first", "end", "want"), [
    (0, 1, ["j-0", "j-1"]),
    (-1, 1, ["x-0", "j-0", "j-1"]),
    (1, None, ["j-1-a1", "j-0-a1"]),
    (0, None, ["j-0", "j-1", "j-1-a1", "j-0-a1"]),
    (1, 1, []),
])
def test_between(first, end, want):
    assert names(Group.of(POD_LIST).between(first, end)) == want


@pytest.mark.parametrize(("pods", "want"), [
    ([], (-1, [])),
    ([make_pod(0, phase="Pending")], (-1, [])),
    (POD_LIST, (1, ["j-1-a1"])),
    # The new attempt not running yet: the old one's pods still run (a restart in flight).
    ([make_pod(0, attempt=2, phase="Pending"), make_pod(0, attempt=1), make_pod(1, attempt=1)],
     (1, ["j-0-a1", "j-1-a1"])),
    # Being deleted is not running, whatever its phase says.
    ([make_pod(0, attempt=2, deleting=True), make_pod(0, attempt=1)], (1, ["j-0-a1"])),
    ([unlabelled(0), unlabelled(1)], (-1, ["x-0", "x-1"])),
])
def test_running_is_the_newest_attempt_with_running_pods(pods, want):
    attempt, running = Group.of(pods).running()
    assert (attempt, names(running)) == want


def attempt_readers(path: Path) -> list[int]:
    """Lines that read a pod's attempt label: podinfo.attempt, imported or called."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "attempt" and \
                isinstance(node.value, ast.Name) and node.value.id == "podinfo":
            found.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("podinfo") and \
                any(a.name == "attempt" for a in node.names):
            found.append(node.lineno)
    return found


def test_only_the_group_reads_a_pods_attempt():
    """Every decision, builder and view asks the Group for an attempt's pods: a second attempt
    filter is a second truth of which pods are current."""
    readers = {str(p.relative_to(REPO)): attempt_readers(p)
               for root in ("operator/ddpjob_operator", "cli/ddpjob_cli") for p in (REPO / root).rglob("*.py")}
    assert readers["operator/ddpjob_operator/base/group.py"], "the group reads the label through podinfo.attempt"
    assert {p: lines for p, lines in readers.items() if lines and not p.endswith("base/group.py")} == {}
