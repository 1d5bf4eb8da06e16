#!/usr/bin/env bash
# A Redis primary and a replica on loopback, for the failover tests
# (tests/failover_redis_test.cpp), which start and stop it themselves. Both
# run AOF with appendfsync always (what keel documents for idempotency
# records); replication is Redis's own, asynchronous.
#
#   redis_pair.sh start <state-dir> [2]      primary and replica (and replica2), the
#                                            replicas in sync; writes <state-dir>/{primary,replica}/port
#   redis_pair.sh cut-link <state-dir>       the replica follows an address where
#                                            nothing listens (it keeps its data) and
#                                            the primary drops its replica connections
#   redis_pair.sh kill-primary <state-dir>   SIGKILL the primary
#   redis_pair.sh promote <state-dir>        REPLICAOF NO ONE on the replica (replica2, when
#                                            there is one, then follows it, in sync before this returns)
#   redis_pair.sh stop <state-dir>           stop both, delete <state-dir>
#
# TCP only, so <state-dir> may be any path.
set -euo pipefail
usage="usage: redis_pair.sh start|cut-link|kill-primary|promote|stop <state-dir>"
cmd=${1:?$usage}
dir=${2:?$usage}
command -v redis-server >/dev/null || { echo "redis_pair.sh: redis-server not found (apt-get install redis-server)" >&2; exit 1; }

cli() { local port=$1; shift; redis-cli -p "$port" "$@"; }

free_port() {
  # Below the ephemeral range where it leaves room: a port some client's
  # outgoing connection uses (the workers make many) cannot be bound either.
  local p low span
  low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
  span=$((low - 20000))
  [ "$span" -ge 2000 ] || span=40000
  for _ in $(seq 1 50); do
    p=$((20000 + RANDOM % span))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then echo "$p"; return 0; fi
  done
  return 1
}

# start_node <name> [redis-server args...]: on a free port, written to
# <state-dir>/<name>/port; a port taken between the check and the bind
# (another test's server) is retried on another.
start_node() {
  local name=$1 port pid
  shift
  mkdir -p "$dir/$name"
  for _ in $(seq 1 10); do
    port=$(free_port)
    : >"$dir/$name/server.log"
    setsid -w redis-server --port "$port" --bind 127.0.0.1 --dir "$dir/$name" --daemonize no \
      --pidfile "$dir/$name/redis.pid" --logfile "$dir/$name/server.log" \
      --appendonly yes --appendfsync always --save "" "$@" </dev/null >"$dir/$name/redis.out" 2>&1 &
    pid=$!
    for _ in $(seq 1 600); do
      # Up, and this server (its dir), not another on the same port.
      if cli "$port" ping 2>/dev/null | grep -q PONG &&
        [ "$(cli "$port" config get dir 2>/dev/null | sed -n 2p)" = "$(cd "$dir/$name" && pwd -P)" ]; then
        echo "$port" >"$dir/$name/port"
        return 0
      fi
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.05
    done
    grep -q "Address already in use" "$dir/$name/server.log" || break
  done
  echo "redis_pair.sh: the $name did not start:" >&2
  sed 's/^/  | /' "$dir/$name/server.log" "$dir/$name/redis.out" >&2 || true
  return 1
}

case $cmd in
  start)
    "$0" stop "$dir" 2>/dev/null || true
    mkdir -p "$dir"
    start_node primary
    pport=$(cat "$dir/primary/port")
    start_node replica --replicaof 127.0.0.1 "$pport"
    if [ "${3:-1}" = 2 ]; then start_node replica2 --replicaof 127.0.0.1 "$pport"; fi
    for node in replica replica2; do
      [ -f "$dir/$node/port" ] || continue
      for _ in $(seq 1 600); do
        cli "$(cat "$dir/$node/port")" info replication | grep -q "master_link_status:up" && break
        sleep 0.05
      done
      cli "$(cat "$dir/$node/port")" info replication | grep -q "master_link_status:up" ||
        { echo "redis_pair.sh: the $node's link is not up after 30 s" >&2; exit 1; }
    done
    echo "redis_pair.sh: primary on 127.0.0.1:$pport, replica on 127.0.0.1:$(cat "$dir/replica/port") ($dir)"
    ;;
  cut-link)
    pport=$(cat "$dir/primary/port")
    sport=$(cat "$dir/replica/port")
    # Port 1: nothing listens there, the replica's reconnections fail at once.
    cli "$sport" replicaof 127.0.0.1 1 >/dev/null
    if [ -f "$dir/replica2/port" ]; then cli "$(cat "$dir/replica2/port")" replicaof 127.0.0.1 1 >/dev/null; fi
    cli "$pport" client kill type replica >/dev/null
    for _ in $(seq 1 200); do
      [ "$(cli "$pport" info replication | tr -d '\r' | sed -n 's/^connected_slaves://p')" = 0 ] && exit 0
      sleep 0.02
    done
    echo "redis_pair.sh: the primary still has a replica" >&2
    exit 1
    ;;
  kill-primary)
    pid=$(cat "$dir/primary/redis.pid")
    kill -9 "$pid"
    while st=$(ps -o stat= -p "$pid") && [[ $st != Z* ]]; do sleep 0.02; done
    ;;
  promote)
    sport=$(cat "$dir/replica/port")
    cli "$sport" replicaof no one >/dev/null
    for _ in $(seq 1 600); do
      cli "$sport" role | head -n 1 | grep -q master && break
      sleep 0.05
    done
    cli "$sport" role | head -n 1 | grep -q master ||
      { echo "redis_pair.sh: the replica is not a primary 30 s after REPLICAOF NO ONE" >&2; exit 1; }
    if [ -f "$dir/replica2/port" ]; then
      r2=$(cat "$dir/replica2/port")
      cli "$r2" replicaof 127.0.0.1 "$sport" >/dev/null
      for _ in $(seq 1 600); do
        cli "$r2" info replication | grep -q "master_link_status:up" && exit 0
        sleep 0.05
      done
      echo "redis_pair.sh: replica2 does not follow the new primary after 30 s" >&2
      exit 1
    fi
    ;;
  stop)
    for node in primary replica replica2; do
      if [ -f "$dir/$node/port" ]; then cli "$(cat "$dir/$node/port")" shutdown nosave >/dev/null 2>&1 || true; fi
      if [ -f "$dir/$node/redis.pid" ]; then
        pid=$(cat "$dir/$node/redis.pid")
        kill "$pid" 2>/dev/null || true
        # Gone (or a zombie) within 2 s, or killed: a replica busy syncing once outlived both.
        for _ in $(seq 1 100); do
          st=$(ps -o stat= -p "$pid" 2>/dev/null) || break
          [[ $st == Z* ]] && break
          sleep 0.02
        done
        st=$(ps -o stat= -p "$pid" 2>/dev/null) && [[ $st != Z* ]] && kill -9 "$pid" 2>/dev/null || true
      fi
    done
    rm -rf "$dir"
    ;;
  *)
    echo "$usage" >&2
    exit 2
    ;;
esac
