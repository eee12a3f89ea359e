"""The embedded GenRM judge server: an OpenAI-compatible chat-completions subset.

``mmyatt serve-genrm MODEL_DIR --host 127.0.0.1 --port 8000 [--api-key K]
[--served-model-name NAME] [--max-batch 32] [--batch-wait-ms 5] [--threads N]
[--keep-warm-ms 0]`` (or
``python -m mmyatt.rewards.judge_server ...``) serves a local judge model so that
controllers can call it over HTTP exactly as they would call ``vllm serve``:

=================================  ==========================================================
``GET /health``                    200 ``{"status": "ok", "model": NAME}`` (no key needed, as
                                   in vLLM, so that liveness probes work)
``GET /v1/models``                 the one served model, OpenAI list format
``POST /v1/chat/completions``      ``model``, ``messages`` (text parts and ``image_url`` parts
                                   holding ``data:`` URLs), ``max_tokens``, ``temperature``,
                                   ``logprobs``, ``top_logprobs``, ``n``, ``seed``
``GET /stats``                     batching and timing counters (needs the key when one is set)
``POST /sleep``, ``/wake_up``      drop / reload the weights between judge phases (placement)
=================================  ==========================================================

With ``max_tokens=1, logprobs=true, top_logprobs=k`` a response carries the top-k
next-token distribution after the assistant generation prompt, which is what a
``yes_prob`` GenRM needs (one forward pass). Longer ``max_tokens`` generate text (the
``score`` mode). Per-token logprobs of generated text are only available with
``max_tokens=1``: the judge model API returns no token strings for generated text,
so a longer request that asks for logprobs is refused (400) rather than answered
with made-up token strings.

The layers: :mod:`mmyatt.rewards.judge_api` (FastAPI app, pydantic request models,
OpenAI error bodies, key and body-size checks) served by uvicorn;
:mod:`mmyatt.rewards.judge_batcher` (dynamic batching on a worker thread); the judge
models in :mod:`mmyatt.models.judge`. Every response reports the model time of the call
that served it in the ``x-mmyatt-model-time-ms`` header and an extra ``mmyatt`` body
field, which OpenAI clients ignore.

Security: the server binds to loopback unless told otherwise (a warning is printed
for any other address). With an API key, every route but ``/health`` must carry
``Authorization: Bearer <key>`` or gets an OpenAI-style 401. The key is never logged.
Images are only accepted inline as ``data:`` URLs; nothing is fetched.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from mmyatt.models.judge import VLM_MODEL_TYPES, JudgeModel, TextJudge, load_judge
from mmyatt.rewards.judge_batcher import Batcher

__all__ = [
    "API_KEY_ENV",
    "VLM_MODEL_TYPES",
    "JudgeModel",
    "JudgeServer",
    "TextJudge",
    "load_judge",
    "serve",
]

API_KEY_ENV = "MMYATT_GENRM_API_KEY"  # how JudgePool hands the key to child servers
MAX_BODY_BYTES = 64 * 1024 * 1024
# The keep-warm window (``--keep-warm-ms``): after an answer the event loop polls this
# long before it sleeps, so that a lone client's next request (sent ~1 ms later) may be
# read on a core that did not go idle. Off by default: side by side on 2 shared cores it
# gave 1.10x req/s at 1 in flight in one bench run and 0.93x in the next, at more CPU
# (BENCHMARKS.md, "GenRM serving: the keep-warm window"). The bench measures it at
# BENCH_KEEP_WARM_MS.
KEEP_WARM_MS = 0.0
BENCH_KEEP_WARM_MS = 5.0


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class JudgeServer:
    """The judge server, in-process: ``JudgeServer(model_dir_or_model).start()``.

    ``model`` is a model directory (loaded with :func:`load_judge`) or a ready
    :class:`JudgeModel`. ``port=0`` picks a free port; ``.url`` says which.
    ``start()`` serves from a background thread; ``serve_forever()`` blocks.
    ``stop()`` fails queued requests with 503, closes the listening socket and every
    open connection, like a killed server. ``served_model_name`` is the name the
    server reports and accepts (a list: the first is reported); by default the model
    directory, also accepted by its base name.
    """

    def __init__(
        self,
        model: str | Path | JudgeModel,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        max_batch: int = 32,
        batch_wait_ms: float = 5.0,
        max_logprobs: int = 20,
        model_name: str | Sequence[str] | None = None,
        request_timeout_s: float = 600.0,
        log_requests: bool = False,
        device: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        keep_warm_ms: float = KEEP_WARM_MS,
    ):
        names = [model_name] if isinstance(model_name, str) else list(model_name or [])
        if isinstance(model, (str, Path)):
            path = str(model)
            judge: JudgeModel = load_judge(path, device=device)
            names = names or [path, Path(path).name]
        else:
            judge = model
            names = names or [getattr(model, "name", None) or "judge"]
        self.model_name = names[0]
        self.model_names = tuple(dict.fromkeys(names))
        self.allow_images = bool(getattr(judge, "supports_images", True))
        self.api_key = api_key or None
        self.max_logprobs = int(max_logprobs)
        self.max_body_bytes = int(max_body_bytes)
        self.request_timeout_s = float(request_timeout_s)
        if keep_warm_ms < 0:
            raise ValueError(f"keep_warm_ms must be >= 0, got {keep_warm_ms}")
        self.keep_warm_s = float(keep_warm_ms) / 1000.0
        self.warm_polls = 0  # passes of the event loop spent polling in keep-warm windows
        self.log_requests = log_requests
        self.created = int(time.time())
        if not is_loopback(host):
            print(
                f"WARNING: the judge server listens on {host}, not loopback: anyone who can "
                "reach this address can use it"
                + ("" if self.api_key else " (and no API key is set)"),
                file=sys.stderr,
                flush=True,
            )
        self.batcher = Batcher(judge, max_batch, batch_wait_ms)
        if isinstance(model, (str, Path)):
            self.batcher.loader = lambda: load_judge(str(model), device=device)
        try:
            self._socket = _listen(host, port)
        except BaseException:
            self.batcher.stop()
            raise
        self.host = host
        self.port = int(self._socket.getsockname()[1])
        self._uvicorn = None
        self._thread: threading.Thread | None = None

    @property
    def model(self) -> JudgeModel | None:
        """The served model (None while asleep, see ``POST /sleep``)."""
        return self.batcher.model

    @property
    def url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1"
        return f"http://{host}:{self.port}"

    @property
    def stats(self) -> dict:
        from mmyatt.placement import resources as res

        with self.batcher.lock:
            stats = json.loads(json.dumps(self.batcher.stats))  # a deep copy, JSON keys
        stats.update(
            pid=os.getpid(),
            cpu_s=res.cpu_seconds(),
            rss_mb=res.rss_mb(),
            peak_rss_mb=res.peak_rss_mb(),
            device_mb=res.device_mb(),  # 0 on CPU
            device_peak_mb=res.device_peak_mb(),
        )
        stats["max_batch"] = self.batcher.max_batch
        stats["batch_wait_ms"] = self.batcher.batch_wait_s * 1000.0
        stats["keep_warm_ms"] = self.keep_warm_s * 1000.0
        stats["keep_warm_polls"] = self.warm_polls
        return stats

    def _server(self):
        import uvicorn

        from mmyatt.rewards.judge_api import build_app

        config = uvicorn.Config(
            build_app(self),
            loop="auto",
            http="auto",
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,  # the Guard logs requests (--log-requests), never headers
            proxy_headers=False,  # served directly; skips a middleware on every request
            timeout_keep_alive=300,
            timeout_graceful_shutdown=1,
            server_header=False,
        )
        self._uvicorn = uvicorn.Server(config)
        return self._uvicorn

    def start(self) -> JudgeServer:
        server = self._server()
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [self._socket]}, name="judge-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the judge server's HTTP loop did not start")
            time.sleep(0.005)
        return self

    def serve_forever(self) -> None:
        self._server().run(sockets=[self._socket])

    def stop(self) -> None:
        self.batcher.stop()  # queued and in-flight requests are answered 503
        if self._uvicorn is not None:
            self._uvicorn.should_exit = self._uvicorn.force_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self._socket.close()

    def __enter__(self) -> JudgeServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)  # a burst of new connections must not overflow the backlog
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve(model_dir: str | Path, **kwargs) -> None:
    """Serve ``model_dir`` in the foreground until interrupted (kwargs: JudgeServer's)."""
    server = JudgeServer(model_dir, **kwargs)
    print(f"judge server for {server.model_name} on {server.url}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def _watch_parent(parent_pid: int) -> None:
    """Exit when the process that started us is gone (no orphaned judges holding GPUs)."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def cli_main(args: argparse.Namespace) -> int:
    """``mmyatt serve-genrm``: ``args`` as :func:`add_arguments` defines them.

    The key may also come from the environment variable ``MMYATT_GENRM_API_KEY``,
    which keeps it out of ``ps`` output.
    """
    api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None
    threads = getattr(args, "threads", None)
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    server = JudgeServer(
        args.model_dir,
        host=args.host,
        port=int(args.port),
        api_key=api_key,
        max_batch=int(getattr(args, "max_batch", 32)),
        batch_wait_ms=float(getattr(args, "batch_wait_ms", 5.0)),
        keep_warm_ms=float(getattr(args, "keep_warm_ms", KEEP_WARM_MS)),
        max_logprobs=int(getattr(args, "max_logprobs", 20)),
        model_name=getattr(args, "served_model_name", None),
        log_requests=bool(getattr(args, "log_requests", False)),
        device=getattr(args, "device", None),
    )
    if threads:
        server.batcher.threads = int(threads)  # the worker thread applies it too
    if getattr(args, "settle", False):  # placement will release it between phases
        server.batcher.settle()
    port_file = getattr(args, "port_file", None)
    if port_file:  # written last and atomically: its presence means "listening"
        tmp = Path(str(port_file) + ".tmp")
        tmp.write_text(str(server.port))
        tmp.replace(port_file)
    parent = getattr(args, "parent_pid", None)
    if parent:
        _watch_parent(int(parent))
    print(f"judge server for {server.model_name} on {server.url}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``mmyatt serve-genrm`` (vLLM's names where vLLM has one)."""
    p.add_argument("model_dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--api-key", default=None, help=f"or set ${API_KEY_ENV} (kept out of ps)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model name(s) the API reports and accepts (default: the model directory)",
    )
    p.add_argument("--max-batch", type=int, default=32, help="most requests in one model call")
    p.add_argument(
        "--batch-wait-ms",
        type=float,
        default=5.0,
        help="how long a batch may wait for company (only while more requests are expected)",
    )
    p.add_argument(
        "--keep-warm-ms",
        type=float,
        default=KEEP_WARM_MS,
        help="after each answer, poll for the next request this long without sleeping, so "
        "that a lone client's next request may find a warm core (default 0: sleep at once; "
        "measured gains were not robust, BENCHMARKS.md)",
    )
    p.add_argument(
        "--settle",
        action="store_true",
        help="before serving, drop the weights, collect and freeze what survives, and reload: "
        "a judge that placement releases between phases (colocate, auto) then never pays "
        "the full garbage collection of its long-lived objects in a release",
    )
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--device", default=None, help="cpu | cuda | auto (default)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--log-requests", action="store_true")
    p.add_argument("--port-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    return p


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(
        argparse.ArgumentParser(
            prog="mmyatt serve-genrm", description="serve a GenRM judge (OpenAI API subset)"
        )
    )


def main(argv: list[str] | None = None) -> int:
    return cli_main(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
