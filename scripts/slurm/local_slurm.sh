#!/usr/bin/env bash
# A real Slurm on this one machine, for tests and trying scripts/slurm/zpd.sbatch by hand.
set -Eeuo pipefail

usage() {
  cat <<'EOF'
usage: local_slurm.sh start [--install] | stop | status | env

Runs Debian's Slurm (slurmctld, slurmd, slurm-client) and munge as root, without
systemd: munged, slurmctld and one `slurmd -N nK` per node, NODES nodes n1..nN
(default 3) that all live on 127.0.0.1 (different ports), each with CPUS CPUs
(default 2). Everything lives in DIR (default /tmp/zpd-slurm): slurm.conf, munge's
key and socket, state, spool, logs (DIR/log/) and pid files, by which `stop` ends
each daemon (SIGTERM, SIGKILL after 10 s). No file outside DIR is written.

  start      start what is not running (idempotent: a running one is kept) and wait
             until every node is idle; --install first installs the Debian packages
             if slurmctld is missing (apt-get; needs root)
  stop       stop the daemons by their pid files; jobs still running are cancelled
             first, so nothing they started outlives them
  status     print sinfo's view; exit 1 when the controller does not answer
  env        print `export SLURM_CONF=DIR/slurm.conf`: eval it to use sbatch, squeue,
             scancel and scontrol on this Slurm

Exit codes: 0 done, 1 failed, 3 cannot run here (not root, or the packages are
missing and --install was not given).

Environment: ZPD_SLURM_DIR (DIR), ZPD_SLURM_NODES (NODES), ZPD_SLURM_CPUS (CPUS),
ZPD_SLURM_PROCTRACK (cgroup or linuxproc; default cgroup where cgroup v1's freezer
is mounted: under linuxproc a process that escapes its step outlives scancel).
EOF
}

dir=${ZPD_SLURM_DIR:-/tmp/zpd-slurm}
nodes=${ZPD_SLURM_NODES:-3}
cpus=${ZPD_SLURM_CPUS:-2}
conf=$dir/slurm.conf
export SLURM_CONF=$conf

die() { echo "local_slurm.sh: $1" >&2; exit "${2:-1}"; }

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
    && command -v sbatch >/dev/null && return 0
  [ "${1:-}" = --install ] || die "slurmctld, slurmd, slurm-client or munge missing (start --install, or apt-get install slurmctld slurmd slurm-client munge)" 3
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
}

free_ports() {   # n: the first of n consecutive ports free on 127.0.0.1
  python3 - "$1" <<'PY'
import random, socket, sys
n = int(sys.argv[1])
for _ in range(200):
    base = random.randrange(20000, 60000 - n)
    socks = []
    try:
        for p in range(base, base + n):
            s = socket.socket(); socks.append(s); s.bind(("127.0.0.1", p))
    except OSError:
        continue
    finally:
        for s in socks:
            s.close()
    print(base)
    break
PY
}

write_conf() {   # once: the ports stay those of the first start
  [ -f "$conf" ] && return 0
  local base proctrack task=task/none host
  base=$(free_ports $((nodes + 1)))
  proctrack=${ZPD_SLURM_PROCTRACK:-}
  if [ -z "$proctrack" ]; then
    proctrack=linuxproc; [ -d /sys/fs/cgroup/freezer ] && proctrack=cgroup
  fi
  if [ "$proctrack" = cgroup ]; then
    task=task/cgroup
    printf 'CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nConstrainCores=no\n' >"$dir/cgroup.conf"
  fi
  host=$(hostname -s)
  cat >"$conf.tmp" <<EOF
# made by scripts/slurm/local_slurm.sh: $nodes nodes on 127.0.0.1
ClusterName=zpdlocal
# Job ids of their own: two instances on one host share the nodes' cgroup directories
# (slurm_n1, ...), and their jobs' must not collide there.
FirstJobId=$((RANDOM * 30 + 1000))
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$((base + nodes))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/$proctrack
TaskPlugin=$task
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
KillWait=5
SlurmdTimeout=30
NodeName=n[1-$nodes] NodeHostname=$host NodeAddr=127.0.0.1 Port=[$base-$((base + nodes - 1))] CPUs=$cpus RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$conf.tmp" "$conf"
}

start_munge() {
  alive "$dir/munge/munged.pid" && return 0
  mkdir -p "$dir/munge"
  [ -f "$dir/munge/munge.key" ] || (umask 077; head -c 1024 /dev/urandom >"$dir/munge/munge.key")
  chown -R munge:munge "$dir/munge"; chmod 711 "$dir/munge"
  runuser -u munge -- munged --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
    --seed-file="$dir/munge/munged.seed"
}

wait_idle() {
  local i
  for i in $(seq 150); do
    [ "$(sinfo -h -N -o '%t' 2>/dev/null | grep -cx 'idle\|mix\|alloc')" = "$nodes" ] && return 0
    sleep 0.2
  done
  die "nodes not idle after 30 s: $(sinfo -N 2>&1 | tr '\n' ' '); logs in $dir/log"
}

start() {
  [ "$(id -u)" = 0 ] || die "slurmd runs jobs as their users and must run as root" 3
  install_packages "${1:-}"
  mkdir -p "$dir/log" "$dir/state"
  chmod 755 "$dir" "$dir/log"
  write_conf
  start_munge
  alive "$dir/slurmctld.pid" || slurmctld -i
  local i
  for i in $(seq "$nodes"); do
    mkdir -p "$dir/spool/n$i"
    alive "$dir/slurmd-n$i.pid" || slurmd -N "n$i"
  done
  wait_idle
  echo "slurm up in $dir: $nodes nodes; eval \"\$($0 env)\" to use it"
}

stop_pids() {   # pid files: SIGTERM to all at once, SIGKILL to what is left after 10 s
  local f pids=() i
  for f in "$@"; do alive "$f" && pids+=("$(cat "$f")"); done
  [ ${#pids[@]} -eq 0 ] || kill -TERM "${pids[@]}" 2>/dev/null || true
  for i in $(seq 100); do
    kill -0 "${pids[@]}" 2>/dev/null || break
    sleep 0.1
  done
  [ ${#pids[@]} -eq 0 ] || kill -KILL "${pids[@]}" 2>/dev/null || true
  rm -f "$@"
}

stop() {
  if alive "$dir/slurmctld.pid"; then    # end the jobs first: their steps die with slurmd
    scancel --full -u root 2>/dev/null || true
    for _ in $(seq 50); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
  fi
  stop_pids "$dir"/slurmd-n*.pid "$dir/slurmctld.pid" "$dir/munge/munged.pid"   # ~2 s each, together
  # cgroup v1 directories of the fake nodes outlive their slurmd
  rmdir /sys/fs/cgroup/*/slurm_n*/uid_*/job_*/step_*/task_* /sys/fs/cgroup/*/slurm_n*/uid_*/job_*/step_* \
    /sys/fs/cgroup/*/slurm_n*/uid_*/job_* /sys/fs/cgroup/*/slurm_n*/uid_* /sys/fs/cgroup/*/slurm_n*/system \
    /sys/fs/cgroup/*/slurm_n* 2>/dev/null || true
  echo "slurm in $dir stopped"
}

case "${1:-}" in
  start) start "${2:-}";;
  stop) stop;;
  status) sinfo -N || exit 1;;
  env) echo "export SLURM_CONF=$conf";;
  -h|--help) usage;;
  *) usage >&2; exit 2;;
esac
