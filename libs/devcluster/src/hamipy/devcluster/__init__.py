"""hami-py local Kubernetes control plane for tests and `make up`."""
