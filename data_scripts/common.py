"""Shared machinery for the data scripts: fetch (pooch, resumable, checksum-verified), read archives, sample reproducibly, write a prepared folder.

A prepared folder looks like::

    <out>/<shift>/<label>/<file>     shift in id, semantic, covariate, far
    <out>/split.csv                  columns: file, shift, label, source
    <out>/classes.json               ID class folders in label order, class names, prompts

Each benchmark script (``ophthalmology.py``, ``radiology.py``, ``pathology.py``) only describes its
sources and draws; everything else lives here.  Only the standard library is imported at module level:
``pooch``, ``requests``, ``tqdm`` and ``PIL`` (the ``data`` extra) are imported where they are used, so
``--help`` and ``--dry-run`` work anywhere.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "manifest.json"
SPLITS = HERE / "splits"
SHIFTS = ("id", "semantic", "covariate", "far")
SPLIT_COLUMNS = ("source", "shift", "label", "original")  # the split file that ships with the repo
OUT_COLUMNS = ("file", "shift", "label", "source")  # <out>/split.csv
JUNK = {"Thumbs.db", ".DS_Store", "desktop.ini"}


class ChecksumError(ValueError):
    """A file's checksum or size differs from the manifest."""


class LayoutError(ValueError):
    """A source does not look like the dataset it should be (missing files, unknown names, too few images)."""


class DownloadError(OSError):
    """A download stopped before the end; running the same command again resumes it."""


class LoginRequired(RuntimeError):
    """A source needs an account (Kaggle); the message says exactly what to do."""


# ---------------------------------------------------------------------------------------------- manifest

REQUIRED_FIELDS = ("title", "page", "download", "filename", "size_bytes", "approx_size", "sha256", "md5",
                   "licence", "login", "used_for", "why")


def load_manifest(path: Path | str | None = None, # a manifest.json; None: the one beside this file
                  ) -> dict:
    """Read and check the manifest of sources."""
    path = Path(path or MANIFEST)
    manifest = json.loads(path.read_text())
    for key, entry in manifest["sources"].items():
        missing = [f for f in REQUIRED_FIELDS if f not in entry]
        if missing:
            raise ValueError(f"manifest {path}: source {key!r} lacks fields {missing}")
        if entry["download"] not in ("http", "kaggle-competition", "kaggle-dataset"):
            raise ValueError(f"manifest {path}: source {key!r} has unknown download kind {entry['download']!r}")
        if entry["download"] == "http" and not entry.get("url"):
            raise ValueError(f"manifest {path}: source {key!r} is downloaded over http but has no url")
        if entry["download"] != "http" and not entry.get("kaggle"):
            raise ValueError(f"manifest {path}: source {key!r} needs a 'kaggle' slug")
        for alg, length in (("sha256", 64), ("md5", 32)):
            value = entry[alg]
            if value is not None and not re.fullmatch(rf"[0-9a-f]{{{length}}}", value):
                raise ValueError(f"manifest {path}: source {key!r} has a malformed {alg} {value!r}")
    return manifest


def known_hash(entry: dict) -> str | None:
    """The strongest checksum the manifest knows for a source, in pooch's ``alg:hex`` form (None when unknown)."""
    if entry["sha256"]:
        return f"sha256:{entry['sha256']}"
    if entry["md5"]:
        return f"md5:{entry['md5']}"
    return None


def file_hash(path: Path, alg: str) -> str:
    """Hex digest of a file, read in blocks."""
    digest = hashlib.new(alg)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(path: Path, # a local file
           entry: dict, # its manifest entry
           ) -> None:
    """Raise ``ChecksumError`` unless the file has the manifest's size and checksum (checks only what is known)."""
    size = path.stat().st_size
    if entry["size_bytes"] is not None and size != entry["size_bytes"]:
        raise ChecksumError(f"{path}: {size} bytes, but the manifest says {entry['size_bytes']}; "
                            "delete it and run again to download it afresh")
    expected = known_hash(entry)
    if expected is not None:
        alg, hexdigest = expected.split(":")
        actual = file_hash(path, alg)
        if actual != hexdigest:
            raise ChecksumError(f"{path}: {alg} is {actual}, but the manifest says {hexdigest}; "
                                "the file is corrupt or a different version: delete it and run again")


# ---------------------------------------------------------------------------------------------- download

