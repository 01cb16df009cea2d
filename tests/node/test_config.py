"""node.yaml + overrides: defaults, merging, and errors that name the setting."""

import pytest

from fastshare.node import config
from fastshare.node.config import ConfigError

TLS = {"cert": "/c.crt", "key": "/c.key", "ca": "/ca.crt"}


def test_file_then_overrides_and_tls_paths_merge(tmp_path):
    path = tmp_path / "node.yaml"
    path.write_text("listen: 0.0.0.0:7443\nunix_socket_mode: '0600'\ntls: {cert: /c.crt, key: /c.key, "
                    "ca: /ca.crt}\nallowed_clients: [controller]\n")
    cfg = config.load(path, {"tls": {"cert": "/new.crt"}, "node_name": "gpu-7", "mps_timeout_s": "5"})
    assert cfg.listen == "0.0.0.0:7443" and cfg.node_name == "gpu-7" and cfg.mps_timeout_s == 5.0
    assert cfg.tls.cert == "/new.crt" and cfg.tls.ca == "/ca.crt"  # a flag replaces one path only
    assert cfg.unix_socket_mode == 0o600 and cfg.allowed_clients == ("controller",)
    assert str(cfg.journal_path).endswith("journal.db")


def test_defaults_are_local_only_and_secure():
    cfg = config.load(None, {})
    assert cfg.listen == "" and cfg.readonly_listen == "" and cfg.unix_socket
    assert cfg.metrics_listen.startswith("127.0.0.1:")


@pytest.mark.parametrize(("settings", "message"), [
    ({"lisen": "x"}, "unknown setting"),
    ({"listen": "127.0.0.1:7443"}, "tls.cert"),
    ({"listen": "nonsense", "tls": TLS}, "listen must be HOST:PORT"),
    ({"listen": "", "unix_socket": ""}, "unreachable"),
    ({"share_ports": "100-200"}, "share_ports"),
    ({"share_ports": "abc"}, "share_ports"),
    ({"mps_memory_oversubscription": 0.5}, "mps_memory_oversubscription"),
    ({"device_backend": "cuda"}, "device_backend"),
    ({"device_backend": "sim"}, "sim_state"),
    ({"rpc_timeout_s": 0}, "rpc_timeout_s"),
    ({"max_workers": "many"}, "max_workers"),
    ({"tls": "yes"}, "tls must be a mapping"),
])
def test_bad_settings_name_the_key(settings, message):
    with pytest.raises(ConfigError, match=message):
        config.load(None, settings)


def test_an_explicit_missing_file_or_bad_yaml_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("listen: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load(tmp_path / "bad.yaml")


@pytest.mark.parametrize(("value", "as_read"), [
    ("127.0.0.1:7070", "127.0.0.1:7070"), ("ctl-1.example.com:7070", "ctl-1.example.com:7070"),
    ("localhost:0", "localhost:0"), ("[::1]:7443", "[::1]:7443"), ("0.0.0.0:7443", "0.0.0.0:7443"),
    ("[2001:db8::10]:7070", "[2001:db8::10]:7070"), ("[::]:7443", "[::]:7443"),
    # an IPv6 address without brackets (a Pod IP from the downward API): the port is required,
    # so the last ':' ends the host; gRPC would read it all as one address and use port 443
    ("2001:db8::10:7070", "[2001:db8::10]:7070"), ("::1:7443", "[::1]:7443"),
    ("fd00::5:07444", "[fd00::5]:7444"),
])
def test_host_and_port_forms_that_are_accepted_as_grpc_reads_them(value, as_read):
    assert config.check_hostport("controller_address", value) == as_read


def test_the_agents_addresses_are_kept_as_grpc_reads_them():
    cfg = config.load(None, {"listen": "fd00::5:7444", "controller_address": "2001:db8::10:7070", "tls": TLS})
    assert (cfg.listen, cfg.controller_address) == ("[fd00::5]:7444", "[2001:db8::10]:7070")


@pytest.mark.parametrize(("value", "says"), [
    ("[ctl]:7070", "not an IPv6 address"),
    ("[::1:7070", "not an IPv6 address"),
    ("1:2:7070", "not an IPv6 address"),
    ("ctl 1:7070", "neither an IP address nor a host name"),
    ("ctl\n:7070", "neither an IP address nor a host name"),
    ("-ctl:7070", "neither an IP address nor a host name"),
    ("ctl..example:7070", "neither an IP address nor a host name"),
    ("ctl:70700", "must be HOST:PORT"),
])
def test_host_and_port_forms_that_are_refused_name_the_key(value, says):
    with pytest.raises(ConfigError, match=f"controller_address.*{says}"):
        config.check_hostport("controller_address", value)


def test_a_unix_socket_group_that_does_not_exist_is_named_at_load():
    """A typo in unix_socket_group was found after the agent had reconciled the GPUs and opened
    the socket: a KeyError traceback, and the socket left behind with the umask's mode."""
    import grp

    with pytest.raises(ConfigError, match="unix_socket_group: no group 'no-such-group-7' on this host"):
        config.load(None, {"unix_socket_group": "no-such-group-7"})
    existing = grp.getgrgid(0).gr_name
    assert config.load(None, {"unix_socket_group": existing}).unix_socket_group == existing


@pytest.mark.parametrize("mode", ["0666", "0606", "0662", "0661", "0604", "0777", "0601"])
def test_a_unix_socket_others_can_reach_is_refused(mode):
    # the root agent's unix socket is full GPU control: no mode may let every local user in
    with pytest.raises(ConfigError, match=r"unix_socket_mode .*others.*0o660.*unix_socket_group"):
        config.load(None, {"unix_socket_mode": mode})


@pytest.mark.parametrize("mode", ["0600", "0660", "0640", "0620"])
def test_owner_and_group_unix_socket_modes_are_accepted(mode):
    assert config.load(None, {"unix_socket_mode": mode}).unix_socket_mode == int(mode, 8)
