"""`treadle bench chaos`'s token accounting: what the engines sampled, and what each
kill of the service threw away (the module docstring of `treadle.bench.chaos` says
how the report's `tokens` are made of them)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import httpx

from treadle.bench.faults import ServiceProcess

TOKEN = "chaos-token"  # the admin token of the service a chaos run starts


class TokenMeter:
    """The engines' sampled-token counters, the latest reading of each (by URL)."""

    def __init__(self, service: ServiceProcess) -> None:
        self.service = service
        self.last: dict[str, float] = {}
        self.in_flight = 0  # tokens in flight at the service's kills (`killing`)
        self.dead = 0  # sampled by engines killed with the service (`killing`)
        self._reading = threading.Lock()  # one reading at a time, none across a kill
        self._lock = threading.Lock()

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(0.5):
            self.read()

    def read(self) -> None:
        with self._reading:
            self._read()

    def _read(self) -> None:
        headers = {"authorization": f"Bearer {TOKEN}"}
        with contextlib.suppress(httpx.HTTPError, ValueError):
            engines = httpx.get(f"{self.service.url}/v1/engines", headers=headers,
                                timeout=2).json()
            for engine in engines:
                url = engine["url"]
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    text = httpx.get(f"{url}/metrics", timeout=2).text
                    value = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                if line.startswith("vllm:generation_tokens_total"))
                    with self._lock:
                        self.last[url] = max(value, self.last.get(url, 0.0))

    @contextlib.contextmanager
    def killing(self) -> Iterator[None]:
        """Around a kill of the service and its engines (its children): read, count
        what the kill throws away (module docstring), kill, with no reading between.
        The engines' requests still running were sampled but never reach their
        counters: they count as generated. Their counters die with them, so the
        readings so far are set aside (a new engine may come back at the same URL,
        its counter from 0)."""
        with self._reading:
            self._read()
            self._at_kill()
            yield

    def _at_kill(self) -> None:
        headers = {"authorization": f"Bearer {TOKEN}"}
        with contextlib.suppress(httpx.HTTPError, ValueError):
            urls = [e["url"] for e in httpx.get(f"{self.service.url}/v1/engines",
                                                headers=headers, timeout=2).json()]
            service = _gauge(httpx.get(f"{self.service.url}/metrics", headers=headers,
                                       timeout=2).text, "treadle_tokens_unjournaled ")
            engines = 0.0
            for url in urls:
                with contextlib.suppress(httpx.HTTPError):
                    engines += _gauge(httpx.get(f"{url}/metrics", timeout=2).text,
                                      "treadle:generation_tokens_in_flight")
            self.in_flight += int(service + engines)
            with self._lock:
                self.dead += int(engines + sum(self.last.values()))
                self.last.clear()

    def summary(self, delivered: int, discarded: int,
                restarts_only: bool) -> dict[str, int | bool]:
        generated = self.dead + int(sum(self.last.values()))
        regenerated = max(0, generated - delivered)
        return {"generated": generated, "delivered": delivered, "regenerated": regenerated,
                "in_flight_at_restarts": self.in_flight, "discarded_by_resumes": discarded,
                "regenerated_by_restart": regenerated if restarts_only
                else self.in_flight + discarded, "restarts_only": restarts_only}


def _gauge(text: str, prefix: str) -> float:
    """The sum of the exposition lines of `text` that start with `prefix`."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))


__all__ = ["TOKEN", "TokenMeter"]
