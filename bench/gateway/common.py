"""Shared pieces of scripts/bench-gateway: processes started in their own
process groups and always stopped, free ports, the systems' configuration
files, and the measurements read from /proc.

Everything listens on 127.0.0.1 only. Nothing here is specific to one
figure; run.py measures the overhead, faults.py the fault table.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH_KEY = "bench-key"  # its SHA-256 is in keel.toml's [clients.bench]
PROMPT = "Say something about deadlines."


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=20.0, proc=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args[0]} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


class Procs:
    """Every process the benchmark starts, each in its own session (so its
    children are in its process group), stopped by group on exit, on an
    error and on SIGINT/SIGTERM: the run leaves nothing behind."""

    def __init__(self, run_dir):
        self.run_dir = run_dir
        self.procs = {}
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum, _frame):
        self.stop_all()
        sys.exit(128 + signum)

    def start(self, name, args, cwd=None, env=None, stdout_file=True):
        out = open(os.path.join(self.run_dir, f"{name}.log"), "wb") if stdout_file else subprocess.PIPE
        p = subprocess.Popen(args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT if stdout_file else None,
                             start_new_session=True)
        self.procs[name] = p
        return p

    def stop(self, name):
        p = self.procs.pop(name, None)
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=5)
        # Whatever the leader left in its group (node's workers, nginx's).
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop_all(self):
        for name in list(self.procs):
            self.stop(name)


def read_serving_port(path, timeout=30.0, proc=None):
    """The port in keel's 'gateway serving on http://127.0.0.1:PORT' line."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode}: {open(path).read()[-2000:]}")
        try:
            m = re.search(r"serving on http://[0-9.]+:(\d+)", open(path).read())
            if m:
                return int(m.group(1))
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise RuntimeError("the gateway did not print its serving line")


# ---------------------------------------------------------------- configs ---

def nginx_conf(run_dir, port, workers=1):
    conf = open(os.path.join(HERE, "nginx.conf.in")).read()
    body = open(os.path.join(HERE, "fixed-completion.json")).read().strip()
    sse = open(os.path.join(HERE, "fixed-completion.sse")).read()
    events = [e + "\n\n" for e in sse.split("\n\n") if e]
    pieces, cur = [], ""
    for e in events:  # whole events per piece, each under nginx's 4 KB
        if len(cur) + len(e) > 3000:
            pieces.append(cur)
            cur = ""
        cur += e
    pieces.append(cur)
    esc = lambda s: s.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
    sets = "\n".join(f"      set $sse{i} '{esc(p)}';" for i, p in enumerate(pieces))
    for k, v in {"@WORKERS@": str(workers), "@RUN@": run_dir, "@PORT@": str(port), "@JSON@": esc(body),
                 "@SSE_SETS@": sets, "@SSE_VARS@": "".join(f"$sse{i}" for i in range(len(pieces)))}.items():
        conf = conf.replace(k, v)
    for d in ("nginx-body", "nginx-proxy", "nginx-fastcgi", "nginx-uwsgi", "nginx-scgi"):
        os.makedirs(os.path.join(run_dir, d), exist_ok=True)
    path = os.path.join(run_dir, "nginx.conf")
    open(path, "w").write(conf)
    return path


def keel_conf(run_dir, name="keel.toml", data_dir=None):
    data = data_dir or os.path.join(run_dir, "keel-data")
    os.makedirs(data, exist_ok=True)
    text = open(os.path.join(HERE, name)).read().replace("@DATA_DIR@", data)
    path = os.path.join(run_dir, name)
    open(path, "w").write(text)
    return path


# ------------------------------------------------------------ measurement ---

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    """utime + stime of the process and its threads (and waited-for children)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_mb(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return 0.0


def group_pids(pid):
    """The process and its descendants (nginx's workers, node's threads are one pid)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            kids = open(f"/proc/{p}/task/{p}/children").read().split()
        except OSError:
            kids = []
        todo.extend(int(k) for k in kids)
    return out


def loadavg():
    return " ".join(open("/proc/loadavg").read().split()[:3])


def http_json(url, body=None, method=None, timeout=5.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def versions():
    def first_line(cmd):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
            return (out.stdout or out.stderr).strip().splitlines()[0]
        except Exception as e:  # a missing tool is named, not fatal
            return f"unavailable ({e.__class__.__name__})"
    return {
        "nginx": first_line(["nginx", "-v"]),
        "haproxy": first_line(["haproxy", "-v"]),
        "wrk": first_line(["wrk", "--version"]),
        "node": first_line(["node", "--version"]),
        "kernel": os.uname().release,
        "cpus": os.cpu_count(),
        "cpu_model": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), ""),
    }
