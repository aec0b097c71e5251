"""Reading the sources' archives for the data scripts: zip, tar, rar and plain folders, and views of the images in them."""
from __future__ import annotations

import contextlib
import glob
import gzip
import io
import os
import re
import secrets
import shutil
import subprocess
import tarfile
import zipfile
import zlib
from pathlib import Path
from typing import Callable, Iterable, Iterator

from proton.bench.prepared import SKIPPED_FILES
from proton.deploy import hold_lock, replace_atomically


class LayoutError(ValueError):
    """A source does not look like the dataset it should be (missing files, unknown names, too few images)."""


# ---------------------------------------------------------------------------------------------- archives

MAX_MEMBER_BYTES = 512 << 20  # a zip or tar member is read whole into memory: a larger one is no image or table of a source (a zip bomb)


def check_size(path: Path, # the archive
               member: str, # the member's name in it
               size: int, # the member's size once decompressed, as the archive declares it
               ) -> None:
    """Raise ``LayoutError`` naming the member if ``size`` is over ``MAX_MEMBER_BYTES``, before it is read."""
    if size > MAX_MEMBER_BYTES:
        raise LayoutError(f"{path}:{member}: {size} bytes once decompressed, over the {MAX_MEMBER_BYTES} bytes any file "
                          "of a source may have; is the archive damaged or not the dataset's?")

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


UNBOUNDED_ZIP_METHODS = {zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "LZMA"}  # zip methods whose reads zipfile cannot bound: refused unread


class ZipContainer(Container):
    def __init__(self, path: Path):
        self.path = path
        try:
            self.zip = zipfile.ZipFile(path)
        except zipfile.BadZipFile as err:
            raise LayoutError(f"{path} is not a readable zip archive (truncated download?): {err}") from err

    def members(self) -> list[str]:
        return sorted(i.filename for i in self.zip.infolist() if not i.is_dir())

    def read(self, member: str) -> bytes:
        # only the central directory is checked on opening: a member's damaged bytes (bad CRC, zlib.error) or a
        # compression zipfile lacks (NotImplementedError for Deflate64, RuntimeError when encrypted) show when it is read
        info = self.zip.getinfo(member)
        check_size(self.path, member, info.file_size)  # zipfile returns no more than the declared size (then checks the CRC) ...
        if info.compress_type in UNBOUNDED_ZIP_METHODS:  # ... but inflates these with no limit on what one read gives
            raise LayoutError(f"{self.path}:{member}: cannot be read (compressed with {UNBOUNDED_ZIP_METHODS[info.compress_type]}, which zipfile inflates "
                              "with no bound on the memory it takes); extract the archive with another tool and pass the folder with --local")
        try:
            with self.zip.open(info) as f:  # ... but inflates up to 1 GiB a read before cutting: read in chunks, each inflated to at most 1 MiB
                return b"".join(iter(lambda: f.read(1 << 20), b""))
        except (zipfile.BadZipFile, zlib.error, NotImplementedError, RuntimeError, EOFError) as err:
            raise LayoutError(f"{self.path}:{member}: cannot be read ({type(err).__name__}: {err}); delete the archive and "
                              "download it again, or extract it with another tool and pass the folder with --local") from err


class TarContainer(Container):
    def __init__(self, path: Path):
        self.path = path
        try:
            self.tar = tarfile.open(path)
            self.infos = {}
            for i in self.tar.getmembers():
                if i.isfile():
                    self.infos[i.name] = i
                elif i.islnk() and i.linkname in self.infos:  # a hard link (a second name) of a file: read as that file
                    self.infos[i.name] = self.infos[i.linkname]
        except (tarfile.TarError, EOFError, OSError) as err:
            raise LayoutError(f"{path} is not a readable tar archive (truncated download?): {err}") from err

    def members(self) -> list[str]:
        return sorted(self.infos)

    def read(self, member: str) -> bytes:
        info = self.infos[member]
        check_size(self.path, member, info.size)
        return self.tar.extractfile(info).read()

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


def stamp(path: Path) -> str:
    """The size and modification time of ``path``: what is derived from it is redone once this changes (a new version)."""
    info = path.stat()
    return f"{info.st_size} {info.st_mtime_ns}\n"


def made_from(marker: Path, # where the stamp of the source was recorded once the derived file was complete
              source: Path, # the file it was derived from
              ) -> bool:
    """Whether ``marker`` records the current version of ``source``."""
    try:
        return marker.read_text() == stamp(source)
    except (FileNotFoundError, NotADirectoryError):
        return False


