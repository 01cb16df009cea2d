"""Role pieces that can run on this machine without provisioning it.

The roles themselves run against real systemd hosts in the molecule scenario; here: argument
validation (fails before any task), the mig-parted file the boot unit reads (rendered by the
role's template, parsed by fastshare's parser), and the Kubernetes manifests module.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from fs_collection import COLLECTION, REPO, run, run_module, run_tasks, tool

from fastshare.device import mig_parted
from fastshare.k8s import manifests
from fastshare.security.certs import describe, init_ca
from tests.security.handmade import issue_roleless_cert, issue_unchecked


@pytest.mark.parametrize(("role", "bad_vars", "expected"), [
    ("gpu_node", {"gpu_node_gpu_backend": "cuda"}, "gpu_node_gpu_backend must be one of: nvml, sim"),
    ("controller", {"controller_deploy_mode": "docker"},
     "controller_deploy_mode must be one of: systemd, kubernetes"),
    ("gpu_node", {"gpu_node_reboot_timeout": "soon"}, "gpu_node_reboot_timeout"),
    ("pki", {"pki_role": "admin"}, "pki_role must be one of: node, controller, client"),
    # A misspelt key would otherwise be dropped from the layout file: MIG devices destroyed.
    ("gpu_node", {"gpu_node_mig_layout": [{"devices": [0], "mig_device": {"3g.20gb": 2}}]},
     "mig_device"),
])
def test_role_arguments_are_validated_before_anything_runs(collections_path: Path, tmp_path: Path,
                                                          role: str, bad_vars: dict, expected: str):
    results = run_tasks(collections_path, [
        {"ansible.builtin.include_role": {"name": f"{COLLECTION}.{role}"}, "vars": bad_vars}], tmp_path)
    # The include, then the role's argument validation task, which must fail and stop the role.
    failed = [r for r in results if r.get("failed")]
    assert len(failed) == 1 and "Validation of arguments failed" in failed[0]["msg"], results
    assert expected in failed[0]["msg"]
    assert len(results) == 2, "no task of the role may run after a failed validation"


def test_boot_unit_layout_file_is_what_fastshare_parses(collections_path: Path, tmp_path: Path):
    layout = [{"devices": [0], "mig_devices": {"3g.20gb": 1, "1g.5gb": 2}},
              {"devices": [1, 2], "mig_enabled": False},
              {"devices": "all"},
              # as the mig_config module also takes them: numbers as strings, zero counts
              {"devices": ["3"], "mig_devices": {"3g.20gb": "2", "1g.5gb": 0}},
              {"devices": [4], "mig_enabled": False, "mig_devices": {"1g.5gb": 0}}]
    out = tmp_path / "mig-config.yaml"
    template = REPO / "roles" / "gpu_node" / "templates" / "mig-config.yaml.j2"
    [result] = run_tasks(collections_path, [
        {"ansible.builtin.template": {"src": str(template), "dest": str(out), "mode": "0644"},
         "vars": {"gpu_node_mig_layout": layout, "gpu_node_mig_config_name": "fastshare"}},
    ], tmp_path)
    assert not result.get("failed"), result.get("msg")
    configs = mig_parted.parse_config(out.read_text())
    specs = configs["fastshare"]
    assert [(s.devices, s.mig_enabled, dict(s.mig_devices)) for s in specs] == [
        ((0,), True, {"3g.20gb": 1, "1g.5gb": 2}), ((1, 2), False, {}), ("all", True, {}),
        ((3,), True, {"3g.20gb": 2}), ((4,), False, {})]


def test_check_mode_previews_the_new_mig_layout(collections_path: Path, tmp_path: Path):
    """`ansible-playbook --check` on a node: the preview plans the layout being asked for,
    not the one the layout file (not rewritten in check mode) still holds."""
    from fastshare.device import simnvml

    machine = tmp_path / "gpus.json"
    simnvml.create_machine(machine, ["A100-SXM4-40GB"], mig_enabled=True)

    def mig_tasks(layout: list[dict], *extra_args: str) -> dict:
        task = {"ansible.builtin.include_role": {"name": f"{COLLECTION}.gpu_node", "tasks_from": "mig.yml"},
                "vars": {"gpu_node_gpu_backend": "sim", "gpu_node_sim_state": str(machine),
                         "gpu_node_venv": str(Path(sys.executable).parents[1]),
                         "gpu_node_mig_config_file": str(tmp_path / "mig-config.yaml"),
                         "gpu_node_mig_layout": layout}}
        results = run_tasks(collections_path, [task], tmp_path, extra_args=list(extra_args))
        # the apply task: after the check of the layout, which check mode skips
        return [r for r in results
                if r.get("action") == f"{COLLECTION}.mig_config" and not r.get("skipped")][-1]

    applied = mig_tasks([{"devices": [0], "mig_devices": {"3g.20gb": 2}}])
    assert applied["changed"] is True and not applied.get("failed"), applied.get("msg")
    before = machine.read_bytes()
    preview = mig_tasks([{"devices": [0], "mig_devices": {"7g.40gb": 1}}], "--check")
    assert not preview.get("failed"), preview.get("msg")
    assert preview["changed"] is True
    assert [(s["action"], s["profile"]) for s in preview["steps"]] == [
        ("destroy", "3g.20gb"), ("destroy", "3g.20gb"), ("create", "7g.40gb")]
    assert machine.read_bytes() == before


def _run_mig_yml(collections_path: Path, tmp_path: Path, machine: Path, layout: list[dict],
                 **extra_vars) -> list[dict]:
    """gpu_node's mig.yml on a simulated machine, layout file under tmp_path; every task's result."""
    task = {"ansible.builtin.include_role": {"name": f"{COLLECTION}.gpu_node", "tasks_from": "mig.yml"},
            "vars": {"gpu_node_gpu_backend": "sim", "gpu_node_sim_state": str(machine),
                     "gpu_node_venv": str(Path(sys.executable).parents[1]),
                     "gpu_node_mig_config_file": str(tmp_path / "mig-config.yaml"),
                     "gpu_node_mig_layout": layout, **extra_vars}}
    return run_tasks(collections_path, [task], tmp_path)


@pytest.mark.parametrize(("bad_entry", "named"), [
    # "two" was dropped from the file as if it were 0: both 3g.20gb devices destroyed
    ({"devices": [0], "mig_devices": {"3g.20gb": "two"}}, "'two'"),
    # 2.9 was written as 2 (the module refuses it in check mode)
    ({"devices": [0], "mig_devices": {"3g.20gb": 2.9}}, "2.9"),
    # "x" was written as GPU 0: its MIG devices replaced by a 7g.40gb
    ({"devices": ["x"], "mig_devices": {"7g.40gb": 1}}, "'x'"),
    # a profile this GPU does not have: the file held it, the boot unit failed at every boot
    ({"devices": [0], "mig_devices": {"9g.99gb": 1}}, "9g.99gb"),
])
def test_a_bad_mig_layout_changes_neither_the_gpus_nor_the_layout_file(
        collections_path: Path, tmp_path: Path, bad_entry: dict, named: str):
    """The role writes the layout file, then applies it. A value mig_config refuses (and so
    check mode refused) was coerced by the template instead ("two" -> none, "x" -> GPU 0), and
    a layout the GPUs cannot take was written all the same: the MIG devices were destroyed or
    the boot unit was left with a file it cannot apply. Now the play fails naming the value,
    and neither the GPUs nor the file change."""
    from fastshare.device import simnvml

    machine = tmp_path / "gpus.json"
    simnvml.create_machine(machine, ["A100-SXM4-40GB"], mig_enabled=True)
    good = _run_mig_yml(collections_path, tmp_path, machine,
                        [{"devices": [0], "mig_devices": {"3g.20gb": 2}}])
    # (enabling the boot unit fails here: this machine does not run systemd)
    assert [r["action"] for r in good if r.get("failed")] in ([], ["ansible.builtin.systemd_service"]), good
    gpus, layout_file = machine.read_bytes(), (tmp_path / "mig-config.yaml").read_text()

    results = _run_mig_yml(collections_path, tmp_path, machine, [bad_entry])
    failed = [r for r in results if r.get("failed")]
    assert failed and named in failed[0]["msg"], [(r.get("action"), r.get("msg")) for r in results]
    assert machine.read_bytes() == gpus, "the MIG devices changed"
    assert (tmp_path / "mig-config.yaml").read_text() == layout_file, "the layout file changed"


def _held_mig_device(machine: Path, state_dir: Path) -> str:
    """A simulated A100 in MIG mode with a 3g.20gb at slice 0, which an exclusive share in the
    agent journal under ``state_dir`` holds; the MIG device's UUID."""
    from fastshare.device import open_devices, simnvml
    from fastshare.node.journal import Journal
    from fastshare.node.model import ShareSpec

    simnvml.create_machine(machine, ["A100-SXM4-40GB"], mig_enabled=True)
    with open_devices("sim", machine) as devices:
        devices.create_mig_instance(0, 9, 0)                  # 3g.20gb at 0
        held = next(m.uuid for m in devices.mig_instances(0))
    state_dir.mkdir()
    journal = Journal(state_dir / "journal.db")
    try:
        journal.begin_share(ShareSpec(id="share-1", kind="exclusive", device_uuids=(held,)), held, None)
    finally:
        journal.close()
    return held


