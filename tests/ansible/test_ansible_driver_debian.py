"""The gpu_node role's Debian driver tasks against a real apt and dpkg.

A throw-away Debian root (an overlay on the molecule scenario's cached debootstrap root, see
molecule/nspawn/hosts.py) gets a local file: apt repository of tiny packages built here with
dpkg-deb: the driver packages of vars/Debian.yml in several versions, the kernel headers the
role installs, and a library the operator holds. The role's tasks, from the kernel headers to
the reboot decision, run in it over Ansible's chroot connection with the root's facts.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fs_collection import REPO, run, tool

ROLE = REPO / "roles" / "gpu_node"
KERNEL = platform.release()          # what the chroot's facts say (same kernel)
A, B, C, D = "550.90.07-1", "550.127.05-1", "550.135.01-1", "550.142.01-1"
DRIVER = yaml.safe_load((ROLE / "vars" / "Debian.yml").read_text())["gpu_node_driver_packages"]
# The operator holds this one; only the driver of version D needs a newer one.
OTHER = "fake-held-lib"
FIRST_TASK = "Install the kernel headers for DKMS (Debian family)"
LAST_TASK = "Decide whether the driver change needs a reboot"


def root_problem() -> str | None:
    """Why this machine cannot build and enter a Debian root, or None."""
    if os.geteuid() != 0:
        return "needs root (mount, chroot, dpkg in the root)"
    for name in ("chroot", "mount", "umount", "dpkg-deb"):
        if shutil.which(name) is None:
            return f"{name} not found (make pytest installs scripts/system-packages.txt when root)"
    return None


def debian_image() -> Path:
    """The molecule scenario's cached Debian root; built (debootstrap, network) when missing."""
    sys.path.insert(0, str(REPO / "molecule" / "nspawn"))
    try:
        import hosts
    finally:
        sys.path.pop(0)
    if (hosts.image_path() / ".complete").exists():
        return hosts.image_path()
    if shutil.which("debootstrap") is None:
        pytest.skip("no cached Debian root and debootstrap not found")
    try:
        return hosts.build_image()
    except SystemExit as exc:
        pytest.skip(f"no cached Debian root and it cannot be built here: {exc}")


def build_deb(out: Path, name: str, version: str, depends: str = "") -> None:
    src = out.parent / "src" / f"{name}_{version}"
    (src / "DEBIAN").mkdir(parents=True)
    (src / "DEBIAN" / "control").write_text(
        f"Package: {name}\nVersion: {version}\nArchitecture: all\nMaintainer: tests <t@example.org>\n"
        + (f"Depends: {depends}\n" if depends else "") + f"Description: fake {name} for the driver tests\n")
    doc = src / "usr" / "share" / "doc" / name
    doc.mkdir(parents=True)
    (doc / "VERSION").write_text(f"{version}\n")
    subprocess.run(["dpkg-deb", "-Zgzip", "-z1", "--root-owner-group", "--build", str(src),
                    str(out / f"{name}_{version}_all.deb")], check=True, capture_output=True)


def write_repository(repo: Path) -> None:
    """Flat repository: the .debs and their Packages index (`deb [trusted=yes] file:... ./`)."""
    repo.mkdir(parents=True)
    for version in (A, B, C, D):
        for name in DRIVER:
            if name == "nvidia-driver":   # the parts of one driver go together, as in Debian
                needs = [f"{part} (= {version})" for part in DRIVER if part != name]
                needs += [f"{OTHER} (>= 2.0)"] if version == D else []
                build_deb(repo, name, version, ", ".join(needs))
            else:
                build_deb(repo, name, version)
    build_deb(repo, f"linux-headers-{KERNEL}", "6.1.0-1")
    for version in ("1.0", "2.0"):
        build_deb(repo, OTHER, version)
    stanzas = []
    for deb in sorted(repo.glob("*.deb")):
        control = subprocess.run(["dpkg-deb", "--field", str(deb)], check=True, capture_output=True,
                                 text=True).stdout.strip()
        data = deb.read_bytes()
        stanzas.append(f"{control}\nFilename: ./{deb.name}\nSize: {len(data)}\n"
                       f"SHA256: {hashlib.sha256(data).hexdigest()}\n")
    (repo / "Packages").write_text("\n".join(stanzas))


def in_root(root: Path, *argv: str) -> str:
    return subprocess.run(["chroot", str(root), *argv], check=True, capture_output=True, text=True,
                          timeout=120).stdout


