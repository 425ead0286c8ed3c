"""A bench's figures through its results file, as ``irisfed bench --out`` writes it and
``--report`` reads it back, for the tests of a bench section's rows."""

from __future__ import annotations

from pathlib import Path

from irisfed.bench.report import Bench, headline, is_headline, load_results, write_json


def reported(bench: Bench, tmp_path: Path) -> tuple[Path, dict, str]:
    """Write ``bench``'s results to ``tmp_path/quick.json`` and read them back, every
    figure a headline row: (the file, its document, its headline table)."""
    out = tmp_path / "quick.json"
    write_json(bench, out)
    doc = load_results(out.read_text(), str(out))
    assert [f["name"] for f in doc["figures"] if is_headline(f)] == [f.name for f in bench.figures]
    return out, doc, headline(doc, "bench/results/quick.json")
