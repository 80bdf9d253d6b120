#!/bin/bash
# One call on the GPU machine: install the peers' wheels (once per machine), then run the steps in order,
# keeping results in /tmp/bench (it survives between calls while the machine stays warm) and copying them
# to $OUT after each step. A step that would start after DEADLINE seconds is left for the next call.
#
#   bench/gpu_call.sh DEADLINE STEP...   STEP: bench:MODEL[:SCHEDULES] | suite:MODEL:BUDGETS[:SYSTEMS]
#                                        | again:MODEL:BUDGETS:SYSTEMS (replaces their rows) | gputest[:PATH[,PATH...]]
#                                        | calibrate[:bf16] (the rates of the fp32 CPU path, or with :bf16 of the
#                                          bf16 one, in their own process, as a user calibrates once per machine:
#                                          the suite's processes then find them cached)
#                                        | kernel[:THREADS] (bench/cpu_kernel.py --dma: the CPU AdamW kernels
#                                          beside pinned PCIe copies; THREADS default: cores - 1)
#   e.g. bench/gpu_call.sh 440 bench:1.36b:cpu,1,2,3,4,6,8,auto suite:1.36b:whole suite:5.2b:whole
#   DATA_SEED=N: suite steps train on another batch and write results-seedN.jsonl (a repeat on fresh data)
#   ITERS=N: suite steps time N iterations each way (default 5); PEER_ITERS=N: the peers' runs N instead
#   ROUNDS=N: suite steps run their systems N times, alternating; bench.rounds pairs them into rounds.log
#   PHASES=0: suite steps synchronise no iteration (bench.run_system --no-phases), as a loop that never does;
#   PHASES=peers: only ours do not (bench.suite --phases peers: our rows as a loop runs, the peers' breakdown)
#   After each suite step, bench.walls prints its rows' step records (CPU path rate included) into walls.log
#   A system NAME@.ab/REV runs another commit's library and bench (bench/tree.sh REV, then carry .ab): with
#   ROUNDS=N beside plain names, two libraries paired on one machine, e.g.
#   bench/tree.sh ce79ce8; ROUNDS=3 PHASES=peers ITERS=12 bash bench/gpu_call.sh 560 again:1.36b:whole:S,S_bwdfills@.ab/ce79ce8
set -u
# TORCH_EXTENSIONS_DIR: DeepSpeed's CPU Adam op is built (JIT) at its first use; kept in /tmp, the build serves the
# later calls of a warm machine (DeepSpeed's setup took 66-70 s at both sizes in calls 147-148, the build not timed
# apart)
export PYTHONUNBUFFERED=1 DOS_HOST_MEMORY_GB=${DOS_HOST_MEMORY_GB:-120} DOS_CACHE_DIR=/tmp/dos \
       TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions} \
       NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -d /tmp/site/deepspeed ] || ls .whl/*.whl > /dev/null 2>&1 || {
  echo "no peer wheels in .whl/: copy ../shared/wheels/*.whl there and pass carry [\".whl\"]"; exit 1; }
[ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/bench
mkdir -p "$R"
# Killed at the device's time limit, the command still returns what its steps wrote so far (H200 call 18
# lost a whole command: its one step was killed before the copy after it).
trap 'cp $R/*.jsonl $R/*.log "$OUT"/ 2>/dev/null' EXIT
trap 'exit 143' TERM INT
[ -f $R/results.jsonl ] || cp docs/benchmarks/results.jsonl $R/ 2>/dev/null || true
# The host as this machine shows it (once per machine): the CPU path's rate moved 2.1-3.4 G elements/s between
# runs of the same settings (overlap.md, calls 71-75), so keep what might explain it: CPUs, NUMA, THP, memory.
[ -f $R/host.log ] || { lscpu; numactl -H 2>/dev/null; grep -H . /sys/kernel/mm/transparent_hugepage/{enabled,defrag};
                       grep -E 'MemTotal|MemFree|MemAvailable|AnonHugePages|Hugepagesize' /proc/meminfo; } > $R/host.log 2>&1
results=$R/results${DATA_SEED:+-seed$DATA_SEED}.jsonl
deadline=$1
shift
for step in "$@"; do
  IFS=: read -r kind model arg systems <<< "$step"
  left=$((deadline - SECONDS))
  if [ $left -le 0 ]; then echo "deadline: $step not started"; continue; fi
  case $kind in
    bench) python3 -m deep_optimizer_states bench --model "$model" ${arg:+--schedules "$arg"} \
             --out "$R/update-$model.jsonl" 2>&1 | tee -a $R/bench.log ;;
    suite|again) before=$(cat $results 2>/dev/null | wc -l)
             python3 -m bench.suite --models "$model" --budgets "$arg" --systems "${systems:-all}" --warmup 2 \
             --iters ${ITERS:-5} ${PEER_ITERS:+--peer-iters $PEER_ITERS} --rounds ${ROUNDS:-1} --deadline $left --out $results ${DATA_SEED:+--data-seed $DATA_SEED} \
             $([ $kind = again ] && echo --again) --phases $(case ${PHASES:-1} in 0) echo none;; peers) echo peers;; *) echo all;; esac) 2>&1 \
             | tee -a $R/suite.log
             added=$(($(cat $results 2>/dev/null | wc -l) - before))  # this step's rows: their steps' records
             [ $added -gt 0 ] && python3 -m bench.walls --last $added $results --references $R/results.jsonl 2>&1 \
               | tee -a $R/walls.log
             [ "${ROUNDS:-1}" -gt 1 ] && python3 -m bench.rounds $results 2>&1 | tee -a $R/rounds.log ;;
    gputest) tests=${step#gputest}; tests=${tests#:}; tests=${tests//,/ }  # a node id keeps its "::"; commas part paths
             timeout $left python3 -m pytest -q --tb=short -m gpu ${tests:-tests/gpu} 2>&1 | tail -150 > $R/gpu-tests.log
             # a suite cut by the deadline ends mid-line, with no summary: say so (call 109's log did not)
             [ "${PIPESTATUS[0]}" = 124 ] && echo "gputest: cut by the deadline after ${left} s" >> $R/gpu-tests.log
             cat $R/gpu-tests.log ;;
    calibrate) timeout $left python3 -m deep_optimizer_states calibrate ${model:+--bf16-cpu-path} 2>&1 \
                 | tee -a $R/calibrate.log ;;
    kernel) timeout $left python3 -m bench.cpu_kernel --threads "${model:-$(($(nproc) - 1))}" --dma 2>&1 \
              | tee -a $R/cpu-kernel.log | grep '^{' >> $R/cpu-kernel.jsonl ;;
    *) echo "unknown step $step" ;;
  esac
  cp $R/*.jsonl $R/*.log "$OUT"/ 2>/dev/null
done
