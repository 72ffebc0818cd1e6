"""``libdsec.gym.check_desktop_action`` and ``DesktopActions``: each bad action named by its field."""

from __future__ import annotations

import pytest

from libdsec import InvalidRequest
from libdsec.gym import DesktopActions, check_desktop_action

W, H = 640, 480


@pytest.mark.parametrize("action", [
    {"action": "click", "x": 0, "y": 0}, {"action": "click"}, {"action": "click", "x": 639, "y": 479, "button": "right",
                                                                 "count": 2},
    {"action": "type", "text": "hi\n"}, {"action": "press", "keys": "ctrl+s"}, {"action": "scroll", "dy": -3},
    {"action": "drag", "x": 1, "y": 2, "to_x": 3, "to_y": 4}, {"action": "wait", "seconds": 0.5}, {"action": "done"},
])
def test_good_actions_pass(action):
    assert check_desktop_action(action, W, H) is action
    assert DesktopActions(W, H).contains(action)


@pytest.mark.parametrize("action, message", [
    ("click", "a desktop action is a dict"),
    ({"x": 1}, "action: None is not one of"),
    ({"action": "jump"}, "action: 'jump' is not one of"),
    ({"action": "click", "x": W, "y": 0}, f"x: {W} is outside the {W}x{H} screen"),
    ({"action": "click", "x": 0, "y": -1}, f"y: -1 is outside the {W}x{H} screen"),
    ({"action": "click", "x": 3}, "y: give both x and y"),
    ({"action": "click", "x": 1.5, "y": 1}, "x: 1.5 is not int"),
    ({"action": "click", "x": True, "y": 1}, "x: True is not int"),
    ({"action": "type"}, "text: 'type' needs it"),
    ({"action": "type", "text": ""}, "text: empty"),
    ({"action": "press", "keys": 5}, "keys: 5 is not str"),
    ({"action": "scroll"}, "dy: a scroll needs dy or dx"),
    ({"action": "drag", "x": 1, "y": 1, "to_x": 2, "to_y": H}, f"to_y: {H} is outside"),
    ({"action": "wait", "seconds": 61}, "seconds: 61 is outside 0-60"),
    ({"action": "done", "reason": "x"}, "reason: not a field of 'done'"),
])
def test_bad_actions_name_their_field(action, message):
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(")):
        check_desktop_action(action, W, H)
    assert not DesktopActions(W, H).contains(action)


def test_samples_are_valid_actions():
    space = DesktopActions(W, H, seed=7)
    samples = [space.sample() for _ in range(200)]
    assert all(space.contains(s) for s in samples)
    assert {s["action"] for s in samples} == {"click", "scroll", "wait"}
