"""What a Verify RPC costs besides the target's forward, on the host (CPU only, no model): packing and unpacking the
request and the reply (the reply carries the accepted tokens' features as one blob), and a loopback gRPC round
trip of the same byte sizes (an echo server that does no work). 8B shapes: features of width 4096 (EAGLE-1) or
3 x 4096 (EAGLE-3), bf16; `--tokens` committed per request and step (tau), a chain of `--draft` tokens proposed.

    python bench/rpc_codec.py [--batch-sizes 1,8,32,64,128] [--tokens 5] [--draft 6] [--repeats 50]
                              [--feature-wire fp8]

`--feature-wire fp8`: the features travel as 8-bit floats with a scale per row (packed before timing: the target
packs them on its GPU); `draft_unpack_ms` then includes unpacking them on this CPU, which a GPU draft does on its
device instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.engine.requests import VerifyInput, VerifyOutput  # noqa: E402
from specdec.rpc.options import channel_options, server_options  # noqa: E402
from specdec.rpc.target_codec import (  # noqa: E402
    verify_from_proto,
    verify_outputs_from_proto,
    verify_outputs_to_proto,
    verify_reply_bytes,
    verify_to_proto,
)
from specdec.rpc.tensor_codec import pack_fp8_rows  # noqa: E402
from specdec.rpc.wire import decode_with_tensor  # noqa: E402
from specdec.v1 import target_pb2  # noqa: E402

METHOD = "/bench.Echo/Echo"


def _best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _unpack(reply: bytes):
    """What the draft's client does with a Verify reply (features read where they lie)."""
    msg, raw = decode_with_tensor(target_pb2.VerifyResponse, reply, "features")
    return verify_outputs_from_proto(msg, features=raw)


def echo_server():
    """A gRPC server answering METHOD with `reply_size` bytes (set per measurement), raw bytes both ways."""
    state = {"reply": b""}
    handler = grpc.method_handlers_generic_handler("bench.Echo", {
        "Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: state["reply"]),
    })
    server = grpc.server(futures.ThreadPoolExecutor(2), options=server_options())
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,8,32,64,128")
    ap.add_argument("--tokens", type=int, default=5)
    ap.add_argument("--draft", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--feature-wire", choices=["native", "fp8"], default="native")
    args = ap.parse_args()
    server, port, state = echo_server()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
    echo = channel.unary_unary(METHOD)
    rows = []
    for width, head in ((4096, "eagle1"), (3 * 4096, "eagle3")):
        for bs in (int(x) for x in args.batch_sizes.split(",")):
            inputs = [VerifyInput(f"req-{i}", list(range(100, 100 + args.draft)), list(range(-1, args.draft - 1)))
                      for i in range(bs)]
            feats = torch.randn(bs * args.tokens, width).to(torch.bfloat16)
            if args.feature_wire == "fp8":
                feats = pack_fp8_rows(feats)
            outs = [VerifyOutput(f"req-{i}", list(range(args.tokens)), args.tokens - 1, f)
                    for i, f in enumerate(feats.split(args.tokens))]
            req = verify_to_proto(inputs).SerializeToString()
            reply = verify_reply_bytes(outs)
            state["reply"] = reply
            row = {"head": head, "bs": bs, "feature_wire": args.feature_wire, "request_kB": round(len(req) / 1e3, 1),
                   "reply_MB": round(len(reply) / 1e6, 2),
                   "draft_pack_ms": _best_ms(lambda inputs=inputs: verify_to_proto(inputs).SerializeToString(),
                                             args.repeats),
                   "target_unpack_ms": _best_ms(lambda req=req: verify_from_proto(
                       target_pb2.VerifyRequest.FromString(req)), args.repeats),
                   "target_pack_ms": _best_ms(lambda outs=outs: verify_reply_bytes(outs), args.repeats),
                   "draft_unpack_ms": _best_ms(lambda reply=reply: _unpack(reply), args.repeats),
                   "grpc_round_trip_ms": _best_ms(lambda req=req: echo(req), args.repeats)}
            # not in the total: protobuf's own encoding of the same reply, as the service packed it before
            proto_ms = _best_ms(lambda outs=outs: verify_outputs_to_proto(outs).SerializeToString(), args.repeats)
            proto_unpack_ms = _best_ms(lambda reply=reply: verify_outputs_from_proto(
                target_pb2.VerifyResponse.FromString(reply)), args.repeats)
            row = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
            row["total_ms"] = round(sum(v for k, v in row.items() if k.endswith("_ms")), 3)
            row["target_pack_protobuf_ms"] = round(proto_ms, 3)
            row["draft_unpack_protobuf_ms"] = round(proto_unpack_ms, 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    channel.close()
    server.stop(None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
