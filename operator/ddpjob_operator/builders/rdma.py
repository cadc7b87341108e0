"""spec.rdma: RDMA devices (InfiniBand, RoCE, EFA) for NCCL, and what goes with them (pure).

The one home of what an RDMA job's training container gets on top of its own: the device
plugin's resource, the IPC_LOCK capability and the fabric's NCCL/libfabric settings. Whether a
tenant may ask for it is the chart's tenant policy (tenantPolicy.rdmaResources).
"""
from __future__ import annotations

from ddpjob_api import contract
from ddpjob_api.spec import JobSpec

EFA_RESOURCE = "vpc.amazonaws.com/efa"
# RDMA registers (pins) the buffers NCCL sends from; without IPC_LOCK a container's locked-memory
# limit makes memory registration fail, and NCCL falls back to sockets or fails at init.
CAPABILITY = "IPC_LOCK"
# InfiniBand and RoCE are NCCL's own IB transport. NCCL_NET=IB makes a pod whose device does not
# work fail at NCCL init with "network IB not found" instead of silently training over TCP sockets,
# several times slower; NCCL_IB_DISABLE=0 undoes an image that turned IB off.
IB_ENV = {contract.ENV_NCCL_IB_DISABLE: "0", contract.ENV_NCCL_NET: "IB"}
# EFA is reached through libfabric (the aws-ofi-nccl plugin the EFA images ship): the efa provider
# only, with GPUDirect RDMA (p4d and later). The plugin's NCCL_NET name differs between its
# versions, so it is not pinned here.
EFA_ENV = {contract.ENV_FI_PROVIDER: "efa", contract.ENV_FI_EFA_USE_DEVICE_RDMA: "1"}


def limits(job: JobSpec) -> dict[str, str]:
    """The device plugin's resource, devicesPerNode per pod (an extended resource: request = limit)."""
    devices = job.spec.rdma
    return {devices.resource: str(devices.devices_per_node)} if devices and devices.resource else {}


def capabilities(job: JobSpec) -> list[str]:
    """Capabilities the training container needs for its RDMA devices."""
    return [CAPABILITY] if job.spec.rdma else []


def env(job: JobSpec) -> dict[str, str]:
    """The fabric's NCCL/libfabric defaults; spec.nccl and the job's own env win over them."""
    resource = job.spec.rdma.resource if job.spec.rdma else None
    if not resource:
        return {}
    return dict(EFA_ENV if resource == EFA_RESOURCE else IB_ENV)