def test_mig_layout_keeps_devices_held_by_an_agent_with_another_state_dir(collections_path: Path,
                                                                          tmp_path: Path):
    """The agent's journal lives in its state_dir (gpu_node_agent_extra may move it). The role
    read /var/lib/fastshare/node/journal.db whatever the agent used, found no journal there, and
    so destroyed a MIG device a share held without gpu_node_mig_force."""
    machine, state_dir = tmp_path / "gpus.json", tmp_path / "agent state"
    held = _held_mig_device(machine, state_dir)
    before = machine.read_bytes()
    results = _run_mig_yml(collections_path, tmp_path, machine,
                           [{"devices": [0], "mig_devices": {"7g.40gb": 1}}],
                           gpu_node_agent_extra={"state_dir": str(state_dir)})
    failed = [r for r in results if r.get("failed")]
    assert failed and held in failed[0]["msg"] and "force" in failed[0]["msg"], \
        [(r.get("action"), r.get("msg")) for r in results]
    assert machine.read_bytes() == before, "a MIG device a share holds was destroyed"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("state_dir", ["/var/lib/fastshare/controller", "/srv/fastshare/controller"])
def test_controller_unit_lets_the_service_write_its_state_dir(collections_path: Path, tmp_path: Path,
                                                              state_dir: str):
    """ProtectSystem=strict makes every path read-only but the ones the unit opens up again:
    whatever controller_state_dir is, the controller must be able to write it."""
    unit = tmp_path / "fastshare-controller.service"
    template = REPO / "roles" / "controller" / "templates" / "fastshare-controller.service.j2"
    [result] = run_tasks(collections_path, [
        {"ansible.builtin.template": {"src": str(template), "dest": str(unit), "mode": "0644"},
         "vars": {"controller_user": "fastshare", "controller_venv": str(Path(sys.executable).parents[1]),
                  "controller_state_dir": state_dir}},
    ], tmp_path)
    assert not result.get("failed"), result.get("msg")
    verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                            timeout=120)
    assert "ignoring" not in verify.stderr, verify.stderr
    settings = [line.split("=", 1) for line in unit.read_text().splitlines() if "=" in line]
    writable = [f"/var/lib/{value}" for key, value in settings if key == "StateDirectory"]
    writable += [path for key, value in settings if key == "ReadWritePaths" for path in value.split()]
    assert "ProtectSystem=strict" in unit.read_text() and state_dir in writable, writable


@pytest.mark.parametrize("state_dir", ["/srv/fast share/controller", "/srv/fastshare/100%", "/srv/a%nb",
                                       "/var/lib/fastshare/", "/var/lib/", "/var/lib/a/../b", "/var/lib//a",
                                       "/var/lib/a:b", "/srv/a\\b", "/srv/a\"b", "/srv/x\n", "srv/x"])
def test_controller_refuses_a_state_dir_systemd_would_split_or_expand(collections_path: Path,
                                                                      tmp_path: Path, state_dir: str):
    """The unit writes controller_state_dir into StateDirectory= or ReadWritePaths= as it is:
    systemd splits those at whitespace, expands % specifiers, reads 'a:b' below /var/lib as a
    directory and a symlink to it, and refuses a path that is not normalised. The service then
    could not write its state (ProtectSystem=strict) or wrote elsewhere; the role refuses such
    a path before it changes anything, naming the variable and the rule."""
    results = run_tasks(collections_path, [
        {"ansible.builtin.include_role": {"name": f"{COLLECTION}.controller"},
         # Should the check not stop the role, the package step fails next (no wheel): nothing
         # is installed on the test machine either way.
         "vars": {"controller_state_dir": state_dir, "controller_package_source": "wheel"}}], tmp_path)
    failed = [r for r in results if r.get("failed")]
    assert len(failed) == 1 and failed[0] is results[-1], results
    assert "controller_state_dir" in failed[0]["msg"] and "normalised" in failed[0]["msg"], failed[0]["msg"]
    assert json.dumps(state_dir) in failed[0]["msg"], failed[0]["msg"]


@pytest.mark.parametrize("settings", [{"controller_token_listen": "0.0.0.0:7071"},
                                      {"controller_settings": {"token_file": "/etc/fastshare/tokens"}}])
def test_controller_refuses_token_settings_with_client_auth_cert(collections_path: Path, tmp_path: Path,
                                                                 settings: dict):
    """Bearer-token settings with controller_client_auth cert (the default): `controller serve`
    refuses them (the token port would refuse every client it is for), so the unit failed at
    start after the role had changed the host. The role refuses them first, naming the fix."""
    results = run_tasks(collections_path, [
        {"ansible.builtin.include_role": {"name": f"{COLLECTION}.controller"},
         "vars": {**settings, "controller_package_source": "wheel"}}], tmp_path)
    failed = [r for r in results if r.get("failed")]
    assert len(failed) == 1 and failed[0] is results[-1], results
    message = failed[0]["msg"]
    assert "controller_client_auth" in message and "token or any" in message, message


def test_controller_accepts_ordinary_state_dirs(collections_path: Path, tmp_path: Path):
    tasks = yaml.safe_load((REPO / "roles" / "controller" / "tasks" / "systemd.yml").read_text())
    check = next(t for t in tasks if "controller_state_dir" in t["name"])
    results = run_tasks(collections_path, [
        {**check, "vars": {"controller_state_dir": state_dir}}
        for state_dir in ("/var/lib/fastshare/controller", "/srv/fastshare/controller-1.0_x+y@z",
                          "/var/lib/.fastshare", "/var/lib")], tmp_path)
    assert not any(r.get("failed") for r in results), results


def _rpm(name: str, version: str, epoch: int | None = 3) -> dict:
    """An entry of ansible_facts.packages as ansible.builtin.package_facts (manager rpm) gives it."""
    return {name: [{"name": name, "version": version, "release": "1.el9", "epoch": epoch,
                    "arch": "x86_64", "source": "rpm"}]}


def _gpu_node_tasks(file: str) -> dict[str, dict]:
    """The tasks of gpu_node's tasks/FILE by name, those in blocks too."""
    def flat(tasks: list[dict]) -> dict[str, dict]:
        found = {}
        for task in tasks:
            found[task["name"]] = task
            for part in ("block", "rescue", "always"):
                found |= flat(task.get(part, []))
        return found
    return flat(yaml.safe_load((REPO / "roles" / "gpu_node" / "tasks" / file).read_text()))


def _driver_tasks() -> dict[str, dict]:
    """driver.yml's tasks by name, those in blocks too."""
    return _gpu_node_tasks("driver.yml")


def test_rhel_driver_packages_are_held_at_the_installed_version(collections_path: Path, tmp_path: Path):
    """On the RHEL family the driver is held with dnf's versionlock list, as dpkg holds it on
    Debian: `dnf upgrade` must not replace the driver under running GPU jobs. The role's own
    tasks (driver.yml, after the versionlock plugin is installed and package_facts has read
    the rpm database) run here with the facts of a RHEL 9 host and a lock list in tmp_path."""
    by_name = _driver_tasks()
    assert by_name["Install the dnf versionlock plugin (RHEL family)"]["ansible.builtin.dnf"]["name"] == \
        "python3-dnf-plugin-versionlock"
    assert "ansible.builtin.package_facts" in by_name["Read the installed packages (RHEL family)"]
    hold = [by_name["Check that the driver packages to hold are installed (RHEL family)"],
            by_name["Hold the driver packages at this version (RHEL family)"]]
    os_vars = yaml.safe_load((REPO / "roles" / "gpu_node" / "vars" / "RedHat.yml").read_text())
    locklist = tmp_path / "versionlock.list"
    locklist.write_text("# Added lock on Mon Jan  5 10:00:00 2026\n"
                        "kernel-0:5.14.0-503.11.1.el9_5.*\nnvidia-driver-3:550.90.07-1.el9.*\n")

    def run_hold(packages: dict, os_family: str = "RedHat", *extra_args: str) -> list[dict]:
        facts = {"os_family": os_family, "distribution_major_version": "9", "packages": packages}
        role_vars = {**os_vars, "ansible_facts": facts, "gpu_node_driver_branch": "550",
                     "gpu_node_dnf_versionlock_list": str(locklist)}
        return run_tasks(collections_path, [{**t, "vars": role_vars} for t in hold], tmp_path,
                         extra_args=list(extra_args))

    driver_rpms = ("nvidia-driver", "kmod-nvidia-latest-dkms", "nvidia-driver-cuda-libs",
                   "nvidia-fabric-manager")
    installed = {k: v for name in driver_rpms for k, v in _rpm(name, "550.127.08").items()}
    installed |= {**_rpm("dnf-plugin-nvidia", "2.0", epoch=None), **_rpm("bash", "5.1.8", epoch=None)}
    held = ["nvidia-driver-3:550.127.08-1.el9.*", "kmod-nvidia-latest-dkms-3:550.127.08-1.el9.*",
            "nvidia-driver-cuda-libs-3:550.127.08-1.el9.*", "nvidia-fabric-manager-3:550.127.08-1.el9.*"]

    check = run_hold(installed, "RedHat", "--check")
    assert not any(r.get("failed") for r in check) and check[1]["changed"] is True, check
    assert "550.127.08" not in locklist.read_text(), "check mode wrote the lock list"

    first = run_hold(installed)
    assert not any(r.get("failed") for r in first) and first[1]["changed"] is True, first
    lines = locklist.read_text().splitlines()
    assert sorted(line for line in lines if "nvidia" in line) == sorted(held), lines
    assert "kernel-0:5.14.0-503.11.1.el9_5.*" in lines          # other locks are left alone
    assert run_hold(installed)[1]["changed"] is False            # idempotent

    # Not on Debian (dpkg holds the packages there); a missing driver is said, not skipped.
    assert all(r.get("skipped") for r in run_hold(installed, "Debian"))
    missing = run_hold(_rpm("bash", "5.1.8", epoch=None))
    assert missing[0].get("failed") and "nvidia-driver" in missing[0]["msg"], missing


