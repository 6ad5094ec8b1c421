#!/usr/bin/env bash
# devinject on a real NVIDIA GPU (tools/gpu_check.py says what it checks; docs/testing.md, "On a real GPU").
# Run as root from anywhere: the project's own .venv when there is one (`make venv`), else python3 with
# devinject's runtime dependencies installed (pip install -r deploy/image/requirements.txt), else it says so.
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
[ -x "$python" ] || python=python3
if ! PYTHONPATH=src "$python" -c 'import devinject.cli' 2>/tmp/devinject-gpucheck.err; then
    echo "tools/gpu_check.sh: $python cannot import devinject: $(tail -1 /tmp/devinject-gpucheck.err)" >&2
    echo "  make venv, or: $python -m pip install -r deploy/image/requirements.txt" >&2
    exit 2
fi
exec timeout 600 "$python" tools/gpu_check.py "$@"
