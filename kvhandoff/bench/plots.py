"""PNG plots of a `kvhandoff bench` run, drawn from its summary and rows (matplotlib, Agg: no display).

- ttft_tpot_vs_rate.png: TTFT and TPOT (p50 solid, p90 dashed) against the arrival rate, one line per
  mode (grid workloads: points with a rate).
- phases.png: the handoff phases' p50 per point, stacked (what a request's time went to); the demo's
  isolated_phases.png the same for isolated requests per stack, with the client's TTFT marked.
- ttft_per_turn.png: median TTFT per turn index, one line per mode (multi-turn workloads).
- retention.png: multi-turn with bidirectional reuse beside a point without it: each point's median
  later-turn TTFT saved over the GiB-seconds of KV its decode workers held (a TTL sweep's trade-off).
- imbalance.png: over each point's time, the most sequences on one decode worker less the fewest
  on another (sampled from the router's /health), one line per point (fleets of 2+ decode workers).
"""
from __future__ import annotations

import math
import os
import re
import statistics
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from kvhandoff.wire.messages import PHASES  # noqa: E402


def by_mode(summaries: list[dict]) -> dict[str, list[dict]]:
    modes: dict[str, list[dict]] = defaultdict(list)
    for s in summaries:
        modes[s["mode"]].append(s)
    return modes


def by_link(modes: dict[str, list[dict]]) -> dict[str, dict[str, list[dict]]]:
    """Modes grouped by the emulated link their launch spec names (`+link=RATE`; else free), each
    mode's name without it: one panel row per link keeps a many-stack run readable."""
    links: dict[str, dict[str, list[dict]]] = defaultdict(dict)
    for mode, points in modes.items():
        m = re.search(r"\+link=([^+]+)", mode)
        links[m[1] if m else "free"][mode.replace(m[0], "") if m else mode] = points
    return links


def rate_plot(summaries: list[dict], path: Path) -> bool:
    rated = [s for s in summaries if s["rate"] is not None and s["ttft_ms"].get("n")]
    if not rated:
        return False
    links = by_link(by_mode(rated))
    fig, axes = plt.subplots(len(links), 2, figsize=(11, 4.2 * len(links)), squeeze=False)
    for row, (link, modes) in zip(axes, links.items()):
        for mode, points in modes.items():
            points.sort(key=lambda s: s["rate"])
            rates = [s["rate"] for s in points]
            for ax, key in zip(row, ("ttft_ms", "tpot_ms")):
                line, = ax.plot(rates, [s[key]["p50"] for s in points], marker="o", label=f"{mode} p50")
                ax.plot(rates, [s[key]["p90"] for s in points], linestyle="--", color=line.get_color(), alpha=0.7,
                        label=f"{mode} p90")
        for ax, title in zip(row, ("time to first token (ms)", "time per output token (ms)")):
            ax.set_xlabel("arrival rate (requests/s)")
            ax.set_title(title if len(links) == 1 else f"{title}, {link} link")
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def phase_plot(summaries: list[dict], path: Path) -> bool:
    phased = [s for s in summaries if s["phases_ms"]]
    if not phased:
        return False
    return stacked_phases([s["label"] for s in phased],
                          [{p: s["phases_ms"].get(p, {}).get("p50") for p in PHASES} for s in phased], path,
                          "ms (p50 of each phase)", "where a request's time went (server-reported handoff phases)")


def stacked_phases(labels: list[str], phases: list[dict], path: Path, xlabel: str, title: str,
                   client_ms: list[float | None] | None = None, client_label: str = "") -> bool:
    """One horizontal bar per label, its phases (ms) stacked in PHASES order, over a grey bar of what
    the client saw where given (`client_label`: the phases plus HTTP, routing and tokenizing)."""
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(labels) + 2.4))
    if client_ms:
        ax.barh(labels, [t or 0.0 for t in client_ms], color="0.85", label=client_label)
    left = [0.0] * len(labels)
    for phase in PHASES:
        widths = [row.get(phase) or 0.0 for row in phases]
        ax.barh(labels, widths, left=left, label=phase)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.invert_yaxis()
    ax.legend(fontsize=8, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / len(labels)))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def turn_plot(rows: list[dict], path: Path) -> bool:
    turns: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row.get("turn") is not None and row["ok"]:
            turns[row["point"]][row["turn"]].append(row["ttft_ms"])
    if not turns:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, per_turn in turns.items():
        xs = sorted(per_turn)
        ax.plot(xs, [statistics.median(per_turn[t]) for t in xs], marker="o", label=label)
    return save_lines(fig, ax, path, "turn", "median TTFT (ms)", "time to first token per turn")