def test_rhel_driver_version_change_moves_only_the_driver_locks(collections_path: Path, tmp_path: Path):
    """gpu_node_driver_version on the RHEL family: a version other than the installed driver's
    drops the lock lines of exactly the driver's packages (a lock hides every other version
    from dnf), the dnf task asks for each of them at the new version (downgrades allowed), and
    once dnf has moved them they are locked again at it. Other lines, NVIDIA's or not, stay.
    "" (or the installed version) releases nothing and asks dnf for nothing new. dnf itself is
    not run (no rpm database here): its arguments are rendered as the role passes them."""
    by_name = _driver_tasks()
    release = by_name["Release the version locks of the driver packages that change version (RHEL family)"]
    install = by_name["Install the NVIDIA driver (RHEL family)"]
    hold = [by_name["Check that the driver packages to hold are installed (RHEL family)"],
            by_name["Hold the driver packages at this version (RHEL family)"]]
    assert install["register"] == "gpu_node_driver_dnf"    # what the reboot decision reads
    dnf_args = {"ansible.builtin.debug": {"msg": install["ansible.builtin.dnf"]}, "when": install["when"]}
    os_vars = yaml.safe_load((REPO / "roles" / "gpu_node" / "vars" / "RedHat.yml").read_text())
    new_source = yaml.safe_load((REPO / "roles" / "gpu_node" / "vars" / "main.yml").read_text())[
        "gpu_node_driver_new_source"]   # no repository added by these runs
    locklist = tmp_path / "versionlock.list"
    others = ["kernel-0:5.14.0-503.11.1.el9_5.*", "nvidia-container-toolkit-0:1.16.2-1.*",
              "dnf-plugin-nvidia-0:2.0-1.el9.*"]
    driver_rpms = ("nvidia-driver", "kmod-nvidia-latest-dkms", "nvidia-driver-cuda-libs")

    def host(version: str) -> dict:
        packages = {k: v for name in driver_rpms for k, v in _rpm(name, version).items()}
        return packages | _rpm("nvidia-container-toolkit", "1.16.2", epoch=None) | \
            _rpm("dnf-plugin-nvidia", "2.0", epoch=None) | _rpm("bash", "5.1.8", epoch=None)

    def locks(version: str) -> list[str]:
        return sorted([f"{name}-3:{version}-1.el9.*" for name in driver_rpms] + others)

    def run(tasks: list[dict], packages: dict, wanted: str, *extra_args: str) -> list[dict]:
        facts = {"os_family": "RedHat", "distribution_major_version": "9", "packages": packages}
        role_vars = {**os_vars, "ansible_facts": facts, "gpu_node_driver_branch": "550",
                     "gpu_node_driver_version": wanted, "gpu_node_dnf_versionlock_list": str(locklist),
                     "gpu_node_driver_wanted": os_vars["gpu_node_driver_packages"],
                     "gpu_node_driver_new_source": new_source}
        return run_tasks(collections_path, [{**t, "vars": role_vars} for t in tasks], tmp_path,
                         extra_args=list(extra_args))

    def lines() -> list[str]:
        return sorted(line for line in locklist.read_text().splitlines() if not line.startswith("#"))

    locklist.write_text("# Added lock on Mon Jan  5 10:00:00 2026\n" + "\n".join(locks("550.90.07")) + "\n")
    old, new = host("550.90.07"), host("550.127.08")

    preview = run([release, dnf_args], old, "550.127.08", "--check")
    assert preview[0]["changed"] is True and lines() == locks("550.90.07"), preview
    assert preview[1]["msg"]["disable_plugin"] == ["versionlock"], preview[1]   # check mode only

    moving = run([release, dnf_args], old, "550.127.08")
    assert [r["item"]["name"] for r in moving[0]["results"] if r["changed"]] == list(driver_rpms), moving
    assert lines() == sorted(others), "only the driver's lock lines may go"
    assert sorted(moving[1]["msg"]["name"]) == sorted(f"{n}-550.127.08" for n in driver_rpms)
    assert moving[1]["msg"]["allow_downgrade"] is True and moving[1]["msg"]["disable_plugin"] == []

    # dnf has installed 550.127.08: the always part of the block reads the rpms and locks them.
    relock = run(hold, new, "550.127.08")
    assert not any(r.get("failed") for r in relock) and lines() == locks("550.127.08"), relock

    for wanted in ("550.127.08", "550.127.08-1.el9", ""):   # pinned where it is, or unpinned
        still = run([release, dnf_args, *hold], new, wanted)
        assert still[0].get("skipped") and not any(r.get("changed") for r in still), (wanted, still)
        assert lines() == locks("550.127.08")
    assert still[1]["msg"]["name"] == ["@nvidia-driver:550-dkms"]    # "": the stream, as before

    # A new host (no driver yet): the stream and the driver at the version asked for.
    fresh = run([release, dnf_args], _rpm("bash", "5.1.8", epoch=None), "550.127.08")
    assert fresh[0].get("skipped"), fresh
    assert fresh[1]["msg"]["name"] == ["@nvidia-driver:550-dkms", "nvidia-driver-550.127.08"]


def test_rhel_check_mode_on_a_new_host_reports_the_driver_of_the_repository_it_would_add(
        collections_path: Path, tmp_path: Path):
    """A new RHEL host: the driver and the fabric manager come from NVIDIA's repository, which the
    role adds first and check mode does not add. dnf, asked in check mode, could not know them
    and `--check` failed, as apt did on Debian. Now the install is reported as coming from the new
    repository. The role's tasks run with the facts of a RHEL 9 host: the repository task for real
    (its file in tmp_path), the dnf and package installs rendered, as dnf cannot run here."""
    by_name = _driver_tasks()
    repo = by_name["Add NVIDIA's CUDA repository (RHEL family)"]
    repo = {**repo, "ansible.builtin.yum_repository": {**repo["ansible.builtin.yum_repository"],
                                                        "reposdir": str(tmp_path)}}
    install = by_name["Install the NVIDIA driver (RHEL family)"]
    fabric = by_name["Install the fabric manager"]
    rendered = [{"name": t["name"], "ansible.builtin.debug": {"msg": t[module]}, "when": t["when"]}
                for t, module in ((install, "ansible.builtin.dnf"), (fabric, "ansible.builtin.package"))]
    report = by_name["Report the driver that would come from the package source this run adds (check mode)"]
    role_vars = {}
    for file in ("defaults/main.yml", "vars/main.yml", "vars/RedHat.yml"):
        role_vars |= yaml.safe_load((REPO / "roles" / "gpu_node" / file).read_text())
    facts = {"os_family": "RedHat", "distribution": "RedHat", "architecture": "x86_64",
             "distribution_major_version": "9", "packages": _rpm("bash", "5.1.8", epoch=None)}
    role_vars |= {"ansible_facts": facts, "gpu_node_driver_branch": "550", "gpu_node_fabric_manager": True}

    def run(*extra_args: str) -> list[dict]:
        return run_tasks(collections_path, [{**t, "vars": role_vars} for t in (repo, *rendered, report)],
                         tmp_path, extra_args=list(extra_args))

    preview = run("--check")
    assert not any(r.get("failed") for r in preview), preview
    assert preview[0]["changed"] is True, preview[0]
    assert not list(tmp_path.glob("*.repo")), "check mode added the repository"
    assert preview[1].get("skipped") and preview[2].get("skipped"), preview   # dnf is not asked
    assert preview[3]["changed"] is True, preview
    assert "@nvidia-driver:550-dkms and nvidia-fabric-manager-550" in preview[3]["msg"], preview[3]
    assert "NVIDIA's CUDA repository" in preview[3]["msg"] and "cannot ask dnf" in preview[3]["msg"]

    assert run()[0]["changed"] is True     # the repository is added (a real run installs too)
    known = run("--check")
    assert known[0]["changed"] is False and known[3].get("skipped"), known
    assert known[1]["msg"]["name"] == ["@nvidia-driver:550-dkms"], known[1]    # dnf is asked
    assert known[2]["msg"]["name"] == "nvidia-fabric-manager-550", known[2]


