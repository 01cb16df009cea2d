"""`fastshare release ID`: end an allocation (e.g. one the controller adopted after its state
database was restored from an older backup, see `fastshare status`)."""

from __future__ import annotations

import click

from fastshare.cli._controller import call_controller, to_json
from fastshare.cli._output import print_json
from fastshare.controller.client import client_options


@click.command("release")
@click.argument("allocation_id")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@client_options
def release(client_config, allocation_id: str, as_json: bool) -> None:
    """End allocation ALLOCATION_ID: its share is freed on its node and its capacity given back.
    Whatever runs on it loses the GPU share."""
    from fastshare.v1 import controller_pb2 as pb

    done = call_controller(client_config, "Release", pb.ReleaseAllocationRequest(allocation_id=allocation_id))
    if as_json:
        print_json(to_json(done))
        return
    state = pb.AllocationState.Name(done.state).removeprefix("ALLOCATION_STATE_").lower()
    click.echo(f"allocation {done.id} on node {done.node}: {state}"
               + ("" if state in ("released", "failed") else " (its node is unreachable: it ends once the "
                                                               "node is back)"))


COMMANDS = [release]