@pytest.fixture(scope="module")
def debian_root(tmp_path_factory: pytest.TempPathFactory):
    problem = root_problem()
    if problem:
        pytest.skip(problem)
    image = debian_image()
    base = tmp_path_factory.mktemp("debian-root")
    root, upper, work = base / "root", base / "upper", base / "work"
    for d in (root, upper, work):
        d.mkdir()
    mounted = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                              f"lowerdir={image},upperdir={upper},workdir={work}", str(root)],
                             capture_output=True).returncode == 0
    if not mounted:     # no overlayfs here: a plain copy (about 300 MB)
        subprocess.run(["cp", "-a", f"{image}/.", str(root)], check=True)
    try:
        write_repository(root / "srv" / "fake-nvidia")
        # Only the local repository: nothing of the test reaches the network.
        (root / "etc" / "apt" / "sources.list").write_text("deb [trusted=yes] file:/srv/fake-nvidia ./\n")
        for extra in (root / "etc" / "apt" / "sources.list.d").glob("*"):
            extra.unlink()
        in_root(root, "apt-get", "update", "-q")
        # The operator's own hold on a package that is not the driver's.
        in_root(root, "apt-get", "install", "-y", "-q", f"{OTHER}=1.0")
        in_root(root, "apt-mark", "hold", OTHER)
        yield root
    finally:
        if mounted:
            subprocess.run(["umount", str(root)], check=False)
        shutil.rmtree(base, ignore_errors=True)


def installed(root: Path) -> dict[str, tuple[str, str]]:
    """package -> (version, selection) for what dpkg has installed among the test's packages."""
    out = in_root(root, "dpkg-query", "--show", "--showformat=${Package} ${Version} ${db:Status-Abbrev}\\n")
    rows = (line.split() for line in out.splitlines())
    selection = {"h": "hold", "i": "install"}
    ours = {*DRIVER, OTHER, f"linux-headers-{KERNEL}"}
    return {r[0]: (r[1], selection.get(r[2][0], r[2][0])) for r in rows
            if len(r) == 3 and r[2][1] == "i" and r[0] in ours}


def driver_tasks() -> list[dict]:
    """driver.yml from the kernel headers to the reboot decision, with the role's variables."""
    tasks = yaml.safe_load((ROLE / "tasks" / "driver.yml").read_text())
    names = [t["name"] for t in tasks]
    picked = tasks[names.index(FIRST_TASK):names.index(LAST_TASK) + 1]
    role_vars = {}
    for part in ("defaults/main.yml", "vars/main.yml", "vars/Debian.yml"):
        role_vars |= yaml.safe_load((ROLE / part).read_text())
    # Registered by the repository tasks before these (not run: they need the network).
    role_vars |= {"gpu_node_apt_sources": {"changed": False}, "gpu_node_apt_repo": {"changed": False}}
    return [{**t, "vars": {**role_vars, **t.get("vars", {})}} for t in picked]


def converge(collections_path: Path, root: Path, tmp_path: Path, version: str,
             *extra: str) -> dict[str, dict]:
    """One run of the tasks in the root (facts gathered there); task name -> result."""
    play = [{"name": "gpu_node driver tasks", "hosts": "debian", "gather_facts": True,
             "gather_subset": ["!all", "min"], "tasks": driver_tasks()}]
    playbook = tmp_path / "driver.yml"
    playbook.write_text(json.dumps(play))
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(json.dumps({"all": {"hosts": {"debian": {
        "ansible_connection": "community.general.chroot", "ansible_host": str(root),
        "ansible_python_interpreter": "/usr/bin/python3"}}}}))
    proc = run([tool("ansible-playbook"), "-i", str(inventory), str(playbook),
                "-e", json.dumps({"gpu_node_driver_version": version}), *extra], check=False,
               env={"ANSIBLE_COLLECTIONS_PATH": str(collections_path),
                    "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.json"})
    try:
        tasks = json.loads(proc.stdout)["plays"][0]["tasks"]
    except (ValueError, KeyError, IndexError):
        pytest.fail(f"no JSON result (rc {proc.returncode})\n{proc.stdout}\n{proc.stderr}")
    return {t["task"]["name"]: t["hosts"]["debian"] for t in tasks}


def failures(results: dict[str, dict]) -> dict[str, str]:
    return {name: r.get("msg", "") for name, r in results.items() if r.get("failed")}


def changed(results: dict[str, dict]) -> list[str]:
    return [name for name, r in results.items() if r.get("changed")]


def reboot_needed(results: dict[str, dict]) -> bool:
    return results[LAST_TASK]["ansible_facts"]["gpu_node_reboot_needed"] is True


INSTALL = "Install the NVIDIA driver (Debian family)"
RELEASE = "Release the hold of the driver packages that change version (Debian family)"
HOLD = "Hold the driver packages at this version (Debian family)"