# Directory names with the characters systemd treats specially in a command line; an
# executable path may not hold quotes or backslashes at all (systemd refuses to load the unit).
AWKWARD_VENV = "fast share 100% $HOME"
AWKWARD_DATA = """data "q" it's back\\slash 50% $PATH"""


def _systemd_argv(value: str) -> list[str]:
    """ExecStart= value -> argv, as systemd.service(5) and systemd.syntax(7) read it: %%
    specifiers, then words (double or single quotes, C escapes), then $$ in each argument."""
    assert re.fullmatch(r"([^%]|%%)*", value), f"unescaped specifier in {value!r}"
    value = value.replace("%%", "%")
    escapes = {"n": "\n", "t": "\t", "r": "\r", "s": " ", "\\": "\\", '"': '"', "'": "'"}
    words, word, quote, i = [], None, None, 0
    while i < len(value):
        c = value[i]
        if c == "\\":
            nxt = value[i + 1]
            if nxt == "x":
                word, i = (word or "") + chr(int(value[i + 2:i + 4], 16)), i + 4
                continue
            word, i = (word or "") + escapes[nxt], i + 2
            continue
        if quote:
            quote = None if c == quote else quote
            word = word if quote is None else word + c
        elif c in "\"'":
            quote, word = c, word or ""
        elif c.isspace():
            if word is not None:
                words.append(word)
            word = None
        else:
            word = (word or "") + c
        i += 1
    assert quote is None, f"unterminated quote in {value!r}"
    if word is not None:
        words.append(word)
    for w in words[1:]:      # the executable path gets no variable substitution
        assert re.fullmatch(r"([^$]|\$\$)*", w), f"unescaped $ in {w!r}"
    return words[:1] + [w.replace("$$", "$") for w in words[1:]]


def _exec_start(unit: Path) -> list[str]:
    [value] = [line[len("ExecStart="):] for line in unit.read_text().splitlines()
               if line.startswith("ExecStart=")]
    return _systemd_argv(value)


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_commands_survive_paths_systemd_would_split_or_expand(collections_path: Path, tmp_path: Path):
    """Every ExecStart= the roles write (MIG layout unit, controller unit, node agent unit)
    takes paths with spaces, quotes, backslashes, % and $ as they are. Unquoted, systemd split
    "/opt/my venv/bin/fastshare" at the space (\"Command /opt/my is not executable\") and
    expanded % specifiers and $VARIABLES. `systemd-analyze verify` checks the executable it
    parsed exists; _systemd_argv checks every other argument. Ordinary paths are written as
    before (no quotes), and an executable systemd would refuse fails the task instead."""
    venv, data = tmp_path / AWKWARD_VENV, tmp_path / AWKWARD_DATA
    fastshare = _executable(venv / "bin" / "fastshare")
    gpu_node_vars = yaml.safe_load((REPO / "roles" / "gpu_node" / "vars" / "main.yml").read_text())
    node_vars = {**gpu_node_vars, "gpu_node_venv": str(venv), "gpu_node_gpu_backend": "sim",
                 "gpu_node_sim_state": str(data / "sim gpus.json"),
                 "gpu_node_mig_config_file": str(data / "mig-config.yaml"),
                 "gpu_node_mig_config_name": "fastshare", "gpu_node_agent_extra": {}}
    mig_unit = tmp_path / "fastshare-mig-layout.service"
    controller_unit = tmp_path / "fastshare-controller.service"
    node_unit = tmp_path / "fastshare-node.service"
    agent = yaml.safe_load((REPO / "roles" / "gpu_node" / "tasks" / "agent.yml").read_text())
    install_agent_unit = next(t for t in agent if t["name"] == "Install the node agent unit")
    shipped_unit = subprocess.run([str(Path(sys.executable).with_name("fastshare")), "node", "unit"],
                                  capture_output=True, text=True, check=True).stdout
    results = run_tasks(collections_path, [
        {"ansible.builtin.template": {"src": str(REPO / "roles/gpu_node/templates" / f"{mig_unit.name}.j2"),
                                      "dest": str(mig_unit), "mode": "0644"}, "vars": node_vars},
        {"ansible.builtin.template": {"src": str(REPO / "roles/controller/templates" /
                                                 f"{controller_unit.name}.j2"),
                                      "dest": str(controller_unit), "mode": "0644"},
         "vars": {"controller_user": "root", "controller_venv": str(venv),
                  "controller_state_dir": "/var/lib/fastshare/controller"}},
        {**install_agent_unit, "notify": [], "vars": {**node_vars, "gpu_node_unit": {"stdout": shipped_unit}},
         "ansible.builtin.copy": {**install_agent_unit["ansible.builtin.copy"],
                                  "dest": str(node_unit)}},
        {"ansible.builtin.template": {"src": str(REPO / "roles/gpu_node/templates" / f"{mig_unit.name}.j2"),
                                      "dest": str(tmp_path / "default.service"), "mode": "0644"},
         "vars": {**gpu_node_vars, "gpu_node_venv": "/opt/fastshare", "gpu_node_gpu_backend": "nvml",
                  "gpu_node_mig_config_file": "/etc/fastshare/mig-config.yaml",
                  "gpu_node_mig_config_name": "fastshare", "gpu_node_agent_extra": {}}},
        {"ansible.builtin.template": {"src": str(REPO / "roles/controller/templates" /
                                                 f"{controller_unit.name}.j2"),
                                      "dest": str(tmp_path / "refused.service"), "mode": "0644"},
         "vars": {"controller_user": "root", "controller_venv": str(data),
                  "controller_state_dir": "/var/lib/fastshare/controller"}},
    ], tmp_path)
    *rendered, refused = results
    assert not any(r.get("failed") for r in rendered), [r.get("msg") for r in rendered]
    for unit in (mig_unit, controller_unit, node_unit):
        verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                                timeout=120)
        assert verify.returncode == 0 and unit.name not in verify.stderr, verify.stderr
        assert _exec_start(unit)[0] == str(fastshare), unit.read_text()
    assert _exec_start(mig_unit)[1:] == [
        "mig", "config", "--gpu-backend", "sim", "--sim-state", str(data / "sim gpus.json"),
        "--file", str(data / "mig-config.yaml"), "--select", "fastshare", "--apply",
        "--agent-journal", "/var/lib/fastshare/node/journal.db", "--unix-socket", "/run/fastshare/node.sock"]
    assert _exec_start(controller_unit)[1:] == ["controller", "serve", "--config",
                                                "/etc/fastshare/controller.yaml"]
    assert _exec_start(node_unit)[1:] == ["node", "serve", "--config", "/etc/fastshare/node.yaml"]
    assert f"apply the MIG layout ({data / 'mig-config.yaml'})".replace("%", "%%") in mig_unit.read_text()
    assert refused.get("failed") and "systemd refuses an executable path" in refused["msg"], refused
    assert ("ExecStart=/opt/fastshare/bin/fastshare mig config --gpu-backend nvml --file "
            "/etc/fastshare/mig-config.yaml --select fastshare --apply --agent-journal "
            "/var/lib/fastshare/node/journal.db --unix-socket /run/fastshare/node.sock\n"
            in (tmp_path / "default.service").read_text())



@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_an_argument_that_is_a_lone_semicolon_stays_an_argument(collections_path: Path, tmp_path: Path):
    """systemd.service(5): a lone ';' in an Exec line separates two commands. Unquoted, an
    argument ';' (a MIG config name, say) split the command in two: a second ExecStart= that
    a simple service refuses, or in a oneshot unit '--apply' run as a program of its own."""
    fastshare = _executable(tmp_path / "venv" / "bin" / "fastshare")
    unit = tmp_path / "semicolon.service"
    argv = [str(fastshare), "mig", "config", "--select", ";", "--apply", "a;", ";b"]
    [result] = run_tasks(collections_path, [
        {"ansible.builtin.copy": {"dest": str(unit), "mode": "0644", "content": "[Service]\nType=simple\n"
                                  "ExecStart={{ argv | fastshare.gpu.systemd_command }}\n"},
         "vars": {"argv": argv}},
    ], tmp_path)
    assert not result.get("failed"), result.get("msg")
    verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                            timeout=120)
    assert verify.returncode == 0 and unit.name not in verify.stderr, (unit.read_text(), verify.stderr)
    assert _exec_start(unit) == argv

