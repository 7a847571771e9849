#!/usr/bin/env bash
# GPU benchmark, staged: everything artrl claims about speed on one GPU, random-init Qwen3-0.6B- and
# Qwen3-8B-shaped models (no download), the seed-like workload, bf16. GPU_SH_SECONDS (default 540)
# caps one run; GPU_SH_STAGES="env long-context ..." runs only the stages named (by the first word of
# the stage names below), so the whole set can be taken in several runs of under 10 minutes each: on the
# first H200 run (2026-12-04, benchmarks/results/2026-12-04-h200/) the budgets below were too small for
# every stage from env on but long-context, and 470 s reached no further than trl.
#
#   stage            what                                                            file (JSON lines)
#   env              versions, device, free memory, which optional kernels import   env.json
#   long-context     bench memory --context: one RL call on a long trajectory pair,  long-context.json
#                    plan beside peak (0.6B; 8B with its checkpointed inputs offloaded
#                    to host memory and without)
#   cap              a call near the longest the plan allows: the 8B shape on the GPU capped at   cap.json
#                    24 GB (as a 24 GB card), a pair too long for it (refused before it trains,
#                    naming the length that fits), then a pair of that length
#   train-0.6b       bench train at --scale 1, ours vs reference, + a profile table  train-qwen3-0.6b.json
#   train-8b         the same at the 8B shape (reference: its first rows only)       train-qwen3-8b.json
#   kernels          A/B of the kernel switches on the 0.6B shape, ours only, short  kernels.json
#                    (the --compile-layers arm runs after the demo, then the serve A/B:
#                    --static-cache and --merge-lora off on the 0.6B shape, into serve.json)
#   trl              TRL's SFTTrainer vs train_sft at both shapes (trl_peer.py)      trl.json
#   serve            bench serve, LoRA on: 64 concurrent, then 8 one at a time, both  serve.json
#   demo             artrl demo --json (4 RL steps on a GPU)                         demo.json
#   pipeline         bench.py pipeline: the synchronous loop vs PipelineTrainer, tools   pipeline.json
#                    that take time (one tool latency; the JSON says rollout/train)
#   workers          (2+ GPUs only) distributed tests and bench train --workers N    workers.json
#
# Each stage runs under its own `timeout` (its budget, or what is left of the cap); one that
# fails or times out adds a line with its exit code and stderr tail to its file, and the next
# stage runs. Each figure is printed as its stage finishes. Budgets (seconds, GPU): env 60,
# long-context 70+2x90, cap 60+90, train-0.6b 180, train-8b 240, kernels 2x15, trl 35+45, serve 45+60, demo 60, pipeline 90, compiled arm
# what is left (up to 60)
# (GPU_SH_BUDGET_FACTOR multiplies them: 8 in --cpu-smoke).
#
#   benchmarks/gpu.sh OUTDIR              on a CUDA machine
#   benchmarks/gpu.sh OUTDIR --cpu-smoke  the same stages on the tiny model on a CPU (checks the script)
#
# Needs PyTorch, transformers and peft (+ this repo's src/). What artrl imports besides is
# installed from carried wheels when missing (benchmarks/gpu_wheels.sh); so are Liger Kernel and
# TRL (gpu_wheels.sh --peer): without them the kernel A/B has no Liger arm and the trl stage
# records that TRL is missing.
set -uo pipefail
out=${1:?usage: benchmarks/gpu.sh OUTDIR [--cpu-smoke]}
mode=${2:-}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
export PYTHONPATH="$here/../src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
workload=${WORKLOAD:-$here/workloads/seed-like.json}
wheels=${GPU_WHEELS:-$here/../.gpu-wheels}
start=$SECONDS
failed=0

