"""One pod per node, as the real kube-scheduler places a job's pods (spec.scheduling.onePodPerNode).

The job asks for more pods than it has nodes: two kwok nodes of this test's own (labelled and
tainted for it, so other tests' pods neither land there nor crowd it), three pods. Held to one pod
per node, two run on two nodes and the scheduler refuses the third; relaxed, all three run and two
share a node, which is what the old preference-only spread allowed for any job.
"""
from __future__ import annotations

from tests.cluster.conftest import wait_for
from tests.cluster.test_node_loss import own_nodes  # noqa: F401  (fixture)
from tests.cluster.test_operator import crd, k8s, start_operator  # noqa: F401  (fixtures)


def placement(tag: str, **extra) -> dict:
    return {"nodeSelector": {"ddpjob.dev/test-node": tag},
            "tolerations": [{"key": "ddpjob.dev/test-node", "operator": "Exists", "effect": "NoSchedule"}], **extra}


def scheduled(pod) -> tuple[str, str, str] | None:
    """The pod's PodScheduled condition (status, reason, message), once the scheduler has set it."""
    cond = next((c for c in (pod.status.conditions or []) if c.type == "PodScheduled"), None)
    return (cond.status, cond.reason or "", cond.message or "") if cond else None


def test_two_pods_of_a_job_never_share_a_node(own_nodes, start_operator, k8s):
    tag, make_node = own_nodes
    nodes = {make_node("a"), make_node("b")}
    start_operator()
    k8s.apply("spread", nodes=3, gpusPerNode=0, scheduling=placement(tag))

    def settled():
        # Every pod placed or refused by the scheduler: nothing left for it to decide.
        pods = k8s.pods("spread")
        return pods if len(pods) == 3 and all(p.spec.node_name or scheduled(p) for p in pods) else None
    pods = wait_for(settled, timeout=60, desc="the scheduler has placed or refused every pod of spread")
    on = [p.spec.node_name for p in pods if p.spec.node_name]
    assert len(on) == 2 and set(on) == nodes, on
    (refused,) = [p for p in pods if not p.spec.node_name]
    status, reason, message = scheduled(refused)
    assert (status, reason) == ("False", "Unschedulable"), (status, reason, message)
    assert "topology spread" in message, message
    # The job says why it waits (the scheduler's words), and a pod placed later still has a node of
    # its own: a third node lets the refused pod run there.
    k8s.wait_status("spread", lambda s: any(c["type"] == "Unschedulable" and c["status"] == "True"
                                            for c in s.get("conditions", [])), "Unschedulable", timeout=40)
    third = make_node("c")
    wait_for(lambda: all(p.spec.node_name for p in k8s.pods("spread")), timeout=60, desc="all 3 pods placed")
    assert sorted(p.spec.node_name for p in k8s.pods("spread")) == sorted(nodes | {third})


def test_relaxed_pods_may_share_a_node(own_nodes, start_operator, k8s):
    tag, make_node = own_nodes
    nodes = {make_node("a"), make_node("b")}
    start_operator()
    k8s.apply("packed", nodes=3, gpusPerNode=0, scheduling=placement(tag, onePodPerNode=False))
    pods = wait_for(lambda: (lambda ps: ps if len(ps) == 3 and all(p.spec.node_name for p in ps) else None)(
        k8s.pods("packed")), timeout=60, desc="all 3 pods of packed placed")
    on = [p.spec.node_name for p in pods]
    assert set(on) == nodes and len(set(on)) == 2, on   # still spread as far as it goes
    (rule,) = pods[0].spec.topology_spread_constraints
    assert rule.when_unsatisfiable == "ScheduleAnyway"
