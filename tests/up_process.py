"""``meshserve up`` run as a person runs it: its own process (and session), its console
written to a file the tests read, stopped by Ctrl-C or killed with everything under it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class UpProcess:
    def __init__(self, args: list[str], cwd: Path) -> None:
        self.out = cwd / f"up-{time.monotonic_ns()}.out"
        self._file = open(self.out, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "up", "--state-dir", str(cwd / ".meshserve"), *args],
            stdout=self._file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "COLUMNS": "200"},
        )

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_for(self, needle: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.text()
            if needle in text:
                return text
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{needle!r} not printed (exit {self.proc.poll()}):\n{self.text()}")

    def interrupt(self, timeout: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(timeout)
        self._file.close()
        return code

    def finish(self, timeout: float = 60.0) -> int:
        code = self.proc.wait(timeout)
        self._file.close()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._file.close()
