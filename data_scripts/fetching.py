"""Downloads and their verification for the data scripts: the manifest, resumable checksum-verified HTTP downloads, Kaggle.

Only the standard library is imported at module level; ``requests`` and ``tqdm`` (the ``data`` extra) are imported
where they are used.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterable

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "manifest.json"


class ChecksumError(ValueError):
    """A file's checksum or size differs from the manifest."""


class DownloadError(OSError):
    """A download failed before the file was complete; the message says what to do (often: run the same command again to resume it)."""


class LoginRequired(RuntimeError):
    """A source needs an account (Kaggle); the message says exactly what to do."""


# ---------------------------------------------------------------------------------------------- manifest

REQUIRED_FIELDS = ("title", "page", "download", "filename", "size_bytes", "approx_size", "sha256", "md5",
                   "licence", "login", "used_for", "why")


def load_manifest(path: Path | str | None = None, # a manifest.json; None: the one beside this file
                  needed: Iterable[str] = (), # source names the caller uses, which must be there
                  ) -> dict:
    """Read and check the manifest of sources."""
    path = Path(path or MANIFEST)
    try: manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err: raise ValueError(f"manifest {path}: not JSON ({err})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("sources"), dict):
        raise ValueError(f"manifest {path}: no 'sources' table (a JSON object of source name -> entry)")
    absent = [k for k in needed if k not in manifest["sources"]]
    if absent:
        raise ValueError(f"manifest {path}: no source {', '.join(map(repr, absent))}, which this script needs")
    for key, entry in manifest["sources"].items():
        if not isinstance(entry, dict):
            raise ValueError(f"manifest {path}: source {key!r} is not a JSON object but {entry!r}")
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
            if value is not None and not (isinstance(value, str) and re.fullmatch(rf"[0-9a-f]{{{length}}}", value)):
                raise ValueError(f"manifest {path}: source {key!r} has a malformed {alg} {value!r}")
        size, name = entry["size_bytes"], entry["filename"]
        if size is not None and not (type(size) is int and size >= 0):  # not bool, an int to JSON's parser but no size
            raise ValueError(f"manifest {path}: source {key!r} has a malformed size_bytes {size!r} (a whole number of bytes or null)")
        if not (isinstance(name, str) and Path(name).name == name and name not in ("", "..") and "\\" not in name):
            raise ValueError(f"manifest {path}: source {key!r} has a malformed filename {name!r} (a file name in --raw, without folders)")
    return manifest


def known_hash(entry: dict) -> str | None:
    """The strongest checksum the manifest knows for a source, as ``alg:hex`` (None when unknown)."""
    if entry["sha256"]:
        return f"sha256:{entry['sha256']}"
    if entry["md5"]:
        return f"md5:{entry['md5']}"
    return None


def verification(entry: dict) -> str:
    """How a source is verified: by its checksum, by its size only, or not at all."""
    if entry["sha256"] or entry["md5"]:
        alg, hexdigest = known_hash(entry).split(":")
        return f"{alg} {hexdigest}"
    if entry["size_bytes"]:
        return "size only: no checksum is published"
    return "not at all: neither a checksum nor a size is published"


def unchecked(entry: dict, # a source's manifest entry
              local: Path, # the user's file or folder for it (--local)
              ) -> str | None:
    """Why a ``--local`` copy is not checked against the manifest (a folder, or a file under another name); None when it is."""
    if not local.is_file():
        return f"not checked: local folder {local}"
    if local.name != entry["filename"]:
        return f"not checked: local copy {local} is not named {entry['filename']}"
    return None


def provenance(verified: str, # how the file was verified, as ``fetch`` returns it
               path: Path, # the file or folder used
               ) -> dict:
    """What the prepared folder records of a source: how it was verified, and the SHA-256 of the file used (None for a folder)."""
    path = Path(path)
    return {"verified": verified, "sha256": file_hash(path, "sha256") if path.is_file() else None}


def file_hash(path: Path, alg: str) -> str:
    """Hex digest of a file, read in blocks."""
    digest = hashlib.new(alg)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def mismatch(path: Path, # a local file
             entry: dict, # its manifest entry
             ) -> str | None:
    """How the file differs from the manifest's size or checksum (checks only what is known); None when it agrees."""
    size = path.stat().st_size
    if entry["size_bytes"] is not None and size != entry["size_bytes"]:
        return f"{size} bytes, the manifest says {entry['size_bytes']}"
    expected = known_hash(entry)
    if expected is not None:
        alg, hexdigest = expected.split(":")
        actual = file_hash(path, alg)
        if actual != hexdigest:
            return f"{alg} is {actual}, the manifest says {hexdigest}"
    return None


def verify(path: Path, # a local file
           entry: dict, # its manifest entry
           ) -> None:
    """Raise ``ChecksumError`` unless the file has the manifest's size and checksum (checks only what is known)."""
    problem = mismatch(path, entry)
    if problem is not None:
        raise ChecksumError(f"{path}: {problem}; the file is cut short, corrupt or a different version: "
                            "delete it and run again to download it afresh")


# ---------------------------------------------------------------------------------------------- download

class ResumableDownloader:
    """Receives a file into ``<file>.part``, keeping the bytes received so far there and resuming them with an HTTP Range request."""

    def __init__(self, part: Path, # where the bytes received so far are kept between runs
                 progressbar: bool = True, # show a tqdm bar
                 chunk_size: int = 1 << 20, # bytes per read
                 timeout: float = 60.0, # seconds without data before giving up
                 ):
        self.part, self.progressbar, self.chunk_size, self.timeout = Path(part), progressbar, chunk_size, timeout

    def __call__(self, entry: dict) -> None: # manifest entry of an http source
        """Receive the rest of the source's file into the part file, which then holds all of it (not yet verified)."""
        import requests
        import urllib3

        url, page = entry["url"], entry["page"]
        what = f"{entry['filename']} from {url}"
        done = self.part.stat().st_size if self.part.exists() else 0
        # the file's own bytes: requests would ask for gzip and decode it, so sizes and ranges would not be the file's
        headers = {"Accept-Encoding": "identity"} | ({"Range": f"bytes={done}-"} if done else {})
        try:
            with requests.get(url, headers=headers, stream=True, timeout=self.timeout) as response:
                total = self._receive(response, done, entry)
        except requests.TooManyRedirects as err:
            raise DownloadError(f"{what}: the server redirects in a loop ({err}); the link may be out of date: "
                                f"find the file on {page} and put its link in the manifest's url") from err
        except requests.HTTPError as err:  # an answer, but not the file: running again as it is would not help
            status = err.response.status_code
            advice = (f"the file is not there, it may have moved: find it on {page} and put its link in the manifest's url"
                      if status in (404, 410) else "the server failed: try again later" if status >= 500 else
                      "the server is busy: try again later" if status == 429 else f"the server refused it: see {page}")
            raise DownloadError(f"{what}: HTTP {status} {err.response.reason}; {advice}") from err
        except (requests.RequestException, urllib3.exceptions.HTTPError) as err:  # the raw stream raises urllib3's own
            have = self.part.stat().st_size if self.part.exists() else 0
            raise DownloadError(f"download of {what} stopped after {have} bytes ({err}); "
                                "run the same command again to resume") from err
        size = self.part.stat().st_size
        if total is not None and size != total:
            raise DownloadError(f"download of {what} ended after {size} of {total} bytes; "
                                "run the same command again to resume")

    def _receive(self, response, done: int, entry: dict) -> int | None:
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
        else:  # 200: the whole file (the server ignored the Range header), or something else in its place
            length = response.headers.get("Content-Length")
            total = int(length) if length is not None else None
            what = f"{entry['filename']} from {entry['url']}"
            if response.headers.get("Content-Type", "").lower().startswith("text/html"):
                raise DownloadError(f"{what} answered an HTML page, not the file (a sign-in page? it came from "
                                    f"{response.url}); nothing was written: sign in or change network, then run again")
            if total is not None and entry["size_bytes"] is not None and total != entry["size_bytes"]:
                raise ChecksumError(f"{what}: the server sends {total} bytes, the manifest says {entry['size_bytes']}: not "
                                    f"that file (a page in its place, or a new version: see {entry['page']}); nothing was written")
            done, mode = 0, "wb"  # only now is the part file known to be outdated: start over
        from tqdm.auto import tqdm

        with open(self.part, mode) as f, tqdm(total=total, initial=done, unit="B", unit_scale=True,
                                              unit_divisor=1024, desc=self.part.name[:-5],
                                              disable=not self.progressbar) as bar:
            for chunk in response.raw.stream(self.chunk_size, decode_content=False):  # as sent, even if labelled gzip
                f.write(chunk)
                bar.update(len(chunk))
        return total


def _content_range_start(value: str) -> int | None:
    match = re.match(r"bytes (\d+)-\d+/", value)
    return int(match.group(1)) if match else None


def _content_range_total(value: str) -> int | None:
    match = re.search(r"/(\d+)\s*$", value)
    return int(match.group(1)) if match else None


@contextlib.contextmanager
def downloading(path: Path): # a file in the downloads folder
    """Hold ``<file>.lock`` while this run downloads and checks ``path``; refuse at once, naming the other run, while another holds it."""
    from proton.deploy import hold_lock

    lock = path.with_name(f"{path.name}.lock")
    with contextlib.ExitStack() as held:
        try: held.enter_context(hold_lock(lock, remove=True))
        except BlockingIOError:
            try: pid = lock.read_text().strip()
            except OSError: pid = ""  # its run has just ended
            raise BlockingIOError(f"another run{f' (process {pid})' if pid else ''} is downloading {path.name} into "
                                  f"{path.parent}; let it finish, then run this again") from None
        lock.write_text(f"{os.getpid()}\n")
        yield


def download(entry: dict, # manifest entry of an http source
             raw: Path, # folder for downloads
             progressbar: bool = True, # show a tqdm bar
             chunk_size: int = 1 << 20, # bytes per read
             ) -> Path:
    """Return a source's verified file in ``raw``, downloading it first (resuming ``<file>.part``) when missing or not the manifest's."""
    raw = Path(raw)
    raw.mkdir(parents=True, exist_ok=True)
    path, part = raw / entry["filename"], raw / f"{entry['filename']}.part"
    with downloading(path):  # one run at a time writes the part file, so a verified file never changes afterwards
        if path.exists():
            problem = mismatch(path, entry)
            if problem is None:
                return path
            print(f"Updating {path} ({problem}) from {entry['url']}", file=sys.stderr)
        else:
            print(f"Downloading {entry['url']} to {path}", file=sys.stderr)
        ResumableDownloader(part, progressbar=progressbar, chunk_size=chunk_size)(entry)
        problem = mismatch(part, entry)  # the part file itself is checked: an interruption now leaves it to resume from
        if problem is not None:
            part.unlink()
            raise ChecksumError(f"{entry['filename']} from {entry['url']} failed its checksum and was deleted: {problem}; "
                                "run again to download it afresh")
        if known_hash(entry) is None:
            print(f"SHA-256 of {path.name}: {file_hash(part, 'sha256')} (the manifest publishes no checksum; "
                  "put this one there to pin the file)", file=sys.stderr)
        os.replace(part, path)
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
    path.parent.mkdir(parents=True, exist_ok=True)
    with downloading(path):  # the kaggle client writes the file under its own name: half-written while another run downloads
        if path.exists():
            return path
        if shutil.which("kaggle") is None or not kaggle_credentials_present():
            raise LoginRequired(kaggle_instructions(key, entry, raw))
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
          ) -> tuple[Path, str]:
    """Return a local path for a source (the user's copy, the cached download, or a fresh download) and how it was verified."""
    if local is not None:
        local = Path(os.path.abspath(Path(local).expanduser()))
        if not local.exists():
            raise FileNotFoundError(f"--local {key}={local}: no such file or folder")
        skipped = unchecked(entry, local)
        if skipped is None:
            verify(local, entry)
        return local, skipped or verification(entry)
    if entry["download"] == "http":
        return download(entry, raw, progressbar=progressbar), verification(entry)
    path = fetch_kaggle(key, entry, raw)
    verify(path, entry)  # the manifest publishes nothing for Kaggle's files, unless someone pinned one there
    return path, verification(entry)


