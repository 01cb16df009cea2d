"""`fastshare cordon|uncordon NODE`: stop or resume new work on a node (its allocations stay);
`fastshare forget-node NODE`: forget a node taken out for good."""

from __future__ import annotations

import click

from fastshare.cli._controller import call_controller, to_json
from fastshare.cli._output import print_json
from fastshare.controller.client import client_options


def _set(client_config, node: str, schedulable: bool, reason: str, as_json: bool) -> None:
    from fastshare.v1 import controller_pb2 as pb

    status = call_controller(client_config, "SetSchedulable", pb.SetSchedulableRequest(
        node=node, schedulable=schedulable, reason=reason))
    if as_json:
        print_json(to_json(status))
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
    from fastshare.v1 import controller_pb2 as pb

    if not yes:
        click.confirm(f"End every allocation on {node} and forget the node?", abort=True)
    reply = call_controller(client_config, "ForgetNode", pb.ForgetNodeRequest(node=node, reason=reason))
    if as_json:
        print_json(to_json(reply))
        return
    click.echo(f"node {node} forgotten; {len(reply.ended)} allocation(s) ended"
               + (": " + ", ".join(a.id for a in reply.ended) if reply.ended else ""))


COMMANDS = [cordon, uncordon, forget_node]
