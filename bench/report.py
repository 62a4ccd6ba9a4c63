"""From trials to figures: medians, ratios taken inside one repetition, targets, table, plot."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

MIB = 2**20

#: The references every contender of a workload is divided by (when they ran), in table order.
REFERENCES = (
    ("bare1", "× bare ×1"),
    ("bare2", "× bare ×2 procs"),
    ("sb3", "× SB3 best"),
    ("torchrl", "× TorchRL"),
    ("async", "× AsyncVectorEnv"),
)


def rate(t: dict[str, Any]) -> float | None:
    """Env steps per second of a trial (TorchRL: of its second, warm ``evaluate()`` call)."""
    if not t.get("ok") or not t.get("env_steps"):
        return None
    seconds = t.get("run_s") if t["spec"].get("contender") == "torchrl" else t.get("wall_s")
    return float(t["env_steps"]) / float(seconds) if seconds else None


def eps_rate(t: dict[str, Any]) -> float | None:
    r = rate(t)
    return r * t["episodes"] / t["env_steps"] if r and t.get("episodes") else None


def _median(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(vals) if vals else None


def by_case(trials: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for t in trials:
        out[t["case"]].append(t)
    return out


def best_sb3(trials: list[dict[str, Any]]) -> dict[str, tuple[str, int]]:
    """Per workload, the SB3 (VecEnv, n_envs) with the highest median throughput so far."""
    best: dict[str, tuple[float, tuple[str, int]]] = {}
    for ts in by_case(trials).values():
        spec = ts[0]["spec"]
        if spec.get("contender") != "sb3" or str(spec.get("vec", "")).startswith("best-of"):
            continue
        r = _median([rate(t) for t in ts if rate(t)])
        w = ts[0]["workload"]
        if r and (w not in best or r > best[w][0]):
            best[w] = (r, (spec["vec"], int(spec["n_envs"])))
    return {w: v[1] for w, v in best.items()}


def _reference_case(workload: str, cases: dict[str, list[dict[str, Any]]], kind: str) -> str | None:
    """The case key of a reference contender on ``workload``."""
    mine = {k: v for k, v in cases.items() if v[0]["workload"] == workload}
    if kind == "sb3":
        best = best_sb3([t for ts in mine.values() for t in ts])
        if workload in best:
            vec, n = best[workload]
            for k, ts in mine.items():
                if ts[0]["spec"].get("contender") == "sb3" and (ts[0]["spec"].get("vec"),
                                                               ts[0]["spec"].get("n_envs")) == (vec, n):
                    return k
        return next((k for k, ts in mine.items() if ts[0]["spec"].get("contender") == "sb3"), None)
    if kind == "torchrl":
        # TorchRL runs on W1-2k only; its rate is the reference for W1-20k too.
        pool = cases if workload.startswith("W1") else mine
        return next((k for k, ts in pool.items() if ts[0]["spec"].get("contender") == "torchrl"
                     and ts[0]["workload"].startswith(workload.split("-")[0])), None)
    for k, ts in mine.items():
        spec = ts[0]["spec"]
        contender, procs = spec.get("contender"), spec.get("procs", 1)
        if kind == "bare1" and contender in ("bare", "bare_vector") and procs == 1:
            return k
        if kind == "bare2" and contender in ("bare", "bare_vector") and procs == 2:
            return k
        if kind == "async" and contender == "async_vector":
            return k
    return None


def paired_ratio(a: list[dict[str, Any]], b: list[dict[str, Any]], metric: Any = rate
                 ) -> float | None:
    """Median over repetitions of metric(a) / metric(b), pairing trials of the same repetition.

    A reference measured in another workload or fewer repetitions pairs by repetition where it
    can and otherwise with its own median.
    """
    b_by_rep = {t["rep"]: metric(t) for t in b if metric(t)}
    b_med = _median(list(b_by_rep.values()))
    ratios = []
    for t in a:
        va = metric(t)
        vb = b_by_rep.get(t["rep"], b_med)
        if va and vb:
            ratios.append(va / vb)
    return _median(ratios)


def steps_per_cpu(t: dict[str, Any]) -> float | None:
    if not t.get("ok") or not t.get("cpu_s") or not t.get("env_steps"):
        return None
    return float(t["env_steps"]) / float(t["cpu_s"])


def summarize(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Per case: medians over repetitions and the paired ratios against each reference."""
    cases = by_case(trials)
    out: dict[str, Any] = {}
    for key, ts in cases.items():
        ok = [t for t in ts if t.get("ok")]
        first = ts[0]
        row: dict[str, Any] = {
            "workload": first["workload"], "label": first["label"], "group": first["group"],
            "cores": first["cores"], "note": first.get("note", ""), "runs": len(ts), "ok": len(ok),
            "spec": first["spec"],
            "errors": sorted({t.get("error", "") for t in ts if not t.get("ok")}),
            "steps_per_s": _median([rate(t) for t in ok]),
            "episodes_per_s": _median([eps_rate(t) for t in ok]),
            "wall_s": _median([t.get("wall_s") for t in ok]),
            "cpu_s": _median([t.get("cpu_s") for t in ok]),
            "peak_rss_mib": _median([t["peak_rss"] / MIB for t in ok if t.get("peak_rss")]),
            "mean_return": _median([t.get("mean_return") for t in ok]),
            "episodes": _median([t.get("episodes") for t in ok]),
            "env_steps": _median([t.get("env_steps") for t in ok]),
            "returns_sha": sorted({t["returns_sha"] for t in ok if t.get("returns_sha")}),
            "imports_s": _median([t.get("imports_s") for t in ok]),
            "first_call_s": _median([t.get("first_call_s") for t in ok]),
            "policy_bytes_moved": _median([t.get("policy_bytes_moved") for t in ok]),
            "cache": next((t.get("cache") for t in ok if t.get("cache")), None),
            "setting": next((f"{t['spec'].get('vec')} n={t['spec'].get('n_envs')}" for t in ok
                             if t["spec"].get("contender") == "sb3"), None),
            "ratios": {}, "cpu_ratios": {}, "rss_ratio_bare1": None,
        }
        for kind, _ in REFERENCES:
            ref = _reference_case(first["workload"], cases, kind)
            if ref is None or ref == key:
                continue
            row["ratios"][kind] = paired_ratio(ts, cases[ref])
            row["cpu_ratios"][kind] = paired_ratio(ts, cases[ref], steps_per_cpu)
            if kind == "bare1":
                row["rss_ratio_bare1"] = paired_ratio(
                    ts, cases[ref], lambda t: t.get("peak_rss") if t.get("ok") else None)
                row["wall_ratio_bare1"] = paired_ratio(
                    ts, cases[ref], lambda t: t.get("wall_s") if t.get("ok") else None)
                bare = cases[ref]
                ref_sha = sorted({t["returns_sha"] for t in bare if t.get("returns_sha")})
                if row["returns_sha"] and ref_sha:
                    row["same_returns_as_bare"] = row["returns_sha"] == ref_sha
        out[key] = row
    return out


