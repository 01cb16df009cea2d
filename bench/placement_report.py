#!/usr/bin/env python3
"""Markdown tables for BENCHMARKS.md from the JSON of `fastshare bench placement --json` and
`fastshare bench mig --json`.

    fastshare bench placement --no-speed --json > quality.json
    fastshare bench placement --no-quality --json > speed.json
    fastshare bench mig --json > mig.json
    python bench/placement_report.py quality.json speed.json mig.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def quality(rows: list[dict]) -> None:
    by = defaultdict(dict)
    for r in rows:
        by[r["trace"]][r["policy"]] = r
    print("| trace | seeds | our FGD | published FGD | diff | our BestFit | published BestFit | diff "
          "| fastshare | vs published FGD | vs our FGD |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for trace in sorted(by):
        f, b, s = (by[trace].get(p, {}) for p in ("fgd", "bestfit", "fastshare"))

        def c(r, k):
            v = r.get(k)
            return "n/a" if v is None else (f"{v:+.2f}" if k.startswith("diff") else f"{v:.2f}")

        ours = "n/a" if not s or not f else f"{s['mean'] - f['mean']:+.2f}"
        print(f"| {trace} | {f.get('seeds', 'n/a')} | {c(f, 'mean')} | {c(f, 'published_mean')} | "
              f"{c(f, 'diff_vs_published')} | {c(b, 'mean')} | {c(b, 'published_mean')} | "
              f"{c(b, 'diff_vs_published')} | {c(s, 'mean')} | {c(s, 'diff_vs_published_fgd')} | {ours} |")


def speed(rows: list[dict]) -> None:
    print("| nodes | GPUs | tasks | p50 ms | p99 ms (wall) | p99 ms (CPU) | max ms | experiment wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['nodes']:,} | {r['gpus']:,} | {r['tasks']:,} | {r['p50_ms']} | {r['p99_ms']} | "
              f"{r['cpu_p99_ms']} | {r['max_ms']} | {r['wall_s']} |")


def mig(rows: list[dict]) -> None:
    base = {r["strategy"]: r["frag_rejection_ratio"] for r in rows}
    print("| strategy | requests | rejected | fragmentation rejections | ratio % | vs largest-first "
          "| vs first-fit |")
    print("|---|---|---|---|---|---|---|")
    def ratio(a: float, b: float) -> str:   # as `fastshare bench mig` prints it
        return f"{a / b:.3f}x" if b else "n/a"

    for r in rows:
        print(f"| {r['strategy']} | {r['requests']} | {r['rejected']} | {r['frag_rejected']} | "
              f"{r['frag_rejection_ratio']} | {ratio(r['frag_rejection_ratio'], base['largest-first'])} | "
              f"{ratio(r['frag_rejection_ratio'], base['first-fit'])} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", metavar="FILE.json",
                        help="output of `fastshare bench placement --json` or `fastshare bench mig --json`")
    for path in parser.parse_args(argv).files:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            parser.error(f"{path}: {exc}")
        if isinstance(data, list):
            mig(data)
        else:
            if "quality" in data:
                quality(data["quality"])
            if "speed" in data:
                speed(data["speed"])
        print()


if __name__ == "__main__":
    main()
