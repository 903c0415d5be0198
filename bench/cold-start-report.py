#!/usr/bin/env python3
"""Report of bench/cold-start.sh (stdlib only): medians of its raw rows, the ratios
issue 16 asks for, and the chart's data and gnuplot script.

Reads OUT/raw.tsv (one row per phase and round) and OUT/workloads.tsv (workload, command,
bytes its startup trace read); writes OUT/results.tsv and OUT/results.json (medians),
OUT/result.txt (the table and ratios) and OUT/chart.gp with its chart-*.dat files (for
`gnuplot OUT/chart.gp`, which draws OUT/cold-start.png).
"""

import argparse
import csv
import json
import os
import statistics

PHASES = {
    "a": "(a) containerd pull + run",
    "b": "(b) ferry, no trace",
    "c": "(c) ferry, published trace",
    "d": "(d) ferry, warm store",
    "e": "(e) chroot, cold page cache",
    "f": "(f) ferry, new tag, old trace",
}
NUMERIC = [
    "first_s", "pull_s", "wire", "wire_first", "fetched", "fetched_first", "requests",
    "requests_first", "read_waits", "read_waits_first", "served", "cpu_daemon_s",
    "cpu_registry_s", "rss_kib",
]


def median(values):
    vals = [float(v) for v in values if v not in ("", None)]
    return statistics.median(vals) if vals else None


def load(args):
    with open(args.raw, newline="") as f:
        raw = list(csv.DictReader(f, delimiter="\t"))
    groups = {}
    for r in raw:
        key = (r["registry"], r["latency_ms"], r["workload"], r["phase"])
        groups.setdefault(key, []).append(r)
    rows = []
    for key, rs in groups.items():
        m = {c: median(r[c] for r in rs) for c in NUMERIC}
        m["first_rounds"] = [float(r["first_s"]) for r in rs if r["first_s"]]
        rows.append(dict(zip(("registry", "latency_ms", "workload", "phase"), key), rounds=len(rs), **m))
    workloads = []
    with open(args.workloads) as f:
        for line in f:
            name, cmd, trace_bytes, trace = (line.rstrip("\n").split("\t") + ["", "", ""])[:4]
            workloads.append({"name": name, "command": cmd, "trace_bytes": int(trace_bytes) if trace_bytes else None,
                              "trace": trace or "none"})
    return rows, workloads


def fmt_mb(v):
    return "-" if v is None else f"{v / 1e6:.1f}"


def fmt(v, spec="{:.2f}"):
    return "-" if v is None else spec.format(v)


def ratios(rows, workloads):
    """The ratios of issue 16, per registry and workload, where both sides ran."""
    t = {(r["registry"], r["latency_ms"], r["workload"], r["phase"]): r for r in rows}
    regs = list(dict.fromkeys(r["registry"] for r in rows if r["registry"] != "-"))
    lats = sorted({r["latency_ms"] for r in rows if r["latency_ms"] != "-"}, key=int)
    out = []

    def add(reg, w, name, num, den, goal, better):
        if num is None or den is None or den <= 0:
            return
        v = num / den
        met = v <= goal if better == "<=" else v >= goal
        out.append({"registry": reg, "workload": w["name"], "ratio": name, "value": round(v, 2),
                    "goal": f"{better} {goal}", "met": met})

    def first(reg, lat, w, ph):
        r = t.get((reg, lat, w, ph))
        return r["first_s"] if r else None

    for reg in regs:
        for w in workloads:
            n = w["name"]
            floor = first("-", "-", n, "e")
            for lat, goal in (("0", 1.5), ("10", 2.5)):
                add(reg, w, f"b/e at {lat} ms", first(reg, lat, n, "b"), floor, goal, "<=")
            add(reg, w, "a/b at 10 ms", first(reg, "10", n, "a"), first(reg, "10", n, "b"), 6, ">=")
            for lat in lats:
                add(reg, w, f"c/d at {lat} ms", first(reg, lat, n, "c"), first(reg, lat, n, "d"), 1.2, "<=")
            for lat in lats:
                add(reg, w, f"f/d at {lat} ms", first(reg, lat, n, "f"), first(reg, lat, n, "d"), 1.3, "<=")
            for lat in lats:
                b = t.get((reg, lat, n, "b"))
                if b is None:
                    continue
                # what the command reads: its trace (all of it crossed FUSE, nothing
                # cached), else what (b) served through FUSE
                read = (w["trace"] == "published" and w["trace_bytes"]) or b["served"]
                add(reg, w, f"fetched before first output / read, (b) at {lat} ms", b["fetched_first"], read, 1.5, "<=")
    return out