def extract_rar(path: Path) -> Path:
    """Extract a RAR archive once into ``<archive>.d`` with the first external tool that manages it.

    One run at a time extracts (another sharing the folder stops at once), into a temporary folder of its own
    renamed to ``<archive>.d`` once complete; what a killed run left is cleared first. ``.complete`` in it
    records the archive's size and time: an archive replaced since is extracted again.
    """
    dest = path.with_name(path.name + ".d")
    if made_from(dest / ".complete", path):
        return dest
    tools = [(name, cmd) for name, cmd in RAR_TOOLS if shutil.which(name)]
    if not tools:
        raise LayoutError(f"{path} is a RAR archive and no extractor was found (tried "
                          f"{', '.join(n for n, _ in RAR_TOOLS)}). Install one, e.g. "
                          "`apt-get install -y libarchive-tools` (bsdtar) or `apt-get install -y unrar`, "
                          "or extract it yourself and pass the folder with --local")
    failures = []
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(hold_lock(path.with_name(f".{dest.name}.lock"), remove=True))
        except BlockingIOError:
            raise BlockingIOError(f"another run is extracting {path}; wait for it to end") from None
        if made_from(dest / ".complete", path):  # extracted by a run that ended since
            return dest
        version = stamp(path)
        for stale in (dest, *path.parent.glob(f".{glob.escape(dest.name)}.*.tmp")):  # an earlier archive's, a killed run's
            shutil.rmtree(stale, ignore_errors=True)
        for name, cmd in tools:
            tmp = path.with_name(f".{dest.name}.{secrets.token_hex(6)}.tmp")
            tmp.mkdir()  # the umask's permissions, not mkdtemp's 0700: --raw may be shared
            try:
                result = subprocess.run(cmd(path, tmp), capture_output=True, text=True)
                if result.returncode == 0:
                    (tmp / ".complete").write_text(version)
                    tmp.rename(dest)
                    return dest
            finally:
                shutil.rmtree(tmp, ignore_errors=True)  # a failed or interrupted extraction; gone once renamed
            failures.append(f"{name}: exit {result.returncode} {result.stderr.strip()[-300:]}")
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
                 convert: Callable[[str, bytes], bytes] | None = None, # (key, member's bytes) -> an image file's bytes
                 ):
        self.container, self.rename, self.convert = container, rename, convert
        regex = re.compile(r"(?:^|/)(?P<key>" + pattern + r")$", flags)
        self.members = {}
        for member in container.members():
            parts = member.split("/")
            # a name starting with '.' is hidden (macOS's '._' copies among them), in a hidden folder too, as read_prepared skips them; './' is no folder
            if parts[-1] in SKIPPED_FILES or any(p.startswith(".") and p not in (".", "..") for p in parts) or "__MACOSX" in parts:
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
            key = by_member[member]
            yield key, self.convert(key, data) if self.convert else data


def safe_name(name: str) -> str:
    """A file name with only letters, digits, '.', '_' and '-' (others become '_')."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def gunzip_once(path: Path) -> Path:
    """Decompress ``x.gz`` next to itself once and return the decompressed path; other paths pass through.

    Each run decompresses into a temporary file of its own, renamed to ``x`` once complete, so ``x`` is
    always whole, even while another run sharing the folder decompresses the same file. ``x.source`` then
    records the size and time of ``x.gz``: a ``x.gz`` replaced since is decompressed again.
    """
    path = Path(path)
    if path.suffix != ".gz":
        return path
    out = path.with_suffix("")
    marker = out.with_name(out.name + ".source")
    if not (out.exists() and made_from(marker, path)):
        version = stamp(path)  # taken first: a .gz replaced while it is read is decompressed again next time
        try:
            with gzip.open(path, "rb") as src:  # nothing half-decompressed stays behind
                replace_atomically(out, lambda dst: shutil.copyfileobj(src, dst, 1 << 20))
        except (EOFError, gzip.BadGzipFile, zlib.error) as err:
            raise LayoutError(f"{path} is not a complete gzip file ({err}); delete it and download it again") from err
        replace_atomically(marker, lambda dst: dst.write(version.encode()))
    return out


def png_bytes(array) -> bytes:
    """Encode a (H, W) or (H, W, 3) uint8 array as PNG."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def check_image(data: bytes, what: str) -> None:
    """Raise ``LayoutError`` unless ``data`` is an image PIL can decode (catches truncated files and Git LFS pointers)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()  # checksums such as PNG's CRCs, without decoding
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # decodes: a JPEG or TIFF cut short passes verify()
    except (UnidentifiedImageError, OSError, SyntaxError, Image.DecompressionBombError) as err:
        head = data[:40]
        raise LayoutError(f"{what} is not a readable image ({err}); it starts with {head!r}") from err