def _find(summary: dict[str, Any], workload: str, label_start: str) -> dict[str, Any] | None:
    """The row labelled exactly ``label_start``, else the first whose label starts with it."""
    rows = [r for r in summary.values() if r["workload"] == workload]
    return next((r for r in rows if r["label"] == label_start),
                next((r for r in rows if r["label"].startswith(label_start)), None))


def targets(summary: dict[str, Any], trials: list[dict[str, Any]], *, quick: bool
            ) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured figure and whether it is met."""
    out: list[dict[str, Any]] = []
    cases = by_case(trials)

    def add(name: str, value: float | None, goal: float, higher: bool, how: str) -> None:
        met = None if value is None else (value >= goal if higher else value <= goal)
        out.append({"target": name, "value": value, "goal": goal, "met": met, "how": how,
                    "quick_sizes": quick})

    def ratio_to(row: dict[str, Any] | None, kind: str) -> float | None:
        return None if row is None else row["ratios"].get(kind)

    for w, label in (("W1-20k", "evalfleet inprocess, 2 workers"),
                     ("W2-20k", "evalfleet inprocess, 2 workers")):
        row = _find(summary, w, label)
        core = _find(summary, w, "evalfleet core")
        b1 = _reference_case(w, cases, "bare1")
        ideal = None
        if row and b1:
            ideal = paired_ratio(cases[f"{w}/{row['label']}"], cases[b1],
                                 lambda t: rate(t) * (2.0 if t["group"] == "bare" else 1.0)
                                 if rate(t) else None)
        add(f"{w}: evalfleet 2 workers ≥ 0.85 × bare limit × 2 (bare run as 2 processes)",
            ratio_to(row, "bare2"), 0.85, True, "env steps/s, paired per repetition")
        add(f"{w}: evalfleet 2 workers ≥ 0.85 × (bare ×1 core rate × 2)", ideal, 0.85, True,
            "ideal: twice the single-core rate, which a shared 2-core machine rarely gives")
        add(f"{w}: evalfleet core (1 process) ≥ 0.85 × bare ×1 core", ratio_to(core, "bare1"),
            0.85, True, "run_shard with its slots vs the bare loop, same process count")
    row = _find(summary, "W1-20k", "evalfleet inprocess, 2 workers")
    add("W1: evalfleet ≥ 3 × SB3 evaluate_policy at its best VecEnv setting",
        ratio_to(row, "sb3"), 3.0, True, "W1-20k, evalfleet 2 workers vs SB3 best of W1-2k")
    row2 = _find(summary, "W1-2k", "evalfleet inprocess, 2 workers")
    add("W1: evalfleet ≥ 50 × TorchRL Evaluator (thread backend)",
        ratio_to(row or row2, "torchrl"), 50.0, True, "env steps/s")
    proc = _find(summary, "W1-iso", "evalfleet process, 2 workers, 16 envs")
    add("process isolation ≥ 2 × AsyncVectorEnv at equal env count (a process per env)",
        ratio_to(proc, "async"), 2.0, True,
        "W1-iso: 16 sandbox processes (2 workers) vs AsyncVectorEnv ×16, 400 episodes")
    packed = _find(summary, "W1-iso", "evalfleet process, 2 workers, 16 envs in")
    add("process isolation ≥ 2 × AsyncVectorEnv at equal env count (8 envs per sandbox)",
        ratio_to(packed, "async"), 2.0, True,
        "W1-iso: 16 envs in 2 sandbox processes (envs_per_sandbox=8) vs AsyncVectorEnv ×16")
    warm = _find(summary, "W4", "evalfleet warm, 8 episodes")
    bare8 = _find(summary, "W4", "bare loop, 8 episodes")
    overhead = None
    if warm and warm["wall_s"] is not None:
        overhead = warm["wall_s"] - (bare8["wall_s"] if bare8 and bare8["wall_s"] else 0.0)
    add("fixed overhead of a warm evaluation ≤ 1 s", overhead, 1.0, False,
        "wall of a warm 8-episode evaluation minus the bare loop's for the same 8 episodes")
    cold = _find(summary, "W4", "evalfleet cold CLI, 8 episodes")
    add("cold `python flows/eval.py` of 8 episodes ≤ 6 s", cold["wall_s"] if cold else None, 6.0,
        False, "fresh process: interpreter, Prefect server, Dask cluster, flow, exit")
    return out


def _fmt(x: float | None, digits: int = 2, suffix: str = "") -> str:
    if x is None:
        return "—"
    if abs(x) >= 1000:
        return f"{x:,.0f}{suffix}"
    if abs(x) >= 100:
        return f"{x:.0f}{suffix}"
    return f"{x:.{digits}f}{suffix}"


def _ratio(x: float | None) -> str:
    return "—" if x is None else (f"{x:.0f}×" if x >= 100 else f"{x:.2f}×")


def markdown(result: dict[str, Any]) -> str:
    """The README table: one section per workload, then W4, the targets and the errors."""
    meta, summary = result["meta"], result["summary"]
    m, v = meta["machine"], meta["versions"]
    lines = [
        f"Measured {meta['date']} on {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, "
        f"{m['os']} (CPU only; load average at start {m['load_avg_at_start'][0]:.1f}). "
        f"{meta['reps']} repetition(s); every ratio is the median over repetitions of a ratio "
        "taken inside one repetition.",
        "",
        "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".",
        "",
        f"Command: `{meta['command'].strip()}`.",
        "",
    ]
    workloads: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in summary.values():
        workloads[row["workload"]].append(row)
    order = ("W1-2k", "W1-20k", "W1-iso", "W2-20k", "W3-2k")
    for w in order:
        rows = workloads.get(w)
        if not rows:
            continue
        lines += [f"### {w}", "",
                  "| contender | cores | env steps/s | episodes/s | wall s | peak RSS MiB | "
                  + " | ".join(name for _, name in REFERENCES)
                  + " | steps per CPU-s × bare | mean return | returns = bare |",
                  "|---|---:|---:|---:|---:|---:|" + "---:|" * len(REFERENCES) + "---:|---:|:---:|"]
        for r in rows:
            if not r["ok"]:
                lines.append(f"| {r['label']} | {r['cores']} | not run: {_err(r)} |"
                             + " |" * (9 + len(REFERENCES) - 3))
                continue
            same = r.get("same_returns_as_bare")
            label = r["label"] + (f" ({r['setting']})" if r.get("setting") and "best" in r["label"]
                                  else "")
            lines.append(
                f"| {label} | {r['cores']} | {_fmt(r['steps_per_s'], 0)} | "
                f"{_fmt(r['episodes_per_s'], 1)} | {_fmt(r['wall_s'])} | "
                f"{_fmt(r['peak_rss_mib'], 0)} | "
                + " | ".join(_ratio(r["ratios"].get(k)) for k, _ in REFERENCES)
                + f" | {_ratio(r['cpu_ratios'].get('bare1'))} | {_fmt(r['mean_return'], 1)} | "
                + ("yes" if same else "no" if same is False else "—") + " |")
        notes = sorted({r["note"] for r in rows if r.get("note")})
        lines += [""] + [f"- {n}" for n in notes] + ([""] if notes else [])
    rows = workloads.get("W4")
    if rows:
        lines += ["### W4: small evaluations, fixed overhead, cache", "",
                  "| contender | wall s | peak RSS MiB | imports s (cold start) | first call s | "
                  "policy bytes moved | note |", "|---|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            if not r["ok"]:
                lines.append(f"| {r['label']} | not run: {_err(r)} | | | | | |")
                continue
            lines.append(
                f"| {r['label']} | {_fmt(r['wall_s'], 3)} | {_fmt(r['peak_rss_mib'], 0)} | "
                f"{_fmt(r['imports_s'])} | {_fmt(r['first_call_s'])} | "
                f"{_fmt(r['policy_bytes_moved'], 0)} | {r.get('note', '')}"
                + (f" cache: {r['cache']}" if r.get("cache") else "") + " |")
        lines.append("")
    lines += ["### Targets", "", "| target | measured | goal | met |", "|---|---:|---:|:---:|"]
    for t in result["targets"]:
        met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        lines.append(f"| {t['target']} | {_fmt(t['value'])} | {t['goal']} | {met} |")
    if result.get("missing"):
        lines += ["", "Not installed: " + "; ".join(f"{k}: `{e}`" for k, e in
                                                     result["missing"].items())]
    lines.append("")
    return "\n".join(lines)


def _err(row: dict[str, Any]) -> str:
    text = (row["errors"] or ["unknown error"])[0].replace("|", "\\|").replace("\n", " ")
    return f"`{text[:300]}`"


def plot(sweep: list[dict[str, Any]], path: Path, meta: dict[str, Any]) -> None:
    """Throughput (env steps/s) against concurrency (env instances), one line per contender."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for p in sweep:
        r = rate({**p, "spec": {"contender": ""}})
        if r:
            series[p["series"]].append((int(p["x"]), r))
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, pts in sorted(series.items()):
        pts.sort()
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("env instances alive at once (one process)")
    ax.set_ylabel("env steps / s")
    ax.set_title(f"CartPole-v1 + MLP, one core — {meta['date']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
