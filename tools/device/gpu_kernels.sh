#!/usr/bin/env bash
# One device call for epilora-kernels on the H200, into $OUT: the steps named as arguments, in
# order, each under its own timeout (seconds, from the environment):
#   tests   the kernel GPU tests (nox -s gpu-sm90 -- ${KERNEL_TESTS_ARGS:-packages/
#           epilora-kernels}), in $TESTS_JOBS (4) processes                       TESTS_TIMEOUT
#   tune    benchmarks/tune.py $TUNE_ARGS -> $OUT/NVIDIA_H200.json, which the later steps of the
#           call then use (installed into the package); copy it to epilora_kernels/configs/ to
#           keep it                                                                 TUNE_TIMEOUT
#   tune-layer benchmarks/tune_layer.py $TUNE_LAYER_ARGS (the decode path's K1, its K2 with
#           --kernel k2, or the fused path's K1 with --path fused, by the layer's time)
#           -> $OUT/NVIDIA_H200.json, used by the later steps as tune's          TUNE_TIMEOUT
#   layer   benchmarks/layer.py $LAYER_ARGS -> $OUT/layer.json                     LAYER_TIMEOUT
#   tune-decode benchmarks/tune_decode.py $TUNE_DECODE_ARGS: the library's tuner on the models'
#           shapes -> $OUT/tune_decode.json; its cache goes to $EPILORA_CACHE_DIR (default
#           ~/.cache/epilora/kernels), where the later steps of the call read it, and a copy to
#           $OUT/tune-cache/ (not the cache itself under $OUT: each step's files there are tarred
#           away when it ends, so a later step would find none)          TUNE_TIMEOUT
#   models  benchmarks/layer.py over the three models' shapes (MODELS_ARGS: the default is the
#           issue's grid of setups, tokens and systems) -> $OUT/layer_models.json LAYER_TIMEOUT
#   decode  benchmarks/decode.py -> $OUT/decode.json                               DECODE_TIMEOUT
#           (both, the first time in the call or after a use: step, with --jobs $COMPILE_JOBS,
#           15: their cases compiled in parallel first, where a cold decode page compiling one
#           kernel at a time ran past 230 s; later runs find the kernels in Triton's cache)
#   timeline dev/decode_timeline.py $TIMELINE_ARGS -> $OUT/decode_timeline.json
#                                                                            TIMELINE_TIMEOUT
#   use:NAME the later steps run epilora-kernels as built from git ref NAME (a wheel that
#           `VARIANTS="NAME ..." tools/device/prepare.sh` put in .device/variants/) and write
#           into $OUT/NAME/ (/, ~ and ^ as dashes: the call brings back no name with ~), e.g.
#           `use:main layer use:next/x layer` times two branches in one call; the benchmark
#           scripts and tests stay the working tree's
#   plugin-tests the plugin's GPU tests but vLLM's Punica op grids (nox -s gpu-sm90 --
#           ${PLUGIN_TESTS_ARGS:-packages/epilora-vllm --ignore=...punica_ops.py}, e.g. one test
#           file; 233 s at 3ef3759)                                   TESTS_TIMEOUT (360)
#   punica-tests vLLM's Punica op grids on the kernels (tests/test_vllm_punica_ops.py, ~4,300
#           cases, vLLM's references on the CPU), in $TESTS_JOBS (8) processes (at 3ef3759
#           45% of them in 225 s, none failing: the whole grid wants a call of its own)
#           -> gpu-sm90-punica.log                                      TESTS_TIMEOUT (540)
#   rl-tests the trainer's GPU tests (nox -s gpu-sm90 -- packages/epilora-rl)   TESTS_TIMEOUT
#   rl-memory benchmarks/rl_memory.py $RL_MEMORY_ARGS -> $OUT/rl.json (the committed file's
#           and earlier RL steps' parts kept), logs in $OUT/rl-logs/        SERVING_TIMEOUT
#   rl-accuracy benchmarks/rl_accuracy.py $RL_ACCURACY_ARGS on SmolLM2 (bf16, from the GGUF
#           and wheels that tools/device/stage_rl.sh stages in .stage/) -> $OUT/rl.json as
#           rl-memory, logs in $OUT/rl-logs/                                   RL_TIMEOUT
#   equivalence the serving demo (tools/serve_demo.py) on the GPU, then
#           benchmarks/equivalence.py $EQUIVALENCE_ARGS on its checkpoints and adapters
#           -> $OUT/equivalence.json, engine logs in $OUT/equivalence-logs/ (SmolLM2 and the
#           wheels staged as for rl-accuracy; the demo and all twelve engines take about ten
#           minutes, so split them over calls held one after another (the demo's files stay)
#           with EQUIVALENCE_ARGS="--systems ...", their logs in one folder per run for
#           `equivalence.py --collect`)                                    EQUIVALENCE_TIMEOUT
#   serving benchmarks/serving.py $SERVING_ARGS -> $OUT/serving.json, engine logs in
#           $OUT/serving-logs/ (`--scenarios start`: each system's first start on empty caches
#           of its own, then a later one)                                     SERVING_TIMEOUT
#   large-m-probe dev/large_m_probe.py $LARGE_M_ARGS: the fused path's kernels at prefill
#           sizes one by one, K1 in each of its tilings (slices together or not), per
#           projection -> $OUT/large_m_probe.json and .log              LARGE_M_TIMEOUT (420)
#   gemv-probe dev/gemv_probe.py $GEMV_ARGS: an FP8 GEMV on CUDA cores against CUTLASS and
#           our K2 at 1-8 tokens, per projection -> $OUT/gemv_probe.json   GEMV_TIMEOUT (300)
#   prefill-probe dev/prefill_probe.py for each of $PROBE_SYSTEMS (epilora vllm-default), each
#           under PROBE_TIMEOUT (300) -> $OUT/prefill_probe_SYSTEM.json and .log (with
#           EPILORA_VLLM_TUNE=0 in the environment the plugin's engine starts ~60 s sooner);
#           PROBE_ARGS: more arguments (e.g. "--lengths 520 512");
#           PROBE_SAMPLE=SECONDS: also the stacks of eager steps sampled that long
#           -> $OUT/stacks_SYSTEM.txt (dev/collapse_stacks.py sums them)
#   op-overhead dev/op_overhead.py $OVERHEAD_ARGS: the kernels' host time per eager call
#           -> $OUT/op_overhead.json                                     OVERHEAD_TIMEOUT (120)
#   launch-variants dev/launch_variants.py $LAUNCH_VARIANTS_ARGS: variants of the kernels'
#           launch rules (K2's one-slot epilogue in rank steps, the heuristic, its rules as
#           before 2026-12-05, the decode path's K1 in lighter programs, the decode
#           path at prefill, the next weight prefetched into L2; --codes: on FP8 codes, as the plugin's engine; --gap-us:
#           a spin between the projections, as the engine's attention) against the shipped
#           ones, per model, rank and tokens -> $OUT/launch_variants.json  LAYER_TIMEOUT (300)
#   engine-kernels dev/engine_kernels.py $ENGINE_KERNELS_ARGS: one engine decode step's kernels
#           per system -> $OUT/engine_kernels.json and its engines' logs          SERVING_TIMEOUT
#   env:NAME=VALUE  sets NAME for the later steps (quote it when VALUE has spaces); setting OUT
#           (e.g. "env:OUT=$OUT/main-1x128") keeps a second run of a step from replacing the first
# The test steps' timeouts interrupt pytest (SIGINT, then a kill 30 s later): a run cut short
# still prints the failures it met and writes its junit XML (at d405d3a a cut plugin run
# showed an F and no report).
# A call brings back at most 8 files of $OUT, so each finished step's files are appended to
# $OUT/results.tar (unpack it here with tools/device/unpack.sh); a step cut off by the call's
# limit leaves its files loose beside it. Run from the repository root with `.device` carried
# (tools/device/prepare.sh first), e.g.
#   EPILORA_GIT_SHA=$(git rev-parse HEAD) bash tools/device/gpu_kernels.sh tests tune
set -uo pipefail
source tools/device/setup.sh
BASE_OUT="$OUT"
sha="${EPILORA_GIT_SHA:-}"
status=0
declare -A used compiled
# $jobs, benchmarks/NAME.py's --jobs: $COMPILE_JOBS the first time since the call began or the
# kernels or their table changed (use:, tune), else 1 (each compile process costs its imports
# even when everything is cached). Sets a global: called in this shell, not in $(...).
jobs_for() {
  if [ -z "${compiled[$1]:-}" ]; then compiled[$1]=1; jobs="${COMPILE_JOBS:-15}"; else jobs=1; fi
}
# benchmarks/NAME.py ARGS -> $OUT/NAME.json, .log and the table NVIDIA_H200.json, which then
# serves the later steps (a run cut short wrote what it finished); the tuner's exit status.
tune() {
  local name="$1"; shift
  timeout "${TUNE_TIMEOUT:-420}" python3 "benchmarks/$name.py" \
    --out-table "$OUT/NVIDIA_H200.json" --out "$OUT/$name.json" --git-sha "$sha" "$@" 2>&1 \
    | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  [ -f "$OUT/NVIDIA_H200.json" ] \
    && cp "$OUT/NVIDIA_H200.json" "$EPILORA_SITE/epilora_kernels/configs/"
  return "$rc"
}
# The RL steps' result file: one working copy for the call, seeded from the committed file, so
# a second RL step adds its part to the first's (each step's $OUT is tarred and removed).
RL_JSON=/tmp/epilora-rl-results.json
rl_results() { [ -f "$RL_JSON" ] || cp benchmarks/results/h200/rl.json "$RL_JSON"; }
rm -f "$RL_JSON"
# SmolLM2's GGUF (sha256-checked) in the demos' cache, /tmp/epilora-cache, and the staged
# wheels installed: from what tools/device/stage_rl.sh staged in .stage/.
smollm2() {
  [ -f /tmp/epilora-cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] && return 0
  (cd .stage/smollm2 && cat part-aa part-ab > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
     && cd /tmp && sha256sum -c "$OLDPWD/SHA256SUMS") || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile \
    --target "$EPILORA_SITE" .stage/wheels/*.whl || return 1
  mkdir -p /tmp/epilora-cache/smollm2 \
    && mv /tmp/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/epilora-cache/smollm2/
}
for step in "$@"; do
  case "$step" in
    use:*) name="${step#use:}"; dir=".device/variants/${name//[\/~^]/-}"
           python3 -m pip install -q --upgrade --force-reinstall --no-index --no-deps \
             --no-compile --target "$EPILORA_SITE" "$dir"/epilora_kernels-*.whl || exit 1
           # A ref used again in the call writes beside its first run (NAME-2, ...), not over it.
           used[$name]=$(( ${used[$name]:-0} + 1 )); again=""
           (( used[$name] > 1 )) && again="-${used[$name]}"
           sha="$(cat "$dir/sha")"; OUT="$BASE_OUT/${name//[\/~^]/-}$again"; mkdir -p "$OUT"
           compiled=()
           echo "epilora-kernels from $name at $sha" ;;
    tests) # In $TESTS_JOBS processes (pytest-xdist, from prepare.sh's wheels; 0: one): 84
           # tests took 142 s in one, mostly compiling, 44-58 s in four.
           workers=(); (( ${TESTS_JOBS:-4} > 0 )) && python3 -c "import xdist" 2>/dev/null \
             && workers=(-n "${TESTS_JOBS:-4}")
           timeout -s INT -k 30 "${TESTS_TIMEOUT:-240}" python3 -m nox -s gpu-sm90 -- \
             ${KERNEL_TESTS_ARGS:-packages/epilora-kernels} "${workers[@]}" \
             --junitxml="$OUT/gpu-sm90-kernels-junit.xml" 2>&1 | tee "$OUT/gpu-sm90-kernels.log" ;;
    tune) compiled=(); tune tune ${TUNE_ARGS:-} ;;
    tune-layer) compiled=(); tune tune_layer ${TUNE_LAYER_ARGS:-} ;;
    layer) jobs_for layer
           timeout "${LAYER_TIMEOUT:-300}" python3 benchmarks/layer.py --out "$OUT/layer.json" \
             --git-sha "$sha" --jobs "$jobs" ${LAYER_ARGS:-} 2>&1 \
             | tee "$OUT/layer.log" ;;
    tune-decode) timeout "${TUNE_TIMEOUT:-420}" python3 benchmarks/tune_decode.py \
                   --out "$OUT/tune_decode.json" --git-sha "$sha" ${TUNE_DECODE_ARGS:-} 2>&1 \
                   | tee "$OUT/tune_decode.log"
                 tune_rc=${PIPESTATUS[0]}
                 mkdir -p "$OUT/tune-cache" && python3 -c "import torch, shutil
from epilora_kernels.tuner import cache_path
shutil.copy(cache_path(torch.cuda.get_device_name()), '$OUT/tune-cache/')"
                 (exit "$tune_rc") ;;  # the step's status: the tuner's
    models) jobs_for layer
            timeout "${LAYER_TIMEOUT:-300}" python3 benchmarks/layer.py \
              --out "$OUT/layer_models.json" --git-sha "$sha" --jobs "$jobs" \
              ${MODELS_ARGS:---models qwen3-8b llama3.1-8b qwen2.5-7b \
                --systems cutlass vllm-default epilora epilora-heuristic \
                --setups 1x16 1x64 1x128 8x16 32x64 \
                --tokens 1 4 8 16 32 64 256 512 2048 4096} 2>&1 \
              | tee "$OUT/layer_models.log" ;;
    decode) jobs_for decode
            timeout "${DECODE_TIMEOUT:-360}" python3 benchmarks/decode.py \
              --out "$OUT/decode.json" --git-sha "$sha" --jobs "$jobs" 2>&1 \
              | tee "$OUT/decode.log" ;;
    large-m-probe) timeout "${LARGE_M_TIMEOUT:-420}" python3 dev/large_m_probe.py \
                     --out "$OUT/large_m_probe.json" ${LARGE_M_ARGS:-} 2>&1 \
                     | tee "$OUT/large_m_probe.log" ;;
    gemv-probe) timeout "${GEMV_TIMEOUT:-300}" python3 dev/gemv_probe.py \
                  --out "$OUT/gemv_probe.json" ${GEMV_ARGS:-} 2>&1 | tee "$OUT/gemv_probe.log" ;;
    timeline) timeout "${TIMELINE_TIMEOUT:-240}" python3 dev/decode_timeline.py \
                --out "$OUT/decode_timeline.json" --git-sha "$sha" ${TIMELINE_ARGS:-} 2>&1 \
                | tee "$OUT/decode_timeline.log" ;;
    plugin-tests) punica=packages/epilora-vllm/tests/test_vllm_punica_ops.py
                  timeout -s INT -k 30 "${TESTS_TIMEOUT:-360}" python3 -m nox -s gpu-sm90 -- \
                    ${PLUGIN_TESTS_ARGS:-packages/epilora-vllm --ignore=$punica} --junitxml="$OUT/gpu-sm90-vllm-junit.xml" 2>&1 \
                    | tee "$OUT/gpu-sm90-vllm.log" ;;
    punica-tests) workers=(); (( ${TESTS_JOBS:-8} > 0 )) && python3 -c "import xdist" 2>/dev/null \
                    && workers=(-n "${TESTS_JOBS:-8}")
                  timeout -s INT -k 30 "${TESTS_TIMEOUT:-540}" python3 -m nox -s gpu-sm90 -- \
                    packages/epilora-vllm/tests/test_vllm_punica_ops.py "${workers[@]}" \
                    --junitxml="$OUT/gpu-sm90-punica-junit.xml" 2>&1 | tee "$OUT/gpu-sm90-punica.log" ;;
    rl-tests) timeout -s INT -k 30 "${TESTS_TIMEOUT:-240}" python3 -m nox -s gpu-sm90 -- \
                packages/epilora-rl --junitxml="$OUT/gpu-sm90-rl-junit.xml" 2>&1 \
                | tee "$OUT/gpu-sm90-rl.log" ;;
    rl-memory) rl_results
               timeout "${SERVING_TIMEOUT:-540}" python3 benchmarks/rl_memory.py \
                 --out "$RL_JSON" --git-sha "$sha" --logs "$OUT/rl-logs" \
                 ${RL_MEMORY_ARGS:-} 2>&1 | tee "$OUT/rl-memory.log"
               cp "$RL_JSON" "$OUT/rl.json" ;;
    rl-accuracy) rl_results
                 smollm2 || exit 1
                 # The checkpoint in its own process: vLLM forks its engine (DESIGN.md section 2).
                 EPILORA_CACHE=/tmp/epilora-cache timeout 300 python3 -c "import sys;
sys.path.insert(0, 'tools'); from quantize_model_demo import write_bf16_checkpoint as w;
w('/tmp/smollm2-bf16')" 2>&1 | tail -3 || exit 1
                 timeout "${RL_TIMEOUT:-570}" python3 benchmarks/rl_accuracy.py \
                   --model-dir /tmp/smollm2-bf16 --out "$RL_JSON" --git-sha "$sha" \
                   --logs "$OUT/rl-logs" ${RL_ACCURACY_ARGS:-} 2>&1 | tee "$OUT/rl-accuracy.log"
                 cp "$RL_JSON" "$OUT/rl.json" ;;
    equivalence) smollm2 || exit 1
                 # The serving demo on the GPU: it makes the checkpoints and the four adapters,
                 # once while the machine is held (a later call of this step, e.g. for the
                 # systems a call's limit cut off, goes straight to the engines).
                 demo=/tmp/epilora-cache/serve-demo
                 if [ ! -f "$demo/fp8/config.json" ] || [ ! -f "$demo/cowboy/adapter_config.json" ]; then
                   EPILORA_CACHE=/tmp/epilora-cache timeout 420 python3 tools/serve_demo.py \
                     2>&1 | tee "$OUT/serve-demo.log"
                   [ "${PIPESTATUS[0]}" = 0 ] || { echo "the serving demo failed"; exit 1; }
                 fi
                 timeout "${EQUIVALENCE_TIMEOUT:-480}" python3 benchmarks/equivalence.py \
                   --root /tmp/epilora-cache/serve-demo --out "$OUT/equivalence.json" \
                   --git-sha "$sha" --logs "$OUT/equivalence-logs" ${EQUIVALENCE_ARGS:-} 2>&1 \
                   | tee "$OUT/equivalence.log" ;;
    serving) timeout "${SERVING_TIMEOUT:-540}" python3 benchmarks/serving.py \
               --out "$OUT/serving.json" --git-sha "$sha" --logs "$OUT/serving-logs" \
               ${SERVING_ARGS:-} 2>&1 | tee "$OUT/serving.log" ;;
    engine-kernels) timeout "${SERVING_TIMEOUT:-540}" python3 dev/engine_kernels.py \
                      --out "$OUT/engine_kernels.json" ${ENGINE_KERNELS_ARGS:-} 2>&1 \
                      | tee "$OUT/engine_kernels.log" ;;
    prefill-probe) # each system's engine in its own process, under its own limit
                   sample=()
                   for system in ${PROBE_SYSTEMS:-epilora vllm-default}; do
                     [ -n "${PROBE_SAMPLE:-}" ] && sample=(--sample "$OUT/stacks_$system.txt" \
                       --sample-seconds "$PROBE_SAMPLE")
                     timeout "${PROBE_TIMEOUT:-300}" python3 dev/prefill_probe.py \
                       --system "$system" --out "$OUT/prefill_probe_$system.json" "${sample[@]}" \
                       ${PROBE_ARGS:-} \
                       > "$OUT/prefill_probe_$system.log" 2>&1
                     echo "$system exit $?"; grep -E "prompt|wall|sampled|garbage" "$OUT/prefill_probe_$system.log"
                   done | tee "$OUT/prefill_probe.log" ;;
    launch-variants) timeout "${LAYER_TIMEOUT:-300}" python3 dev/launch_variants.py \
                       --out "$OUT/launch_variants.json" ${LAUNCH_VARIANTS_ARGS:-} 2>&1 \
                       | tee "$OUT/launch_variants.log" ;;
    op-overhead) timeout "${OVERHEAD_TIMEOUT:-120}" python3 dev/op_overhead.py \
                   --out "$OUT/op_overhead.json" ${OVERHEAD_ARGS:-} 2>&1 | tee "$OUT/op_overhead.log" ;;
    env:*) export "${step#env:}"; mkdir -p "$OUT"; echo "$step"; continue ;;
    *) echo "unknown step: $step"; exit 2 ;;
  esac
  rc=${PIPESTATUS[0]}
  echo "step $step exit $rc"
  (cd "$BASE_OUT" && find . -type f ! -name results.tar -print0 \
     | xargs -0 -r tar rf results.tar --remove-files)
  status=$(( status || rc ))
done
exit $status
