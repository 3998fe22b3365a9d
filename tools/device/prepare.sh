#!/usr/bin/env bash
# Prepare `.device/` (git-ignored) for a device call, from the repository root on this machine:
# the vLLM bundle (once), nox and its pure-Python dependencies as wheels (the GPU machine has no
# network and no nox), and wheels of our packages (vLLM finds plugins, pytest its plugin,
# through installed entry points). VARIANTS="ref ..." also builds epilora-kernels from each git
# ref into .device/variants/<ref, /, ~ and ^ as dashes>/ for gpu_kernels.sh's `use:ref` step.
# LEAN=1 leaves out nox, its dependencies and vLLM's tests (about 1 MB): for calls that run
# benchmarks only, where the repository and the bundle come near the 64 MiB a call carries.
set -euo pipefail
[ -s .device/vllm-bundle.tar.xz ] || ../shared/device/make-vllm-bundle
# Afresh: a newer release downloaded beside an older wheel makes the install there fail.
rm -rf .device/wheels
if [ "${LEAN:-0}" != 1 ]; then
  mkdir -p .device/wheels
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform any -d .device/wheels \
    nox==2026.10.20 argcomplete colorlog dependency-groups humanize python-discovery \
    platformdirs filelock attrs packaging==25.0 \
    pytest-xdist==3.8.0 execnet==2.1.2  # the GPU tests in processes (gpu_kernels.sh TESTS_JOBS)
fi
rm -rf .device/dist && uv build --all-packages -q -o .device/dist --wheel
# vLLM 0.26.0's LoRA layer and Punica op tests (its sdist's tests/lora, ~130 KB), which the plugin's
# GPU tests run on FP8 bases (packages/epilora-vllm/tests/vllm_suite.py; setup.sh points there).
# Fetched into the user's cache (vllm_suite.fetch), then copied: with EPILORA_VLLM_TESTS set,
# fetch only reads, so a fresh machine would find nothing.
rm -rf .device/vllm-tests
if [ "${LEAN:-0}" != 1 ]; then
  suite="$(env -u EPILORA_VLLM_TESTS .venv/bin/python -c "import sys; sys.path.insert(0, 'packages/epilora-vllm/tests')
import vllm_suite; print(vllm_suite.fetch())" | tail -n 1)"  # vLLM logs to stdout
  cp -r "$suite" .device/vllm-tests
fi
rm -rf .device/variants
for ref in ${VARIANTS:-}; do
  dir=".device/variants/${ref//[\/~^]/-}" tree="$(mktemp -d)"
  git worktree add -q --detach "$tree" "$ref"
  (cd "$tree" && uv build --package epilora-kernels -q -o "$OLDPWD/$dir" --wheel)
  git -C "$tree" rev-parse HEAD > "$dir/sha"
  git worktree remove --force "$tree"
done
du -sh .device/*
# What a call carries (tracked files and .device, as the disk holds them) against its limit.
tracked=$(git ls-files -z | xargs -0 stat -c %b,%B 2>/dev/null \
          | awk -F, '{ kib += $1 * $2 / 1024 } END { printf "%d", kib }' || true)
carried=$(( ${tracked:-0} + $(du -sk .device | cut -f1) ))
echo "a call carries about $(( carried / 1024 )) MiB of 64 with .device"
(( carried < 64 * 1024 )) || echo "prepare.sh: over the 64 MiB a call carries: LEAN=1 drops about 1 MB" >&2
