"""Bad numbers, names and types on the command line and in the controller's config file are
refused with the flag's (or key's) name and what it must be, before anything starts: no
traceback (a negative --sm once crashed building the protobuf request, an integer `listen` in
the config file crashed the controller), no run of nothing reported as a result, and no state
directory left behind."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from fastshare.cli import main

OFFLINE = {"FASTSHARE_CONTROLLER": "127.0.0.1:9"}


@pytest.mark.parametrize("flag, value", [("--sm", "-1"), ("--sm", "101"), ("--sm", str(2**40)),
                                         ("--gpus", "-1"), ("--gpus", "0"), ("--gpus", "17"),
                                         ("--sm-count", "-3"), ("--lease-ttl", "-1"),
                                         ("--lease-ttl", str(2**32))])
def test_run_refuses_numbers_a_request_cannot_carry(flag, value):
    # `--gpus 0` was taken for "not given" and a whole request got one GPU
    result = CliRunner().invoke(main, ["run", flag, value, "--", "true"], env=OFFLINE)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert flag in result.output and "not in the range" in result.output


@pytest.mark.parametrize("size", ["99999999999999999999999TiB", "1025TiB"])
def test_run_refuses_a_memory_size_no_gpu_has(size):
    # a size past uint64 crashed building the request (ValueError: Value out of range)
    result = CliRunner().invoke(main, ["run", "--mem", size, "--", "true"], env=OFFLINE)
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    assert f"--mem: '{size}' is over 1 PiB" in result.output


@pytest.mark.parametrize("flag, value", [("--heartbeat-interval", "nan"), ("--heartbeat-interval", "0"),
                                         ("--heartbeat-timeout", "inf"), ("--reconcile-interval", "-5"),
                                         ("--agent-deadline", "-3"), ("--agent-deadline", "inf"),
                                         ("--mps-oversubscription", "0.5"), ("--mps-oversubscription", "17"),
                                         ("--finished-retention", "60"), ("--finished-retention", "nan")])
def test_controller_refuses_bad_numbers_before_touching_state(tmp_path, flag, value):
    output = _serve_refused(tmp_path, flag, value)
    assert flag in output and "must be a number in" in output


def _serve_refused(tmp_path, flag: str, value: str) -> str:
    """`controller serve FLAG VALUE`: a clear error (exit 1, no traceback) before the state
    directory exists; its output."""
    state = tmp_path / "state"
    result = CliRunner().invoke(main, ["controller", "serve", "--state-dir", str(state), "--tls-dir",
                                       str(tmp_path / "tls"), flag, value])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    assert not state.exists()
    return result.output


@pytest.mark.parametrize("args", [["sim", "--tune", "nan"], ["sim", "--tune", "11"],
                                  ["bench", "mig", "--load", "nan"], ["bench", "mig", "--load", "inf"],
                                  ["k8s", "controller", "--lease-duration", "inf"],
                                  ["k8s", "controller", "--node-interval", "nan"],
                                  ["k8s", "controller", "--heartbeat-timeout", "-inf"]])
def test_fractional_flags_refuse_nan_and_infinity(args):
    # NaN compares false with both ends of a range: `sim --tune nan` used to replay tune 0, and
    # `bench mig --load nan` to offer nothing, both printing figures as if all were well
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert args[-2] in result.output and "range" in result.output


@pytest.mark.parametrize("seeds, why", [("abc", "expected seeds like"), ("5-1", "is empty"),
                                        ("1-2000", "at most 1000 seeds"), ("-3", "expected seeds like"),
                                        ("42-", "expected seeds like"), ("1,3-", "expected seeds like")])
def test_bench_seeds_are_refused_before_any_run(seeds, why):
    # "5-1" used to run no seed at all and print a table of zeros as the result; "42-" (42-51
    # cut short) ran seed 42 alone and reported its figures as the mean
    result = CliRunner().invoke(main, ["bench", "mig", "--seeds", seeds])
    assert result.exit_code == 2, result.output
    assert "--seeds" in result.output and why in result.output


def test_bench_placement_names_an_unknown_trace_before_running_the_others(tmp_path):
    (tmp_path / "openb_node_list_gpu_node.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\n"
                                                           "n0,1000,1000,1,T4\n")
    (tmp_path / "openb_pod_list_tiny.csv").write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
                                                      "p0,1,1,1,500\n")
    result = CliRunner().invoke(main, ["bench", "placement", "--data", str(tmp_path),
                                       "--traces", "tiny,nosuch", "--no-speed"])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    assert "--traces: no openb_pod_list_nosuch.csv" in result.output and "choose from tiny" in result.output
    assert "tiny" not in result.output.split("Error")[0]   # nothing ran before the refusal


@pytest.mark.parametrize("line, says", [
    ("listen: 123", "listen must be a string, got 123"), ("state_dir: [1]", "state_dir must be a string"),
    ("token_file: 5", "token_file must be a string"), ("log_level: 5", "log_level must be a string"),
    ("client_auth: bogus", "client_auth must be one of cert, token, any, got 'bogus'"),
    ("log_level: bogus", "log_level must be one of debug, info, warning, error"),
    ("tls_name: ../../etc/x", "tls_name in --config) '../../etc/x' is invalid"),
    ("1: 2", "unknown setting(s) 1"),
    ("heartbeat_interval: abc", "heartbeat_interval in --config) must be a number in 1..3600, got 'abc'"),
    ("agent_deadline: [1]", "agent_deadline in --config) must be a number in 1..3600, got [1]"),
    ("reconcile_interval: true", "reconcile_interval in --config) must be a number in 1..86400, got True"),
    ("heartbeat_timeout: .nan", "heartbeat_timeout in --config) must be a number in 2..86400, got nan")])
def test_controller_config_file_values_name_the_key(tmp_path, line, says):
    config = tmp_path / "controller.yaml"
    state = tmp_path / "state"
    state_line = "" if line.startswith("state_dir") else f"state_dir: {state}\n"
    config.write_text(f"{state_line}tls_dir: {tmp_path / 'tls'}\n{line}\n")
    result = CliRunner().invoke(main, ["controller", "serve", "--config", str(config)])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    assert says in result.output
    assert not state.exists()


@pytest.mark.parametrize("flag, value, ok", [
    ("--namespace", "Bad_NS", False), ("--namespace", "-x", False), ("--namespace", "a" * 64, False),
    ("--lease-namespace", "x.y", False), ("--lease-name", "a b", False), ("--lease-name", "a..b", False),
    ("--gpu-node-label", "a b", False), ("--gpu-node-label", "Fast.IO/gpu", False),
    ("--gpu-node-label", "x/" + "a" * 64, False), ("--gpu-node-label", "/gpu", False),
    ("--namespace", "team-a", True), ("--lease-name", "fastshare.ctl-2", True),
    ("--gpu-node-label", "gpu", True), ("--gpu-node-label", "example.com/has_GPU.2", True),
    # a Service name is a DNS-1035 label: a leading digit passed, and the API server refused it
    ("--service-name", "1ctl", False), ("--service-name", "ctl-1", True)])
def test_k8s_controller_names_follow_kubernetes_rules(flag, value, ok):
    # a typo here used to get as far as the API server, which refuses such a Lease name or label
    # selector, or serves an empty list for such a namespace: a controller that does nothing
    result = CliRunner().invoke(main, ["k8s", "controller", flag, value])
    assert result.exit_code == 2, result.output
    if ok:   # passed on to the next check
        assert "Missing option '--tls-dir'" in result.output
    else:
        assert f"Invalid value for '{flag}'" in result.output and "must be" in result.output


@pytest.mark.parametrize("setting", ["listen", "readonly_listen", "metrics_listen"])
def test_node_agent_names_the_setting_whose_port_is_taken(tmp_path, setting):
    # a second agent on one host (the README's node.yaml sets no metrics_listen, so both take
    # 127.0.0.1:9402) stopped with only "[Errno 98] Address already in use"
    import socket

    import yaml

    from fastshare.device import simnvml
    from fastshare.security import certs

    certs.init_ca(tmp_path / "ca")
    certs.issue(tmp_path / "ca", "node-1", tmp_path / "pki", sans=["127.0.0.1"], role="node", days=1)
    simnvml.create_machine(tmp_path / "m.json", ["L4"])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        settings = {"listen": "127.0.0.1:0", "readonly_listen": "", "metrics_listen": "", setting: address}
        (tmp_path / "node.yaml").write_text(yaml.safe_dump({
            "node_name": "node-1", **settings, "unix_socket": "", "state_dir": str(tmp_path / "state"),
            "run_dir": str(tmp_path / "run"), "device_backend": "sim", "sim_state": str(tmp_path / "m.json"),
            "tls": {"cert": str(tmp_path / "pki/node-1.crt"), "key": str(tmp_path / "pki/node-1.key"),
                    "ca": str(tmp_path / "pki/ca.crt")}}))
        result = CliRunner().invoke(main, ["node", "serve", "--config", str(tmp_path / "node.yaml")])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    assert f"{setting} {address}: cannot listen there" in result.output
    # and what to do: another address (the flag too), or none (metrics_listen defaults to :9402,
    # which a second agent on one host, as in the README's example, finds taken)
    flag = "--" + setting.replace("_", "-")
    assert f"set {setting} (or {flag}) to a free HOST:PORT, or '' for none" in result.output, result.output


@pytest.mark.parametrize("args, field, flag", [
    (["--mem", "1GiB"], "spec.sm_percent", "--sm"), (["--sm", "30"], "spec.memory_bytes", "--mem"),
    (["--sm", "30", "--mem", "1GiB", "--quota", "0.9:0.3"], "spec.quota_limit", "--quota"),
    (["--kind", "whole", "--sm", "30"], "spec.sm_percent", "--sm")])
def test_run_names_the_flag_of_the_field_the_controller_refuses(monkeypatch, args, field, flag):
    # `fastshare run --mem 1GiB -- cmd` said only "spec.sm_percent: must be in 1..100, got 0"
    import grpc

    from fastshare.controller import convert, validation
    from fastshare.controller.validation import Request

    class Refused(grpc.RpcError):
        def __init__(self, details):
            self._details = details

        def code(self):
            return grpc.StatusCode.INVALID_ARGUMENT

        def details(self):
            return self._details

    class Client:   # answers as the controller does: its own validation's message
        def __init__(self, config):
            pass

        def call(self, method, request, **kwargs):
            req = Request(spec=convert.spec_from_pb(request.spec), owner=request.owner,
                          idempotency_key=request.idempotency_key, lease_ttl=request.lease_ttl_seconds)
            try:
                validation.validate(req, [])
            except validation.ValidationError as exc:
                raise Refused(str(exc)) from None
            raise AssertionError("accepted")

    monkeypatch.setattr("fastshare.controller.client.Client", Client)
    result = CliRunner().invoke(main, ["run", *args, "--", "true"], env=OFFLINE)
    assert result.exit_code == 1, result.output
    assert f"invalid request: {field} ({flag}): " in result.output


@pytest.mark.parametrize("flag, value", [("--listen", "127.0.0.1:99999"), ("--listen", "127.0.0.1"),
                                         ("--listen", "[::1:7070"), ("--token-listen", "127.0.0.1:70000"),
                                         ("--token-listen", "host name:1")])
def test_controller_refuses_a_listen_address_that_is_no_host_port(tmp_path, flag, value):
    # gRPC bound --listen 127.0.0.1:99999 to some other, random port, and the controller said
    # it listened on 127.0.0.1:99999; agents and clients configured with it never reached it
    output = _serve_refused(tmp_path, flag, value)
    assert f"{flag} (or {flag[2:].replace('-', '_')} in --config)" in output
    assert any(why in output for why in ("HOST:PORT", "not an IPv6 address", "neither an IP address"))


@pytest.mark.parametrize("args, says", [
    (["controller", "serve", "--config", "{f}"], "--config {f}"),
    (["node", "serve", "--config", "{f}"], "invalid node agent configuration: {f}"),
    (["k8s", "manifests", "--values", "{f}"], "{f}"),
    (["mig", "config", "--select", "x", "--file", "{f}"], "{f}"),
])
def test_a_settings_file_that_is_not_text_is_refused_naming_it(tmp_path, args, says):
    # a binary file (a key, a tarball) given by mistake crashed with a UnicodeDecodeError traceback
    from fastshare.device import simnvml

    machine = tmp_path / "m.json"
    simnvml.create_machine(machine, ["A100-SXM4-40GB"])
    f = tmp_path / "settings.yaml"
    f.write_bytes(b"\xff\xfe\x00binary")
    result = CliRunner().invoke(main, [a.format(f=f) for a in args],
                                env={"FASTSHARE_GPU_BACKEND": "sim", "FASTSHARE_SIM_STATE": str(machine)})
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert says.format(f=f) in result.output and "utf-8" in result.output


def test_bench_placement_with_nothing_to_measure_is_refused():
    # --no-speed --no-quality printed nothing and exited 0 ({} with --json), as if it had measured
    result = CliRunner().invoke(main, ["bench", "placement", "--no-speed", "--no-quality", "--json"])
    assert result.exit_code == 2, result.output
    assert "--no-speed" in result.output and "--no-quality" in result.output
    assert result.stdout == ""


def _openb_without_data(tmp_path):
    data = tmp_path / "openb"
    data.mkdir()
    (data / "openb_node_list_gpu_node.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\n")
    (data / "openb_pod_list_default.csv").write_text("name\n")
    return data


@pytest.mark.parametrize("flag, value", [("--policies", "fgd,,bestfit"), ("--policies", "fgd, "),
                                         ("--traces", "default,")])
def test_bench_placement_lists_take_a_trailing_or_doubled_comma(tmp_path, flag, value):
    # an empty entry was looked up: "--policies: unknown , " and "no openb_pod_list_.csv"
    result = CliRunner().invoke(main, ["bench", "placement", "--data", str(_openb_without_data(tmp_path)),
                                       "--no-speed", "--traces", "default", flag, value, "--seeds", "1"])
    assert "unknown" not in result.output and "openb_pod_list_.csv" not in result.output
    assert "no data rows" in result.output   # it got as far as reading the files


@pytest.mark.parametrize("part", ["--no-speed", "--no-quality"])
def test_bench_placement_refuses_trace_files_it_cannot_read_naming_them(tmp_path, part):
    # the TraceError escaped as a traceback
    data = _openb_without_data(tmp_path)
    result = CliRunner().invoke(main, ["bench", "placement", "--data", str(data), part, "--seeds", "1"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"{data / 'openb_node_list_gpu_node.csv'}: no data rows" in result.output


def test_controller_refuses_a_token_file_that_is_not_text(tmp_path):
    # UnicodeDecodeError traceback
    tokens = tmp_path / "tokens"
    tokens.write_bytes(b"\xff\xfe\x00")
    tokens.chmod(0o600)
    state = tmp_path / "state"
    result = CliRunner().invoke(main, ["controller", "serve", "--state-dir", str(state), "--tls-dir",
                                       str(tmp_path / "tls"), "--token-file", str(tokens)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"--token-file: {tokens}" in result.output and "not a text file" in result.output
    assert not state.exists()


@pytest.mark.parametrize("code, hinted", [("INVALID_ARGUMENT", False), ("NOT_FOUND", False),
                                          ("UNAVAILABLE", True)])
def test_node_cli_asks_whether_the_agent_runs_only_when_it_is_unreachable(monkeypatch, code, hinted):
    # `fastshare node release ''` (refused by a running agent: share_id is required) asked
    # "is `fastshare node serve` running?", sending the user after the wrong problem
    import types

    import grpc

    from fastshare.cli import node as node_cli

    class Refused(grpc.RpcError):
        def code(self):
            return getattr(grpc.StatusCode, code)

        def details(self):
            return "what the agent said"

    def refuse(*_args, **_kwargs):
        raise Refused()

    monkeypatch.setattr(node_cli, "_stub", lambda _socket: types.SimpleNamespace(ReleaseShare=refuse))
    result = CliRunner().invoke(main, ["node", "release", "--unix-socket", "/nonexistent.sock", "x"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"{code}: what the agent said" in result.output
    assert ("fastshare node serve" in result.output) == hinted


def test_run_says_which_controller_it_cannot_reach_and_that_it_retries(monkeypatch, tmp_path):
    # it retried for ~16 s in silence, then said only "UNAVAILABLE: failed to connect to all
    # addresses", without naming the controller (status and cordon do)
    from fastshare.cli import run as run_cli
    from fastshare.security import certs

    certs.init_ca(tmp_path / "ca")
    certs.issue(tmp_path / "ca", "client", tmp_path / "pki", role="client")
    monkeypatch.setattr(run_cli.time, "sleep", lambda _s: None)
    result = CliRunner().invoke(main, ["run", "--sm", "10", "--mem", "1GiB", "--tls-dir",
                                       str(tmp_path / "pki"), "--", "true"], env=OFFLINE)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "Error: controller at 127.0.0.1:9: UNAVAILABLE" in result.output
    assert result.output.count("controller at 127.0.0.1:9 UNAVAILABLE, retrying") == 4


@pytest.mark.parametrize("extra", [["--token-listen", "127.0.0.1:7071"], ["--token-file", "{tokens}"],
                                   ["--token-listen", "127.0.0.1:7071", "--token-file", "{tokens}"]])
def test_controller_refuses_token_settings_that_client_auth_cert_would_ignore(tmp_path, extra):
    # --token-listen with the default --client-auth cert started, and every token client on that
    # port got "this controller requires a client certificate" (the port cannot ask for one)
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret\n")
    tokens.chmod(0o600)
    state = tmp_path / "state"
    result = CliRunner().invoke(main, ["controller", "serve", "--state-dir", str(state), "--tls-dir",
                                       str(tmp_path / "tls"), *(a.format(tokens=tokens) for a in extra)])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    assert not state.exists()
    assert "--client-auth" in result.output and "token or any" in result.output, result.output
    assert "s3cret" not in result.output


def _tls_dir(tmp_path):
    """Certificates of node-1, the controller and another node, in one directory."""
    from fastshare.security import certs

    certs.init_ca(tmp_path / "ca")
    certs.issue(tmp_path / "ca", "node-1", tmp_path / "pki", sans=["127.0.0.1"], role="node", days=1)
    certs.issue(tmp_path / "ca", "controller", tmp_path / "pki", role="controller", days=1)
    certs.issue(tmp_path / "ca", "other", tmp_path / "pki", role="node", days=1)
    return tmp_path / "pki"


TLS_DAMAGE = [("key of another", "tls.key: {pki}/{name}.key is not the key of {pki}/{name}.crt"),
              ("garbage cert", "tls.cert: {pki}/{name}.crt is not a PEM certificate"),
              ("garbage key", "tls.key: {pki}/{name}.key is not a PEM private key"),
              ("no cert", "tls.cert: {pki}/{name}.crt does not exist")]


@pytest.mark.parametrize("damage, says", TLS_DAMAGE, ids=[d for d, _ in TLS_DAMAGE])
def test_node_agent_names_a_damaged_or_mismatched_tls_file(tmp_path, damage, says):
    # each was "listen 127.0.0.1:0: cannot listen there (in use, or not of this host)"
    import shutil

    import yaml

    from fastshare.device import simnvml

    pki = _tls_dir(tmp_path)
    {"key of another": lambda: shutil.copy(pki / "other.key", pki / "node-1.key"),
     "garbage cert": lambda: (pki / "node-1.crt").write_text("garbage"),
     "garbage key": lambda: (pki / "node-1.key").write_text("garbage"),
     "no cert": lambda: (pki / "node-1.crt").unlink()}[damage]()
    simnvml.create_machine(tmp_path / "m.json", ["L4"])
    (tmp_path / "node.yaml").write_text(yaml.safe_dump({
        "node_name": "node-1", "listen": "127.0.0.1:0", "metrics_listen": "", "unix_socket": "",
        "state_dir": str(tmp_path / "state"), "run_dir": str(tmp_path / "run"), "device_backend": "sim",
        "sim_state": str(tmp_path / "m.json"),
        "tls": {"cert": str(pki / "node-1.crt"), "key": str(pki / "node-1.key"), "ca": str(pki / "ca.crt")}}))
    result = CliRunner().invoke(main, ["node", "serve", "--config", str(tmp_path / "node.yaml")])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert says.format(pki=pki, name="node-1") in result.output, result.output
    assert "cannot listen there" not in result.output, result.output
    assert not (tmp_path / "state").exists()   # refused before the journal is opened


@pytest.mark.parametrize("damage, says", TLS_DAMAGE[:3], ids=[d for d, _ in TLS_DAMAGE[:3]])
def test_controller_names_a_damaged_or_mismatched_tls_file(tmp_path, damage, says):
    # each was "cannot start the controller: Failed to bind to address 127.0.0.1:0"
    import shutil

    pki = _tls_dir(tmp_path)
    {"key of another": lambda: shutil.copy(pki / "other.key", pki / "controller.key"),
     "garbage cert": lambda: (pki / "controller.crt").write_text("garbage"),
     "garbage key": lambda: (pki / "controller.key").write_text("garbage")}[damage]()
    state = tmp_path / "state"
    result = CliRunner().invoke(main, ["controller", "serve", "--state-dir", str(state),
                                       "--tls-dir", str(pki), "--listen", "127.0.0.1:0"])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert says.format(pki=pki, name="controller") in result.output, result.output
    assert "Failed to bind" not in result.output
    assert not state.exists()


def test_bench_placement_refuses_a_malformed_published_curves_file_before_any_run(tmp_path, monkeypatch):
    # the curves were read after each trace's replays: a bad value ended the benchmark (hours
    # on the openb traces) with a traceback after printing its runs
    from fastshare.sim import benchmarks

    (tmp_path / "openb_node_list_gpu_node.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\n"
                                                           "n0,1000,1000,1,T4\n")
    (tmp_path / "openb_pod_list_tiny.csv").write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
                                                      "p0,1,1,1,500\n")
    curves = tmp_path / "published_alloc_curves.csv"
    curves.write_text("workload,sc_policy,tune,seed,total_gpus," + ",".join(map(str, range(131))) + "\n"
                      "openb_pod_list_tiny,06-FGD,1.3,42,1," + ",".join(["1.0"] * 130 + ["x"]) + "\n")
    monkeypatch.setattr(benchmarks.Experiment, "run",
                        lambda *a, **k: pytest.fail("replayed before the check"))
    result = CliRunner().invoke(main, ["bench", "placement", "--data", str(tmp_path), "--no-speed",
                                       "--seeds", "1"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"{curves} line 2: 130 must be a number (got 'x')" in result.output
    assert result.stdout == ""


@pytest.mark.parametrize("args", [["--traces", "a,b", "--no-speed"], ["--traces", "a"]])
def test_bench_placement_reads_every_trace_before_the_first_run(tmp_path, monkeypatch, args):
    # trace b (or the default trace of the speed part) was read only after the replays of the
    # traces before it: a malformed one ended the benchmark after its runs, not before them
    from fastshare.sim import benchmarks

    (tmp_path / "openb_node_list_gpu_node.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\n"
                                                           "n0,1000,1000,1,T4\n")
    header = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
    (tmp_path / "openb_pod_list_a.csv").write_text(header + "p0,1,1,1,500\n")
    for bad in ("b", "default"):
        (tmp_path / f"openb_pod_list_{bad}.csv").write_text(header + "p0,1,1,1,5000\n")
    monkeypatch.setattr(benchmarks.Experiment, "run",
                        lambda *a, **k: pytest.fail("replayed before the check"))
    result = CliRunner().invoke(main, ["bench", "placement", "--data", str(tmp_path), *args, "--seeds", "1"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "line 2: gpu_milli must be 0..1000 (got 5000)" in result.output


@contextlib.contextmanager
def _fake_agent(tmp_path, servicer) -> Iterator[str]:
    """``servicer`` served as a node agent on a unix socket (its path), e.g. an older agent's answers."""
    from concurrent import futures

    import grpc

    from fastshare.v1 import agent_pb2_grpc

    sock = tmp_path / "node.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    agent_pb2_grpc.add_NodeAgentServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    try:
        yield str(sock)
    finally:
        server.stop(None)