def test_k8s_manifests_module_renders_fastshares_templates(collections_path: Path):
    values = {"namespace": "gpu-sharing"}
    result = run_module(collections_path, f"{COLLECTION}.k8s_manifests", {"values": values})
    assert result["changed"] is False and result["namespace"] == "gpu-sharing"
    assert result["resources"] == yaml.safe_load(yaml.safe_dump(manifests.render(values)))
    kinds = {r["kind"] for r in result["resources"]}
    assert {"CustomResourceDefinition", "Namespace", "Deployment", "DaemonSet", "Service"} <= kinds
    assert result["merged_values"] == manifests.merged_values(values)   # names the CA's objects
    assert result["merged_values"]["agent"]["caConfigMap"] == "fastshare-ca"
    bad = run_module(collections_path, f"{COLLECTION}.k8s_manifests", {"values": {"controller": 3}})
    assert bad["failed"] and "values" in bad["msg"]
    values = {"namespace": "GPU_Sharing"}   # rendered, then refused by `kubectl apply`
    bad = run_module(collections_path, f"{COLLECTION}.k8s_manifests", {"values": values})
    assert bad["failed"] and bad["msg"].startswith(
        "values: namespace: 'GPU_Sharing' cannot name a Namespace: must be at most 63 lower-case"), bad["msg"]


def _pki_vars(tmp_path: Path, **extra) -> dict:
    """roles/pki's variables for node gpu9 with the CA on localhost, files under tmp_path."""
    fastshare = str(Path(sys.executable).with_name("fastshare"))
    return {"pki_ca_host": "localhost", "pki_ca_dir": str(tmp_path / "ca"), "pki_name": "gpu9",
            "pki_sans": ["gpu9", "10.0.0.9"], "pki_fastshare": fastshare,
            "pki_dest_dir": str(tmp_path / "tls"), "pki_owner": "root", "pki_group": "root", **extra}


def _converge_pki(collections_path: Path, tmp_path: Path, check: bool = False, **extra) -> bool:
    """roles/pki for node gpu9 with the CA on localhost, files under tmp_path; whether it changed
    (``check``: in check mode)."""
    results = run_tasks(collections_path, [
        {"ansible.builtin.include_role": {"name": f"{COLLECTION}.pki"},
         "vars": _pki_vars(tmp_path, **extra)}],
        tmp_path, gather_facts=True, extra_args=["--check"] if check else None)
    failed = [str(r.get("msg")) for r in results if r.get("failed")]
    assert not failed, "\n".join(failed)   # a string: pytest shortens other messages
    return any(r.get("changed") for r in results)


def test_pki_issues_once_then_renews_only_when_due_or_names_change(collections_path: Path, tmp_path: Path):
    """roles/pki with the CA on localhost, all files under tmp_path (fastshare certs does the work)."""
    tls = tmp_path / "tls"

    def converge(**extra) -> bool:
        return _converge_pki(collections_path, tmp_path, **extra)

    assert converge() is True
    key = tls / "gpu9.key"
    assert (tls / "gpu9.crt").is_file() and (tls / "ca.crt").is_file()
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    first = (tls / "gpu9.crt").read_bytes()
    assert converge() is False, "a valid certificate with the same names must not be issued again"
    assert converge(pki_days=60, pki_renew_days=40) is True, \
        "30-day certificates are due when 40 days are required"
    assert converge(pki_days=60, pki_renew_days=40) is False, "the 60-day certificate is not due"
    assert (tls / "gpu9.crt").read_bytes() != first
    assert converge(pki_sans=["gpu9", "10.0.0.9", "gpu9.example"]) is True
    assert "gpu9.example" in describe(tls / "gpu9.crt")["sans"]
    # a name taken out is taken out of the certificate too (it stayed valid until renewal)
    assert converge(pki_sans=["gpu9", "10.0.0.9"]) is True, "a removed SAN must re-issue the certificate"
    assert sorted(describe(tls / "gpu9.crt")["sans"]) == ["10.0.0.9", "gpu9"]
    assert converge(pki_sans=["gpu9", "10.0.0.9"]) is False
    # the certificate's own name is always among its SANs: not having it in pki_sans changes nothing
    assert converge(pki_sans=["10.0.0.9"]) is False


@pytest.mark.parametrize(("days", "renew_days"), [(7, 10), (10, 10)])
def test_pki_refuses_a_renewal_window_as_long_as_the_lifetime(collections_path: Path, tmp_path: Path,
                                                              days: int, renew_days: int):
    """pki_days 7 with the default pki_renew_days 10: every new certificate was due at once, so
    each run issued it again (and restarted the agent or controller): never idempotent."""
    with pytest.raises(AssertionError) as refused:
        _converge_pki(collections_path, tmp_path, pki_days=days, pki_renew_days=renew_days)
    assert "pki_renew_days" in str(refused.value) and "pki_days" in str(refused.value)
    assert not (tmp_path / "ca" / "issued").exists(), "a certificate was issued"


def test_pki_gives_a_certificate_from_before_roles_its_role_once(collections_path: Path, tmp_path: Path):
    """A cluster set up before certificates had roles: its node certificate has none, and the
    controller now refuses it. The next run issues it again with the role, and only once."""
    tls, ca = tmp_path / "tls", tmp_path / "ca"

    def converge() -> bool:
        return _converge_pki(collections_path, tmp_path, pki_role="node")

    assert converge() is True
    assert describe(tls / "gpu9.crt")["role"] == "node"
    # What the previous version issued and installed: same names, valid for 30 days, no role.
    issue_roleless_cert(ca, "gpu9", ca / "issued" / "gpu9", sans=("10.0.0.9",))
    for name in ("gpu9.crt", "gpu9.key"):
        shutil.copy(ca / "issued" / "gpu9" / name, tls / name)
    assert describe(tls / "gpu9.crt")["role"] is None
    assert converge() is True, "a certificate without the role must be issued again"
    assert describe(tls / "gpu9.crt")["role"] == "node"
    assert converge() is False, "once it has the role, a second run changes nothing"
    # A node certificate from before node certificates listed the agent name (the name the
    # controller dials the agent by): issued again with it, once.
    issue_unchecked(ca, "gpu9", ca / "issued" / "gpu9", sans=("10.0.0.9",), role="node")
    for name in ("gpu9.crt", "gpu9.key"):
        shutil.copy(ca / "issued" / "gpu9" / name, tls / name)
    assert "gpu9.agent.fastshare.invalid" not in describe(tls / "gpu9.crt")["sans"]
    assert converge() is True, "a node certificate without the agent name must be issued again"
    assert "gpu9.agent.fastshare.invalid" in describe(tls / "gpu9.crt")["sans"]
    assert converge() is False, "once it has the agent name, a second run changes nothing"


def _fastshare_before_agent_names(tmp_path: Path) -> str:
    """A `fastshare` for the CA host from before node certificates listed the agent name."""
    script = tmp_path / "old-fastshare"
    script.write_text(f"#!{sys.executable}\n"
                      "import sys\n"
                      "from fastshare.security import certs\n"
                      "certs.agent_name = lambda node: node   # it listed only the node's own names\n"
                      "from fastshare.cli import main\n"
                      "sys.exit(main())\n")
    script.chmod(0o755)
    return str(script)


def test_pki_fails_once_when_the_ca_host_fastshare_predates_agent_names(collections_path: Path,
                                                                       tmp_path: Path):
    """With a fastshare on the CA host from before agent names, the node certificate it issued
    never had the name the role expects: each run issued it again (and restarted the agent), for
    ever, and nothing said why. Now the run fails naming the SAN and what to do, and leaves the
    certificate and key from before in place, on the CA host and on the node."""
    tls, issued = tmp_path / "tls", tmp_path / "ca" / "issued" / "gpu9"
    old = _fastshare_before_agent_names(tmp_path)

    def converge(**extra) -> bool:
        return _converge_pki(collections_path, tmp_path, pki_role="node", **extra)

    with pytest.raises(AssertionError) as refused:
        converge(pki_fastshare=old)
    assert "gpu9.agent.fastshare.invalid" in str(refused.value)
    assert "upgrade fastshare on localhost" in str(refused.value).lower() and old in str(refused.value)
    assert not issued.exists() and not tls.exists()
    # A node certificate the old fastshare issued before the role expected the agent name.
    issue_unchecked(tmp_path / "ca", "gpu9", issued, sans=("10.0.0.9",), role="node")
    tls.mkdir()
    for name in ("gpu9.crt", "gpu9.key"):
        shutil.copy(issued / name, tls / name)
    before = {path: path.read_bytes() for directory in (issued, tls) for path in directory.glob("gpu9.*")}
    with pytest.raises(AssertionError) as refused:
        converge(pki_fastshare=old)
    assert "gpu9.agent.fastshare.invalid" in str(refused.value)
    assert {path: path.read_bytes() for path in before} == before, "the certificate issued before changed"
    assert sorted(p.name for p in (tmp_path / "ca").iterdir()) == ["ca.crt", "ca.key", "issued"], \
        "a staging directory was left behind"
    # fastshare upgraded on the CA host: issued once with the name
    assert converge() is True
    assert "gpu9.agent.fastshare.invalid" in describe(tls / "gpu9.crt")["sans"]
    assert converge() is False


