#!/usr/bin/env bash
# Prepare `.device/` (git-ignored) for a device call, from the repository root on this machine:
# the vLLM bundle (once), nox and its pure-Python dependencies as wheels (the GPU machine has no
# network and no nox), and wheels of our packages (vLLM finds plugins, pytest its plugin,
# through installed entry points).
set -euo pipefail
[ -s .device/vllm-bundle.tar.xz ] || ../shared/device/make-vllm-bundle
mkdir -p .device/wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform any -d .device/wheels \
  nox==2026.10.20 argcomplete colorlog dependency-groups humanize python-discovery \
  platformdirs filelock attrs packaging==25.0
rm -rf .device/dist && uv build --all-packages -q -o .device/dist --wheel
du -sh .device/*
