"""The results as a markdown table (for RESULTS.md and the README) and one PNG chart."""

from __future__ import annotations

from pathlib import Path


def markdown(machine: dict, load: dict, r: dict) -> str:
    lines = [
        f"Measured {machine['date']} on {machine['nproc']} × {machine['cpu']}; Python "
        f"{machine['python']}, Celery {machine['celery']}, redis-py {machine['redis-py']}, "
        f"Redis {machine['redis-server']}. Load average (1/5/15 min) at start "
        f"{load['start']}, at end {load['end']}.",
        "",
    ]
    if "stream" in r:
        lines += stream_table(r["stream"])
    if "overhead" in r:
        o = r["overhead"]
        lines += [
            f"**Per-task overhead** — {o['n']} no-op tasks per batch through one solo worker "
            f"(Redis broker and results), {o['rounds']} interleaved rounds, median; "
            "`exclusive` keeps its leases in Redis, `exclusive (store)` in that store:",
            "",
            "| base class | ms per task | time vs plain `Task` (of its kind: `acks_late` or not) |",
            "|---|---:|---:|",
        ]
        for name, ratio in o["ratio"].items():
            lines.append(f"| {name} | {o['per_task_ms'][name]:.2f} | {ratio:.3f}x |")
        lines.append("")
    if "primitive" in r:
        p = r["primitive"]
        lines += [
            f"**Lock primitive** — acquire + release pairs per second, one client, one key, "
            f"median of {p['rounds']} rounds of {p['pairs']}:",
            "",
            "| lock | pairs/s |",
            "|---|---:|",
        ]
        lines += [f"| {name} | {rate:,.0f} |" for name, rate in p["per_second"].items()]
        lines.append("")
    if "breakdown" in r:
        lines += breakdown(r["breakdown"])
    if "library" in r:
        x = r["library"]
        lines += [
            f"**Library Python per call** — one process, leases in the memory store, "
            f"median of {x['rounds']} interleaved rounds of {x['cycles']} calls made as a "
            "solo worker makes them:",
            "",
            "| call | µs |",
            "|---|---:|",
        ]
        lines += [f"| {name} | {us:.1f} |" for name, us in x["calls_us"].items()]
        lines += [f"| added by the lease | {x['added_us']:.1f} |"]
        if "added_fastest_us" in x:
            lines += [
                f"| added by the lease, fastest of 25 blocks of 1,000 calls | "
                f"{x['added_fastest_us']:.1f} |"
            ]
        lines += [""]
    if "handoff" in r:
        lines += [
            "**Handoff** — holder's release to the waiting duplicate's start, on another worker:",
            "",
            "| policy | samples | p50 | p99 | max |",
            "|---|---:|---:|---:|---:|",
        ]
        for policy, h in r["handoff"].items():
            lines.append(
                f"| `{policy}` | {h['samples']} | {h['p50_ms']:.1f} ms | {h['p99_ms']:.1f} ms "
                f"| {h['max_ms']:.1f} ms |"
            )
        lines.append("")
    if "failover" in r:
        f = r["failover"]
        lines += [
            f"**Failover** — SIGKILL of the holder to the next acquisition, "
            f"`lease_ttl={f['ttl']:g}` s (median of trials):",
            "",
            "| killed | trials | key free after | next run started after (max) |",
            "|---|---:|---:|---:|",
        ]
        for what in ("whole worker", "pool child only"):
            x = f[what]
            lines.append(
                f"| {what} | {x['trials']} | {x['freed_s']:.2f} s | {x['next_start_s']:.2f} s "
                f"({x['next_start_max_s']:.2f} s) |"
            )
        lines.append("")
    if "scale" in r:
        s = r["scale"]
        table = s["per_second"]
        columns = list(next(iter(table.values())))
        lines += [
            f"**Scale** — tasks per second, {s['n']} tasks with a {s['body_ms']:g} ms body, "
            "`wait` policy, task *i* on key *i* mod keys (plain `Task`: no lease):",
            "",
            "| processes | " + " | ".join(columns) + " |",
            "|---:|" + "---:|" * len(columns),
        ]
        for processes, row in table.items():
            lines.append(f"| {processes} | " + " | ".join(f"{row[c]:.0f}" for c in columns) + " |")
        lines.append("")
    if "beat" in r:
        lines += beat_table(r["beat"])
    if "web" in r:
        lines += web_table(r["web"])
    if "rates" in r:
        lines += rates_table(r["rates"])
    return "\n".join(lines)


