"""Client stubs built from the services' protobuf descriptors.

The generated *_pb2_grpc modules pin the grpcio version they were generated with (they refuse
an older grpcio); building the stubs from the *_pb2 descriptors needs only a channel, so the
client runs with any grpcio that machines already have.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import symbol_database


class ServiceStub:
    """One attribute per RPC of `service` (a ServiceDescriptor), like a generated stub."""

    def __init__(self, channel: grpc.Channel, service: Any) -> None:
        db = symbol_database.Default()
        for method in service.methods:
            request = db.GetSymbol(method.input_type.full_name)
            response = db.GetSymbol(method.output_type.full_name)
            path = f"/{service.full_name}/{method.name}"
            if method.client_streaming and method.server_streaming:
                make = channel.stream_stream
            elif method.client_streaming:
                make = channel.stream_unary
            elif method.server_streaming:
                make = channel.unary_stream
            else:
                make = channel.unary_unary
            setattr(self, method.name, make(path, request_serializer=request.SerializeToString,
                                            response_deserializer=response.FromString))
