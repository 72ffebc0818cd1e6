"""The keys of desktops' live views (``dsec.apiserver.streams.StreamKeys``): made for one sandbox
and project, refused altered, expired, for another sandbox or under another root token."""

from __future__ import annotations

import time
from urllib.parse import parse_qs, urlsplit

import pytest

from libdsec import Unauthenticated

from dsec.apiserver.streams import StreamKeys

SANDBOX, OTHER = "n0-0123456789abcdef", "n0-fedcba9876543210"


def _key(path: str) -> str:
    return path.split("/desktop/stream/", 1)[1].split("/", 1)[0]


def test_a_key_opens_its_sandbox_for_its_project():
    keys = StreamKeys("root-token")
    stream = keys.stream(SANDBOX, "team/a", ttl_s=60)
    assert stream.path.startswith(f"/v1/sandboxes/{SANDBOX}/desktop/stream/") and time.time() < stream.expires_at
    # noVNC's page connects by itself, its WebSocket under the same key.
    url = urlsplit(stream.path)
    assert url.path.endswith("/vnc.html")
    query = parse_qs(url.query)
    assert query["autoconnect"] == ["1"] and query["path"] == [f"v1/sandboxes/{SANDBOX}/desktop/stream/"
                                                              f"{_key(stream.path)}/websockify"]
    assert keys.check(SANDBOX, _key(stream.path)) == "team/a"


def test_every_other_key_is_refused_naming_why():
    keys = StreamKeys("root-token")
    key = _key(keys.stream(SANDBOX, "team-a", ttl_s=60).path)
    expires, name, mac = key.split(".")
    with pytest.raises(Unauthenticated, match="this path has none"):
        keys.check(SANDBOX, "vnc.html")
    for wrong in (f"{expires}.{name}.{'0' * len(mac)}", f"{int(expires) + 1}.{name}.{mac}", f"{key}.x",
                  f"{expires}.{'dGVhbS1i'}.{mac}"):  # altered: the MAC, the expiry, its form, the project
        with pytest.raises(Unauthenticated, match="this one is not it"):
            keys.check(SANDBOX, wrong)
    with pytest.raises(Unauthenticated, match="this one is not it"):
        keys.check(OTHER, key)  # another sandbox's
    with pytest.raises(Unauthenticated, match="this one is not it"):
        StreamKeys("another-root-token").check(SANDBOX, key)  # another cluster's
    stale = _key(keys.stream(SANDBOX, "team-a", ttl_s=0.001).path)
    time.sleep(1.1)
    with pytest.raises(Unauthenticated, match="expired"):
        keys.check(SANDBOX, stale)
