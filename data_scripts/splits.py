"""Split files for the data scripts: reproducible, seeded draws of images, recorded in the split files that ship with the repository."""
from __future__ import annotations

import csv
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from archives import LayoutError, View
from proton.bench.prepared import FOLDERS, open_csv
from proton.deploy import replace_atomically

SPLITS = Path(__file__).resolve().parent / "splits"
SPLIT_COLUMNS = ("source", "shift", "label", "original")  # a split file of the repository; the prepared folder's split.csv is another table


# ---------------------------------------------------------------------------------------------- sampling

def rank(keys: Iterable[str], # candidate keys
         seed: int, # the sampling seed
         scope: str, # names the draw, so that two draws from one source are independent
         ) -> list[str]:
    """Keys ordered by SHA-256 of (seed, scope, key): a permutation that is the same on every machine and Python version.

    A key's place never depends on which other keys exist, so the first n of a longer list are the first
    n of the ranking, and ``--limit`` picks a subset of the full draw.
    """
    return sorted(set(keys), key=lambda k: (hashlib.sha256(f"{seed}\x00{scope}\x00{k}".encode()).hexdigest(), k))


def choose(candidates: dict[str, str], # key -> label
           n: int, # how many to take
           seed: int, # sampling seed
           scope: str, # names the draw
           ) -> list[str]:
    """The first ``n`` candidates in ``rank`` order, sorted by key."""
    if len(candidates) < n:
        raise LayoutError(f"{scope}: need {n} images but the source has only {len(candidates)}")
    return sorted(rank(candidates, seed, scope)[:n])


# ---------------------------------------------------------------------------------------------- benchmarks

@dataclass(frozen=True)
class Draw:
    """``n`` images of one shift from one source view, sampled among the candidates ``pick`` returns."""
    view: str  # name of the source view (a key of Benchmark.views), also the `source` column of split files
    shift: str  # id | semantic | covariate | far, or fit (labelled ID images kept out of the test set)
    labels: tuple[str, ...]  # every label this draw can produce (folder names under <out>/<shift>/)
    n: int  # images to draw (the paper's count)
    pick: Callable[[View], dict[str, str]]  # view -> {key: label} of eligible images

    @property
    def scope(self) -> str:
        return f"{self.view}/{self.shift}/{'+'.join(self.labels)}"


@dataclass(frozen=True)
class Row:
    source: str  # view name
    shift: str
    label: str
    original: str  # the image's key in its source


def read_split(path: Path, # a split file
               draws: Iterable[Draw] = (), # the benchmark's draws: each row must belong to one; () checks no row against them
               ) -> list[Row]:
    """Rows of a split file (empty when it does not exist), each checked: four fields, a known shift, a draw it belongs to."""
    path, draws = Path(path), tuple(draws)
    if not path.exists():
        return []
    rows, lines = [], {}  # row -> the line it is on
    with open_csv(path) as f:  # UTF-8, a byte-order mark (Excel's 'CSV UTF-8') not part of the header; else an error naming the file
        reader = csv.reader(f)
        header = next(reader, None)
        if tuple(header or ()) != SPLIT_COLUMNS:
            raise ValueError(f"{path}: columns {header}, expected {list(SPLIT_COLUMNS)}")
        for fields in reader:
            if not fields:
                continue
            where = f"{path}, line {reader.line_num}"
            if len(fields) != len(SPLIT_COLUMNS):
                raise ValueError(f"{where}: {len(fields)} fields, expected {len(SPLIT_COLUMNS)} ({', '.join(SPLIT_COLUMNS)})")
            row = Row(*fields)
            if row.shift not in FOLDERS:
                raise ValueError(f"{where}: unknown shift {row.shift!r}; the shifts are {', '.join(FOLDERS)}")
            if draws and not any(fixed_rows(d, [row]) for d in draws):
                raise ValueError(f"{where}: no draw takes {row.source}/{row.shift}/{row.label}; "
                                 f"the draws are {', '.join(d.scope for d in draws)}")
            if row in lines:
                raise ValueError(f"{where}: {','.join(fields)} again (line {lines[row]}); remove one")
            lines[row] = reader.line_num
            rows.append(row)
    return rows


def write_split(path: Path, rows: Iterable[Row]) -> None:
    """Write a split file sorted by source, shift, label and key (so that diffs stay small); a failed write leaves the old file whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = sorted(set(rows), key=lambda r: (r.source, FOLDERS.index(r.shift), r.label, r.original))
    text = io.StringIO()
    # the reader ends a line at a lone '\r' too, which the writer quotes only when it is in lineterminator: quote every field then
    quoting = csv.QUOTE_ALL if any("\r" in f for r in rows for f in (r.source, r.label, r.original)) else csv.QUOTE_MINIMAL
    writer = csv.writer(text, lineterminator="\n", quoting=quoting)
    writer.writerow(SPLIT_COLUMNS)
    writer.writerows([r.source, r.shift, r.label, r.original] for r in rows)
    replace_atomically(path, lambda f: f.write(text.getvalue().encode("utf-8")))


def fixed_rows(draw: Draw, rows: list[Row]) -> list[Row]:
    """The split-file rows that belong to a draw."""
    return [r for r in rows if r.source == draw.view and r.shift == draw.shift and r.label in draw.labels]


def select(draw: Draw, # what to draw
           view: View, # its source
           rows: list[Row], # rows of the split file
           seed: int, # sampling seed for draws the split file does not fix
           limit: int | None = None, # at most this many images (smoke tests)
           taken: frozenset | set = frozenset(), # keys of this view that earlier draws chose: never drawn again
           ) -> tuple[list[Row], bool]:
    """The rows a draw yields, and whether they were sampled now (True) or taken from the split file (False)."""
    candidates = {k: v for k, v in draw.pick(view).items() if k not in taken}
    fixed = fixed_rows(draw, rows)
    if fixed:
        for r in fixed:
            if r.original in taken:
                raise LayoutError(f"the split file puts {r.source}:{r.original} in {r.shift}/{r.label}, but an earlier "
                                  "draw of the same source already has it: an image may be in one draw only (a fit "
                                  "image never in the test set); remove one of its rows")
            if r.original not in candidates:
                raise LayoutError(f"the split file lists {r.source}:{r.original} ({r.shift}/{r.label}) but the "
                                  "source has no such image: is it a different version? Check the manifest, or "
                                  "pass another --split to sample afresh")
            if candidates[r.original] != r.label:
                raise LayoutError(f"the split file labels {r.source}:{r.original} {r.label!r}, the source says "
                                  f"{candidates[r.original]!r}")
        if limit is not None:
            keep = set(rank([r.original for r in fixed], seed, draw.scope)[:limit])
            fixed = [r for r in fixed if r.original in keep]
        return fixed, False
    n = draw.n if limit is None else min(draw.n, limit)
    keys = choose(candidates, n, seed, draw.scope)
    return [Row(draw.view, draw.shift, candidates[k], k) for k in keys], True


