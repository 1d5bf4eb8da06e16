#!/usr/bin/env python3
"""Many concurrent streams through keel's gateway (scripts/bench-gateway-streams).

Each level keeps N streams in flight: streamed chat completions arrive at
a fixed rate (open loop: keel_loadgen --rate), N divided by one stream's
length, for --seconds, each on a client connection of its own, to one
keel_stream_mock upstream (first token after --first-token-ms, then one
every --token-gap-ms, --tokens in all); the first stream's length ramps
the count up to N. Systems run in interleaved rounds:

  direct          the load generator straight to the mock: what the machine
                  gives with no gateway (the baseline each figure is taken against)
  keel-fibers     keel's gateway, requests on fibers over --fiber-threads threads
  keel-threads    (--threads-mode) the same gateway with a worker thread per request

For each: time to first token and whole-stream time (p50, p99), the
gateway's threads (the most seen, sampled every 50 ms), its RSS at the
end of the run, and its CPU per streamed token. Added figures are the
gateway's minus direct's in the same round; the medians over rounds are
reported, with the load average beside each run.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (BENCH_KEY, HERE, Procs, cpu_seconds, free_port, loadavg, log, median,  # noqa: E402
                    read_serving_port, rss_mb, wait_port)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", required=True, help="build directory with examples/gateway and bench/keel_*")
    p.add_argument("--out", required=True, help="results folder")
    p.add_argument("--streams", default="2000", help="comma-separated concurrency levels")
    p.add_argument("--gaps", default="10", help="comma-separated token gaps in ms, each run at every level")
    p.add_argument("--tokens", type=int, default=50)
    p.add_argument("--first-token-ms", type=int, default=20)
    p.add_argument("--seconds", type=float, default=30.0, help="how long streams keep arriving, per run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--fiber-threads", type=int, default=2)
    p.add_argument("--threads-mode", action="store_true", help="also run the gateway with a thread per request")
    return p.parse_args()


class Sampler:
    """The most threads and the highest RSS a process shows while it runs."""

    def __init__(self, pid):
        self.pid, self.threads, self.rss = pid, 0, 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                self.threads = max(self.threads, len(os.listdir(f"/proc/{self.pid}/task")))
                self.rss = max(self.rss, rss_mb(self.pid))
            except OSError:
                pass
            time.sleep(0.05)

    def stop(self):
        self._stop.set()
        self._t.join()


def loadgen(build, url, n, a, gap, key=None):
    body = os.path.join(HERE, "stream-request.json")
    stream_s = (a.first_token_ms + a.tokens * gap) / 1000.0
    rate = n / stream_s
    # Connections beyond N: a stream that runs long must not make the next one wait.
    args = [os.path.join(build, "bench", "keel_loadgen"), "--url", url, "--body", body, "--stream",
            "-H", "Content-Type: application/json", "--rate", f"{rate:.3f}", "--duration", str(a.seconds),
            "--max-conns", str(int(n * 1.25) + 16), "--timeout", "120", "--drain", str(stream_s * 2 + 10)]
    if key:
        args += ["-H", f"Authorization: Bearer {key}"]
    out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout)


def start_gateway(procs, a, run_dir, name, mock_port, fiber_threads, workers):
    data = os.path.join(run_dir, f"{name}-data")
    shutil.rmtree(data, ignore_errors=True)
    os.makedirs(data)
    text = open(os.path.join(HERE, "streams.toml")).read()
    for k, v in {"@DATA_DIR@": data, "@FIBER_THREADS@": str(fiber_threads), "@WORKERS@": str(workers)}.items():
        text = text.replace(k, v)
    conf = os.path.join(run_dir, f"{name}.toml")
    open(conf, "w").write(text)
    env = dict(os.environ, MOCK_PORT=str(mock_port))
    log_path = os.path.join(run_dir, f"{name}.log")
    p = procs.start(name, [os.path.join(a.build, "examples", "gateway"), "--config", conf], env=env)
    port = read_serving_port(log_path, proc=p)
    return p, port


def main():
    a = parse_args()
    os.makedirs(a.out, exist_ok=True)
    run_dir = os.path.join(a.out, "run")
    os.makedirs(run_dir, exist_ok=True)
    procs = Procs(run_dir)
    levels = [int(x) for x in a.streams.split(",")]
    gaps = [int(x) for x in a.gaps.split(",")]
    workers = int(max(levels) * 1.25) + 64
    results = []
    try:
        mock_port = free_port()
        systems = ["direct", "keel-fibers"] + (["keel-threads"] if a.threads_mode else [])
        for gap in gaps:
            mock = procs.start("mock", [os.path.join(a.build, "bench", "keel_stream_mock"), "--port", str(mock_port),
                                        "--first-token-ms", str(a.first_token_ms), "--tokens", str(a.tokens),
                                        "--token-gap-ms", str(gap)])
            wait_port(mock_port, proc=mock)
            gws = {}
            for s in systems[1:]:
                gws[s] = start_gateway(procs, a, run_dir, s, mock_port, a.fiber_threads if s == "keel-fibers" else 0,
                                       workers)
            for n in levels:
                for r in range(a.rounds):
                    for s in systems:
                        row = {"system": s, "streams": n, "gap_ms": gap, "round": r, "load": loadavg()}
                        if s == "direct":
                            res = loadgen(a.build, f"http://127.0.0.1:{mock_port}/v1/chat/completions", n, a, gap)
                        else:
                            p, port = gws[s]
                            sampler = Sampler(p.pid)
                            c0 = cpu_seconds(p.pid)
                            res = loadgen(a.build, f"http://127.0.0.1:{port}/v1/chat/completions", n, a, gap,
                                          BENCH_KEY)
                            cpu = cpu_seconds(p.pid) - c0
                            sampler.stop()
                            row.update({"threads_max": sampler.threads, "rss_mb_max": round(sampler.rss, 1),
                                        "cpu_s": round(cpu, 3),
                                        "cpu_us_per_token": round(cpu / max(1, res["ok"] * (a.tokens + 1)) * 1e6, 1)})
                        row.update({"ok": res["ok"], "requests": res["requests"], "status": res["status"],
                                    "ttft_ms": res["ttft_ms"], "latency_ms": res["latency_ms"]})
                        log(f"{s:13s} streams={n:5d} gap={gap}ms round {r}: ok {res['ok']}/{res['requests']} "
                            f"ttft p50 {res['ttft_ms'].get('p50', -1):.1f} p99 {res['ttft_ms'].get('p99', -1):.1f} ms"
                            + (f", threads {row['threads_max']}, rss {row['rss_mb_max']} MB, "
                               f"{row['cpu_us_per_token']} us CPU/token" if s != "direct" else "")
                            + f" (load {row['load']})")
                        results.append(row)
            for s in systems[1:]:
                procs.stop(s)
            procs.stop("mock")
    finally:
        procs.stop_all()

    summary = []
    for gap in gaps:
        for n in levels:
            for s in systems[1:]:
                added_p50, added_p99, total_p50 = [], [], []
                mine = [x for x in results if x["system"] == s and x["streams"] == n and x["gap_ms"] == gap]
                for x in mine:
                    d = next(y for y in results if y["system"] == "direct" and y["streams"] == n and
                             y["gap_ms"] == gap and y["round"] == x["round"])
                    added_p50.append(x["ttft_ms"]["p50"] - d["ttft_ms"]["p50"])
                    added_p99.append(x["ttft_ms"]["p99"] - d["ttft_ms"]["p99"])
                    total_p50.append(x["latency_ms"]["p50"] - d["latency_ms"]["p50"])
                direct = [y for y in results if y["system"] == "direct" and y["streams"] == n and y["gap_ms"] == gap]
                summary.append({
                    "system": s, "streams": n, "gap_ms": gap,
                    "ok": f"{sum(x['ok'] for x in mine)}/{sum(x['requests'] for x in mine)}",
                    "direct_ttft_p50_ms": median([y["ttft_ms"]["p50"] for y in direct]),
                    "direct_ttft_p99_ms": median([y["ttft_ms"]["p99"] for y in direct]),
                    "added_ttft_p50_ms": median(added_p50), "added_ttft_p99_ms": median(added_p99),
                    "added_stream_p50_ms": median(total_p50),
                    "threads_max": max(x["threads_max"] for x in mine),
                    "rss_mb_max": max(x["rss_mb_max"] for x in mine),
                    "cpu_us_per_token": median([x["cpu_us_per_token"] for x in mine]),
                    "loads": [x["load"] for x in mine]})
    json.dump({"args": vars(a), "runs": results, "summary": summary}, open(os.path.join(a.out, "streams.json"), "w"),
              indent=1)
    lines = ["| system | streams | token gap | ok | direct TTFT p50 / p99 | added TTFT p50 / p99 | added stream p50 | "
             "threads (max) | RSS (max) | CPU per token | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in summary:
        lines.append(f"| {x['system']} | {x['streams']} | {x['gap_ms']} ms | {x['ok']} | "
                     f"{x['direct_ttft_p50_ms']:.1f} / {x['direct_ttft_p99_ms']:.1f} ms | "
                     f"{x['added_ttft_p50_ms']:+.1f} / {x['added_ttft_p99_ms']:+.1f} ms | "
                     f"{x['added_stream_p50_ms']:+.0f} ms | {x['threads_max']} | {x['rss_mb_max']:.0f} MB | "
                     f"{x['cpu_us_per_token']:.1f} us | {x['loads'][0]} |")
    md = "\n".join(lines) + "\n"
    open(os.path.join(a.out, "streams.md"), "w").write(md)
    print(md)


if __name__ == "__main__":
    main()
