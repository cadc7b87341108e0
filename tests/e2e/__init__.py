"""End-to-end tier: Helm install, RBAC and Prometheus against the local control plane."""
