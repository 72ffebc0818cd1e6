"""``dsec serve`` raises its open-file limit (a sandbox holds one open file on the server, its
init channel), and says so when the host's hard limit keeps it lower."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

PROBE = """
import json, resource, sys
from dsec.node import raise_nofile
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
note = raise_nofile(wanted=int(sys.argv[1]))
print(json.dumps([*resource.getrlimit(resource.RLIMIT_NOFILE), note]))
"""


def _raise(wanted: int) -> tuple[int, int, str | None]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(wanted)], capture_output=True, text=True, check=True,
                         env=os.environ)
    return tuple(json.loads(out.stdout))


def test_soft_limit_goes_up_to_what_is_wanted() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    soft_after, hard_after, note = _raise(min(hard, 4096))
    assert soft_after >= min(hard, 4096) and hard_after == hard and note is None


def test_past_the_hard_limit_it_is_raised_or_said() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nr_open = int(open("/proc/sys/fs/nr_open").read())
    if hard == resource.RLIM_INFINITY or hard >= nr_open:
        return  # nothing above the hard limit to ask for here
    wanted = min(nr_open, hard + 1024)
    soft_after, hard_after, note = _raise(wanted)
    if hard_after >= wanted:  # CAP_SYS_RESOURCE: raised
        assert soft_after == hard_after and note is None
    else:  # kept at the hard limit, and the log says how many sandboxes that allows
        assert soft_after == hard_after == hard and note and f"{hard:,}" in note and "LimitNOFILE" in note