def test_driver_version_is_installed_held_and_changed_only_when_asked(
        collections_path: Path, debian_root: Path, tmp_path: Path):
    """The operator's lever, gpu_node_driver_version, on a real apt and dpkg: install A (held);
    "" moves nothing though newer versions are there; B upgrades exactly the driver and holds it
    again; check mode reports C and installs nothing; back to A is a downgrade; a version whose
    driver needs the operator's held library fails, leaving that hold and the driver's in place."""
    root = debian_root
    headers = (f"linux-headers-{KERNEL}", ("6.1.0-1", "install"))
    other = (OTHER, ("1.0", "hold"))

    def driver_at(version: str) -> dict:
        return {**{name: (version, "hold") for name in DRIVER}, headers[0]: headers[1], other[0]: other[1]}

    first = converge(collections_path, root, tmp_path, A)
    assert failures(first) == {}
    assert installed(root) == driver_at(A)
    assert first[INSTALL]["changed"] and first[HOLD]["changed"] and reboot_needed(first)
    assert not first.get(RELEASE, {}).get("changed")          # nothing was installed to release

    again = converge(collections_path, root, tmp_path, "")
    assert changed(again) == [] and not reboot_needed(again), changed(again)
    assert installed(root) == driver_at(A), "no surprise upgrade while C and D are available"

    upgrade = converge(collections_path, root, tmp_path, B)
    assert failures(upgrade) == {}
    assert installed(root) == driver_at(B)
    assert sorted(r["item"] for r in upgrade[RELEASE]["results"] if r["changed"]) == sorted(DRIVER)
    assert upgrade[INSTALL]["changed"] and reboot_needed(upgrade)
    assert changed(converge(collections_path, root, tmp_path, B)) == []    # pinned at B: a no-op

    preview = converge(collections_path, root, tmp_path, C, "--check")
    assert failures(preview) == {}
    assert preview[INSTALL]["changed"] and reboot_needed(preview)
    assert f"Inst nvidia-driver [{B}] ({C} " in preview[INSTALL]["stdout"], preview[INSTALL]["stdout"]
    assert installed(root) == driver_at(B), "check mode installed or released something"

    downgrade = converge(collections_path, root, tmp_path, A)
    assert failures(downgrade) == {}
    assert installed(root) == driver_at(A) and reboot_needed(downgrade)

    refused = converge(collections_path, root, tmp_path, D)
    assert refused[INSTALL].get("failed"), refused[INSTALL]
    # "E: Unable to correct problems, you have held broken packages." / "nvidia-driver :
    # Depends: fake-held-lib (>= 2.0) but 1.0 is to be installed"
    assert "held broken packages" in refused[INSTALL]["msg"], refused[INSTALL]
    assert f"Depends: {OTHER} (>= 2.0)" in refused[INSTALL]["stdout"], refused[INSTALL]
    assert installed(root) == driver_at(A), "the operator's hold was released, or the driver's not restored"


REPORT = "Report the driver that would come from the package source this run adds (check mode)"


def test_check_mode_on_a_new_host_reports_the_driver_of_the_source_it_would_add(
        collections_path: Path, debian_root: Path, tmp_path: Path):
    """A new Debian host: the driver's packages come from a component (non-free) or repository that
    the role adds first, which check mode does not add, nor read. apt, asked in check mode, did not
    know them ("No package matching 'nvidia-driver' is available") and `--check` failed. Now the
    install is reported as coming from the new source, and a reboot as needed to load it; nothing is
    installed. A driver missing from sources the role adds nothing to still fails check mode. With
    the source there already, check mode then failed holding packages dpkg had never seen ("Failed
    to find package"); now it holds those it knows and reports the install."""
    root = debian_root
    sources = root / "etc" / "apt" / "sources.list"
    kept = sources.read_text()
    main = root / "srv" / "fake-main"     # the distribution's main: the kernel headers, no driver
    main.mkdir()
    for deb in (root / "srv" / "fake-nvidia").glob("linux-headers-*.deb"):
        shutil.copy(deb, main / deb.name)
    stanzas = (root / "srv" / "fake-nvidia" / "Packages").read_text().split("\n\n")
    (main / "Packages").write_text("\n\n".join(s for s in stanzas if "Package: linux-headers-" in s))
    in_root(root, "apt-get", "purge", "-y", "-q", "--allow-change-held-packages", *DRIVER)
    try:
        sources.write_text("deb [trusted=yes] file:/srv/fake-main ./\n")
        in_root(root, "apt-get", "update", "-q")
        before = installed(root)
        adding = json.dumps({"gpu_node_apt_sources": {"changed": True}})
        preview = converge(collections_path, root, tmp_path, "", "--check", "-e", adding)
        assert failures(preview) == {}, failures(preview)
        assert INSTALL not in changed(preview) and REPORT in changed(preview), changed(preview)
        assert "nvidia-driver" in preview[REPORT]["msg"] and "source this run adds" in preview[REPORT]["msg"]
        assert reboot_needed(preview)
        assert installed(root) == before, "check mode installed something"
        # No source added by this run: the driver missing from apt's sources is a failure, as before.
        unknown = converge(collections_path, root, tmp_path, "", "--check")
        assert "No package matching" in failures(unknown).get(INSTALL, ""), failures(unknown)
        # The source is there (the driver not installed yet): apt's simulation reports the install.
        sources.write_text(kept)
        in_root(root, "apt-get", "update", "-q")
        known = converge(collections_path, root, tmp_path, B, "--check")   # (D needs a held library)
        assert failures(known) == {}, failures(known)
        assert INSTALL in changed(known) and REPORT not in changed(known) and reboot_needed(known)
        assert installed(root) == before, "check mode installed something"
    finally:
        sources.write_text(kept)
        in_root(root, "apt-get", "update", "-q")
