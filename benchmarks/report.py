"""The report: every comparison is one row of the table and one entry of the JSON."""

import statistics

from benchmarks.settings import IF_MISSED, TARGETS
from benchmarks.timing import stats


def fmt(x, unit):
    if unit == "%":
        return f"{100 * x:.1f}%"
    if abs(x) >= 100:
        return f"{x:,.0f} {unit}"
    return f"{x:.3g} {unit}"


def fmt_stats(s, unit):
    return f"{fmt(s['median'], unit)} [{fmt(s['min'], unit).split()[0]}–{fmt(s['max'], unit).split()[0]}]"


def comparison(name, ours, baseline, unit, target=None, higher_is_better=True, judge="median", note=""):
    """One row: ours and baseline are lists of per-round values (the same rounds, in order,
    when paired) or, for a quoted reference, a single number; baseline None: ours alone
    against the target, judged by its median or its mean. target: a key of TARGETS, or None."""
    ours_s = stats(ours)
    row = {
        "name": name,
        "unit": unit,
        "ours": ours_s,
        "note": note,
        "target": None if target is None else TARGETS[target],
        "higher_is_better": higher_is_better,
    }
    if baseline is None:  # an absolute number against a target
        row.update(baseline=None, ratio=None)
        value = ours_s["median"] if judge == "median" else statistics.fmean(ours)
        if judge == "mean":
            row["ours"]["mean"] = value
    else:
        base_s = (
            stats(baseline)
            if isinstance(baseline, list)
            else {"median": baseline, "min": baseline, "max": baseline, "n": 0}
        )
        row["baseline"] = base_s
        row["ratio"] = ours_s["median"] / base_s["median"]
        if isinstance(baseline, list) and len(baseline) == len(ours):
            row["paired_ratio"] = stats([a / b for a, b in zip(ours, baseline, strict=True)])
        value = row["ratio"]
    row["met"] = None if target is None else (value >= row["target"] if higher_is_better else value < row["target"])
    if row["met"] is False:
        row["if_missed"] = IF_MISSED[target]
    return row


def table(rows):
    lines = [
        "| benchmark | ours | baseline | ratio [paired min–max] | target | met |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        unit = r["unit"]
        ours = fmt_stats(r["ours"], unit)
        if r["baseline"] is None:
            base, ratio = "", ""
        else:
            base = (
                fmt_stats(r["baseline"], unit)
                if r["baseline"]["n"]
                else f"{fmt(r['baseline']['median'], unit)} (quoted)"
            )
            ratio = f"{r['ratio']:.2f}x"
            if "paired_ratio" in r:
                ratio += f" [{r['paired_ratio']['min']:.2f}–{r['paired_ratio']['max']:.2f}]"
        if r["target"] is None:
            target = ""
        elif r["baseline"] is None:
            target = ("≥ " if r["higher_is_better"] else "< ") + fmt(r["target"], unit)
            if "mean" in r["ours"]:
                target = "mean " + target
        else:
            target = f"≥ {r['target']:g}x"
        met = {None: "", True: "yes", False: "**no**"}[r["met"]]
        name = r["name"] + (f" ({r['note']})" if r["note"] else "")
        lines.append(f"| {name} | {ours} | {base} | {ratio} | {target} | {met} |")
    return "\n".join(lines)


def missed(rows):
    """What each target not met means, a line each, for after the table."""
    return [f"- {r['name']}: {r['if_missed']}" for r in rows if r["met"] is False]
