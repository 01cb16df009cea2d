"""`fastshare run -- CMD`: hold a GPU allocation for exactly as long as CMD runs.

Allocates (with a lease and an idempotency key, so a retry after a controller restart finds
the same allocation), runs CMD with the allocation's environment, forwards signals, renews
the lease while CMD runs, releases when CMD exits (also when it crashes or is killed) and
exits with CMD's status; what CMD leaves running is ended first. If `fastshare run` itself is
killed with SIGKILL, CMD and every process under it are ended (Linux: a supervisor with the
parent-death signal, see _SUPERVISOR), the lease expires and the controller releases the
allocation.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import click
import grpc

from fastshare.cli._output import fail
from fastshare.controller.client import client_options
from fastshare.controller.validation import MAX_GPUS_PER_NODE, MAX_LEASE_TTL, MAX_SM_COUNT, MIN_LEASE_TTL

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
NO_LEASE_CHECK_S = 5.0   # how often a run without a lease checks that its allocation still stands
KILL_GRACE_S = 5.0       # from SIGTERM to SIGKILL for what CMD leaves running when it ends


def _quota(text: str | None) -> tuple[float, float]:
    if not text:
        return 0.0, 0.0
    try:
        parts = [float(p) for p in text.split(":")]
    except ValueError:
        fail(f"--quota {text!r}: use REQUEST:LIMIT fractions, e.g. 0.3:0.6 (or one number for both)")
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2:
        fail(f"--quota {text!r}: use REQUEST:LIMIT, e.g. 0.3:0.6")
    return parts[0], parts[1]


# The controller names the request field it refuses; the user typed the flag.
FLAGS = {"spec.kind": "--kind", "spec.sm_percent": "--sm", "spec.memory_bytes": "--mem",
         "spec.quota_request": "--quota", "spec.quota_limit": "--quota", "spec.gpu_count": "--gpus",
         "spec.mig_profile": "--mig-profile", "spec.sm_count": "--sm-count", "spec.models": "--model",
         "spec.node_selector": "--selector", "spec.affinity": "--affinity",
         "spec.anti_affinity": "--anti-affinity", "spec.exclusion": "--exclusion", "owner": "--owner",
         "lease_ttl_seconds": "--lease-ttl", "idempotency_key": "--key"}


def _with_flag(details: str) -> str:
    """'spec.sm_percent: must be ...' -> 'spec.sm_percent (--sm): must be ...'."""
    field, sep, rest = details.partition(":")
    return f"{field} ({FLAGS[field]}){sep}{rest}" if sep and field in FLAGS else details


def _retry(client, method: str, request, attempts: int = 5):
    """``client.call(method, request)``, retried while the controller is unreachable, saying so
    on stderr (a retry after a controller restart finds the same allocation: idempotency key)."""
    for attempt in range(attempts):
        try:
            return client.call(method, request)
        except grpc.RpcError as exc:
            if exc.code() not in RETRYABLE or attempt == attempts - 1:
                raise
            delay = min(2.0 * (attempt + 1), 5.0)
            click.echo(f"fastshare: {method}: controller at {client.config.address} {exc.code().name}, "
                       f"retrying in {delay:g} s", err=True)
            time.sleep(delay)
    raise AssertionError(method)


def _describe(a) -> str:
    from fastshare.v1 import controller_pb2 as pb

    devices = ", ".join(
        f"GPU {d.gpu_index}" + (f" MIG {d.mig_profile}@{d.mig_start}" if d.mig_profile else "")
                        for d in a.devices)
    state = pb.AllocationState.Name(a.state).split("_")[-1].lower()
    return f"allocation {a.id} ({state}) on {a.node}: {devices}"


@click.command("run", context_settings={"allow_interspersed_args": False})
@click.option("--kind", type=click.Choice(["fastpod", "mps", "exclusive", "whole"]), default="fastpod",
              show_default=True, help="fastpod: SM share + memory limit (MPS); mps: memory-only MPS share; "
              "exclusive: a MIG slice; whole: whole GPUs.")
@click.option("--sm", "sm_percent", type=click.IntRange(0, 100), default=0,
              help="SM share in % (fastpod; exclusive: slice size).")
@click.option("--mem", "memory", help="GPU memory, e.g. 8GiB (fastpod limit, mps share, exclusive minimum).")
@click.option("--quota", help="Time quota REQUEST:LIMIT fractions of the GPU, e.g. 0.3:0.6 (fastpod).")
@click.option("--gpus", "gpu_count", type=click.IntRange(1, MAX_GPUS_PER_NODE), default=None,
              help="Number of whole GPUs (whole) [1].")
@click.option("--mig-profile", default="", help="Exact MIG profile, e.g. 3g.20gb (exclusive).")
@click.option("--sm-count", type=click.IntRange(0, MAX_SM_COUNT), default=0,
              help="Smallest MIG slice with this many SMs (exclusive).")
@click.option("--model", "models", multiple=True,
              help="Allowed GPU models (globs, repeatable), e.g. 'H100*'.")
@click.option("--selector", "selectors", multiple=True, help="Node label KEY=VALUE (repeatable).")
@click.option("--affinity", default="", help="Share a GPU with others carrying this tag.")
@click.option("--anti-affinity", default="", help="Never share a GPU with others carrying this tag.")
@click.option("--exclusion", default="", help="Only share a GPU with others carrying this tag.")
@click.option("--owner", default=None, help="Owner recorded with the allocation [user@host].")
@click.option("--lease-ttl", type=click.IntRange(0, MAX_LEASE_TTL), default=30, show_default=True,
              help="Seconds the allocation survives without renewal (covers kill -9 of this command): "
              f"{MIN_LEASE_TTL} or more; 0 = no lease, held until released.")
@click.option("--key", "idempotency_key", default=None, help="Idempotency key [random per invocation].")
@click.option("--quiet", "-q", is_flag=True, help="No allocation summary on stderr.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@client_options
def run(client_config, kind, sm_percent, memory, quota, gpu_count, mig_profile, sm_count, models, selectors,
        affinity, anti_affinity, exclusion, owner, lease_ttl, idempotency_key, quiet, command) -> None:
    """Run COMMAND on an allocated GPU share:  fastshare run --sm 30 --mem 8GiB -- python train.py"""
    from fastshare.controller.client import Client, ClientConfigError, parse_bytes, unreachable_hint
    from fastshare.v1 import common_pb2
    from fastshare.v1 import controller_pb2 as pb

    try:
        memory_bytes = parse_bytes(memory) if memory else 0
    except ValueError as exc:
        fail(f"--mem: {exc}")
    selector = {}
    for item in selectors:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(f"--selector {item!r}: use KEY=VALUE")
        selector[key] = value
    quota_request, quota_limit = _quota(quota)
    kinds = {"fastpod": common_pb2.SHARE_KIND_FASTPOD, "mps": common_pb2.SHARE_KIND_MPS,
             "exclusive": common_pb2.SHARE_KIND_EXCLUSIVE, "whole": common_pb2.SHARE_KIND_WHOLE}
    spec = pb.AllocationSpec(
        kind=kinds[kind], sm_percent=sm_percent, memory_bytes=memory_bytes, quota_request=quota_request,
        quota_limit=quota_limit, mig_profile=mig_profile, sm_count=sm_count,
        gpu_count=gpu_count or (1 if kind == "whole" else 0), models=list(models), node_selector=selector,
        affinity=affinity, anti_affinity=anti_affinity, exclusion=exclusion)
    request = pb.AllocateRequest(spec=spec, owner=owner or f"{getpass.getuser()}@{socket.gethostname()}",
                                 idempotency_key=idempotency_key or f"run-{uuid.uuid4().hex}",
                                 lease_ttl_seconds=lease_ttl)
    try:
        client = Client(client_config)
    except ClientConfigError as exc:
        fail(str(exc))
    try:
        allocation = _retry(client, "Allocate", request)
    except grpc.RpcError as exc:
        label = {grpc.StatusCode.RESOURCE_EXHAUSTED: "rejected",
                 grpc.StatusCode.INVALID_ARGUMENT: "invalid request",
                 grpc.StatusCode.UNAUTHENTICATED: "not authenticated"}.get(
                     exc.code(), f"controller at {client_config.address}: {exc.code().name}")
        details = exc.details() or ""
        fail(f"{label}: {_with_flag(details) if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else details}",
             unreachable_hint(exc, client_config))
    if allocation.state != pb.ALLOCATION_STATE_ACTIVE:
        if allocation.state in (pb.ALLOCATION_STATE_PENDING, pb.ALLOCATION_STATE_PREPARED):
            # Its node is down; once back it would be made active for nobody (and held for good
            # without a lease): give it back.
            _release(client, allocation.id, quiet=True)
        why = f": {allocation.reason}" if allocation.reason else ""
        fail(f"{_describe(allocation)} is not usable{why}",
             "run again without --key for a new allocation" if allocation.reason else None)
    if not quiet:
        click.echo(f"fastshare: {_describe(allocation)}", err=True)
    code = _run_child(client, allocation, command, lease_ttl, quiet)
    sys.exit(code)


def _run_child(client, allocation, command, lease_ttl: int, quiet: bool) -> int:
    from fastshare.v1 import controller_pb2 as pb

    stop = threading.Event()

    def watch() -> None:
        """Keep the lease alive; without a lease, only check now and then that the allocation
        still stands (renewing one would be refused every time). Either way, stop the command
        when the allocation is released elsewhere."""
        gone = (pb.ALLOCATION_STATE_RELEASING, pb.ALLOCATION_STATE_RELEASED, pb.ALLOCATION_STATE_FAILED)
        while not stop.wait(max(1.0, lease_ttl / 3) if lease_ttl else NO_LEASE_CHECK_S):
            try:
                if lease_ttl:
                    # with its own ttl: a record that lost its lease (adopted after a restore of
                    # the controller's state, from a share made before shares carried the lease)
                    # gets it back instead of refusing every renewal
                    client.call("RenewLease", pb.RenewLeaseRequest(allocation_id=allocation.id,
                                                                   ttl_seconds=lease_ttl), timeout=10)
                    continue
                released = client.call("Get", pb.GetAllocationRequest(allocation_id=allocation.id),
                                       timeout=10).state in gone
            except grpc.RpcError as exc:
                what = "lease renewal" if lease_ttl else "allocation check"
                click.echo(f"fastshare: {what} failed: {exc.code().name}: {exc.details()}", err=True)
                released = exc.code() == grpc.StatusCode.NOT_FOUND
            if released and child is not None and child.poll() is None:
                # The command must not keep using capacity that may already belong to another
                # workload.
                ended = _how_it_ended(client, allocation.id)
                click.echo(f"fastshare: {ended}; stopping the command", err=True)
                child.terminate()
                return

    env = {**os.environ, **dict(allocation.env)}
    child = None
    received: list[int] = []

    def forward(signum, _frame) -> None:
        received.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    renewer = threading.Thread(target=watch, name="lease", daemon=True)
    try:
        try:
            child = subprocess.Popen(_argv(command), env=env)
        except OSError as exc:
            click.echo(f"fastshare: cannot run {command[0]!r}: {exc.strerror}", err=True)
            return 127 if isinstance(exc, FileNotFoundError) else 126
        for signum in received:          # a signal that came before the child existed
            child.send_signal(signum)
        renewer.start()
        status = _wait_waking(child)
    finally:
        stop.set()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _release(client, allocation.id, quiet)
    return status if status >= 0 else 128 - status


def _wait_waking(child: subprocess.Popen) -> int:
    """The child's exit status. The kernel may deliver a signal sent to this process to any of its
    threads (gRPC's, the lease's); the Python handler that forwards it runs on the main thread
    only once that thread runs again, which a wait() without timeout never did."""
    while True:
        try:
            return child.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            continue


def _how_it_ended(client, allocation_id: str) -> str:
    """"the allocation was released", or why it failed (e.g. its device went away under it)."""
    from fastshare.v1 import controller_pb2 as pb

    with contextlib.suppress(grpc.RpcError):
        ended = client.call("Get", pb.GetAllocationRequest(allocation_id=allocation_id), timeout=10)
        # 'releasing' with this reason until its agent answers, then 'failed' (the controller's DEVICE_GONE)
        if ended.state == pb.ALLOCATION_STATE_FAILED or ended.reason.startswith("device gone: "):
            return f"the allocation failed: {ended.reason or 'no reason recorded'}"
    return "the allocation was released"


# On Linux CMD is started under this small supervisor. It is the subreaper of CMD's processes
# (PR_SET_CHILD_SUBREAPER: what CMD starts and leaves, a worker a shell script put in the
# background or a daemon, comes to it rather than to init) and gets SIGTERM when fastshare run
# dies, also by SIGKILL (PR_SET_PDEATHSIG). When CMD exits, or fastshare run dies, it ends every
# process left under it (SIGTERM, SIGKILL after KILL_GRACE_S), then exits with CMD's status: no
# process runs on after the release, or on capacity the lease's expiry hands to the next
# workload. CMD stays in fastshare run's process group (the terminal's, for Ctrl-C and reads);
# of the signals the supervisor gets from there, it passes on to CMD only those fastshare run
# forwards, which CMD would otherwise get twice. (A preexec_fn doing this in fastshare run would
# make subprocess fork() beside gRPC's threads, which can break the child before its exec.)
_SUPERVISOR = """
import ctypes, os, signal, sys, time
parent, grace = int(sys.argv[1]), float(sys.argv[2])
waited = {signal.SIGCHLD, *(signal.Signals(int(s)) for s in sys.argv[3].split(","))}
libc = ctypes.CDLL(None)
signal.pthread_sigmask(signal.SIG_BLOCK, waited)   # taken by sigwaitinfo below, none by a handler
libc.prctl(36, 1, 0, 0, 0)                         # PR_SET_CHILD_SUBREAPER
libc.prctl(1, signal.SIGTERM, 0, 0, 0)             # PR_SET_PDEATHSIG: SIGTERM when fastshare run dies

