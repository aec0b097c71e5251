"""The data scripts, offline: each source's real layout as tiny generated files, downloads from a real HTTP server on 127.0.0.1."""
import contextlib
import csv
import dataclasses
import functools
import gzip
import hashlib
import http.server
import io
import json
import re
import shutil
import socket
import struct
import sys
import tarfile
import threading
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from proton.bench.prepared import MARKER_FILE, check_claimable, claim_folder, read_prepared
from proton.deploy import hold_lock
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st
from PIL import Image

DATA_SCRIPTS = Path(__file__).parents[1] / "data_scripts"
sys.path.insert(0, str(DATA_SCRIPTS))
import archives  # noqa: E402
import common  # noqa: E402
import fetching  # noqa: E402
import splits  # noqa: E402
import ophthalmology  # noqa: E402
import pathology  # noqa: E402
import prepare_all  # noqa: E402
import prompts  # noqa: E402
import radiology  # noqa: E402
import startup  # noqa: E402

BENCHMARKS = (ophthalmology.BENCHMARK, radiology.BENCHMARK, pathology.BENCHMARK)
LISTINGS = DATA_SCRIPTS / "splits" / "listings"
FIVES_WRAPPER = "FIVES A Fundus Image Dataset for AI-based Vessel Segmentation"


# ------------------------------------------------------------------------------------------ guards and fixtures

@pytest.fixture(autouse=True)
def only_localhost(monkeypatch):
    """Every socket may connect to 127.0.0.1 only, and no proxy is used for it."""
    real_connect = socket.socket.connect

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] != "127.0.0.1":
            raise AssertionError(f"a test tried to reach {address}")
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")


@functools.lru_cache(maxsize=None)
def _encoded(fmt, shade):
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (shade, 7, 9)).save(buffer, format=fmt)
    return buffer.getvalue()


def image_bytes(fmt, value=0):
    """A tiny image file; a few distinct shades are enough, and encoding each once keeps the tests fast."""
    return _encoded(fmt, value % 8 * 32)


def make_zip(path, files):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def make_tgz(path, files):
    with tarfile.open(path, "w:gz") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


def make_dir(root, files):
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def md5(data):
    return hashlib.md5(data).hexdigest()


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def shipped(name):
    return splits.read_split(splits.SPLITS / f"{name}.csv")


class FileServer:
    """A real HTTP server on 127.0.0.1 serving bytes by path, with Range support; it can cut one response short.

    ``encoding``: "when asked" gzip-compresses a response for a client that accepts it, "always" labels every
    response gzip-encoded as it is (a .gz served so, Apache's classic misconfiguration); both say Content-Encoding: gzip.
    """

    def __init__(self, files, cut_after=None, ranges=True, encoding=None):
        self.files, self.cut_after, self.ranges, self.requests = files, dict(cut_after or {}), ranges, []
        self.encoding = encoding
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                owner.requests.append((self.path, self.headers.get("Range")))
                data = owner.files.get(self.path)
                if data is None:
                    self.send_error(404)
                    return
                start = 0
                asked = self.headers.get("Range")
                if owner.ranges and asked:
                    start = int(asked.split("=")[1].split("-")[0])
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                body = data[start:]
                asked = "gzip" in (self.headers.get("Accept-Encoding") or "")
                if owner.encoding == "always" or (owner.encoding == "when asked" and asked):
                    body = gzip.compress(body, mtime=0) if owner.encoding == "when asked" else body
                    self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                cut = owner.cut_after.pop(self.path, None)
                self.wfile.write(body if cut is None else body[:cut])
                self.wfile.flush()
                if cut is not None:
                    self.close_connection = True

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.watchdog = threading.Timer(60, self.server.shutdown)  # a hung test cannot keep the server alive
        self.watchdog.start()
        return self

    def __exit__(self, *exc):
        self.watchdog.cancel()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def http_entry(url, data, **changes):
    entry = {"title": "fixture", "page": url, "download": "http", "url": url, "filename": "fixture.zip",
             "size_bytes": len(data), "approx_size": "1 KB", "sha256": None, "md5": md5(data), "licence": "test",
             "login": None, "used_for": {}, "why": "test"}
    entry.update(changes)
    return entry


def ju_notebook(path, cell):
    """A notebook shaped like Ju et al.'s: the prompts in the first code cell, a later cell that must not be read."""
    code = lambda source, n: {"cell_type": "code", "execution_count": n, "metadata": {}, "outputs": [],  # noqa: E731
                              "source": source.splitlines(keepends=True)}
    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": ["# OOD detection\n"]}, code(cell, 1),
                    code("in_class = ['a later cell']\n", 2)],
          "metadata": {"kernelspec": {"name": "python3"}}, "nbformat": 4, "nbformat_minor": 5}
    Path(path).write_text(json.dumps(nb, indent=1))
    return Path(path)


# The shapes of Ju et al.'s first code cells, with made-up prompts. The imports and the call would fail if the cell ran.
LIST_CELL = """import not_installed_anywhere
data_dir = '../datasets/'
in_class = ['a {first} image',
            'a {second} image']
in_dir = {dirs!r}
model = load_the_model(data_dir)
"""
DICT_CELL = """import not_installed_anywhere
# in_class = ['an older, commented-out list']
in_class = {{{first!r}: ["first {first}", "second {first}"],
    {second!r}: ["only {second}"]}}
in_dir = ['x/', 'y/']
raise SystemExit("this cell is read, never run")
"""
FUNDUS_L1 = LIST_CELL.format(first="healthy retina", second="diabetic retina", dirs=["N/", "D/"])
FUNDUS_L5 = DICT_CELL.format(first="N/", second="D/")
XRAY_L1 = LIST_CELL.format(first="clear lung", second="cloudy lung", dirs=["normal/", "pneumonia/"])
XRAY_L10 = DICT_CELL.format(first="N", second="P")


# ------------------------------------------------------------------------------------------ manifest and splits

def test_manifest_is_complete_and_matches_the_scripts():
    manifest = fetching.load_manifest()
    used = set()
    for bench in BENCHMARKS:
        bench.check()
        used |= set(bench.keys())
        described = manifest["benchmarks"][bench.name]
        assert set(described["sources"]) == set(bench.keys())
        assert described["classes"] == list(bench.classes)
        counts = {}
        for d in bench.draws:
            counts[d.shift] = counts.get(d.shift, 0) + d.n
        assert counts == described["counts"]
        for key in bench.keys():
            assert bench.name in manifest["sources"][key]["used_for"]
    assert used == set(manifest["sources"])
    for key, entry in manifest["sources"].items():
        assert (entry["login"] is None) == (entry["download"] == "http"), key


def test_manifest_rejects_a_malformed_checksum(tmp_path):
    manifest = json.loads(fetching.MANIFEST.read_text())
    manifest["sources"]["fives"]["md5"] = "not-a-checksum"
    (tmp_path / "m.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="malformed md5"):
        fetching.load_manifest(tmp_path / "m.json")



@pytest.mark.parametrize("field,value", [("size_bytes", "10240"), ("size_bytes", -1), ("size_bytes", True), ("size_bytes", 1.5),
                                         ("filename", "../outside/escaped.zip"), ("filename", "sub/a.zip"), ("filename", "sub\\a.zip"),
                                         ("filename", ".."), ("filename", ""), ("filename", None), ("sha256", 7)])
def test_manifest_rejects_a_malformed_size_or_file_name(tmp_path, field, value):
    "A size that is not a whole number of bytes would fail every download; a file name with a folder would be written outside --raw."
    manifest = json.loads(fetching.MANIFEST.read_text())
    manifest["sources"]["fives"][field] = value
    (tmp_path / "m.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=re.escape(f"manifest {tmp_path / 'm.json'}: source 'fives' has a malformed {field} {value!r}")):
        fetching.load_manifest(tmp_path / "m.json")

def test_the_paper_counts():
    n = {b.name: {(d.shift, d.labels): d.n for d in b.draws if d.shift != "fit"} for b in BENCHMARKS}
    assert n["ophthalmology"][("id", ("normal",))] == n["ophthalmology"][("id", ("diabetic_retinopathy",))] == 150
    assert n["ophthalmology"][("covariate", ("uwf",))] == 150
    for name in ("radiology", "pathology"):
        per_shift = {}
        for (shift, _), k in n[name].items():
            per_shift[shift] = per_shift.get(shift, 0) + k
        assert per_shift == {"id": 300, "semantic": 300, "covariate": 300, "far": 300}


def test_shipped_splits_are_drawn_from_the_offline_listings():
    listings = {"deepdrid_uwf": (LISTINGS / "deepdrid_uwf.txt").read_text().split(),
                "imagenette": (LISTINGS / "imagenette_val.txt").read_text().split()}
    assert len(listings["deepdrid_uwf"]) == 256 and len(listings["imagenette"]) == 3925
    for bench in BENCHMARKS:
        rows = shipped(bench.name)
        assert rows, bench.name
        assert {r.source for r in rows} <= set(listings), "only sources whose file list is known offline ship"
        for draw in bench.draws:
            if draw.view in listings:
                expected, _ = splits.select(draw, SimpleNamespace(keys=listings[draw.view]), [], seed=0)
                assert sorted(splits.fixed_rows(draw, rows), key=str) == sorted(expected, key=str)
    far = {b.name: {r.original for r in shipped(b.name) if r.shift == "far"} for b in BENCHMARKS}
    assert far["ophthalmology"] < far["radiology"] == far["pathology"]


# ------------------------------------------------------------------------------------------ sampling

def test_rank_is_deterministic_seeded_and_prefix_consistent():
    keys = [f"k{i}" for i in range(200)]
    assert splits.rank(keys, 0, "s") == splits.rank(list(reversed(keys)), 0, "s")
    assert splits.rank(keys, 0, "s") != splits.rank(keys, 1, "s")
    assert splits.rank(keys, 0, "s") != splits.rank(keys, 0, "t")
    subset = keys[::3]
    assert splits.rank(subset, 0, "s") == [k for k in splits.rank(keys, 0, "s") if k in set(subset)]
    assert set(splits.choose(dict.fromkeys(keys, "x"), 5, 0, "s")) <= set(splits.choose(dict.fromkeys(keys, "x"), 50, 0, "s"))


def test_choose_refuses_too_few_candidates():
    with pytest.raises(archives.LayoutError, match="need 3 images but the source has only 2"):
        splits.choose({"a": "x", "b": "x"}, 3, 0, "scope")


def test_a_split_file_keeps_its_rows_when_a_write_fails(tmp_path, monkeypatch):
    "The split file is written beside itself and renamed: a disk that fills up half-way loses none of the rows it had."
    split, rows = tmp_path / "s.csv", [splits.Row("v", "id", "a", f"img/a_{i}.png") for i in range(3)]
    splits.write_split(split, rows)
    before, real = split.read_text(), csv.writer

    class Full:  # writes the header, then the disk is full
        def __init__(self, f, **options): self.writer = real(f, **options)
        def writerow(self, row): self.writer.writerow(row)
        def writerows(self, rows): raise OSError(28, "No space left on device")

    monkeypatch.setattr(csv, "writer", Full)
    with pytest.raises(OSError, match="No space left on device"):
        splits.write_split(split, rows + [splits.Row("v", "id", "b", "img/b_0.png")])
    assert split.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["s.csv"]


SPLIT_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)  # any text a file name or label may hold


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(st.tuples(st.sampled_from(["id", "far", "fit"]), SPLIT_TEXT, SPLIT_TEXT), min_size=1, max_size=6))
@example(items=[("id", "a", "img/a\r2.png")])  # a lone carriage return ends a line for the reader: written unquoted, it split the row
def test_a_split_file_reads_back_the_rows_written(tmp_path, items):
    rows = [splits.Row("v", shift, label, key) for shift, label, key in items]
    splits.write_split(tmp_path / "s.csv", rows)
    assert sorted(splits.read_split(tmp_path / "s.csv"), key=str) == sorted(set(rows), key=str)


# ------------------------------------------------------------------------------------------ fit draws

def letters_view(tmp_path):
    """A source of five images labelled a and five labelled b: ``img/a_0.png`` ... ``img/b_4.png``."""
    root = make_dir(tmp_path / "src", {f"img/{c}_{i}.png": image_bytes("PNG", i) for c in "ab" for i in range(5)})
    return archives.View(archives.open_container(root), r"img/[ab]_\d+\.png")


def letters_pick(label):
    return lambda view: {k: label for k in view.keys if k.split("/")[1].startswith(f"{label}_")}


def letters(*draws):
    return common.Benchmark("letters", ("a", "b"), ("a", "b"), "{}", {"v": ((), None)}, draws)


LETTERS = letters(*(splits.Draw("v", "id", (c,), 3, letters_pick(c)) for c in "ab"),
                  *(splits.Draw("v", "fit", (c,), 2, letters_pick(c)) for c in "ab"))


def test_fit_draws_are_disjoint_from_every_test_draw_of_their_view(tmp_path):
    rows = common.prepare(LETTERS, {"v": letters_view(tmp_path)}, tmp_path / "out", tmp_path / "s.csv", progressbar=False)
    names = {shift: {r["file"].rsplit("/", 1)[1] for r in rows if r["shift"] == shift} for shift in ("id", "fit")}
    assert len(names["id"]) == 6 and len(names["fit"]) == 4
    assert names["id"] | names["fit"] == {f"{c}_{i}.png" for c in "ab" for i in range(5)}, "fit takes what the test draws left"
    assert {r.shift for r in splits.read_split(tmp_path / "s.csv")} == {"id", "fit"}, "fit rows go into the split file"
    folder = read_prepared(tmp_path / "out")
    assert folder.shift.count("fit") == 4
    assert [int(x) for x in folder.labels] == ["ab".index(f.split("/")[1]) for f in folder.files], "fit images keep their class"


def test_a_limited_run_draws_the_first_images_of_the_full_run(tmp_path):
    "Under --limit the fit draws excluded only the limited test picks, so they took images that the full run tests."
    root = make_dir(tmp_path / "src", {f"img/{c}_{i}.png": image_bytes("PNG", i) for c in "ab" for i in range(40)})
    view = archives.View(archives.open_container(root), r"img/[ab]_\d+\.png")
    bench = letters(*(splits.Draw("v", "id", (c,), 30, letters_pick(c)) for c in "ab"),
                    *(splits.Draw("v", "fit", (c,), 10, letters_pick(c)) for c in "ab"))
    limited = common.prepare(bench, {"v": view}, tmp_path / "limited", tmp_path / "s.csv", limit=3, progressbar=False)
    full = common.prepare(bench, {"v": view}, tmp_path / "full", tmp_path / "s.csv", progressbar=False)
    files = lambda rows, shift: {r["file"] for r in rows if r["shift"] == shift}  # noqa: E731
    assert len(files(limited, "fit")) == 6 and files(limited, "fit") < files(full, "fit")
    assert len(files(limited, "id")) == 6 and files(limited, "id") < files(full, "id")


