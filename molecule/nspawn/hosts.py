#!/usr/bin/env python3
"""Real systemd hosts for molecule: Debian roots booted with systemd-nspawn, reachable over ssh.

Why this exists: there is no Docker engine on our machines, but systemd-nspawn can boot a
debootstrap'd Debian root with systemd as PID 1. Each host gets its own network namespace
with a veth pair into a bridge, so hosts talk to each other and to the Ansible control node
(this machine) over a real network, and Ansible reaches them with plain ssh.

Subcommands (all need root):
  image                     build (once) the cached Debian root; print its path
  create STATE NAME...      copy the root per host, wire the network, boot, wait for sshd;
                            print molecule's instance config as JSON
  destroy STATE             stop hosts, remove copies, namespaces, veths, bridge (idempotent)
  supervise STATE NAME      internal: run one host's nspawn, re-booting it when it reboots

Everything a run creates is recorded under STATE (molecule's ephemeral directory); network
objects carry names derived from STATE (see Net), so that runs from different checkouts can
coexist and destroy also cleans up after a crashed create without touching other runs.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import wheels

SUITE = "bookworm"
MIRROR = os.environ.get("FASTSHARE_MOLECULE_MIRROR", "http://deb.debian.org/debian")
PACKAGES = sorted(
    [
        "ca-certificates",
        "dbus",
        "iproute2",
        "iputils-ping",
        "openssh-server",
        "openssl",
        "procps",
        "python3",
        "python3-apt",
        "python3-packaging",
        "python3-pip",
        "python3-venv",
        "sudo",
        "systemd",
        "systemd-sysv",
    ]
)
# Bumped whenever the image customisation below changes, so the cache key changes too.
IMAGE_RECIPE = "3"

SUBNETS = range(1, 255)  # candidates for 10.231.X.0/24; the bridge is .1, hosts are .11, .12, ...
BOOT_TIMEOUT = float(os.environ.get("FASTSHARE_MOLECULE_BOOT_TIMEOUT", "240"))
STOP_TIMEOUT = 60.0
REBOOT_EXIT = 133  # systemd-nspawn's exit status when the container asked for a reboot


def log(msg: str) -> None:
    print(f"[hosts] {msg}", file=sys.stderr, flush=True)


def run(*cmd: str, check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(cmd, text=True, capture_output=True)
    if check and res.returncode != 0:
        raise SystemExit(f"command failed ({res.returncode}): {' '.join(cmd)}\n{res.stderr.strip()}")
    if not quiet and res.returncode != 0:
        log(f"ignored failure of {' '.join(cmd)}: {res.stderr.strip()}")
    return res


# --------------------------------------------------------------------------- image


def cache_dir() -> Path:
    base = os.environ.get("FASTSHARE_MOLECULE_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "fastshare" / "molecule"


def image_path() -> Path:
    key = hashlib.sha256(
        json.dumps([SUITE, MIRROR, PACKAGES, IMAGE_RECIPE]).encode()
    ).hexdigest()[:12]
    return cache_dir() / f"{SUITE}-{key}"


def customise_image(root: Path) -> None:
    """Make the root boot headless in a container and accept only key-based root ssh."""
    (root / "etc/apt/sources.list").write_text(
        f"deb {MIRROR} {SUITE} main\n"
        f"deb {MIRROR} {SUITE}-updates main\n"
        f"deb http://deb.debian.org/debian-security {SUITE}-security main\n"
    )
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()  # per-host keys are generated at create time
    (root / "etc/ssh/sshd_config.d/molecule.conf").write_text(
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nUseDNS no\n"
    )
    # Units that only make sense on a console or real hardware slow the boot down here.
    for unit in ("getty@tty1.service", "console-getty.service", "systemd-networkd-wait-online.service"):
        link = root / "etc/systemd/system" / unit
        if not link.is_symlink():
            link.symlink_to("/dev/null")
    (root / "etc/machine-id").write_text("")
    run("chroot", str(root), "apt-get", "clean")


def build_image() -> Path:
    """Build the Debian root once per package list; later calls only return the cached path."""
    target = image_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two concurrent creates must not both debootstrap
        if (target / ".complete").exists():
            return target
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        started = time.monotonic()
        log(f"debootstrap {SUITE} into {tmp} (once; cached afterwards)")
        res = subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(PACKAGES)}",
                SUITE,
                str(tmp),
                MIRROR,
            ],
            text=True,
            capture_output=True,
        )
        if res.returncode != 0:
            tail = "\n".join((res.stdout + res.stderr).splitlines()[-20:])
            shutil.rmtree(tmp, ignore_errors=True)
            raise SystemExit(f"debootstrap failed ({res.returncode}):\n{tail}")
        customise_image(tmp)
        (tmp / ".complete").write_text(f"{time.monotonic() - started:.1f}\n")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        for old in target.parent.glob(f"{SUITE}-*"):
            if old != target:  # roots of older package lists are never used again
                shutil.rmtree(old, ignore_errors=True)
        log(f"image built in {time.monotonic() - started:.0f}s: {target}")
        return target


# --------------------------------------------------------------------------- network


@dataclass(frozen=True)
class Net:
    """Names and addresses of one run's network, derived from its state directory.

    Several runs (other worktrees, other helpers) can live side by side on one machine: each
    has its own bridge, namespaces, veths and /24, and destroy touches only its own.
    """

    run_id: str  # 4 hex digits
    subnet: int  # X in 10.231.X.0/24

    @classmethod
    def for_state(cls, state: Path, subnet: int = 0) -> Net:
        return cls(hashlib.sha256(str(state).encode()).hexdigest()[:4], subnet)

    @property
    def bridge(self) -> str:
        return f"fsbr{self.run_id}"

    @property
    def gateway(self) -> str:
        return f"10.231.{self.subnet}.1"

    def netns(self, name: str) -> str:
        return f"fs{self.run_id}-{name}"

    def veth(self, name: str) -> str:
        return f"fv{self.run_id}{name}"[:15]  # interface names have at most 15 characters

    def address(self, index: int) -> str:
        return f"10.231.{self.subnet}.{11 + index}"


def free_subnet(run_id: str) -> int:
    """A 10.231.X.0/24 no interface on this machine uses, starting at a run-specific X."""
    used = subprocess.run(["ip", "-4", "-o", "addr", "show"], text=True, capture_output=True).stdout
    first = int(run_id, 16) % len(SUBNETS)
    for i in range(len(SUBNETS)):
        x = SUBNETS[(first + i) % len(SUBNETS)]
        if f" 10.231.{x}." not in used:
            return x
    raise SystemExit("no free 10.231.X.0/24 subnet for the molecule hosts")


def link_exists(name: str, netns: str | None = None) -> bool:
    cmd = ["ip", *(["-n", netns] if netns else []), "link", "show", name]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


def setup_bridge(net: Net) -> None:
    if not link_exists(net.bridge):
        run("ip", "link", "add", net.bridge, "type", "bridge")
    # Idempotent: "replace" does not fail if the address is already there.
    run("ip", "addr", "replace", f"{net.gateway}/24", "dev", net.bridge)
    run("ip", "link", "set", net.bridge, "up")


def setup_host_net(net: Net, name: str, index: int) -> str:
    """One namespace per host, its eth0 a veth whose peer is enslaved to the bridge."""
    ns, veth = net.netns(name), net.veth(name)
    if not netns_exists(ns):
        run("ip", "netns", "add", ns)
    if not link_exists(veth):
        run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
    run("ip", "link", "set", veth, "master", net.bridge)
    run("ip", "link", "set", veth, "up")
    run("ip", "-n", ns, "link", "set", "lo", "up")
    run("ip", "-n", ns, "addr", "replace", f"{net.address(index)}/24", "dev", "eth0")
    run("ip", "-n", ns, "link", "set", "eth0", "up")
    run("ip", "-n", ns, "route", "replace", "default", "via", net.gateway)
    return ns


def teardown_host_net(net: Net, name: str) -> None:
    if link_exists(net.veth(name)):
        run("ip", "link", "del", net.veth(name), check=False)
    if netns_exists(net.netns(name)):
        run("ip", "netns", "del", net.netns(name), check=False)


# --------------------------------------------------------------------------- hosts


def prepare_root(state: Path, net: Net, image: Path, name: str, names: list[str]) -> Path:
    root = state / "machines" / name
    if root.exists():
        shutil.rmtree(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    run("cp", "-a", "--reflink=auto", str(image), str(root))
    (root / ".complete").unlink(missing_ok=True)
    (root / "etc/hostname").write_text(f"{name}\n")
    hosts = "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"
    hosts += "".join(f"{net.address(i)} {n}\n" for i, n in enumerate(names))
    (root / "etc/hosts").write_text(hosts)
    # No DNS server is reachable from the hosts: the copied host resolver would make every
    # lookup that skips /etc/hosts (gRPC's c-ares asks DNS for SRV/TXT records) wait for a
    # timeout. A local address without a server fails at once instead.
    (root / "etc/resolv.conf").unlink(missing_ok=True)
    (root / "etc/resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    (root / "etc/machine-id").write_text(uuid.uuid4().hex + "\n")
    run("ssh-keygen", "-q", "-A", "-f", str(root))  # this host's own ssh host keys
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    (ssh_dir / "authorized_keys").write_text((state / "id_ed25519.pub").read_text())
    (ssh_dir / "authorized_keys").chmod(0o600)
    (root / "etc/pip.conf").write_text(wheels.pip_conf())
    for path in wheels.MOUNTS.values():
        (root / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
    return root


def nspawn_cmd(state: Path, name: str) -> list[str]:
    recorded = json.loads((state / "hosts.json").read_text())
    binds, net = recorded["binds"], Net.for_state(state, recorded["subnet"])
    return [
        "systemd-nspawn",
        "--quiet",
        "--boot",
        "--register=no",
        "--keep-unit",
        f"--machine={name}",
        f"--directory={state / 'machines' / name}",
        f"--network-namespace-path=/run/netns/{net.netns(name)}",
        "--console=read-only",
        "--resolv-conf=off",
        "--timezone=off",
        *[f"--bind-ro={src}:{dst}" for src, dst in binds.items()],
    ]


def ensure_nspawn_runtime_dir() -> None:
    """systemd-nspawn needs /run/systemd/nspawn on a tmpfs (it bind-mounts through it)."""
    path = Path("/run/systemd/nspawn")
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mountpoint", "-q", str(path)]).returncode != 0:
        run("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", str(path))


def supervise(state: Path, name: str) -> int:
    """Run the container in the foreground; boot it again when it asked for a reboot.

    Without a host systemd there is no unit with RestartForceExitStatus=133, so this loop is
    what turns `systemctl reboot` inside a host into a real reboot. SIGTERM powers it off.
    """
    child: subprocess.Popen[bytes] | None = None
    stopping = False

    def on_term(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child and child.poll() is None:
            child.send_signal(signal.SIGTERM)  # nspawn turns this into an orderly poweroff

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    while True:
        child = subprocess.Popen(nspawn_cmd(state, name))
        rc = child.wait()
        print(f"[supervise] {name}: systemd-nspawn exited {rc}", flush=True)
        if stopping or rc != REBOOT_EXIT:
            return rc
        with (state / "run" / f"{name}.boots").open("a") as boots:
            boots.write(f"{time.time()}\n")


def start_host(state: Path, name: str) -> int:
    rundir = state / "run"
    rundir.mkdir(parents=True, exist_ok=True)
    with open(rundir / f"{name}.log", "ab") as logfile:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "supervise", str(state), name],
            stdin=subprocess.DEVNULL,
            stdout=logfile,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: destroy can signal all of it at once
            close_fds=True,
        )
    (rundir / f"{name}.pid").write_text(f"{proc.pid}\n")
    return proc.pid


def ssh_base(state: Path, addr: str) -> list[str]:
    return [
        "ssh",
        "-i", str(state / "id_ed25519"),
        "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=no",
        "-o", "UserKnownHostsFile=/dev/null",
        "-o", "LogLevel=ERROR",
        "-o", "ConnectTimeout=5",
        f"root@{addr}",
    ]


def wait_ready(state: Path, name: str, addr: str, pid: int, deadline: float) -> str:
    """Wait until sshd answers and systemd finished booting; return the system state."""
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            tail = (state / "run" / f"{name}.log").read_text(errors="replace").splitlines()[-25:]
            raise SystemExit(f"{name}: systemd-nspawn exited during boot:\n" + "\n".join(tail))
        with contextlib.suppress(OSError), socket.create_connection((addr, 22), timeout=3):
            res = subprocess.run(
                [*ssh_base(state, addr), "systemctl", "is-system-running", "--wait"],
                text=True,
                capture_output=True,
                timeout=max(5.0, deadline - time.monotonic()),
            )
            status = res.stdout.strip()
            if status in ("running", "degraded"):
                return status
        time.sleep(1)
    raise SystemExit(f"{name}: not ready after {BOOT_TIMEOUT:.0f}s (see {state / 'run' / (name + '.log')})")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def create(state: Path, names: list[str], repo: Path) -> list[dict[str, object]]:
    state.mkdir(parents=True, exist_ok=True)
    destroy(state)  # leftovers of an earlier, failed run of this scenario
    started = time.monotonic()
    image = build_image()
    key = state / "id_ed25519"
    key.unlink(missing_ok=True)
    Path(str(key) + ".pub").unlink(missing_ok=True)
    run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "molecule", "-f", str(key))
    t0 = time.monotonic()
    binds = {
        str(wheels.deps_wheelhouse(repo, cache_dir())): wheels.MOUNTS["deps"],
        str(wheels.local_wheel(repo, state / "wheels-local")): wheels.MOUNTS["local"],
    }
    log(f"wheelhouses ready in {time.monotonic() - t0:.1f}s")
    net = Net.for_state(state)
    net = Net.for_state(state, free_subnet(net.run_id))
    # Recorded before anything exists, so that destroy finds every piece of a partial create.
    (state / "hosts.json").write_text(json.dumps({"names": names, "binds": binds, "subnet": net.subnet}))
    ensure_nspawn_runtime_dir()
    setup_bridge(net)
    pids = {}
    for i, name in enumerate(names):
        t0 = time.monotonic()
        prepare_root(state, net, image, name, names)
        log(f"{name}: root ready in {time.monotonic() - t0:.1f}s")
        setup_host_net(net, name, i)
        pids[name] = start_host(state, name)
    deadline = time.monotonic() + BOOT_TIMEOUT
    for i, name in enumerate(names):
        status = wait_ready(state, name, net.address(i), pids[name], deadline)
        log(f"{name}: {status} at {net.address(i)} (bridge {net.bridge}, namespace {net.netns(name)})")
    log(f"{len(names)} hosts up in {time.monotonic() - started:.1f}s")
    return [
        {
            "instance": name,
            "address": net.address(i),
            "user": "root",
            "port": 22,
            "identity_file": str(key),
        }
        for i, name in enumerate(names)
    ]


def processes_rooted_in(root: Path) -> list[int]:
    """PIDs whose root directory is inside ROOT: what is left of a container after nspawn died."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if Path(os.readlink(proc / "root")).is_relative_to(root):
                found.append(int(proc.name))
    return found


