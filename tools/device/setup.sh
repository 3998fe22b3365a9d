# Sourced by the device-call scripts: vLLM bundle, our wheels (and nox) on the path, $OUT ready.
source .device/activate.sh
export EPILORA_SITE=/tmp/epilora-site  # where our wheels are installed
# .device/wheels (nox for the test steps) is absent after `LEAN=1 prepare.sh`.
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target "$EPILORA_SITE" \
  $(ls .device/wheels/*.whl 2>/dev/null) .device/dist/*.whl || exit 1
# Our packages after vLLM's bundle on the path, so nothing of ours shadows vLLM's dependencies.
export PYTHONPATH="$PYTHONPATH:$EPILORA_SITE" OUT="${OUT:-out}"
mkdir -p "$OUT"
# vLLM's LoRA layer tests for the plugin's GPU tests (prepare.sh; the GPU machine has no network)
export EPILORA_VLLM_TESTS="$PWD/.device/vllm-tests"
[ -f "$EPILORA_VLLM_TESTS/tests/lora/test_layers.py" ] \
  || echo "setup.sh: no $EPILORA_VLLM_TESTS (run tools/device/prepare.sh): the plugin's GPU tests will not collect" >&2
