"""One call to the controller's API for a CLI command, its failures turned into messages."""

from __future__ import annotations

from typing import Any

import grpc

from fastshare.cli._output import fail


def call_controller(client_config: Any, method: str, request: Any) -> Any:
    """``method(request)`` on the controller; a bad client set-up or an RPC error ends the
    command with the controller's answer and what to check (``unreachable_hint``)."""
    from fastshare.controller.client import Client, ClientConfigError, unreachable_hint

    try:
        with Client(client_config) as client:
            return client.call(method, request)
    except ClientConfigError as exc:
        fail(str(exc))
    except grpc.RpcError as exc:
        fail(f"controller at {client_config.address}: {exc.code().name}: {exc.details()}",
             unreachable_hint(exc, client_config))


def to_json(message: Any) -> dict:
    """A reply as ``--json`` prints it: proto field names, every field present."""
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