def test_an_overlapping_split_file_is_refused(tmp_path):
    view, split = letters_view(tmp_path), tmp_path / "s.csv"
    common.prepare(LETTERS, {"v": view}, tmp_path / "out", split, progressbar=False)
    rows = splits.read_split(split)
    test_image = next(r.original for r in rows if r.shift == "id" and r.label == "a")
    fit = next(r for r in rows if r.shift == "fit" and r.label == "a")
    splits.write_split(split, [r for r in rows if r != fit] + [splits.Row("v", "fit", "a", test_image)])
    with pytest.raises(archives.LayoutError, match=f"puts v:{test_image} in fit/a, but an earlier draw"):
        common.prepare(LETTERS, {"v": view}, tmp_path / "again", split, progressbar=False)
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("row,message", [("v,id,a,img/a_0.png,oops", "line 3: 5 fields, expected 4"),
                                         ("v,id,a", "line 3: 3 fields, expected 4"),
                                         ("v,test,a,img/a_0.png", "line 3: unknown shift 'test'"),
                                         ("v,id,A,img/a_0.png", "line 3: no draw takes v/id/A"),
                                         ("V,id,a,img/a_0.png", "line 3: no draw takes V/id/a")])
def test_a_hand_edited_split_row_is_refused_before_any_image_is_written(tmp_path, row, message):
    "A row with a field too many or too few, an unknown shift, or a source or label no draw has: named with its file and line."
    split = tmp_path / "s.csv"
    split.write_text(f"source,shift,label,original\nv,id,b,img/b_0.png\n{row}\n")
    with pytest.raises(ValueError, match=re.escape(f"{split}, {message}")):
        common.prepare(LETTERS, {"v": letters_view(tmp_path)}, tmp_path / "out", split, progressbar=False)
    assert not (tmp_path / "out").exists() and split.read_text().endswith(f"{row}\n")


def test_a_split_file_that_is_not_utf8_is_named(tmp_path):
    split = tmp_path / "s.csv"
    split.write_bytes("source,shift,label,original\nv,id,caf\u00e9,k\n".encode("latin-1"))
    with pytest.raises(ValueError, match=re.escape(f"{split} is not UTF-8 text")):
        splits.read_split(split)


def test_a_split_file_with_a_byte_order_mark_is_read(tmp_path):
    "Excel saves 'CSV UTF-8' with a byte-order mark; the header is still the header."
    split = tmp_path / "s.csv"
    split.write_text("\ufeffsource,shift,label,original\nv,id,b,img/b_0.png\n", encoding="utf-8")
    assert splits.read_split(split, LETTERS.draws) == [splits.Row("v", "id", "b", "img/b_0.png")]


def test_the_dry_run_refuses_a_split_row_no_draw_takes(tmp_path):
    (tmp_path / "s.csv").write_text("source,shift,label,original\nPCam,id,benign,test/00004\n")
    with pytest.raises(ValueError, match=r"s\.csv, line 2: no draw takes PCam/id/benign; the draws are pcam/id/benign, "):
        common.run(pathology.BENCHMARK, ["--out", str(tmp_path / "o"), "--split", str(tmp_path / "s.csv"), "--dry-run"])


def test_a_repeated_split_row_is_named_with_its_lines(tmp_path):
    "A row given twice reached the writing as 'X and X would both be written to ...', naming neither the row nor its line."
    (tmp_path / "s.csv").write_text("source,shift,label,original\npcam,id,benign,test/4\npcam,id,benign,test/5\npcam,id,benign,test/4\n")
    with pytest.raises(ValueError, match=r"s\.csv, line 4: pcam,id,benign,test/4 again \(line 2\); remove one"):
        common.run(pathology.BENCHMARK, ["--out", str(tmp_path / "o"), "--split", str(tmp_path / "s.csv"), "--dry-run"])


@pytest.mark.parametrize("option", ["--split", "--manifest"])
def test_a_folder_given_for_a_file_names_the_option(tmp_path, capsys, option):
    "'[Errno 21] Is a directory' named the folder but not the option that gave it."
    assert pathology.main(pathology.BENCHMARK, ["--out", str(tmp_path / "o"), option, str(tmp_path), "--dry-run"]) == 1
    assert capsys.readouterr().err == f"error: {option} {tmp_path} is a folder, not a file\n"
    if option == "--manifest":  # prepare_all's shared option: named once, before any benchmark
        assert prepare_all.cli(["--out", str(tmp_path / "o"), option, str(tmp_path), "--dry-run"]) == 1
        out, err = capsys.readouterr()
        assert err == f"error: {option} {tmp_path} is a folder, not a file\n" and "==>" not in out


def test_the_benchmarks_fit_draws():
    for bench in BENCHMARKS:
        fit = tuple(d for d in bench.draws if d.shift == "fit")
        assert fit and bench.draws[-len(fit):] == fit, "fit draws come last"
        assert {(d.view, d.labels) for d in fit} == {(d.view, d.labels) for d in bench.draws if d.shift == "id"}
    n = {b.name: {d.labels: d.n for d in b.draws if d.shift == "fit"} for b in BENCHMARKS}
    assert n == {"ophthalmology": {("normal",): 50, ("diabetic_retinopathy",): 50},  # FIVES has 200 per class, 150 are tested
                 "radiology": {("normal",): 150, ("pneumonia",): 150}, "pathology": {("benign",): 150, ("malignant",): 150}}
    with pytest.raises(ValueError, match="follows a fit draw; fit draws come last"):
        letters(*reversed(LETTERS.draws)).check()
    with pytest.raises(ValueError, match=r"fit draw labels \('c',\) are not classes"):
        letters(splits.Draw("v", "fit", ("c",), 1, letters_pick("c"))).check()


# ------------------------------------------------------------------------------------------ Ju et al.'s prompts

FUNDUS_KEYS = ophthalmology.BENCHMARK.prompt_classes


def test_prompts_are_read_from_the_notebook_never_run(tmp_path):
    assert prompts.read_prompts(ju_notebook(tmp_path / "l1.ipynb", FUNDUS_L1), FUNDUS_KEYS) == {
        "normal": ["a healthy retina image"], "diabetic_retinopathy": ["a diabetic retina image"]}
    assert prompts.read_prompts(ju_notebook(tmp_path / "l5.ipynb", FUNDUS_L5), FUNDUS_KEYS) == {
        "normal": ["first N/", "second N/"], "diabetic_retinopathy": ["only D/"]}
    swapped = LIST_CELL.format(first="diabetic retina", second="healthy retina", dirs=["D/", "N/"])
    assert prompts.read_prompts(ju_notebook(tmp_path / "sw.ipynb", swapped), FUNDUS_KEYS) == {
        "normal": ["a healthy retina image"], "diabetic_retinopathy": ["a diabetic retina image"]}, "a list follows in_dir"
    assert prompts.read_prompts(ju_notebook(tmp_path / "x.ipynb", XRAY_L10), radiology.BENCHMARK.prompt_classes) == {
        "normal": ["first N", "second N"], "pneumonia": ["only P"]}


@pytest.mark.parametrize("cell, message", [
    (DICT_CELL.format(first="N/", second="G/"), "unknown class key 'G/'"),
    ("p = ['a', 'b']\nin_class = [x.upper() for x in p]\nin_dir = ['N/', 'D/']\n",
     r"in_class is not a literal \(\[x.upper\(\) for x in p\]\); it is read, never run"),
    ("in_class = open('prompts.txt').read()\n", r"in_class is not a literal \(open\('prompts.txt'\).read\(\)\)"),
    ("in_dir = ['N/', 'D/']\n", "assigns no in_class"),
    ("in_class = ['x']\nin_dir = ['N/', 'D/']\n", "in_class lists 1 prompts but in_dir is"),
    ("in_class = {'N/': ['x']}\n", r"no prompts for the classes \['diabetic_retinopathy'\]"),
    ("in_class = {'N/': ['x'], 'D/': ['']}\n", "must be a non-empty list of non-empty strings"),
    ("in_class = ['x',\n", "the first code cell is not Python"),
    ("in_class = {['N/']: ['x']}\n", r"nb\.ipynb: in_class is not a literal \(\{\['N/'\]: \['x'\]\}\)"),  # TypeError: unhashable
    ("in_class = " + "-" * 100_000 + "1\n", r"nb\.ipynb: the first code cell is not Python .*MemoryError"),
    ("in_class = " + "-" * 5_000 + "1\n", r"nb\.ipynb: the first code cell is not Python .*RecursionError"),
])
def test_a_bad_prompt_notebook_is_refused(tmp_path, cell, message):
    with pytest.raises(ValueError, match=message):
        prompts.read_prompts(ju_notebook(tmp_path / "nb.ipynb", cell), FUNDUS_KEYS)


