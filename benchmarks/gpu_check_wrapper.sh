#!/usr/bin/env bash
# The GPU check on a machine without network, from the repository root there:
#
#   bash benchmarks/gpu_check_wrapper.sh [gpu_check.py flags]
#
# with the payload `make gpu-payload` prepared here (.gpu-payload/, carried beside the
# working tree). It installs the payload's wheels into a folder of their own (ahead of the
# image's packages on PYTHONPATH), puts back the generated gRPC stubs git does not carry,
# installs pdserve itself editable with --no-deps (against the torch, triton and transformers
# of the image), and runs benchmarks/gpu_check.py on cuda: the JSON goes to stdout and, when
# $OUT is set, to $OUT/gpu_check.json (the parts' logs to $OUT/gpu_check.log).
set -uo pipefail
cd "$(dirname "$0")/.."
PAYLOAD=${PDSERVE_GPU_PAYLOAD:-.gpu-payload}
PY=${PYTHON:-python3}
SITE=${PDSERVE_GPU_SITE:-/tmp/pdserve-gpu-site}

if [ ! -d "$PAYLOAD/wheels" ]; then
    echo "gpu_check_wrapper: no $PAYLOAD/wheels; run \`make gpu-payload\` where pip works and" \
        "carry $PAYLOAD" >&2
    exit 2
fi
# Everything but the check's JSON goes to stderr.
"$PY" benchmarks/gpu_check_parts/payload.py size "$PAYLOAD" >&2 || true  # what came, for the log

start=$(date +%s)
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$PAYLOAD"/wheels/*.whl >&2 || { echo "gpu_check_wrapper: wheels failed" >&2; exit 3; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
(cd "$PAYLOAD/wheels" && ls -- *.whl) >"$SITE/.pdserve-gpu-installed"
export PDSERVE_GPU_CHECK_INSTALLED="$SITE/.pdserve-gpu-installed"

for stub in "$PAYLOAD"/stubs/*; do
    [ -e "protos/pdserve/v1/$(basename "$stub")" ] || cp "$stub" protos/pdserve/v1/
done
# --no-build-isolation: setuptools from the image (a build environment would need the network).
"$PY" -m pip install -q --no-deps --no-build-isolation --no-cache-dir -e . >&2 \
    || { echo "gpu_check_wrapper: pip install -e . failed" >&2; exit 4; }
echo "gpu_check_wrapper: installed in $(($(date +%s) - start)) s" >&2

export PDSERVE_GPU_CHECK_TOKENIZER="$PAYLOAD/tokenizer"
export PYTHONUNBUFFERED=1
exec "$PY" benchmarks/gpu_check.py --device cuda "$@"
