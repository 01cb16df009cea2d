"""`fastshare cordon|uncordon NODE`: stop or resume new work on a node (its allocations stay);
`fastshare forget-node NODE`: forget a node taken out for good."""

from __future__ import annotations

import click
import grpc

from fastshare.cli._output import fail, print_json
from fastshare.controller.client import client_options


def _set(client_config, node: str, schedulable: bool, reason: str, as_json: bool) -> None:
    from google.protobuf.json_format import MessageToDict

    from fastshare.controller.client import Client, ClientConfigError, unreachable_hint
    from fastshare.v1 import controller_pb2 as pb

    try:
        with Client(client_config) as client:
            status = client.call("SetSchedulable", pb.SetSchedulableRequest(
                node=node, schedulable=schedulable, reason=reason))
    except ClientConfigError as exc:
        fail(str(exc))
    except grpc.RpcError as exc:
        fail(f"controller at {client_config.address}: {exc.code().name}: {exc.details()}",
             unreachable_hint(exc, client_config))
    if as_json:
        print_json(MessageToDict(status, preserving_proto_field_name=True,
                                 always_print_fields_with_no_presence=True))
    elif status.cordoned:
        held = len({a for g in status.gpus for a in g.allocation_ids})
        click.echo(f"node {status.name} cordoned: no new allocations; its existing ones stay "
                   f"(`fastshare status` lists them). Undo with `fastshare uncordon {status.name}`.")
        if held:
            click.echo(f"{held} allocation(s) still on {status.name}")
    else:
        click.echo(f"node {status.name} uncordoned: it takes new allocations again")


@click.command("cordon")
@click.argument("node")
@click.option("--reason", default="", help="Why (shown in `fastshare status` and in rejections).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@client_options
def cordon(client_config, node: str, reason: str, as_json: bool) -> None:
    """Give NODE no new allocations (e.g. before changing its MIG layout); existing ones stay."""
    _set(client_config, node, False, reason, as_json)


@click.command("uncordon")
@click.argument("node")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@client_options
def uncordon(client_config, node: str, as_json: bool) -> None:
    """Let NODE take new allocations again."""
    _set(client_config, node, True, "", as_json)


@click.command("forget-node")
@click.argument("node")
@click.option("--reason", default="", help="Why (kept in each ended allocation's reason).")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@client_options
def forget_node(client_config, node: str, reason: str, yes: bool, as_json: bool) -> None:
    """Forget NODE, taken out for good (decommissioned, renamed, re-installed): its allocations
    end and give back what they held, and it leaves `fastshare status`. Its agent must be stopped
    first (refused while it heartbeats)."""
    from google.protobuf.json_format import MessageToDict

    from fastshare.controller.client import Client, ClientConfigError, unreachable_hint
    from fastshare.v1 import controller_pb2 as pb

    if not yes:
        click.confirm(f"End every allocation on {node} and forget the node?", abort=True)
    try:
        with Client(client_config) as client:
            reply = client.call("ForgetNode", pb.ForgetNodeRequest(node=node, reason=reason))
    except ClientConfigError as exc:
        fail(str(exc))
    except grpc.RpcError as exc:
        fail(f"controller at {client_config.address}: {exc.code().name}: {exc.details()}",
             unreachable_hint(exc, client_config))
    if as_json:
        print_json(MessageToDict(reply, preserving_proto_field_name=True,
                                 always_print_fields_with_no_presence=True))
        return
    click.echo(f"node {node} forgotten; {len(reply.ended)} allocation(s) ended"
               + (": " + ", ".join(a.id for a in reply.ended) if reply.ended else ""))


COMMANDS = [cordon, uncordon, forget_node]
