#!/usr/bin/env bash
# Start (or stop) every zpd process listed in a hostfile, over ssh or on this node.
set -Eeuo pipefail

usage() {
  cat <<'EOF'
usage: launch_cluster.sh HOSTFILE [start|stop]

HOSTFILE has one process per line, '#' starts a comment:

    # role     host            port   extra options for that process
    prefill    10.0.0.1        5760   --ib-device mlx5_0
    decode     10.0.0.2        5770   --ib-device mlx5_0 --max-batch 128
    router     10.0.0.1        5757
    http       10.0.0.1        30000  --served-model-name my-model

role is prefill, decode, router (one or more: the first coordinates pauses and
weight pushes, the others follow it, each serving requests) or http (any number:
zpd's HTTP front, SGLang's and OpenAI's APIs on that port, a client of the
routers; optional);
the extra options are split on whitespace. host is the address the
process binds and announces; it is started directly when host is this node
(127.x, localhost, this node's name or one of its addresses) and over ssh
otherwise, or always over ssh when written user@host. Workers start first; the
routers start once every worker is ready, with the prefill and decode
endpoints of the file; then each http front, given every router's endpoint. A
front's API keys come from ZPD_API_KEY / ZPD_ADMIN_API_KEY in its own node's
environment (a local one inherits this shell's; they never go on a command line),
and a front on a non-loopback host needs one, or --insecure. Each process logs to RUN_DIR/logs/ROLE-HOST-PORT.log on
its own node; pid files go to RUN_DIR/pids/ on this node.

'stop' stops every process the last start recorded (http, then router), by pid:
SIGTERM, then SIGKILL after 15 s.

Environment (forwarded to every process, local or remote):
  ZPD_MODEL, ZPD_DEVICE, ZPD_DTYPE, ZPD_PROTOCOL, ZPD_IB_DEVICE, ZPD_KV_CACHE_MB,
  ZPD_CURVE_KEYS, ZPD_INSECURE, ZPD_LOG_LEVEL, ZPD_PYTHON   see scripts/launch_prefill.sh --help
                       (and scripts/launch_http.sh --help)
  ZPD_ROUTER_SECRET_FILE  the routers' secret (--router-secret-file); default: made
                       once as RUN_DIR/router.secret (0600). On several nodes copy it to
                       the same path on each, as the key directory of ZPD_CURVE_KEYS
  ZPD_RUN_DIR          logs and pid files (default RUN_DIR=<checkout>/run)
  ZPD_REMOTE_DIR       the checkout's path on remote nodes (default: this checkout's path)
  ZPD_SSH              ssh command (default: ssh -o BatchMode=yes)
  ZPD_STARTUP_TIMEOUT  seconds to wait for each process to be ready (default 300)
EOF
}

[ $# -ge 1 ] || { usage >&2; exit 2; }
case "$1" in -h|--help) usage; exit 0;; esac
hostfile=$1; action=${2:-start}
here=$(cd "$(dirname "$0")/.." && pwd)
run_dir=${ZPD_RUN_DIR:-$here/run}
remote_dir=${ZPD_REMOTE_DIR:-$here}
read -r -a ssh_cmd <<<"${ZPD_SSH:-ssh -o BatchMode=yes}"
timeout_s=${ZPD_STARTUP_TIMEOUT:-300}
forward_vars=(ZPD_MODEL ZPD_DEVICE ZPD_DTYPE ZPD_PROTOCOL ZPD_IB_DEVICE ZPD_KV_CACHE_MB
              ZPD_CURVE_KEYS ZPD_INSECURE ZPD_LOG_LEVEL ZPD_PYTHON MC_FORCE_TCP MC_LOG_LEVEL
              ZPD_ROUTER_SECRET_FILE)

is_local() {   # host (without user@) is this node
  local h=$1
  case "$h" in 127.*|localhost|::1) return 0;; esac
  [ "$h" = "$(hostname)" ] || [ "$h" = "$(hostname -f 2>/dev/null || true)" ] && return 0
  ip -o addr show 2>/dev/null | awk '{print $4}' | cut -d/ -f1 | grep -qxF "$h"
}

