"""The node agent: owns a host's GPUs, creates MIG slices and MPS daemons on demand, journals
everything it creates and reconciles the device against that journal after a crash.

Modules: ``config`` (node.yaml + flags), ``journal`` (SQLite, write-ahead), ``sharefiles``
(interception-library files), ``agent`` (the logic), ``service`` (gRPC surface, auth, status
codes), ``server`` (ports, TLS, metrics, systemd readiness), ``client`` (dialling an agent).
"""
