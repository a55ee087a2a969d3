"""Generated gRPC/protobuf stubs of the `specdec.v1` protocol (source: proto/specdec/v1/*.proto).

Do not edit the *_pb2* modules by hand; regenerate them with `scripts/gen_proto.sh`.
"""
