"""One setting decides where the course lives: every chapter's Colab install cell, the book's buttons and the README agree with it."""
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
spec = importlib.util.spec_from_file_location("address", ROOT / "tools" / "address.py")
address = importlib.util.module_from_spec(spec); spec.loader.exec_module(address)


def test_install_cells_config_and_readme_agree_with_settings():
    assert address.disagreements() == []


def test_every_chapter_has_an_install_cell_pinned_to_the_version():
    url, version, released = address.settings()
    for path in sorted((ROOT / "nbs").glob("*.ipynb")):
        if path.stem in ("99_references", "index"): continue  # the bibliography and the landing page run no code
        found = address.INSTALL.findall(path.read_text())
        assert found, f"{path.name} has no Colab install cell"
    assert address.install_spec("course").endswith(f"=={version}" if released else f"@v{version}")


def test_the_config_points_its_buttons_at_the_setting():
    url = address.settings()[0]
    config = (ROOT / "_config.yml").read_text()
    assert re.search(rf"^  url: {re.escape(url)}$", config, re.M)
    assert f"colab.research.google.com/github/{url.split('github.com/')[1]}/blob/main/nbs/" in (ROOT / "README.md").read_text()


def test_a_changed_setting_is_caught(tmp_path, monkeypatch):
    "The check can fail: with another address in the settings, every install cell disagrees."
    monkeypatch.setattr(address, "settings", lambda: ("https://github.com/someone/PROTON", "0.1.0", False))
    assert len(address.disagreements()) >= len(list((ROOT / "nbs").glob("*.ipynb"))) - 1
