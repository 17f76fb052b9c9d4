#!/usr/bin/env bash
# start.sh - a throw-away Slurm cluster on this one host, with accounting (sacct works), for tests/e2e.
#
#   sudo tools/slurm-dev/start.sh        # all nodes idle in ~25 s; prints the time it took
#   tools/slurm-dev/stop.sh              # stops exactly the daemons this script started (pid files)
#
# Debian 12 (bookworm), root, no systemd/docker/cgroups (docs/slurm.md lists the Slurm behaviour to know).
# The host presents SLURM_NNODES virtual nodes n1..nN (one slurmd each, own port), one slurmctld,
# slurmdbd + MariaDB (submitit's job.state needs sacct), and a private munged. Fake GPUs are GRES.
# Everything (config, state, spool, logs, pid files) lives under $SLURM_PREFIX.
# Idempotent: when the cluster of this prefix is already up, it says so and exits 0.
#
# Env knobs (defaults in brackets):
#   SLURM_PREFIX      [${TMPDIR:-/tmp}/hpcrl-slurm]   work dir
#   SLURM_NNODES      [3]        virtual nodes (het components never share a node: keep >= 3)
#   SLURM_NODE_CPUS   [4]        CPUs advertised per node (oversubscribed on purpose)
#   SLURM_NODE_MEM    [4000]     RealMemory (MB) per node
#   SLURM_NODE_GPUS   [2]        fake GPUs (GRES gpu) per node, 0 = none
#   SLURM_LINK_ETC    [1]        symlink /etc/slurm/*.conf -> generated files (else export SLURM_CONF)
#   SLURM_CTLD_PORT   [16817]    slurmctld port; slurmdbd +2, slurmd ports are +184..
#   SLURM_MYSQL_PORT  [13306]
#   SLURM_CRED_EXPIRE [10]       seconds; also how long a requeued job is held
#   SLURM_START_TIMEOUT [60]     seconds to wait for all nodes idle
#   SLURM_WITH_DBD    [1]        0 = no slurmdbd/MariaDB (faster, but sacct and submitit's job.state fail)
set -euo pipefail

PREFIX=${SLURM_PREFIX:-${TMPDIR:-/tmp}/hpcrl-slurm}
NNODES=${SLURM_NNODES:-3}
NODE_CPUS=${SLURM_NODE_CPUS:-4}
NODE_MEM=${SLURM_NODE_MEM:-4000}
NODE_GPUS=${SLURM_NODE_GPUS:-2}
LINK_ETC=${SLURM_LINK_ETC:-1}
CTLD_PORT=${SLURM_CTLD_PORT:-16817}
SLURMD_PORT0=$((CTLD_PORT + 184))
DBD_PORT=$((CTLD_PORT + 2))
MYSQL_PORT=${SLURM_MYSQL_PORT:-13306}
CRED_EXPIRE=${SLURM_CRED_EXPIRE:-10}
START_TIMEOUT=${SLURM_START_TIMEOUT:-60}
WITH_DBD=${SLURM_WITH_DBD:-1}

ETC=$PREFIX/etc RUN=$PREFIX/run LOG=$PREFIX/log
CONF=$ETC/slurm.conf
MUNGE_DIR=$RUN/munge
MUNGE_SOCK=$MUNGE_DIR/munge.socket.2
t_start=$(date +%s%N)
elapsed() { local ms=$(( ($(date +%s%N) - t_start) / 1000000 )); printf '%d.%03d' $((ms / 1000)) $((ms % 1000)); }
log() { printf '[slurm-dev start %7ss] %s\n' "$(elapsed)" "$*"; }
die() { echo "slurm-dev start: $*" >&2; exit 1; }
# A pid file names one of our daemons only while that pid runs one of them (pids get reused).
alive() {
  [ -s "$1" ] || return 1
  case "$(cat "/proc/$(cat "$1")/comm" 2>/dev/null)" in slurmd|slurmctld|slurmdbd|mariadbd|mysqld|munged) return 0;; esac
  return 1
}
# Poll up to $1 tenths of a second for the command in "$@" to succeed.
poll() { local n=$1; shift; for _ in $(seq "$n"); do "$@" && return 0; sleep 0.1; done; return 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it installs packages, writes /etc/hosts and starts daemons); rerun with sudo"
[ "$NNODES" -ge 1 ] || die "SLURM_NNODES must be >= 1"
export SLURM_CONF=$CONF

