"""Kubernetes integration: FastPod CRD, manifests, in-cluster controller, test control plane."""