def test_mig_enable_force_through_an_agent_that_ignores_it_is_refused_with_a_hint(tmp_path):
    """`mig enable --force` now goes to the node agent as SetMigMode's force. An agent older than that
    field ignores it and refuses as before while a share holds the GPU (MIG is never enabled under a
    share unasked): the CLI says so, instead of leaving the user wondering why --force did not work."""

    import grpc

    from fastshare.v1 import agent_pb2, agent_pb2_grpc

    asked = []

    class OlderAgent(agent_pb2_grpc.NodeAgentServicer):
        def GetInventory(self, request, context):
            return agent_pb2.Inventory(gpus=[agent_pb2.Gpu(index=0, uuid="GPU-0", mig_capable=True)])

        def SetMigMode(self, request, context):   # as an agent without the force field answered
            asked.append(request)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "GPU GPU-0 has shares (w); release them before changing its MIG mode")

    with _fake_agent(tmp_path, OlderAgent()) as sock:
        result = CliRunner().invoke(main, ["mig", "enable", "--gpu", "0", "--force", "--unix-socket", sock])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert [(r.gpu_uuid, r.enabled, r.force) for r in asked] == [("GPU-0", True, True)]
    assert "GPU 0: GPU GPU-0 has shares (w); release them" in result.output, result.output
    assert "older than this CLI and ignores --force" in result.output, result.output