class ResumableDownloader:
    """A pooch downloader that keeps the bytes received so far in ``<file>.part`` and resumes them with an HTTP Range request."""

    def __init__(self, part: Path, # where the bytes received so far are kept between runs
                 progressbar: bool = True, # show a tqdm bar
                 chunk_size: int = 1 << 20, # bytes per read
                 timeout: float = 60.0, # seconds without data before giving up
                 ):
        self.part, self.progressbar, self.chunk_size, self.timeout = Path(part), progressbar, chunk_size, timeout

    def __call__(self, url, output_file, pooch, check_only=False):
        import requests

        if check_only:
            return requests.head(url, timeout=self.timeout, allow_redirects=True).status_code == 200
        done = self.part.stat().st_size if self.part.exists() else 0
        headers = {"Range": f"bytes={done}-"} if done else {}
        try:
            with requests.get(url, headers=headers, stream=True, timeout=self.timeout) as response:
                total = self._receive(response, done)
        except requests.RequestException as err:
            have = self.part.stat().st_size if self.part.exists() else 0
            raise DownloadError(f"download of {url} stopped after {have} bytes ({err}); "
                                "run the same command again to resume") from err
        size = self.part.stat().st_size
        if total is not None and size != total:
            raise DownloadError(f"download of {url} ended after {size} of {total} bytes; "
                                "run the same command again to resume")
        os.replace(self.part, output_file)

    def _receive(self, response, done: int) -> int | None:
        """Append (206) or rewrite (200) the part file from a response; return the expected total size."""
        if response.status_code == 416:  # nothing after `done`: the part file already holds everything
            total = _content_range_total(response.headers.get("Content-Range", ""))
            if total is None or total != done:
                self.part.unlink()
                raise DownloadError(f"server refused to resume at byte {done}; the partial file was "
                                    "removed, run again to start over")
            return total
        response.raise_for_status()
        if response.status_code == 202:
            raise DownloadError(f"{response.url} answered 202 Accepted without the file (the host is "
                                "preparing it); wait a minute and run again")
        if response.status_code == 206:
            start = _content_range_start(response.headers.get("Content-Range", ""))
            if start != done:
                raise DownloadError(f"server resumed at byte {start}, expected {done}; delete {self.part}")
            total, mode = _content_range_total(response.headers["Content-Range"]), "ab"
        else:  # 200: the server ignored the Range header, so start over
            done, mode = 0, "wb"
            length = response.headers.get("Content-Length")
            total = int(length) if length is not None else None
        from tqdm.auto import tqdm

        with open(self.part, mode) as f, tqdm(total=total, initial=done, unit="B", unit_scale=True,
                                              unit_divisor=1024, desc=self.part.name[:-5],
                                              disable=not self.progressbar) as bar:
            for chunk in response.iter_content(chunk_size=self.chunk_size):
                f.write(chunk)
                bar.update(len(chunk))
        return total


def _content_range_start(value: str) -> int | None:
    match = re.match(r"bytes (\d+)-\d+/", value)
    return int(match.group(1)) if match else None


def _content_range_total(value: str) -> int | None:
    match = re.search(r"/(\d+)\s*$", value)
    return int(match.group(1)) if match else None


def download(entry: dict, # manifest entry of an http source
             raw: Path, # folder for downloads
             progressbar: bool = True, # show a tqdm bar
             chunk_size: int = 1 << 20, # bytes per read
             ) -> Path:
    """Download a source with pooch (resuming a partial file), check its checksum and size, and return its path."""
    import pooch

    raw = Path(raw)
    raw.mkdir(parents=True, exist_ok=True)
    part = raw / f"{entry['filename']}.part"
    downloader = ResumableDownloader(part, progressbar=progressbar, chunk_size=chunk_size)
    try:
        path = Path(pooch.retrieve(entry["url"], known_hash=known_hash(entry), fname=entry["filename"],
                                   path=raw, downloader=downloader, progressbar=progressbar))
    except ValueError as err:  # pooch's hash mismatch: it has already deleted the bad file
        raise ChecksumError(f"{entry['filename']} from {entry['url']} failed its checksum and was deleted: {err}") from err
    size = path.stat().st_size
    if entry["size_bytes"] is not None and size != entry["size_bytes"]:
        path.unlink()
        raise ChecksumError(f"{entry['filename']} has {size} bytes, the manifest says {entry['size_bytes']}; "
                            "it was deleted, run again to download it afresh")
    return path


