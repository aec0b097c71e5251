"""The first thing a data script does when run as a command: until its work starts (``common.command``), Ctrl-C ends it in
one line and exit status 130, as during the work, rather than with a traceback from inside the imports (torch takes
seconds to load). Standard library only, so that it is in place before anything heavy loads."""
import signal
import sys
from pathlib import Path


def interrupted(signum, frame):
    """Ctrl-C while the script loads: nothing is written yet, so it ends here."""
    print(f"{Path(sys.argv[0]).name}: interrupted", file=sys.stderr)
    raise SystemExit(130)


def guard():
    """Handle Ctrl-C as ``interrupted`` until ``common.command`` hands it back to Python."""
    signal.signal(signal.SIGINT, interrupted)
