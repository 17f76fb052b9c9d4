#!/bin/bash
# A stand-in for `hpcrl role ROLE --run-dir DIR` in the Slurm tests: it follows the role contract
# (engines stop on their DONE file or TERM; trainer rank 0 requeues the job on USR2; mpi-agents leave
# at once) in milliseconds, and records what each task saw in RUN_DIR/stub/ROLE-JOBID-RESTART-PROCID.txt.
# STUB_TRAINER (set through slurm.env): ok (default) | fail | preemptible | block; STUB_AGENT: ok | fail
role=$1 run_dir=$3 restart=${SLURM_RESTART_COUNT:-0}
mkdir -p "$run_dir/stub"
out="$run_dir/stub/$role-$SLURM_JOB_ID-$restart-$SLURM_PROCID.txt"
record() { echo "$*" >> "$out"; }
wait_loop() {  # seconds; a trap runs between the short sleeps
  for _ in $(seq $(( $1 * 5 ))); do "${@:2}" && return 0; sleep 0.2 & wait $!; done; return 1
}
done_file() { [ -e "$run_dir/engines/DONE-$SLURM_JOB_ID-$restart" ]; }
never() { return 1; }

if [ "$role" = engines ]; then
  trap 'record TERM; exit 0' TERM
  record "role=engines node=$SLURMD_NODENAME procid=$SLURM_PROCID ntasks=$SLURM_NTASKS omp=$OMP_NUM_THREADS" \
    "nvls=${NCCL_NVLS_ENABLE:-}/${TORCH_SYMM_MEM_DISABLE_MULTICAST:-}/${NVSHMEM_DISABLE_NVLS:-}" \
    "gpus=${CUDA_VISIBLE_DEVICES:-none} name=$SLURM_JOB_NAME"
  wait_loop 120 done_file && { record DONE; exit 0; }
  exit 3
fi

if [ "$role" = mpi-agent ]; then
  # The real agent leaves when trainer rank 0 broadcasts STOP; the stub records where it ran and leaves.
  record "role=mpi-agent node=$SLURMD_NODENAME procid=$SLURM_PROCID pmix_rank=${PMIX_RANK:-none}" \
    "het_group=${HPCRL_HET_GROUP:-} step_tasks=$SLURM_STEP_NUM_TASKS omp=$OMP_NUM_THREADS"
  [ "${STUB_AGENT:-ok}" = fail ] && exit 5
  exit 0
fi

mode=${STUB_TRAINER:-ok}
[ "$restart" -gt 0 ] && [ "$mode" = preemptible ] && mode=ok
if [ "$mode" = preemptible ]; then
  on_usr2() {
    record USR2
    # rank 0 plays the driver: checkpoint (nothing here), then requeue the job
    # Slurm TERMs the step as soon as the requeue is accepted: ignore it, or the record may not be written.
    if [ "$SLURM_PROCID" = 0 ]; then trap '' TERM; scontrol requeue "$SLURM_JOB_ID" && record REQUEUED; fi
    exit 0
  }
  trap on_usr2 USR2
fi
record "role=trainer node=$SLURMD_NODENAME procid=$SLURM_PROCID ntasks=$SLURM_NTASKS omp=$OMP_NUM_THREADS" \
  "pmix_rank=${PMIX_RANK:-none} het_group=${HPCRL_HET_GROUP:-}" \
  "nvls=${NCCL_NVLS_ENABLE:-}/${TORCH_SYMM_MEM_DISABLE_MULTICAST:-}/${NVSHMEM_DISABLE_NVLS:-}" \
  "gpus=${CUDA_VISIBLE_DEVICES:-none} mode=$mode name=$SLURM_JOB_NAME"
case $mode in
  ok) exit 0 ;;
  fail) exit 3 ;;
  preemptible | block) wait_loop 120 never; exit 4 ;;
esac
