"""A real terminal for tests: a detached tmux session of 80 x 24, and whether words stand whole
in what it shows."""

from __future__ import annotations

import re
import subprocess
import time
import uuid


def whole_on_a_line(word: str, lines: list[str]) -> bool:
    """The word stands whole (between spaces or line ends) on one of the lines."""
    pattern = re.compile(rf"(?<!\S){re.escape(word)}(?!\S)")
    return any(pattern.search(line) for line in lines)


def broken(words: set[str], lines: list[str]) -> list[str]:
    """The words that stand whole on no line."""
    return sorted(word for word in words if not whole_on_a_line(word, lines))


class Pane:
    """Detached tmux sessions of 80 x 24 on a server of its own (its own socket name)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.server = f"pane-test-{uuid.uuid4().hex[:8]}"
        self.env = env
        self.sessions = 0

    def tmux(self, *args: str) -> str:
        done = subprocess.run(["tmux", "-L", self.server, "-f", "/dev/null", *args], env=self.env,
                              capture_output=True, text=True, timeout=30, check=False)
        if done.returncode != 0:
            raise AssertionError(f"tmux {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def run(self, *commands: str, timeout_s: float = 60) -> list[str]:
        """Run the shell commands in a fresh 80 x 24 session; the whole screen and scrollback,
        lines the terminal wrapped joined again (-J), so only breaks the program wrote remain."""
        script = "; ".join([*commands, "echo __done__", "sleep 600"])
        # Each run gets a session of its own, and finished ones stay until close(): a server whose
        # last session ends exits, and a new session started while it is exiting fails.
        self.sessions += 1
        session = f"pane{self.sessions}"
        self.tmux("new-session", "-d", "-x", "80", "-y", "24", "-s", session, script)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            screen = self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", session)
            if "__done__" in screen:
                return screen.splitlines()
            time.sleep(0.2)
        raise AssertionError(f"the commands did not finish in {timeout_s:.0f} s: {screen}")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.server, "kill-server"], env=self.env, capture_output=True, timeout=30,
                       check=False)
