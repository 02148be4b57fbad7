#!/usr/bin/env python3
"""A minimal Python client of duet's public gRPC API, as a user would write one.

Stubs are generated from proto/ with grpcio-tools (see cli/tests/python_client.rs):

    python3 -m grpc_tools.protoc -I proto --python_out=DIR --grpc_python_out=DIR \
        proto/duet/v1/generation.proto proto/duet/v1/worker.proto

Streams one greedy completion and checks the standard health service, then prints one
JSON object on stdout:

    {"ids": [...], "text": "...", "finish_reason": "FINISH_REASON_LENGTH",
     "usage": {...}, "request_id": "...", "health": {"": "SERVING", ...}}
"""

import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="router address, host:port")
    ap.add_argument("--stubs", required=True, help="directory of the generated stubs")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=300.0, help="gRPC deadline, seconds")
    a = ap.parse_args()

    sys.path.insert(0, a.stubs)
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from duet.v1 import generation_pb2 as pb
    from duet.v1 import generation_pb2_grpc as pb_grpc

    with grpc.insecure_channel(a.target) as channel:
        grpc.channel_ready_future(channel).result(timeout=a.timeout)

        health = health_pb2_grpc.HealthStub(channel)
        statuses = {}
        for service in ("", "duet.v1.Generation"):
            r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=a.timeout)
            statuses[service] = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

        stub = pb_grpc.GenerationStub(channel)
        req = pb.GenerateRequest(text=a.prompt, max_tokens=a.max_tokens)
        ids, text, final, request_id = [], "", None, ""
        for msg in stub.Generate(req, timeout=a.timeout):
            request_id = msg.request_id
            kind = msg.WhichOneof("event")
            if kind == "token":
                ids.append(msg.token.id)
                text += msg.token.text
            elif kind == "final":
                final = msg.final
                text += final.text
        if final is None:
            print("stream ended without a final message", file=sys.stderr)
            return 1

    out = {
        "ids": ids,
        "text": text,
        "finish_reason": pb.FinishReason.Name(final.finish_reason),
        "usage": {
            "prompt_tokens": final.usage.prompt_tokens,
            "completion_tokens": final.usage.completion_tokens,
            "truncated_tokens": final.usage.truncated_tokens,
        },
        "request_id": request_id,
        "health": statuses,
    }
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