def test_pki_names_a_san_the_inventory_writes_otherwise_than_the_certificate(collections_path: Path,
                                                                             tmp_path: Path):
    """An IPv6 address in capitals (say as ansible_host): the certificate lists it in lower case,
    so the SANs never matched and every run issued the certificate again. Now the run fails
    saying to write it as the certificate does, not to upgrade anything."""
    with pytest.raises(AssertionError) as refused:
        _converge_pki(collections_path, tmp_path, pki_sans=["gpu9", "2001:DB8::9"])
    assert "Write 2001:DB8::9 in pki_sans" in str(refused.value), str(refused.value)
    assert "2001:db8::9" in str(refused.value) and "Upgrade" not in str(refused.value)
    assert not (tmp_path / "ca" / "issued").exists()
    assert _converge_pki(collections_path, tmp_path, pki_sans=["gpu9", "2001:db8::9"]) is True
    assert _converge_pki(collections_path, tmp_path, pki_sans=["gpu9", "2001:db8::9"]) is False



def test_pki_check_mode_with_a_certificate_due_changes_nothing(collections_path: Path, tmp_path: Path):
    """In check mode the command that reads the certificate issued before was skipped, and the
    role failed parsing its empty output (from_json) whenever a certificate existed."""
    issued = tmp_path / "ca" / "issued" / "gpu9"
    assert _converge_pki(collections_path, tmp_path) is True
    before = {path: path.read_bytes() for path in (*issued.iterdir(), *(tmp_path / "tls").iterdir())}
    _converge_pki(collections_path, tmp_path, check=True, pki_sans=["gpu9", "10.0.0.10"])
    assert {path: path.read_bytes() for path in before} == before
    assert sorted(p.name for p in (tmp_path / "ca").iterdir()) == ["ca.crt", "ca.key", "issued"]


def _check_pki(collections_path: Path, tmp_path: Path, **extra) -> list[str]:
    """roles/pki as _converge_pki runs it, in check mode: the messages of the tasks that reported a
    change; nothing under tmp_path/ca or tmp_path/tls may have been written."""
    def files() -> dict[Path, bytes]:
        return {p: p.read_bytes() for d in ("ca", "tls") for p in (tmp_path / d).rglob("*") if p.is_file()}

    before = files()
    results = run_tasks(collections_path, [
        {"ansible.builtin.include_role": {"name": f"{COLLECTION}.pki"},
         "vars": _pki_vars(tmp_path, **extra)}],
        tmp_path, gather_facts=True, extra_args=["--check"])
    failed = [str(r.get("msg")) for r in results if r.get("failed")]
    assert not failed, "\n".join(failed)
    assert files() == before, "check mode wrote files"
    return [str(r.get("msg", "")) for r in results if r.get("changed")]


@pytest.mark.parametrize("fastshare", ["installed", "not installed yet"])
def test_pki_check_mode_on_a_new_host_reports_the_certificate_and_fails_not(collections_path: Path,
                                                                          tmp_path: Path, fastshare: str):
    """A first run in check mode (no CA, no certificate; on a new host even no fastshare yet) failed
    fetching the certificate it had not issued. Now it reports the certificate it would issue, as
    changed, and writes nothing."""
    extra = {} if fastshare == "installed" else {"pki_fastshare": str(tmp_path / "opt" / "fastshare")}
    changed = _check_pki(collections_path, tmp_path, pki_role="node", **extra)
    assert any("gpu9 would be issued" in m and "none issued before" in m for m in changed), changed
    assert not (tmp_path / "ca").exists() and not (tmp_path / "tls").exists()


def test_pki_check_mode_reports_a_certificate_it_would_issue_again(collections_path: Path, tmp_path: Path):
    """In check mode the issuing was skipped and the certificate issued before compared with itself: a
    certificate due (SANs changed, a node certificate without the agent name, close to its end) was
    reported unchanged. Now check mode reports it as changed, saying why, and writes nothing."""
    ca, tls = tmp_path / "ca", tmp_path / "tls"
    assert _converge_pki(collections_path, tmp_path, pki_role="node") is True
    assert _check_pki(collections_path, tmp_path, pki_role="node") == []
    for extra, why in (({"pki_sans": ["gpu9", "10.0.0.10"]}, "SANs to add: 10.0.0.10; to drop: 10.0.0.9"),
                       ({"pki_days": 60, "pki_renew_days": 40}, "within pki_renew_days (40)"),
                       ({"pki_role": "controller"}, "role node, not controller")):
        changed = _check_pki(collections_path, tmp_path, **({"pki_role": "node"} | extra))
        assert any("gpu9 would be issued" in m and why in m for m in changed), (extra, changed)
    # a node certificate from before node certificates listed the agent name
    issue_unchecked(ca, "gpu9", ca / "issued" / "gpu9", sans=("10.0.0.9",), role="node")
    for name in ("gpu9.crt", "gpu9.key"):
        shutil.copy(ca / "issued" / "gpu9" / name, tls / name)
    changed = _check_pki(collections_path, tmp_path, pki_role="node")
    assert any("SANs to add: gpu9.agent.fastshare.invalid" in m for m in changed), changed
    assert "gpu9.agent.fastshare.invalid" not in describe(tls / "gpu9.crt")["sans"]


def test_pki_carries_a_ca_rotation_to_the_host_in_three_runs(collections_path: Path, tmp_path: Path):
    """The bare-metal CA rotation of the README: the bundle in the CA directory's ca.crt reaches
    the host before the signer changes; after the switch the certificate is issued again by the
    new CA; the old CA is dropped last. At every step the host trusts its own certificate's CA."""
    tls, ca = tmp_path / "tls", tmp_path / "ca"

    def converge() -> bool:
        return _converge_pki(collections_path, tmp_path, pki_role="node")

    def trusted() -> list[x509.Certificate]:
        return x509.load_pem_x509_certificates((tls / "ca.crt").read_bytes())

    def signer_trusted() -> None:
        cert = x509.load_pem_x509_certificate((tls / "gpu9.crt").read_bytes())
        assert any(cert.issuer == c.subject and _verifies(cert, c) for c in trusted())

    assert converge() is True
    old = x509.load_pem_x509_certificate((ca / "ca.crt").read_bytes())
    first = (tls / "gpu9.crt").read_bytes()
    init_ca(tmp_path / "new")
    new = x509.load_pem_x509_certificate((tmp_path / "new" / "ca.crt").read_bytes())

    # 1. trust both; the old CA still signs, so the certificate stays
    (ca / "ca.crt").write_bytes((ca / "ca.crt").read_bytes() + (tmp_path / "new" / "ca.crt").read_bytes())
    assert converge() is True
    assert trusted() == [old, new] and (tls / "gpu9.crt").read_bytes() == first
    signer_trusted()
    # 2. the new CA's key signs: the certificate is issued again, by the new CA
    shutil.copy(tmp_path / "new" / "ca.key", ca / "ca.key")
    assert converge() is True
    assert _verifies(x509.load_pem_x509_certificate((tls / "gpu9.crt").read_bytes()), new)
    assert trusted() == [old, new]
    signer_trusted()
    # 3. drop the old CA
    shutil.copy(tmp_path / "new" / "ca.crt", ca / "ca.crt")
    assert converge() is True
    assert trusted() == [new]
    signer_trusted()
    assert converge() is False, "after the rotation a run changes nothing"


def _verifies(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except Exception:
        return False
    return True


def test_controller_and_node_agent_keep_their_certificates_apart():
    """One host can be both a controller and a GPU node. With one TLS directory the gpu_node
    role made it root-only, so the controller's user could not read its own key, and each role
    flipped the owner back at every run."""
    def default(role: str, var: str) -> str:
        return yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text())[var]

    controller, node = default("controller", "controller_tls_dir"), default("gpu_node", "gpu_node_tls_dir")
    assert controller != node
    assert not controller.startswith(node + "/") and not node.startswith(controller + "/")


@pytest.mark.parametrize(("listen", "host"), [("127.0.0.1:7070", "127.0.0.1"), ("0.0.0.0:7070", "127.0.0.1"),
                                              ("[::]:7070", "127.0.0.1"), ("[::1]:7070", "::1"),
                                              ("ctl.example:7070", "ctl.example")])
def test_the_controller_role_waits_on_an_address_it_can_reach(collections_path: Path, tmp_path: Path,
                                                              listen: str, host: str):
    """The role waits for the controller's port before it moves on; with "[::1]:7070" it
    waited on the host "[::1]" (brackets and all) and timed out."""
    tasks = yaml.safe_load((REPO / "roles" / "controller" / "tasks" / "systemd.yml").read_text())
    wait = next(t for t in tasks if "ansible.builtin.wait_for" in t)
    [result] = run_tasks(collections_path, [
        {"ansible.builtin.debug": {"msg": wait["ansible.builtin.wait_for"]["host"]},
         "vars": {**wait["vars"], "controller_listen": listen}}], tmp_path)
    assert result["msg"] == host


@pytest.mark.parametrize(("controller_host", "address"), [
    ("192.0.2.10", "192.0.2.10:7070"), ("ctl1.example", "ctl1.example:7070"),
    ("2001:db8::10", "[2001:db8::10]:7070"), ("[2001:db8::10]", "[2001:db8::10]:7070")])