def retention_plot(summaries: list[dict], rows: list[dict], path: Path) -> bool:
    """Multi-turn with bidirectional reuse: per point, the median TTFT of later turns (turn > 1) saved
    against the point with the most later-turn TTFT and nothing retained (the baseline, e.g. the same
    mode without --bidirectional), over the GiB-seconds of KV its decode workers held: what each
    retention setting (a TTL sweep: push+bidirectional+retention-ttl=...) buys for its memory."""
    later: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        if row.get("turn") and row["turn"] > 1 and row["ok"]:
            later[row["point"]].append(row["ttft_ms"])
    kept = [s for s in summaries if (s.get("retention") or {}).get("gib_s") and later.get(s["label"])]
    plain = [statistics.median(later[s["label"]]) for s in summaries
             if not (s.get("retention") or {}).get("gib_s") and later.get(s["label"])]
    if not kept or not plain:
        return False
    baseline = max(plain)
    # What the points share up to a '+' (push+bidirectional+) goes once into the title, not on every label.
    labels = [s["label"] for s in kept]
    shared = os.path.commonprefix(labels) if len(labels) > 1 else ""
    shared = shared[:shared.rfind("+") + 1]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for s in kept:
        x, y = s["retention"]["gib_s"], baseline - statistics.median(later[s["label"]])
        ax.scatter([x], [y])
        ax.annotate(s["label"][len(shared):], (x, y), fontsize=8, xytext=(4, 4), textcoords="offset points")
    ax.axhline(0, color="0.6", linewidth=0.8)
    ax.margins(x=0.35)                  # room for the labels right of the last point
    ax.set_xlabel("KV retained on decode workers (GiB-seconds)")
    ax.set_ylabel("median TTFT saved on later turns (ms)")
    ax.set_title(f"what retention buys{f' ({shared.rstrip(chr(43))})' if shared else ''}: "
                 f"against later turns without it ({baseline:.0f} ms)", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def imbalance_plot(summaries: list[dict], path: Path) -> bool:
    """One panel per stack (mode), a line per rate: the most sequences on one decode worker less the
    fewest on another, over the point's time."""
    sampled = by_mode([s for s in summaries if s.get("decode_imbalance")])
    if not sampled:
        return False
    cols = min(3, len(sampled))
    rows = math.ceil(len(sampled) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows + 0.6), squeeze=False, sharex=True,
                             sharey=True)
    for ax, (mode, points) in zip(axes.flat, sampled.items()):
        for s in points:
            load = [(t, max(ld.values()) - min(ld.values())) for t, ld in s["timeline"] if len(ld) > 1]
            ax.plot([t for t, _ in load], [v for _, v in load], alpha=0.8,
                    label=s["label"].removeprefix(mode) or s["label"])
        ax.set_title(mode, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes.flat[len(sampled):]:
        ax.set_visible(False)
    fig.supxlabel("s into the point")
    fig.supylabel("sequences: busiest - idlest decode worker")
    fig.suptitle("decode load imbalance over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def save_lines(fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> bool:
    """A line chart's labels, grid and legend, written to `path`."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def draw(out: Path, summaries: list[dict], rows: list[dict]) -> list[str]:
    """Draw what the run has data for; returns the file names written."""
    made = []
    for name, ok in (("ttft_tpot_vs_rate.png", lambda p: rate_plot(summaries, p)),
                     ("phases.png", lambda p: phase_plot(summaries, p)),
                     ("ttft_per_turn.png", lambda p: turn_plot(rows, p)),
                     ("imbalance.png", lambda p: imbalance_plot(summaries, p)),
                     ("retention.png", lambda p: retention_plot(summaries, rows, p))):
        if ok(out / name):
            made.append(name)
    return made
