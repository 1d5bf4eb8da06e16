#!/usr/bin/env python3
"""Reads the Google Benchmark JSON files scripts/bench wrote and prints each
benchmark's median beside the baseline measured in the same run (the same
binary, the same arguments and threads) and their ratio; writes all of it
as one JSON file.

  bench/report.py OUT.json RESULT.json...

A baseline is the plain thing doing the same work without keel: a timed
call, a counting semaphore, raw sqlite3 / libpq / hiredis, a bare
curl_easy_perform, a bare line split. The table of which is which is
BASELINES below; a benchmark with none is printed alone.
"""
import json
import os
import re
import sys

# (benchmark name pattern, its baseline's name), first match wins.
BASELINES = [
    (r"^BM_Baseline_", None),
    (r"^BM_DirectCall$", None),
    (r"^BM_Bulkhead_AcquireRelease$", "BM_Baseline_CountingSemaphore"),
    (r"^BM_AdaptiveLimiter_AcquireRelease$", "BM_Baseline_CountingSemaphore"),
    (r"^BM_Pipeline_(NullListener|MetricsListener)$", "BM_Pipeline_NoListener"),
    (r"^BM_Pipeline_OneRetry_MetricsListener$", "BM_Pipeline_OneRetry_NullListener"),
    (r"^BM_Pipeline_", "BM_Baseline_TimedCall"),
    (r"^BM_(Idempotency_BeginCommit|Lease_ClaimRelease)_Sqlite$", "BM_Baseline_Sqlite_RawUpsert"),
    (r"^BM_JobQueue_", "BM_Baseline_Sqlite_RawJobTransactions"),
    (r"_Postgres$", "BM_Baseline_Postgres_RawUpsert"),
    (r"^BM_Idempotency_BeginCommit_Redis$", "BM_Baseline_Redis_RawHset"),
    (r"^BM_SharedQuota_Acquire_Redis$", "BM_Baseline_Redis_RawHset"),
    (r"^BM_Lease_ClaimRelease_Redis$", "BM_Baseline_Redis_RawIncr"),
    (r"^BM_SharedConcurrency_AcquireRelease_Redis$", "BM_Baseline_Redis_RawSetDel"),
    (r"^BM_SharedProviderState_HealthyPass$", "BM_Baseline_BreakerRegistry_Pass"),
    (r"^BM_Hedge_PrimaryWins", "BM_Hedge_Baseline_NoHedge"),
    (r"^BM_AsyncRun_Empty$", "BM_SyncRun_Empty"),
    (r"^BM_AsyncPipeline_Full_Success", "BM_SyncPipeline_Full_Success"),
    (r"^BM_AsyncHedge_PrimaryWins$", "BM_SyncHedge_PrimaryWins_OnCallerThread"),
    (r"^BM_Sync", None),
    (r"^BM_FanOut_8Units_AllCached$", "BM_Baseline_Store_8Saves"),
    (r"^BM_FanOut_8Units_Fresh$", "BM_Baseline_Pool_8Tasks"),
    (r"^BM_Http_Call$", "BM_Baseline_CurlEasyPerform"),
    (r"^BM_Http_Exchange$", "BM_Baseline_CurlEasyPerform"),
    (r"^BM_AsyncHttp_Exchange", "BM_Http_Exchange"),  # the event loop beside the blocking client
    (r"^BM_Sse_LineSplit_Nlohmann$", None),  # a second baseline: what gateways commonly write
    (r"^BM_Sse_Parse$", "BM_Sse_LineSplit"),
    (r"^BM_Stream_(PerToken|PerToolDelta|PerEvent_Relay)$", "BM_Stream_PerToken_Bare"),
    (r"^BM_Stream_ParsedIntoPolicy$", "BM_Stream_ParserOnly"),
    (r"^BM_Grpc_UnaryCall$", "BM_Grpc_BareStubCall"),
    (r"^BM_Chaos_(Off|Off_Outermost|On_Fault)$", "BM_Chaos_Without"),
]

UNIT_NS = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}


def split_name(run_name):
    """'BM_X/full:0/threads:2/real_time' -> ('BM_X', ['full:0', 'threads:2'], real_time?)"""
    parts = run_name.split("/")
    real = "real_time" in parts
    return parts[0], [p for p in parts[1:] if p != "real_time"], real


def medians(path):
    data = json.load(open(path))
    out = {}
    benchmarks = data.get("benchmarks", [])
    aggregated = any(b.get("run_type") == "aggregate" for b in benchmarks)
    for b in benchmarks:
        # With repetitions, the median of them; with one run, the run.
        if aggregated and not (b.get("run_type") == "aggregate" and b.get("aggregate_name") == "median"):
            continue
        if b.get("error_occurred"):
            continue
        base, args, real = split_name(b.get("run_name", b["name"]))
        t = b["real_time"] if real else b["cpu_time"]
        out[(base, tuple(args))] = {"ns": t * UNIT_NS[b.get("time_unit", "ns")], "real": real,
                                    "allocs": b.get("allocs/iter"), "name": b.get("run_name", b["name"])}
    return out, data.get("context", {})


def baseline_for(base, args, results):
    for pattern, bl in BASELINES:
        if re.search(pattern, base):
            if bl is None:
                return None
            if (bl, args) in results:
                return (bl, args)
            threads = tuple(a for a in args if a.startswith("threads:"))
            for key in results:  # the same threads, other arguments
                if key[0] == bl and tuple(a for a in key[1] if a.startswith("threads:")) == threads:
                    return key
            for key in results:
                if key[0] == bl:
                    return key
            return None
    return None


def fmt_ns(ns):
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.2f} us"
    return f"{ns:.1f} ns"


def main():
    out_path, files = sys.argv[1], sys.argv[2:]
    report = {}
    for path in files:
        area = os.path.basename(path).replace("keel_bench_", "").replace(".json", "")
        results, ctx = medians(path)
        rows = []
        for (base, args), r in sorted(results.items()):
            bl = baseline_for(base, args, results)
            row = {"benchmark": r["name"], "median_ns": r["ns"], "clock": "real" if r["real"] else "cpu",
                   "allocs_per_iter": r["allocs"]}
            if bl is not None:
                row["baseline"] = results[bl]["name"]
                row["baseline_ns"] = results[bl]["ns"]
                row["ratio"] = r["ns"] / results[bl]["ns"] if results[bl]["ns"] else None
            rows.append(row)
        report[area] = {"context": {k: ctx.get(k) for k in ("date", "num_cpus", "mhz_per_cpu", "load_avg")},
                        "benchmarks": rows}
        print(f"\n== {area} (load average {ctx.get('load_avg')}) ==")
        print(f"{'benchmark':58} {'median':>11} {'baseline (same run)':>56} {'ratio':>7}")
        for row in rows:
            b = f"{row['baseline']} {fmt_ns(row['baseline_ns'])}" if "baseline" in row else ""
            ratio = f"{row['ratio']:.2f}x" if row.get("ratio") else ""
            print(f"{row['benchmark'][:58]:58} {fmt_ns(row['median_ns']):>11} {b[-56:]:>56} {ratio:>7}")
    json.dump(report, open(out_path, "w"), indent=1)
    print(f"\nJSON: {out_path}")


if __name__ == "__main__":
    main()
