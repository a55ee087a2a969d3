"""gRPC edge plumbing shared by the target, draft and gateway services.

- `tensor_codec`   torch tensors <-> `specdec.v1.Tensor` (feature blobs).
- `sampling_codec` `SamplingParams` <-> its message, with presence semantics.
- `errors`         `specdec.errors` exceptions -> gRPC status codes in servicers.
- `server`         `start_server` (health, reflection, TLS, limits) and `run_server_forever` (signals, drain).
- `channel`        `make_channel` with the same limits/TLS, `wait_for_serving` via the health service.
- `metadata`       request id and deadline propagation through call metadata.
- `tls`, `options` the TLS config/flags and the channel/server options both sides share.

Engines never import this package; only the services' servicer and client modules do.
"""
