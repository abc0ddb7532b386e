#!/usr/bin/env python3
"""A/B of two racekv builds on the benchmarks of docs/benchmarks.md, in alternating runs.

    ops/bench-ab.py --a OLD/racekv --b NEW/racekv [--pairs 3] [--only ops,redis] [--out ab.json]

Each case runs A then B (then A, B, ...) `--pairs` times, so both see the same drift of a
shared machine. For each figure it prints the medians and B/A (above 1: B is faster, or
for latencies smaller, see `higher_is_better`). Where a bench measures a peer in the same
run (redis-server), the racekv/peer ratio is compared too, which cancels most noise.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

# (name, bench arguments, extractor: report -> {figure: (value, higher_is_better)}).
CASES = [
    (
        "ops-shm-get",
        ["ops", "--transport", "shm", "--threads", "1", "--keys", "1000000", "--get-ratio", "1.0", "--seconds", "5"],
        lambda r: {"get_ops_per_sec": (r["ops_per_sec"], True), "ratio_to_memory_limit": (r["ratio_to_memory_limit"], True)},
    ),
    (
        "ops-shm-upsert",
        ["ops", "--transport", "shm", "--threads", "1", "--keys", "1000000", "--get-ratio", "0.0", "--seconds", "5"],
        lambda r: {"put_ops_per_sec": (r["ops_per_sec"], True)},
    ),
    (
        "ops-tcp-mixed",
        ["ops", "--transport", "tcp", "--threads", "1", "--keys", "100000", "--get-ratio", "0.5", "--seconds", "5"],
        lambda r: {"ops_per_sec": (r["ops_per_sec"], True)},
    ),
    (
        "rpc-tcp",
        ["rpc", "--transport", "tcp", "--threads", "1,8", "--seconds", "2"],
        lambda r: {f"{p['mode']}_t{p['threads']}_ops_per_sec": (p["ops_per_sec"], True) for p in r["results"]},
    ),
    (
        "attach-tcp",
        ["attach", "--transport", "tcp"],
        lambda r: {"attach_p50_us": (r["attach_p50_us"], False), "attach_then_get_p50_us": (r["attach_then_get_p50_us"], False)},
    ),
    (
        "redis",
        ["redis", "--ops", "get,set", "--pipeline", "1,16", "--rounds", "1", "--requests", "300000"],
        lambda r: {
            f"{p['op']}_p{p['pipeline']}_ratio_to_redis_server": (p["ratio"], True) for p in r["results"]
        },
    ),
]


def run(binary, args):
    out = subprocess.run([binary, "bench", *args, "--json"], check=True, capture_output=True, text=True).stdout
    # The report is the last JSON object printed.
    return json.loads(out[out.index("{"):])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="the baseline racekv binary")
    parser.add_argument("--b", required=True, help="the candidate racekv binary")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--out", help="write every sample and the summary here as JSON")
    args = parser.parse_args()
    only = {c for c in args.only.split(",") if c}
    cases = [c for c in CASES if not only or c[0] in only]
    unknown = only - {c[0] for c in CASES}
    if unknown:
        sys.exit(f"unknown cases: {sorted(unknown)}; known: {[c[0] for c in CASES]}")
    samples = {}
    for name, bench_args, extract in cases:
        for pair in range(args.pairs):
            for side, binary in (("a", args.a), ("b", args.b)):
                started = time.time()
                figures = extract(run(binary, bench_args))
                print(f"{name} pair {pair + 1}/{args.pairs} {side}: {time.time() - started:.0f} s", file=sys.stderr)
                for figure, (value, higher) in figures.items():
                    if value is None:
                        continue  # not measured on this run (e.g. no memory-latency probe)
                    entry = samples.setdefault((name, figure), {"a": [], "b": [], "higher_is_better": higher})
                    entry[side].append(value)
    summary = []
    print(f"{'case':16} {'figure':40} {'A median':>12} {'B median':>12} {'B/A':>6}  better")
    for (name, figure), s in samples.items():
        a, b = statistics.median(s["a"]), statistics.median(s["b"])
        ratio = b / a if a else float("nan")
        better = "higher" if s["higher_is_better"] else "lower"
        print(f"{name:16} {figure:40} {a:12.3f} {b:12.3f} {ratio:6.3f}  {better}")
        summary.append({"case": name, "figure": figure, "a": s["a"], "b": s["b"], "b_over_a": ratio, "better": better})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"a": args.a, "b": args.b, "pairs": args.pairs, "results": summary}, f, indent=1)


if __name__ == "__main__":
    main()
