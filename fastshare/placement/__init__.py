"""Placement engine: where every GPU request goes. Pure, deterministic, no I/O.

API (everything else in the package is internal)::

    from fastshare.placement import Engine, NodeView, GpuView, Request, Assignment, Rejection

    engine = Engine([NodeView("node-1", cpu_milli=32000, memory_mib=131072,
                              gpus=[GpuView(0, "A100-SXM4-40GB", 40960, 108, mig_capable=True,
                                            mig_profiles=profiles)])])
    result = engine.place(Request("job-1", "fastpod", sm_percent=30, gpu_memory_mib=8192))
    if result:                      # Assignment (truthy) or Rejection (falsy, .reason in words)
        engine.release(result)      # gives back exactly what place took

- Kinds: ``fastpod`` (SM % + GPU memory + time quota on one GPU via MPS; the SM shares on a
  GPU add up to at most 100 %, their memory to at most the GPU's and their guaranteed time
  quota requests to at most 1, the node agent's admission rule; a request's default quota is
  1, the GPU's whole time), ``mps`` (GPU memory only, up to ``mps_oversubscription`` x memory),
  ``exclusive`` (the smallest MIG profile with the SMs/memory asked, at the placement that
  destroys the least future MIG capacity; 100 % of the SMs only where the largest slice has
  them all, e.g. H100, not A100: 98 of 108),
  ``whole`` (N idle GPUs on one node, tightest link group). A GPU in MIG mode takes no MPS
  shares and no whole requests; a GPU holding shares takes no MIG slice.
- Constraints: host CPU/memory, ``gpu_models`` allow-list, ``node_selector`` labels,
  KubeShare-style ``affinity`` / ``anti_affinity`` / ``exclusion`` tags between sharers (MPS
  shares, or the MIG slices of one GPU).
- Persistence: ``Assignment.to_dict/from_dict``, ``Engine.to_dict/from_dict`` (cluster view
  + assignments), ``Engine.restore(assignment)`` to rebuild the ledger after a restart.
- Policies (``make_policy``): random, dotprod, gpuclustering, gpupacking, bestfit, fgd (the
  FGD paper's baselines) and fastshare (default). Bad input raises ``InvalidRequest``
  (a ValueError naming the field); lack of capacity returns a ``Rejection``.
"""

from fastshare.placement.engine import Engine
from fastshare.placement.fastshare_policy import FastsharePolicy
from fastshare.placement.model import (
    Assignment,
    GpuView,
    InvalidRequest,
    MigSlot,
    NodeView,
    Rejection,
    Request,
)
from fastshare.placement.policies import (
    POLICY_NAMES,
    BestFitPolicy,
    DotProductPolicy,
    FGDPolicy,
    GpuClusteringPolicy,
    GpuPackingPolicy,
    Policy,
    RandomPolicy,
    Task,
    Typical,
    typical_shapes,
)


def make_policy(name: str, typical: list[Typical] | None = None, seed: int = 42) -> Policy:
    """A policy by name. ``typical`` (task shapes of the workload) feeds fgd; fastshare
    learns the request mix from the requests it is shown (``Policy.observe``)."""
    name = name.lower()
    if name == "random":
        return RandomPolicy(seed)
    if name == "dotprod":
        return DotProductPolicy()
    if name == "gpuclustering":
        return GpuClusteringPolicy()
    if name == "gpupacking":
        return GpuPackingPolicy()
    if name == "bestfit":
        return BestFitPolicy()
    if name == "fgd":
        if not typical:
            raise InvalidRequest("policy: fgd needs the workload's typical task shapes")
        return FGDPolicy(typical)
    if name == "fastshare":
        return FastsharePolicy()  # learns the request mix online; ``typical`` is not used
    raise InvalidRequest(f"policy: must be one of {', '.join(POLICY_NAMES)} (got {name!r})")


__all__ = [
    "POLICY_NAMES", "Assignment", "Engine", "FastsharePolicy", "GpuView",
    "InvalidRequest", "MigSlot", "NodeView", "Policy", "Rejection", "Request", "Task", "make_policy",
    "typical_shapes",
]
