"""Every test here, and every LMCache process they start, runs with LMCache's usage telemetry
off (LMCache reports to a server of its own unless told not to, and tests talk to loopback
only) and without its start-up banner. The helpers the test modules share
(``lmcache_support``) are importable from this directory."""

import os
import sys
from pathlib import Path

for name, value in {
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "LMCACHE_DISABLE_BANNER": "1",
}.items():
    os.environ[name] = value

# pytest imports test modules with --import-mode=importlib, which puts no test directory on
# sys.path; the shared helpers are a plain module of this one.
sys.path.insert(0, str(Path(__file__).parent))
