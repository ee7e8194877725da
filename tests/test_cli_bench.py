"""``kvarn-cutlass bench --from-json`` on records a bench run did not write: one line naming the file
and the section, exit status 1, and no output written."""

from __future__ import annotations

import json

import pytest

from kvarn_cutlass.cli import main


@pytest.mark.parametrize("section,results", [
    ("decode", {"rows": 5}),
    ("compress", "not a dict"),
    ("launch", "not a dict"),
])
def test_malformed_section_is_one_line_naming_it(section, results, capsys, tmp_path):
    record = tmp_path / "results.json"
    record.write_text(json.dumps({"sections": {"copy": {"results": {"sizes": []}}, section: {"results": results}}}))
    out = tmp_path / "out"
    assert main(["bench", "--from-json", str(record), "--out", str(out), "--no-plots"]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    assert str(record) in err[0] and f"section {section!r}" in err[0], err[0]
    assert not out.exists()  # checked before anything is written


def test_committed_record_still_renders(capsys, tmp_path):
    from pathlib import Path

    record = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "h200.json"
    assert main(["bench", "--from-json", str(record), "--out", str(tmp_path), "--no-plots"]) == 0
    assert (tmp_path / "results.md").read_text().count("|") > 100
