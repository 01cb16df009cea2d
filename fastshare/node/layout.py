"""Administrative MIG layouts through the agent: the device layer plans, the agent journals.

The plan comes from ``fastshare.device.mig_layout`` (the one layout planner); instances that
shares hold count as in use, so a layout change never destroys them unless ``force``. Each
create/destroy is journaled like a share's (purpose 'layout'): a crash mid-apply is finished
or forgotten by the reconciler, and layout instances are never mistaken for orphans.
"""

from __future__ import annotations

from fastshare.device import mig_layout
from fastshare.device.api import DeviceError, GpuInfo, MigInstance
from fastshare.node import faults
from fastshare.node.agent import Agent, AgentError, Deadline, _device_error


def apply_layout(agent: Agent, gpu_uuid: str, profiles: dict[str, int], force: bool, apply: bool,
                 deadline: Deadline) -> tuple[list[dict], bool]:
    """Plan (and with ``apply`` run) the steps to ``profiles``; returns (actions, changed).

    The same planner and refusals as ``fastshare mig plan/apply`` without an agent (shapes read
    from NVML under the GPU's lock, so a share being prepared there is seen once it is held).
    Shares on an instance destroyed by ``force`` are dropped before the reply, with that cause,
    also when a later step fails."""
    gpu = agent._gpu(gpu_uuid)
    agent.refuse_mig_change_if_lost(gpu)
    plan: mig_layout.Plan | None = None
    noted: list[str] = []   # held instances noted as destroyed by this layout (only with force)
    try:
        with agent._device_locks.hold(gpu_uuid, deadline):
            plan, placed, current, layout = _plan(agent, gpu, profiles, force)
            if apply and plan.changed:
                try:
                    _run_steps(agent, gpu, plan, placed, noted, f"destroyed by a forced MIG layout change to "
                               f"{layout} (ApplyMigLayout with force, e.g. `fastshare mig apply --force`)")
                finally:   # before the lock goes: an MPS prepare looks its device up under it
                    agent.refresh_devices()
    finally:
        if noted:
            agent._drop_vanished()
            agent._settle_taken(noted)   # the note of one NVML did not destroy goes too
        if apply and plan is not None and plan.changed:   # also after a failed step: watchers look again
            agent._changed()
    return _actions(plan, current), plan.changed


def destroy_all(agent: Agent, gpu: GpuInfo, force: bool, noted: list[str]) -> list[dict]:
    """Under the GPU's lock, before MIG is disabled (SetMigMode with destroy_instances): destroy its
    MIG instances as apply_layout to no profiles does, with the same refusals before any change;
    the held ones destroyed (only with ``force``) are added to ``noted``. Returns the actions."""
    plan, placed, current, _ = _plan(agent, gpu, {}, force)
    if plan.changed:
        try:
            _run_steps(agent, gpu, plan, placed, noted, "destroyed by a forced MIG disable (SetMigMode with "
                       "force, e.g. `fastshare mig config --force` with mig-enabled: false)")
        finally:
            agent.refresh_devices()
    return _actions(plan, current)


def _actions(plan: mig_layout.Plan, current: list[MigInstance]) -> list[dict]:
    uuid_at = {m.start: m.uuid or "" for m in current}
    return [{"op": s.action, "profile_name": s.profile_name, "profile_id": s.profile_id, "start": s.start,
             "mig_uuid": uuid_at.get(s.start, "") if s.action == "destroy" else ""} for s in plan.steps]


def _plan(agent: Agent, gpu: GpuInfo, profiles: dict[str, int],
          force: bool) -> tuple[mig_layout.Plan, list[mig_layout.Placed], list[MigInstance], str]:
    """Under the GPU's lock: (plan, instances as placed with their shares, instances, the wanted
    layout's text)."""
    try:
        shape = mig_layout.shape_of(agent.devices, gpu.index)
        current = agent.devices.mig_instances(gpu.index)
    except mig_layout.LayoutError as exc:
        raise AgentError("FAILED_PRECONDITION", str(exc)) from None
    except DeviceError as exc:
        raise _device_error(exc, f"reading the MIG layout of GPU {gpu.uuid}") from None
    try:
        wanted = mig_layout.parse_layout({k: int(v) for k, v in profiles.items()}, shape)
    except mig_layout.LayoutError as exc:
        raise AgentError("INVALID_ARGUMENT", f"profiles: {exc}") from None
    held: dict[str, list[str]] = {}
    for r in agent.journal.shares():
        held.setdefault(r.device_uuid, []).append(r.spec.id)
    placed = mig_layout.placed_instances(current, held)
    try:
        plan = mig_layout.plan_layout(shape, placed, wanted, force=force)
    except mig_layout.LayoutError as exc:
        raise AgentError("FAILED_PRECONDITION", str(exc)) from None
    return plan, placed, current, mig_layout.format_layout(wanted, shape) or "no MIG instances"


def _run_steps(agent: Agent, gpu: GpuInfo, plan: mig_layout.Plan, placed: list[mig_layout.Placed],
               noted: list[str], cause: str) -> None:
    """Under the GPU's lock. A held instance (destroyed only with force: the plan keeps held
    instances otherwise) is noted in the journal as destroyed by this change (``cause``) before it goes, so
    its shares are dropped with that cause, not as destroyed by hand, also by an agent restarted
    after a crash between the destroy and the drop; it is added to ``noted`` (whose notes go
    again once the shares are dropped, or if the instance is still there)."""
    for step in plan.steps:
        victim = next((p for p in placed if p.start == step.start), None)
        if step.action == "destroy" and victim is not None and victim.shares:
            agent.journal.note_taken(victim.label, cause)
            noted.append(victim.label)
        _run(agent, gpu.uuid, gpu.index, step)


def _run(agent: Agent, gpu_uuid: str, gpu_index: int, step: mig_layout.Step) -> None:
    journal = agent.journal
    try:
        if step.action == "destroy":
            if any(m.start == step.start for m in journal.migs(gpu_uuid)):
                journal.set_mig_state(gpu_uuid, step.start, "destroying")
            agent.devices.destroy_mig_instance(gpu_index, step.start)
            faults.point("agent.after_layout_destroy")
            journal.delete_mig(gpu_uuid, step.start)
        else:
            agent._forget_vanished_mig(gpu_uuid, step.start)
            journal.begin_mig(gpu_uuid, step.start, step.profile_id, None, "layout")
            try:
                mig = agent.devices.create_mig_instance(gpu_index, step.profile_id, step.start)
            except DeviceError:
                journal.delete_mig(gpu_uuid, step.start)
                raise
            faults.point("agent.after_mig_create")
            journal.mig_ready(gpu_uuid, step.start, mig.uuid)
    except DeviceError as exc:
        raise _device_error(exc, f"{step.describe()} on GPU {gpu_uuid}") from None