# ---------------------------------------------------------------------------------------------- kaggle

def kaggle_command(entry: dict, raw: Path) -> list[str]:
    """The ``kaggle`` command line that downloads a source into ``raw``."""
    if entry["download"] == "kaggle-competition":
        return ["kaggle", "competitions", "download", "-c", entry["kaggle"], "-p", str(raw)]
    return ["kaggle", "datasets", "download", "-d", entry["kaggle"], "-p", str(raw)]


def kaggle_credentials_present() -> bool:
    """Whether the kaggle client will find credentials (checks only that they exist, never reads them)."""
    if os.environ.get("KAGGLE_API_TOKEN") or (os.environ.get("KAGGLE_USERNAME") and os.environ.get("KAGGLE_KEY")):
        return True
    folders = [Path(os.environ["KAGGLE_CONFIG_DIR"])] if os.environ.get("KAGGLE_CONFIG_DIR") else []
    folders += [Path.home() / ".kaggle", Path.home() / ".config" / "kaggle"]
    return any((d / name).is_file() for d in folders for name in ("kaggle.json", "access_token"))


def kaggle_instructions(key: str, entry: dict, raw: Path) -> str:
    """Step-by-step text telling a user how to get a Kaggle source."""
    steps = [
        f"Source {key!r} ({entry['title']}) is on Kaggle and needs a free Kaggle account:",
        "  1. Sign in at https://www.kaggle.com, open https://www.kaggle.com/settings, section 'API', and click",
        "     'Create New Token'. This downloads kaggle.json.",
        "  2. Put it where the client looks and make it private:",
        "       mkdir -p ~/.kaggle && mv ~/Downloads/kaggle.json ~/.kaggle/ && chmod 600 ~/.kaggle/kaggle.json",
        "     (on Colab: upload kaggle.json with the file browser, then run the same commands on /content/kaggle.json;",
        "      or set the environment variables KAGGLE_USERNAME and KAGGLE_KEY, or KAGGLE_API_TOKEN for a new-style token)",
    ]
    n = 3
    if entry["download"] == "kaggle-competition":
        steps += [f"  {n}. Accept the competition rules once, in a browser while signed in (without this the download",
                  f"     answers 403 Forbidden): {entry['page']}/rules  -> 'I Understand and Accept'"]
        n += 1
    steps += [f"  {n}. Install the client:  pip install kaggle",
              f"  {n + 1}. Download (about {entry['approx_size']}):",
              f"       {' '.join(kaggle_command(entry, raw))}",
              f"  {n + 2}. Run this script again; it finds {raw / entry['filename']}."]
    return "\n".join(steps)


def fetch_kaggle(key: str, entry: dict, raw: Path) -> Path:
    """Return a Kaggle source's archive, downloading it with the kaggle client when credentials exist."""
    path = Path(raw) / entry["filename"]
    if path.exists():
        return path
    if shutil.which("kaggle") is None or not kaggle_credentials_present():
        raise LoginRequired(kaggle_instructions(key, entry, raw))
    Path(raw).mkdir(parents=True, exist_ok=True)
    result = subprocess.run(kaggle_command(entry, raw))
    if result.returncode != 0 or not path.exists():
        raise LoginRequired(f"`{' '.join(kaggle_command(entry, raw))}` failed (exit code {result.returncode}).\n"
                            + kaggle_instructions(key, entry, raw))
    return path


def fetch(key: str, # manifest key
          entry: dict, # its manifest entry
          raw: Path, # folder for downloads
          local: Path | None = None, # a file or folder the user already has: used instead of downloading
          progressbar: bool = True, # show tqdm bars
          ) -> Path:
    """Return a local path for a source: the user's copy, the cached download, or a fresh download."""
    if local is not None:
        local = Path(local).expanduser()
        if not local.exists():
            raise FileNotFoundError(f"--local {key}={local}: no such file or folder")
        if local.is_file() and local.name == entry["filename"]:
            verify(local, entry)
        return local
    if entry["download"] == "http":
        return download(entry, raw, progressbar=progressbar)
    return fetch_kaggle(key, entry, raw)


# ---------------------------------------------------------------------------------------------- archives