# --------------------------------------------------------------------------------------- settings
if [[ "$mode" == "--cpu-smoke" ]]; then
  # a small CPU, maybe shared: every budget x GPU_SH_BUDGET_FACTOR (default 8), the whole run capped at 3600 s
  cap=${GPU_SH_SECONDS:-3600}; factor=${GPU_SH_BUDGET_FACTOR:-8}
  small=artrl/tiny; large=artrl/tiny; dev=cpu
  train_small=(--scale 0.05 --profile --profile-micro-batches 2)
  train_large=(--scale 0.05 --reference-steps 2)
  ab_scale=0.05
  ab_variants=("default" "--gradient-checkpointing" "--logprob-chunk-size 256")
  ab_last=()  # compiling on a CPU takes minutes
  trl_small=(--trajectories 8 --batch-size 4 --prompt-words 20 --completion-words 20)
  trl_large=(--trajectories 8 --batch-size 4 --prompt-words 10 --completion-words 10)
  serve_many=(--requests 8 --concurrency 8 --max-tokens 8 --sequential-requests 2)
  demo_args=(--quick)
  pipeline_args=(--steps 3 --groups-per-step 2 --rollouts-per-group 2 --turns 2 --tool-latency 0.1 --max-tokens 4
                 --prompt-words 20 --result-words 10)
  long_small=(--context 256 --layout completion)
  long_large=(--context 256 --layout completion --gradient-checkpointing)
  long_arms=("")  # offloading is CUDA's
  cap_args=(--context 256 --layout completion --gradient-checkpointing)  # no cap on a CPU: the plumbing only
  cap_longest=512
  serve_ab=()  # the switches are CUDA's
  ngpu=0