def table(rows, workloads, ratio_rows, args):
    order = {w["name"]: i for i, w in enumerate(workloads)}
    lines = [
        f"cold start, {args.image} ({args.image_bytes / 1e6:.0f} MB compressed), {args.runs} round(s), medians",
        "first = seconds from the start of the pull to the first output line ((a): the pull, once per",
        "registry and latency, + the run); wire = MB the latency proxy sent to the node (- at 0 ms: no",
        "proxy; (a) moves the whole image); fetched = the daemon's bytes_fetched; @1st = when the first",
        "line arrived; req = Range requests, waits = reads that waited for the network (at first output);",
        "cpu = CPU seconds of the daemon / registry from the pull to the first line; RSS after the run.",
        "",
    ]
    head = f"{'workload':<8} {'phase':<29} {'first':>7} {'pull':>6} {'wire':>7} {'wire@1st':>8} {'fetched':>8} {'fetch@1st':>9} {'req':>5} {'waits':>5} {'cpu-d':>6} {'cpu-r':>6} {'RSS MB':>6}"
    floors = [r for r in rows if r["phase"] == "e"]
    if floors:
        lines.append("no registry")
        lines.append(head)
        for r in sorted(floors, key=lambda r: order.get(r["workload"], 99)):
            lines.append(f"{r['workload']:<8} {PHASES['e']:<29} {fmt(r['first_s']):>7}")
        lines.append("")
    reg_order = {reg: i for i, reg in enumerate(dict.fromkeys(r["registry"] for r in rows))}
    setups = sorted({(r["registry"], r["latency_ms"]) for r in rows if r["phase"] != "e"}, key=lambda k: (reg_order[k[0]], int(k[1])))
    for reg, lat in setups:
        lines.append(f"registry {reg}, {lat} ms one way")
        lines.append(head)
        sel = [r for r in rows if (r["registry"], r["latency_ms"]) == (reg, lat)]
        for r in sorted(sel, key=lambda r: (order.get(r["workload"], 99), r["phase"])):
            rss = None if r["rss_kib"] is None else r["rss_kib"] / 1024
            lines.append(
                f"{r['workload']:<8} {PHASES[r['phase']]:<29} {fmt(r['first_s']):>7} {fmt(r['pull_s']):>6} "
                f"{fmt_mb(r['wire']):>7} {fmt_mb(r['wire_first']):>8} {fmt_mb(r['fetched']):>8} "
                f"{fmt_mb(r['fetched_first']):>9} {fmt(r['requests_first'], '{:.0f}'):>5} "
                f"{fmt(r['read_waits_first'], '{:.0f}'):>5} {fmt(r['cpu_daemon_s']):>6} "
                f"{fmt(r['cpu_registry_s']):>6} {fmt(rss, '{:.0f}'):>6}"
            )
        lines.append("")
    if ratio_rows:
        lines.append("ratios (issue 16)")
        for q in ratio_rows:
            lines.append(f"  {q['registry']:<7} {q['workload']:<8} {q['ratio']:<52} {q['value']:>7.2f}  goal {q['goal']:<6} {'met' if q['met'] else 'NOT met'}")
    for w in workloads:
        if w["trace"] == "failed":
            lines.append(f"trace of {w['name']}: `ferry trace record` failed (trace-{w['name']}.txt), nothing published: its (c) ran without a trace")
        elif w["trace"] == "partial":
            lines.append(f"trace of {w['name']}: the command failed under `ferry trace record` (trace-{w['name']}.txt): its (c) ran with a partial trace")
    reads = [w for w in workloads if w["trace_bytes"]]
    if reads:
        lines.append("read = bytes the startup trace saw the command read: " + ", ".join(f"{w['name']} {w['trace_bytes'] / 1e6:.1f} MB" for w in reads))
    return "\n".join(lines) + "\n"


