#!/usr/bin/python
# Copyright: (c) 2026, fastshare developers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: declarative MIG layout, planned by fastshare, changed only where needed."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: mig_config
short_description: Declarative MIG layout for the NVIDIA GPUs of a host
version_added: 0.1.0
description:
  - Brings the MIG mode and the MIG devices of the selected GPUs to the requested layout.
  - The difference to what exists is computed by the same planner as C(fastshare mig plan).
    Instances that already sit at a suitable placement are kept, new ones are created at
    explicit placements (never where NVML's default placer would put them), and only what
    must change is destroyed or created. A second run with the same layout changes nothing.
  - Every GPU is planned before anything is changed, and read again right before the first change;
    one lost since it was planned is refused before any change. Should a GPU fail midway anyway, the
    message lists the GPUs changed before it and those not reached; running the task again, once that
    GPU is put right, makes only the changes still missing.
  - An instance that is in use (processes
    run on it, or a fastshare share holds it according to the node agent running on
    O(unix_socket), or to O(agent_journal) without one) is never destroyed
    or moved; and the module fails naming the instance. O(force=true) lets the module destroy
    instances held by fastshare shares; running processes always block destruction, because
    NVML refuses it.
  - While the node agent answers on O(unix_socket), the GPUs are read from its inventory, also in
    check mode, so the module opens no GPU backend of its own, and O(gpu_backend) and O(sim_state)
    are not used. Without an agent there (or with one too old to give the GPUs' PCI device ids),
    the module reads the GPUs through O(gpu_backend), and O(sim_state) is required with
    O(gpu_backend=sim).
  - Enabling or disabling MIG on an Ampere GPU (A100, A30) stays pending until the GPU is reset;
    the module then reports RV(reset_required) and RV(reboot_required) and leaves the MIG devices
    of that GPU for the next run after the reset. Hopper and later apply the mode at once and
    the layout is created in the same run.
author:
  - fastshare developers (@fastshare)
extends_documentation_fragment:
  - fastshare.gpu.backend
options:
  layout:
    description:
      - The wanted layout, one entry per group of GPUs. GPUs that no entry selects are left alone.
      - A GPU may be selected by one entry only.
      - Exactly one of O(layout) and O(config_file) is required.
    type: list
    elements: dict
    suboptions:
      devices:
        description:
          - V(all), or a list of GPU indexes (NVML order).
          - A lost GPU (fallen off the bus, NVML_ERROR_GPU_IS_LOST) is left out of V(all) with a
            warning; one named by index is refused before any GPU changes (reset it or reboot). The
            same holds for the C(devices) of O(config_file) entries.
        type: raw
        default: all
      mig_enabled:
        description:
          - Whether MIG mode is on for these GPUs. V(false) destroys every MIG device first.
        type: bool
        default: true
      mig_devices:
        description:
          - MIG profile name (as NVML names it on that GPU, for example C(3g.20gb)) or profile id,
            mapped to the number of MIG devices of that profile. An empty mapping means none.
        type: dict
        default: {}
  config_file:
    description:
      - Path (on the managed node) of an NVIDIA mig-parted style config file (C(version=v1),
        C(mig-configs)), so existing mig-parted configs can be used as they are.
      - Entries select GPUs with C(devices) (V(all) or indexes) and optionally C(device-filter)
        (PCI device ids such as C(0x20B010DE), or model names); C(mig-enabled) and C(mig-devices)
        mean what O(layout[].mig_enabled) and O(layout[].mig_devices) mean.
    type: path
  config_name:
    description:
      - Which named config of O(config_file) to apply. Required with O(config_file).
    type: str
  force:
    description:
      - Destroy instances held by fastshare shares when the layout needs their place, and turn
        MIG on for a GPU that a share holds whole (the share loses the GPU).
      - Instances with running processes are never destroyed; stop the processes first.
    type: bool
    default: false
  agent_journal:
    description:
      - Path of the fastshare node agent's journal (C(journal.db) in its state directory).
      - MIG devices that a share in it holds count as in use, and so does a GPU that a share
        holds whole (MIG is not enabled on it without O(force)). When the file does not exist,
        no device counts as held.
      - Not read while the node agent answers on O(unix_socket) (its own shares count then).
        Without a running agent, the module holds the agent's lock of this directory (or of
        C(/var/lib/fastshare/node) when not given) while it changes MIG, so an agent starting
        meanwhile waits for it; while an agent holds it (starting, not answering yet) the module
        fails without changing anything.
    type: path
  unix_socket:
    description:
      - The fastshare node agent's unix socket. While an agent answers there, the module reads the
        GPUs from its inventory (no GPU backend needed) and changes nothing beside it; the agent
        makes the changes (C(SetMigMode), C(ApplyMigLayout)) under its
        lock of each GPU, so a share it holds or is preparing counts as in use, and every GPU is
        checked by the agent (C(PlanMigLayout)) before anything changes, also in check mode.
      - O(force) means the same then; the agent drops the shares a forced change takes their
        device from, reported lost to the controller with that cause.
      - With no agent answering there, the module changes MIG directly through O(gpu_backend)
        (see O(agent_journal)).
    type: str
    default: /run/fastshare/node.sock
attributes:
  check_mode:
    description: Plans and reports the steps without changing anything.
    support: full
  diff_mode:
    description: Shows the MIG mode and devices of each selected GPU before and after.
    support: full
  platform:
    description: Linux hosts with the NVIDIA driver, or any host with the simulated backend.
    support: full
    platforms: posix
notes:
  - MIG devices do not survive a reboot or a driver reload; the MIG mode does. The
    P(fastshare.gpu.gpu_node#role) role installs a boot-time unit that applies the layout again.
seealso:
  - module: fastshare.gpu.gpu_info
  - name: NVIDIA MIG user guide
    description: MIG profiles, placements and the mode reset on Ampere.
    link: https://docs.nvidia.com/datacenter/tesla/mig-user-guide/
"""

EXAMPLES = r"""
- name: Two 3g slices on every GPU
  fastshare.gpu.mig_config:
    layout:
      - devices: all
        mig_enabled: true
        mig_devices:
          3g.20gb: 2

# While the node agent answers on unix_socket, it reads the GPUs and makes the changes: no backend
# options needed. Without one, the module uses gpu_backend (default nvml).
- name: A mixed layout on GPU 0, MIG off on GPU 1, shares protected (by the running agent, if any)
  fastshare.gpu.mig_config:
    agent_journal: /var/lib/fastshare/node/journal.db
    unix_socket: /run/fastshare/node.sock
    layout:
      - devices: [0]
        mig_devices:
          3g.20gb: 1
          2g.10gb: 1
          1g.5gb: 1
      - devices: [1]
        mig_enabled: false
  register: mig

- name: Reboot when an Ampere mode change waits for a GPU reset
  ansible.builtin.reboot:
  when: mig.reboot_required

- name: Apply a named config from an existing mig-parted file
  fastshare.gpu.mig_config:
    config_file: /etc/nvidia-mig-manager/config.yaml
    config_name: all-balanced

- name: Preview on a simulated machine
  fastshare.gpu.mig_config:
    gpu_backend: sim
    sim_state: /var/lib/fastshare/sim-gpus.json
    layout:
      - devices: all
        mig_devices:
          1g.5gb: 7
  check_mode: true
  diff: true
"""

RETURN = r"""
changed:
  description: Whether a MIG mode or a MIG device was changed (or, in check mode, would be).
  returned: always
  type: bool
steps:
  description: The destroy and create steps, in the order they ran (or would run).
  returned: always
  type: list
  elements: dict
  contains:
    gpu:
      description: GPU index.
      type: int
    action:
      description: V(destroy) or V(create).
      type: str
    profile:
      description: MIG profile name.
      type: str
      sample: 3g.20gb
    profile_id:
      description: NVML profile id.
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
    description:
      description: The step in words.
      type: str
      sample: "GPU 0: create 3g.20gb (id 9) at start 4 (memory slices 4..7)"
gpus:
  description: One entry per GPU that the layout selects.
  returned: always
  type: list
  elements: dict
  contains:
    index:
      description: GPU index.
      type: int
    uuid:
      description: GPU UUID.
      type: str
    name:
      description: NVML product name.
      type: str
    changed:
      description: Whether this GPU changed.
      type: bool
    mig_enabled:
      description: The requested MIG mode.
      type: bool
    mig_mode:
      description: MIG mode after the run (predicted in check mode).
      type: dict
      contains:
        current:
          description: MIG mode in effect.
          type: bool
        pending:
          description: MIG mode after the next GPU reset.
          type: bool
    reset_required:
      description: A MIG mode change on this GPU waits for a GPU reset.
      type: bool
    mig_devices:
      description: MIG devices after the run (predicted in check mode; C(uuid) is null for new ones).
      type: list
      elements: dict
      contains:
        profile:
          description: Profile name.
          type: str
        start:
          description: Placement start.
          type: int
        size:
          description: Placement size.
          type: int
        uuid:
          description: MIG device UUID.
          type: str
reset_required:
  description: A MIG mode change waits for a GPU reset on at least one GPU (see RV(reset_gpus)).
  returned: always
  type: bool
reboot_required:
  description:
    - A reboot is needed to finish the change. A reboot resets every GPU, so this is true
      whenever RV(reset_required) is; resetting just the GPUs in RV(reset_gpus) while nothing
      uses them (C(nvidia-smi -r -i N)) is the alternative.
  returned: always
  type: bool
reset_gpus:
  description: Indexes of the GPUs whose MIG mode change waits for a reset.
  returned: always
  type: list
  elements: int
  sample: [0, 1]
"""

import contextlib  # noqa: E402  (Ansible: imports follow the docs)

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible_collections.fastshare.gpu.plugins.module_utils.backend import (  # noqa: E402
    DeviceError,
    JournalError,
    backend_argument_spec,
    fail_backend,
    held_device_uuids,
    require_fastshare,
    try_open_backend,
)
from ansible_collections.fastshare.gpu.plugins.module_utils.mig import (  # noqa: E402
    MigConfigError,
    agent_held,
    apply_plans,
    config_file_targets,
    describe_layout,
    layout_targets,
    local_agent,
    plan_targets,
    planning_devices,
    predicted_devices,
    predicted_mode,
    step_dict,
    without_agent,
)


def argument_spec():
    spec = backend_argument_spec()
    spec.update(
        layout=dict(type="list", elements="dict", options=dict(
            devices=dict(type="raw", default="all"),
            mig_enabled=dict(type="bool", default=True),
            mig_devices=dict(type="dict", default={}),
        )),
        config_file=dict(type="path"),
        config_name=dict(type="str"),
        force=dict(type="bool", default=False),
        agent_journal=dict(type="path"),
        unix_socket=dict(type="str", default="/run/fastshare/node.sock"),
    )
    return spec


def _devices_of(instances):
    return [(m.profile_name, m.start, m.size, m.uuid) for m in instances]


def _state(devices):
    return [(g.index, g.mig_current, g.mig_pending, _devices_of(g.mig_instances)) for g in devices.gpus()]


def _changed_since(devices, state):
    try:
        return _state(devices) != state
    except DeviceError:
        return True                       # cannot read back: do not claim that nothing changed


def _predicted(gpu_plan, gpu, before):
    """Check mode: (plan, steps, MIG mode, reset required, devices) as the run would leave them."""
    steps = [s.to_dict() for s in gpu_plan.plan.steps] if gpu_plan.plan else []
    return (gpu_plan, steps, predicted_mode(gpu_plan, gpu), gpu_plan.reset_required,
            predicted_devices(gpu_plan, before))


def _observed(gpu_plan, result, gpu_now):
    """After the run: the same tuple, read back from the GPU."""
    mode = dict(current=gpu_now.mig_current, pending=gpu_now.mig_pending)
    return gpu_plan, result["steps"], mode, result["reset_required"], _devices_of(gpu_now.mig_instances)


def _open_backend(module, agent):
    """The GPUs through the backend options: no node agent answers on unix_socket (or one too old to
    plan from), so the module reads them itself; fails naming the option that is missing or wrong."""
    socket_path = module.params["unix_socket"]
    on = f"on unix_socket {socket_path}" if socket_path else "(unix_socket is empty)"
    why = (f"no node agent answers {on}" if agent is None else
           f"the node agent {on} is too old to plan from (its inventory has no PCI device ids)")
    if module.params["gpu_backend"] == "sim" and not module.params["sim_state"]:
        module.fail_json(msg=f"gpu_backend is sim but sim_state is missing (needed while {why})",
                         changed=False)
    devices, error = try_open_backend(module)
    if error is not None:
        fail_backend(module, error, why)
    return devices


def run(module, devices, agent):
    gpus = {g.index: g for g in devices.gpus()}
    if module.params["config_file"]:
        targets, left_out = config_file_targets(module.params["config_file"], module.params["config_name"],
                                                list(gpus.values()))
    else:
        targets, left_out = layout_targets(module.params["layout"], list(gpus.values()))
    for lost in left_out:   # fallen off the bus, under devices: all (one named is refused)
        module.warn(lost["reason"])
    journal = module.params["agent_journal"]
    # A running agent makes the changes; without one, its state directory is held meanwhile.
    directly = agent is None and not module.check_mode
    with without_agent(journal) if directly else contextlib.nullcontext():
        gpus = {g.index: g for g in devices.gpus()}   # again, now that no agent changes them beside
        held = agent_held(agent) if agent is not None else held_device_uuids(journal)
        before = {index: _devices_of(g.mig_instances) for index, g in gpus.items()}
        # Plan every GPU first: any refusal happens before anything changes.
        plans = plan_targets(devices, targets, module.params["force"], held, agent)
        if module.check_mode:
            outcomes = [_predicted(gp, gpus[gp.gpu_index], before[gp.gpu_index]) for gp in plans]
        else:
            state = _state(devices)
            try:
                results = apply_plans(devices, plans, agent, journal)
            except (MigConfigError, DeviceError) as exc:
                # A GPU may have changed before the failure: report what the GPUs say, not a guess.
                extra = dict(nvml_error=exc.code) if isinstance(exc, DeviceError) else {}
                module.fail_json(msg=str(exc), changed=_changed_since(devices, state), **extra)
            now = {g.index: g for g in devices.gpus()}
            outcomes = [_observed(gp, r, now[gp.gpu_index]) for gp, r in zip(plans, results, strict=True)]
    steps, report, diff_before, diff_after = [], [], [], []
    for gp, done, mode, reset_required, after in outcomes:
        gpu = gpus[gp.gpu_index]
        steps.extend(step_dict(gpu.index, s) for s in done)
        report.append(dict(index=gpu.index, uuid=gpu.uuid, name=gpu.name,
                           changed=gp.mode_change or bool(done), mig_enabled=gp.mig_enabled,
                           mig_mode=mode, reset_required=reset_required,
                           mig_devices=[dict(profile=p, start=s, size=z, uuid=u) for p, s, z, u in after]))
        diff_before.append(describe_layout(gpu, gpu.mig_current, gpu.mig_pending, before[gpu.index]))
        diff_after.append(describe_layout(gpu, mode["current"], mode["pending"], after))
    reset_gpus = [r["index"] for r in report if r["reset_required"]]
    result = dict(changed=any(r["changed"] for r in report), steps=steps, gpus=report,
                  reset_required=bool(reset_gpus), reboot_required=bool(reset_gpus), reset_gpus=reset_gpus)
    if module._diff:
        result["diff"] = dict(before="".join(diff_before), after="".join(diff_after))
    return result


def main():
    module = AnsibleModule(argument_spec=argument_spec(),
                           required_one_of=[("layout", "config_file")],
                           mutually_exclusive=[("layout", "config_file")],
                           required_together=[("config_file", "config_name")],
                           supports_check_mode=True)
    if module.params["config_file"] == "":
        module.fail_json(msg="config_file must be the path of a mig-parted file, got ''", changed=False)
    if module.params["layout"] is None and module.params["config_file"] is None:
        module.fail_json(msg="one of layout or config_file is needed (layout is null)", changed=False)
    require_fastshare(module)
    try:
        # A running agent reads the GPUs and makes the changes (no backend needed); none is changed
        # beside a starting one (fastshare.node.local_agent, as for `fastshare mig config`).
        agent = local_agent(module.params["unix_socket"], module.params["agent_journal"])
        with planning_devices(agent, lambda: _open_backend(module, agent)) as devices:
            result = run(module, devices, agent)
    except (MigConfigError, JournalError) as exc:
        module.fail_json(msg=str(exc), changed=False)
    except DeviceError as exc:
        module.fail_json(msg=str(exc), nvml_error=exc.code)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
