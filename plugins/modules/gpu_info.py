#!/usr/bin/python
# Copyright: (c) 2026, fastshare developers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: report a host's NVIDIA GPUs and their MIG layout (changes nothing)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_info
short_description: Report the NVIDIA GPUs of a host and their MIG layout
version_added: 0.1.0
description:
  - Reads the driver version, every GPU (index, UUID, model, memory, SM count, PCI bus id,
    MIG capability, current and pending MIG mode, compute mode) and the MIG devices on each
    GPU (profile, placement, UUID) through NVML or fastshare's simulated NVML.
  - Never changes anything. When NVML cannot be reached (no driver loaded yet, for example)
    the module still succeeds and says so in RV(nvml_reachable) and RV(nvml_error), so a
    play can decide what to do.
  - A O(sim_state) that is no simulated machine file (missing, not a file, not a machine) is a
    mistake in the task, not an unreachable NVML; the module fails naming it.
author:
  - fastshare developers (@fastshare)
extends_documentation_fragment:
  - fastshare.gpu.backend
attributes:
  check_mode:
    description: The module only reads, so it runs fully in check mode.
    support: full
  diff_mode:
    description: Nothing changes, so there is never a diff.
    support: none
  platform:
    description: Linux hosts with the NVIDIA driver, or any host with the simulated backend.
    support: full
    platforms: posix
notes:
  - Returns data under its own keys (not C(ansible_facts)); register the result.
seealso:
  - module: fastshare.gpu.mig_config
"""

EXAMPLES = r"""
- name: Read the GPUs
  fastshare.gpu.gpu_info:
  register: gpus

- name: Show the MIG-capable GPUs
  ansible.builtin.debug:
    msg: "{{ gpus.gpus | selectattr('mig_capable') | map(attribute='name') | list }}"

- name: Read a simulated machine
  fastshare.gpu.gpu_info:
    gpu_backend: sim
    sim_state: /var/lib/fastshare/sim-gpus.json
"""

RETURN = r"""
nvml_reachable:
  description: Whether NVML (or the simulated NVML) answered.
  returned: always
  type: bool
  sample: true
nvml_error:
  description: The NVML error code when NVML could not be reached.
  returned: when RV(nvml_reachable) is false
  type: str
  sample: LIBRARY_NOT_FOUND
driver_version:
  description: The NVIDIA driver version.
  returned: when RV(nvml_reachable) is true
  type: str
  sample: "550.90.07"
gpus:
  description: One entry per GPU, ordered by NVML index. Empty when NVML is unreachable.
  returned: always
  type: list
  elements: dict
  contains:
    index:
      description: NVML index.
      type: int
      sample: 0
    uuid:
      description: GPU UUID.
      type: str
      sample: GPU-5f1c0d0e-3f3a-4a7e-9b1e-0a1b2c3d4e5f
    name:
      description: NVML product name.
      type: str
      sample: NVIDIA A100-SXM4-40GB
    model:
      description: fastshare's catalog name of the model, null when the catalog does not know it.
      type: str
      sample: A100-SXM4-40GB
    memory_mib:
      description: Total memory in MiB.
      type: int
      sample: 40960
    sm_count:
      description: Streaming multiprocessors of the whole GPU.
      type: int
      sample: 108
    pci_bus_id:
      description: PCI bus id.
      type: str
      sample: "00000000:07:00.0"
    mig_capable:
      description: Whether the GPU supports MIG.
      type: bool
      sample: true
    mig_mode:
      description: MIG mode now and after the next GPU reset.
      type: dict
      contains:
        current:
          description: MIG mode in effect.
          type: bool
        pending:
          description: MIG mode that applies after the next reset (Ampere).
          type: bool
    compute_mode:
      description: NVML compute mode.
      type: str
      sample: DEFAULT
    processes:
      description: Compute processes running on the GPU.
      type: int
      sample: 0
    mig_devices:
      description: MIG devices on the GPU, ordered by placement start.
      type: list
      elements: dict
      contains:
        profile:
          description: Profile name.
          type: str
          sample: 3g.20gb
        profile_id:
          description: NVML profile id (the id the create call takes).
          type: int
          sample: 9
        start:
          description: Placement start (memory slice).
          type: int
          sample: 4
        size:
          description: Placement size (memory slices).
          type: int
          sample: 4
        uuid:
          description: MIG device UUID (null while no compute instance exists).
          type: str
          sample: MIG-0e4a3c2b-1d6f-5a8e-9c7b-2f1e0d3c4b5a
        gi_id:
          description: GPU instance id (reused after destroy, not an identity).
          type: int
        ci_id:
          description: Compute instance id.
          type: int
        sm_count:
          description: SMs of the MIG device.
          type: int
          sample: 42
        memory_mib:
          description: Memory of the MIG device in MiB.
          type: int
          sample: 19968
        processes:
          description: Compute processes running on the MIG device.
          type: int
          sample: 0
"""

from ansible.module_utils.basic import AnsibleModule  # noqa: E402  (Ansible: imports follow the docs)
from ansible_collections.fastshare.gpu.plugins.module_utils.backend import (  # noqa: E402
    BACKEND_REQUIRED_IF,
    SIM_STATE_ERRORS,
    DeviceError,
    backend_argument_spec,
    fail_backend,
    layout_facts,
    try_open_backend,
)


def main():
    module = AnsibleModule(argument_spec=backend_argument_spec(), required_if=BACKEND_REQUIRED_IF,
                           supports_check_mode=True)
    devices, error = try_open_backend(module)
    if error is not None and module.params["gpu_backend"] == "sim" and error.code in SIM_STATE_ERRORS:
        fail_backend(module, error)
    if error is not None:
        module.exit_json(changed=False, nvml_reachable=False, nvml_error=error.code, gpus=[])
    try:
        result = layout_facts(devices)
    except DeviceError as exc:
        module.fail_json(msg=f"reading the GPUs failed: {exc}", nvml_error=exc.code)
    module.exit_json(changed=False, nvml_reachable=True, **result)


if __name__ == "__main__":
    main()
