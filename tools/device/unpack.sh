#!/usr/bin/env bash
# Unpack a gpu_kernels.sh call's results.tar (and copy its loose files) into a folder here:
#   tools/device/unpack.sh /work/.device/<n> DEST
set -euo pipefail
src="$1" dest="$2"
mkdir -p "$dest" && dest="$(cd "$dest" && pwd)"  # absolute: the copy below runs in $src
[ -f "$src/results.tar" ] && tar xf "$src/results.tar" -C "$dest"
(cd "$src" && find . -type f ! -name results.tar -exec cp --parents {} "$dest" \;)
chmod -R u+w "$dest"
find "$dest" -type f | sort
