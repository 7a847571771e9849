#!/usr/bin/env bash
# Download, on a machine with package-registry access, the wheels that a GPU machine without
# internet lacks for `benchmarks/gpu.sh`: artrl imports the packages in gpu-requirements.txt,
# which an image holding only PyTorch, transformers and peft may not have. gpu.sh installs them
# from this folder (pip --no-index) when they are missing there, and the test packages of
# gpu-test-requirements.txt for the distributed tests it runs.
#
#   benchmarks/gpu_wheels.sh [DIR]          default DIR: .gpu-wheels (git-ignored; carry it to the GPU machine)
#   benchmarks/gpu_wheels.sh --peer [DIR]   also Liger Kernel and TRL with the few packages they add to such an
#                                           image (gpu-peer-requirements.txt, without dependencies; pyarrow
#                                           is most of their size), for the kernel A/B and the TRL stages
#
# Wheels for CPython 3.11 and 3.12 on x86-64 Linux; PYTHON_VERSIONS="3.12 3.13" to choose others
# (PEER_PYTHON_VERSIONS for the peer wheels, default: the Python running this script).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
peer=0
if [[ "${1:-}" == "--peer" ]]; then peer=1; shift; fi
dir=${1:-$here/../.gpu-wheels}
mkdir -p "$dir"
py=${PYTHON:-python3}
platforms=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
for v in ${PYTHON_VERSIONS:-3.11 3.12}; do
  "$py" -m pip download --quiet --dest "$dir" --only-binary=:all: --python-version "$v" "${platforms[@]}" \
    -r "$here/gpu-requirements.txt" -r "$here/gpu-test-requirements.txt" \
    2> >(grep -v "is ignored: it is neither" >&2)
done
if (( peer )); then
  for v in ${PEER_PYTHON_VERSIONS:-$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}; do
    "$py" -m pip download --quiet --no-deps --dest "$dir" --only-binary=:all: --python-version "$v" \
      "${platforms[@]}" -r "$here/gpu-peer-requirements.txt" 2> >(grep -v "is ignored: it is neither" >&2)
  done
fi
ls "$dir" | wc -l | xargs echo "wheels in $dir:"
du -sh "$dir"
