# Source this first in a command on the lent GPU machine (the `device` tool), from the repository root:
#   source scripts/device_setup.sh
# The machine has torch/CUDA/Triton but no flashinfer, OpenTelemetry or grpcio 1.85 and no package index, so the
# wheels travel with the command (carry the folders; 64 MiB per call in all, the tracked tree is ~44 MiB):
#   .whl/      flashinfer_python-0.5.3, apache_tvm_ffi-0.1.15.post2 (cp312 manylinux_2_28), opentelemetry api/sdk
#              1.45.2 and semantic-conventions 0.66b2, fetched with
#              python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#                --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl <packages>
#   .grpcwhl/  grpcio, grpcio-health-checking, grpcio-reflection 1.85.1 (only to run the services there)
#   .fiaot/    flashinfer modules compiled on an earlier call (<name>/<name>.so, stripped), to skip the JIT
#              (~35 s per attention module); bring them back from ~/.cache/flashinfer/0.5.3/90a/cached_ops under $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl $(ls .grpcwhl/*.whl 2>/dev/null)
mkdir -p /tmp/site/flashinfer/data/aot && cp -r .fiaot/* /tmp/site/flashinfer/data/aot/ 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD MAX_JOBS=16 PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fiw
true
