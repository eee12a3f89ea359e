"""Start N judge servers as child processes for a run, or adopt running ones.

>>> with JudgePool("runs/judge", n=2) as pool:          # doctest: +SKIP
...     reward = GenRMReward(JudgeClient(pool.urls))

Each child is ``python -m mmyatt.serving.server MODEL_DIR --host 127.0.0.1 --port 0``
(``backend="vllm"``: ``vllm serve``, :mod:`mmyatt.engines.vllm_judge`); it writes the
port it bound to a file, then the pool waits for ``GET /health``, or raises an error
quoting the end of the log of a child that exits or stays unhealthy for
``startup_timeout_s``. ``devices`` sets ``CUDA_VISIBLE_DEVICES`` per server (round
robin). The API key travels in the environment (``MMYATT_GENRM_API_KEY``), never on the
command line that ``ps`` shows. Children exit when the process that started them dies.

A watcher thread restarts a child that exits while the pool runs on the same port, so
that the controllers' URLs stay valid and their clients' retries find it back, at most
``max_restarts`` times per server (``restarts``, ``events``); then the clients' retry
budget decides. ``JudgePool.external(urls)`` adopts servers started elsewhere after a
health check; ``stop()`` leaves those be.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx2

from mmyatt.distributed import free_port
from mmyatt.engines.vllm_judge import vllm_judge_child
from mmyatt.serving import API_KEY_ENV
from mmyatt.serving.client import server_root

logger = logging.getLogger(__name__)


class JudgePoolError(RuntimeError):
    """A judge server did not start, or an external one is not healthy."""


def check_health(url: str, timeout_s: float = 2.0) -> bool:
    """True when ``GET url/health`` answers 200 (vLLM's /health answers with no body)."""
    try:
        return httpx2.get(server_root(url) + "/health", timeout=timeout_s).status_code == 200
    except (httpx2.HTTPError, ValueError):
        return False


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class JudgePool:
    """N judge servers on loopback; see the module docstring."""

    def __init__(
        self,
        model_dir: str | Path | None,
        n: int = 1,
        *,
        base_port: int | None = None,
        api_key: str | None = None,
        devices: Sequence[str | int] | None = None,
        startup_timeout_s: float = 120.0,
        max_batch: int = 32,
        batch_wait_ms: float = 5.0,
        threads: int | None = None,
        log_dir: str | Path | None = None,
        settle: bool = False,
        max_restarts: int = 3,
        backend: str = "mmyatt",
        vllm_args: Sequence[str] = (),
        watch_interval_s: float = 0.5,
    ):
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.urls: list[str] = []
        self.processes: list[subprocess.Popen] = []
        self.log_paths: list[Path] = []
        self.max_restarts = int(max_restarts)
        self.restarts = [0] * n
        self.events: list[str] = []
        self._api_key = api_key
        self._given_up: set[int] = set()
        self._commands: list[list[str]] = []
        self._envs: list[dict] = []
        self._stopping = threading.Event()
        self._spawn_lock = threading.Lock()  # a restart and stop() never interleave
        self._watcher: threading.Thread | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        if model_dir is None:
            return  # JudgePool.external
        if n < 1:
            raise ValueError(f"a judge pool needs n >= 1 servers, got {n}")
        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"no judge model directory at {str(model_dir)!r}")
        self._tmp = tempfile.TemporaryDirectory(prefix="mmyatt-judges-")
        work = Path(self._tmp.name)
        logs = Path(log_dir) if log_dir is not None else work
        logs.mkdir(parents=True, exist_ok=True)
        port_files = [work / f"port{i}" for i in range(n)]
        options = [f"--max-batch={max_batch}", f"--batch-wait-ms={batch_wait_ms}"]
        options += [f"--threads={threads}"] if threads else []
        # placement releases this judge between phases: its full collection at start
        options += ["--settle"] if settle else []
        try:
            for i, port_file in enumerate(port_files):
                port = base_port + i if base_port is not None else 0
                env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
                if devices:
                    env["CUDA_VISIBLE_DEVICES"] = str(devices[i % len(devices)])
                if backend == "vllm":
                    port = port or free_port()  # vllm serve cannot report the port it bound
                    cmd, env = vllm_judge_child(
                        model_dir, port, port_file, env, api_key, max_batch, vllm_args
                    )
                else:
                    cmd = [sys.executable, "-m", "mmyatt.serving.server", str(model_dir)]
                    cmd += ["--host", "127.0.0.1", "--port", str(port), *options]
                    cmd += [f"--port-file={port_file}", f"--parent-pid={os.getpid()}"]
                    if api_key:
                        env[API_KEY_ENV] = api_key
                self._commands.append(cmd)
                self._envs.append(env)
                self.log_paths.append(logs / f"judge{i}.log")
                self.processes.append(self._spawn(i, append=False))
            self._wait_ready(port_files, startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self._watch_interval_s = float(watch_interval_s)
        self._watcher = threading.Thread(target=self._watch, name="judge-pool-watch", daemon=True)
        self._watcher.start()

    def _spawn(self, i: int, *, append: bool) -> subprocess.Popen:
        with open(self.log_paths[i], "ab" if append else "wb") as log:
            return subprocess.Popen(
                self._commands[i],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._envs[i],
            )

    def _watch(self) -> None:
        """Restart children that exit while the pool runs (see the module docstring)."""
        while not self._stopping.wait(self._watch_interval_s):
            with self._spawn_lock:
                if self._stopping.is_set():
                    return
                for i, proc in enumerate(self.processes):
                    if proc.poll() is not None:
                        self._restart(i, proc.returncode)

    def _restart(self, i: int, code: int) -> None:
        if self.restarts[i] >= self.max_restarts:
            if i not in self._given_up:  # said once
                self._given_up.add(i)
                self._event(
                    f"judge server {i} ({self.urls[i]}) exited with code {code}; restart "
                    f"budget of {self.max_restarts} used up, it stays down; log {self.log_paths[i]}"
                )
            return
        self.restarts[i] += 1
        self._event(
            f"judge server {i} ({self.urls[i]}) exited with code {code}; restarting it on "
            f"the same port ({self.restarts[i]}/{self.max_restarts})"
        )
        try:
            self.processes[i] = self._spawn(i, append=True)
        except OSError as error:
            self._event(f"judge server {i}: restart failed: {error}")

    def _event(self, text: str) -> None:
        self.events.append(text)
        logger.warning("[judge] %s", text)

    def wait_healthy(self, timeout_s: float = 60.0) -> bool:
        """Block until every server answers ``/health`` (e.g. after a restart)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(check_health(u, 1.0) for u in self.urls):
                return True
            time.sleep(0.1)
        return False

    def _wait_ready(self, port_files: list[Path], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        urls: list[str | None] = [None] * len(self.processes)
        while not all(u is not None and check_health(u, 1.0) for u in urls):
            for i, proc in enumerate(self.processes):
                if proc.poll() is not None:
                    raise JudgePoolError(
                        f"judge server {i} exited with code {proc.returncode} while starting; "
                        f"log {self.log_paths[i]}:\n{_tail(self.log_paths[i])}"
                    )
                if urls[i] is None and port_files[i].is_file():
                    urls[i] = f"http://127.0.0.1:{int(port_files[i].read_text())}"
            if time.monotonic() > deadline:
                waiting = [i for i, u in enumerate(urls) if u is None or not check_health(u)]
                raise JudgePoolError(
                    f"judge servers {waiting} not healthy after {timeout_s:g} s; log "
                    f"{self.log_paths[waiting[0]]}:\n{_tail(self.log_paths[waiting[0]])}"
                )
            time.sleep(0.1)
        self.urls = list(urls)
        for cmd, url in zip(self._commands, self.urls):  # a restart keeps the port
            cmd[cmd.index("--port") + 1] = url.rsplit(":", 1)[1]

    @classmethod
    def external(cls, urls: Sequence[str], *, timeout_s: float = 10.0) -> JudgePool:
        """Adopt servers started elsewhere after checking ``/health`` on each."""
        if not urls:
            raise ValueError("JudgePool.external needs at least one URL")
        pool = cls(None)
        deadline = time.monotonic() + timeout_s
        pending = list(urls)
        while pending := [u for u in pending if not check_health(u, 2.0)]:
            if time.monotonic() > deadline:
                raise JudgePoolError(f"judge servers not healthy after {timeout_s:g} s: {pending}")
            time.sleep(0.2)
        pool.urls = [u.rstrip("/") for u in urls]
        return pool

    def stats(self) -> list[dict]:
        """``/stats`` of each embedded server (an empty dict for a server without it)."""
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        out = []
        for url in self.urls:
            try:
                response = httpx2.get(f"{url}/stats", headers=headers, timeout=2.0)
                out.append(response.json() if response.status_code == 200 else {})
            except (httpx2.HTTPError, ValueError):
                out.append({})
        return out

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the children (SIGTERM), then kill any still running."""
        self._stopping.set()
        with self._spawn_lock:  # no restart after this point
            if self._watcher is not None and self._watcher is not threading.current_thread():
                self._watcher, watcher = None, self._watcher
            else:
                watcher = None
        if watcher is not None:
            watcher.join(timeout=5)
        for proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.processes = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> JudgePool:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