def test_node_agent_dials_the_controller_at_host_and_port(collections_path: Path, tmp_path: Path,
                                                        controller_host: str, address: str):
    """node.yaml's controller_address is the controller's ansible_host and port. An IPv6
    ansible_host was joined as '2001:db8::10:7070', itself an IPv6 address: the agent dialled
    that address on gRPC's default port and never registered."""
    from fastshare.node.config import load

    out = tmp_path / "node.yaml"
    node_vars = {**yaml.safe_load((REPO / "roles" / "gpu_node" / "defaults" / "main.yml").read_text()),
                 **yaml.safe_load((REPO / "roles" / "gpu_node" / "vars" / "main.yml").read_text()),
                 "gpu_node_gpu_backend": "nvml", "gpu_node_agent_name": "gpu1",
                 "gpu_node_agent_listen": "192.0.2.21:7444", "gpu_node_controller_address": "localhost"}
    [result] = run_tasks(collections_path, [
        {"ansible.builtin.template": {"src": str(REPO / "roles" / "gpu_node" / "templates" / "node.yaml.j2"),
                                      "dest": str(out), "mode": "0640"}, "vars": node_vars}],
        tmp_path, extra_args=["-e", f"ansible_host={controller_host}"])
    assert not result.get("failed"), result.get("msg")
    assert load(out).controller_address == address