def test_mig_config_force_through_an_agent_that_ignores_it_is_refused_with_a_hint(tmp_path):
    """`mig config --apply --force` (and mig_config with force, e.g. the role re-run right after an
    upgrade, its agent not restarted yet) sends SetMigMode with force; an agent older than that field
    refuses as before: the error says the agent ignores force, not only 'release them'."""

    import grpc

    from fastshare.device import simnvml
    from fastshare.v1 import agent_pb2, agent_pb2_grpc

    machine = tmp_path / "m.json"
    simnvml.create_machine(machine, ["H100-SXM5-80GB"], mig_enabled=False)
    uuid = simnvml.load_machine(machine)["gpus"][0]["uuid"]

    class OlderAgent(agent_pb2_grpc.NodeAgentServicer):
        def GetInventory(self, request, context):   # no pci_device_id: the GPUs are read from NVML
            return agent_pb2.Inventory(gpus=[agent_pb2.Gpu(index=0, uuid=uuid, name="NVIDIA H100 80GB HBM3",
                                                           mig_capable=True)],
                                       shares=[agent_pb2.Share(id="w", device_uuids=[uuid])])

        def SetMigMode(self, request, context):   # as an agent without the force field answered
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"GPU {uuid} has shares (w); release them before changing its MIG mode")

    config = tmp_path / "mig.yaml"
    config.write_text('{"version": "v1", "mig-configs": {"c": [{"devices": [0], "mig-enabled": true}]}}')
    with _fake_agent(tmp_path, OlderAgent()) as sock:
        result = CliRunner().invoke(main, ["mig", "config", "--file", str(config), "--select", "c", "--apply",
                                           "--force", "--gpu-backend", "sim", "--sim-state", str(machine),
                                           "--unix-socket", sock])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "GPU 0: GPU " in result.output and "release them" in result.output, result.output
    assert "older than this fastshare and ignores force" in result.output, result.output


