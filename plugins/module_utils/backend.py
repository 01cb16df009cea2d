# Copyright: (c) 2026, fastshare developers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Shared by the fastshare.gpu modules: import the fastshare package, open the GPU backend.

The modules hold no GPU logic of their own: everything comes from the ``fastshare`` package
installed on the managed node, so the CLI, the node agent and Ansible plan and act alike.
"""

from __future__ import annotations

import traceback

from ansible.module_utils.basic import missing_required_lib

try:
    from fastshare.device import open_devices
    from fastshare.device.api import DeviceError
except ImportError:
    HAS_FASTSHARE = False
    FASTSHARE_IMPORT_ERROR = traceback.format_exc()

    class DeviceError(Exception):
        """Stand-in so that modules import; require_fastshare() fails before it matters."""

        code = "UNKNOWN"
else:
    HAS_FASTSHARE = True
    FASTSHARE_IMPORT_ERROR = None

FASTSHARE_URL = "https://github.com/fastshare/fastshare"


def backend_argument_spec():
    """Options of the backend doc fragment (fastshare.gpu.backend)."""
    return dict(
        gpu_backend=dict(type="str", default="nvml", choices=["nvml", "sim"]),
        sim_state=dict(type="path"),
    )


BACKEND_REQUIRED_IF = [("gpu_backend", "sim", ("sim_state",))]


def require_fastshare(module):
    """Fail the way Ansible modules do when a Python dependency is missing."""
    if not HAS_FASTSHARE:
        module.fail_json(msg=missing_required_lib("fastshare", url=FASTSHARE_URL),
                         exception=FASTSHARE_IMPORT_ERROR)


def try_open_backend(module):
    """(devices, None) for the host's GPUs through NVML or the simulated NVML, or (None, error)."""
    require_fastshare(module)
    try:
        return open_devices(module.params["gpu_backend"], module.params["sim_state"]), None
    except DeviceError as exc:
        return None, exc


# fastshare.device.open_devices' codes for a sim_state that is no simulated machine file
# (missing, not a file, unreadable as a machine): the task's mistake, not an unreachable NVML.
SIM_STATE_ERRORS = ("NOT_FOUND", "CORRUPTED")


def fail_backend(module, error, why=None):
    """Fail the module naming the backend option and NVML's (or the machine file's) reason (and
    ``why`` the backend was needed, if given)."""
    backend = module.params["gpu_backend"]
    option = f"sim_state={module.params['sim_state']}" if backend == "sim" else f"gpu_backend={backend}"
    reason = f"; it is needed because {why}" if why else ""
    module.fail_json(msg=f"cannot open the {backend} GPU backend ({option}): {error}{reason}",
                     nvml_error=error.code)


def open_backend(module):
    """The host's GPUs; fails the module with NVML's reason when they cannot be reached."""
    devices, error = try_open_backend(module)
    if error is not None:
        fail_backend(module, error)
    return devices


def device_error_result(exc):
    """Return values that name an NVML failure (code such as IN_USE or RESET_REQUIRED)."""
    return dict(msg=str(exc), nvml_error=getattr(exc, "code", "UNKNOWN"))


def mig_device_dict(instance):
    """A MIG device as the modules return it (identity: GPU, profile, placement start)."""
    return dict(profile=instance.profile_name, profile_id=instance.profile_id, start=instance.start,
                size=instance.size, uuid=instance.uuid, gi_id=instance.gi_id, ci_id=instance.ci_id,
                sm_count=instance.sm_count, memory_mib=instance.memory_mib, processes=instance.processes)


def gpu_dict(gpu):
    """A GPU as the modules return it."""
    return dict(index=gpu.index, uuid=gpu.uuid, name=gpu.name, model=getattr(gpu, "model", None),
                memory_mib=gpu.memory_mib,
                sm_count=gpu.sm_count, pci_bus_id=gpu.pci_bus_id, mig_capable=gpu.mig_capable,
                mig_mode=dict(current=gpu.mig_current, pending=gpu.mig_pending),
                compute_mode=gpu.compute_mode, processes=gpu.processes,
                mig_devices=[mig_device_dict(m) for m in sorted(gpu.mig_instances, key=lambda m: m.start)])


def layout_facts(devices):
    """Driver version and every GPU with its MIG devices."""
    return dict(driver_version=devices.driver_version(), gpus=[gpu_dict(g) for g in devices.gpus()])


class JournalError(Exception):
    """The agent journal given to a module cannot be read; the message names the option."""


def held_device_uuids(journal_path):
    """The devices that fastshare shares hold (UUID -> share ids), from the node agent's journal."""
    from fastshare.node.journal import held_device_uuids as held  # only needed here
    from fastshare.sqlite_file import StateFileError

    try:
        return held(journal_path)
    except StateFileError as exc:
        raise JournalError(f"agent_journal: {exc}") from None