else
  cap=${GPU_SH_SECONDS:-540}; factor=${GPU_SH_BUDGET_FACTOR:-1}
  small=random:qwen3-0.6b; large=random:qwen3-8b; dev=cuda
  # one profiled micro-batch: on the second H200 run the profile of 4 (about 68k tokens each) outlasted what was left
  # of the stage's 180 s after a 31.6 s timed call, and the reference mode never started
  train_small=(--scale 1 --profile --profile-micro-batches 1)
  train_large=(--scale 1 --reference-steps 12 --profile --profile-micro-batches 2)
  ab_scale=0.25
  # the defaults (memory-aware budget and checkpointing, Liger when it imports, no compile) against each switch;
  # the compiled arm runs last (its compile time is the least predictable)
  ab_variants=("default" "--no-liger-kernel")
  ab_last=("--compile-layers")
  trl_small=(--trajectories 48 --batch-size 16 --prompt-words 300 --completion-words 300)
  trl_large=(--trajectories 16 --batch-size 8 --prompt-words 300 --completion-words 300 --trl-per-device 4)
  serve_many=(--requests 64 --concurrency 64 --max-tokens 64 --sequential-requests 8)
  demo_args=(--rl-steps 4)  # SFT warm-up and 4 RL steps: the split between rollouts and training, in budget
  # both arms, 6 train calls each of 8 groups x 8 rollouts, 3 turns of 32 tokens with a 0.5 s tool after each
  pipeline_args=(--steps 6 --groups-per-step 8 --rollouts-per-group 8 --turns 3 --tool-latency 0.5 --max-tokens 32
                 --prompt-words 200 --result-words 100)
  # one trajectory pair, every token trained: 0.6B at 2 x 32k tokens (checkpointing and offloading as the plan
  # chooses), 8B at 2 x 16k with checkpointing, its layers' inputs offloaded to host memory and kept on the GPU
  long_small=(--dtype bfloat16 --context 32768 --layout completion)
  long_large=(--dtype bfloat16 --context 16384 --layout completion --gradient-checkpointing)
  long_arms=("--offload-activations" "--no-offload-activations")
  # each answer its own row (the shared prompt is short): 2 x 24,576 is over what 24 GB fits a row (18,944 tokens
  # measured on 2026-12-04; 2 x 16,384 trained in two micro-batches)
  cap_args=(--gpu-memory-gb 24 --dtype bfloat16 --context 24576 --layout completion)
  cap_longest=1000000
  serve_ab=("--static-cache" "--merge-lora off")
  ngpu=$("$py" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
fi
tag() { local m=${1#random:}; echo "${m//[:\/]/-}"; }

# ------------------------------------------------------------------------- packages from wheels
# artrl's own imports (gpu-requirements.txt) are required; Liger Kernel and TRL (gpu-peer-requirements.txt)
# are optional and installed without their dependencies (torch, triton, transformers, accelerate are the image's).
reqs=$here/gpu-requirements.txt
modules=$(grep -v '^#' "$reqs" | sed 's/[<>=].*//' | paste -sd, -)
if ! "$py" -c "import $modules" 2>/dev/null; then
  if [[ ! -d "$wheels" ]]; then
    echo "gpu.sh: $py lacks one of $modules and there is no wheel folder $wheels;" \
         "run benchmarks/gpu_wheels.sh where the package registry is reachable and carry .gpu-wheels" >&2
    exit 2
  fi
  "$py" -m pip install --quiet --no-index --find-links "$wheels" -r "$reqs"
fi
if [[ -d "$wheels" ]] && ! "$py" -c "import trl, datasets, liger_kernel" 2>/dev/null; then
  # one at a time: a package the image has already (pyarrow, pandas) need not be in the folder, and one that is
  # missing must not keep the others out
  while read -r req; do
    "$py" -m pip install --quiet --no-index --no-deps --find-links "$wheels" "$req" 2>/dev/null \
      || echo "gpu.sh: optional peer package $req is not in $wheels (gpu_wheels.sh --peer)" >&2
  done < <(grep -v '^#' "$here/gpu-peer-requirements.txt" | grep .)
fi

# ----------------------------------------------------------------------------------------- stages
# wanted NAME: whether GPU_SH_STAGES (when set) names the stage, by its first word
wanted() { [[ -z "${GPU_SH_STAGES:-}" || " $GPU_SH_STAGES " == *" ${1%% *} "* ]]; }
# stage NAME BUDGET FILE CMD...: run CMD under timeout min(BUDGET, time left), record it (gpu_record.py)
stage() {
  local name=$1 budget=$(( $2 * factor )) file=$3; shift 3
  wanted "$name" || return 0
  local left=$(( cap - (SECONDS - start) ))
  local limit=$(( budget < left ? budget : left ))
  local so se t0 rc
  so=$(mktemp); se=$(mktemp)
  if (( limit < 3 )); then
    echo '{"skipped": "the run'"'"'s time cap was reached"}' > "$so"; rc=0
  else
    t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$so" 2> "$se"
    rc=$?
  fi
  "$py" "$here/gpu_record.py" "$name" "$out/$file" "$rc" "$(( SECONDS - ${t0:-$SECONDS} ))" "$so" "$se"
  (( rc == 0 )) || failed=$(( failed + 1 ))
  rm -f "$so" "$se"
}
for f in env long-context cap train-$(tag $small) train-$(tag $large) kernels trl serve demo pipeline workers; do
  [[ -z "${GPU_SH_STAGES:-}" ]] && rm -f "$out/$f.json"  # a run of some stages adds to what earlier runs wrote
done
cli=("$py" -m artrl.cli)

stage env 60 env.json "$py" - <<'PY'
import importlib.util, json, platform, torch, transformers, peft
info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "peft": peft.__version__, "cuda": torch.cuda.is_available(),
        "liger_kernel": importlib.util.find_spec("liger_kernel") is not None,
        "trl": importlib.util.find_spec("trl") is not None,
        "flash_attn": importlib.util.find_spec("flash_attn") is not None}
if torch.cuda.is_available():
    free, total = torch.cuda.mem_get_info()
    info.update(device_name=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
                free_gb=round(free / 1e9, 1), total_gb=round(total / 1e9, 1))
print(json.dumps(info))
PY

# long trajectories (docs/performance.md, "Long trajectories"): the plan beside the measured peak, offloading's
# price and saving
stage "long-context $(tag $small)" 70 long-context.json "${cli[@]}" bench memory --model "$small" --device $dev \
  "${long_small[@]}"
for v in "${long_arms[@]}"; do
  # shellcheck disable=SC2086  # a variant is one flag, or none
  stage "long-context $(tag $large) $v" 90 long-context.json "${cli[@]}" bench memory --model "$large" \
    --device $dev "${long_large[@]}" $v
done

# a call near the longest the plan allows (docs/performance.md, "The planned longest context on a GPU"): refused
# first, then at the length the refusal named (or, where the first call fitted, the length its budget allowed)
stage "cap $(tag $large) too long" 60 cap.json "${cli[@]}" bench memory --model "$large" --device $dev "${cap_args[@]}"
if wanted cap; then
  fit=$("$py" -c 'import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
last = lines[-1] if lines else {}
print(last.get("fit") or (last.get("context") or {}).get("fit_tokens") or 0)' "$out/cap.json" 2>/dev/null || echo 0)
  # the pair shares a short prompt: each answer is a row of its own (two rows of about the fit go to two
  # micro-batches), so each answer is the fit less the prompt's tokens
  each=$(( fit - 48 )); (( each > cap_longest )) && each=$cap_longest
  if (( each > 64 )); then
    stage "cap $(tag $large) at the fit" 90 cap.json "${cli[@]}" bench memory --model "$large" --device $dev \
      "${cap_args[@]}" --context "$each"  # the later --context wins
  fi
fi

stage train-0.6b 180 "train-$(tag $small).json" \
  "${cli[@]}" bench train --workload "$workload" --model "$small" --device $dev "${train_small[@]}"
stage train-8b 240 "train-$(tag $large).json" \
  "${cli[@]}" bench train --workload "$workload" --model "$large" --device $dev "${train_large[@]}"

for v in "${ab_variants[@]}"; do
  # shellcheck disable=SC2086  # a variant is a few words of flags
  stage "kernels ${v}" 15 kernels.json "${cli[@]}" bench train --workload "$workload" --model "$small" \
    --device $dev --scale $ab_scale --only ours $( [[ $v == default ]] || echo $v )
done

stage "trl $(tag $small)" 35 trl.json "$py" "$here/trl_peer.py" --model "$small" --device $dev "${trl_small[@]}"
stage "trl $(tag $large)" 45 trl.json "$py" "$here/trl_peer.py" --model "$large" --device $dev "${trl_large[@]}"

# 64 concurrent requests, then 8 of them one at a time (the ratio; 64 one at a time would not fit a slow engine)
stage "serve $(tag $small)" 45 serve.json "${cli[@]}" bench serve --model "$small" --device $dev --lora "${serve_many[@]}"
stage "serve $(tag $large)" 60 serve.json "${cli[@]}" bench serve --model "$large" --device $dev --lora "${serve_many[@]}"

stage demo 60 demo.json "${cli[@]}" demo --model "$small" --device $dev --json ${demo_args[@]+"${demo_args[@]}"}

# the synchronous RL loop against PipelineTrainer on the same model and work (docs/performance.md, Pipelined RL)
stage pipeline 90 pipeline.json "$py" "$here/bench.py" pipeline --model "$small" --device $dev "${pipeline_args[@]}"

for v in ${ab_last[@]+"${ab_last[@]}"}; do
  stage "kernels $v" 60 kernels.json "${cli[@]}" bench train --workload "$workload" --model "$small" \
    --device $dev --scale $ab_scale --only ours $v
done

# the built-in engine's GPU switches against their defaults, in what is left of the cap (docs/engines.md)
for v in ${serve_ab[@]+"${serve_ab[@]}"}; do
  # shellcheck disable=SC2086  # a variant is a few words of flags
  stage "serve $(tag $small) $v" 40 serve.json "${cli[@]}" bench serve --model "$small" --device $dev --lora \
    "${serve_many[@]}" $v
done

# training workers (docs/distributed.md): only where there are at least 2 devices, outside the time cap
if (( ngpu >= 2 )); then
  cap=$(( SECONDS - start + 1200 ))
  if "$py" -c "import pytest, hypothesis" 2>/dev/null || { [[ -d "$wheels" ]] && "$py" -m pip install --quiet \
      --no-index --find-links "$wheels" -r "$here/gpu-test-requirements.txt"; }; then
    stage "workers tests" 600 workers.json env ARTRL_TEST_DEVICE=cuda "$py" -m pytest -q -p no:cacheprovider \
      "$here/../tests/test_distributed.py"
  fi
  counts=(2); (( ngpu > 2 )) && counts+=("$ngpu")
  for n in "${counts[@]}"; do
    stage "workers $n" 300 workers.json "${cli[@]}" bench train --workload "$workload" --scale 1 \
      --model "$large" --device cuda --gradient-checkpointing --max-tokens-per-microbatch 32768 --workers "$n"
  done
fi

echo "gpu.sh: $(( SECONDS - start )) s; $failed stage(s) failed or timed out; results in $out:" >&2
ls "$out" >&2
exit $(( failed > 0 ))