@pytest.mark.parametrize("args", [["node", "serve", "--log-level", "warning", "--config", "{tmp}/none.yaml"],
                                  ["controller", "serve", "--log-level", "WARNING", "--state-dir",
                                   "{tmp}/state", "--tls-dir", "{tmp}/tls", "--heartbeat-interval", "0"],
                                  ["k8s", "controller", "--log-level", "Warning", "--tls-dir", "{tmp}"]])
def test_log_level_is_taken_in_either_case(tmp_path, args):
    # `node serve` took only DEBUG..ERROR and the two controllers only debug..error, so each
    # refused the other's spelling (the demo passes WARNING to one and warning to the other);
    # each command here gets past --log-level and stops at its next, deliberate, refusal
    result = CliRunner().invoke(main, [a.format(tmp=tmp_path) for a in args])
    assert result.exit_code == 1, result.output
    assert "--log-level" not in result.output
    assert not (tmp_path / "state").exists()


def test_node_agent_names_the_gpu_backend_flag_it_refuses(tmp_path):
    # the refusal named the YAML key (`device_backend must be one of nvml, sim`), not the
    # flag or the environment variable the value came from
    config = tmp_path / "node.yaml"
    config.write_text("{}\n")
    for args, env in (([], {"FASTSHARE_GPU_BACKEND": "simm"}), (["--gpu-backend", "simm"], {})):
        result = CliRunner().invoke(main, ["node", "serve", "--config", str(config), *args], env=env)
        assert result.exit_code == 2, result.output
        assert "'--gpu-backend' (env var: 'FASTSHARE_GPU_BACKEND')" in result.output
        assert "'simm' is not one of 'nvml', 'sim'" in result.output


