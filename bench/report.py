"""Render a bench JSON file (``irisfed bench --out F``) as a Markdown table.

``python -m bench.report bench/results/full.json``
"""

import json
import sys


def markdown(doc: dict) -> str:
    lines = [f"Machine: {doc['machine']}; run {doc['when'][:16]}Z ({'quick' if doc['quick'] else 'full'}).", "",
             "| section | figure | value | vs baseline (same run) | target | met | runs | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for f in doc["figures"]:
        ratio = f"{f['ratio']:.2f}× {f['baseline']}" if f["ratio"] is not None else ""
        met = "" if f["met"] is None else ("yes" if f["met"] else "**no**")
        lines.append(f"| {f['section']} | {f['name']} | {f['value']:,.1f} {f['unit']} | {ratio} | "
                     f"{f['target']} | {met} | {f['runs']} | {f['note']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(json.loads(open(sys.argv[1]).read())))
