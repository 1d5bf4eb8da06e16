#!/usr/bin/env bash
# A throwaway Redis server on loopback for the tests, with AOF and
# appendfsync always (the durability keel documents for idempotency records).
#
#   redis.sh start   <state-dir>   start on a free port; write <state-dir>/port
#   redis.sh stop    <state-dir>   stop it and delete <state-dir>
#   redis.sh kill    <state-dir>   SIGKILL it (like a crash), keep the AOF
#   redis.sh restart <state-dir>   start it again on the same port, replaying the AOF
set -euo pipefail
cmd=${1:?usage: redis.sh start|stop|kill|restart <state-dir>}
dir=${2:?usage: redis.sh start|stop|kill|restart <state-dir>}
command -v redis-server >/dev/null || { echo "redis.sh: redis-server not found (apt-get install redis-server)" >&2; exit 1; }

start_on() {
  local port=$1
  redis-server --port "$port" --bind 127.0.0.1 --dir "$dir" --daemonize yes \
    --pidfile "$dir/redis.pid" --logfile "$dir/server.log" \
    --appendonly yes --appendfsync always --save "" >/dev/null || return 1
  for _ in $(seq 1 100); do
    if redis-cli -p "$port" ping 2>/dev/null | grep -q PONG; then return 0; fi
    # The AOF may still be loading after a restart.
    sleep 0.05
  done
  return 1
}

case $cmd in
  start)
    "$0" stop "$dir" 2>/dev/null || true
    mkdir -p "$dir"
    for _ in $(seq 1 30); do
      port=$((20000 + RANDOM % 40000))
      if start_on "$port"; then
        echo "$port" >"$dir/port"
        echo "redis.sh: Redis up on 127.0.0.1:$port ($dir)"
        exit 0
      fi
    done
    echo "redis.sh: could not start Redis; log:" >&2
    cat "$dir/server.log" >&2 || true
    exit 1
    ;;
  stop)
    if [ -f "$dir/port" ]; then redis-cli -p "$(cat "$dir/port")" shutdown nosave >/dev/null 2>&1 || true; fi
    if [ -f "$dir/redis.pid" ]; then kill "$(cat "$dir/redis.pid")" 2>/dev/null || true; fi
    rm -rf "$dir"
    ;;
  kill)
    pid=$(cat "$dir/redis.pid")
    kill -9 "$pid"
    while kill -0 "$pid" 2>/dev/null; do sleep 0.02; done
    rm -f "$dir/redis.pid"
    ;;
  restart)
    start_on "$(cat "$dir/port")"
    ;;
  *)
    echo "redis.sh: unknown command $cmd" >&2
    exit 2
    ;;
esac
