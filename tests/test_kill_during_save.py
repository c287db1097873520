"""kill -9 during a save never leaves a broken profile: the file is always the old version or the new one.

A writer process saves the same profile over and over (each version's notes carry its number at both
ends, and are large enough that a write takes a while) and says when each save has returned; the test
kills it after a different number of saves each time, at a random moment of the next one, and reads the
file after each kill. Counting saves, not seconds, keeps the kills spread on a slow disk too."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from app.profiles import Profile, ProfileStore, save_last_used
    from engine.settings import EngineSettings
    store = ProfileStore(Path({dir!r}), shipped_dir=None)
    i = 0
    print("ready", flush=True)
    while True:
        i += 1
        notes = f"<{{i}}>" + "x" * 400_000 + f"</{{i}}>"
        store.save(Profile(name="soak", notes=notes, settings=EngineSettings(draft_depth=1 + i % 16)))
        save_last_used(EngineSettings(draft_depth=1 + i % 16), notes=notes)
        print(f"saved {{i}}", flush=True)
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_kill_minus_nine_during_saves_leaves_a_whole_file(tmp_path):
    from app.profiles import ProfileStore, load_last_used

    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, SPECDECK_CONFIG_DIR=str(tmp_path / "config"))
    rng = random.Random(1)
    store_dir = tmp_path / "profiles"
    seen_versions = set()
    for attempt in range(8):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER.format(root=root, dir=str(store_dir))],
            stdout=subprocess.PIPE,
            env=env,
        )
        assert proc.stdout.readline().strip() == b"ready"
        completed = attempt % 4  # saves that returned before the kill
        for i in range(1, completed + 1):
            assert proc.stdout.readline().strip() == f"saved {i}".encode()
        time.sleep(rng.uniform(0.0, 0.3))  # then somewhere in the next save (or the one after)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        profiles, problems = ProfileStore(store_dir, shipped_dir=None).list()
        assert problems == []
        if not profiles:  # killed before the first save finished: no file, which is fine
            continue
        (p,) = profiles
        head = p.notes[: p.notes.index(">") + 1]
        assert p.notes.endswith("</" + head[1:])  # one whole version, not a mix
        version = int(head[1:-1])
        assert p.settings.draft_depth == 1 + version % 16
        assert version >= completed  # a save that returned is never undone by a kill
        seen_versions.add(head)
        previous = os.environ.get("SPECDECK_CONFIG_DIR")
        os.environ["SPECDECK_CONFIG_DIR"] = env["SPECDECK_CONFIG_DIR"]
        try:
            settings, problem = load_last_used()
        finally:  # back to the session's temp dir (conftest), never to the user's own
            if previous is None:
                del os.environ["SPECDECK_CONFIG_DIR"]
            else:
                os.environ["SPECDECK_CONFIG_DIR"] = previous
        assert problem is None
    assert len(seen_versions) >= 2  # the kills landed at different points of the write loop
