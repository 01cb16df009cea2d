"""Cluster PKI and mTLS for fastshare's gRPC services.

``certs`` creates a cluster CA and short-lived ECDSA certificates; ``tls`` turns certificate
paths into gRPC server/channel credentials (reloaded from disk on rotation) and tells a
servicer who is calling.
"""
