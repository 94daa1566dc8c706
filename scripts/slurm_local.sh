#!/usr/bin/env bash
# A throw-away one-node Slurm cluster for tests (Debian's slurm-wlm, run as root, no systemd).
#
#   scripts/slurm_local.sh install      # apt-get slurm-wlm (+ munge) if missing; idempotent
#   scripts/slurm_local.sh start DIR    # cluster with all state under DIR; prints `export` lines
#   scripts/slurm_local.sh stop DIR     # cancel its jobs, kill its daemons, wait for them to exit
#
# Everything (slurm.conf, munge key/socket, spool, state, logs, pid files) lives under DIR,
# ports are picked free at start, so several clusters (or a stale one) never collide.
set -euo pipefail

die() { echo "slurm_local: $*" >&2; exit 1; }

cmd_install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
     command -v srun >/dev/null && command -v munged >/dev/null; then
    return 0
  fi
  local log; log=$(mktemp)
  export DEBIAN_FRONTEND=noninteractive
  # Package lists may be empty on a fresh machine: refresh them only when needed. Then pull
  # slurmctld, slurmd, slurm-client and munge (9 packages). Quiet unless it fails.
  { apt-cache show slurmctld >/dev/null 2>&1 || apt-get update -qq; } >"$log" 2>&1 &&
    apt-get install -y -qq --no-install-recommends slurm-wlm >>"$log" 2>&1 ||
    { cat "$log" >&2; rm -f "$log"; die "apt-get install slurm-wlm failed"; }
  rm -f "$log"
  # Debian's postinst may start the system-wide munged/slurm daemons where an init runs them;
  # they use /etc/slurm and ports 6817/6818, which this script never touches.
}

# A TCP port nobody on this machine uses (not in /proc/net/tcp{,6}), below the ephemeral range.
free_port() {
  local p
  while :; do
    p=$((20000 + RANDOM % 12000))
    [[ " $* " == *" $p "* ]] && continue   # not one we already picked
    grep -qi "$(printf ':%04X ' "$p")" /proc/net/tcp /proc/net/tcp6 2>/dev/null || { echo "$p"; return; }
  done
}