# ---------------------------------------------------------------- 0. already up?
if alive "$RUN/slurmctld.pid" && scontrol ping >/dev/null 2>&1; then
  log "already running (slurmctld pid $(cat "$RUN/slurmctld.pid")); nothing to do"
  exit 0
fi

# ---------------------------------------------------------------- 1. install
# libpmix-dev: Slurm's mpi/pmix plugin dlopens pmix2/lib/libpmix.so (the -dev symlink) at step launch
# ("can not load PMIx library" without it); `srun --mpi=pmix` runs sync.transport=mpi's MPI world.
PKGS="slurmctld slurmd slurm-client munge libpmix2 libpmix-dev"
[ "$WITH_DBD" = 1 ] && PKGS="$PKGS slurmdbd mariadb-server"
missing=""
for p in $PKGS; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $p"; done
if [ -n "$missing" ]; then
  command -v apt-get >/dev/null || die "missing packages:$missing, and no apt-get to install them"
  log "installing$missing from Debian"
  export DEBIAN_FRONTEND=noninteractive
  # Keep the packages' postinst from starting services (no systemd here; on a systemd box they would
  # start with the wrong config). Only remove the policy file if this script created it.
  added_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; added_policy=1
  fi
  apt-get update -qq
  # shellcheck disable=SC2086
  apt-get install -y -qq --no-install-recommends $missing >/dev/null
  [ $added_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
  log "installed"
fi

# ---------------------------------------------------------------- 2. names must resolve
HOST=$(hostname -s)
getent hosts "$HOST" >/dev/null || echo "127.0.0.1 $HOST" >> /etc/hosts
# The virtual node names appear in SLURM_JOB_NODELIST; make them resolve to this host.
sed -i '/# slurm-virtual-nodes$/d' /etc/hosts
echo "127.0.0.1 $(for i in $(seq 1 "$NNODES"); do printf 'n%s ' "$i"; done)# slurm-virtual-nodes" >> /etc/hosts

mkdir -p "$ETC" "$RUN" "$LOG" "$PREFIX/state" "$PREFIX/spool"
# slurmd does not create its spool dir before use. tmp/nN is the node's TmpFS: srun --mpi=pmix makes
# TmpFS/spmix_appdir_<uid>_<step> on every node, which collides when all virtual nodes share /tmp.
for i in $(seq 1 "$NNODES"); do mkdir -p "$PREFIX/spool/n$i" "$PREFIX/tmp/n$i"; done
# Stale pid files from a crashed run would fool the waits below; live daemons of this prefix are reused.
for pf in "$RUN"/slurmd-*.pid "$RUN/slurmctld.pid"; do [ -e "$pf" ] && ! alive "$pf" && rm -f "$pf"; done

# ---------------------------------------------------------------- 3. munge (a private instance)
if [ ! -s /etc/munge/munge.key ]; then
  if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key --force
  else dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; fi
  chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
fi
install -d -o munge -g munge -m 0755 "$MUNGE_DIR"
if ! alive "$MUNGE_DIR/munged.pid"; then
  runuser -u munge -- /usr/sbin/munged --socket="$MUNGE_SOCK" --pid-file="$MUNGE_DIR/munged.pid" \
    --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed"
fi
poll 50 test -S "$MUNGE_SOCK" || die "munged did not create $MUNGE_SOCK; see $MUNGE_DIR/munged.log"
munge -n -S "$MUNGE_SOCK" | unmunge -S "$MUNGE_SOCK" >/dev/null
log "munged up (pid $(cat "$MUNGE_DIR/munged.pid"))"

# ---------------------------------------------------------------- 4. config
NODES="n[1-$NNODES]"; [ "$NNODES" = 1 ] && NODES=n1
PORTS="$SLURMD_PORT0"; [ "$NNODES" -gt 1 ] && PORTS="[$SLURMD_PORT0-$((SLURMD_PORT0 + NNODES - 1))]"
GRES_LINE=""; GRES_TYPES=""
if [ "$NODE_GPUS" -gt 0 ]; then
  GRES_LINE="Gres=gpu:$NODE_GPUS"; GRES_TYPES="GresTypes=gpu"
  mkdir -p "$PREFIX/fakedev"
  # Slurm wants a device file per GPU; a bare nvidia-major node (no driver behind it) is enough:
  # nothing opens it. A plain file also works (slurmd logs an error).
  for g in $(seq 0 $((NODE_GPUS - 1))); do
    [ -c "$PREFIX/fakedev/gpu$g" ] || { rm -f "$PREFIX/fakedev/gpu$g"
      mknod "$PREFIX/fakedev/gpu$g" c 195 "$g" 2>/dev/null || touch "$PREFIX/fakedev/gpu$g"; }
  done
  printf 'AutoDetect=off\nNodeName=%s Name=gpu File=%s\n' "$NODES" "$PREFIX/fakedev/gpu[0-$((NODE_GPUS - 1))]" > "$ETC/gres.conf"
else
  rm -f "$ETC/gres.conf"
fi
# slurmd 22.05 loads a cgroup plugin even with task/none; "autodetect" dies on some layouts.
echo "CgroupPlugin=cgroup/v1" > "$ETC/cgroup.conf"

if [ "$WITH_DBD" = 1 ]; then
  ACCT="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$HOST
AccountingStoragePort=$DBD_PORT
# slurmctld/sacct -> slurmdbd auth takes the munge socket from here, not from AuthInfo
AccountingStoragePass=$MUNGE_SOCK
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30"
else
  ACCT="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
fi

cat > "$CONF" <<CONF_EOF
# generated by tools/slurm-dev/start.sh
ClusterName=ci
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTLD_PORT
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCK,cred_expire=$CRED_EXPIRE
StateSaveLocation=$PREFIX/state
SlurmdSpoolDir=$PREFIX/spool/%n
TmpFS=$PREFIX/tmp/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
$ACCT
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
$GRES_TYPES
# het jobs start only from the backfill scheduler: run it every second
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2,sched_min_interval=100000
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# the node sizes below win over what slurmd detects (2 cores look like N x $NODE_CPUS)
SlurmdParameters=config_overrides
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# at preemption also send the job's --signal (the USR2 that hpcrl and submitit listen to)
SlurmctldParameters=preempt_send_user_signal
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=60
MessageTimeout=20
Waittime=0
NodeName=$NODES NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$PORTS CPUs=$NODE_CPUS RealMemory=$NODE_MEM $GRES_LINE State=UNKNOWN
PartitionName=debug  Nodes=$NODES Default=YES MaxTime=INFINITE State=UP PriorityTier=1  GraceTime=10
PartitionName=urgent Nodes=$NODES Default=NO  MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
CONF_EOF

if [ "$WITH_DBD" = 1 ]; then
  cat > "$ETC/slurmdbd.conf" <<CONF_EOF
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=$HOST
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$RUN/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$MYSQL_PORT
StorageUser=slurm
StoragePass=slurmpw
StorageLoc=slurm_acct_db
CONF_EOF
  chmod 600 "$ETC/slurmdbd.conf"   # slurmdbd refuses a readable one
else
  rm -f "$ETC/slurmdbd.conf"
fi

if [ "$LINK_ETC" = 1 ]; then
  mkdir -p /etc/slurm
  if [ -e /etc/slurm/slurm.conf ] && [ "$(readlink -f /etc/slurm/slurm.conf)" != "$CONF" ]; then
    mv /etc/slurm/slurm.conf "/etc/slurm/slurm.conf.bak.$(date +%s)"
  fi
  ln -sfn "$CONF" /etc/slurm/slurm.conf
  for f in gres.conf cgroup.conf slurmdbd.conf; do
    if [ -f "$ETC/$f" ]; then ln -sfn "$ETC/$f" /etc/slurm/$f; else rm -f /etc/slurm/$f; fi
  done
fi

# ---------------------------------------------------------------- 5. daemons (they fork and write pid files)
if [ "$WITH_DBD" = 1 ]; then
  MYSQL_DIR=$PREFIX/mysql MYSQL_SOCK=$RUN/mysqld.sock
  if [ ! -d "$MYSQL_DIR/mysql" ]; then
    mariadb-install-db --no-defaults --datadir="$MYSQL_DIR" --user=root --skip-test-db \
      --auth-root-authentication-method=socket > "$LOG/mariadb-install.log" 2>&1 \
      || die "mariadb-install-db failed; see $LOG/mariadb-install.log"
  fi
  if ! alive "$RUN/mysqld.pid"; then
    # A socket or pid file left by a daemon that died would pass the wait below while nothing listens
    # (CI once failed here with ERROR 2002, connection refused).
    rm -f "$MYSQL_SOCK" "$RUN/mysqld.pid"
    ( setsid mariadbd --no-defaults --datadir="$MYSQL_DIR" --user=root --bind-address=127.0.0.1 \
        --port="$MYSQL_PORT" --socket="$MYSQL_SOCK" --pid-file="$RUN/mysqld.pid" \
        --log-error="$LOG/mysqld.log" --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 \
        --skip-log-bin --innodb-flush-log-at-trx-commit=0 </dev/null >/dev/null 2>&1 & )
  fi
  # Up means answering a query, not just a socket file on disk.
  mysql_up() { mariadb --socket="$MYSQL_SOCK" -e 'SELECT 1' >/dev/null 2>&1; }
  poll 600 mysql_up || { tail -5 "$LOG/mysqld.log" >&2; die "mariadbd does not answer on $MYSQL_SOCK; see $LOG/mysqld.log"; }
  mariadb --socket="$MYSQL_SOCK" -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpw';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
  log "mariadb up (pid $(cat "$RUN/mysqld.pid"))"
  if ! alive "$RUN/slurmdbd.pid"; then
    slurmdbd   # reads slurmdbd.conf next to $SLURM_CONF
  fi
  dbd_up() { (echo > "/dev/tcp/127.0.0.1/$DBD_PORT") 2>/dev/null; }
  poll 300 dbd_up || die "slurmdbd did not listen on $DBD_PORT; see $LOG/slurmdbd.log"
  log "slurmdbd up (pid $(cat "$RUN/slurmdbd.pid"))"
fi
alive "$RUN/slurmctld.pid" || slurmctld -f "$CONF"
poll 150 scontrol ping >/dev/null 2>&1 \
  || { tail -5 "$LOG/slurmctld.log" >&2; die "slurmctld did not come up; see $LOG/slurmctld.log"; }
log "slurmctld up (pid $(cat "$RUN/slurmctld.pid"))"
for i in $(seq 1 "$NNODES"); do alive "$RUN/slurmd-n$i.pid" || slurmd -f "$CONF" -N "n$i"; done
for i in $(seq 1 "$NNODES"); do poll 50 test -s "$RUN/slurmd-n$i.pid" || die "slurmd n$i did not start; see $LOG/slurmd-n$i.log"; done
log "slurmds up: $(cd "$RUN" && for f in slurmd-*.pid; do printf '%s=%s ' "${f%.pid}" "$(cat "$f")"; done)"

# ---------------------------------------------------------------- 6. wait until all nodes are idle
deadline=$(( $(date +%s) + START_TIMEOUT ))
until [ "$(sinfo -h -p debug -t idle -o '%D' 2>/dev/null)" = "$NNODES" ]; do
  if [ "$(date +%s)" -gt "$deadline" ]; then sinfo -N -l >&2; die "nodes not idle after ${START_TIMEOUT}s"; fi
  sleep 0.2
done
if [ "$WITH_DBD" = 1 ]; then
  # slurmctld registers the cluster with slurmdbd in the background; sacct answers once it has.
  poll 300 sacct -n -X -S now >/dev/null 2>&1 || die "sacct does not answer; see $LOG/slurmdbd.log"
fi
log "cluster ready: $NNODES nodes, $NODE_CPUS CPUs and $NODE_GPUS fake GPUs each, accounting=$WITH_DBD (took $(elapsed) s)"
[ "$LINK_ETC" = 1 ] || echo "export SLURM_CONF=$CONF"
