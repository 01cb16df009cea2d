"""`fastshare certs`: create the cluster CA and issue short-lived certificates for mTLS."""

from __future__ import annotations

from pathlib import Path

import click

from fastshare.cli._output import fail, print_json, print_table
from fastshare.security import certs as pki


@click.group("certs")
def certs() -> None:
    """Cluster CA and certificates for mTLS between controller, agents and CLI."""


@certs.command("init")
@click.argument("ca_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--name", default="fastshare-ca", show_default=True, help="CA common name.")
@click.option("--days", type=int, default=pki.DEFAULT_CA_DAYS, show_default=True, help="CA lifetime.")
@click.option("--force", is_flag=True, help="Replace an existing CA (invalidates every issued cert).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def init(ca_dir: Path, name: str, days: int, force: bool, as_json: bool) -> None:
    """Create a CA (ca.crt, ca.key mode 0600) in CA_DIR."""
    try:
        cert = pki.init_ca(ca_dir, name=name, days=days, force=force)
    except pki.CertError as exc:
        fail(str(exc))
    except OSError as exc:   # e.g. a full disk, no permission on CA_DIR
        fail(f"{ca_dir}: {exc.strerror or exc}: {exc.filename or ''}")
    info = pki.describe(cert)
    if as_json:
        print_json(info)
    else:
        click.echo(f"CA created: {cert} (key {ca_dir / pki.CA_KEY}), valid until {info['not_after']}")


@certs.command("issue")
@click.option("--ca", "ca_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="CA directory made by `fastshare certs init`.")
@click.option("--name", required=True, help="Common name (also the first DNS SAN), e.g. the node name.")
@click.option("--san", "sans", multiple=True, help="Extra DNS name or IP address; repeatable.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Writes NAME.crt, NAME.key and ca.crt here.")
@click.option("--role", type=click.Choice(pki.ROLES), default=pki.DEFAULT_ROLE, show_default=True,
              help="node: a node agent (NAME = its node name); controller: the controller; client: a "
                   "user or operator of the controller's API. Servers decide on the role, not on names.")
@click.option("--days", type=int, default=pki.DEFAULT_LEAF_DAYS, show_default=True,
              help="Lifetime; short on purpose, servers reload re-issued files.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def issue(ca_dir: Path, name: str, sans: tuple[str, ...], out_dir: Path, role: str, days: int,
          as_json: bool) -> None:
    """Issue a certificate with a role, signed by the CA (ECDSA P-256)."""
    try:
        issued = pki.issue(ca_dir, name, out_dir, sans=sans, role=role, days=days)
    except pki.CertError as exc:
        fail(str(exc))
    except OSError as exc:   # e.g. a full disk, no permission on --out
        fail(f"--out {out_dir}: {exc.strerror or exc}: {exc.filename or ''}")
    info = pki.describe(issued.cert_path)
    info.update(key=str(issued.key_path), ca=str(issued.ca_path))
    if as_json:
        print_json(info)
    else:
        print_table(None, ["cert", "key", "ca", "role", "names", "valid until"],
                    [[issued.cert_path, issued.key_path, issued.ca_path, info["role"],
                      ", ".join(info["sans"]), info["not_after"]]])


@certs.command("show")
@click.argument("cert", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("--ca", "ca_dir", type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="Also say whether the CA in this directory (the one of its ca.key) signed it.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def show(cert: Path, ca_dir: Path | None, as_json: bool) -> None:
    """Subject, role, names and validity of a certificate."""
    try:
        info = pki.describe(cert)
    except ValueError as exc:
        fail(f"{cert}: not a PEM certificate ({exc})")
    if ca_dir is not None:
        try:
            info["signed_by_ca"] = pki.signed_by(cert, ca_dir)
        except pki.CertError as exc:
            fail(str(exc))
    if as_json:
        print_json(info)
    else:
        columns = ["common name", "role", "names", "not before", "not after", "issuer"]
        row = [info["common_name"], info["role"] or "none (re-issue it with --role)",
               ", ".join(info["sans"]), info["not_before"], info["not_after"], info["issuer"]]
        if ca_dir is not None:
            columns.append("signed by --ca")
            row.append("yes" if info["signed_by_ca"] else "no: issue again")
        print_table(None, columns, [row])


COMMANDS = [certs]
