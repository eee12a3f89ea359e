"""The embedded GenRM judge server: an OpenAI chat-completions subset on FastAPI and
uvicorn. ``mmyatt serve-genrm MODEL_DIR [--host 127.0.0.1] [--port 8000] [--api-key K]``
(or ``python -m mmyatt.serving.server``) serves a local judge as ``vllm serve`` would:

=================================  ==========================================================
``GET /health``                    ``{"status": "ok", "model": NAME}`` (no key needed, as in
                                   vLLM, so that liveness probes work)
``GET /v1/models``                 the one served model, OpenAI list format
``POST /v1/chat/completions``      ``model``, ``messages`` (text parts and ``image_url`` parts
                                   holding ``data:`` URLs), ``max_tokens``, ``temperature``,
                                   ``logprobs``, ``top_logprobs``, ``n``, ``seed``
``GET /stats``                     batching, timing and memory counters
``POST /sleep``, ``/wake_up``      drop / reload the weights between judge phases (placement)
``POST /mmyatt/placement``         pin the server to cores, set its torch threads
=================================  ==========================================================

Every route's request and answer is a pydantic model (:mod:`mmyatt.serving.api`);
requests are batched by :mod:`mmyatt.serving.batcher` for a model of
:mod:`mmyatt.models.judge`. ``max_tokens=1, logprobs=true, top_logprobs=k`` answers the
top-k next-token distribution (``yes_prob``: one forward); longer ``max_tokens``
generate text (``score``); per-token logprobs of generated text are refused (400)
rather than made up. An extra ``mmyatt`` field, which OpenAI clients ignore, reports
the model call that served the answer.

Security: loopback unless told otherwise (any other address is logged as a warning);
with an API key every route but ``/health`` needs ``Authorization: Bearer <key>``
(else an OpenAI-style 401); bodies over ``max_body_bytes`` get a 413;
``--log-requests`` is uvicorn's access log (request line and status, never headers);
images only inline as ``data:`` URLs, nothing is fetched.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import ipaddress
import itertools
import logging
import os
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import orjson
import torch
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from PIL import Image, UnidentifiedImageError
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from mmyatt.models.judge import JudgeModel, TextJudge, load_judge
from mmyatt.placement import resources
from mmyatt.serving import API_KEY_ENV
from mmyatt.serving.api import (
    ChatCompletion,
    ChatRequest,
    ErrorBody,
    Health,
    ImagePart,
    ModelCard,
    ModelList,
    Placement,
    PlacementRequest,
    Slept,
    Stats,
    Woken,
)
from mmyatt.serving.batcher import Batcher, BatcherStopped, Result, Work
from mmyatt.serving.guard import APIError, Guard, validation_error

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_app(server: JudgeServer) -> FastAPI:
    """The FastAPI app of ``server``: its routes and OpenAI-shaped errors."""
    # FastAPI's OpenTelemetry hooks look up the environment on every request (0.13 ms):
    # off, as the judge reports its own timings
    telemetry = {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(
        title="mmyatt judge", docs_url=None, redoc_url=None, openapi_url=None, telemetry=telemetry
    )
    # answer ids unique to this app: a random prefix and a counter (uuid4 reads the
    # kernel's random source on every call, 0.1 ms)
    id_prefix, ids = f"chatcmpl-{secrets.token_hex(8)}", itertools.count()
    app.add_middleware(Guard, api_key=server.api_key, max_body_bytes=server.max_body_bytes)
    errors = {code: {"model": ErrorBody} for code in (400, 401, 404, 413, 500, 503, 504)}

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError):
        return validation_error(error.errors()).response()

    @app.exception_handler(HTTPException)
    async def _no_route(request: Request, _: HTTPException):  # 404 and 405 alike
        message = f"no route {request.method} {request.url.path}"
        return APIError(message, 404, "not_found").response()

    @app.get("/health")
    async def health() -> Health:
        return Health(model=server.model_name)

    @app.get("/v1/models", responses=errors)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=server.model_name, created=server.created)])

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=errors)
    async def chat_completions(request: Request) -> Response:
        work = to_work(chat_request(request, await request.body()), server)
        try:
            result = await asyncio.wait_for(server.batcher.submit(work), server.request_timeout_s)
        except BatcherStopped as error:
            raise APIError(str(error), 503) from error
        except asyncio.TimeoutError as error:
            raise APIError("the judge model did not answer in time", 504) from error
        except ValueError as error:  # the model refused the input
            raise APIError(str(error)) from error
        except Exception as error:  # noqa: BLE001 - reported to the client as a 500
            raise APIError(f"judge model error: {type(error).__name__}: {error}", 500) from error
        # the answer as ChatCompletion describes it, written by orjson (FastAPI passes a
        # Response through: no jsonable_encoder, no second validation)
        answer = {
            "id": f"{id_prefix}{next(ids):08x}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": server.model_name,
            "choices": choices(work, result),
            "mmyatt": {
                "model_time_ms": result.model_time_s * 1000.0,
                "batch_size": result.batch_size,
                "queue_ms": result.queue_s * 1000.0,
            },
        }
        return Response(orjson.dumps(answer), media_type="application/json")

    @app.get("/stats", responses=errors)
    def stats() -> Stats:
        return Stats(**server.stats)

    @app.post("/sleep", responses=errors)
    def sleep() -> Slept:
        try:
            return Slept(sleep_s=server.batcher.sleep())
        except ValueError as error:
            raise APIError(f"/sleep: {error}") from error

    @app.post("/wake_up", responses=errors)
    def wake_up() -> Woken:
        return Woken(reload_s=server.batcher.wake())

    @app.post("/mmyatt/placement", responses=errors)
    def placement(request: PlacementRequest) -> Placement:
        try:
            if request.cores:
                resources.pin_process(request.cores)
            if request.threads:
                server.batcher.threads = request.threads
            if request.reset_peak:
                resources.reset_peak_rss()
                resources.reset_device_peak()
        except (ValueError, OSError) as error:
            raise APIError(f"/mmyatt/placement: {error}") from error
        return Placement(cores=resources.process_cores(), threads=server.batcher.threads)

    return app


def _check_image(url: str) -> None:
    data = base64.b64decode(url.split(",", 1)[1])
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as error:
        raise APIError(f"an image part is not a readable image: {error}") from error


def chat_request(request: Request, body: bytes) -> ChatRequest:
    """The body, of a JSON media type as FastAPI asks of a body model, parsed from its
    bytes by pydantic (FastAPI's json.loads and validation of the dict took twice as
    long); errors as an OpenAI-style 400."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if not re.fullmatch(r"application/([^/;]+\+)?json", media):
        raise APIError("body: send the request as JSON (Content-Type: application/json)")
    try:
        return ChatRequest.model_validate_json(body)
    except ValidationError as error:
        raise validation_error(error.errors()) from None


