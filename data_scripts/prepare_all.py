"""Prepare all three benchmarks into <out>/ophthalmology, <out>/radiology and <out>/pathology.

Downloads go to one --raw folder, so Imagenette is fetched once.  A benchmark that fails (for example
radiology without Kaggle credentials) is reported and the others still run; the exit code is non-zero
if any failed.

Example:  python data_scripts/prepare_all.py --out data
          python data_scripts/prepare_all.py --out data --dry-run
          python data_scripts/prepare_all.py --out data --only ophthalmology pathology
"""
import argparse
import sys
from pathlib import Path

if __name__ == "__main__":  # Ctrl-C while the imports below load (torch takes seconds): one line, not a traceback
    import startup
    startup.guard()

import ophthalmology
import pathology
import radiology
from common import check_counts, check_file, check_outside, command, default_raw, main, parse_local

BENCHMARKS = {m.BENCHMARK.name: m for m in (ophthalmology, radiology, pathology)}


def cli(argv=None) -> int:
    """Run each chosen benchmark's script with the shared options; return the worst exit code."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="parent folder; each benchmark goes to <out>/<name>")
    p.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), default=list(BENCHMARKS), help="benchmarks to prepare")
    p.add_argument("--raw", type=Path, help="folder for downloads (see the single scripts' --help)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed for draws the split files do not fix")
    p.add_argument("--dry-run", action="store_true", help="list what would be fetched and written; no network")
    p.add_argument("--manifest", type=Path, help="manifest of sources")
    p.add_argument("--limit", type=int, help="at most this many images per draw (smoke test)")
    p.add_argument("--resize", type=int, metavar="N",
                   help="store images larger than N at N, never enlarged: pathology and radiology on the short side, as "
                        "the CLIP models resize them; ophthalmology on the long side, as FLAIR does (e.g. 224, or 512 for FLAIR)")
    p.add_argument("--local", action="append", default=[], metavar="SOURCE=PATH",
                   help="use a local copy of a source; passed to the benchmarks that use that source")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    try:  # the options every benchmark shares, checked once before any of them starts
        check_counts(args.limit, args.resize)
        check_file("--manifest", args.manifest)
        parse_local(args.local, sorted({k for name in args.only for k in BENCHMARKS[name].BENCHMARK.keys()}))
        for name in args.only:
            check_outside("--raw", (args.raw or default_raw()).expanduser(), args.out.expanduser() / name, "downloads")
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    codes = {}
    for name in args.only:
        bench = BENCHMARKS[name].BENCHMARK
        sub = ["--out", str(args.out / name), "--seed", str(args.seed)]
        sub += ["--raw", str(args.raw)] if args.raw else []
        sub += ["--manifest", str(args.manifest)] if args.manifest else []
        sub += ["--limit", str(args.limit)] if args.limit is not None else []
        sub += ["--resize", str(args.resize)] if args.resize is not None else []
        sub += ["--dry-run"] if args.dry_run else []
        sub += ["--no-progress"] if args.no_progress else []
        sub += [f"--local={item}" for item in args.local if item.partition("=")[0] in bench.keys()]
        print(f"==> {name}", flush=True)
        codes[name] = main(bench, sub, description=BENCHMARKS[name].__doc__)
    failed = [n for n, c in codes.items() if c]
    if failed:
        print(f"not prepared: {', '.join(failed)} (see the messages above)", file=sys.stderr)
    return max(codes.values(), default=0)


if __name__ == "__main__":
    sys.exit(command(cli))
