"""Where the course lives, written once: settings.ini's `git_url`, `version` and `pypi_released` decide the Colab install cell of
every chapter, the book's repository and launch buttons (_config.yml) and the README's links. `python tools/address.py` rewrites
them from the settings; `python tools/address.py --check` (and tests/test_address.py) fails when any of them disagrees."""
import configparser
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALL = re.compile(r'%pip install -q \\?"proton-ood\[(?P<extras>[a-z,]+)\](?P<spec>[^"\\]*)\\?"')
GITHUB = re.compile(r"https://github\.com/[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+")


def settings():
    "The repository address, the version and whether that version is on PyPI, from settings.ini."
    c = configparser.ConfigParser()
    c.read(ROOT / "settings.ini")
    d = c["DEFAULT"]
    return d["git_url"].rstrip("/"), d["version"], d.getboolean("pypi_released", fallback=False)


def install_spec(extras: str) -> str:
    "What a chapter's install cell asks pip for: the released version from PyPI, or the repository at that version's tag."
    url, version, released = settings()
    return f"proton-ood[{extras}]=={version}" if released else f"proton-ood[{extras}] @ git+{url}@v{version}"


def _fix_notebook(path: Path) -> bool:
    "Rewrite the notebook's install cell from the settings; whether it changed."
    nb = json.loads(path.read_text())
    changed = False
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        new = INSTALL.sub(lambda m: f'%pip install -q "{install_spec(m["extras"])}"', src)
        if new != src:
            cell["source"] = new.splitlines(keepends=True)
            changed = True
    if changed: path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return changed


def _fix_text(path: Path) -> bool:
    "Point every GitHub address of the project in a text file (_config.yml, README.md) at the settings' one."
    url = settings()[0]
    text = path.read_text()
    new = GITHUB.sub(lambda m: url if m[0].rstrip("/").lower().endswith("/proton") else m[0], text)
    if new != text: path.write_text(new)
    return new != text


def disagreements() -> list:
    "Every place that disagrees with the settings, as one line each."
    url = settings()[0]
    found = []
    for path in sorted((ROOT / "nbs").glob("*.ipynb")):
        for m in INSTALL.finditer(path.read_text()):
            if m["spec"].strip() != install_spec(m["extras"])[len(f"proton-ood[{m['extras']}]"):].strip():
                found.append(f"{path.name}: installs {m[0]!r}, the settings say {install_spec(m['extras'])!r}")
    for name in ("_config.yml", "README.md"):
        for m in GITHUB.finditer((ROOT / name).read_text()):
            if m[0].rstrip("/").lower().endswith("/proton") and m[0].rstrip("/") != url:
                found.append(f"{name}: points at {m[0]}, the settings say {url}")
    return found


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        bad = disagreements()
        print("\n".join(bad) or "every install cell, _config.yml and the README agree with settings.ini")
        sys.exit(1 if bad else 0)
    changed = [p.name for p in sorted((ROOT / "nbs").glob("*.ipynb")) if _fix_notebook(p)]
    changed += [n for n in ("_config.yml", "README.md") if _fix_text(ROOT / n)]
    print("rewrote " + (", ".join(changed) if changed else "nothing: everything agrees"))
