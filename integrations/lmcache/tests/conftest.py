"""Every test here, and every LMCache process they start, runs with LMCache's usage telemetry
off (LMCache reports to a server of its own unless told not to, and tests talk to loopback
only) and without its start-up banner."""

import os

for name, value in {
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "LMCACHE_DISABLE_BANNER": "1",
}.items():
    os.environ[name] = value
