"""The comparison's report (``compare.py``): the markdown tables and the three figures
(throughput per plan, predicted against measured, the oracle's grid)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe
from compare_results import AUTO, HAND, ONE
from report import despine, lead_in_words, load_sentence, plural, pyplot, save_figure


def _stages(row: dict) -> str:
    if not row["stage_predicted_ms"] or not row["stage_measured_ms"]:
        return "–"
    before = " / ".join(f"{v:.0f}" for v in row["stage_predicted_ms"])
    after = " / ".join(f"{v:.0f}" for v in row["stage_measured_ms"])
    return f"{before} → {after}"


def _cut(row: dict) -> str:
    return ", ".join(row["split_points"]) or "–"


def markdown(data: dict[str, Any]) -> str:
    st = data["settings"]
    lines = [
        "# autosplit against the hand split, one device and the peers",
        "",
        f"Machine: {describe(st['machine'])}. Devices: {st['devices']}; schedule GPipe; "
        f"{st['loss']}. Every configuration of a model is trained in one job, interleaved round "
        f"by round after a warm-up round{lead_in_words(st)}; {st['rounds']} timed rounds of one "
        "step each, the "
        "median is reported (spread = (max − min) / median). Command: "
        f"`{st['command']}`; whole run {data['phases_seconds']['total'] / 60:.1f} min.",
        "",
        "Timings on this shared 2-core machine drift 20–30 % between runs (other jobs, tests "
        "included, may run beside it); compare rows of one run, not across runs. A timing during "
        f"which other processes used more than {st['max_others']:.0%} of the machine's CPU time "
        f"is taken again (at most {st['retries']} times; /proc/stat's busy time minus the ranks' own).",
        "",
        "Ratios are speed-ups: the other configuration's step time over this row's (> 1: this "
        "row is faster). Predicted: autosplit's prediction for that plan (`predicted_step_ms`, the "
        "event simulation of the schedule on the profiled block times); bound: the closed form "
        "(m + p − 1) · t_max (`bound_step_ms`). Heuristics without their own micro-batch choice (uniform, by "
        "parameters) get the measured size the cost model predicts fastest for their cut; "
        f"torchgpipe {st['torchgpipe'] or '(not installed)'} `balance_by_time` runs on the model "
        "flattened into an nn.Sequential, timed on one micro-batch, with autosplit's m.",
        "",
    ]
    for m in data["models"]:
        lines += [
            f"## {m['model']} ({m['input']}, {m['blocks']} blocks)",
            "",
            f"Hand split: {m['hand_split']}. Profiled micro-batch sizes: "
            f"{', '.join(map(str, m['profile']['microbatch_sizes']))} ({m['profile']['seconds']:.0f} s).",
            "",
            "| plan | cut before | m × b | measured (s) | spread | samples/s | predicted (s) | bound (s) "
            "| vs hand split | vs one device | stage compute (ms): profiled → run together |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in m["rows"]:
            same = f" (= {r['same_as']})" if r["same_as"] else ""
            hand = f"×{r['vs_hand_split']:.2f}" if r["vs_hand_split"] is not None else "–"
            lines.append(
                f"| {r['name']}{same} | {_cut(r)} | {r['microbatches']} × {r['split_size']} | "
                f"{r['median_s']:.3f} | {r['spread']:.0%} | {r['throughput']:.1f} | "
                f"{r['predicted_ms'] / 1000:.3f} | {r['bound_ms'] / 1000:.3f} | {hand} | "
                f"×{r['vs_one_device']:.2f} | {_stages(r)} |"
            )
        tg = m.get("torchgpipe")
        if tg:
            lines += ["", f"torchgpipe's balance_by_time: layers {tg['layer_balance']} of {tg['layers']} "
                          f"→ blocks {list(tg['balance'])}, timed on a micro-batch of {tg['sample_rows']} "
                          f"in {tg['seconds']:.1f} s" + (f"; {'; '.join(tg['notes'])}" if tg["notes"] else "") + "."]
        lines += ["", f"Stage compute per micro-batch: the profile's sum over the stage's blocks (each "
                      f"timed alone) against the stage's blocks run together in one process; median "
                      f"error {m['stage_error']:.0%}."]
        for note in m["notes"]:
            lines += ["", note + "."]
        if load_sentence(m["load"]):
            lines += ["", load_sentence(m["load"])]
        lines.append("")
    o = data["oracle"]
    sizes = list(reversed(o["microbatch_sizes"]))
    lines += [
        f"## The oracle: {o['model']} ({o['input']}), every cut × m ≤ {o['max_m']}",
        "",
        f"{len(o['points'])} points, {plural(st['oracle_rounds'], 'timed round')} each (median below); then "
        f"the {st['refine']} fastest and autosplit's and the hand split's points again, "
        f"{plural(st['refine_rounds'], 'round')} among themselves (refined). Step time in seconds; "
        "**bold**: autosplit's plan; *italic*: the hand split. " + load_sentence(o["load"]),
        "",
        "| cut before | " + " | ".join(f"m={o['batch'] // b} (b={b})" for b in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    by_cut: dict[str, dict[int, dict]] = {}
    for p in o["points"]:
        by_cut.setdefault(p["before"], {})[p["split_size"]] = p
    for before, row in by_cut.items():
        cells = []
        for b in sizes:
            p = row[b]
            text = f"{p['median_s']:.2f}"
            if p["autosplit"]:
                text = f"**{text}**"
            elif p["hand"]:
                text = f"*{text}*"
            cells.append(text)
        lines.append(f"| {before} | " + " | ".join(cells) + " |")
    lines += ["", "| refined point | cut before | m × b | refined median (s) | coarse median (s) | predicted (s) |",
              "|---|---|---|---|---|---|"]
    for p in sorted((p for p in o["points"] if p["refined_median_s"] is not None),
                    key=lambda p: p["refined_median_s"]):
        who = "autosplit" if p["autosplit"] else ("hand split" if p["hand"] else "")
        lines.append(f"| {who} | {p['before']} | {p['microbatches']} × {p['split_size']} | "
                     f"{p['refined_median_s']:.3f} | {p['median_s']:.3f} | {p['predicted_ms'] / 1000:.3f} |")
    per_m = ", ".join(f"m={m}: ×{v['vs_best']:.2f} (best cut before {v['best_before']})"
                      for m, v in o["best_per_m"].items())
    lines += [
        "",
        f"autosplit's plan (cut before {o['autosplit']['before']}, {o['autosplit']['microbatches']} × "
        f"{o['autosplit']['split_size']}) is ×{o['autosplit_vs_best']:.3f} the best point found "
        f"(refined; ×{o['autosplit_vs_best_coarse']:.3f} against the coarse sweep's best, cut before "
        f"{o['coarse_best']['before']} at m={o['coarse_best']['microbatches']}). "
        f"Best step per m relative to the best overall (coarse): {per_m}.",
        "",
    ]
    e = data["errors"]
    lines += [
        "## Cost model error and goals",
        "",
        f"Median absolute error of the predicted step, |predicted − measured| / measured: "
        f"{e['compare_predicted']:.1%} over the {e['compare_rows']} measured configurations of the "
        f"comparison ({e['compare_pipelined_predicted']:.1%} without the one-device rows; the "
        f"closed-form bound {e['compare_bound']:.1%}); {e['oracle_predicted']:.1%} over the "
        f"oracle's {e['oracle_points']} points (bound {e['oracle_bound']:.1%}).",
        "",
        "| goal | value | met |",
        "|---|---|---|",
    ]
    for g in data["goals"]:
        value = f"{g['value']:.1%}" if g["target"] == 0.10 else f"×{g['value']:.3f}"
        lines.append(f"| {g['goal']} | {value} | {'yes' if g['met'] else '**no**'} |")
    lines += ["", "Phases (s): " + ", ".join(f"{k} {v:.0f}" for k, v in data["phases_seconds"].items()) + "."]
    return "\n".join(lines) + "\n"


def figures(data: dict[str, Any], out: Path, stem: str) -> list[str]:
    plt = pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    names = []
    colors = {ONE: "#8C8C8C", HAND: "#DD8452", "uniform": "#BBBBBB", "by parameters": "#BBBBBB",
              "torchgpipe": "#8172B2", AUTO: "#4C72B0"}
    models = data["models"]

    # 1. measured throughput per plan per model, predicted marker
    fig, axes = plt.subplots(len(models), 1, figsize=(7.5, 1.0 + 1.9 * len(models)), dpi=100,
                             layout="constrained", squeeze=False)
    for ax, m in zip(axes[:, 0], models):
        rows = m["rows"]
        ys = list(range(len(rows)))[::-1]
        vals = [r["throughput"] for r in rows]
        lo = [v - m["batch"] / r["max_s"] for v, r in zip(vals, rows)]
        hi = [m["batch"] / r["min_s"] - v for v, r in zip(vals, rows)]
        ax.barh(ys, vals, xerr=[lo, hi], color=[colors[r["name"]] for r in rows], height=0.65,
                error_kw={"elinewidth": 1, "capsize": 2})
        ax.scatter([m["batch"] / (r["predicted_ms"] / 1000) for r in rows], ys, marker="D",
                   color="black", s=18, zorder=3)
        labels = []
        for r in rows:
            same = " (same plan)" if r["same_as"] else ""
            where = f"{_cut(r)} · {r['microbatches']}×{r['split_size']}" if r["name"] != ONE else f"1×{r['split_size']}"
            labels.append(f"{r['name']}{same}\n{where}")
        ax.set_yticks(ys, labels, fontsize=7)
        for y, v, r in zip(ys, vals, rows):
            ax.text(v * 0.02, y, f"{v:.1f}/s ×{r['vs_one_device']:.2f}", va="center", fontsize=7,
                    color="white", fontweight="bold")
        ax.set_title(f"{m['model']} ({m['input']})", loc="left", fontsize=9)
        ax.set_xlim(0, max(vals + [m["batch"] / (r["predicted_ms"] / 1000) for r in rows]) * 1.12)
        despine(ax)
    axes[-1, 0].set_xlabel("training throughput (samples/s; median, whiskers min–max); "
                           "×: speed-up over one device", fontsize=8)
    fig.legend(handles=[Line2D([], [], marker="D", color="black", linestyle="", markersize=5,
                               label="autosplit's prediction for that plan")],
               fontsize=8, frameon=False, loc="upper right")
    fig.suptitle("Plans measured side by side on 2 devices (higher is faster)", fontsize=10, x=0.02,
                 ha="left")
    names.append(save_figure(fig, out / f"{stem}_throughput.png"))

    # 2. predicted vs measured
    fig, ax = plt.subplots(figsize=(5.5, 5), dpi=100, layout="constrained")
    o = data["oracle"]
    ox = [p["predicted_ms"] / 1000 for p in o["points"]]
    oy = [p["median_s"] for p in o["points"]]
    ax.scatter(ox, oy, s=12, color="#BBBBBB", label=f"oracle sweep points ({o['model']}, {o['input']})")
    markers = "osD^v"
    for i, m in enumerate(models):
        rows = [r for r in m["rows"] if r["same_as"] is None]
        ax.scatter([r["predicted_ms"] / 1000 for r in rows], [r["median_s"] for r in rows],
                   marker=markers[i % len(markers)], s=30, label=f"{m['model']} plans")
    lo = min(ox + oy + [r["predicted_ms"] / 1000 for m in models for r in m["rows"]]) * 0.8
    hi = max(ox + oy + [r["median_s"] for m in models for r in m["rows"]]) * 1.25
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="y = x")
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="#4C72B0",
                    alpha=0.12, label="±10 %")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted step time (s), autosplit's cost model")
    ax.set_ylabel("measured step time (s), median")
    e = data["errors"]
    ax.set_title(f"Predicted vs measured: median error {e['compare_predicted']:.0%} (compared plans), "
                 f"{e['oracle_predicted']:.0%} (sweep)", fontsize=9, loc="left")
    ax.legend(fontsize=7, frameon=False, loc="upper left")
    names.append(save_figure(fig, out / f"{stem}_predicted.png"))

    # 3. the oracle's grid
    sizes = list(reversed(o["microbatch_sizes"]))
    befores = list(dict.fromkeys(p["before"] for p in o["points"]))
    cell = {(p["before"], p["split_size"]): p for p in o["points"]}
    grid = [[cell[(bf, b)]["median_s"] for b in sizes] for bf in befores]
    fig, ax = plt.subplots(figsize=(6.2, 0.3 * len(befores) + 1.8), dpi=100, layout="constrained")
    image = ax.imshow(grid, cmap="viridis_r", aspect="auto")
    best = min(o["points"], key=lambda p: p["median_s"])
    for i, bf in enumerate(befores):
        for j, b in enumerate(sizes):
            v = grid[i][j]
            light = v > (min(map(min, grid)) + max(map(max, grid))) / 2
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if light else "black")
            p = cell[(bf, b)]
            if p["autosplit"]:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.2))
            if p["hand"]:
                ax.add_patch(Rectangle((j - 0.45, i - 0.45), 0.9, 0.9, fill=False, edgecolor="orange",
                                       linewidth=1.5, linestyle="--"))
    bi, bj = befores.index(best["before"]), sizes.index(best["split_size"])
    ax.plot(bj + 0.36, bi, marker="*", color="white", markersize=9, markeredgecolor="black")
    ax.set_xticks(range(len(sizes)), [f"m={o['batch'] // b}\nb={b}" for b in sizes], fontsize=8)
    ax.set_yticks(range(len(befores)), befores, fontsize=7)
    ax.set_ylabel("cut before block")
    fig.colorbar(image, ax=ax, label="measured step time (s)", shrink=0.8)
    ax.set_title(f"Oracle sweep: {o['model']}, {o['input']}, 2 devices\n"
                 f"red box: autosplit (×{o['autosplit_vs_best']:.3f} of the best found); "
                 "dashed: hand split; ★ fastest (coarse)", fontsize=9, loc="left")
    names.append(save_figure(fig, out / f"{stem}_oracle.png"))
    return names
