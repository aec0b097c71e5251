"""The `proton-ood` console command, run as a user runs it: a separate process."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from proton.bench import EmbeddingCache, SyntheticWorld


def run(*args):
    exe = shutil.which("proton-ood") or str(Path(sys.executable).parent / "proton-ood")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=600)


def test_version_and_help():
    from proton import __version__
    assert run("--version").stdout.strip() == f"proton-ood {__version__}"
    out = run("--help").stdout
    assert all(c in out for c in ("evaluate", "extract", "info"))


def test_unknown_command_is_refused():
    r = run("train")
    assert r.returncode == 2 and "invalid choice: 'train'" in r.stderr


def test_info_checks_a_cache(tmp_path):
    path = tmp_path / "c.npz"
    cache = EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=30, n_per_shift=10)
    cache.save(path)
    r = run("info", str(path))
    assert r.returncode == 0 and cache.content_hash() in r.stdout
    path.write_bytes(path.read_bytes()[:-40])  # truncated
    r = run("info", str(path))
    assert r.returncode != 0 and str(path) in r.stderr


def test_command_help_reaches_the_command():
    r = run("evaluate", "-h")
    assert r.returncode == 0 and "--simulated" in r.stdout


def test_evaluate_on_the_simulated_world(tmp_path):
    out = tmp_path / "results.csv"
    r = run("evaluate", "--simulated", "default", "--permutations", "1", "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    header = out.read_text().splitlines()[0]
    assert header == "method,shift,seed,auroc,aupr_out,aupr_in,fpr95,fpr95_ood,n_id,n_ood,fpr95_convention"


def one_line_error(r):
    "The run failed with exactly one line on stderr and no traceback."
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    return r.returncode != 0 and len(lines) == 1 and "Traceback" not in r.stderr and lines[0].startswith("proton-ood")


@pytest.mark.parametrize("case", ["missing", "corrupt", "directory"])
def test_info_errors_are_one_line(tmp_path, case):
    path = tmp_path / "c.npz"
    if case == "corrupt": path.write_bytes(b"not a zip archive")
    if case == "directory": path.mkdir()
    r = run("info", str(path))
    assert one_line_error(r), r.stderr
    assert str(path) in r.stderr


def test_evaluate_errors_are_one_line(tmp_path):
    r = run("evaluate", "--seed", "-1", "--out", str(tmp_path / "r.csv"))
    assert one_line_error(r) and "--seed" in r.stderr, r.stderr
    blocker = tmp_path / "file"; blocker.write_text("")
    r = run("evaluate", "--permutations", "1", "--no-progress", "--out", str(blocker / "r.csv"))  # a file where a folder should be
    assert one_line_error(r) and "cannot write" in r.stderr, r.stderr


def test_extract_errors_are_one_line(tmp_path):
    data = tmp_path / "data" / "id" / "a"; data.mkdir(parents=True)
    from PIL import Image
    Image.new("RGB", (8, 8)).save(data / "x.png")
    for extra in (["--model", "open_clip:ViT-S-32/none", "--device", "bogus"], ["--model", "open_clip:No-Such-Arch/none"]):
        r = run("extract", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "c.npz"), "--workers", "0", "--no-progress", *extra)
        assert one_line_error(r), r.stderr


def test_a_warning_is_one_line_naming_the_command(tmp_path):
    "What a run skips (here GL-MCM and the prompt-set baselines: the cache has no local embeddings and no prompt sets) is said in one line."
    path = tmp_path / "c.npz"
    EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=60, n_per_shift=20).save(path)
    r = run("evaluate", str(path), "--permutations", "1", "--no-progress", "--out", str(tmp_path / "r.csv"))
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 0 and lines and all(l.startswith("proton-ood evaluate: warning: skipped ") for l in lines), r.stderr
    assert "gl_mcm" in r.stderr


def test_debug_shows_the_traceback(tmp_path):
    r = run("--debug", "info", str(tmp_path / "missing.npz"))
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_evaluate_follows_the_paper_protocol_and_records_it(tmp_path):
    import json
    import pandas as pd
    out = tmp_path / "results.csv"
    r = run("evaluate", "--simulated", "ophthalmology", "--permutations", "1", "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    df = pd.read_csv(out)
    share = df.n_id / (df.n_id + df.n_ood)
    assert ((share - 0.7).abs() < 0.02).all(), share  # ρ = 0.7, the paper's ID fraction
    protocol = json.loads((tmp_path / "results_protocol.json").read_text())["main_table"]
    assert protocol["rho"] == 0.7 and protocol["fpr95_convention"] == "ju2025" and protocol["n_permutations"] == 1
    assert set(df.fpr95_convention) == {"ju2025"} and "FPR95 (ju2025)" in r.stdout


@pytest.mark.parametrize("unbuffered", ["1", None])  # a user's shell seldom sets PYTHONUNBUFFERED: stdout to a pipe is then block-buffered
@pytest.mark.parametrize("args", [["info"], ["--help"], ["--version"], ["info", "--help"]])
def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path, args, unbuffered):
    "`proton-ood info ... | head -1`: that `head` left early is no error to report, whether stdout is buffered or not."
    path = tmp_path / "c.npz"
    EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=30, n_per_shift=10).save(path)
    exe = shutil.which("proton-ood") or str(Path(sys.executable).parent / "proton-ood")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"} | ({"PYTHONUNBUFFERED": unbuffered} if unbuffered else {})
    reader, writer = os.pipe()
    os.close(reader)  # the reader is gone before the command writes a line
    r = subprocess.run([exe, *args, *([str(path)] if args == ["info"] else [])], stdout=writer, stderr=subprocess.PIPE, text=True, timeout=600, env=env)
    os.close(writer)
    quiet = 0 if unbuffered and args != ["info"] else 141  # argparse's own print of help and version ignores a failed write
    assert r.returncode == quiet and r.stderr == "", r.stderr


@pytest.mark.parametrize("args", [["info"], ["--version"]])
def test_a_full_stdout_is_one_line(tmp_path, args):
    "`proton-ood info ... > /dev/full`: one line naming the output, not Python's 'Exception ignored' noise."
    path = tmp_path / "c.npz"
    EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=30, n_per_shift=10).save(path)
    exe = shutil.which("proton-ood") or str(Path(sys.executable).parent / "proton-ood")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with open("/dev/full", "w") as full:
        r = subprocess.run([exe, *args, *([str(path)] if args == ["info"] else [])], stdout=full, stderr=subprocess.PIPE, text=True, timeout=600, env=env)
    assert one_line_error(r) and "No space left on device" in r.stderr and "standard output" in r.stderr, r.stderr


def test_all_skips_an_experiment_the_cache_cannot_run_and_runs_the_rest(tmp_path):
    "`--experiments all` on a cache with one OOD shift stopped at triage (it needs two); named explicitly, triage still fails."
    cache = EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=60, n_per_shift=20)
    path = cache.subset((cache.shift == "id") | (cache.shift == "covariate")).save(tmp_path / "one_shift.npz")
    r = run("evaluate", str(path), "--out", str(tmp_path / "r.csv"), "--experiments", "all", "--permutations", "1", "--no-progress")
    assert r.returncode == 0, r.stderr
    skipped = [l for l in r.stderr.splitlines() if l.startswith("proton-ood evaluate: warning: skipped triage: ")]
    assert len(skipped) == 1 and "two OOD shifts" in skipped[0], r.stderr
    assert (tmp_path / "r_dynamics.csv").exists() and not (tmp_path / "r_triage.csv").exists()
    r = run("evaluate", str(path), "--out", str(tmp_path / "t.csv"), "--experiments", "triage", "--no-progress")  # triage takes no --permutations
    assert one_line_error(r) and "two OOD shifts" in r.stderr, r.stderr


def test_a_reader_that_stops_reading_leaves_evaluate_results_and_protocol_in_step(tmp_path):
    "The summary is printed after the CSV and its protocol are both written: a closed pipe at the print leaves them matching."
    import json
    import pandas as pd
    path = tmp_path / "c.npz"
    EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=60, n_per_shift=20).save(path)
    out = tmp_path / "e.csv"
    assert run("evaluate", str(path), "--permutations", "1", "--no-progress", "--fpr95", "mcm", "--out", str(out)).returncode == 0
    reader, writer = os.pipe()
    os.close(reader)
    exe = shutil.which("proton-ood") or str(Path(sys.executable).parent / "proton-ood")
    r = subprocess.run([exe, "evaluate", str(path), "--permutations", "1", "--no-progress", "--out", str(out)], stdout=writer,
                       stderr=subprocess.PIPE, text=True, timeout=600, env=dict(os.environ, PYTHONUNBUFFERED="1"))  # the print fails at once
    os.close(writer)
    assert r.returncode == 141, r.stderr
    protocol = json.loads((tmp_path / "e_protocol.json").read_text())["main_table"]
    assert set(pd.read_csv(out).fpr95_convention) == {protocol["fpr95_convention"]} == {"ju2025"}


def test_ctrl_c_while_the_command_starts_is_one_line(tmp_path):
    "Ctrl-C in a command's first second, while it imports torch and the rest, ends it as Ctrl-C later does: one line, status 130."
    import signal
    import time
    path = tmp_path / "c.npz"
    EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=30, n_per_shift=10).save(path)
    exe = shutil.which("proton-ood") or str(Path(sys.executable).parent / "proton-ood")
    interrupted = 0
    for delay in (0.4, 0.25, 0.6, 0.15):  # after Python's own start-up (a signal before it kills any Python program)
        p = subprocess.Popen([exe, "info", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(delay); p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=600)
        assert (p.returncode, err) in ((130, "proton-ood info: interrupted\n"), (0, ""), (-signal.SIGINT, "")), (delay, p.returncode, err)  # the last: once it was done
        interrupted += p.returncode == 130
        if interrupted >= 2: break
    assert interrupted >= 2


def test_ctrl_c_once_the_command_is_done_ends_it_quietly(tmp_path):
    "A Ctrl-C during Python's shutdown, after `main` returned, raised KeyboardInterrupt in an atexit callback: a traceback and status 0. As the program, the process now dies of the signal, silently; called as a function, `main` puts the caller's handler back."
    import signal
    import proton.cli as cli
    path = tmp_path / "c.npz"
    EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=30, n_per_shift=10).save(path)
    code = ("import atexit, os, signal, sys\nfrom proton.cli import main\n"
            "def ctrl_c(): os.kill(os.getpid(), signal.SIGINT); print('survived', file=sys.stderr)\n"
            "atexit.register(ctrl_c)\nsys.exit(main())")  # registered first, so run last: at the end of the shutdown
    r = subprocess.run([sys.executable, "-c", code, "info", str(path)], capture_output=True, text=True, timeout=600)
    assert (r.returncode, r.stderr) == (-signal.SIGINT, ""), (r.returncode, r.stderr)
    assert "sha256:" in r.stdout  # the work was done
    before = signal.getsignal(signal.SIGINT)
    assert cli.main(["info", str(path)]) == 0
    assert signal.getsignal(signal.SIGINT) is before


def test_a_path_that_is_not_utf8_is_printed_escaped_by_every_command(tmp_path):
    "evaluate wrote its files into a folder named in another encoding, then failed printing that name under a strict UTF-8 stdout: exit 1."
    cache = tmp_path / "c.npz"
    EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=60, n_per_shift=30).save(cache)
    odd = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9")); odd.mkdir()
    exe = shutil.which("proton-ood") or str(Path(sys.executable).parent / "proton-ood")
    r = subprocess.run([exe, "evaluate", str(cache), "--out", str(odd / "e.csv"), "--permutations", "1", "--no-progress"],
                       capture_output=True, env=dict(os.environ, PYTHONIOENCODING="utf-8"), timeout=600)
    assert r.returncode == 0, r.stderr.decode(errors="backslashreplace")
    assert b"caf\\udce9" in r.stdout, r.stdout


def test_figure1_on_a_cache_of_identical_embeddings_warns_and_writes_its_tables(tmp_path):
    "t-SNE of images that do not differ crashed the process (SIGSEGV in sklearn): the map puts them at one point, with a warning, and every table is written."
    import numpy as np
    T = np.random.default_rng(0).normal(size=(3, 16)).astype(np.float32)
    shift = np.array(["id"] * 60 + ["semantic"] * 20 + ["covariate"] * 20 + ["far"] * 20)
    EmbeddingCache(image_embeddings=np.tile(T[0] + 0.1, (120, 1)), text_embeddings=T, class_names=["a", "b", "c"], labels=np.where(shift == "id", 0, -1),
                   shift=shift, temperature=0.01, metadata=dict(model="m")).save(tmp_path / "same.npz")
    r = run("evaluate", str(tmp_path / "same.npz"), "--out", str(tmp_path / "r.csv"), "--experiments", "figure1", "--no-progress")
    assert r.returncode == 0, (r.returncode, r.stderr[-500:])
    assert "the mapped images all have the same embedding" in r.stderr
    tsne = next(tmp_path.glob("r*tsne*.csv"))
    assert set(np.loadtxt(tsne, delimiter=",", skiprows=1, usecols=(0, 1)).ravel()) == {0.0}


def test_an_error_that_a_ctrl_c_caused_is_reported_as_the_ctrl_c(monkeypatch, capsys):
    "A Ctrl-C during an import can surface as another error (numpy: 'cannot load module more than once per process'): exit 1 with that error, not 130."
    import signal
    import proton.cli as cli
    def info(argv):
        try: os.kill(os.getpid(), signal.SIGINT); time.sleep(1)
        except KeyboardInterrupt: raise ImportError("cannot load module more than once per process") from None
    import time
    monkeypatch.setattr(cli, "info_main", info)
    assert cli.main(["info", "c.npz"]) == 130
    assert capsys.readouterr().err == "proton-ood info: interrupted\n"


def without(blocked, *args):
    "`proton-ood ARGS` in a process where the modules `blocked` cannot be imported, as on an install without the extra that brings them."
    code = f"import sys\nfor m in {list(blocked)!r}: sys.modules[m] = None\nfrom proton.cli import main\nsys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)


EXTRAS = ("PIL", "open_clip", "transformers", "torchvision", "safetensors", "pandas", "matplotlib", "seaborn", "pydicom", "h5py", "pooch", "pytorch_ood", "skimage")


@pytest.mark.parametrize("command", ["evaluate", "extract", "score", "reproduce", "info"])
def test_every_command_shows_its_help_on_a_core_install(command):
    r = without(EXTRAS, command, "--help")
    assert r.returncode == 0 and r.stdout.startswith(f"usage: proton-ood {command}"), r.stderr


def test_a_cache_is_scored_on_a_core_install_and_an_image_folder_names_the_extra(tmp_path):
    path = tmp_path / "c.npz"
    EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=30, n_per_shift=10).save(path)
    r = without(EXTRAS, "score", str(path), "--out", str(tmp_path / "s.csv"), "--no-progress")
    assert r.returncode == 0 and len((tmp_path / "s.csv").read_text().splitlines()) == 61, r.stderr
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    r = without(EXTRAS, "score", str(tmp_path / "images"), "--model", "open_clip:ViT-S-32/none", "--classes", "a,b", "--out", str(tmp_path / "t.csv"), "--no-progress")
    assert one_line_error(r) and 'pip install "proton-ood[vlm]"' in r.stderr, r.stderr


@pytest.mark.parametrize("missing", ["pandas", "matplotlib"])
def test_reproduce_names_the_plot_extra_before_any_extraction(tmp_path, missing):
    (tmp_path / "data" / "ophthalmology").mkdir(parents=True)
    r = without([missing], "reproduce", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "report"), "--model", "open_clip:ViT-S-32/none", "--no-progress")
    assert one_line_error(r) and 'pip install "proton-ood[plot]"' in r.stderr, r.stderr
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize("args", [["--deb", "score"], ["--", "score"], ["--debug", "--debug", "score"], ["--deb", "evaluate"]])
def test_a_line_argparse_takes_without_a_command_up_front_is_a_usage_error_not_info(args):
    "argparse took '--deb' for --debug and '--' as the end of options: main found no command at argv[0] and ran `info score`, which said 'No such file or directory: score'."
    r = run(*args)
    assert r.returncode == 2 and "give the command first" in r.stderr and "Traceback" not in r.stderr and "No such file" not in r.stderr, r.stderr


def test_a_missing_checkpoint_or_tokenizer_is_named_by_its_option(tmp_path):
    "FLAIR's and UniMed-CLIP's messages said 'pass checkpoint=' and 'pass tokenizer=', the Python arguments, to a command-line user."
    import numpy as np
    from PIL import Image
    (tmp_path / "in").mkdir()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "in" / "a.png")
    (tmp_path / "vocab").mkdir()
    (tmp_path / "vocab" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]) + "\n")
    for extra, option in ((["--tokenizer", str(tmp_path / "vocab")], "checkpoint"), (["--checkpoint", "none"], "tokenizer")):
        r = run("score", str(tmp_path / "in"), "--out", str(tmp_path / "r.csv"), "--classes", "a,b", "--model", "unimed", "--no-progress", *extra)
        assert r.returncode == 1 and f"pass {option}= (--{option})" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_score_help_states_its_defaults():
    "evaluate's and extract's --help named their defaults; score's named none (γ, M, K_min, W, q, k, h, chunk and batch sizes)."
    out = " ".join(run("score", "--help").stdout.split()).split(" options: ", 1)[1]  # past the usage line
    for option, default in (("--gamma", "0.7"), ("--bank-size", "100"), ("--k-min", "5"), ("--warmup", "200"), ("--id-recall", "0.95"),
                            ("--drift-k", "0.5"), ("--drift-h", "5.0"), ("--chunk-size", "256"), ("--batch-size", "32")):
        described = out.split(f"{option} ", 1)[1].split(" --", 1)[0]
        assert f"(default {default})" in described, (option, described)