def test_mig_reconfigure_waits_only_for_devices_in_use(collections_path: Path, tmp_path: Path):
    """playbooks/mig_reconfigure.yml drains by retrying the layout's plan until nothing in use
    stands in its way. A layout that can never apply (a profile the GPU does not have) was
    retried too: 60 times 10 s with the node cordoned and no reason shown. Now it fails at once;
    a device a share holds (the agent's journal in its state_dir) is still waited for."""
    import json

    machine, state_dir = tmp_path / "gpus.json", tmp_path / "agent"
    held = _held_mig_device(machine, state_dir)
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(json.dumps({"gpu_nodes": {"hosts": {"localhost": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}))

    def drain(layout: list[dict]) -> dict:
        extra = {"gpu_node_mig_layout": layout, "gpu_node_gpu_backend": "sim",
                 "gpu_node_sim_state": str(machine), "gpu_node_venv": str(Path(sys.executable).parents[1]),
                 "gpu_node_agent_extra": {"state_dir": str(state_dir)}, "ansible_become": False,
                 "mig_reconfigure_drain_retries": 3, "mig_reconfigure_drain_delay": 1}
        proc = run([tool("ansible-playbook"), "-i", str(inventory), "-e", json.dumps(extra),
                    str(REPO / "playbooks" / "mig_reconfigure.yml")], check=False,
                   env={"ANSIBLE_COLLECTIONS_PATH": str(collections_path),
                        "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.json"})
        tasks = json.loads(proc.stdout)["plays"][0]["tasks"]
        return next(t["hosts"]["localhost"] for t in tasks if t["task"]["name"].startswith("Drain - wait"))

    before = machine.read_bytes()
    bad = drain([{"devices": [0], "mig_devices": {"9g.99gb": 1}}])
    assert bad["failed"] and "9g.99gb" in bad["msg"] and bad.get("attempts", 1) == 1, bad
    in_use = drain([{"devices": [0], "mig_devices": {"7g.40gb": 1}}])
    assert in_use["failed"] and held in in_use["msg"] and in_use["attempts"] == 3, in_use
    assert machine.read_bytes() == before


_FAKE_SYSTEMCTL = """#!/bin/sh
# systemctl of a host whose units only record what they were told: one state file per unit; each
# call is logged with a digest of the simulated GPUs, so the log shows when the layout changed.
dir={dir}
echo "$* $(md5sum < {machine} | cut -c1-32)" >> "$dir/calls"
unit=$(echo "$2" | tr -d "'")
state=$(cat "$dir/$unit" 2>/dev/null || echo inactive)
case "$1" in
  show) printf 'Id=%s\\nLoadState=loaded\\nActiveState=%s\\n' "$unit" "$state";;
  start|restart) echo active > "$dir/$unit";;
  stop) echo inactive > "$dir/$unit";;
  is-enabled) echo enabled;;
esac
"""

# The node CLI answers `node status` only while the (fake) agent unit is active.
_FAKE_FASTSHARE = """#!/bin/sh
[ "$1 $2" = "node status" ] && [ "$(cat {dir}/fastshare-node.service 2>/dev/null)" = active ] && echo '{{}}'
"""


def _mig_reconfigure_harness(collections_path: Path, tmp_path: Path):
    """playbooks/mig_reconfigure.yml on one simulated A100 with a fake ``systemctl`` (a state per
    unit, each call logged with the machine file's digest) and a fake ``fastshare`` whose
    ``node status`` answers while the agent's unit is active. Returns the machine file, the
    units directory and ``reconfigure(**extra)``, which runs the playbook and gives the
    (action, machine digest) of each start, stop or restart of the agent's unit."""
    from fastshare.device import simnvml

    machine, units = tmp_path / "gpus.json", tmp_path / "units"
    simnvml.create_machine(machine, ["A100-SXM4-40GB"], mig_enabled=True)
    units.mkdir()
    (units / "fastshare-node.service").write_text("active\n")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name, text in (("systemctl", _FAKE_SYSTEMCTL), ("fastshare", _FAKE_FASTSHARE),
                       ("python", f'#!/bin/sh\nexec {sys.executable} "$@"\n')):
        (venv / "bin" / name).write_text(text.format(dir=units, machine=machine))
        (venv / "bin" / name).chmod(0o755)
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(json.dumps({"gpu_nodes": {"hosts": {"localhost": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}))
    base = {"gpu_node_mig_layout": [{"devices": [0], "mig_devices": {"3g.20gb": 2}}],
            "gpu_node_gpu_backend": "sim", "gpu_node_sim_state": str(machine), "gpu_node_venv": str(venv),
            "gpu_node_mig_config_file": str(tmp_path / "mig-config.yaml"),
            "gpu_node_agent_extra": {"state_dir": str(tmp_path / "agent")}, "ansible_become": False}

    def reconfigure(**extra: object) -> list[tuple[str, str]]:
        (units / "calls").write_text("")
        proc = run([tool("ansible-playbook"), "-i", str(inventory), "-e", json.dumps({**base, **extra}),
                    str(REPO / "playbooks" / "mig_reconfigure.yml")], check=False,
                   env={"ANSIBLE_COLLECTIONS_PATH": str(collections_path),
                        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"})
        assert proc.returncode == 0, proc.stdout[-3000:]
        calls = [line.split() for line in (units / "calls").read_text().splitlines()]
        return [(c[0], c[-1]) for c in calls
                if c[0] in ("start", "stop", "restart") and "fastshare-node.service" in c[1]]

    return machine, units, reconfigure


def test_mig_reconfigure_restarts_the_node_agent_once(collections_path: Path, tmp_path: Path):
    """playbooks/mig_reconfigure.yml stops the agent, applies the layout and starts the agent.
    The role's apply task also notified its restart handler, which ran at the end of the play:
    the agent that had just been started (and the node uncordoned) was restarted a second time.
    Now it is started once, after the layout changed, and a run that changes nothing leaves it be."""
    machine, units, reconfigure = _mig_reconfigure_harness(collections_path, tmp_path)
    before = hashlib.md5(machine.read_bytes()).hexdigest()
    actions = reconfigure()
    after = hashlib.md5(machine.read_bytes()).hexdigest()
    assert after != before
    # stopped before the layout changed, started once after it
    assert actions in ([("stop", before), ("start", after)], [("stop", before), ("restart", after)]), actions
    assert (units / "fastshare-node.service").read_text().strip() == "active"
    assert reconfigure() == []  # the same layout again: nothing to change, the agent keeps running


def test_mig_reconfigure_leaves_a_disabled_node_agent_alone(collections_path: Path, tmp_path: Path):
    """With ``gpu_node_agent_enabled: false`` the operator runs no agent on the node (or not as
    this unit): the playbook applied the layout, then started ``fastshare-node.service`` anyway
    and waited for it to answer. Now it applies the layout and touches no agent unit."""
    machine, units, reconfigure = _mig_reconfigure_harness(collections_path, tmp_path)
    (units / "fastshare-node.service").write_text("inactive\n")
    before = hashlib.md5(machine.read_bytes()).hexdigest()
    assert reconfigure(gpu_node_agent_enabled=False) == []
    assert hashlib.md5(machine.read_bytes()).hexdigest() != before
    assert (units / "fastshare-node.service").read_text().strip() == "inactive"


# ---- check mode (`ansible-playbook --check`) of whole roles on a host with nothing installed yet ----

# systemctl of a host that knows the units installed in /etc/systemd/system (none of fastshare's on a
# new host; other tests here install the MIG layout's), none of them enabled or running: systemd
# answers `show` of a unit it does not know with LoadState=not-found. Any call that would change
# something is logged.
_NEW_HOST_SYSTEMCTL = """#!/bin/sh
case "$1" in
  show) [ -e "/etc/systemd/system/$2" ] && load=loaded || load=not-found
        printf 'Id=%s\\nLoadState=%s\\nActiveState=inactive\\n' "$2" "$load";;
  is-enabled) echo disabled; exit 1;;
  list-unit-files) exit 1;;
  *) echo "$*" >> {log};;
esac
"""

# What the roles write outside the directories a test gives them (their fixed paths); /etc/passwd
# and /etc/group take the controller's service user.
_HOST_PATHS = ("/etc/fastshare", "/etc/systemd/system/fastshare-node.service",
               "/etc/systemd/system/fastshare-controller.service",
               "/etc/systemd/system/fastshare-mig-layout.service", "/etc/tmpfiles.d/fastshare.conf",
               "/run/fastshare", "/var/log/fastshare", "/var/lib/fastshare", "/etc/passwd", "/etc/group")


def _files(*roots: str | Path) -> dict[str, bytes | None]:
    """Every file and directory under ``roots``: contents (b"/" for a directory, None when absent)."""
    found: dict[str, bytes | None] = {}
    for root in map(Path, roots):
        for path in [root, *(sorted(root.rglob("*")) if root.is_dir() else [])]:
            found[str(path)] = b"/" if path.is_dir() else path.read_bytes() if path.exists() else None
    return found


def _check_role_on_a_new_host(collections_path: Path, tmp_path: Path, role: str, role_vars: dict,
                              service_mgr: str | None = None) -> list[dict]:
    """``role`` on localhost in check mode, with no fastshare unit known to systemd (a fake
    systemctl); every task's result. Nothing may fail, nothing may be written on the host or under
    tmp_path, and systemctl may only be asked (``service_mgr``: the fact the host reports, for a
    role that requires systemd on a machine without it)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "systemctl.log"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(_NEW_HOST_SYSTEMCTL.format(log=log))
    (bin_dir / "systemctl").chmod(0o755)
    watched = (*_HOST_PATHS, tmp_path)
    before = _files(*watched)
    tasks = [{"ansible.builtin.include_role": {"name": f"{COLLECTION}.{role}"}, "vars": role_vars}]
    if service_mgr:
        tasks.insert(0, {"ansible.builtin.set_fact": {"ansible_service_mgr": service_mgr, "cacheable": True}})
    results = run_tasks(collections_path, tasks, tmp_path, gather_facts=True, extra_args=["--check"],
                        env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    failed = [f"{r.get('action')}: {r.get('msg')}" for r in results if r.get("failed")]
    assert not failed, "\n".join(failed)
    after = _files(*watched)
    written = [path for path in after.keys() | before.keys()
               if after.get(path) != before.get(path) and path != str(tmp_path / "play.yml")]
    assert not written, f"check mode wrote {sorted(written)}"
    assert not log.exists(), f"check mode ran systemctl {log.read_text()}"
    return results


def _fake_wheel(tmp_path: Path) -> str:
    wheel = tmp_path / "dist" / "fastshare-0.1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"not read in check mode")
    return str(wheel)


def _changed_messages(results: list[dict]) -> list[str]:
    return [str(r.get("msg", "")) for r in results if r.get("changed")]


@pytest.mark.parametrize("fastshare", ["not installed yet", "installed"])
def test_controller_check_mode_on_a_new_host_fails_not(collections_path: Path, tmp_path: Path,
                                                       fastshare: str):
    """`ansible-playbook --check` of a controller host with nothing of it installed yet (or only the
    fastshare package, say on a GPU node becoming the controller too): check mode installs no unit,
    and then the restart handler and the start of fastshare-controller.service failed ("Could not find
    the requested service"). Now they are skipped, the role says the controller would be started, and
    nothing is written."""
    venv = tmp_path / "venv" if fastshare == "not installed yet" else Path(sys.executable).parents[1]
    results = _check_role_on_a_new_host(collections_path, tmp_path, "controller", {
        "controller_deploy_mode": "systemd", "controller_venv": str(venv),
        "controller_package_wheel": _fake_wheel(tmp_path), "controller_state_dir": str(tmp_path / "state"),
        "controller_tls_dir": str(tmp_path / "tls"), "pki_ca_dir": str(tmp_path / "ca")})
    changed = _changed_messages(results)
    assert any("fastshare-controller.service" in m and "would be" in m for m in changed), changed
    assert any("certificate of controller would be issued" in m for m in changed), changed


@pytest.mark.parametrize("fastshare", ["not installed yet", "installed"])
def test_gpu_node_check_mode_on_a_new_host_fails_not(collections_path: Path, tmp_path: Path,
                                                     fastshare: str):
    """`ansible-playbook --check` of a GPU node with nothing installed yet (simulated GPUs, a MIG layout):
    it failed reading the simulated machine check mode had not made, with the fastshare check mode had
    not installed, then on the MPS stand-in, the MIG layout and the agent's unit, none of which were
    there. Now the tasks that need them are skipped, a task says which and why, the units are reported
    as to be started, and nothing is written."""
    venv = tmp_path / "venv" if fastshare == "not installed yet" else Path(sys.executable).parents[1]
    results = _check_role_on_a_new_host(collections_path, tmp_path, "gpu_node", {
        "gpu_node_gpu_backend": "sim", "gpu_node_sim_gpus": ["A100-SXM4-40GB"],
        "gpu_node_sim_state": str(tmp_path / "sim" / "gpus.json"), "gpu_node_venv": str(venv),
        "gpu_node_package_wheel": _fake_wheel(tmp_path),
        "gpu_node_mig_layout": [{"devices": [0], "mig_devices": {"3g.20gb": 2}}],
        "gpu_node_controller_address": "localhost", "gpu_node_tls_dir": str(tmp_path / "tls"),
        "gpu_node_agent_extra": {"state_dir": str(tmp_path / "agent")}, "pki_ca_dir": str(tmp_path / "ca")},
        service_mgr="systemd")
    changed = _changed_messages(results)
    for unit in ("fastshare-node.service", "fastshare-mig-layout.service"):
        if not (Path("/etc/systemd/system") / unit).exists():     # (check mode installed none)
            assert any(unit in m and "would be" in m for m in changed), (unit, changed)
    said = [str(r["msg"]) for r in results if str(r.get("msg", "")).startswith("Check mode:")]
    assert len(said) == 1 and "simulated machine" in said[0] and "MIG layout" in said[0], said
    if fastshare == "not installed yet":
        assert "fastshare is not installed" in said[0] and "unit of the node agent" in said[0], said


def _role_tasks(*wanted: tuple[str, str]) -> list[dict]:
    """gpu_node tasks by (file, name), those in blocks too."""
    return [_gpu_node_tasks(f)[name] for f, name in wanted]


def test_gpu_node_check_mode_skips_the_drivers_services_and_programs_until_it_is_installed(
        collections_path: Path, tmp_path: Path):
    """Check mode on a new GPU node (nvml): the driver would be installed, but is not, so its
    persistence daemon's unit and the MPS control program it brings were not there, and check mode
    failed on them ("Could not find the requested service nvidia-persistenced.service", "... is
    missing; it comes with the NVIDIA driver"). Now they are skipped while the driver would be
    installed, and a task says so; nothing is written. With the driver there they are checked."""
    role_vars: dict = {}
    for part in ("defaults/main.yml", "vars/main.yml", "vars/Debian.yml"):
        role_vars |= yaml.safe_load((REPO / "roles" / "gpu_node" / part).read_text())
    role_vars |= {"gpu_node_gpu_backend": "nvml", "gpu_node_venv": str(Path(sys.executable).parents[1]),
                  "gpu_node_mps_control": str(tmp_path / "no-driver" / "nvidia-cuda-mps-control"),
                  "gpu_node_fastshare_found": {"stat": {"exists": True}}, "gpu_node_sim_state": "",
                  "gpu_node_mig_layout": [{"devices": "all", "mig_devices": {"3g.20gb": 2}}]}
    tasks = _role_tasks(("driver.yml", "Persistence mode"),
                        ("mps.yml", "Check the MPS control program"),
                        ("mps.yml", "Require the MPS control program"),
                        ("main.yml", "Say what check mode skips because this run would install or create "
                                     "it first"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(_NEW_HOST_SYSTEMCTL.format(log=tmp_path / "systemctl.log"))
    (bin_dir / "systemctl").chmod(0o755)

    def check(driver: dict) -> list[dict]:
        return run_tasks(collections_path, [{**t, "vars": {**role_vars, **t.get("vars", {}),
                                                           "gpu_node_driver_apt": driver}} for t in tasks],
                         tmp_path, extra_args=["--check"],
                         env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})

    pending = check({"changed": True})
    assert not [r.get("msg") for r in pending if r.get("failed")], pending
    persistence, _, mps, said = pending
    assert persistence.get("skipped") and mps.get("skipped"), pending
    assert "NVIDIA driver" in said["msg"] and "persistence mode" in said["msg"], said
    assert "MPS control program" in said["msg"] and "MIG layout" in said["msg"], said
    assert not (tmp_path / "systemctl.log").exists()
    installed = check({"changed": False})           # the driver is there: a missing program is said
    assert installed[2].get("failed") and "mps-control is missing" in installed[2]["msg"], installed
