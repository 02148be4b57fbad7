#!/usr/bin/env python3
"""Server reflection of a duet gRPC server, as Python's official grpcio-reflection sees it.

grpcio-reflection speaks `grpc.reflection.v1alpha` only. This lists the server's services
and describes `duet.v1.Generation` from the descriptors the server sends (no local .proto),
then prints one JSON object on stdout:

    {"services": [...], "generation": {"methods": {"Generate": {"input": "...",
     "output": "...", "server_streaming": true}, ...}}}

or, when the server refuses the call, {"error": "UNAUTHENTICATED", "details": "..."}.
`--token` adds the cluster token header that workers require of members.
"""

import argparse
import json
import sys

import grpc


class _Metadata(grpc.StreamStreamClientInterceptor):
    """Adds one metadata pair to every call (reflection is a stream-stream call)."""

    def __init__(self, key, value):
        self.pair = (key, value)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        metadata = list(details.metadata or []) + [self.pair]
        return continuation(details._replace(metadata=metadata), request_iterator)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="server address, host:port")
    ap.add_argument("--token", help="cluster token (x-duet-cluster-token) for a worker")
    ap.add_argument("--timeout", type=float, default=60.0)
    a = ap.parse_args()

    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    channel = grpc.insecure_channel(a.target)
    grpc.channel_ready_future(channel).result(timeout=a.timeout)
    if a.token:
        channel = grpc.intercept_channel(channel, _Metadata("x-duet-cluster-token", a.token))
    db = ProtoReflectionDescriptorDatabase(channel)
    try:
        services = sorted(db.get_services())
        pool = DescriptorPool(db)
        gen = pool.FindServiceByName("duet.v1.Generation")
    except grpc.RpcError as e:
        print(json.dumps({"error": e.code().name, "details": e.details()}))
        return 0
    methods = {
        m.name: {
            "input": m.input_type.full_name,
            "output": m.output_type.full_name,
            "server_streaming": m.server_streaming,
        }
        for m in gen.methods
    }
    print(json.dumps({"services": services, "generation": {"methods": methods}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
