#!/usr/bin/env bash
# stop.sh - stop the cluster that tools/slurm-dev/start.sh started: exactly its daemons, by pid file.
#
#   tools/slurm-dev/stop.sh              # idempotent: nothing running -> says so, exits 0
#   SLURM_WIPE=1 tools/slurm-dev/stop.sh # also delete state/spool/logs/db (next start: job ids from 1)
set -uo pipefail
PREFIX=${SLURM_PREFIX:-${TMPDIR:-/tmp}/hpcrl-slurm}
RUN=$PREFIX/run
export SLURM_CONF=$PREFIX/etc/slurm.conf
t_start=$(date +%s%N)
elapsed() { local ms=$(( ($(date +%s%N) - t_start) / 1000000 )); printf '%d.%03d' $((ms / 1000)) $((ms % 1000)); }
stopped=0
# A pid file can outlive its daemon (reboot, crash) and its pid be reused: only signal our daemons.
ours() { case "$(cat "/proc/$1/comm" 2>/dev/null)" in slurmd|slurmctld|slurmdbd|mariadbd|mysqld|munged) return 0;; esac; return 1; }

# Stop a group of daemons together (each takes ~2 s to exit; one after the other added up to 14 s).
stop_group() {  # pidfile...
  local pf pid pids=() names=()
  for pf in "$@"; do
    [ -s "$pf" ] || continue
    pid=$(cat "$pf")
    if kill -0 "$pid" 2>/dev/null && ours "$pid"; then kill -TERM "$pid"; pids+=("$pid"); names+=("$(basename "$pf" .pid)=$pid"); fi
    rm -f "$pf"
  done
  [ ${#pids[@]} = 0 ] && return 0
  for _ in $(seq 100); do
    local left=0; for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && left=1; done
    [ $left = 0 ] && break; sleep 0.1
  done
  for pid in "${pids[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then echo "pid $pid still alive after 10 s: SIGKILL"; kill -KILL "$pid"; fi
  done
  echo "stopped ${names[*]} at $(elapsed) s"
  stopped=$((stopped + ${#pids[@]}))
}

# Running jobs are children of slurmstepd, which outlives slurmd: cancel them while slurmctld is up.
if [ -s "$RUN/slurmctld.pid" ] && ours "$(cat "$RUN/slurmctld.pid")"; then
  scancel --quiet --user=root 2>/dev/null || true
  for _ in $(seq 50); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
fi
# slurmds before slurmctld: a slurmd whose controller is gone takes ~10 s to stop; slurmctld before
# slurmdbd, which it flushes accounting records to.
stop_group "$RUN"/slurmd-*.pid
stop_group "$RUN/slurmctld.pid"
stop_group "$RUN/slurmdbd.pid"
stop_group "$RUN/mysqld.pid" "$RUN/munge/munged.pid"

if [ "${SLURM_WIPE:-0}" = 1 ]; then
  rm -rf "$PREFIX/state" "$PREFIX/spool" "$PREFIX/log" "$PREFIX/mysql" "$RUN"
  sed -i '/# slurm-virtual-nodes$/d' /etc/hosts
  echo "wiped state, spool, logs and the accounting db under $PREFIX"
fi
if [ $stopped = 0 ]; then echo "slurm-dev stop: nothing was running under $PREFIX ($(elapsed) s)"
else echo "slurm-dev stop: stopped $stopped daemons ($(elapsed) s)"; fi