# Runs a shell command line on the process's node.
on_node() {   # target local(0/1) command-line
  if [ "$2" = 1 ]; then bash -c "$3"; else "${ssh_cmd[@]}" "$1" "$3"; fi
}

pid_file() { echo "$run_dir/pids/$1-$2-$3.pid"; }

stop_all() {
  local f role host port target pid local_ n=0
  for role in http router decode prefill; do
    for f in "$run_dir"/pids/"$role"-*.pid; do
      [ -e "$f" ] || continue
      read -r target local_ pid port <"$f"
      # Only a process that still runs zpd: the pid may have been reused since.
      on_node "$target" "$local_" "
        rm -f $(printf %q "$run_dir/ready/$role-${target#*@}-$port.json")
        if grep -qa zpd /proc/$pid/cmdline 2>/dev/null; then
          kill -TERM $pid
          for i in \$(seq 75); do kill -0 $pid 2>/dev/null || exit 0; sleep 0.2; done
          echo 'pid $pid ignored SIGTERM for 15 s: SIGKILL' >&2; kill -KILL $pid
        fi" || echo "launch_cluster.sh: could not stop $role on $target (pid $pid)" >&2
      echo "stopped $role $target:$port (pid $pid)"
      rm -f "$f"; n=$((n + 1))
    done
  done
  [ $n -gt 0 ] || echo "launch_cluster.sh: nothing to stop (no pid files in $run_dir/pids)"
}

