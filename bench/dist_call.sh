#!/bin/bash
# One call on a multi-GPU machine (nvidia-h200-x2): peers' wheels installed once, then the steps in order,
# results kept in /tmp/dist (it survives between calls while the machine stays warm) and copied to $OUT
# after each step. A step that would start after DEADLINE seconds is left for the next call, and so is a run
# that its last recorded run says would not end by then (bench/dist_estimate.py).
#
#   bench/dist_call.sh DEADLINE STEP...
#   STEP: run:SYSTEM:MODEL:RANKS[:SWEEP] | gputest[:REPEATS[:FILES]] | startup:SIZES:PRESETS | topo
#   FILES: comma-separated test paths (default: tests/gpu and tests/test_host_memory.py)
#   e.g. bench/dist_call.sh 560 gputest run:ours:5.2b:2:cpu,gpu,2 run:fsdp2_offload:5.2b:2 run:deepspeed:5.2b:2
#   SWEEP (ours only): fixed schedules timed in the same job after the run, comma-separated
#   WARMUP, ITERS, SLOTS (environment): iterations per run (2, 5) and ours' staging slots (2)
#
# Threads: torchrun sets OMP_NUM_THREADS=1 for every rank. The peers get what their docs recommend,
# OMP_NUM_THREADS = cores / ranks; ours runs with torchrun's default and picks its own count.
set -u
export PYTHONUNBUFFERED=1 DOS_CACHE_DIR=/tmp/dos NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
       NVSHMEM_DISABLE_NVLS=1
[ -d /tmp/site/deepspeed ] || ls .whl/*.whl > /dev/null 2>&1 || {
  echo "no peer wheels in .whl/: copy ../shared/wheels/*.whl there and pass carry [\".whl\"]"; exit 1; }
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/dist
mkdir -p "$R"
# Killed at the device's time limit, the command still returns what its steps wrote so far (H200 call 18
# lost a whole command: its one step was killed before the copy after it).
trap 'cp $R/*.jsonl $R/*.log "$OUT"/ 2>/dev/null' EXIT
trap 'exit 143' TERM INT
cores=$(nproc)
deadline=$1
shift
for step in "$@"; do
  IFS=: read -r kind a b c d <<< "$step"
  left=$((deadline - SECONDS))
  if [ $left -le 0 ]; then echo "deadline: $step not started"; continue; fi
  case $kind in
    run)
      need=$(python3 -m bench.dist_estimate "$a" "$b" "$c" "${WARMUP:-2}" "${ITERS:-5}" "${d:-}" 2>/dev/null || echo 0)
      if [ "${need:-0}" -gt "$left" ]; then
        echo "deadline: $step not started (about $need s needed by its last recorded run, $left s left)"; continue
      fi
      started=$SECONDS
      threads=""
      [ "${a#ours}" = "$a" ] && threads="OMP_NUM_THREADS=$((cores / c))"
      log=$R/$a-$b-$c-slots${SLOTS:-2}.log
      env $threads timeout $left torchrun --standalone --nproc_per_node "$c" -m bench.dist_run --system "$a" \
          --model "$b" --warmup "${WARMUP:-2}" --iters "${ITERS:-5}" --sweep "${d:-}" --slots "${SLOTS:-2}" > "$log" 2>&1
      rc=$?
      results=$(tr '\r' '\n' < "$log" | grep '^RESULT ')
      if [ -n "$results" ]; then
        sed 's/^RESULT //' <<< "$results" >> $R/dist.jsonl
      else
        echo "{\"system\": \"$a\", \"model\": \"$b\", \"ranks\": $c, \"status\": \"no result (rc $rc)\"}" >> $R/dist.jsonl
      fi
      echo "rc=$rc $step ($((SECONDS - started)) s)"
      if [ -n "$results" ]; then cut -c1-700 <<< "$results"; else tail -5 "$log"; fi ;;
    topo) { nvidia-smi topo -m; lscpu | grep -iE "^(socket|numa|model name|core|thread)"; } 2>&1 | tee $R/topo.log ;;
    gputest) files=${b:-tests/gpu,tests/test_host_memory.py}
             DOS_GPU_REPEATS=${a:-2} timeout $left python3 -m pytest -q -m gpu ${files//,/ } 2>&1 \
               > $R/gpu-tests.log; grep -E "^(FAILED|ERROR)|passed|failed" $R/gpu-tests.log | tail -15 ;;
    startup) timeout $left python3 -m bench.startup --sizes "$a" --single-gb 4 --optimizer "$b" \
               --out $R/startup.jsonl 2>&1 | tee $R/startup.log ;;
    *) echo "unknown step $step" ;;
  esac
  cp $R/*.jsonl $R/*.log "$OUT"/ 2>/dev/null
done