def to_work(req: ChatRequest, server: JudgeServer) -> Work:
    """Check what the request model cannot (this server's model, limits, images)."""
    if req.model is not None and req.model not in server.model_names:
        raise APIError(
            f"the model {req.model!r} does not exist; this server serves {server.model_name!r}",
            404,
            "model_not_found",
            "model",
        )
    if req.stream:
        raise APIError("streaming is not supported by the embedded judge server", param="stream")
    for i, m in enumerate(req.messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            if isinstance(part, ImagePart):
                if not server.allow_images:
                    raise APIError(
                        f"messages[{i}].content[{j}]: this judge is a text-only model; "
                        "serve a VLM judge (Qwen2-VL / Qwen2.5-VL) to judge images",
                        param="messages",
                    )
                _check_image(part.image_url.url)
    max_tokens = req.max_completion_tokens or req.max_tokens or 128
    top = req.top_logprobs or 0
    if top > server.max_logprobs:
        raise APIError(
            f"'top_logprobs' must be an integer in [0, {server.max_logprobs}], got {top}",
            param="top_logprobs",
        )
    if top and not req.logprobs:
        raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if req.logprobs and max_tokens > 1:
        raise APIError(
            "logprobs are only available with max_tokens=1 on the embedded judge server "
            "(next-token distribution); use vLLM for per-token logprobs of generated text",
            param="logprobs",
        )
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    messages = [m.model_dump() for m in req.messages]
    return Work(messages, max_tokens, temperature, bool(req.logprobs), top, req.n, req.seed)


def _logprob(token: str, logprob: float) -> dict:
    # -inf (a token the model cannot emit) as vLLM writes it: JSON has no infinity
    return {"token": token, "logprob": max(logprob, -9999.0), "bytes": list(token.encode())}


def choices(work: Work, result: Result) -> list[dict]:
    """The answer's choices (:class:`Choice` in :mod:`mmyatt.serving.api`), as the dicts
    that orjson writes: values this server made, not validated again."""
    out = []
    for j in range(work.n):
        if work.next_token_only:
            token, logprob = result.top[0]
            finish = "length"
        else:
            token, logprobs = result.generations[j]
            logprob = logprobs[0] if logprobs else 0.0
            finish = "length" if len(logprobs) >= work.max_tokens else "stop"
        logprobs = None
        if work.logprobs and result.top is not None:
            chosen = _logprob(token, logprob)
            chosen["top_logprobs"] = [_logprob(t, v) for t, v in result.top[: work.top_logprobs]]
            logprobs = {"content": [chosen]}
        message = {"role": "assistant", "content": token}
        out.append({"index": j, "message": message, "logprobs": logprobs, "finish_reason": finish})
    return out


class JudgeServer:
    """The judge server, in-process: ``JudgeServer(model_dir_or_model).start()``.

    ``model`` is a model directory (loaded with :func:`load_judge`, and reloadable after
    ``/sleep``) or a ready :class:`JudgeModel`. ``port=0`` picks a free port; ``.url``
    says which. ``start()`` serves from a background thread; ``serve_forever()`` blocks.
    ``stop()`` fails queued requests with 503 and closes the listening socket and every
    open connection, like a killed server. ``model_name`` is the name the server
    reports and accepts (a list: the first is reported); by default the model directory,
    also accepted by its base name, or ``"judge"`` for a model object.
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
    ):
        names = [model_name] if isinstance(model_name, str) else list(model_name or [])
        loader = None
        if isinstance(model, (str, Path)):
            path = str(model)
            names = names or [path, Path(path).name]

            def loader():
                return load_judge(path, device=device)

            model = loader()
        self.model_name = (names or ["judge"])[0]
        self.model_names = tuple(dict.fromkeys(names or ["judge"]))
        self.allow_images = not isinstance(model, TextJudge)
        self.api_key = api_key or None
        self.max_logprobs = int(max_logprobs)
        self.max_body_bytes = int(max_body_bytes)
        self.request_timeout_s = float(request_timeout_s)
        self.log_requests = log_requests
        self.created = int(time.time())
        if not is_loopback(host):
            logger.warning(
                "the judge server listens on %s, not loopback: anyone who can reach this "
                "address can use it%s",
                host,
                "" if self.api_key else " (and no API key is set)",
            )
        self.batcher = Batcher(model, max_batch, batch_wait_ms, loader=loader)
        try:
            self._socket = _listen(host, port)
        except BaseException:
            self.batcher.stop()
            raise
        self.host = host
        self.port = int(self._socket.getsockname()[1])
        self._uvicorn: uvicorn.Server | None = None
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
        with self.batcher.lock:
            stats = {**self.batcher.stats, "batch_sizes": dict(self.batcher.stats["batch_sizes"])}
        return {
            **stats,
            "pid": os.getpid(),
            "cpu_s": resources.cpu_seconds(),
            "rss_mb": resources.rss_mb(),
            "peak_rss_mb": resources.peak_rss_mb(),
            "device_mb": resources.device_mb(),  # 0 on CPU
            "device_peak_mb": resources.device_peak_mb(),
            "max_batch": self.batcher.max_batch,
            "batch_wait_ms": self.batcher.batch_wait_s * 1000.0,
        }

    def _server(self) -> uvicorn.Server:
        config = uvicorn.Config(
            build_app(self),
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=self.log_requests,
            proxy_headers=False,  # served directly
            timeout_keep_alive=300,
            timeout_graceful_shutdown=1,
            server_header=False,
        )
        if self.log_requests:  # uvicorn's access log: request line and status only
            logging.getLogger("uvicorn.access").setLevel(logging.INFO)
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
        self.batcher.stop()  # queued requests are answered 503
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
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart takes the port
    try:
        sock.bind((host, port))
        sock.listen(1024)  # a burst of new connections must not overflow the backlog
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _watch_parent(parent_pid: int) -> None:
    """Exit when the process that started us is gone (no orphaned judges holding GPUs)."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def cli_main(args: argparse.Namespace) -> int:
    """``mmyatt serve-genrm``: ``args`` as :func:`add_arguments` defines them. The key
    may also come from the environment variable ``MMYATT_GENRM_API_KEY``, which keeps it
    out of ``ps`` output."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    server = JudgeServer(
        args.model_dir,
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_batch=args.max_batch,
        batch_wait_ms=args.batch_wait_ms,
        max_logprobs=args.max_logprobs,
        model_name=args.served_model_name,
        log_requests=args.log_requests,
        device=args.device,
    )
    server.batcher.threads = args.threads  # the model thread applies it too
    if args.settle:  # placement will release it between phases
        server.batcher.settle()
    if args.port_file:  # written last and atomically: its presence means "listening"
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(server.port))
        tmp.replace(args.port_file)
    if args.parent_pid:
        _watch_parent(args.parent_pid)
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
    names = "the model name(s) the API reports and accepts (default: the model directory)"
    p.add_argument("--served-model-name", nargs="+", default=None, help=names)
    p.add_argument("--max-batch", type=int, default=32, help="most requests in one model call")
    wait = "how long a batch may wait for company (only while more requests are expected)"
    p.add_argument("--batch-wait-ms", type=float, default=5.0, help=wait)
    settle = "drop, collect and reload the weights once before serving (Batcher.settle)"
    p.add_argument("--settle", action="store_true", help=settle)
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--device", default=None, help="cpu | cuda | auto (default)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--log-requests", action="store_true")
    p.add_argument("--port-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mmyatt serve-genrm", description="serve a GenRM judge (OpenAI API subset)"
    )
    return cli_main(add_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