# The routers prove themselves to the workers and to each other with a shared secret
# (docs/operating.md, Security): made once, private, and kept for later starts.
router_secret() {
  if [ -z "${ZPD_ROUTER_SECRET_FILE:-}" ]; then
    ZPD_ROUTER_SECRET_FILE=$run_dir/router.secret
    [ -f "$ZPD_ROUTER_SECRET_FILE" ] || (umask 077; set -o noclobber
      od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$ZPD_ROUTER_SECRET_FILE")
  fi
  export ZPD_ROUTER_SECRET_FILE
}

start_one() {   # role target port extra...
  local role=$1 target=$2 port=$3; shift 3
  local host=${target#*@} local_=0 script log ready env_args="" v q
  if [ "$target" = "$host" ] && is_local "$host"; then local_=1; fi
  log="$run_dir/logs/$role-$host-$port.log"
  ready="$run_dir/ready/$role-$host-$port.json"
  for v in "${forward_vars[@]}"; do
    [ -n "${!v:-}" ] && env_args+=" $v=$(printf %q "${!v}")"
  done
  script="launch_$role.sh --host $(printf %q "$host") --port $port --log-file $(printf %q "$log")"
  script+=" --ready-file $(printf %q "$ready")"
  for q in "$@"; do script+=" $(printf %q "$q")"; done
  local dir=$here; [ $local_ = 1 ] || dir=$remote_dir
  # setsid: the process outlives this shell and its terminal; exec keeps the pid.
  local pid
  pid=$(on_node "$target" "$local_" "mkdir -p $(printf %q "$run_dir/logs") $(printf %q "$run_dir/ready") &&
        rm -f $(printf %q "$ready") && cd $(printf %q "$dir") || exit 1
        env$env_args setsid bash scripts/$script </dev/null >/dev/null 2>&1 & echo \$!")
  [[ "$pid" =~ ^[0-9]+$ ]] || { echo "launch_cluster.sh: could not start $role on $target: $pid" >&2; return 1; }
  echo "$target $local_ $pid $port" >"$(pid_file "$role" "$host" "$port")"
  echo "started $role on $host:$port (pid $pid, log $log)"
}

# Each process writes its ready file once its socket is bound and it serves; the
# file is polled rather than the port, so no probe connection shows in the logs.
wait_ready() {   # role host port
  local deadline=$((SECONDS + timeout_s)) target local_ pid
  local ready=$(printf %q "$run_dir/ready/$1-$2-$3.json")
  read -r target local_ pid _ <"$(pid_file "$1" "$2" "$3")"
  until on_node "$target" "$local_" "test -f $ready"; do
    if ! on_node "$target" "$local_" "kill -0 $pid" 2>/dev/null; then
      echo "launch_cluster.sh: $1 on $2:$3 exited; the end of its log ($run_dir/logs/$1-$2-$3.log):" >&2
      on_node "$target" "$local_" "tail -n 20 $(printf %q "$run_dir/logs/$1-$2-$3.log")" >&2 || true
      return 1
    fi
    [ $SECONDS -lt $deadline ] || { echo "launch_cluster.sh: $1 on $2:$3 not up in ${timeout_s} s" >&2; return 1; }
    sleep 1
  done
}

start_all() {
  local lines=() https=() routers=() role target port rest prefill="" decode="" line
  while IFS= read -r line || [ -n "$line" ]; do
    line=${line%%#*}
    read -r role target port rest <<<"$line" || true
    [ -n "$role" ] || continue
    [[ "$port" =~ ^[0-9]+$ ]] || { echo "launch_cluster.sh: bad port in: $role $target $port" >&2; exit 2; }
    case "$role" in
      prefill) prefill+="${prefill:+,}${target#*@}:$port"; lines+=("$role $target $port $rest");;
      decode) decode+="${decode:+,}${target#*@}:$port"; lines+=("$role $target $port $rest");;
      router) routers+=("$role $target $port $rest");;
      http) https+=("$role $target $port $rest");;
      *) echo "launch_cluster.sh: unknown role '$role' (prefill, decode, router or http)" >&2; exit 2;;
    esac
  done <"$hostfile"
  if [ -z "$prefill" ] || [ -z "$decode" ] || [ ${#routers[@]} -eq 0 ]; then
    echo "launch_cluster.sh: $hostfile needs at least one prefill, one decode and one router" >&2
    exit 2
  fi
  if ls "$run_dir"/pids/*.pid >/dev/null 2>&1; then
    echo "launch_cluster.sh: $run_dir/pids has pid files: run '$0 $hostfile stop' first" >&2
    exit 1
  fi
  mkdir -p "$run_dir/pids" "$run_dir/logs"
  router_secret
  # A failed start stops what it started, so a retry begins from nothing.
  trap 'echo "launch_cluster.sh: start failed; stopping what was started" >&2; stop_all >&2' ERR
  for line in "${lines[@]}"; do
    read -r -a f <<<"$line"
    start_one "${f[@]}"
  done
  for line in "${lines[@]}"; do
    read -r role target port _ <<<"$line"
    wait_ready "$role" "${target#*@}" "$port"
  done
  local router_ep="" follow=() fronts=""
  for line in "${routers[@]}"; do     # the first coordinates, the others follow it
    read -r -a f <<<"$line"
    start_one router "${f[1]}" "${f[2]}" --prefill "$prefill" --decode "$decode" "${follow[@]}" "${f[@]:3}"
    wait_ready router "${f[1]#*@}" "${f[2]}"
    [ ${#follow[@]} -gt 0 ] || follow=(--coordinator "${f[1]#*@}:${f[2]}")
    router_ep+="${router_ep:+,}${f[1]#*@}:${f[2]}"
  done
  for line in "${https[@]}"; do
    read -r -a f <<<"$line"
    start_one http "${f[1]}" "${f[2]}" --router "$router_ep" "${f[@]:3}"
    wait_ready http "${f[1]#*@}" "${f[2]}"
    fronts+="; http http://${f[1]#*@}:${f[2]}"
  done
  trap - ERR
  echo "zpd cluster up: router $router_ep; prefill $prefill; decode $decode$fronts; logs in $run_dir/logs"
}

case "$action" in
  start) start_all;;
  stop) stop_all;;
  *) usage >&2; exit 2;;
esac
