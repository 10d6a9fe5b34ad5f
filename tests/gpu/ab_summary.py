#!/usr/bin/env python3
"""Summarises a same-machine A/B of GPU benchmarks (tests/gpu/run.sh ab).

    python3 tests/gpu/ab_summary.py OUT ROUNDS PREFIX TAG...

reads OUT/PREFIX-TAG-R.json for every TAG and round R in 1..ROUNDS (bench-results JSON:
{"results": [{"name", "params", "value", "unit"}]}), and prints one row per result present for
every tag: the mean of each tag, the slowdown of each tag against the first (time ratio: for a
throughput, base / tag), and the spread of the repeated runs of each binary (max / min - 1). A row
is flagged SLOWER when a tag is slower than the first by more than the larger of the two spreads.
Exit status 0 always (the table is the evidence; run.sh decides nothing on it).
"""
import json
import statistics
import sys


def key_of(row):
    params = ",".join(f"{k}={v}" for k, v in sorted(row.get("params", {}).items()))
    return f"{row['name']}[{params}]"


def load(out, prefix, tag, rounds):
    runs = []
    units = {}
    for r in range(1, rounds + 1):
        path = f"{out}/{prefix}-{tag}-{r}.json"
        rows = {}
        for row in json.load(open(path))["results"]:
            value = row.get("value")
            if not isinstance(value, (int, float)) or value <= 0:
                continue
            rows[key_of(row)] = float(value)
            units[key_of(row)] = row.get("unit", "")
        runs.append(rows)
    keys = set.intersection(*(set(r) for r in runs))
    means = {k: statistics.mean(r[k] for r in runs) for k in keys}
    spreads = {k: max(r[k] for r in runs) / min(r[k] for r in runs) - 1.0 for k in keys}
    return means, spreads, units


def main():
    out, rounds, prefix, tags = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    data = {t: load(out, prefix, t, rounds) for t in tags}
    base = tags[0]
    keys = sorted(set.intersection(*(set(data[t][0]) for t in tags)))
    worst_spread = 0.0
    flagged = 0
    print(f"A/B {prefix}: mean of {rounds} rounds; slowdown = time ratio to {base}; spread = "
          "max/min - 1 of one binary's rounds")
    for k in keys:
        unit = data[base][2].get(k, "")
        higher_is_better = "/s" in unit
        cells = []
        base_value = data[base][0][k]
        for t in tags:
            v = data[t][0][k]
            slowdown = base_value / v if higher_is_better else v / base_value
            spread = data[t][1][k]
            worst_spread = max(worst_spread, spread)
            mark = ""
            if t != base and slowdown - 1.0 > max(spread, data[base][1][k]):
                mark = " SLOWER"
                flagged += 1
            cells.append(f"{t}={v:.4g} ({slowdown:.3f}x, +-{spread * 100:.1f}%){mark}")
        print(f"{k} [{unit}]: " + "  ".join(cells))
    print(f"A/B {prefix}: {len(keys)} rows, {flagged} slower than the spread of repeated runs "
          f"(largest spread {worst_spread * 100:.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