def test_a_tampered_prompt_file_is_refused_by_its_checksum(tmp_path):
    entry = fetching.load_manifest()["sources"]["ju_prompts_ophthalmology_l5"]
    assert entry["sha256"] and entry["url"].startswith("https://raw.githubusercontent.com/PyJulie/Medical-VLMs-OOD-Detection/"
                                                        "a7ed4c98faba387f72f806f66b96f17d91feb9e9/")
    forged = ju_notebook(tmp_path / "forged.ipynb", FUNDUS_L5).read_bytes()
    forged = (forged * (entry["size_bytes"] // len(forged) + 1))[:entry["size_bytes"]]  # the right size, other bytes
    with FileServer({"/nb.ipynb": forged}) as server:
        with pytest.raises(fetching.ChecksumError, match="failed its checksum and was deleted"):
            fetching.download(dict(entry, url=server.url + "/nb.ipynb"), tmp_path / "raw", progressbar=False)
    assert not (tmp_path / "raw" / entry["filename"]).exists()
    (tmp_path / entry["filename"]).write_bytes(forged)
    with pytest.raises(fetching.ChecksumError, match="sha256 is"):
        fetching.fetch("ju_prompts_ophthalmology_l5", entry, tmp_path / "raw", local=tmp_path / entry["filename"])


# ------------------------------------------------------------------------------------------ downloads

def test_download_verifies_the_checksum(tmp_path):
    data = bytes(range(256)) * 40
    with FileServer({"/a.zip": data}) as server:
        path = fetching.download(http_entry(server.url + "/a.zip", data), tmp_path, progressbar=False)
        assert path.read_bytes() == data
        assert path == tmp_path / "fixture.zip"
        again = fetching.download(http_entry(server.url + "/a.zip", data), tmp_path, progressbar=False)
    assert again == path and len(server.requests) == 1, "a verified file is not downloaded twice"


def test_a_corrupted_download_is_rejected_and_deleted(tmp_path):
    data = bytes(range(256)) * 40
    corrupted = data[:100] + b"X" + data[101:]
    with FileServer({"/a.zip": corrupted}) as server:
        with pytest.raises(fetching.ChecksumError, match=r"failed its checksum and was deleted: md5 is"):
            fetching.download(http_entry(server.url + "/a.zip", data), tmp_path, progressbar=False)
    assert not (tmp_path / "fixture.zip").exists() and not (tmp_path / "fixture.zip.part").exists()


def test_a_download_of_the_wrong_size_is_rejected_without_a_checksum(tmp_path):
    data = b"x" * 1000
    with FileServer({"/a.zip": data}) as server:
        with pytest.raises(fetching.ChecksumError, match="1000 bytes, the manifest says 999"):
            fetching.download(http_entry(server.url + "/a.zip", data, md5=None, size_bytes=999), tmp_path, progressbar=False)
    assert not (tmp_path / "fixture.zip").exists()


def test_a_partial_download_is_resumed_with_a_range_request(tmp_path):
    data = bytes(np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8))
    entry = http_entry(None, data)
    with FileServer({"/a.zip": data}, cut_after={"/a.zip": 200_000}) as server:
        entry["url"] = server.url + "/a.zip"
        with pytest.raises(fetching.DownloadError, match="run the same command again to resume"):
            fetching.download(entry, tmp_path, progressbar=False, chunk_size=16_384)
        kept = (tmp_path / "fixture.zip.part").stat().st_size
        assert 0 < kept <= 200_000
        path = fetching.download(entry, tmp_path, progressbar=False, chunk_size=16_384)
    assert path.read_bytes() == data
    assert server.requests == [("/a.zip", None), ("/a.zip", f"bytes={kept}-")]
    assert not (tmp_path / "fixture.zip.part").exists()


def test_a_server_that_ignores_ranges_makes_the_download_start_over(tmp_path):
    data = b"abcdefgh" * 1000
    (tmp_path / "fixture.zip.part").write_bytes(b"garbage")
    with FileServer({"/a.zip": data}, ranges=False) as server:
        path = fetching.download(http_entry(server.url + "/a.zip", data), tmp_path, progressbar=False)
    assert path.read_bytes() == data


def test_a_complete_part_file_is_finished_without_downloading_again(tmp_path):
    data = b"abcdefgh" * 1000
    (tmp_path / "fixture.zip.part").write_bytes(data)
    with FileServer({"/a.zip": data}) as server:
        path = fetching.download(http_entry(server.url + "/a.zip", data), tmp_path, progressbar=False)
    assert path.read_bytes() == data and server.requests == [("/a.zip", f"bytes={len(data)}-")]


@pytest.mark.parametrize("encoding", ["when asked", "always"])
def test_a_download_is_stored_as_served_whatever_the_content_encoding(tmp_path, encoding):
    "requests asked for gzip and decoded it, so the bytes written never matched Content-Length: every run said 'run again to resume'."
    data = bytes(range(256)) * 40
    data = gzip.compress(data, mtime=0) if encoding == "always" else data  # a .gz file, stored as it is
    with FileServer({"/a.gz": data}, encoding=encoding) as server:
        path = fetching.download(http_entry(server.url + "/a.gz", data), tmp_path, progressbar=False)
    assert path.read_bytes() == data


def test_a_local_copy_is_checked_against_the_manifest(tmp_path):
    entry = http_entry("http://127.0.0.1:9/never", b"right")
    (tmp_path / "fixture.zip").write_bytes(b"wrong")
    with pytest.raises(fetching.ChecksumError, match="5 bytes|md5 is"):
        fetching.fetch("fixture", dict(entry, size_bytes=None), tmp_path / "raw", local=tmp_path / "fixture.zip")
    with pytest.raises(FileNotFoundError, match="no such file"):
        fetching.fetch("fixture", entry, tmp_path, local=tmp_path / "missing.zip")


# ------------------------------------------------------------------------------------------ downloads: interruptions, concurrent runs, wrong answers

def test_an_interruption_while_the_download_is_checked_keeps_every_byte(tmp_path, monkeypatch):
    "Ctrl-C while the finished download was checked lost it all: pooch deleted the temporary file it had been renamed to."
    import builtins
    data = bytes(range(256)) * 40
    real_open = builtins.open

    def interrupted(file, mode="r", *args, **kwargs):  # Ctrl-C as the checksum starts reading the received file
        if mode == "rb" and Path(file).parent == tmp_path:
            raise KeyboardInterrupt
        return real_open(file, mode, *args, **kwargs)

    with FileServer({"/a.zip": data}) as server:
        entry = http_entry(server.url + "/a.zip", data)
        with monkeypatch.context() as m:
            m.setattr(builtins, "open", interrupted)
            with pytest.raises(KeyboardInterrupt):
                fetching.download(entry, tmp_path, progressbar=False)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["fixture.zip.part"], "nothing lost, nothing orphaned"
        assert (tmp_path / "fixture.zip.part").read_bytes() == data
        path = fetching.download(entry, tmp_path, progressbar=False)
    assert path.read_bytes() == data and sorted(p.name for p in tmp_path.iterdir()) == ["fixture.zip"]
    assert server.requests == [("/a.zip", None), ("/a.zip", f"bytes={len(data)}-")], "the rerun downloads nothing again"


class ScriptedServer(FileServer):
    """A FileServer whose every GET is answered by ``answer(handler, n)``, n counting the requests from 0."""

    def __init__(self, answer):
        self.requests, owner = [], self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                owner.requests.append((self.path, self.headers.get("Range")))
                answer(self, len(owner.requests) - 1)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def send(handler, status, body=b"", **headers):
    """Answer with a status, headers (underscores for dashes) and a body."""
    handler.send_response(status)
    for name, value in ({"Content_Length": str(len(body))} | headers).items():
        handler.send_header(name.replace("_", "-"), value)
    handler.end_headers()
    handler.wfile.write(body)


@pytest.mark.parametrize("checksum", ["md5", "size only"])
def test_a_second_run_downloading_the_same_file_is_refused_and_the_first_is_kept_whole(tmp_path, checksum):
    "Two runs sharing --raw wrote one <file>.part at once: the second failed on a vanished file, the first's verified file grew, a size-only file kept a hole."
    data = bytes(np.random.default_rng(1).integers(0, 256, 200_000, dtype=np.uint8))
    halfway, release, result = threading.Event(), threading.Event(), []

    def answer(handler, n):  # the server ignores Range; its first answer stops half-way until released
        if n:
            return send(handler, 200, data)
        send(handler, 200, data[:100_000], Content_Length=str(len(data)))
        handler.wfile.flush()
        halfway.set()
        release.wait(10)
        handler.wfile.write(data[100_000:])

    with ScriptedServer(answer) as server:
        entry = http_entry(server.url + "/a.zip", data, **({"md5": None} if checksum == "size only" else {}))
        first = threading.Thread(target=lambda: result.append(fetching.download(entry, tmp_path, progressbar=False, chunk_size=4096)))
        first.start()
        try:
            assert halfway.wait(10)
            with pytest.raises(BlockingIOError, match=r"^another run \(process \d+\) is downloading fixture\.zip into "
                                                      f"{re.escape(str(tmp_path))}; let it finish, then run this again$"):
                fetching.download(entry, tmp_path, progressbar=False)
        finally:
            release.set()
            first.join(10)
        assert result == [tmp_path / "fixture.zip"] and result[0].read_bytes() == data
        assert fetching.download(entry, tmp_path, progressbar=False).read_bytes() == data, "a later run finds it whole"
    assert len(server.requests) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["fixture.zip"]


def test_a_kaggle_file_another_run_is_downloading_is_not_taken(tmp_path):
    "The kaggle client writes the archive under its own name: a second run took the half-written file as finished."
    entry = dict(fetching.load_manifest()["sources"]["chest_ct"])
    (tmp_path / entry["filename"]).write_bytes(b"PK half")
    with hold_lock(tmp_path / f"{entry['filename']}.lock"):
        with pytest.raises(BlockingIOError, match=f"^another run is downloading {re.escape(entry['filename'])} into "):
            fetching.fetch_kaggle("chest_ct", entry, tmp_path)
    assert fetching.fetch_kaggle("chest_ct", entry, tmp_path) == tmp_path / entry["filename"]


PAGE = b"<html><body><form>Please log in</form></body></html>"


@pytest.mark.parametrize("headers,error,message", [
    ({"Content_Type": "text/html; charset=utf-8"}, fetching.DownloadError, "answered an HTML page, not the file"),
    ({"Content_Type": "application/octet-stream"}, fetching.ChecksumError, f"sends {len(PAGE)} bytes, the manifest says 200000")])
def test_a_page_in_place_of_the_file_keeps_the_partial_download(tmp_path, headers, error, message):
    "A login or captive-portal page (200) answering the resume request overwrote the partial download, which the checksum then deleted."
    data = bytes(np.random.default_rng(2).integers(0, 256, 200_000, dtype=np.uint8))
    (tmp_path / "fixture.zip.part").write_bytes(data[:100_000])
    with ScriptedServer(lambda handler, n: send(handler, 200, PAGE, **headers)) as server:
        with pytest.raises(error, match=f"^fixture\\.zip from {re.escape(server.url)}/a\\.zip.* {message}[^\n]*$"):
            fetching.download(http_entry(server.url + "/a.zip", data), tmp_path, progressbar=False)
    assert server.requests == [("/a.zip", "bytes=100000-")]
    assert (tmp_path / "fixture.zip.part").read_bytes() == data[:100_000], "the bytes received so far are kept"


@pytest.mark.parametrize("status,advice", [
    (404, "HTTP 404 Not Found; the file is not there, it may have moved: find it on https://example.org/page "
          "and put its link in the manifest's url"),
    (500, "HTTP 500 Internal Server Error; the server failed: try again later"),
    (302, "the server redirects in a loop .*; the link may be out of date: find the file on https://example.org/page "
          "and put its link in the manifest's url")])
def test_a_download_the_server_refuses_is_named_with_advice_that_fits(tmp_path, status, advice):
    "404, 500 and a redirect loop all said 'run the same command again to resume', naming only the URL."
    data = b"abcdefgh" * 1000
    (tmp_path / "fixture.zip.part").write_bytes(data[:100])
    with ScriptedServer(lambda handler, n: send(handler, status, Location=handler.path)) as server:
        url = server.url + "/a.zip"
        with pytest.raises(fetching.DownloadError, match=f"^fixture\\.zip from {re.escape(url)}: {advice}$") as caught:
            fetching.download(http_entry(url, data, page="https://example.org/page"), tmp_path, progressbar=False)
    assert "resume" not in str(caught.value) and (tmp_path / "fixture.zip.part").read_bytes() == data[:100]


# ------------------------------------------------------------------------------------------ dry run

@pytest.mark.parametrize("script", ["ophthalmology", "radiology", "pathology", "prepare_all"])
def test_dry_run_touches_no_network_and_writes_nothing(script, tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("--dry-run used the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    argv = ["--out", str(tmp_path / "out"), "--raw", str(tmp_path / "raw"), "--dry-run"]
    if script == "prepare_all":
        assert prepare_all.cli(argv) == 0
    else:
        module = {"ophthalmology": ophthalmology, "radiology": radiology, "pathology": pathology}[script]
        assert common.main(module.BENCHMARK, argv) == 0
    printed = capsys.readouterr().out
    assert not (tmp_path / "out").exists() and not (tmp_path / "raw").exists()
    manifest = fetching.load_manifest()
    names = [b.name for b in BENCHMARKS] if script == "prepare_all" else [script]
    for bench in (b for b in BENCHMARKS if b.name in names):
        for key in bench.keys():
            entry = manifest["sources"][key]
            assert (entry["url"] or entry["page"]) in printed
            assert str(tmp_path / "raw" / entry["filename"]) in printed
            assert entry["approx_size"] in printed
    if "radiology" in names:
        assert "kaggle competitions download -c rsna-pneumonia-detection-challenge" in printed
        assert "L10  from ju_prompts_radiology_l10" in printed
    if "pathology" in names:
        assert "Prompt sets: none. Ju et al.'s pathology prompts describe LC25000 lung tissue" in printed
    assert "fit/normal/" in printed or "fit/benign/" in printed
    assert "among the images no test draw took, then added to the split file" in printed


def test_a_tilde_is_expanded_in_every_path_option(tmp_path, monkeypatch, capsys):
    "'--out=~/x' reaches the script unexpanded by the shell: it made a folder named '~' in the current one."
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    shutil.copy(fetching.MANIFEST, tmp_path / "m.json")
    (tmp_path / "s.csv").write_text("source,shift,label,original\n")
    argv = ["--out=~/prepared", "--split=~/s.csv", "--manifest=~/m.json", "--raw=~/raw", "--dry-run"]
    assert common.main(pathology.BENCHMARK, argv) == 0
    printed = capsys.readouterr().out
    assert f"written to {tmp_path / 'prepared'}/" in printed and f"(split file {tmp_path / 's.csv'})" in printed
    assert "~" not in printed


def test_dry_run_reports_a_partial_download(tmp_path, capsys):
    (tmp_path / "FIVES.rar.part").write_bytes(b"x" * 123)
    common.main(ophthalmology.BENCHMARK, ["--out", str(tmp_path / "o"), "--raw", str(tmp_path), "--dry-run"])
    assert "partial, 123 bytes, will resume" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ ophthalmology

def fives_files():
    """FIVES' real layout: 600 train + 200 test, 200 per disease code, vessel masks beside, xlsx and a Thumbs.db."""
    files, n = {}, 0
    for split, per_code in (("train", 150), ("test", 50)):
        for code in "ADGN":
            for _ in range(per_code):
                n += 1
                files[f"{FIVES_WRAPPER}/{split}/Original/{n}_{code}.png"] = image_bytes("PNG", n)
        files[f"{FIVES_WRAPPER}/{split}/Ground truth/1_A.png"] = image_bytes("PNG")
        files[f"{FIVES_WRAPPER}/{split}/Original/Thumbs.db"] = b"\0junk"
    files[f"{FIVES_WRAPPER}/Quality Assessment.xlsx"] = b"PK\3\4 not really"
    return files


def deepdrid_zip(path):
    """DeepDRiD v1.1's layout: a wrapper folder, the 256 UWF images (real paths) and some regular fundus images."""
    files = {f"deepdrdoc-DeepDRiD-0657068/{p}": image_bytes("JPEG", i)
             for i, p in enumerate((LISTINGS / "deepdrid_uwf.txt").read_text().split())}
    files["deepdrdoc-DeepDRiD-0657068/regular_fundus_images/regular-fundus-training/Images/1/1_l1.jpg"] = image_bytes("JPEG")
    files["deepdrdoc-DeepDRiD-0657068/ultra-widefield_images/ultra-widefield-training/ultra-widefield-training.csv"] = b"patient_id\n"
    return make_zip(path, files)


def imagenette_tgz(path, names):
    """Imagenette's layout: imagenette2-320/{train,val}/<wnid>/<name>.JPEG and the noisy-label table."""
    files = {f"imagenette2-320/{n}": image_bytes("JPEG", i) for i, n in enumerate(names)}
    files["imagenette2-320/train/n01440764/n01440764_1.JPEG"] = image_bytes("JPEG")
    files["imagenette2-320/noisy_imagenette.csv"] = b"path,is_valid\n"
    return make_tgz(path, files)


@pytest.fixture(scope="module")
def ophthalmology_sources(tmp_path_factory):
    """FIVES as a local folder; DeepDRiD and Imagenette served over HTTP by one server for the module."""
    tmp = tmp_path_factory.mktemp("ophthalmology_sources")
    far = sorted({r.original for r in shipped("ophthalmology") if r.shift == "far"})
    extra = ["val/n03888257/n03888257_999999.JPEG", "val/n01440764/ILSVRC2012_val_0.JPEG"]
    blobs = {"/deepdrid.zip": deepdrid_zip(tmp / "d.zip").read_bytes(),
             "/imagenette.tgz": imagenette_tgz(tmp / "i.tgz", far + extra).read_bytes(),
             "/l1.ipynb": ju_notebook(tmp / "l1.ipynb", FUNDUS_L1).read_bytes(),
             "/l5.ipynb": ju_notebook(tmp / "l5.ipynb", FUNDUS_L5).read_bytes()}
    fives = make_dir(tmp / "fives", fives_files())
    with FileServer(blobs) as server:
        manifest = json.loads(fetching.MANIFEST.read_text())
        for key, path in (("deepdrid", "/deepdrid.zip"), ("imagenette", "/imagenette.tgz")):
            manifest["sources"][key].update(url=server.url + path, md5=md5(blobs[path]), size_bytes=len(blobs[path]))
        for key, path in (("ju_prompts_ophthalmology_l1", "/l1.ipynb"), ("ju_prompts_ophthalmology_l5", "/l5.ipynb")):
            manifest["sources"][key].update(url=server.url + path, sha256=hashlib.sha256(blobs[path]).hexdigest(),
                                            size_bytes=len(blobs[path]))
        (tmp / "manifest.json").write_text(json.dumps(manifest))
        yield SimpleNamespace(server=server, manifest=tmp / "manifest.json", fives=fives)


@pytest.fixture
def served_ophthalmology(ophthalmology_sources, tmp_path):
    """Per test: an empty download folder and a copy of the shipped split file."""
    src = ophthalmology_sources
    src.server.requests.clear()
    split = tmp_path / "ophthalmology.csv"
    shutil.copy(splits.SPLITS / "ophthalmology.csv", split)
    base = ["--raw", str(tmp_path / "raw"), "--manifest", str(src.manifest),
            "--local", f"fives={src.fives}", "--split", str(split), "--no-progress"]
    return SimpleNamespace(server=src.server, base=base, split=split, tmp=tmp_path)


def test_ophthalmology_end_to_end(served_ophthalmology):
    s = served_ophthalmology
    out = s.tmp / "out"
    table = common.run(ophthalmology.BENCHMARK, ["--out", str(out)] + s.base)
    rows = read_csv(out / "split.csv")
    assert rows == [{k: str(v) for k, v in r.items()} for r in table]
    assert list(rows[0]) == ["file", "shift", "label", "source"]
    counts = {}
    for r in rows:
        counts[(r["shift"], r["label"])] = counts.get((r["shift"], r["label"]), 0) + 1
        assert (out / r["file"]).is_file() and r["file"].startswith(f"{r['shift']}/{r['label']}/")
    assert {k: v for k, v in counts.items() if k[0] != "far"} == {
        ("id", "normal"): 150, ("id", "diabetic_retinopathy"): 150, ("semantic", "glaucoma"): 150,
        ("semantic", "amd"): 150, ("covariate", "uwf"): 150, ("fit", "normal"): 50, ("fit", "diabetic_retinopathy"): 50}
    assert sum(v for k, v in counts.items() if k[0] == "far") == 150
    assert all(f.name.endswith("_N.png") for f in (out / "id" / "normal").iterdir())
    assert all(f.name.startswith(("train_", "test_")) for f in (out / "semantic" / "amd").iterdir())
    assert {r["file"].rsplit("/", 1)[1] for r in rows if r["shift"] == "covariate"} == {
        ophthalmology.uwf_name(r.original) for r in shipped("ophthalmology") if r.shift == "covariate"}
    classes = json.loads((out / "classes.json").read_text())
    assert classes["classes"] == ["normal", "diabetic_retinopathy"]
    assert classes["prompts"] == {"normal": ["normal"], "diabetic_retinopathy": ["diabetic retinopathy"]}
    assert classes["counts"]["id"] == {"normal": 150, "diabetic_retinopathy": 150}
    # the FIVES draws were sampled now and added to the split file; the shipped rows are untouched
    split = splits.read_split(s.split)
    assert set(shipped("ophthalmology")) < set(split) and len(split) == 1000
    # fit/ holds the 50 images of each ID class that id/ does not, labelled with their class
    folder = read_prepared(out)
    for c in ("normal", "diabetic_retinopathy"):
        fit, test = ({f.name for f in (out / shift / c).iterdir()} for shift in ("fit", "id"))
        assert len(fit) == 50 and not fit & test and len(fit | test) == 200
    assert {int(x) for x, sh in zip(folder.labels, folder.shift) if sh == "fit"} == {0, 1}
    assert all(folder.classes[x] == f.split("/")[1] for f, x, sh in zip(folder.files, folder.labels, folder.shift) if sh == "fit")
    # the prompt sets, read from the (served, checksummed) notebooks
    assert folder.prompt_sets == {"L1": {"normal": ["a healthy retina image"], "diabetic_retinopathy": ["a diabetic retina image"]},
                                  "L5": {"normal": ["first N/", "second N/"], "diabetic_retinopathy": ["only D/"]}}
    assert classes["prompt_set_sources"] == {"L1": "ju_prompts_ophthalmology_l1", "L5": "ju_prompts_ophthalmology_l5"}
    # a second run reuses the split file, so it writes exactly the same files
    common.run(ophthalmology.BENCHMARK, ["--out", str(out)] + s.base)
    assert read_csv(out / "split.csv") == rows and splits.read_split(s.split) == split
    # and the downloads were fetched once, with their checksums verified
    assert sorted(p for p, _ in s.server.requests) == ["/deepdrid.zip", "/imagenette.tgz", "/l1.ipynb", "/l5.ipynb"]


def test_limit_takes_a_subset_of_the_full_draw_and_leaves_the_split_alone(served_ophthalmology):
    s = served_ophthalmology
    before = s.split.read_text()
    small = common.run(ophthalmology.BENCHMARK, ["--out", str(s.tmp / "small"), "--limit", "3"] + s.base)
    larger = common.run(ophthalmology.BENCHMARK, ["--out", str(s.tmp / "larger"), "--limit", "7"] + s.base)
    assert len(small) == 8 * 3 and len(larger) == 8 * 7 and s.split.read_text() == before
    assert {r["file"] for r in small} < {r["file"] for r in larger}
    shipped_uwf = {ophthalmology.uwf_name(r.original) for r in shipped("ophthalmology") if r.shift == "covariate"}
    assert {r["file"].rsplit("/", 1)[1] for r in larger if r["shift"] == "covariate"} < shipped_uwf
    other = common.run(ophthalmology.BENCHMARK, ["--out", str(s.tmp / "other"), "--limit", "7"] + s.base
                       + ["--seed", "1", "--split", str(s.tmp / "none.csv")])  # the last --split wins
    fives = lambda rows: {r["file"] for r in rows if r["source"] == "fives"}  # noqa: E731
    assert fives(other) != fives(larger), "the seed decides the draws the split file does not fix"


def test_a_split_file_fixing_fewer_images_than_the_paper_is_reported_and_warned(served_ophthalmology, capsys):
    "A split file with 100 'fives,id,normal' rows: the dry run said 150 would be written, the real run wrote 100 without a word."
    s = served_ophthalmology
    normal = sorted(k for k in (ophthalmology.fives_view({"fives": ophthalmology_fives(s)}).keys) if k.endswith("_N.png"))[:100]
    with open(s.split, "a") as f:
        f.writelines(f"fives,id,normal,{k}\n" for k in normal)
    assert ophthalmology.main(ophthalmology.BENCHMARK, ["--out", str(s.tmp / "out"), "--dry-run"] + s.base) == 0
    out, err = capsys.readouterr()
    assert [line.split()[0] for line in out.splitlines() if "id/normal/" in line] == ["100"] and err == ""
    assert "fixed by the split file (100 rows; the paper draws 150)" in out
    common.run(ophthalmology.BENCHMARK, ["--out", str(s.tmp / "out")] + s.base)
    assert len(list((s.tmp / "out" / "id" / "normal").iterdir())) == 100
    assert capsys.readouterr().err.splitlines()[-1] == (f"warning: {s.split} fixes 100 images of the draw fives/id/normal, "
                                                        "not the paper's 150")


def ophthalmology_fives(s):
    "The FIVES folder the served ophthalmology sources use."
    return Path(next(a for a in s.base if a.startswith("fives=")).partition("=")[2])


def test_a_split_naming_a_missing_image_is_refused(served_ophthalmology):
    s = served_ophthalmology
    with open(s.split, "a") as f:
        f.write("fives,id,normal,train/Original/9999_N.png\n")
    with pytest.raises(archives.LayoutError, match="9999_N.png.*different version"):
        common.run(ophthalmology.BENCHMARK, ["--out", str(s.tmp / "out")] + s.base)
    assert not (s.tmp / "out").exists(), "nothing is written when the selection fails"


def test_fives_without_a_rar_tool_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "FIVES.rar").write_bytes(b"Rar!\x1a\x07\x01\x00")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(archives.LayoutError, match="apt-get install -y libarchive-tools"):
        archives.open_container(tmp_path / "FIVES.rar")


# ------------------------------------------------------------------------------------------ radiology

def dicom_bytes(pixels, photometric="MONOCHROME2"):
    pydicom = pytest.importorskip("pydicom")
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = SecondaryCaptureImageStorage, generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset(None, {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
    ds.Modality, ds.SamplesPerPixel, ds.PhotometricInterpretation = "CR", 1, photometric
    ds.Rows, ds.Columns = pixels.shape
    bits = pixels.dtype.itemsize * 8
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = bits, bits, bits - 1, 0
    ds.PixelData = pixels.tobytes()
    buffer = io.BytesIO()
    pydicom.dcmwrite(buffer, ds, enforce_file_format=True)
    return buffer.getvalue()


def rsna_zip(path):
    """RSNA's layout: DICOMs under stage_2_train_images, class table with a repeated patient (two boxes), labels, test images."""
    rng = np.random.default_rng(1)
    classes = ["Normal"] * 4 + ["Lung Opacity"] * 4 + ["No Lung Opacity / Not Normal"] * 4
    ids = [f"{i:04d}abcd-{i}" for i in range(len(classes))]
    table = "patientId,class\n" + "".join(f"{p},{c}\n" for p, c in zip(ids, classes)) + f"{ids[5]},Lung Opacity\n"
    files = {"stage_2_detailed_class_info.csv": table.encode(), "stage_2_train_labels.csv": b"patientId,x,y,width,height,Target\n",
             "stage_2_test_images/ffff.dcm": dicom_bytes(np.zeros((8, 8), np.uint8)),
             "GCP Credits Request Link - RSNA.txt": b"..."}
    pixels = {}
    for p in ids:
        pixels[p] = rng.integers(0, 256, (8, 8), dtype=np.uint8)
        files[f"stage_2_train_images/{p}.dcm"] = dicom_bytes(pixels[p])
    return make_zip(path, files), pixels


def ct_zip(path):
    """The CT dataset's layout: one folder per class, COVID unused, mixed case and extensions."""
    files = {f"COVID2_CT/{i}.png": image_bytes("PNG", i) for i in range(3)}
    files.update({f"Normal_CT/{i} (1).jpg": image_bytes("JPEG", i) for i in range(3)})
    files.update({f"pneumonia_CT/pneumonia_CT/{i}.png": image_bytes("PNG", i) for i in range(3)})
    return make_zip(path, files)


def test_radiology_end_to_end(tmp_path):
    pytest.importorskip("pydicom")
    rsna, pixels = rsna_zip(tmp_path / "rsna-pneumonia-detection-challenge.zip")
    far = sorted({r.original for r in shipped("radiology") if r.shift == "far"})
    argv = ["--out", str(tmp_path / "out"), "--raw", str(tmp_path / "raw"), "--limit", "2", "--no-progress",
            "--local", f"rsna={rsna}", "--local", f"chest_ct={ct_zip(tmp_path / 'ct.zip')}",
            "--local", f"imagenette={imagenette_tgz(tmp_path / 'i.tgz', far)}", "--split", str(tmp_path / "s.csv"),
            "--local", f"ju_prompts_radiology_l1={ju_notebook(tmp_path / 'l1.ipynb', XRAY_L1)}",
            "--local", f"ju_prompts_radiology_l10={ju_notebook(tmp_path / 'l10.ipynb', XRAY_L10)}"]
    rows = common.run(radiology.BENCHMARK, argv)
    got = {(r["shift"], r["label"]) for r in rows}
    assert got >= {("id", "normal"), ("id", "pneumonia"), ("semantic", "no_lung_opacity_not_normal"),
                   ("covariate", "normal_ct"), ("covariate", "pneumonia_ct")}
    out = tmp_path / "out"
    for r in rows:
        if r["source"] == "rsna":
            patient = Path(r["file"]).stem
            assert r["file"].endswith(".png")
            assert np.array_equal(np.asarray(Image.open(out / r["file"])), pixels[patient]), "DICOM pixels survive"
    assert not (tmp_path / "s.csv").exists(), "--limit never writes the split file"
    assert json.loads((out / "classes.json").read_text())["ood_to_id"] == {"normal_ct": "normal", "pneumonia_ct": "pneumonia"}
    folder = read_prepared(out)
    assert folder.prompt_sets == {"L1": {"normal": ["a clear lung image"], "pneumonia": ["a cloudy lung image"]},
                                  "L10": {"normal": ["first N", "second N"], "pneumonia": ["only P"]}}
    assert sorted({f for f in folder.files if f.startswith("fit/")}) == sorted(
        r["file"] for r in rows if r["shift"] == "fit") and len({r["label"] for r in rows if r["shift"] == "fit"}) == 2


def test_dicom_conversion_inverts_monochrome1_and_scales_16_bit():
    pytest.importorskip("pydicom")
    ramp = np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000
    png = np.asarray(Image.open(io.BytesIO(radiology.dicom_to_png(dicom_bytes(ramp, "MONOCHROME1")))))
    assert png.dtype == np.uint8 and png[0, 0] == 255 and png[-1, -1] == 0
    assert np.all(np.diff(png.reshape(-1).astype(int)) <= 0)


@pytest.mark.parametrize("header", ["patientId,class", "\ufeffpatientId,class", "patientId,Class", "patientId,x,y,Target"])
def test_the_rsna_class_table_header_is_checked(tmp_path, header):
    "A byte-order mark (a table saved by Excel) is read; a table without patientId and class is named with its columns."
    table = f"{header}\n0001,Normal\n".encode()
    view = radiology.rsna_view({"rsna": make_dir(tmp_path / "rsna", {"stage_2_detailed_class_info.csv": table})})
    columns = header.lstrip("\ufeff").split(",")
    if columns == ["patientId", "class"]:
        assert radiology.rsna_labels(view) == {"stage_2_train_images/0001.dcm": "normal"}
    else:
        with pytest.raises(archives.LayoutError, match=re.escape(f"stage_2_detailed_class_info.csv: columns {columns}, "
                                                                 "expected patientId and class")):
            radiology.rsna_labels(view)


@pytest.mark.parametrize("damage", ["not DICOM", "cut short"])
def test_a_bad_dicom_file_is_named(tmp_path, damage):
    "An RSNA file that is not DICOM (an HTML error page) or is cut short: one line naming it, not pydicom's traceback."
    rsna, _ = rsna_zip(tmp_path / "rsna.zip")
    with zipfile.ZipFile(rsna) as z:
        files = {name: z.read(name) for name in z.namelist()}
    key = "stage_2_train_images/0000abcd-0.dcm"
    files[key] = b"<html>403 Forbidden</html>" if damage == "not DICOM" else files[key][:-40]
    view = radiology.rsna_view({"rsna": make_zip(tmp_path / "bad.zip", files)})
    with pytest.raises(archives.LayoutError, match=f"rsna:{re.escape(key)} is not a readable DICOM radiograph"):
        list(view.read_many([key]))


@pytest.fixture(scope="module")
def write_dicom():
    "tests/test_dicom.py's writer, imported before a hypothesis test runs: that module's own @given tests, defined inside one, would nest."
    pytest.importorskip("pydicom")
    from test_dicom import write_dicom
    return write_dicom


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bits=st.sampled_from([8, 12, 16]), photometric=st.sampled_from(["MONOCHROME1", "MONOCHROME2"]),
       window=st.one_of(st.none(), st.tuples(st.integers(-500, 3000), st.integers(1, 4000))),
       rescale=st.sampled_from([None, (1, 0), (2, -1024)]), seed=st.integers(0, 2**16))
def test_the_data_script_converts_a_dicom_file_as_the_library_reads_it(tmp_path, write_dicom, bits, photometric, window, rescale, seed):
    "A radiograph prepared as PNG reaches the model as `proton-ood score` reads the same DICOM file: one conversion, not two."
    from proton.models.vlm import read_image
    pixels = np.random.default_rng(seed).integers(0, 2**bits, (6, 7)).astype(np.uint8 if bits == 8 else np.uint16)
    tags = {} if window is None else dict(WindowCenter=window[0], WindowWidth=window[1])
    if rescale is not None: tags |= dict(RescaleSlope=rescale[0], RescaleIntercept=rescale[1])
    path = write_dicom(tmp_path / "x.dcm", pixels, photometric, **tags)
    png = np.asarray(Image.open(io.BytesIO(radiology.dicom_to_png(path.read_bytes()))))
    np.testing.assert_array_equal(png, read_image(path))


def test_radiology_without_kaggle_prints_exactly_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("KAGGLE_USERNAME", "KAGGLE_KEY", "KAGGLE_API_TOKEN", "KAGGLE_CONFIG_DIR"):
        monkeypatch.delenv(var, raising=False)
    code = common.main(radiology.BENCHMARK, ["--out", str(tmp_path / "out"), "--raw", str(tmp_path / "raw")])
    message = capsys.readouterr().err
    assert code == 2
    for needed in ("Create New Token", "~/.kaggle/kaggle.json", "chmod 600", "pip install kaggle",
                   "https://www.kaggle.com/competitions/rsna-pneumonia-detection-challenge/rules",
                   f"kaggle competitions download -c rsna-pneumonia-detection-challenge -p {tmp_path / 'raw'}",
                   f"kaggle datasets download -d anaselmasry/covid19normalpneumonia-ct-images -p {tmp_path / 'raw'}"):
        assert needed in message
    assert not (tmp_path / "out").exists() and not (tmp_path / "raw" / "imagenette2-320.tgz").exists()


def test_kaggle_dataset_instructions_need_no_rules():
    entry = fetching.load_manifest()["sources"]["chest_ct"]
    text = fetching.kaggle_instructions("chest_ct", entry, Path("/raw"))
    assert "kaggle datasets download -d anaselmasry/covid19normalpneumonia-ct-images -p /raw" in text
    assert "rules" not in text


# ------------------------------------------------------------------------------------------ pathology

def pcam_files(tmp_path, n=24):
    """PCam's format: gzipped HDF5, x (N, 96, 96, 3) uint8 and y (N, 1, 1, 1)."""
    h5py = pytest.importorskip("h5py")
    x = np.random.default_rng(2).integers(0, 256, (n, 96, 96, 3), dtype=np.uint8)
    y = (np.arange(n) % 3 == 0).astype(np.uint8).reshape(n, 1, 1, 1)
    paths = []
    for name, key, value in (("x", "x", x), ("y", "y", y)):
        plain = tmp_path / f"pcam_{name}.h5"  # not the manifest's file name, which would be checked against its md5
        with h5py.File(plain, "w") as f:
            f.create_dataset(key, data=value)
        with open(plain, "rb") as src, gzip.open(f"{plain}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        plain.unlink()
        paths.append(Path(f"{plain}.gz"))
    return paths, x, y.reshape(-1)


def crc_zip(path):
    """CRC-VAL-HE-7K's layout: CRC-VAL-HE-7K/<CLASS>/<CLASS>-<id>.tif, nine classes."""
    files = {f"CRC-VAL-HE-7K/{c}/{c}-TCGA-{i:04d}.tif": image_bytes("TIFF", i)
             for c in ("ADI", "BACK", "DEB", "LYM", "MUC", "MUS", "NORM", "STR", "TUM") for i in range(3)}
    files["__MACOSX/CRC-VAL-HE-7K/NORM/._NORM-TCGA-0000.tif"] = b"resource fork"
    return make_zip(path, files)


def test_pathology_end_to_end(tmp_path):
    (x_path, y_path), x, y = pcam_files(tmp_path)
    far = sorted({r.original for r in shipped("pathology") if r.shift == "far"})
    argv = ["--out", str(tmp_path / "out"), "--raw", str(tmp_path / "raw"), "--limit", "2", "--no-progress",
            "--local", f"pcam_test_x={x_path}", "--local", f"pcam_test_y={y_path}",
            "--local", f"crc_val={crc_zip(tmp_path / 'crc.zip')}",
            "--local", f"imagenette={imagenette_tgz(tmp_path / 'i.tgz', far)}", "--split", str(tmp_path / "s.csv")]
    rows = common.run(pathology.BENCHMARK, argv)
    labels = {}
    for r in rows:
        labels.setdefault(r["shift"], set()).add(r["label"])
    assert labels["id"] == {"benign", "malignant"} and labels["covariate"] == {"norm", "tum"}
    assert labels["semantic"] == {"adi", "deb", "muc", "mus", "str"} and labels["fit"] == {"benign", "malignant"}
    out = tmp_path / "out"
    assert read_prepared(out).prompt_sets is None and not (out / "prompt_sets.json").exists()
    for r in rows:
        if r["source"] == "pcam":
            index = int(Path(r["file"]).stem.rsplit("_", 1)[1])
            assert np.array_equal(np.asarray(Image.open(out / r["file"])), x[index])
            assert r["label"] == ("malignant" if y[index] else "benign")
    assert (tmp_path / "pcam_x.h5").exists(), "PCam is decompressed once, beside the download"


@pytest.mark.parametrize("case,message", [("swapped", r"pcam_y\.h5\.gz has no dataset 'x' \(it has \['y'\]\)"),
                                          ("cut", r"pcam_x\.h5\.gz is not a complete gzip file"),
                                          ("not hdf5", r"pcam_x\.h5\.gz is not an HDF5 file")])
def test_bad_pcam_files_are_named(tmp_path, case, message):
    "x and y swapped, a gzip cut short or a file that is not HDF5: one line naming the file, and no half-decompressed file left."
    (x_path, y_path), _, _ = pcam_files(tmp_path)
    if case == "swapped":
        x_path, y_path = y_path, x_path
    if case == "cut":
        x_path.write_bytes(x_path.read_bytes()[:-5000])
    if case == "not hdf5":
        x_path.write_bytes(gzip.compress(b"<html>403 Forbidden</html>"))
    with pytest.raises(archives.LayoutError, match=message):
        pathology.PcamView(x_path, y_path)
    assert not list(tmp_path.glob("*.tmp")) and not (tmp_path / "pcam_x.h5").exists()


# ------------------------------------------------------------------------------------------ runs sharing --raw: decompressing and extracting

import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402


def test_two_runs_decompressing_one_file_each_get_it_whole(tmp_path, monkeypatch):
    "Two runs decompressing PCam at once (one --raw): the second starts while the first writes; the .h5 that appears is whole."
    data = bytes(range(256)) * 3000
    gz = tmp_path / "x.h5.gz"
    gz.write_bytes(gzip.compress(data))
    real_open, reached, done, got = gzip.open, {"a": threading.Event(), "b": threading.Event()}, threading.Event(), {}

    class Paced:  # gzip.open's file, read 10,000 bytes at a time: 'a' waits at its 3rd read for 'b' to reach its 2nd
        def __init__(self, *args): self.f, self.reads = real_open(*args), 0
        def __enter__(self): return self
        def __exit__(self, *exc): self.f.close()
        def read(self, n=-1):
            self.reads += 1
            me = threading.current_thread().name
            if (me, self.reads) in (("a", 3), ("b", 2)):
                reached[me].set()
                assert (reached["b"] if me == "a" else done).wait(10), f"{me} waited in vain"
            return self.f.read(10_000)

    def decompress(me):
        try: got[me] = archives.gunzip_once(gz).read_bytes()
        except BaseException as err: got[me] = err
        finally:
            if me == "a": done.set()
            reached[me].set()

    monkeypatch.setattr(gzip, "open", Paced)
    a = threading.Thread(target=decompress, args=("a",), name="a")
    a.start()
    assert reached["a"].wait(10)
    b = threading.Thread(target=decompress, args=("b",), name="b")
    b.start()
    a.join(); b.join()
    assert got["a"] == data, f"the first run's .h5 is not the file: {got['a'] if isinstance(got['a'], Exception) else 'wrong bytes'}"
    assert got["b"] == data and (tmp_path / "x.h5").read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.h5", "x.h5.gz", "x.h5.source"], "no temporary file is left"



def test_a_replaced_gz_is_decompressed_again(tmp_path):
    "A .gz replaced by another version (a new download or --local copy) is decompressed afresh, not the old copy reused."
    gz = tmp_path / "x.h5.gz"
    gz.write_bytes(gzip.compress(b"version A" * 1000))
    assert archives.gunzip_once(gz).read_bytes() == b"version A" * 1000
    gz.write_bytes(gzip.compress(b"version B, longer" * 1000))
    assert archives.gunzip_once(gz).read_bytes() == b"version B, longer" * 1000

SLOW_RAR_TOOL = """
import os, sys, tarfile, time
from pathlib import Path
src, dst, control = sys.argv[1], sys.argv[2], Path(sys.argv[3])
try: os.mkdir(control / "a"); me = "a"  # the first run of the tool pauses half way, a later one after one member
except FileExistsError: me = "b"
with open(control / "runs", "a") as f: f.write(me)
with tarfile.open(src) as tar:
    members = tar.getmembers()
    for i, m in enumerate(members):
        if i == (len(members) // 2 if me == "a" else 1):
            (control / f"{me}_paused").touch()
            deadline = time.time() + 20
            while not (control / f"{me}_go").exists():
                if time.time() > deadline: sys.exit(f"{me} was never let go")
                time.sleep(0.01)
        tar.extract(m, dst, filter="data")
"""


@pytest.fixture
def slow_rar(tmp_path, monkeypatch):
    "FIVES.rar (a tar) and the only RAR tool a stand-in that pauses in `control` (see SLOW_RAR_TOOL) until told to go on."
    files = {f"F/train/Original/{i}_N.png": bytes([i]) for i in range(20)}
    (tmp_path / "raw").mkdir()
    rar = make_tgz(tmp_path / "raw" / "FIVES.rar", files)
    control, tool = tmp_path / "control", tmp_path / "tool.py"
    control.mkdir()
    tool.write_text(SLOW_RAR_TOOL)
    monkeypatch.setattr(archives, "RAR_TOOLS", ((sys.executable, lambda src, dst: [sys.executable, str(tool), src, dst, control]),))
    return SimpleNamespace(rar=rar, files=sorted(files), control=control)


def wait_for(condition, what):
    "Poll `condition` for up to 20 seconds."
    deadline = time.time() + 20
    while not condition():
        assert time.time() < deadline, f"never {what}"
        time.sleep(0.01)


def extracted(rar):
    "The files of what extract_rar returns for `rar`, or the error it raised."
    try: return [m for m in archives.DirContainer(archives.extract_rar(rar)).members() if m != ".complete"]
    except BaseException as err: return err


def test_two_runs_extracting_one_rar_do_not_spoil_each_other(slow_rar):
    "A second run sharing --raw that comes while FIVES.rar is extracted stops at once, naming it; the first gets every file."
    s, got = slow_rar, {}
    runs = {me: threading.Thread(target=lambda me=me: got.update({me: extracted(s.rar)})) for me in "ab"}
    runs["a"].start()
    wait_for((s.control / "a_paused").exists, "paused half way")
    runs["b"].start()
    wait_for(lambda: not runs["b"].is_alive() or (s.control / "b_paused").exists(), "refused or extracting")
    (s.control / "a_go").touch()
    runs["a"].join()
    (s.control / "b_go").touch()
    runs["b"].join()
    assert got["a"] == s.files, f"the first run's folder lacks {sorted(set(s.files) - set(got['a']))}"
    assert isinstance(got["b"], BlockingIOError) and f"another run is extracting {s.rar}" in str(got["b"])
    assert extracted(s.rar) == s.files and (s.control / "runs").read_text() == "a", "extracted once, then reused"
    assert sorted(p.name for p in s.rar.parent.iterdir()) == ["FIVES.rar", "FIVES.rar.d"], "no lock or temporary folder left"


def test_what_a_killed_extraction_left_is_cleared(slow_rar):
    "A run killed while extracting (or an earlier version's unfinished FIVES.rar.d) leaves nothing the next run uses or keeps."
    s = slow_rar
    make_dir(s.rar.parent / "FIVES.rar.d", {"F/train/Original/99_N.png": b"from an unfinished extraction"})
    code = (f"import sys; sys.path[:0] = [{str(DATA_SCRIPTS)!r}]; import archives; "
            f"archives.RAR_TOOLS = (({sys.executable!r}, lambda src, dst: [{sys.executable!r}, {str(s.control.parent / 'tool.py')!r}, src, dst, {str(s.control)!r}]),); "
            f"archives.extract_rar(archives.Path({str(s.rar)!r}))")
    killed = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try: wait_for((s.control / "a_paused").exists, "paused half way")
    finally: os.killpg(killed.pid, signal.SIGKILL); killed.wait()
    (s.control / "b_go").touch()
    assert extracted(s.rar) == s.files
    assert sorted(p.name for p in s.rar.parent.iterdir()) == ["FIVES.rar", "FIVES.rar.d"]



def test_a_replaced_rar_is_extracted_again(slow_rar):
    "FIVES.rar replaced by another version (a new download) is extracted afresh: the old FIVES.rar.d is not read."
    s = slow_rar
    (s.control / "a_go").touch(), (s.control / "b_go").touch()
    assert extracted(s.rar) == s.files
    make_tgz(s.rar, {"F/train/Original/0_N.png": b"version B", "F/train/Original/99_N.png": b"new in B"})
    assert extracted(s.rar) == ["F/train/Original/0_N.png", "F/train/Original/99_N.png"]
    assert (s.rar.parent / "FIVES.rar.d" / "F/train/Original/0_N.png").read_bytes() == b"version B"

@pytest.mark.parametrize("raw,message", [("out", "--raw {out} is also --out"),
                                         ("out/raw", "--raw {out}/raw is inside --out {out}"),
                                         (".out.partial/raw", "--raw {tmp}/.out.partial/raw is inside {tmp}/.out.partial, where --out {out} is built")])
def test_a_raw_inside_out_is_refused_before_any_download(tmp_path, monkeypatch, capsys, raw, message):
    "Downloads kept in --out (or where a run builds it) would make --out a folder no run may replace, or be deleted with it."
    monkeypatch.setattr(fetching, "download", lambda *a, **k: pytest.fail("downloaded before --raw was checked"))
    for dry in ([], ["--dry-run"]):
        assert pathology.main(pathology.BENCHMARK, ["--out", str(tmp_path / "out"), "--raw", str(tmp_path / raw), *dry]) == 1
        err = capsys.readouterr().err
        assert err == f"error: {message.format(out=tmp_path / 'out', tmp=tmp_path)}; keep downloads in a folder outside it\n"
    assert list(tmp_path.iterdir()) == [], "nothing was written"


@pytest.mark.parametrize("split,message", [("out/s.csv", "--split {out}/s.csv is inside --out {out}"),
                                           (".out.old/s.csv", "--split {tmp}/.out.old/s.csv is inside {tmp}/.out.old, where --out {out} is built")])
def test_a_split_inside_out_is_refused_before_any_download(tmp_path, monkeypatch, capsys, split, message):
    "The rows a first run samples would be written into --out, then deleted with the folder the new one replaces."
    monkeypatch.setattr(fetching, "download", lambda *a, **k: pytest.fail("downloaded before --split was checked"))
    for dry in ([], ["--dry-run"]):
        assert pathology.main(pathology.BENCHMARK, ["--out", str(tmp_path / "out"), "--raw", str(tmp_path / "raw"),
                                                    "--split", str(tmp_path / split), *dry]) == 1
        err = capsys.readouterr().err
        assert err == f"error: {message.format(out=tmp_path / 'out', tmp=tmp_path)}; keep the split file in a folder outside it\n"
    assert list(tmp_path.iterdir()) == [], "nothing was written"


def test_an_out_inside_raw_is_accepted(tmp_path, capsys):
    "The prepared folder may live in the download folder: a run replaces only --out and what it builds beside it."
    assert pathology.main(pathology.BENCHMARK, ["--out", str(tmp_path / "raw/out"), "--raw", str(tmp_path / "raw"), "--dry-run"]) == 0


# ------------------------------------------------------------------------------------------ views and folders

def test_views_ignore_junk_and_refuse_duplicate_keys(tmp_path):
    root = make_dir(tmp_path / "d", {"a/train/Original/1_N.png": b"1", "a/train/Original/Thumbs.db": b"",
                                     "__MACOSX/a/train/Original/2_N.png": b"", "a/train/Original/._3_N.png": b""})
    assert ophthalmology.fives_view({"fives": root}).keys == ["train/Original/1_N.png"]
    make_dir(root, {"copy/train/Original/1_N.png": b"1"})
    with pytest.raises(archives.LayoutError, match="two files have the key 'train/Original/1_N.png'"):
        ophthalmology.fives_view({"fives": root})


def test_a_hidden_file_in_a_source_is_not_drawn(tmp_path):
    "A name starting with '.' is a hidden file, which read_prepared skips: drawn and written, it made the folder unreadable."
    root = make_dir(tmp_path / "src", {"x/.1.png": image_bytes("PNG", 1), "x/2.png": image_bytes("PNG", 2), "x/3.png": image_bytes("PNG", 3)})
    view = archives.View(archives.open_container(root), r"x/[^/]+\.png")
    assert view.keys == ["x/2.png", "x/3.png"]
    bench = common.Benchmark("t", ("a",), ("a",), "{}", {"v": ((), None)},
                             (splits.Draw("v", "id", ("a",), 2, lambda v: {k: "a" for k in v.keys}),))
    common.prepare(bench, {"v": view}, tmp_path / "out", tmp_path / "s.csv", progressbar=False)
    assert list(read_prepared(tmp_path / "out").files) == ["id/a/2.png", "id/a/3.png"]


def test_a_file_in_a_hidden_folder_is_not_drawn_and_a_dot_slash_prefix_is_no_hidden_folder(tmp_path):
    "read_prepared skips any hidden part of a path: a file in a hidden folder (.ipynb_checkpoints/) was drawn and written visibly, beside its original."
    files = {"./x/1.png": image_bytes("PNG", 1), "./x/.ipynb_checkpoints/2.png": image_bytes("PNG", 2), "./x/p/3.png": image_bytes("PNG", 3)}
    view = archives.View(archives.open_container(make_tgz(tmp_path / "s.tar.gz", files)), r"x/(?:.*/)?[^/]+\.png")
    assert view.keys == ["x/1.png", "x/p/3.png"]


def test_a_corrupt_image_in_a_source_is_named(tmp_path):
    view = archives.View(archives.open_container(make_dir(tmp_path / "d", {"x/1.png": b"version https://git-lfs"})), r"x/[^/]+\.png")
    bench = common.Benchmark("t", ("a",), ("a",), "{}", {"v": ((), None)},
                             (splits.Draw("v", "id", ("a",), 1, lambda v: {k: "a" for k in v.keys}),))
    with pytest.raises(archives.LayoutError, match="v:x/1.png is not a readable image.*git-lfs"):
        common.prepare(bench, {"v": view}, tmp_path / "out", tmp_path / "s.csv", progressbar=False)


def test_two_images_with_one_output_name_are_named_before_anything_is_written(tmp_path):
    "Nested keys (a CT class folder's patient subfolders) can share a base name: both sources are named, and --out is not created."
    root = make_dir(tmp_path / "src", {"x/1.png": image_bytes("PNG", 1), "x/p1/0.png": image_bytes("PNG", 2), "x/p2/0.png": image_bytes("PNG", 3)})
    view = archives.View(archives.open_container(root), r"x/(?:.*/)?[^/]+\.png")
    bench = common.Benchmark("t", ("a",), ("a",), "{}", {"v": ((), None)},
                             (splits.Draw("v", "id", ("a",), 3, lambda v: {k: "a" for k in v.keys}),))
    with pytest.raises(archives.LayoutError, match=r"v:x/p1/0\.png and v:x/p2/0\.png would both be written to id/a/0\.png"):
        common.prepare(bench, {"v": view}, tmp_path / "out", tmp_path / "s.csv", progressbar=False)
    assert not (tmp_path / "out").exists()


def files_in(root):
    "Every file under `root`, relative path -> bytes."
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_first_run_that_fails_half_way_leaves_nothing_in_the_way(tmp_path):
    "A first run that stops at a bad image leaves no --out, so the same command runs once the source is mended."
    view = letters_view(tmp_path)
    (tmp_path / "src/img/b_4.png").write_bytes(b"not an image")
    with pytest.raises(archives.LayoutError, match="v:img/b_4.png is not a readable image"):
        common.prepare(LETTERS, {"v": view}, tmp_path / "out", tmp_path / "s.csv", progressbar=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"], "nothing written, nothing left behind"
    (tmp_path / "src/img/b_4.png").write_bytes(image_bytes("PNG", 4))
    rows = common.prepare(LETTERS, {"v": view}, tmp_path / "out", tmp_path / "s.csv", progressbar=False)
    assert len(read_prepared(tmp_path / "out")) == len(rows) == 10


KILLED_RUN = """
import os, signal, sys
from pathlib import Path
sys.path[:0] = [{tests!r}, {scripts!r}]
import common
from test_data_scripts import LETTERS, letters_view
tmp, real, seen = Path({tmp!r}), common.check_image, []
def check_then_die(data, what):  # SIGKILL once a few images are written: no handler, no cleanup
    seen.append(what)
    if len(seen) == 5: os.kill(os.getpid(), signal.SIGKILL)
    real(data, what)
common.check_image = check_then_die
common.prepare(LETTERS, {{"v": letters_view(tmp)}}, tmp / "out", tmp / "s.csv", progressbar=False)
"""


def test_a_killed_first_run_does_not_block_the_next(tmp_path):
    "A run killed half-way (SIGKILL, a closed Colab tab) cannot clean up: the next run of the same command clears what it left and writes the folder."
    import subprocess
    code = KILLED_RUN.format(tests=str(Path(__file__).parent), scripts=str(DATA_SCRIPTS), tmp=str(tmp_path))
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == -9
    assert not (tmp_path / "out").exists() and (tmp_path / ".out.partial" / "id").is_dir(), "killed while writing, beside --out"
    rows = common.prepare(LETTERS, {"v": letters_view(tmp_path)}, tmp_path / "out", tmp_path / "s.csv", progressbar=False)
    assert len(read_prepared(tmp_path / "out")) == len(rows) == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "s.csv", "src"], "the killed run's leftovers are gone"


def test_a_rerun_that_fails_half_way_keeps_the_folder_it_would_replace(tmp_path):
    "The new folder is built beside the old one and replaces it only when complete: a failed rerun changes no file of the old one."
    view, out = letters_view(tmp_path), tmp_path / "out"
    common.prepare(LETTERS, {"v": view}, out, tmp_path / "s.csv", progressbar=False)
    before = files_in(out)
    (tmp_path / "src/img/b_4.png").write_bytes(b"not an image")
    with pytest.raises(archives.LayoutError, match="v:img/b_4.png is not a readable image"):
        common.prepare(LETTERS, {"v": view}, out, tmp_path / "s.csv", progressbar=False)
    assert files_in(out) == before and len(read_prepared(out)) == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "s.csv", "src"]


@pytest.mark.parametrize("made_by,message", [("hand", "was not made by the letters data script"),
                                             ("another benchmark", "holds the other benchmark"),
                                             ("this script, then notes added", r"holds \['notes.txt'\], which the data scripts did not write")])
def test_a_folder_the_script_did_not_write_is_refused_not_wiped(tmp_path, made_by, message):
    "A hand-made prepared folder (the extract chapter's format), another benchmark's folder, or a file of one's own in --out are left alone."
    out = tmp_path / "out"
    if made_by == "hand":
        make_dir(out, {"id/a/x.png": image_bytes("PNG"), "far/cats/y.png": image_bytes("PNG"), "classes.json": b'{"classes": ["a"]}'})
    else:
        common.prepare(LETTERS if made_by.startswith("this") else dataclasses.replace(LETTERS, name="other"),
                       {"v": letters_view(tmp_path)}, out, tmp_path / "other.csv", progressbar=False)
    if made_by.startswith("this"):
        (out / "notes.txt").write_text("mine")
    before = files_in(out)
    with pytest.raises(ValueError, match=message):
        common.prepare(LETTERS, {"v": letters_view(tmp_path)}, out, tmp_path / "s.csv", progressbar=False)
    assert files_in(out) == before


def test_a_folder_written_before_the_marker_is_prepared_again(tmp_path):
    "Earlier versions wrote no MARKER_FILE but classes.json's 'benchmark': such a folder is the script's own, with nothing added."
    view, out = letters_view(tmp_path), tmp_path / "out"
    common.prepare(LETTERS, {"v": view}, out, tmp_path / "s.csv", progressbar=False)
    (out / MARKER_FILE).unlink()
    with pytest.raises(ValueError, match="holds the letters benchmark, not other"):
        check_claimable(out, "other")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds \['notes.txt'\], which the data scripts did not write"):
        check_claimable(out, "letters")
    (out / "notes.txt").unlink()
    common.prepare(LETTERS, {"v": view}, out, tmp_path / "s.csv", progressbar=False)
    assert len(read_prepared(out)) == 10 and (out / MARKER_FILE).read_text() == "letters\n"


def test_a_failed_swap_leaves_the_old_folder_and_nothing_beside_it(tmp_path, monkeypatch):
    "Putting the new folder in place can fail too (EBUSY, EXDEV): the old folder stays as it was and the new one is removed."
    view, out = letters_view(tmp_path), tmp_path / "out"
    common.prepare(LETTERS, {"v": view}, out, tmp_path / "s.csv", progressbar=False)
    before, rename, tries = files_in(out), Path.rename, []
    def busy(self, target):  # the new folder cannot take --out's place, once
        if Path(target) == out and not tries: tries.append(self); raise OSError(16, "Device or resource busy", str(out))
        return rename(self, target)
    monkeypatch.setattr(Path, "rename", busy)
    with pytest.raises(OSError, match="busy"):
        common.prepare(LETTERS, {"v": view}, out, tmp_path / "s.csv", progressbar=False)
    assert files_in(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out", "s.csv", "src"]


def test_a_failure_writing_the_marker_leaves_nothing_beside_out(tmp_path, monkeypatch):
    monkeypatch.setattr(Path, "write_text", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"), claim_folder(tmp_path / "out", "t"):
        pytest.fail("claimed without its marker")
    assert list(tmp_path.iterdir()) == []


def test_a_second_run_on_the_same_out_is_refused_while_the_first_writes(tmp_path):
    "Two runs on one --out (prepare_all and a manual rerun): the second must not clear the first's new folder."
    out = tmp_path / "out"
    with claim_folder(out, "t") as first:
        (first / "id/x").mkdir(parents=True)
        with pytest.raises(BlockingIOError, match=f"another run is writing {re.escape(str(out))}"), claim_folder(out, "t"):
            pytest.fail("a second run claimed the folder")
        assert (first / "id/x").is_dir() and (first / MARKER_FILE).is_file()
    assert (out / "id/x").is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["out"], "the lock is gone with the run"


@pytest.fixture
def mounted(tmp_path):
    "An empty folder that is a mount point (a Docker volume, an external disk): a tmpfs, where root may mount one."
    import os, subprocess
    out = tmp_path / "out"
    out.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(out)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield out
    subprocess.run(["umount", str(out)], check=True)


def test_an_out_that_is_a_mount_point_is_written_in_place(mounted, tmp_path):
    "A mount point cannot be renamed: the new folder is built inside it, and a failed rerun still leaves the old one as it was."
    view = letters_view(tmp_path)
    common.prepare(LETTERS, {"v": view}, mounted, tmp_path / "s.csv", progressbar=False)
    assert len(read_prepared(mounted)) == 10 and sorted(p.name for p in tmp_path.iterdir()) == ["out", "s.csv", "src"]
    before = files_in(mounted)
    (tmp_path / "src/img/b_4.png").write_bytes(b"not an image")
    with pytest.raises(archives.LayoutError, match="not a readable image"):
        common.prepare(LETTERS, {"v": view}, mounted, tmp_path / "s.csv", progressbar=False)
    assert files_in(mounted) == before
    (tmp_path / "src/img/b_4.png").write_bytes(image_bytes("PNG", 4))
    common.prepare(LETTERS, {"v": view}, mounted, tmp_path / "s.csv", progressbar=False)
    assert files_in(mounted) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out", "s.csv", "src"]


@pytest.mark.parametrize("fmt", ["JPEG", "TIFF", "PNG"])
def test_a_truncated_image_is_caught(fmt):
    "Image.verify() does not decode JPEG or TIFF data: half a file passed and was copied into the prepared folder."
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buffer, format=fmt)
    data = buffer.getvalue()
    archives.check_image(data, "v:whole")
    with pytest.raises(archives.LayoutError, match="v:half is not a readable image"):
        archives.check_image(data[:len(data) // 2], "v:half")


def test_an_image_that_cannot_be_resized_is_named(tmp_path):
    "PIL reads Sun raster files but cannot write them: --resize fails naming the image, not with a bare KeyError."
    sun = struct.pack(">8I", 0x59A66A95, 8, 8, 8, 64, 1, 0, 0) + bytes(range(64))  # an 8x8 grey Sun raster
    view = archives.View(archives.open_container(make_dir(tmp_path / "d", {"x/1.ras": sun})), r"x/[^/]+\.ras")
    bench = common.Benchmark("t", ("a",), ("a",), "{}", {"v": ((), None)},
                             (splits.Draw("v", "id", ("a",), 1, lambda v: {k: "a" for k in v.keys}),))
    with pytest.raises(archives.LayoutError, match=r"v:x/1\.ras could not be resized \(KeyError: 'SUN'\)"):
        common.prepare(bench, {"v": view}, tmp_path / "out", tmp_path / "s.csv", progressbar=False, resize=4)



@pytest.mark.parametrize("check", [lambda data: archives.check_image(data, "v:big"), lambda data: common.resized(data, 4, "v:big")])
def test_an_image_over_pils_size_limit_is_named(monkeypatch, check):
    "An image over PIL's decompression-bomb limit is an unreadable image naming its file, not an unexpected DecompressionBombError."
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 7)  # the image has 16 pixels: over twice this, PIL refuses to open it
    with pytest.raises(archives.LayoutError, match=r"^v:big .*exceeds limit"):
        check(image_bytes("PNG"))

def damaged_zip(path, damage):
    """A zip holding ``x/0.tif`` and ``x/1.tif``, whose ``x/1.tif`` cannot be read back: its bytes flipped, or
    compressed with a method Python lacks (Deflate64, as Windows zips large files)."""
    files = {f"x/{i}.tif": bytes(np.random.default_rng(i).integers(0, 4, 3000, dtype=np.uint8)) for i in range(2)}  # compressible
    method = zipfile.ZIP_DEFLATED if damage == "flipped deflated" else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", method) as z:
        for name, data in files.items():
            z.writestr(name, data)
    data = bytearray(path.read_bytes())
    info = zipfile.ZipFile(path).getinfo("x/1.tif")
    if damage == "deflate64":
        data[info.header_offset + 8] = 9  # the compression method in its local header
        data[bytes(data).rfind(b"PK\x01\x02") + 10] = 9  # and in its central directory entry, the last one
    else:
        start = info.header_offset + 30 + len(info.filename) + 100
        data[start:start + 4] = bytes(b ^ 0xFF for b in data[start:start + 4])
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("damage", ["flipped stored", "flipped deflated", "deflate64"])
def test_a_damaged_zip_member_is_named(tmp_path, damage):
    "A member that cannot be read out of its zip is named with the archive, in one line; the other members are read."
    path = damaged_zip(tmp_path / "a.zip", damage)
    container = archives.open_container(path)
    assert len(container.read("x/0.tif")) == 3000
    with pytest.raises(archives.LayoutError, match=re.escape(f"{path}:x/1.tif: cannot be read")):
        container.read("x/1.tif")



@pytest.mark.parametrize("make", [make_zip, make_tgz])
def test_a_member_too_large_for_an_image_is_refused_before_it_is_read(tmp_path, monkeypatch, make):
    "A zip or tar member whose declared size is over MAX_MEMBER_BYTES (a zip bomb) is named in one line, not read into memory."
    monkeypatch.setattr(archives, "MAX_MEMBER_BYTES", 1000)
    path = make(tmp_path / ("a.zip" if make is make_zip else "a.tgz"), {"x/0.tif": bytes(1000), "x/1.tif": bytes(1001)})
    container = archives.open_container(path)
    assert len(container.read("x/0.tif")) == 1000
    archive, reader = (container.zip, "open") if make is make_zip else (container.tar, "extractfile")
    monkeypatch.setattr(archive, reader, lambda *args: pytest.fail("the member is read"))
    with pytest.raises(archives.LayoutError, match=re.escape(f"{path}:x/1.tif: 1001 bytes once decompressed, over")):
        container.read("x/1.tif")


@pytest.mark.parametrize("method,message", [(zipfile.ZIP_DEFLATED, "cannot be read"), (zipfile.ZIP_BZIP2, "cannot be read (compressed with bzip2"),
                                            (zipfile.ZIP_LZMA, "cannot be read (compressed with LZMA")])
def test_a_zip_member_that_says_it_is_small_is_not_inflated_whole(tmp_path, method, message):
    """A member declaring 1,000 bytes whose few compressed bytes hold 32 MiB: zipfile inflated up to 1 GiB a read before cutting to the
    declared size (deflate), and bzip2 or LZMA members with no output limit at all. Deflate is read in bounded chunks; bzip2 and LZMA are refused unread."""
    import tracemalloc
    path = tmp_path / "a.zip"
    with zipfile.ZipFile(path, "w", compression=method) as z: z.writestr("x/0.tif", bytes(32 << 20))
    data = bytearray(path.read_bytes())
    at = data.index(b"PK\x01\x02")  # the central directory's entry: its uncompressed size, at byte 24, is what zipfile trusts
    data[at + 24:at + 28] = struct.pack("<I", 1000)
    path.write_bytes(data)
    container = archives.open_container(path)
    tracemalloc.start()
    try:
        with pytest.raises(archives.LayoutError, match=re.escape(f"{path}:x/0.tif: {message}")): container.read("x/0.tif")
        peak = tracemalloc.get_traced_memory()[1]
    finally: tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes taken to read a member of 1,000 bytes"


def test_a_tar_holds_the_same_files_as_its_folder_hard_links_included(tmp_path):
    "A file that is a second name (hard link) of another is stored in a tar as a link member: it is read as the file it names."
    folder = make_dir(tmp_path / "d", {"train/1.png": image_bytes("PNG", 1), "train/2.png": image_bytes("PNG", 2)})
    (folder / "val").mkdir()
    os.link(folder / "train/1.png", folder / "val/1.png")
    with tarfile.open(tmp_path / "d.tgz", "w:gz") as tar:
        tar.add(folder, arcname="d")
    with tarfile.open(tmp_path / "d.tgz") as tar:
        assert tar.getmember("d/val/1.png").islnk(), "tarfile stores a second name as a link"
    files = {m: data for m, data in archives.DirContainer(tmp_path).read_many(["d/train/1.png", "d/train/2.png", "d/val/1.png"])}
    container = archives.open_container(tmp_path / "d.tgz")
    assert container.members() == sorted(files)
    assert dict(container.read_many(files)) == files

def test_a_foreign_output_folder_is_not_touched(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "thesis.tex").write_text("precious")
    with pytest.raises(ValueError, match="not empty and was not made by the t data script"), claim_folder(tmp_path / "out", "t"):
        pytest.fail("a foreign folder was claimed")
    assert (tmp_path / "out" / "thesis.tex").read_text() == "precious"


def test_unknown_local_source_is_refused():
    with pytest.raises(ValueError, match="unknown source 'fivez'"):
        common.parse_local(["fivez=/x"], ophthalmology.BENCHMARK.keys())


# ------------------------------------------------------------------------------------------ how each source is verified

def test_the_dry_run_says_how_each_source_is_verified(tmp_path, capsys):
    common.main(ophthalmology.BENCHMARK, ["--out", str(tmp_path / "o"), "--raw", str(tmp_path), "--dry-run"])
    printed = capsys.readouterr().out
    assert "verified  size only: no checksum is published" in printed  # FIVES
    assert "verified  md5 " in printed  # DeepDRiD, Imagenette
    common.main(radiology.BENCHMARK, ["--out", str(tmp_path / "r"), "--raw", str(tmp_path), "--dry-run"])
    assert "verified  not at all: neither a checksum nor a size is published" in capsys.readouterr().out  # the Kaggle sources


def test_a_tampered_file_of_the_right_size_is_caught_where_a_hash_exists(tmp_path):
    entry = http_entry("http://127.0.0.1:9/never", b"right bytes")
    (tmp_path / "fixture.zip").write_bytes(b"wrong bytes")  # same length
    with pytest.raises(fetching.ChecksumError, match="md5 is"): fetching.verify(tmp_path / "fixture.zip", entry)
    sized = dict(entry, md5=None, sha256=None)
    fetching.verify(tmp_path / "fixture.zip", sized)  # size only: nothing can tell
    assert fetching.fetch("fixture", sized, tmp_path / "raw", local=tmp_path / "fixture.zip")[1] == "size only: no checksum is published"
    assert fetching.provenance("size only: no checksum is published", tmp_path / "fixture.zip") == dict(
        verified="size only: no checksum is published", sha256=fetching.file_hash(tmp_path / "fixture.zip", "sha256"))


def test_the_prepared_folder_records_how_its_sources_were_verified(served_ophthalmology, ophthalmology_sources):
    s = served_ophthalmology
    common.run(ophthalmology.BENCHMARK, ["--out", str(s.tmp / "out")] + s.base)
    sources = json.loads((s.tmp / "out" / "classes.json").read_text())["sources"]
    assert set(sources) == set(ophthalmology.BENCHMARK.keys())
    assert sources["fives"]["verified"] == f"not checked: local folder {ophthalmology_sources.fives}"
    assert sources["deepdrid"]["verified"].startswith("md5")
    assert all(v["sha256"] is None or len(v["sha256"]) == 64 for v in sources.values())


def test_a_local_copy_is_recorded_as_checked_only_when_it_was(tmp_path):
    "classes.json said a --local folder, or file under another name, was verified by the manifest's md5, which nothing had checked."
    (x_path, y_path), _, _ = pcam_files(tmp_path)
    manifest = json.loads(fetching.MANIFEST.read_text())
    entry = manifest["sources"]["pcam_test_x"]
    x_path = x_path.rename(tmp_path / entry["filename"])  # the manifest's name: checked against its md5, here the file's
    entry.update(md5=md5(x_path.read_bytes()), size_bytes=x_path.stat().st_size)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with zipfile.ZipFile(crc_zip(tmp_path / "crc.zip")) as z:
        z.extractall(tmp_path / "crc")
    far = sorted({r.original for r in shipped("pathology") if r.shift == "far"})
    argv = ["--out", str(tmp_path / "out"), "--raw", str(tmp_path / "raw"), "--limit", "2", "--no-progress",
            "--manifest", str(tmp_path / "manifest.json"), "--local", f"pcam_test_x={x_path}", "--local", f"pcam_test_y={y_path}",
            "--local", f"crc_val={tmp_path / 'crc'}", "--local", f"imagenette={imagenette_tgz(tmp_path / 'i.tgz', far)}",
            "--split", str(tmp_path / "s.csv")]
    common.run(pathology.BENCHMARK, argv)
    sources = json.loads((tmp_path / "out" / "classes.json").read_text())["sources"]
    assert sources["pcam_test_x"] == dict(verified=f"md5 {fetching.file_hash(x_path, 'md5')}",
                                          sha256=fetching.file_hash(x_path, "sha256"))
    y_name = manifest["sources"]["pcam_test_y"]["filename"]
    assert sources["pcam_test_y"] == dict(verified=f"not checked: local copy {y_path} is not named {y_name}",
                                          sha256=fetching.file_hash(y_path, "sha256"))
    assert sources["crc_val"] == dict(verified=f"not checked: local folder {tmp_path / 'crc'}", sha256=None)
    assert sources["imagenette"]["verified"].startswith("not checked: local copy ")
    plan = common.run(pathology.BENCHMARK, argv + ["--dry-run"])  # the dry run says the same
    assert f"verified  md5 {entry['md5']}" in plan and f"verified  not checked: local folder {tmp_path / 'crc'}" in plan


def test_a_kaggle_file_is_checked_against_what_the_manifest_knows(tmp_path):
    "A Kaggle archive already in --raw was taken unchecked, so a checksum put in the manifest was recorded as verified."
    entry = dict(fetching.load_manifest()["sources"]["chest_ct"], md5=md5(b"right"))
    (tmp_path / entry["filename"]).write_bytes(b"wrong")
    with pytest.raises(fetching.ChecksumError, match="md5 is"):
        fetching.fetch("chest_ct", entry, tmp_path)
    (tmp_path / entry["filename"]).write_bytes(b"right")
    assert fetching.fetch("chest_ct", entry, tmp_path) == (tmp_path / entry["filename"], f"md5 {md5(b'right')}")


def test_resize_stores_images_at_the_short_side_losslessly_for_png(served_ophthalmology):
    from proton.models.flair import flair_preprocess
    s = served_ophthalmology
    plain = common.run(ophthalmology.BENCHMARK, ["--out", str(s.tmp / "plain"), "--limit", "3"] + s.base)
    small = common.run(ophthalmology.BENCHMARK, ["--out", str(s.tmp / "small"), "--limit", "3", "--resize", "2"] + s.base)
    assert small == plain  # the same files, in the same places
    for r in small:
        before, after = Image.open(s.tmp / "plain" / r["file"]), Image.open(s.tmp / "small" / r["file"])
        assert before.size == (4, 4) and after.size == (2, 2) and after.format == before.format
        if after.format == "PNG":  # lossless: FLAIR's resize of the original, rounded to 8 bits
            assert (flair_preprocess(after, 2) - flair_preprocess(before, 2)).abs().max() * 255 <= 0.5 + 1e-3
    classes = json.loads((s.tmp / "small" / "classes.json").read_text())
    assert classes["resize"] == 2 and "FLAIR" in classes["resized_as"]["resampling"]
    assert json.loads((s.tmp / "plain" / "classes.json").read_text())["resize"] is None
    common.run(ophthalmology.BENCHMARK, ["--out", str(s.tmp / "large"), "--limit", "3", "--resize", "4"] + s.base)
    assert all((s.tmp / "large" / r["file"]).read_bytes() == (s.tmp / "plain" / r["file"]).read_bytes() for r in plain)  # not enlarged
    with pytest.raises(ValueError, match="--resize must be at least 1"):
        common.run(ophthalmology.BENCHMARK, ["--out", str(s.tmp / "none"), "--resize", "0"] + s.base)


@pytest.mark.parametrize("mode,size", [("RGB", (300, 120)), ("L", (120, 300)), ("P", (200, 200)), ("I;16", (90, 400))])
def test_resized_keeps_format_and_mode_and_the_short_side(mode, size):
    array = (np.arange(size[0] * size[1]) % 251).reshape(size[1], size[0])
    image = (Image.fromarray(array.astype(np.uint16) * 200) if mode == "I;16" else
             Image.fromarray(array.astype(np.uint8)).convert(mode if mode != "P" else "RGB"))
    if mode == "P":
        image = image.convert("P", palette=Image.Palette.ADAPTIVE)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    out = Image.open(io.BytesIO(common.resized(buffer.getvalue(), 60, "x")))
    assert out.format == "PNG" and min(out.size) == 60 and out.size[0] / out.size[1] == pytest.approx(size[0] / size[1], rel=0.02)
    assert out.mode == {"P": "RGB", "I;16": "L"}.get(mode, mode)  # 16 bits: in 8, as the model reads them


@pytest.fixture(scope="module")
def clip_preprocess():
    "An open_clip model's preprocessing (random weights): torchvision's Resize(224), bicubic, then its centre crop."
    from proton.models import load_vlm
    return load_vlm("open_clip:ViT-S-32/none").preprocess


@pytest.mark.parametrize("size", [(500, 375), (375, 500), (640, 480), (320, 426), (1000, 667), (300, 300)])
def test_a_resized_image_gives_the_clip_model_the_input_of_the_original(clip_preprocess, size):
    "Resize(224) truncates the long side (500x375 -> 298x224); resized() rounded it (299x224), so the model resampled again: up to 132/255 off."
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    stored = Image.open(io.BytesIO(common.resized(buffer.getvalue(), 224, "x")))
    assert min(stored.size) == 224
    np.testing.assert_array_equal(clip_preprocess(stored).numpy(), clip_preprocess(image).numpy())


def fundus_png(size, seed):
    "A fundus-like photograph as PNG: a bright disc on black, with vessels 2-6 px wide and sensor noise."
    from PIL import ImageDraw
    rng = np.random.default_rng(seed)
    image = Image.new("RGB", size)
    draw = ImageDraw.Draw(image)
    draw.ellipse((size[0] // 40, size[1] // 40, size[0] * 39 // 40, size[1] * 39 // 40), fill=(190, 80, 40))
    for _ in range(150):
        draw.line(tuple(rng.integers(0, min(size), 4)), fill=(120, 30, 20), width=int(rng.integers(2, 7)))
    noisy = np.clip(np.asarray(image, np.int16) + rng.integers(-6, 7, (size[1], size[0], 3)), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noisy).save(buffer, format="PNG")
    return buffer.getvalue()


FUNDUS_SIZES = [(2048, 2048), (1600, 1200), (1200, 1600), (2000, 1333)]  # FIVES' square PNGs, and other cameras' shapes


def test_resize_stores_ophthalmology_images_as_flair_resizes_them(served_ophthalmology):
    "FLAIR scales the long side to 512 (bilinear, antialiased): PIL bicubic on the short side gave it other inputs (1600x1200: one row short)."
    from proton.models.flair import flair_preprocess
    s = served_ophthalmology
    fives = make_dir(s.tmp / "fives", {f"train/Original/{i}_{code}.png": fundus_png(FUNDUS_SIZES[i % 4], i)
                                       for i, code in enumerate("NNDDGGAA")})
    table = common.run(ophthalmology.BENCHMARK, ["--out", str(s.tmp / "out"), "--limit", "1", "--resize", "512"] + s.base
                       + ["--local", f"fives={fives}"])
    sizes, diffs = set(), []
    for r in table:
        if r["source"] == "fives":
            original = Image.open(fives / "train/Original" / r["file"].rsplit("/", 1)[1].removeprefix("train_"))
            stored = Image.open(s.tmp / "out" / r["file"])
            sizes.add(original.size)
            assert max(stored.size) == 512 and stored.format == "PNG"
            diffs.append((flair_preprocess(stored) - flair_preprocess(original)).abs().numpy() * 255)
    assert len(sizes) == 4
    assert max(d.max() for d in diffs) <= 0.5 + 1e-3 and max(d.mean() for d in diffs) <= 0.26  # 8-bit rounding, no more (README)
    classes = json.loads((s.tmp / "out" / "classes.json").read_text())
    assert classes["resize"] == 512


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_a_resized_image_with_transparency_shows_the_model_the_same_colours(mode):
    "The model reads an image converted to RGB, which ignores transparency: PIL's premultiplied resize made transparent white black."
    array = np.full((100, 120, 4), 255, dtype=np.uint8)
    array[..., 3] = 0  # a transparent white background
    array[30:70, 40:80] = (200, 30, 30, 255)  # around an opaque red square
    image = Image.fromarray(array)
    if mode == "LA":
        image = image.convert("LA")
    if mode == "P":  # a palette with a transparent colour: white
        image = image.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=2)
        image.info["transparency"] = image.getpixel((0, 0))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", **({"transparency": image.info["transparency"]} if mode == "P" else {}))
    original = Image.open(io.BytesIO(buffer.getvalue()))
    assert original.mode == mode and (mode != "P" or "transparency" in original.info)
    out = Image.open(io.BytesIO(common.resized(buffer.getvalue(), 50, "x")))
    expected = original.convert("RGB").resize(out.size, Image.Resampling.BICUBIC)
    assert out.size == (60, 50) and np.array_equal(np.asarray(out.convert("RGB")), np.asarray(expected))


@pytest.mark.parametrize("fmt", ["JPEG", "MPO"])
def test_a_resized_jpeg_is_encoded_at_quality_95(fmt):
    "PIL reads a phone or camera JPEG with a multi-picture marker as MPO: it is a JPEG all the same, re-encoded at 95, not PIL's 75."
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (120, 160, 3), dtype=np.uint8))
    encoded = {}
    for name, options in (("source", dict(format=fmt, quality=95, **({"save_all": True, "append_images": [image]} if fmt == "MPO" else {}))),
                          ("q95", dict(format="JPEG", quality=95))):
        encoded[name] = io.BytesIO()
        image.save(encoded[name], **options)
    assert Image.open(encoded["source"]).format == fmt
    out = Image.open(io.BytesIO(common.resized(encoded["source"].getvalue(), 60, "x")))
    assert out.format == "JPEG" and out.size == (80, 60)
    assert out.quantization == Image.open(encoded["q95"]).quantization


def test_a_resized_png_is_stored_uncompressed_for_fast_decoding():
    "Decoding limits FLAIR's extraction from PNG files: a resized one is stored without compression, as many bytes as pixels and more."
    rng = np.random.default_rng(0)
    smooth = np.clip(np.add.outer(np.arange(240), np.arange(320)) / 2 + rng.normal(0, 1, (240, 320)), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(np.stack([smooth] * 3, -1)).save(buffer, format="PNG")  # PIL's default level: compresses well
    small = common.resized(buffer.getvalue(), 120, "x")
    assert len(small) >= 120 * 160 * 3 > len(buffer.getvalue()) / 4


@pytest.mark.parametrize("fmt,dtype", [("PNG", np.uint16), ("TIFF", np.uint16), ("TIFF", np.int32)])
def test_a_resized_wide_grey_image_looks_to_the_model_as_the_original_does(fmt, dtype):
    "A 16- or 32-bit image reaches the model scaled by the bit depth of its own maximum: a resize that smoothed away a small bright spot made it 4x brighter."
    from proton.models.vlm import as_rgb_image
    array = np.full((400, 400), 500, dtype)
    array[200:202, 200:202] = 1100  # a 12-bit detector's image with one small bright spot: 10 bits without it
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=fmt)
    original = Image.open(io.BytesIO(buffer.getvalue()))
    assert original.mode.startswith("I")
    out = Image.open(io.BytesIO(common.resized(buffer.getvalue(), 100, "x")))
    expected = as_rgb_image(original).resize(out.size, Image.Resampling.BICUBIC)
    assert out.format == fmt and out.size == (100, 100)
    np.testing.assert_array_equal(np.asarray(as_rgb_image(out)), np.asarray(expected))


def test_prepare_all_passes_resize_on(tmp_path, capsys):
    assert prepare_all.cli(["--out", str(tmp_path / "out"), "--raw", str(tmp_path / "raw"), "--dry-run", "--resize", "224"]) == 0
    out = capsys.readouterr().out
    assert out.count("--resize 224: short side to N") == len(BENCHMARKS) - 1 and out.count("--resize 224: long side to N as FLAIR") == 1


@pytest.mark.parametrize("options,message", [(["--limit", "0"], "--limit must be at least 1, got 0"),
                                             (["--resize", "0"], "--resize must be at least 1, got 0"),
                                             (["--local", "nosuch=/tmp"], "--local 'nosuch=/tmp': unknown source 'nosuch'"),
                                             (["--local", "fives"], "--local 'fives': expected SOURCE=PATH"),
                                             (["--local", "fives=/no/such/fives.zip"], "--local fives=/no/such/fives.zip: no such file or folder")])
def test_prepare_all_refuses_bad_options_once_before_any_benchmark(tmp_path, capsys, options, message):
    "A 0 must not read as 'not given' (--limit 0 downloaded everything), and an unknown or malformed --local is named once, before any work."
    assert prepare_all.cli(["--out", str(tmp_path / "out"), "--raw", str(tmp_path / "raw"), "--dry-run", *options]) != 0
    out, err = capsys.readouterr()
    assert message in err and err.count("error") == 1 and "==>" not in out, (out, err)
    assert not (tmp_path / "out").exists()


def test_prepare_all_refuses_a_raw_inside_a_later_benchmarks_out_before_any_benchmark(tmp_path, monkeypatch, capsys):
    "--raw <out>/pathology passed ophthalmology's turn (a real run downloads ~3.5 GB) and failed only at pathology's."
    monkeypatch.setattr(fetching, "download", lambda *a, **k: pytest.fail("downloaded before --raw was checked"))
    for dry in (["--dry-run"], []):
        assert prepare_all.cli(["--out", str(tmp_path / "pa"), "--raw", str(tmp_path / "pa" / "pathology"),
                                "--only", "ophthalmology", "pathology", *dry]) == 1
        out, err = capsys.readouterr()
        assert err == f"error: --raw {tmp_path / 'pa' / 'pathology'} is also --out; keep downloads in a folder outside it\n"
        assert "==>" not in out
    assert list(tmp_path.iterdir()) == [], "nothing was written"


def test_prepare_all_goes_on_after_a_benchmark_fails_unexpectedly(tmp_path, monkeypatch, capsys):
    "A benchmark that fails in a way nobody foresaw gets one line and exit code 1; the others still run; Ctrl-C still stops all."
    real = common.run

    def run(bench, argv=None, description=""):
        if bench.name == "ophthalmology":
            raise KeyError("unforeseen")
        return real(bench, argv, description)

    monkeypatch.setattr(common, "run", run)
    assert prepare_all.cli(["--out", str(tmp_path / "out"), "--raw", str(tmp_path / "raw"), "--dry-run"]) == 1
    out, err = capsys.readouterr()
    assert [line for line in out.splitlines() if line.startswith("==>")] == [f"==> {b.name}" for b in BENCHMARKS]
    assert err.splitlines() == ["error: unexpected KeyError: 'unforeseen' (a bug: please report it with the command you ran)",
                                "not prepared: ophthalmology (see the messages above)"]
    monkeypatch.setattr(common, "run", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        prepare_all.cli(["--out", str(tmp_path / "out"), "--dry-run"])


@pytest.mark.parametrize("text,message", [("hi", "manifest {}: not JSON"), ("[1, 2]", "manifest {}: no 'sources' table"),
                                          ('{"sources": []}', "manifest {}: no 'sources' table")])
def test_a_manifest_that_is_not_one_is_named(tmp_path, text, message):
    (tmp_path / "m.json").write_text(text)
    with pytest.raises(ValueError, match=re.escape(message.format(tmp_path / "m.json"))):
        fetching.load_manifest(tmp_path / "m.json")


@pytest.mark.parametrize("change,message", [("drop", "manifest {}: no source 'deepdrid', which this script needs"),
                                            ("null", "manifest {}: source 'fives' is not a JSON object but None")])
def test_a_manifest_lacking_a_source_is_named(tmp_path, change, message):
    "An older or trimmed --manifest is named with what it lacks, in the dry run too, not a KeyError traceback."
    manifest = json.loads(fetching.MANIFEST.read_text())
    if change == "drop":
        del manifest["sources"]["deepdrid"]
    else:
        manifest["sources"]["fives"] = None
    (tmp_path / "m.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=re.escape(message.format(tmp_path / "m.json"))):
        common.run(ophthalmology.BENCHMARK, ["--out", str(tmp_path / "o"), "--manifest", str(tmp_path / "m.json"), "--dry-run"])


@pytest.mark.parametrize("case,message", [("file", r"--out .*out is a file, not a folder"),
                                          ("foreign", r"out is not empty and was not made by the pathology data script"),
                                          ("hand-made", r"out is not empty and was not made by the pathology data script"),
                                          ("split", r"split\.csv: columns \['hi'\]"),
                                          ("local", r"--local \w+=.*absent: no such file or folder"),
                                          ("busy", r"another run is writing .*out; wait for it to end")])
def test_what_would_stop_the_writing_is_refused_before_any_download(tmp_path, monkeypatch, case, message):
    "Hours of downloads must not end in a folder that cannot be claimed or a split file that cannot be read."
    monkeypatch.setattr(fetching, "download", lambda *a, **k: pytest.fail("downloaded before the run's files were checked"))
    if case == "file": (tmp_path / "out").write_text("not a folder")
    if case == "foreign": (tmp_path / "out").mkdir(); (tmp_path / "out" / "notes.txt").write_text("mine")
    if case == "hand-made": make_dir(tmp_path / "out", {"id/a/x.png": image_bytes("PNG"), "classes.json": b'{"classes": ["a"]}'})
    (tmp_path / "split.csv").write_text("hi\n")
    split = ["--split", str(tmp_path / "split.csv")] if case == "split" else []
    local = [f"--local={sorted(pathology.BENCHMARK.keys())[-1]}={tmp_path / 'absent'}"] if case == "local" else []
    with contextlib.ExitStack() as held:
        if case == "busy": held.enter_context(hold_lock(tmp_path / ".out.lock"))  # as a run writing out holds it
        with pytest.raises((ValueError, OSError), match=message):
            common.run(pathology.BENCHMARK, ["--out", str(tmp_path / "out"), "--raw", str(tmp_path / "raw"), *split, *local])
    if case != "busy":  # the dry run refuses it too ('--out afile' printed 'Also written: afile/split.csv' and exited 0)
        with pytest.raises((ValueError, OSError), match=message):
            common.run(pathology.BENCHMARK, ["--out", str(tmp_path / "out"), "--raw", str(tmp_path / "raw"), *split, *local, "--dry-run"])
    assert case != "foreign" or (tmp_path / "out" / "notes.txt").read_text() == "mine"
    assert case != "hand-made" or (tmp_path / "out" / "id/a/x.png").exists()


def test_a_second_run_on_the_same_out_is_refused_while_the_first_downloads(tmp_path, monkeypatch):
    "The first run took --out's lock only when it began writing, after its downloads: a second run with its own --raw passed every check and downloaded everything too."
    second = []
    def downloading(key, *args, **kwargs):  # the first run, in its first download, meets a second run
        if second or key == "second run": pytest.fail("the second run downloaded while the first was downloading")
        second.append("second run")
        with pytest.raises(BlockingIOError, match=f"another run is writing {re.escape(str(tmp_path / 'out'))}"):
            common.run(pathology.BENCHMARK, ["--out", str(tmp_path / "out"), "--raw", str(tmp_path / "raw2")])
        raise KeyboardInterrupt  # the first run stops here
    monkeypatch.setattr(common, "fetch", downloading)
    with pytest.raises(KeyboardInterrupt):
        common.run(pathology.BENCHMARK, ["--out", str(tmp_path / "out"), "--raw", str(tmp_path / "raw1")])
    assert second, "the first run never downloaded"
    assert not list(tmp_path.glob(".out*")), "the first run's lock outlived it"


# ------------------------------------------------------------------------------------------ the scripts' command line: a reader that leaves, Ctrl-C

import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402


def script_env(unbuffered):
    "The environment a script runs in: this one's, with stdout buffered as in a user's shell or unbuffered as in many containers."
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(DATA_SCRIPTS.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTHONUNBUFFERED", None)
    return dict(env, PYTHONUNBUFFERED="1") if unbuffered else env


@pytest.mark.parametrize("unbuffered", [False, True])
@pytest.mark.parametrize("script", ["prepare_all.py", "pathology.py"])
def test_a_reader_that_leaves_ends_a_script_silently(tmp_path, script, unbuffered):
    "`prepare_all.py --dry-run | head -1` printed a BrokenPipeError traceback (exit 1), `pathology.py --dry-run | true` 'Exception ignored' (exit 120)."
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        p = subprocess.run([sys.executable, str(DATA_SCRIPTS / script), "--out", "out", "--raw", "raw", "--dry-run"], cwd=tmp_path,
                           stdout=write, stderr=subprocess.PIPE, text=True, env=script_env(unbuffered), timeout=120)
    finally:
        os.close(write)
    assert (p.returncode, p.stderr) == (141, "")


@pytest.mark.parametrize("script", ["prepare_all.py", "pathology.py"])
def test_ctrl_c_stops_a_script_in_one_line(tmp_path, script):
    "Ctrl-C while a script reads a source printed a KeyboardInterrupt traceback of dozens of lines (exit -2)."
    x = tmp_path / "x.h5.gz"  # PCam's x, a pipe nobody writes to: the run waits there until interrupted
    os.mkfifo(x)
    for name in ("y.h5.gz", "crc.zip", "i.tgz"):
        (tmp_path / name).write_bytes(b"never read")
    only = ["--only", "pathology"] if script == "prepare_all.py" else []
    p = subprocess.Popen([sys.executable, str(DATA_SCRIPTS / script), *only, "--out", str(tmp_path / "out"), "--raw", str(tmp_path / "raw"),
                          "--no-progress", f"--local=pcam_test_x={x}", f"--local=pcam_test_y={tmp_path / 'y.h5.gz'}",
                          f"--local=crc_val={tmp_path / 'crc.zip'}", f"--local=imagenette={tmp_path / 'i.tgz'}"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=script_env(False))
    deadline = time.monotonic() + 120
    while True:  # opening the pipe for writing succeeds once the run opened it for reading
        try:
            writer = os.open(x, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
    try:
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        os.close(writer)
    assert (p.returncode, err) == (130, f"{script}: interrupted\n")
    out = tmp_path / "out" / "pathology" if only else tmp_path / "out"
    assert not out.exists() and not list(out.parent.glob(".*")), "the run left something in or beside the benchmark's folder"


@pytest.mark.parametrize("script", ["prepare_all.py", "ophthalmology.py", "pathology.py", "radiology.py"])
def test_ctrl_c_while_a_script_loads_is_one_line_too(tmp_path, script):
    "Ctrl-C in a script's first seconds, while torch and the library load, printed a KeyboardInterrupt traceback (exit -2)."
    slow = tmp_path / "slow" / "proton"  # a `proton` that takes its time to load, as torch does: the run is surely inside its imports
    slow.mkdir(parents=True)
    (slow / "__init__.py").write_text(f"open({str(tmp_path / 'loading')!r}, 'w').close()\nimport time\ntime.sleep(60)\n")
    env = script_env(False) | {"PYTHONPATH": str(slow.parent)}
    p = subprocess.Popen([sys.executable, str(DATA_SCRIPTS / script), "--out", str(tmp_path / "out"), "--dry-run"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while not (tmp_path / "loading").exists():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert (p.returncode, err) == (130, f"{script}: interrupted\n")


def test_a_relative_local_path_is_recorded_absolute(tmp_path, monkeypatch):
    "A --local path typed relative to the working folder was recorded as typed in classes.json, naming no folder once read from elsewhere."
    (tmp_path / "crc").mkdir()
    monkeypatch.chdir(tmp_path)
    local = common.parse_local(["crc_val=crc", "imagenette=./crc/../crc"], ["crc_val", "imagenette"])
    assert local == dict(crc_val=tmp_path / "crc", imagenette=tmp_path / "crc")
    assert fetching.unchecked(dict(download="http", filename="x.zip"), local["crc_val"]) == f"not checked: local folder {tmp_path / 'crc'}"
    (tmp_path / "store").write_bytes(b"x")
    (tmp_path / "x.zip").symlink_to(tmp_path / "store")
    assert common.parse_local(["crc_val=x.zip"], ["crc_val"])["crc_val"] == tmp_path / "x.zip"  # a link keeps its name, which the manifest's checksum goes by


def test_an_error_that_ctrl_c_caused_stops_prepare_all(tmp_path, monkeypatch, capsys):
    "A Ctrl-C that a library reports as another error (as an interrupted read can) was printed as that error, and prepare_all went on with the next benchmark."
    calls = []
    def run(bench, argv=None, description=""):
        calls.append(bench.name)
        try: signal.raise_signal(signal.SIGINT)  # Ctrl-C inside the work...
        except KeyboardInterrupt as e: raise OSError("read interrupted") from e  # ...which the library reports as its own error
    monkeypatch.setattr(common, "run", run)
    previous = signal.signal(signal.SIGINT, startup.interrupted)  # as a script's first line leaves it
    try: code = common.command(lambda: prepare_all.cli(["--out", str(tmp_path / "out"), "--dry-run"]))
    finally: signal.signal(signal.SIGINT, previous)
    assert (code, len(calls), common.CTRL_C) == (130, 1, [])  # and the next run starts afresh
    assert capsys.readouterr().err.splitlines()[-1].endswith(": interrupted")
