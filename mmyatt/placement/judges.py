"""Rank 0's handle on the judge servers started with a run: pin them to cores, set their
torch threads, drop and reload their weights, read their counters (CPU seconds, model
time, reload time, peak RSS). Speaks the server's ``/sleep``, ``/wake_up``,
``/mmyatt/placement`` and ``/stats`` routes (mmyatt/serving/server.py)."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Sequence

logger = logging.getLogger(__name__)


class JudgeControl:
    def __init__(self, urls: Sequence[str], api_key: str | None = None, timeout_s: float = 300.0):
        self.urls = [u.rstrip("/") for u in urls]
        if self.urls and self.urls[0].endswith("/v1"):
            self.urls = [u[:-3] for u in self.urls]
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.can_release = True  # False once a server says it cannot drop its weights
        self.readable = True  # False once a server has no /stats or peak reset (vLLM)

    def _call(self, url: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(
            url + path, data=data, headers=headers, method="GET" if body is None else "POST"
        )
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            return json.loads(r.read() or b"{}")

    def place(self, cores: Sequence[int], threads_total: int, reset_peak: bool = False) -> None:
        """Every server on ``cores`` with ``threads_total`` torch threads between them."""
        per = max(1, int(threads_total) // max(1, len(self.urls)))
        body = {"cores": list(cores), "threads": per, "reset_peak": reset_peak}
        for u in self.urls:
            try:
                self._call(u, "/mmyatt/placement", body)
            except urllib.error.HTTPError as error:
                raise RuntimeError(
                    f"judge {u} does not take POST /mmyatt/placement (HTTP {error.code}): "
                    "placement modes that pin the judge need mmyatt's judge server "
                    "(reward.judge.backend=mmyatt), or use placement.mode=shared"
                ) from error

    def reset_peak(self) -> None:
        if not self.readable:
            return
        for u in self.urls:
            try:
                self._call(u, "/mmyatt/placement", {"reset_peak": True})
            except (urllib.error.URLError, OSError, ValueError):
                self.readable = False  # e.g. a vLLM server: no per-phase judge figures
                return

    def sleep(self) -> float:
        """Drop every server's weights; seconds spent (0 when they cannot)."""
        if not self.can_release:
            return 0.0
        total = 0.0
        for u in self.urls:
            try:
                total += float(self._call(u, "/sleep", {}).get("sleep_s", 0.0))
            except urllib.error.HTTPError as error:
                self.can_release = False
                logger.warning(
                    f"[placement] judge {u} cannot release its weights (HTTP {error.code}); "
                    "the run keeps them loaded (colocate, partial_release_judge)"
                )
                return 0.0
        return total

    def wake(self) -> float:
        """Reload every server's weights; the reload seconds, summed over servers."""
        if not self.can_release:
            return 0.0
        return sum(float(self._call(u, "/wake_up", {}).get("reload_s", 0.0)) for u in self.urls)

    def stats(self) -> dict[str, float]:
        """Counters summed over servers: cpu_s, model_time_s, reload_s, rss_mb, peak_rss_mb,
        device_mb and device_peak_mb (0 for a judge on the CPU)."""
        keys = ("cpu_s", "model_time_s", "reload_s", "rss_mb", "peak_rss_mb", "reloads")
        keys += ("device_mb", "device_peak_mb")
        out = dict.fromkeys(keys, 0.0)
        if not self.readable:
            return out
        for u in self.urls:
            try:
                s = self._call(u, "/stats")
            except (urllib.error.URLError, OSError, ValueError):
                self.readable = False  # e.g. a vLLM server: no judge figures, the run goes on
                return dict.fromkeys(keys, 0.0)
            for k in keys:
                out[k] += float(s.get(k, 0.0))
        return out
