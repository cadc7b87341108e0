"""GET the trainer pods' Prometheus endpoints: `fetch_all` scrapes many endpoints concurrently
with a bound and a per-request timeout, so one slow pod never holds up the others. What the bodies
say is parsed below, in `decisions/samples.py`.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ddpjob_operator.decisions.samples import RankSample, parse_metrics

# Default cap on one metrics body: a trainer's exposition is a few KiB per rank.
MAX_BODY_BYTES = 4 * 1024 * 1024
_CHUNK = 64 * 1024


class BodyTooLarge(Exception):
    """A metrics response grew past the cap; the scrape is abandoned before it is held in memory."""


def _parse_each(texts: list[str]) -> list[dict[int, RankSample] | Exception]:
    out: list[dict[int, RankSample] | Exception] = []
    for text in texts:
        try:
            out.append(parse_metrics(text))
        except Exception as exc:  # noqa: BLE001  (a broken exposition is that pod's problem)
            out.append(exc)
    return out


async def parse_all_async(texts: list[str]) -> list[dict[int, RankSample] | Exception]:
    """`parse_metrics` of every body, in one worker-thread call per pass (not one per pod): large
    (but allowed) bodies must not stall the loop. A body that does not parse gives its exception."""
    return await asyncio.to_thread(_parse_each, texts) if texts else []


@dataclass
class ScrapeResult:
    """One endpoint's outcome: text on success, error otherwise."""

    url: str
    text: str | None = None
    error: str | None = None
    oversized: bool = False  # the body passed the cap (a pod misbehaving, worth a warning)


async def _read_capped(resp: object, *, max_bytes: int) -> bytes:
    """The body, read in chunks and abandoned as soon as it passes `max_bytes`."""
    length = getattr(resp, "content_length", None)
    if length is not None and length > max_bytes:
        raise BodyTooLarge(f"Content-Length {length} over the {max_bytes}-byte cap")
    buf = bytearray()
    async for chunk in resp.content.iter_chunked(_CHUNK):  # type: ignore[attr-defined]
        buf += chunk
        if len(buf) > max_bytes:
            raise BodyTooLarge(f"body over the {max_bytes}-byte cap")
    return bytes(buf)


def session(*, concurrency: int, keepalive: float):
    """A long-lived aiohttp session for `fetch_all`: connections kept open `keepalive` seconds
    between scrapes (longer than the scrape interval, so each pod's connection is reused)."""
    import aiohttp  # comes with kopf; imported here: the CLI takes MAX_BODY_BYTES without it

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(1, concurrency),
                                                                keepalive_timeout=keepalive))


async def fetch_all(urls: list[str], *, concurrency: int = 16, timeout: float = 5.0,
                    semaphore: asyncio.Semaphore | None = None, session=None,
                    max_bytes: int = MAX_BODY_BYTES) -> list[ScrapeResult]:
    """GET every URL concurrently (at most `concurrency` at once, or as `semaphore` allows across
    callers), each with its own deadline and a body of at most `max_bytes`; never raises. With
    `session` (see session()) its kept-alive connections are used; else a session for this call."""
    if max_bytes < 1:
        raise ValueError(f"fetch_all: max_bytes must be positive, got {max_bytes}")
    import aiohttp  # comes with kopf; imported here: the CLI takes MAX_BODY_BYTES without it

    sem = semaphore or asyncio.Semaphore(max(1, concurrency))
    # The deadline covers connect + read of one request; time spent queued on the semaphore is not
    # counted against it, so a slow pod delays nobody but itself.
    per_request = aiohttp.ClientTimeout(total=timeout)

    async def one(session: "aiohttp.ClientSession", url: str) -> ScrapeResult:
        async with sem:
            try:
                async with session.get(url, timeout=per_request) as resp:
                    if resp.status != 200:
                        return ScrapeResult(url=url, error=f"HTTP {resp.status}")
                    body = await _read_capped(resp, max_bytes=max_bytes)
                    return ScrapeResult(url=url, text=body.decode(resp.charset or "utf-8",
                                                                  errors="replace"))
            except BodyTooLarge as exc:
                return ScrapeResult(url=url, error=f"BodyTooLarge: {exc}", oversized=True)
            except Exception as exc:  # noqa: BLE001  (any failure is one pod's problem, not the job's)
                return ScrapeResult(url=url, error=f"{type(exc).__name__}: {exc}".rstrip(": "))

    if not urls:
        return []
    if session is not None:
        return list(await asyncio.gather(*(one(session, u) for u in urls)))
    connector = aiohttp.TCPConnector(limit=max(1, concurrency), force_close=True)
    async with aiohttp.ClientSession(connector=connector) as own:
        return list(await asyncio.gather(*(one(own, u) for u in urls)))