cmd_start() {
  local dir node mem cport dport i
  [[ -n "${1:-}" ]] || die "usage: $0 start DIR"
  mkdir -p "$1"; dir=$(cd "$1" && pwd)
  [[ -e "$dir/run/slurmctld.pid" ]] && die "$dir already holds a cluster (stop it first)"
  mkdir -p "$dir"/{munge,state,spool,log,run}
  chmod 755 "$dir" "$dir/munge"   # munged refuses key/socket dirs that others can write to
  node=$(hostname -s)
  mem=$(awk '/^MemTotal/ {print int($2 / 1024)}' /proc/meminfo)   # MB, so --mem=... works
  cport=$(free_port); dport=$(free_port "$cport")
  # On any failure below, report and tear down what was started.
  trap 'echo "slurm_local: start failed; logs in $dir/log" >&2; cmd_stop "$dir" >&2' ERR
  # Every daemon (and each job's slurmstepd) carries this in its environment: stop uses it to
  # tell this cluster's processes from others'.
  export SLURM_CONF="$dir/slurm.conf"

  # Private munged: own key, socket, pid, log and seed, so no system-wide munged is needed.
  # (Slurm 22.05 has no auth/slurm; auth/munge with AuthInfo=socket= points at this one.)
  dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$dir/munge/munge.key"
  munged --force -S "$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" \
    --seed-file="$dir/munge/munged.seed"

  cat >"$dir/slurm.conf" <<EOF
ClusterName=reshard
# Controller on this host, reached over loopback; ports picked free above.
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$cport
SlurmdPort=$dport
# Daemons run as root (we are root; jobs run as the submitting user).
SlurmUser=root
SlurmdUser=root
# Authenticate through the private munged above.
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
# All state under DIR.
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups, accounting or MPI: plain process tracking works in a container.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
# Allocate single CPUs (not whole nodes), so 4 array tasks / 4 srun tasks share the node.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Trust the CPU count below rather than the 2 cores the machine really has.
SlurmdParameters=config_overrides
# How long finished jobs stay known (default 300 s). sbatch --wait polls after 2, 10, 42, 74.. s,
# backing off only while its interval < MinJobAge/2, so SLURM_LOCAL_MIN_JOB_AGE=4 makes it poll
# every 2 s -- but then an array task finished >4 s before a lower-numbered one is purged unseen
# and its non-zero exit code is lost from sbatch --wait's status.
MinJobAge=${SLURM_LOCAL_MIN_JOB_AGE:-300}
# A node that was down comes back by itself once slurmd registers.
ReturnToService=2
NodeName=$node NodeAddr=127.0.0.1 CPUs=4 RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

  slurmctld -c   # -c: ignore any saved state; daemonizes, writes its pid file
  slurmd -N "$node"

  # Wait (<= 60 s) until the node is idle, i.e. jobs can start.
  for ((i = 0; i < 120; i++)); do
    [[ "$(sinfo -h -N -o %t 2>/dev/null)" == idle ]] && { echo "export SLURM_CONF=$SLURM_CONF"; return 0; }
    sleep 0.5
  done
  echo "slurm_local: node not idle after 60 s" >&2
  tail -n 20 "$dir"/log/*.log >&2
  false   # -> ERR trap: stop, exit 1
}

ours() {   # is pid $1 alive and started with this cluster's SLURM_CONF in its environment?
  grep -qzxF "SLURM_CONF=$SLURM_CONF" "/proc/$1/environ" 2>/dev/null
}

kill_tree() {   # SIGKILL a process and all its descendants (children first)
  local c
  for c in $(cat /proc/"$1"/task/*/children 2>/dev/null); do kill_tree "$c"; done
  kill -9 "$1" 2>/dev/null || true
}

cmd_stop() {
  local dir pids="" f p i alive jobs
  [[ -n "${1:-}" ]] || die "usage: $0 stop DIR"
  dir=$(cd "$1" && pwd)
  export SLURM_CONF="$dir/slurm.conf"
  # Cancel its jobs first so slurmd kills their tasks and slurmstepds (best effort, <= 10 s).
  if [[ -s "$dir/run/slurmctld.pid" ]] && ours "$(cat "$dir/run/slurmctld.pid")"; then
    mapfile -t jobs < <(squeue -h -o %A 2>/dev/null || true)
    if ((${#jobs[@]})); then
      scancel "${jobs[@]}" 2>/dev/null || true
      for ((i = 0; i < 20; i++)); do
        [[ -z "$(squeue -h -o %A 2>/dev/null)" ]] && break; sleep 0.5
      done
    fi
  fi
  for f in slurmd slurmctld munged; do
    [[ -s "$dir/run/$f.pid" ]] || continue
    p=$(cat "$dir/run/$f.pid")
    ours "$p" && kill "$p" && pids+=" $p"   # a stale pid file's pid may be someone else's
  done
  # Wait up to 20 s, then SIGKILL what is left.
  for ((i = 0; i < 40; i++)); do
    alive=0
    for p in $pids; do kill -0 "$p" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.5
  done
  for p in $pids; do kill -9 "$p" 2>/dev/null || true; done
  # Steps left behind (e.g. the controller was already dead, so no scancel): kill each of our
  # slurmstepds with its process tree (the caller's own processes carry SLURM_CONF too: skip).
  for f in /proc/[0-9]*; do
    [[ "$(tr '\0' ' ' 2>/dev/null <"$f/cmdline")" == slurmstepd* ]] && ours "${f#/proc/}" &&
      kill_tree "${f#/proc/}"
  done
  rm -f "$dir"/run/*.pid
}

case "${1:-}" in
  install) cmd_install ;;
  start) cmd_start "${2:-}" ;;
  stop) cmd_stop "${2:-}" ;;
  *) die "usage: $0 {install|start DIR|stop DIR}" ;;
esac
