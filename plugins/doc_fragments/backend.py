# Copyright: (c) 2026, fastshare developers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Options every fastshare.gpu module shares: which GPU backend to talk to."""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  gpu_backend:
    description:
      - How the module reaches the GPUs.
      - V(nvml) uses the NVIDIA driver's NVML library on the managed node.
      - V(sim) uses fastshare's simulated NVML, a machine described by the state file
        O(sim_state); it behaves like NVML (same calls, same errors) and is what tests and
        hosts without GPUs use.
    type: str
    choices: [nvml, sim]
    default: nvml
  sim_state:
    description:
      - Path of the simulated machine's state file on the managed node.
      - Required when O(gpu_backend=sim); ignored otherwise.
    type: path
requirements:
  - The C(fastshare) Python package on the managed node, importable by the interpreter the
    module runs with (for example set C(ansible_python_interpreter) to the virtualenv that
    the P(fastshare.gpu.gpu_node#role) role creates, C(/opt/fastshare/venv/bin/python)).
  - For O(gpu_backend=nvml), the NVIDIA driver (C(libnvidia-ml.so.1)).
"""
