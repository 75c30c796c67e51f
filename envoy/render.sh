#!/bin/sh
# Renders envoy/envoy.yaml to stdout, taking each {{NAME}} from the environment variable NAME
# (defaults as documented at the top of envoy.yaml). REPLICAS is a space-separated list of
# host:port used to build FALLBACK_LB_ENDPOINTS when that variable is not set.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
: "${LISTEN_PORT:=10000}"
: "${ADMIN_PORT:=9901}"
: "${WASM_PATH:=$here/../target/wasm32-wasip1/release/kvroute_filter.wasm}"
: "${INDEXER_PORT:=8190}"
: "${REPLICAS:=127.0.0.1:8001 127.0.0.1:8002 127.0.0.1:8003 127.0.0.1:8004}"
if [ -z "${PLUGIN_CONFIG:-}" ]; then PLUGIN_CONFIG='"{}"'; fi
if [ -z "${VM_CONFIG:-}" ]; then VM_CONFIG='""'; fi
if [ -z "${FALLBACK_LB_ENDPOINTS:-}" ]; then
  FALLBACK_LB_ENDPOINTS="["
  sep=""
  for r in $REPLICAS; do
    FALLBACK_LB_ENDPOINTS="$FALLBACK_LB_ENDPOINTS$sep{\"endpoint\":{\"address\":{\"socket_address\":{\"address\":\"${r%:*}\",\"port_value\":${r##*:}}}}}"
    sep=","
  done
  FALLBACK_LB_ENDPOINTS="$FALLBACK_LB_ENDPOINTS]"
fi
export LISTEN_PORT ADMIN_PORT WASM_PATH INDEXER_PORT FALLBACK_LB_ENDPOINTS PLUGIN_CONFIG VM_CONFIG
exec python3 - "$here/envoy.yaml" <<'PY'
import os, sys
text = open(sys.argv[1]).read()
for name in ["LISTEN_PORT", "ADMIN_PORT", "WASM_PATH", "INDEXER_PORT", "FALLBACK_LB_ENDPOINTS", "PLUGIN_CONFIG", "VM_CONFIG"]:
    text = text.replace("{{" + name + "}}", os.environ[name])
sys.stdout.write(text)
PY