class Container:
    """Read-only access to the files of a zip, a tar or a folder, by '/'-separated member name."""

    def members(self) -> list[str]:
        raise NotImplementedError

    def read(self, member: str) -> bytes:
        raise NotImplementedError

    def read_many(self, members: Iterable[str]) -> Iterator[tuple[str, bytes]]:
        """Yield (member, bytes) for the given members, in whatever order reads them fastest."""
        for member in members:
            yield member, self.read(member)


class DirContainer(Container):
    def __init__(self, root: Path):
        self.root = Path(root)

    def members(self) -> list[str]:
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())

    def read(self, member: str) -> bytes:
        return (self.root / member).read_bytes()


class ZipContainer(Container):
    def __init__(self, path: Path):
        try:
            self.zip = zipfile.ZipFile(path)
        except zipfile.BadZipFile as err:
            raise LayoutError(f"{path} is not a readable zip archive (truncated download?): {err}") from err

    def members(self) -> list[str]:
        return sorted(i.filename for i in self.zip.infolist() if not i.is_dir())

    def read(self, member: str) -> bytes:
        return self.zip.read(member)


class TarContainer(Container):
    def __init__(self, path: Path):
        try:
            self.tar = tarfile.open(path)
            self.infos = {i.name: i for i in self.tar.getmembers() if i.isfile()}
        except (tarfile.TarError, EOFError, OSError) as err:
            raise LayoutError(f"{path} is not a readable tar archive (truncated download?): {err}") from err

    def members(self) -> list[str]:
        return sorted(self.infos)

    def read(self, member: str) -> bytes:
        return self.tar.extractfile(self.infos[member]).read()

    def read_many(self, members):
        # a compressed tar only seeks forward cheaply, so read in archive order
        for member in sorted(members, key=lambda m: self.infos[m].offset_data):
            yield member, self.read(member)


RAR_TOOLS = (  # tried in this order; 7z builds without the non-free RAR codec fail and the next tool is tried
    ("bsdtar", lambda src, dst: ["bsdtar", "-xf", str(src), "-C", str(dst)]),
    ("unrar", lambda src, dst: ["unrar", "x", "-o+", "-idq", str(src), f"{dst}{os.sep}"]),
    ("7z", lambda src, dst: ["7z", "x", "-y", f"-o{dst}", str(src)]),
    ("7zz", lambda src, dst: ["7zz", "x", "-y", f"-o{dst}", str(src)]),
    ("unar", lambda src, dst: ["unar", "-q", "-f", "-o", str(dst), str(src)]),
)


def extract_rar(path: Path) -> Path:
    """Extract a RAR archive once into ``<archive>.d`` with the first external tool that manages it."""
    dest = path.with_name(path.name + ".d")
    if (dest / ".complete").exists():
        return dest
    tools = [(name, cmd) for name, cmd in RAR_TOOLS if shutil.which(name)]
    if not tools:
        raise LayoutError(f"{path} is a RAR archive and no extractor was found (tried "
                          f"{', '.join(n for n, _ in RAR_TOOLS)}). Install one, e.g. "
                          "`apt-get install -y libarchive-tools` (bsdtar) or `apt-get install -y unrar`, "
                          "or extract it yourself and pass the folder with --local")
    failures = []
    for name, cmd in tools:
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        result = subprocess.run(cmd(path, dest), capture_output=True, text=True)
        if result.returncode == 0:
            (dest / ".complete").touch()
            return dest
        failures.append(f"{name}: exit {result.returncode} {result.stderr.strip()[-300:]}")
    shutil.rmtree(dest, ignore_errors=True)
    raise LayoutError(f"could not extract {path}:\n  " + "\n  ".join(failures))


def open_container(path: Path) -> Container:
    """A folder, zip, tar (.tar, .tgz, .tar.gz) or RAR archive as a ``Container``."""
    path = Path(path)
    if path.is_dir():
        return DirContainer(path)
    name = path.name.lower()
    if name.endswith(".zip"):
        return ZipContainer(path)
    if name.endswith((".tar", ".tgz", ".tar.gz")):
        return TarContainer(path)
    if name.endswith(".rar"):
        return DirContainer(extract_rar(path))
    raise LayoutError(f"{path}: unknown archive type (expected a folder, .zip, .tar, .tgz or .rar)")


