#!/usr/bin/env bash
# Long GPU work in device calls of at most 10 minutes: run lanes of commands in the background from a private copy of
# the tree, then poll. Session 26's way (PERFORMANCE.md, twenty-fifth pass): nothing a later call syncs or carries can
# touch the copy, and results come back packed in at most 8 files.
#   bash experiments/gpu_lanes.sh start LANE_FILE...   # first call: copies the tree to /tmp/tree, starts lane i on GPU i
#   bash experiments/gpu_lanes.sh poll SECONDS         # later calls, back to back (the machine goes after 30 s idle)
# A lane file holds one command per line, run in order from /tmp/tree with CUDA_VISIBLE_DEVICES set to the lane's GPU
# (a line may reset it, e.g. to 0,1 for a two-GPU test; blank and # lines are skipped). Each line's exit status goes
# to /tmp/lanes/stages; its output to /tmp/lanes/<lane>.<line>.log. Write results under $RES (/tmp/lanes/res): poll
# packs $RES and the logs into $OUT/res.tgz and $OUT/logs.tgz. Set RESEARCH_LM_COMMIT / BENCH_COMMIT (the tree
# on the device may carry a stale .git) and PYTHONPATH=/tmp/tree:<wheels> before `start`.
set -uo pipefail
L=/tmp/lanes
case ${1:-} in
  start)
    shift
    mkdir -p /tmp/tree $L/res && cp -a . /tmp/tree/ && rm -rf /tmp/tree/.whl || exit 1
    i=0
    for lane in "$@"; do  # setsid: the lanes outlive this call
      cp "$lane" $L/lane$i && setsid nohup bash /tmp/tree/experiments/gpu_lanes.sh lane $i < /dev/null > /dev/null 2>&1 &
      i=$((i + 1))
    done
    sleep 20; cat $L/stages 2>/dev/null; nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv 2>/dev/null ;;
  lane)  # (internal) lane $2's lines in order; a lane started again forgets its old "done" (poll counts them)
    sed -i "/ lane $2 done$/d" $L/stages 2>/dev/null
    cd /tmp/tree && n=0
    while IFS= read -r line; do
      case "$line" in ''|'#'*) continue ;; esac
      n=$((n + 1))
      CUDA_VISIBLE_DEVICES=$2 RES=$L/res bash -c "$line" > $L/lane$2.$n.log 2>&1
      rc=$?  # (before $(date) resets $?)
      echo "$(date +%T) lane $2 line $n rc $rc : ${line:0:100}" >> $L/stages
    done < $L/lane$2
    echo "$(date +%T) lane $2 done" >> $L/stages ;;
  poll)
    end=$(( $(date +%s) + ${2:-60} )); lanes=$(ls $L/lane? | wc -l)
    pack() { tar czf "$OUT/res.tgz" -C $L res && tar czf "$OUT/logs.tgz" -C $L $(cd $L && ls *.log stages 2>/dev/null); }
    # (cat | grep -c: 0 while no line has finished yet and the stages file does not exist)
    i=0
    while [ "$(date +%s)" -lt "$end" ] && [ "$(cat $L/stages 2>/dev/null | grep -c ' done$')" -lt "$lanes" ]; do
      sleep 5; i=$((i + 1))
      # packed every minute too: a call cut short (the session's device time ran out) still returns what $OUT
      # holds, and session 28 lost a whole lane of results to a poll that packed only at its end
      [ $((i % 12)) = 0 ] && pack
    done
    cat $L/stages; nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
    pack ;;
  *) echo "usage: gpu_lanes.sh start LANE_FILE... | poll SECONDS" >&2; exit 2 ;;
esac