def reap(cmd):
    status = None
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == cmd:
            status = os.waitstatus_to_exitcode(wait_status)

def left():
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:   # ended
            continue
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        if state != "Z":   # ended, waiting for its parent to reap it
            children.setdefault(int(ppid), []).append(int(entry))
    found, todo = [], [os.getpid()]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found

def end_all(cmd):
    deadline, termed = time.monotonic() + grace, set()
    while True:
        reap(cmd)
        pids = left()
        if not pids:
            return
        late = time.monotonic() > deadline
        for pid in pids:
            if late or pid not in termed:
                termed.add(pid)
                for sig in (signal.SIGKILL,) if late else (signal.SIGTERM, signal.SIGCONT):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
        time.sleep(0.05)

if os.getppid() != parent:                         # it died before the prctl
    sys.exit(128 + signal.SIGTERM)
cmd = os.fork()
if cmd == 0:
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)         # and CMD, should the supervisor itself be killed
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):   # Python ignores them; CMD must not inherit that
        signal.signal(sig, signal.SIG_DFL)
    try:
        os.execvp(sys.argv[4], sys.argv[4:])
    except OSError as exc:
        print(f"fastshare: cannot run {sys.argv[4]!r}: {exc.strerror}", file=sys.stderr)
        os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
status = None
while status is None:
    info = signal.sigwaitinfo(waited)
    if info.si_signo == signal.SIGCHLD:
        status = reap(cmd)
    elif os.getppid() != parent:                   # fastshare run died
        break
    elif info.si_pid == parent:                    # forwarded by fastshare run
        try:
            os.kill(cmd, info.si_signo)
        except ProcessLookupError:
            pass