def stop_hosts(state: Path, names: list[str]) -> None:
    """Power all hosts off at once (SIGTERM -> orderly shutdown), then kill what is left."""
    pids = {}
    for name in names:
        pidfile = state / "run" / f"{name}.pid"
        if pidfile.exists():
            pid = int(pidfile.read_text())
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                pids[name] = pid
            pidfile.unlink()
    deadline = time.monotonic() + STOP_TIMEOUT
    while any(pid_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for name, pid in pids.items():
        if pid_alive(pid):
            log(f"{name}: no orderly poweroff within {STOP_TIMEOUT:.0f}s; killing")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    for name in names:
        kill_leftovers(state / "machines" / name)


def kill_leftovers(root: Path) -> None:
    for _ in range(10):
        left = processes_rooted_in(root)
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)


def destroy(state: Path) -> None:
    """Remove everything this run (this state directory) made; other runs are left alone."""
    net = Net.for_state(state)
    names: list[str] = []
    with contextlib.suppress(OSError, ValueError, KeyError):
        names = json.loads((state / "hosts.json").read_text())["names"]
    machines = state / "machines"
    if machines.is_dir():
        names += [p.name for p in machines.iterdir() if p.name not in names]
    # Namespaces of this run that a crashed create made but did not get to record.
    if Path("/run/netns").is_dir():
        prefix = net.netns("")
        names += [ns.name[len(prefix):] for ns in Path("/run/netns").glob(prefix + "*")
                  if ns.name[len(prefix):] not in names]
    stop_hosts(state, names)
    for name in names:
        teardown_host_net(net, name)
        shutil.rmtree(machines / name, ignore_errors=True)
    if link_exists(net.bridge):
        run("ip", "link", "del", net.bridge, check=False)
    (state / "hosts.json").unlink(missing_ok=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("image")
    p = sub.add_parser("create")
    p.add_argument("state", type=Path)
    p.add_argument("names", nargs="+")
    p.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2],
                   help="checkout whose fastshare wheel the hosts get (default: this one)")
    p = sub.add_parser("destroy")
    p.add_argument("state", type=Path)
    p = sub.add_parser("supervise")
    p.add_argument("state", type=Path)
    p.add_argument("name")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (network namespaces, bridges and systemd-nspawn)")
    if args.cmd == "image":
        print(build_image())
    elif args.cmd == "create":
        print(json.dumps(create(args.state.resolve(), args.names, args.repo.resolve())))
    elif args.cmd == "destroy":
        destroy(args.state.resolve())
    elif args.cmd == "supervise":
        return supervise(args.state.resolve(), args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
