# Sourced by the device-call scripts: vLLM bundle, our wheels (and nox) on the path, $OUT ready.
source .device/activate.sh
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/epilora-site \
  .device/wheels/*.whl .device/dist/*.whl || exit 1
# Our packages after vLLM's bundle on the path, so nothing of ours shadows vLLM's dependencies.
export PYTHONPATH="$PYTHONPATH:/tmp/epilora-site" OUT="${OUT:-out}"
mkdir -p "$OUT"