def rates_table(r: dict) -> list[str]:
    """How exact a rate per key is, and what a call under one costs (rates.py)."""
    e, c = r["exactness"], r["cost"]
    return [
        f"**A rate per key** — `exclusive_rate={e['rate']!r}`, {e['processes']} processes "
        f"calling one key in a loop ({e['calls']:,} calls): the most grants in any period "
        f"(by the store's clock) is {e['most_in_a_period']} for a rate of {e['limit']}, and "
        f"{e['admitted_of_ceiling']:.0%} of what the rate allows over the time ran. One "
        f"process, a key per call, median of {c['rounds']} rounds of {c['calls']}:",
        "",
        "| call | µs per call |",
        "|---|---:|",
        *(f"| {name} | {us:.0f} |" for name, us in c["us_per_call"].items()),
        f"| ratio | {c['ratio']:.3f}x |",
        "",
    ]


def stream_table(s: dict) -> list[str]:
    """Per-task time inside one worker, every variant in one stream (stream.py): a table
    per hiredis setting, a pair of columns per harness and pool."""
    lines = [
        f"**Per-task time in one worker** — no-op tasks of every variant shuffled into one "
        f"stream ({s['per_variant']} of each per round), Redis broker and results; a task's "
        "time runs from its start to the next task's start in the same process; median per "
        f"round over plain `Task`'s (`acks_late`: over plain `acks_late`), median of "
        f"{s['rounds']} rounds. `queued`: the stream is queued first, then drained; `live`: "
        "sent while the worker drains it (producer, worker and Redis share the cores).",
        "",
    ]
    for run in s["runs"]:
        columns = list(run["columns"])
        lines += [
            f"{'With' if run['hiredis'] else 'Without'} hiredis; load average at start "
            f"{run['load']['start']}, at end {run['load']['end']}:",
            "",
            "| variant | " + " | ".join(f"{c}: µs | {c}: vs plain" for c in columns) + " |",
            "|---|" + "---:|---:|" * len(columns),
        ]
        for name in run["columns"][columns[0]]["ratio"]:
            cells = []
            for column in columns:
                x = run["columns"][column]
                cells += [
                    f"{x['per_task_us'].get(name, 0):.0f}",
                    f"{x['ratio'].get(name, 0):.2f}x",
                ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def web_table(w: dict) -> list[str]:
    lines = [
        f"**Web view** — {w['leases']:,} held leases (one key in ten a semaphore with two "
        f"holders); one refresh of a page of {w['page_size']} keys with their marks, the "
        "beat panel and the feed; store round trips and median time, against the "
        "protocol's default page (every holder listed, each key's marks read on their own):",
        "",
        "| store | reads per refresh | ms | default page: reads | ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for store, row in w["per_refresh"].items():
        page, default = row["page"], row["default_page"]
        lines.append(
            f"| {store} | {page['reads']} | {page['ms']:.0f} | {default['reads']} "
            f"| {default['ms']:.0f} |"
        )
    lines.append("")
    return lines


def beat_table(b: dict) -> list[str]:
    ttl, intervals = b["ttl"], b["intervals"]
    bounds = " / ".join(f"{ttl + ttl / 3 + s:g}" for s in intervals.values())
    lines = [
        f"**Beat failover** — three `celery beat` processes and a worker; entries every "
        f"{', '.join(f'{s} s' for s in intervals.values())} (and a one-off where the "
        "scheduler has one); the leader stopped right after it sent the 15 s entry, by "
        f"{', '.join(b['signals'])}, a beat started in its place each time; lease ttl "
        f"(RedBeat: lock timeout) {ttl:g} s, loop interval 1 s; {b['runs']} runs:",
        "",
        "| scheduler | sends | sent twice | one-off sent | takeover after SIGKILL "
        "(median, max) | after SIGTERM | worst gap per entry (bound ttl + ttl/3 + interval) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for side, x in b["sides"].items():
        one_off = "—" if x["one_off_sends"] is None else ", ".join(map(str, x["one_off_sends"]))
        gaps = " / ".join(f"{x['worst_gap_s'][e]:.1f}" for e in intervals)
        lines.append(
            f"| {side} | {x['sends']} | {x['sent_twice']} | {one_off} "
            f"| {_pair(x['sigkill_takeover_s'])} | {_pair(x['sigterm_takeover_s'])} "
            f"| {gaps} s ({bounds}) |"
        )
    lines.append("")
    return lines


def _pair(values) -> str:
    return "—" if values is None else f"{values[0]:.2f} s, {values[1]:.2f} s"


def chart(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    if "overhead" in r:
        ratios = r["overhead"]["ratio"]
        ax = axes[0][0]
        colours = ["grey"] + [f"C{i}" for i in range(len(ratios) - 1)]
        ax.bar(list(ratios), list(ratios.values()), color=colours)
        ax.tick_params(axis="x", labelrotation=30)
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_title("Time for N no-op tasks, relative to plain Task")
        ax.set_ylim(0.9, max(1.3, max(ratios.values()) + 0.05))
    if "primitive" in r:
        rates = r["primitive"]["per_second"]
        ax = axes[0][1]
        ax.barh(list(rates), list(rates.values()))
        ax.set_title("Lock acquire+release pairs per second")
    if "handoff" in r:
        h = r["handoff"]
        ax = axes[1][0]
        x = range(len(h))
        ax.bar([i - 0.2 for i in x], [v["p50_ms"] for v in h.values()], 0.4, label="p50")
        ax.bar([i + 0.2 for i in x], [v["p99_ms"] for v in h.values()], 0.4, label="p99")
        ax.set_xticks(list(x), [f"on_duplicate={p}" for p in h])
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title("Handoff: release to next start")
        ax.legend()
    if "scale" in r:
        table = r["scale"]["per_second"]
        ax = axes[1][1]
        for column in next(iter(table.values())):
            ax.plot(list(table), [row[column] for row in table.values()], marker="o", label=column)
        ax.set_xlabel("worker processes")
        ax.set_ylabel("tasks/s")
        ax.set_xticks(list(table))
        ax.set_title("Throughput, 5 ms body")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def breakdown(b: dict) -> list[str]:
    """Where a task's lease costs go (benchmarks/breakdown.py), in µs."""
    pairs, calls = b["pairs_us"], b["calls_us"]
    floor = pairs["raw SET NX PX + DEL"]
    lines = [
        f"**Breakdown** — one process, one key, median of {b['rounds']} interleaved rounds "
        f"of {b['cycles']} cycles (µs per cycle; ratio to the raw pair or the plain call):",
        "",
        "| what | µs | ratio |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {us:.1f} | {us / floor:.2f}x |" for name, us in pairs.items()]
    plain = calls["plain Task.__call__"]
    lines += [f"| {name} | {us:.1f} | {us / plain:.2f}x |" for name, us in calls.items()]
    lines += [f"| {name} | {us:.2f} | |" for name, us in b["parts_us"].items()]
    lines += [f"| store time: {name} | {us:.2f} | |" for name, us in b["script_us"].items()]
    if "renewal" in b:
        x = b["renewal"]
        lines.append(
            f"| renewing {x['leases']:,} leases: scripts, longest in Redis (µs) "
            f"| {x['scripts']:.0f}, {x['longest script µs']:.0f} | |"
        )
    if "burst" in b:
        x = b["burst"]
        lines.append(
            f"| a burst of {x['keys']:,} keys: entries left, kept for (s) "
            f"| {x['entries left']:,}, {x['longest kept s']:,} | |"
        )
    lines.append("")
    return lines