def chart(rows, workloads, out):
    """One panel per (registry, latency): first output per system, grouped by workload."""
    t = {(r["registry"], r["latency_ms"], r["workload"], r["phase"]): r["first_s"] for r in rows}
    regs = list(dict.fromkeys(r["registry"] for r in rows if r["phase"] != "e"))
    lats = sorted({r["latency_ms"] for r in rows if r["phase"] != "e"}, key=int)
    phases = [p for p in "abcdef" if any(r["phase"] == p for r in rows)]
    cols, nrows = max(len(lats), 1), max(len(regs), 1)
    png = os.path.join(out, "cold-start.png")
    top = 30 * max([r["first_s"] for r in rows if r["first_s"]] + [1])
    gp = [
        f"set terminal pngcairo size {420 * cols + 80},{360 * nrows + 60} font 'sans,9'",
        f"set output '{png}'",
        "set datafile missing '-'",
        "set style data histograms",
        "set style histogram clustered gap 1",
        "set style fill solid 0.85 border -1",
        "set boxwidth 0.9",
        "set logscale y",
        # room above the tallest bar for the key (drawn in the first panel only)
        f"set yrange [0.1:{top}]",
        "set grid ytics",
        "set ylabel 'first output (s, log scale)'",
        "set key top right font 'sans,8'",
        f"set multiplot layout {nrows},{cols} title 'cold start to first output (bench/cold-start.sh)'",
    ]
    for reg in regs:
        for lat in lats:
            dat = os.path.join(out, f"chart-{reg}-{lat}.dat")
            with open(dat, "w") as f:
                f.write("workload " + " ".join(phases) + "\n")
                for w in workloads:
                    vals = []
                    for p in phases:
                        v = t.get(("-", "-", w["name"], "e") if p == "e" else (reg, lat, w["name"], p))
                        vals.append("-" if v is None else f"{v:.3f}")
                    f.write(w["name"] + " " + " ".join(vals) + "\n")
            gp.append(f"set title '{reg} registry, {lat} ms one way'")
            plots = [f"'{dat}' using {i + 2}:xtic(1) title '{PHASES[p]}'" if i == 0 else f"'' using {i + 2} title '{PHASES[p]}'" for i, p in enumerate(phases)]
            gp.append("plot " + ", ".join(plots))
            gp.append("unset key")
    gp.append("unset multiplot")
    with open(os.path.join(out, "chart.gp"), "w") as f:
        f.write("\n".join(gp) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--raw", required=True)
    ap.add_argument("--workloads", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--image", required=True)
    ap.add_argument("--image-bytes", type=int, required=True)
    ap.add_argument("--runs", type=int, required=True)
    args = ap.parse_args()
    rows, workloads = load(args)
    ratio_rows = ratios(rows, workloads)
    cols = ["registry", "latency_ms", "workload", "phase", "rounds"] + NUMERIC
    with open(os.path.join(args.out, "results.tsv"), "w") as f:
        f.write("\t".join(cols) + "\n")
        for r in rows:
            f.write("\t".join("" if r[c] is None else str(r[c]) for c in cols) + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"image": args.image, "image_bytes": args.image_bytes, "runs": args.runs,
                   "workloads": workloads, "phases": PHASES, "medians": rows, "ratios": ratio_rows}, f, indent=1)
    with open(os.path.join(args.out, "result.txt"), "w") as f:
        f.write(table(rows, workloads, ratio_rows, args))
    chart(rows, workloads, args.out)


if __name__ == "__main__":
    main()
