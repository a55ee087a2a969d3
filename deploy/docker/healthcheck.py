"""gRPC health check for the specdec containers: exit 0 when the named service reports SERVING.

Used by the image HEALTHCHECK (docker, compose) and by the Helm chart's exec probes when TLS is on (the kubelet's
native gRPC probe cannot speak TLS). Settings come from flags, falling back to environment variables, so the
same image serves every role:
  SPECDEC_HEALTH_ADDR     host:port to check (default localhost:$SPECDEC_HEALTH_PORT, port default 50050)
  SPECDEC_HEALTH_SERVICE  grpc.health.v1 service name (default "specdec.v1.GatewayService")
  SPECDEC_HEALTH_TLS_CA / _CERT / _KEY / _SERVER_NAME   switch to TLS (client cert optional)
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv: list[str]) -> argparse.Namespace:
    env = os.environ.get
    default_addr = env("SPECDEC_HEALTH_ADDR") or f"localhost:{env('SPECDEC_HEALTH_PORT', '50050')}"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addr", default=default_addr)
    parser.add_argument("--service", default=env("SPECDEC_HEALTH_SERVICE", "specdec.v1.GatewayService"))
    parser.add_argument("--timeout", type=float, default=float(env("SPECDEC_HEALTH_TIMEOUT", "4")))
    parser.add_argument("--tls-ca", default=env("SPECDEC_HEALTH_TLS_CA", ""))
    parser.add_argument("--tls-cert", default=env("SPECDEC_HEALTH_TLS_CERT", ""))
    parser.add_argument("--tls-key", default=env("SPECDEC_HEALTH_TLS_KEY", ""))
    parser.add_argument("--server-name", default=env("SPECDEC_HEALTH_TLS_SERVER_NAME", ""))
    return parser.parse_args(argv)


def read(path: str) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def open_channel(args: argparse.Namespace):
    import grpc

    if not (args.tls_ca or args.tls_cert):
        return grpc.insecure_channel(args.addr)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(args.tls_ca),
        private_key=read(args.tls_key),
        certificate_chain=read(args.tls_cert),
    )
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    return grpc.secure_channel(args.addr, credentials, options=options)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with open_channel(args) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except Exception as exc:  # any failure (connect, TLS, NOT_FOUND) means unhealthy; say why
        print(f"unhealthy: {args.addr} {args.service}: {exc}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"unhealthy: {args.addr} {args.service}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
