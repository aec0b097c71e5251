"""Packaging for `proton-ood`: every field comes from `settings.ini`, the nbdev 2 project file."""
from configparser import ConfigParser
from pathlib import Path

import setuptools

here = Path(__file__).parent
cfg = ConfigParser(delimiters=["="])
cfg.read(here / "settings.ini", encoding="utf-8")
cfg = cfg["DEFAULT"]

statuses = ["Planning", "Pre-Alpha", "Alpha", "Beta", "Production/Stable", "Mature", "Inactive"]
reqs = lambda key: cfg.get(key, "").split()
plot, course, vlm, data, interop, dev = (reqs(f"{k}_requirements") for k in ("plot", "course", "vlm", "data", "interop", "dev"))

setuptools.setup(
    name=cfg["lib_name"],
    version=cfg["version"],
    description=cfg["description"],
    long_description=(here / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    author=cfg["author"],
    author_email=cfg["author_email"],
    url=cfg["git_url"],
    license="Apache-2.0",
    keywords=cfg["keywords"],
    classifiers=[
        f"Development Status :: {int(cfg['status']) + 1} - {statuses[int(cfg['status'])]}",
        f"Intended Audience :: {cfg['audience']}",
        "Natural Language :: English",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Medical Science Apps.",
    ],
    python_requires=f">={cfg['min_python']}",
    packages=setuptools.find_packages(include=["proton", "proton.*"]),
    include_package_data=True,
    install_requires=reqs("requirements"),
    extras_require={"plot": plot, "course": plot + course, "vlm": vlm, "data": data, "interop": interop,
                    "all": plot + course + vlm + data + interop, "dev": dev + plot + course + vlm + data + interop},
    entry_points={"nbdev": [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"],
                  "console_scripts": cfg.get("console_scripts", "").split("\n")},
    zip_safe=False,
)
