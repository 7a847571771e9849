#!/usr/bin/env bash
# GPU benchmark: random-init Qwen3-0.6B- and Qwen3-8B-shaped models (no download), the seed-like
# workload at full length, bf16, flex_attention (block-sparse), LoRA. Prints and writes one JSON
# file per model (MFU, tokens/s, peak memory, ratio to the reference one-row-per-step trainer),
# plus the serve benchmark. Needs PyTorch, transformers and peft (+ this repo's src/); the few other
# packages artrl imports are installed from carried wheels when missing (benchmarks/gpu_wheels.sh).
#
# With 2 or more GPUs it also runs the training-worker tests (tests/test_distributed.py on CUDA,
# NCCL, float32: the adapter of 2 workers equals one process's, a killed worker, resume across
# worker counts, a second "machine" through torchrun) and `bench train --workers N` for N = 2 and
# N = all GPUs (tokens/s against one GPU, scaling efficiency, each rank's computed tokens).
#
#   benchmarks/gpu.sh OUTDIR              on a CUDA machine (about 5-8 minutes on one H200;
#                                         the worker tests and benches add about 10 on several)
#   benchmarks/gpu.sh OUTDIR --cpu-smoke  tiny model, small scale: checks the script on a CPU
set -euo pipefail
out=${1:?usage: benchmarks/gpu.sh OUTDIR [--cpu-smoke]}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
export PYTHONPATH="$here/../src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
workload=${WORKLOAD:-$here/workloads/seed-like.json}
if [[ "${2:-}" == "--cpu-smoke" ]]; then
  models=(artrl/tiny); scale=0.05
  train_args=(--device cpu)
  serve_args=(--model artrl/tiny --device cpu --requests 8 --concurrency 4 --max-tokens 8)
  workers_model=artrl/tiny; worker_counts=(2); test_device=cpu; test_select=(-m "not slow")
else
  models=(random:qwen3-0.6b random:qwen3-8b); scale=1
  train_args=(--device cuda --gradient-checkpointing --max-tokens-per-microbatch 32768)
  serve_args=(--model random:qwen3-0.6b --device cuda --requests 64 --concurrency 16 --max-tokens 64)
  workers_model=${WORKERS_MODEL:-random:qwen3-8b}; test_device=cuda; test_select=()
  ngpu=$("$py" -c "import torch; print(torch.cuda.device_count())")
  worker_counts=()
  if (( ngpu >= 2 )); then worker_counts=(2); fi
  if (( ngpu > 2 )); then worker_counts+=("$ngpu"); fi
fi
# artrl also imports the packages in gpu-requirements.txt; a GPU image without internet may lack them:
# install them from wheels carried along (benchmarks/gpu_wheels.sh makes the folder).
reqs=$here/gpu-requirements.txt
modules=$(grep -v '^#' "$reqs" | sed 's/[<>=].*//' | paste -sd, -)
if ! "$py" -c "import $modules" 2>/dev/null; then
  wheels=${GPU_WHEELS:-$here/../.gpu-wheels}
  if [[ ! -d "$wheels" ]]; then
    echo "gpu.sh: $py lacks one of $modules and there is no wheel folder $wheels;" \
         "run benchmarks/gpu_wheels.sh where the package registry is reachable and carry .gpu-wheels" >&2
    exit 2
  fi
  "$py" -m pip install --quiet --no-index --find-links "$wheels" -r "$reqs"
fi
test_reqs=$here/gpu-test-requirements.txt
if (( ${#worker_counts[@]} )) && ! "$py" -c "import pytest, hypothesis" 2>/dev/null; then
  wheels=${GPU_WHEELS:-$here/../.gpu-wheels}
  if [[ -d "$wheels" ]]; then
    "$py" -m pip install --quiet --no-index --find-links "$wheels" -r "$test_reqs" || true
  fi
fi
"$py" - <<'PY' | tee "$out/env.json"
import json, platform, torch, transformers, peft
info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "peft": peft.__version__, "cuda": torch.cuda.is_available()}
if torch.cuda.is_available():
    info["device_name"] = torch.cuda.get_device_name(0)
print(json.dumps(info))
PY
for m in "${models[@]}"; do
  name=${m//[:\/]/-}
  "$py" -m artrl.cli bench train --workload "$workload" --scale "$scale" --model "$m" "${train_args[@]}" \
    | tee "$out/train-$name.json"
done
"$py" -m artrl.cli bench serve "${serve_args[@]}" | tee "$out/serve.json"
# training workers (docs/distributed.md): only where there are at least 2 devices to put them on
if (( ${#worker_counts[@]} )); then
  if "$py" -c "import pytest, hypothesis" 2>/dev/null; then
    set +e  # run the benches below even when a test fails; the exit code says so at the end
    ARTRL_TEST_DEVICE=$test_device "$py" -m pytest -q -p no:cacheprovider ${test_select[@]+"${test_select[@]}"} \
      "$here/../tests/test_distributed.py" 2>&1 | tee "$out/test-distributed.txt"
    test_rc=${PIPESTATUS[0]}
    set -e
  else
    echo "gpu.sh: pytest or hypothesis missing (carry them: benchmarks/gpu_wheels.sh); worker tests skipped" \
      | tee "$out/test-distributed.txt"
    test_rc=0
  fi
  for n in "${worker_counts[@]}"; do
    "$py" -m artrl.cli bench train --workload "$workload" --scale "$scale" --model "$workers_model" \
      "${train_args[@]}" --workers "$n" | tee "$out/train-workers-$n.json"
  done
  if (( test_rc != 0 )); then echo "gpu.sh: the worker tests failed (see $out/test-distributed.txt)" >&2; exit 1; fi
else
  echo "gpu.sh: fewer than 2 GPUs; the training-worker tests and bench need 2 or more" >&2
fi