class View:
    """The images of one source: a container's members that match ``pattern``, keyed by the pattern's ``key`` group.

    The key is the member's path from a fixed anchor of the dataset's layout on, so it does not depend on
    the folder an archive happens to be wrapped in; split files store keys.
    """

    def __init__(self, container: Container, # where the files are
                 pattern: str, # regex searched in each member name; its group `key` is the image's key
                 flags: int = 0, # regex flags, e.g. re.IGNORECASE
                 rename: Callable[[str], str] | None = None, # key -> output file name; default: the key's base name
                 convert: Callable[[bytes], bytes] | None = None, # turns a member's bytes into an image file's bytes
                 ):
        self.container, self.rename, self.convert = container, rename, convert
        regex = re.compile(r"(?:^|/)(?P<key>" + pattern + r")$", flags)
        self.members = {}
        for member in container.members():
            parts = member.split("/")
            if parts[-1] in JUNK or parts[-1].startswith("._") or "__MACOSX" in parts:
                continue
            match = regex.search(member)
            if match:
                key = match.group("key")
                if key in self.members:
                    raise LayoutError(f"two files have the key {key!r}: {self.members[key]!r} and {member!r}")
                self.members[key] = member

    @property
    def keys(self) -> list[str]:
        return sorted(self.members)

    def find(self, pattern: str) -> bytes:
        """The bytes of the one member whose name ends with ``pattern`` (an auxiliary file such as a label table)."""
        regex = re.compile(r"(?:^|/)" + pattern + r"$")
        found = [m for m in self.container.members() if regex.search(m) and "__MACOSX" not in m]
        if len(found) != 1:
            raise LayoutError(f"expected one file matching {pattern!r}, found {len(found)}: {found[:5]}")
        return self.container.read(found[0])

    def output_name(self, key: str) -> str:
        return safe_name(self.rename(key) if self.rename else key.rsplit("/", 1)[-1])

    def read_many(self, keys: Iterable[str]) -> Iterator[tuple[str, bytes]]:
        by_member = {self.members[k]: k for k in keys}
        for member, data in self.container.read_many(by_member):
            yield by_member[member], self.convert(data) if self.convert else data


