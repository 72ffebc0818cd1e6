"""``libdsec.gym.DesktopEnv`` against a real ``dsec serve`` and a real desktop: gymnasium's own env
checker, every episode from the same snapshot of a ready desktop, actions through the desktop,
bad actions named by their field, the reward from the grader in a clean copy."""

from __future__ import annotations

import numpy
import pytest
from gymnasium.utils.env_checker import check_env

from libdsec import DesktopSpec, InvalidRequest, SnapshotNotFound, SyncDSecClient
from libdsec.gym import DesktopEnv, DesktopTask

pytestmark = [pytest.mark.slow, pytest.mark.root]

W, H = 640, 480
TASK = DesktopTask(
    instruction="type 'hello' into the editor and save it (ctrl+s), then done",
    setup=": > /home/user/note.txt", launch=("org.xfce.mousepad /home/user/note.txt",),
    grader='test "$(cat /home/user/note.txt)" = hello', keep=["/home/user"], max_steps=6,
    desktop=DesktopSpec(width=W, height=H, session="wm"), run_args={"memory_limit_mb": 1024})


def test_desktop_env(server, desktop_image, no_sandbox_outlives_the_test):
    with SyncDSecClient(server.endpoint, token=server.token) as client:
        env = DesktopEnv(client, image=desktop_image, task=TASK, snapshot="desktop-env-test", a11y=True)
        try:
            check_env(env, skip_render_check=True)
            obs, info = env.reset(seed=1)
            assert obs["screen"].shape == (H, W, 3) and obs["screen"].dtype == numpy.uint8
            assert info["snapshot"] == "desktop-env-test" and 'mousepad' in obs["accessibility_tree"]
            first = obs["screen"]
            # The editor opened the note? type into it through actions, save, done: solved.
            windows = env._run(env.sandbox.desktop.windows())
            editor = next(w for w in windows if w.app.lower() == "mousepad")
            env.step({"action": "click", "x": editor.x + editor.width // 2, "y": editor.y + editor.height // 2})
            obs, reward, *_ = env.step({"action": "type", "text": "hello"})
            assert reward == 0.0 and not numpy.array_equal(obs["screen"], first)  # the text is on the screen
            assert 'text="hello"' in obs["accessibility_tree"]
            env.step({"action": "press", "keys": "ctrl+s"})
            env.step({"action": "wait", "seconds": 0.5})
            _, reward, terminated, truncated, info = env.step({"action": "done"})
            assert (reward, terminated, truncated, info["solved"]) == (1.0, True, False, True)

            # The next episode starts from the same desktop: the note empty again, the same screen.
            obs, _ = env.reset()
            assert numpy.array_equal(obs["screen"], first)
            assert env._run(env.sandbox.read_file("/home/user/note.txt")) == b""
            # Bad actions: each refused naming its field, the episode goes on.
            bad = {
                "action": ({"action": "jump"}, "action: 'jump' is not one of"),
                "x": ({"action": "click", "x": W, "y": 1}, f"x: {W} is outside the {W}x{H} screen"),
                "y": ({"action": "click", "x": 1}, "y: give both x and y"),
                "text": ({"action": "type"}, "text: 'type' needs it"),
                "keys": ({"action": "press", "keys": 5}, "keys: 5 is not str"),
                "seconds": ({"action": "wait", "seconds": 600}, "seconds: 600 is outside"),
                "speed": ({"action": "drag", "x": 1, "y": 1, "to_x": 2, "to_y": 2, "speed": 3}, "speed: not a field"),
                "dict": ("click", "a desktop action is a dict"),
            }
            for field, (action, message) in bad.items():
                with pytest.raises(InvalidRequest, match=message.replace("(", r"\(")):
                    env.step(action)
            assert not env.action_space.contains({"action": "click", "x": -1, "y": 0})
            # Out of steps: truncated, graded all the same (unsolved).
            for _ in range(TASK.max_steps - 1):
                assert env.step({"action": "wait", "seconds": 0})[3] is False
            _, reward, terminated, truncated, info = env.step({"action": "wait", "seconds": 0})
            assert (terminated, truncated, reward, info["solved"]) == (False, True, 0.0, False)
        finally:
            env.close()
        # The snapshot the env made is gone with it.
        with pytest.raises(SnapshotNotFound):
            client.get_snapshot("desktop-env-test")
