"""The names of a job's children: its headless Service, each rank's pod and hostname, and rank 0's
DNS name (MASTER_ADDR). The operator names what it creates with them, the local runner the nodes it
starts, the CLI what it looks up; one spelling, so all three find the same pod."""
from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from ddpjob_api.contract import FT_LIGHTHOUSE_PORT

if TYPE_CHECKING:
    from ddpjob_api.spec import JobSpec


def service_name(job: JobSpec) -> str:
    """The headless Service that gives every pod a stable DNS name."""
    return job.name


def pod_hostname(job: JobSpec, rank: int) -> str:
    """The pod's hostname in every attempt, `<job>-<rank>`: its DNS name under the headless Service
    (MASTER_ADDR is rank 0's) never changes, whatever the pod is called.

    The rank is zero-padded to the width of the largest one (`<job>-07` in a job of 11 to 100
    nodes): torchrun's c10d rendezvous numbers the nodes in the sorted order of their addresses,
    the pods' FQDNs, and `<job>-10` sorts before `<job>-2`, so unpadded names would give pod i
    another node rank from 11 pods on. Jobs of up to 10 nodes keep `<job>-<rank>`."""
    width = len(str(max(job.spec.nodes, job.max_nodes) - 1))
    return f"{job.name}-{rank:0{width}d}"


def pod_name(job_name: str, rank: int, attempt: int, replacement: int = 0) -> str:
    """The pod of one rank in one attempt: `<job>-<rank>` in attempt 0 (the names most jobs, which
    never restart, show), `<job>-<rank>-a<K>` after: a failed attempt's pods are kept for their
    logs (spec.failurePolicy.keepFailedAttempts), so the next attempt cannot reuse their names.
    The n-th replacement of a lost pod within the attempt adds `-r<n>`: the pod it replaces may
    still exist (terminating, or an evicted pod kept Failed for its logs). A pod name may be 253
    characters, so the suffixes fit any job name the CRD accepts; only the hostname must fit a
    63-character DNS label, and it carries none."""
    base = f"{job_name}-{rank}" + (f"-a{attempt}" if attempt > 0 else "")
    return f"{base}-r{replacement}" if replacement > 0 else base


def master_dns(job: JobSpec, *, cluster_domain: str | None = None) -> str:
    """Rank 0's stable DNS name `<job>-0.<svc>.<ns>.svc[.<domain>]` (`<job>-00` from 11 nodes on)."""
    base = f"{pod_hostname(job, 0)}.{service_name(job)}.{job.namespace}.svc"
    return f"{base}.{cluster_domain}" if cluster_domain else base


def lighthouse_name(job: JobSpec) -> str:
    """The torchft Lighthouse's pod and Service of a spec.faultTolerance job, `<job>-ft`: a Service
    name is a 63-character DNS label and a job name may have 58."""
    return f"{job.name}-ft"


def lighthouse_url(job: JobSpec) -> str:
    """Where a per-step job's replica groups reach its Lighthouse (contract.ENV_FT_LIGHTHOUSE)."""
    return f"http://{lighthouse_name(job)}.{job.namespace}.svc:{FT_LIGHTHOUSE_PORT}"


def lighthouse_id_url(lighthouse: str) -> str:
    """Where the id of the Lighthouse at URL `lighthouse` is served: the same host, the next port
    (contract.FT_LIGHTHOUSE_ID_PORT)."""
    parts = urlsplit(lighthouse)
    if parts.port is None:
        raise ValueError(f"the Lighthouse's URL {lighthouse!r} names no port")
    host = parts.netloc.rpartition(":")[0]
    return f"{parts.scheme}://{host}:{parts.port + 1}"
