"""A user's mistake, found by whichever process finds it, as one line and exit code 2.

Mistakes in the config, the data or the files the user named are not bugs: they get one
line naming the file, line or key, never a traceback (``--debug`` shows it). Most are
found before any controller starts. One found inside a controller (a record that only
that controller reads) must not turn into every other controller's "Connection closed by
peer" traceback and the launcher's failure box, so the controller that finds it:

1. writes its line to ``<run dir>/controller_error.txt`` (the first one wins),
2. waits a moment, during which every other controller, polling for that file, leaves
   quietly (exit 0: nothing for the launcher to report or restart),
3. leaves quietly itself;

and the launching process, once its controllers are gone, prints the line and exits 2.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from mmyatt.config.schema import ConfigError
from mmyatt.datasets.manifest import ManifestError
from mmyatt.datasets.media import MediaError
from mmyatt.outputs.run_identity import RunDirError

ERROR_FILE = "controller_error.txt"
POLL_S = 0.2  # how often a controller looks for a peer's error
GRACE_S = 2.0  # how long the controller that found it waits for the others to leave


class ControllerUserError(Exception):
    """A user's mistake a controller found and reported; the message is its line."""


def user_error_line(error: BaseException) -> str | None:
    """One line for an error the user caused (config, data, files, run directory), else
    None (a bug: its traceback stays)."""
    if isinstance(error, ControllerUserError):
        return str(error)
    if isinstance(error, ConfigError):
        return f"config error: {error}"
    if isinstance(error, (ManifestError, MediaError)):
        return f"data error: {error}"
    if isinstance(error, RunDirError):
        return f"run directory: {error}"
    if isinstance(error, FileNotFoundError):
        if error.filename is not None:
            return f"file not found: {error.filename} ({error.strerror})"
        return f"file not found: {error}"
    return None


def debugging() -> bool:
    """``--debug`` was given (controllers inherit it through the environment)."""
    return os.environ.get("MMYATT_DEBUG") == "1"


class PeerErrors:
    """One controller's side of the protocol above, for the run directory ``run_dir``."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / ERROR_FILE
        self.reported = False

    def watch(self) -> None:
        """Leave quietly (exit 0) as soon as another controller reports an error."""
        threading.Thread(target=self._poll, daemon=True, name="peer-errors").start()

    def _poll(self) -> None:
        while not self.path.exists() or self.reported:
            time.sleep(POLL_S)
        self.leave()

    def report(self, error: BaseException) -> bool:
        """Write the line of a user's mistake for the launcher and give the other
        controllers time to leave; False (nothing written) for a bug or under --debug."""
        line = user_error_line(error)
        if line is None or debugging():
            return False
        self.reported = True
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:  # another controller's error came first
            return True
        with os.fdopen(fd, "w") as f:
            f.write(line + "\n")
        time.sleep(GRACE_S)
        return True

    def peer_reported(self) -> bool:
        return self.path.exists()

    @staticmethod
    def leave() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def clear(run_dir: str | os.PathLike) -> None:
    """Forget a previous run's error (the launcher, before controllers start)."""
    (Path(run_dir) / ERROR_FILE).unlink(missing_ok=True)


def take(run_dir: str | os.PathLike) -> str | None:
    """The line a controller reported, removed from the run directory; None if none."""
    path = Path(run_dir) / ERROR_FILE
    if not path.exists():
        return None
    line = path.read_text().strip()
    path.unlink(missing_ok=True)
    return line