def safe_name(name: str) -> str:
    """A file name with only letters, digits, '.', '_' and '-' (others become '_')."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def gunzip_once(path: Path) -> Path:
    """Decompress ``x.gz`` next to itself once (atomically) and return the decompressed path; other paths pass through."""
    path = Path(path)
    if path.suffix != ".gz":
        return path
    out = path.with_suffix("")
    if not out.exists():
        tmp = out.with_name(out.name + ".tmp")
        with gzip.open(path, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, out)
    return out


def png_bytes(array) -> bytes:
    """Encode a (H, W) or (H, W, 3) uint8 array as PNG."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def check_image(data: bytes, what: str) -> None:
    """Raise ``LayoutError`` unless ``data`` is an image PIL can open (catches truncated files and Git LFS pointers)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        head = data[:40]
        raise LayoutError(f"{what} is not a readable image ({err}); it starts with {head!r}") from err


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
    shift: str  # id | semantic | covariate | far
    labels: tuple[str, ...]  # every label this draw can produce (folder names under <out>/<shift>/)
    n: int  # images to draw (the paper's count)
    pick: Callable[[View], dict[str, str]]  # view -> {key: label} of eligible images

    @property
    def scope(self) -> str:
        return f"{self.view}/{self.shift}/{'+'.join(self.labels)}"


@dataclass(frozen=True)
class Benchmark:
    """What a benchmark needs: its ID classes and prompts, its sources and its draws."""
    name: str
    classes: tuple[str, ...]  # ID class folders under <out>/id/, in label order
    class_names: tuple[str, ...]  # what a prompt says for each class
    prompt_template: str  # a domain template with one {} for the class name
    views: dict  # view name -> (manifest keys, opener(paths: dict[key, Path]) -> View)
    draws: tuple[Draw, ...]
    ood_to_id: dict = field(default_factory=dict)  # covariate label -> the ID class it shows

    def check(self) -> None:
        """Raise ``ValueError`` if the description is inconsistent."""
        if len(self.classes) != len(self.class_names):
            raise ValueError(f"{self.name}: {len(self.classes)} classes but {len(self.class_names)} class names")
        for d in self.draws:
            if d.shift not in SHIFTS:
                raise ValueError(f"{self.name}: unknown shift {d.shift!r}")
            if d.view not in self.views:
                raise ValueError(f"{self.name}: draw uses unknown view {d.view!r}")
            if d.shift == "id" and not set(d.labels) <= set(self.classes):
                raise ValueError(f"{self.name}: ID draw labels {d.labels} are not classes {self.classes}")

    def keys(self) -> list[str]:
        """Manifest keys this benchmark downloads."""
        return [k for view in self.views.values() for k in view[0]]


@dataclass(frozen=True)
class Row:
    source: str  # view name
    shift: str
    label: str
    original: str  # the image's key in its source


def read_split(path: Path) -> list[Row]:
    """Rows of a split file (empty when it does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != SPLIT_COLUMNS:
            raise ValueError(f"{path}: columns {reader.fieldnames}, expected {list(SPLIT_COLUMNS)}")
        return [Row(**r) for r in reader]


def write_split(path: Path, rows: Iterable[Row]) -> None:
    """Write a split file sorted by source, shift, label and key (so that diffs stay small)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = sorted(set(rows), key=lambda r: (r.source, SHIFTS.index(r.shift), r.label, r.original))
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(SPLIT_COLUMNS)
        writer.writerows([r.source, r.shift, r.label, r.original] for r in rows)


def fixed_rows(draw: Draw, rows: list[Row]) -> list[Row]:
    """The split-file rows that belong to a draw."""
    return [r for r in rows if r.source == draw.view and r.shift == draw.shift and r.label in draw.labels]


def select(draw: Draw, # what to draw
           view: View, # its source
           rows: list[Row], # rows of the split file
           seed: int, # sampling seed for draws the split file does not fix
           limit: int | None = None, # at most this many images (smoke tests)
           ) -> tuple[list[Row], bool]:
    """The rows a draw yields, and whether they were sampled now (True) or taken from the split file (False)."""
    candidates = draw.pick(view)
    fixed = fixed_rows(draw, rows)
    if fixed:
        for r in fixed:
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


def prepare(bench: Benchmark, # what to prepare
            views: dict[str, View], # view name -> opened source
            out: Path, # the prepared folder
            split: Path, # split file: read, and extended with newly sampled draws unless `limit` is set
            seed: int = 0, # sampling seed for draws the split file does not fix
            limit: int | None = None, # at most this many images per draw (smoke tests; the split file is left alone)
            progressbar: bool = True, # show tqdm bars
            ) -> list[dict]:
    """Select every draw's images, write them under ``out`` with split.csv and classes.json; return the split.csv rows."""
    from tqdm.auto import tqdm

    bench.check()
    shipped = read_split(split)
    chosen, new = [], []
    for draw in bench.draws:
        rows, sampled = select(draw, views[draw.view], shipped, seed, limit)
        chosen += [(draw, r) for r in rows]
        if sampled:
            new += rows
    out = Path(out)
    _claim(out)
    table, seen = [], set()
    for view_name in dict.fromkeys(d.view for d, _ in chosen):
        view = views[view_name]
        wanted = {r.original: r for d, r in chosen if r.source == view_name}
        for key, data in tqdm(view.read_many(wanted), total=len(wanted), desc=f"{bench.name}: {view_name}",
                              disable=not progressbar):
            row = wanted[key]
            check_image(data, f"{view_name}:{key}")
            target = Path(row.shift) / row.label / view.output_name(key)
            if target in seen:
                raise LayoutError(f"two images would both be written to {target}")
            seen.add(target)
            (out / target).parent.mkdir(parents=True, exist_ok=True)
            (out / target).write_bytes(data)
            table.append({"file": target.as_posix(), "shift": row.shift, "label": row.label, "source": view_name})
    table.sort(key=lambda r: (SHIFTS.index(r["shift"]), r["label"], r["file"]))
    with open(out / "split.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=OUT_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(table)
    write_classes(bench, out, table, seed)
    if new and limit is None:
        write_split(split, shipped + new)
    return table


def _claim(out: Path) -> None:
    """Make ``out`` ready: create it, or clear the shift folders of an earlier run; refuse a foreign non-empty folder."""
    if out.exists() and any(out.iterdir()) and not (out / "classes.json").exists():
        raise ValueError(f"{out} is not empty and was not made by these scripts; choose an empty --out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "split.csv").unlink(missing_ok=True)  # a run that fails half-way must not leave an old table behind
    for shift in SHIFTS:
        shutil.rmtree(out / shift, ignore_errors=True)


def write_classes(bench: Benchmark, out: Path, table: list[dict], seed: int) -> None:
    """Write ``classes.json``: ID classes in label order, prompts, counts per shift and label."""
    counts: dict = {}
    for r in table:
        counts.setdefault(r["shift"], {}).setdefault(r["label"], 0)
        counts[r["shift"]][r["label"]] += 1
    info = {
        "benchmark": bench.name,
        "classes": list(bench.classes),
        "class_names": list(bench.class_names),
        "prompts": {c: [name] for c, name in zip(bench.classes, bench.class_names)},
        "prompt_template": bench.prompt_template,
        "templated_prompts": {c: [bench.prompt_template.format(name)] for c, name in zip(bench.classes, bench.class_names)},
        "ood_to_id": bench.ood_to_id,
        "counts": counts,
        "seed": seed,
    }
    (out / "classes.json").write_text(json.dumps(info, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------- command line

def default_raw() -> Path:
    """Where downloads are kept unless --raw says otherwise: $PROTON_DATA_RAW or ~/.cache/proton-ood/raw."""
    if os.environ.get("PROTON_DATA_RAW"):
        return Path(os.environ["PROTON_DATA_RAW"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "proton-ood" / "raw"


def parser(description: str, name: str) -> argparse.ArgumentParser:
    """The command line every data script shares."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="prepared folder to write")
    p.add_argument("--raw", type=Path, default=None,
                   help=f"folder for downloads, shared by all scripts (default: {default_raw()})")
    p.add_argument("--seed", type=int, default=0, help="sampling seed for draws the split file does not fix (default 0)")
    p.add_argument("--dry-run", action="store_true", help="list what would be fetched and written; no network, no writes")
    p.add_argument("--split", type=Path, default=SPLITS / f"{name}.csv",
                   help="split file: its rows fix the images; draws it lacks are sampled and added to it")
    p.add_argument("--local", action="append", default=[], metavar="SOURCE=PATH",
                   help="use a file or extracted folder you already have for a source (repeatable)")
    p.add_argument("--manifest", type=Path, default=MANIFEST, help="manifest of sources")
    p.add_argument("--limit", type=int, default=None,
                   help="at most this many images per draw, for a quick smoke test (the split file is not changed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def parse_local(items: list[str], known: list[str]) -> dict[str, Path]:
    """``["key=path", ...]`` as a dict, refusing unknown keys."""
    local = {}
    for item in items:
        key, sep, path = item.partition("=")
        if not sep or not path:
            raise ValueError(f"--local {item!r}: expected SOURCE=PATH")
        if key not in known:
            raise ValueError(f"--local {item!r}: unknown source {key!r}; this script's sources are {known}")
        local[key] = Path(path)
    return local


def plan(bench: Benchmark, manifest: dict, raw: Path, out: Path, split: Path, seed: int,
         local: dict[str, Path], limit: int | None = None) -> str:
    """The dry-run report: every source (URL, size, licence, login, destination) and every draw. Touches no network."""
    lines = [f"PROTON data, {bench.name} benchmark: dry run (nothing is downloaded or written)", "", "Sources:"]
    for key in bench.keys():
        e = manifest["sources"][key]
        lines.append(f"  {key}: {e['title']}")
        lines.append(f"    size     {e['approx_size']}" + (f" ({e['size_bytes']} bytes)" if e["size_bytes"] else ""))
        lines.append(f"    licence  {e['licence']}")
        checksum = known_hash(e)
        lines.append(f"    checksum {checksum or 'none published (size checked where known)'}")
        dest = raw / e["filename"]
        if key in local:
            lines.append(f"    use      {local[key]} (--local)")
            continue
        if e["download"] == "http":
            lines.append(f"    from     {e['url']}  (no login)")
        else:
            lines.append(f"    from     {e['page']}  (needs a Kaggle account"
                         + (" and accepted competition rules" if e["download"] == "kaggle-competition" else "") + ")")
            lines.append(f"    command  {' '.join(kaggle_command(e, raw))}")
            lines.append("    login    a normal run without the file prints the steps (token, kaggle.json, rules)")
        part = raw / f"{e['filename']}.part"
        state = ("present" if dest.exists() else
                 f"partial, {part.stat().st_size} bytes, will resume" if part.exists() else "not downloaded yet")
        lines.append(f"    to       {dest}  [{state}]")
    rows = read_split(split)
    lines += ["", f"Images, written to {out}/<shift>/<label>/ (split file {split}"
              f"{'' if split.exists() else ', not there yet'}):"]
    for d in bench.draws:
        fixed = fixed_rows(d, rows)
        n = d.n if limit is None else min(d.n, limit)
        how = (f"fixed by the split file ({len(fixed)} rows)" if fixed else
               f"sampled on the first run with seed {seed}" + ("" if limit else ", then added to the split file"))
        folder = f"{d.shift}/{d.labels[0] if len(d.labels) == 1 else '<class>'}/"
        lines.append(f"  {n:4d}  {folder:<36} from {d.view:<12} {how}")
    lines += ["", f"Also written: {out / 'split.csv'} (file, shift, label, source) and {out / 'classes.json'}"]
    return "\n".join(lines)


def run(bench: Benchmark, # the benchmark to prepare
        argv: list[str] | None = None, # command-line arguments (default: sys.argv[1:])
        description: str = "", # --help text
        ) -> list[dict] | str:
    """Parse arguments and prepare a benchmark (or return the dry-run plan); raises on any problem."""
    args = parser(description, bench.name).parse_args(argv)
    manifest = load_manifest(args.manifest)
    raw = (args.raw or default_raw()).expanduser()
    local = parse_local(args.local, bench.keys())
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}")
    if args.dry_run:
        return plan(bench, manifest, raw, args.out, args.split, args.seed, local, args.limit)
    paths, missing = {}, []
    # Kaggle sources first, so that missing credentials are reported before hours of other downloads
    for key in sorted(bench.keys(), key=lambda k: manifest["sources"][k]["download"] == "http"):
        if missing and manifest["sources"][key]["download"] == "http":
            break
        try:
            paths[key] = fetch(key, manifest["sources"][key], raw, local.get(key), progressbar=not args.no_progress)
        except LoginRequired as err:
            missing.append(str(err))
    if missing:
        raise LoginRequired("\n\n".join(missing))
    views = {name: opener(paths) for name, (_, opener) in bench.views.items()}
    return prepare(bench, views, args.out, args.split, seed=args.seed, limit=args.limit,
                   progressbar=not args.no_progress)


def main(bench: Benchmark, argv: list[str] | None = None, description: str = "") -> int:
    """``run`` for the command line: prints the plan or a summary, turns known failures into a message and exit code."""
    try:
        result = run(bench, argv, description)
    except LoginRequired as err:
        print(err, file=sys.stderr)
        return 2
    except (ValueError, OSError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if isinstance(result, str):
        print(result)
        return 0
    counts: dict = {}
    for r in result:
        counts[r["shift"]] = counts.get(r["shift"], 0) + 1
    print(f"{bench.name}: wrote {len(result)} images ({', '.join(f'{s} {counts[s]}' for s in SHIFTS if s in counts)})")
    return 0


# ---------------------------------------------------------------------------------------------- far OOD: Imagenette

IMAGENETTE_CLASSES = {  # WordNet ID -> folder name; the ten Imagenette classes
    "n01440764": "tench", "n02102040": "english_springer", "n02979186": "cassette_player",
    "n03000684": "chain_saw", "n03028079": "church", "n03394916": "french_horn",
    "n03417042": "garbage_truck", "n03425413": "gas_pump", "n03445777": "golf_ball", "n03888257": "parachute",
}


def imagenette_view(paths: dict) -> View:
    """The 3,925 validation images of Imagenette (``val/<wnid>/<name>.JPEG``)."""
    return View(open_container(paths["imagenette"]), r"val/n\d{8}/[^/]+\.JPEG")


def imagenette_pick(view: View) -> dict[str, str]:
    """Every Imagenette validation image, labelled with its class."""
    return {k: IMAGENETTE_CLASSES[k.split("/")[1]] for k in view.keys if k.split("/")[1] in IMAGENETTE_CLASSES}


def imagenette_draw(n: int) -> Draw:
    """Far-OOD: ``n`` Imagenette validation images, any class."""
    return Draw("imagenette", "far", tuple(IMAGENETTE_CLASSES.values()), n, imagenette_pick)
