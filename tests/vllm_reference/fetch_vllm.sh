#!/bin/sh
# Thin wrapper: fetch vLLM 0.33.0's kv_events.py into the kvroute cache (see fetch_vllm.py).
# Uses $KVROUTE_PYTHON if set, else python3.
exec "${KVROUTE_PYTHON:-python3}" "$(dirname "$0")/fetch_vllm.py" "$@"
