"""A prepared folder's files that cannot be read, or hold a bad row, are refused in one line naming the file and line; what the writers write reads back under any locale."""
import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from proton.bench.prepared import SPLIT_FILE, image_path, open_csv, read_prepared, write_classes_file

OPEN_QUOTE = "file,shift,label,source\n\"id/a/1.png,id,a,s\n" + "".join(f"id/a/{i}.png,id,a,s\n" for i in range(8000))  # a quote never closed: one field of > 128 KiB
SHORT_ROW = "shift,label,file,source\nid,a\nid,b,id/b/2.png,s\n"  # row 2 has no file


def prepared(tmp_path, split_text):
    "A prepared folder with one image in each of the classes a and b, and `split_text` as its split.csv."
    root = tmp_path / "p"
    for label, name in (("a", "1.png"), ("b", "2.png")):
        (root / image_path("id", label, name)).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(root / image_path("id", label, name))
    write_classes_file(root, ["a", "b"], ["a", "b"], {"a": ["a"], "b": ["b"]})
    (root / SPLIT_FILE).write_text(split_text, encoding="utf-8")
    return root


def test_unreadable_csv_names_the_file_and_line(tmp_path):
    "csv.Error (here: a field over csv's limit, as an unclosed quote makes) was neither ValueError nor OSError and named no file."
    root = prepared(tmp_path, OPEN_QUOTE)
    with pytest.raises(ValueError, match=re.escape(f"{root / SPLIT_FILE}, line ") + r"\d+: not readable as CSV"):
        read_prepared(root)
    with pytest.raises(ValueError, match=re.escape(f"{root / SPLIT_FILE}, line ") + r"\d+: not readable as CSV"):
        with open_csv(root / SPLIT_FILE) as f: list(csv.reader(f))  # as the data scripts read their split files


def test_short_split_row_names_the_file_line_and_field(tmp_path):
    "A row without a file gave a raw TypeError from Path(None)."
    root = prepared(tmp_path, SHORT_ROW)
    with pytest.raises(ValueError, match=re.escape(f"{root / SPLIT_FILE}, line 2: no file")):
        read_prepared(root)
    (root / SPLIT_FILE).write_text("file,shift,label,source\nid/a/1.png,id,,s\nid/b/2.png,id,b,s\n", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"{root / SPLIT_FILE}, line 2: no label")):
        read_prepared(root)


@pytest.mark.parametrize("text", [OPEN_QUOTE, SHORT_ROW], ids=["open_quote", "short_row"])
def test_extract_refuses_a_bad_split_in_one_line(tmp_path, text):
    root = prepared(tmp_path, text)
    exe = shutil.which("proton-ood") or str(Path(sys.executable).parent / "proton-ood")
    r = subprocess.run([exe, "extract", "--model", "open_clip:RN50/none", "--data", str(root), "--out", str(tmp_path / "c.npz"),
                        "--device", "cpu", "--workers", "0", "--no-progress"], capture_output=True, text=True, timeout=600)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{root / SPLIT_FILE}, line " in lines[0], r.stderr


def test_writers_write_utf8_under_an_ascii_locale(tmp_path):
    "prompt_sets.json and classes.json were written in the locale's encoding (here ASCII: UnicodeEncodeError), though read as UTF-8."
    code = ("import sys; from pathlib import Path; from proton.bench.prepared import *; root = Path(sys.argv[1]); "
            "write_classes_file(root, ['a', 'b'], ['a', 'b'], {'a': ['a \\u2013 1'], 'b': ['b']}); "
            "write_prompt_sets(root, {'L1': {'a': ['drusen \\u2013 early AMD'], 'b': ['caf\\u00e9']}})")
    root = prepared(tmp_path, "file,shift,label,source\nid/a/1.png,id,a,s\nid/b/2.png,id,b,s\n")
    env = {**os.environ, "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "LC_ALL": "C", "PYTHONIOENCODING": "utf-8"}
    r = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    folder = read_prepared(root)
    assert folder.prompt_sets["L1"] == {"a": ["drusen \u2013 early AMD"], "b": ["caf\u00e9"]}
    assert folder.prompts["a"] == ["a \u2013 1"]


@pytest.mark.parametrize("rel,deep", [("id/x.png", "1 folder deep"), ("id/a/b/x.png", "3 folders deep")])
def test_an_image_at_the_wrong_depth_is_named_in_good_english(tmp_path, rel, deep):
    "An image right under id/ was '1 folders deep'."
    root = prepared(tmp_path, "file,shift,label,source\nid/a/1.png,id,a,s\nid/b/2.png,id,b,s\n")
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8)).save(root / rel)
    with pytest.raises(ValueError, match=re.escape(f"{root / rel}: images must sit at <shift>/<class>/<file>, this one is {deep}") + "$"):
        read_prepared(root)
