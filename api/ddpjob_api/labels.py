"""Label and annotation keys on the operator's children."""
from __future__ import annotations

import re

JOB_NAME = "ddpjob.dev/job-name"
NODE_RANK = "ddpjob.dev/node-rank"
ATTEMPT = "ddpjob.dev/attempt"
# A pod that replaced a lost one of its rank within the attempt: the how-manyth (absent: the first pod).
REPLACEMENT = "ddpjob.dev/replacement"
# Pod annotations: the restart counters before the pod's attempt, the operator's own record of
# them (lifecycle.trusted_counters), out of reach of whoever may edit the DDPJob's status.
RESTARTS = "ddpjob.dev/restarts"
COUNTED_RESTARTS = "ddpjob.dev/counted-restarts"
# What a pod of a per-step job (spec.faultTolerance) is: one of its training pods, or its torchft
# Lighthouse. The Lighthouse carries the job-name label too (the operator's pod watch sees it and a
# deleted one wakes the job's pass), so whatever selects a job's training pods by label leaves
# role=lighthouse out: the pass (base/podinfo.lighthouse), the headless Service and the pods' spread
# (role=trainer, per-step jobs only), `ddpjob` (training_selector). Pods of other jobs carry no role.
ROLE = "ddpjob.dev/role"
ROLE_TRAINER = "trainer"
ROLE_LIGHTHOUSE = "lighthouse"
MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "ddpjob-operator"
CONTAINER = "trainer"


# Keys the operator owns, as the CRD's CEL rules write them (one home: the CRD's rules are checked
# against these by tests/unit/test_pod_hardening.py). An annotation or label under ddpjob.dev/
# (sub-domains included) is the operator's.
RESERVED_KEY_PATTERN = "^([^/]*[.])?ddpjob[.]dev/"
# A label key is also the operator's when Prometheus' Kubernetes discovery would read it as one
# of ours: it exposes pod labels as __meta_kubernetes_pod_label_<key with every character outside
# [A-Za-z0-9_] made "_">, so ddpjob-dev/job-name and ddpjob_dev_job_name land on the same meta
# label as ddpjob.dev/job-name, which the PodMonitor relabels into `ddpjob`: which pod label
# wins would be arbitrary, and a job's series could pose as another job's.
RESERVED_LABEL_PATTERN = "^(([^/]*[.])?ddpjob[.]dev/|ddpjob[^a-zA-Z0-9]dev[^a-zA-Z0-9])"


def reserved(key: str) -> bool:
    """True for label/annotation keys the operator owns (ddpjob.dev/*, sub-domains included)."""
    return re.match(RESERVED_KEY_PATTERN, key) is not None


def reserved_label(key: str) -> bool:
    """True for label keys the operator owns: reserved ones, and those Prometheus reads as ours."""
    return re.match(RESERVED_LABEL_PATTERN, key) is not None


def user_keys(mapping: dict[str, str] | None, *, label: bool = False) -> dict[str, str]:
    """A job's podLabels/podAnnotations (`label`: labels) without reserved keys: the schema refuses
    them, and a manifest that never met the API server (ddpjob render, --local) must not steer the
    operator (a job-name label would put the pods into another job's Service)."""
    owned = reserved_label if label else reserved
    return {str(k): str(v) for k, v in (mapping or {}).items() if not owned(str(k))}


def selector(job_name: str) -> str:
    """Label selector for every child of a job."""
    return f"{JOB_NAME}={job_name}"


def training_selector(job_name: str) -> str:
    """Label selector for a job's training pods: every pod of the job but its Lighthouse (`!=` also
    matches the pods that carry no role, those of a job without spec.faultTolerance)."""
    return f"{selector(job_name)},{ROLE}!={ROLE_LIGHTHOUSE}"