end_all(cmd)
sys.exit(128 + signal.SIGTERM if status is None else status if status >= 0 else 128 - status)
"""


def _argv(command: tuple[str, ...] | list[str]) -> list[str]:
    """CMD, on Linux under a small supervisor that ends CMD and every process CMD left behind
    when CMD exits or this process dies, also by SIGKILL: none may run on, unsupervised, on
    capacity that the release or the lease's expiry hands to the next workload."""
    if not sys.platform.startswith("linux"):
        return list(command)
    forwarded = ",".join(str(int(sig)) for sig in FORWARDED)
    return [sys.executable, "-I", "-S", "-c", _SUPERVISOR, str(os.getpid()), str(KILL_GRACE_S), forwarded,
            *command]


def _release(client, allocation_id: str, quiet: bool) -> None:
    from fastshare.v1 import controller_pb2 as pb

    try:
        request = pb.ReleaseAllocationRequest(allocation_id=allocation_id)
        done = _retry(client, "Release", request)
        if not quiet:
            state = pb.AllocationState.Name(done.state).split("_")[-1].lower()
            click.echo(f"fastshare: released {allocation_id} ({state})", err=True)
    except grpc.RpcError as exc:
        click.echo(f"fastshare: release of {allocation_id} failed ({exc.code().name}: {exc.details()}); "
                   "its lease will expire", err=True)


COMMANDS = [run]