@pytest.mark.parametrize("file, args, env, says", [
    ("", ["--listen", "1.2.3.4"], {}, "--listen (or FASTSHARE_NODE_LISTEN) must be HOST:PORT"),
    ("listen: 127.0.0.1:7444\n", [], {"FASTSHARE_NODE_LISTEN": "1.2.3.4"},
     "--listen (or FASTSHARE_NODE_LISTEN) must be HOST:PORT"),
    ("", ["--controller-address", "ctl 1:7070"], {},
     "--controller-address (or FASTSHARE_CONTROLLER_ADDRESS): 'ctl 1' is neither an IP address"),
    ("", ["--node-name", "n" * 254], {}, "--node-name (or FASTSHARE_NODE_NAME) must be 1-253 characters"),
    ("readonly_listen: 127.0.0.1:7445\n", ["--listen", "127.0.0.1:7445"], {},
     "readonly_listen (in {config}) must differ from --listen (or FASTSHARE_NODE_LISTEN)"),
    ("listen: 1.2.3.4\n", [], {}, "listen (in {config}) must be HOST:PORT"),
    ("metrics_listen: 127.0.0.1\n", ["--listen", "127.0.0.1:7444"], {},
     "metrics_listen (in {config}) must be HOST:PORT"),
])
def test_node_agent_names_the_flag_or_the_file_a_refused_value_came_from(tmp_path, file, args, env, says):
    # `--listen 1.2.3.4` answered "listen must be HOST:PORT": the configuration key, not the flag
    # typed (and a bad value in the file did not name the file)
    config = tmp_path / "node.yaml"
    config.write_text(file or "{}\n")
    tls = [f"--tls-{part}={tmp_path / part}" for part in ("cert", "key", "ca")]
    result = CliRunner().invoke(main, ["node", "serve", "--config", str(config), *tls, *args], env=env)
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    assert f"invalid node agent configuration: {says.format(config=config)}" in result.output


@pytest.mark.parametrize("address", ["127.0.0.1:99999", "ctl.example.com", "127.0.0.1:", "fd00::1:99999"])
@pytest.mark.parametrize("command", [["status"], ["release", "fs-1"],
                                     ["run", "--kind", "mps", "--mem", "1GiB", "--", "true"]])
def test_client_commands_refuse_a_controller_address_that_is_no_host_port(tmp_path, command, address):
    # gRPC dialled port 99999 as 34463 (modulo 65536) and the hint said nothing listened at
    # 99999; an address without a port went to gRPC's default one
    result = CliRunner().invoke(main, [*command[:1], "--controller", address, "--tls-dir", str(tmp_path),
                                       *command[1:]])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    assert (f"--controller (or FASTSHARE_CONTROLLER) must be HOST:PORT (port 0-65535; [::1]:PORT for IPv6), "
            f"got {address!r}") in result.output
