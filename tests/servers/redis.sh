#!/usr/bin/env bash
# A throwaway Redis server on loopback for the tests, with AOF and
# appendfsync always (the durability keel documents for idempotency records).
#
#   redis.sh start   <state-dir>   start on a free port; write <state-dir>/port
#   redis.sh stop    <state-dir>   stop it and delete <state-dir>
#   redis.sh kill    <state-dir>   SIGKILL it (like a crash), keep the AOF
#   redis.sh restart <state-dir>   start it again on the same port, replaying the AOF
#
# TCP only, so <state-dir> may be any path. A start that fails says why at
# once; only a port that turns out taken is retried, on another port.
set -euo pipefail
cmd=${1:?usage: redis.sh start|stop|kill|restart <state-dir>}
dir=${2:?usage: redis.sh start|stop|kill|restart <state-dir>}
command -v redis-server >/dev/null || { echo "redis.sh: redis-server not found (apt-get install redis-server)" >&2; exit 1; }

# start_on <port>: 0 up, 2 the port is taken, 1 any other failure (its cause
# is in $dir/attempt.log). The server runs in its own session, not
# daemonized, so that the script sees at once if it exits.
start_on() {
  local port=$1 from pid want
  from=$(stat -c %s "$dir/server.log" 2>/dev/null || echo 0)
  setsid -w redis-server --port "$port" --bind 127.0.0.1 --dir "$dir" --daemonize no \
    --pidfile "$dir/redis.pid" --logfile "$dir/server.log" \
    --appendonly yes --appendfsync always --save "" </dev/null >"$dir/redis.out" 2>&1 &
  pid=$!
  # Up once it answers PING (the AOF may take a while to load after a
  # restart) and is this server, not another on the same port.
  want=$(cd "$dir" && pwd -P)
  for _ in $(seq 1 600); do
    if redis-cli -p "$port" ping 2>/dev/null | grep -q PONG &&
      [ "$(redis-cli -p "$port" config get dir 2>/dev/null | sed -n 2p)" = "$want" ]; then
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  kill "$pid" 2>/dev/null || true  # not up after 30 s: give up on it
  { tail -c +"$((from + 1))" "$dir/server.log" 2>/dev/null; cat "$dir/redis.out"; } >"$dir/attempt.log"
  grep -q "Address already in use" "$dir/attempt.log" && return 2
  return 1
}

# Says why a start on <port> failed, in one line, then the attempt's log.
fail() {
  local port=$1 why
  if grep -q "Address already in use" "$dir/attempt.log"; then
    why="127.0.0.1:$port is taken by another process"
  elif ! grep -q . "$dir/attempt.log"; then
    why="no answer to PING within 30 s"
  elif grep -q 'FATAL CONFIG' "$dir/attempt.log"; then  # e.g. >>> 'dir "/x"' No such file or directory
    why="$(grep -m 1 '^>>>' "$dir/attempt.log") $(tail -n 1 "$dir/attempt.log")"
  else  # its last warning-level line: the one it exited on
    why=$(grep ' # ' "$dir/attempt.log" | tail -n 1)
  fi
  echo "redis.sh: Redis did not start: $why" >&2
  sed 's/^/  | /' "$dir/attempt.log" >&2
  exit 1
}

case $cmd in
  start)
    "$0" stop "$dir" 2>/dev/null || true
    mkdir -p "$dir"
    for _ in $(seq 1 30); do
      port=$((20000 + RANDOM % 40000))
      rc=0
      start_on "$port" || rc=$?
      if [ "$rc" -eq 0 ]; then
        echo "$port" >"$dir/port"
        echo "redis.sh: Redis up on 127.0.0.1:$port ($dir)"
        exit 0
      fi
      [ "$rc" -eq 2 ] || fail "$port"
    done
    echo "redis.sh: 30 random ports were all taken; the last attempt:" >&2
    fail "$port"
    ;;
  stop)
    if [ -f "$dir/port" ]; then redis-cli -p "$(cat "$dir/port")" shutdown nosave >/dev/null 2>&1 || true; fi
    if [ -f "$dir/redis.pid" ]; then kill "$(cat "$dir/redis.pid")" 2>/dev/null || true; fi
    rm -rf "$dir"
    ;;
  kill)
    pid=$(cat "$dir/redis.pid")
    kill -9 "$pid"
    # Gone, or a zombie: whoever adopted it may be slow to reap it.
    while st=$(ps -o stat= -p "$pid") && [[ $st != Z* ]]; do sleep 0.02; done
    rm -f "$dir/redis.pid"
    ;;
  restart)
    port=$(cat "$dir/port")
    start_on "$port" || fail "$port"
    ;;
  *)
    echo "redis.sh: unknown command $cmd" >&2
    exit 2
    ;;
esac
