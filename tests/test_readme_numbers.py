"The README's GPU tables quote raw outputs kept in benchmarks/results: each quoted number must be the raw output's, rounded."
import itertools, json, re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRACT = ROOT / "benchmarks/results/2026-11-27-h100-extract3"

def readme_table(after:str): # text that precedes the table
    "Rows of the first markdown table after `after`, as lists of cell texts."
    text = (ROOT / "README.md").read_text()
    lines = text[text.index(after):].splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("|"))
    table = itertools.takewhile(lambda l: l.startswith("|"), lines[start:])
    return [[c.strip() for c in l.strip("|").split("|")] for l in table][2:]  # past the header and its rule

def test_the_readme_extraction_table_quotes_the_raw_output():
    rows = [r | {"precision": json.loads((EXTRACT / f).read_text())["precision"]} for f in ("extract_vit_fp32.json", "extract_vit_amp.json", "extract_flair_512.json")
            for r in json.loads((EXTRACT / f).read_text())["rows"]]
    quoted = readme_table(f"raw output in `{EXTRACT.relative_to(ROOT)}/`")
    assert len(quoted) == 5
    model = None
    for cells in quoted:
        model = model if cells[0] == "same" else cells[0].split(",")[0]
        share = re.fullmatch(r"GPU, (\d+) % of the files to the workers", cells[2])
        path = "workers" if cells[2] == "workers (PIL)" else "device" if cells[2] == "GPU (nvJPEG)" else f"device {int(share[1]) / 100:g}w"
        raw = next(r for r in rows if r["model"].startswith(model) and r["precision"] == cells[1] and r["path"] == path)
        assert [int(cells[3].replace(",", "")), int(cells[4].replace(",", ""))] == [round(raw["forward_only"]), round(raw["end_to_end_steady"])], cells
        assert cells[5] == f"{raw['steady_ratio']:.0%}".replace("%", " %"), cells

def test_the_readme_engine_row_quotes_the_raw_output():
    raw = json.loads((ROOT / "benchmarks/results/2026-11-27-h100-engine/engine_cuda.json").read_text())
    row = next(r for r in readme_table("| machine | commit | C | N |") if r[1] == "45160eb")
    assert row[2:4] == ["2", "10^7"]
    measured = next(r for r in raw["throughput"] if (r["C"], r["n"], r["impl"]) == (2, 10**7, "vectorised"))
    assert int(row[4].replace(",", "")) == round(measured["samples_per_s"]), row
