"""``meshserve calibrate --engine-url URL``: fit a sim profile to a running engine's own
step times.

Where ``meshserve calibrate`` times a plain PyTorch forward (a floor for vLLM), this mode
measures the engine users run: a vLLM OpenAI server (or anything with vLLM's HTTP surface
and metrics, ``meshserve sim-server`` included). It sends requests one shape at a time
and reads the engine's own per-request phase times from ``/metrics``
(``vllm:request_prefill_time_seconds``: scheduled → first token;
``vllm:request_decode_time_seconds``: first → last token), so neither HTTP nor
tokenization time enters the step times:

- a prefill point: one request alone, ``max_tokens`` 1, a chunk of N new tokens after C
  cached ones (the C-token prefix is sent first so the prefix cache holds it): its
  prefill time is one step of N prefill tokens over C + N of context. Each is timed twice:
  with the engine otherwise idle, and while a background request decodes (the keeper), so
  the engine is busy as it is under load and the step holds one decode besides. The busy
  points are fitted; the idle ones give ``idle_wake_s``, what a step starting from idle
  costs beyond the same step on a busy engine (vLLM's CPU build parks its threads when
  idle: 2.5 ms, as much as a small prefill, which a fit of idle points alone reads as a
  fixed cost of every prefill);
- a mixed point: one prefill of N tokens while B requests decode (B keepers), the step
  a Poisson load makes all the time (a prefill chunk beside a decoding batch): the
  one-keeper points alone left the fit to add the two kinds of work up, and the sim
  came out 10–29 % fast on vLLM's CPU build under load (BENCHMARKS.md);
- a batched prefill point: B requests of N new tokens each, sent while a long prefill
  (a blocker, as long as the token budget allows) holds the engine, so that all B join the
  engine's queue during the blocker's step and are scheduled together in the next: their
  mean prefill time (the blocker's, measured alone, taken out) is one step of B · N prefill
  tokens. Beside the one-request points this tells a cost per prefilling sequence from a
  cost per prefilling step;
- a decode point: B requests of L prompt tokens at once, K output tokens each
  (``ignore_eos``): the decode time over K − 1 tokens is the mean step of a batch of B
  over B · (L + K/2) tokens of context. Where B · L passes the step budget, the prompts
  share a cached prefix (each reads it: attention is per sequence) and prefill only their
  tails, so the batch still starts together; that is what gives the per-context-token
  cost its range (16 sequences of 1,024 tokens, as under load).

Prompts are token ids from the engine's own ``/tokenize`` of seeded random words, so
every prompt is distinct (no accidental cache hits) and valid for its vocabulary. The
coefficients are fitted as ``meshserve calibrate`` fits them; the KV capacity
(``vllm:cache_config_info``: block size and blocks) and the engine limits given are
written with them, so ``meshserve sim-server --profile FILE`` runs the same engine shape.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import random
import re
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from .calibrate import fitted_parts, point_rows, save_profile
from .calibrate_fit import Point, fit, predict
from .console import CliError

PREFILL_SUM = "vllm:request_prefill_time_seconds_sum"
PREFILL_COUNT = "vllm:request_prefill_time_seconds_count"
DECODE_SUM = "vllm:request_decode_time_seconds_sum"
DECODE_COUNT = "vllm:request_decode_time_seconds_count"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
KEEPER_PROMPT = 16  # the background request's prompt tokens
KEEPER_CONTEXT = 64  # its context when a point is taken, roughly (a few µs either way)
DECODE_TAIL = 16  # at least this many of a long decode point's prompt tokens are its own
_WORDS = ("alpha", "river", "stone", "cloud", "ember", "quartz", "meadow", "signal", "harbor", "violet", "copper",
          "lantern", "orbit", "saffron", "timber", "glacier", "canyon", "falcon", "mosaic", "nectar")


def metric_sums(text: str, names: Sequence[str]) -> dict[str, float]:
    """Each named sample summed over its label sets (engines, models) in Prometheus text."""
    wanted = set(names)
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in wanted:
            out[m.group(1)] += float(m.group(3))
    return out


def cache_config(text: str) -> tuple[int, int] | None:
    """(block size, KV blocks) from ``vllm:cache_config_info``, if the engine exports it."""
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == "vllm:cache_config_info" and m.group(2):
            labels = dict(_LABEL.findall(m.group(2)))
            try:
                return int(labels["block_size"]), int(labels["num_gpu_blocks"])
            except (KeyError, ValueError):
                return None
    return None


@dataclass(frozen=True, slots=True)
class EnginePlan:
    prefill_chunks: tuple[int, ...] = (32, 128, 512, 1024)
    prefill_contexts: tuple[int, ...] = (0, 1024)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    decode_contexts: tuple[int, ...] = (64, 512, 1024)
    decode_tokens: int = 32
    repeats: int = 3
    prefill_batches: tuple[int, ...] = (4, 8)  # behind a blocker; chunks: the first two prefill_chunks
    # a prefill while this many requests decode (a step of both, as under load); chunks:
    # the second and third prefill_chunks
    mixed_decode_batches: tuple[int, ...] = (4, 12)


T = TypeVar("T")


class KeeperEnded(RuntimeError):
    """The background request finished within a measurement: its own prefill is in the
    metrics' sums, so the measurement is void."""


async def while_busy(probe: EngineProbe, keep_tokens: int, measure: Callable[[], Awaitable[T]],
                     attempts: int = 3, keepers: int = 1) -> T:
    """``measure()`` while ``keepers`` background requests decode; redone with fresh ones
    when one ended first (a slow engine: its tokens ran out)."""
    for attempt in range(attempts):
        try:
            async with probe.busy(keep_tokens, keepers):
                return await measure()
        except KeeperEnded:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


class EngineProbe:
    """Requests to one engine, timed by the engine's own metrics."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str, seed: int) -> None:
        self.session = session
        self.url = url.rstrip("/")
        self.model = model
        self.rng = random.Random(seed)

    async def metrics(self) -> str:
        async with self.session.get(f"{self.url}/metrics") as r:
            r.raise_for_status()
            return await r.text()

    async def tokens(self, n: int) -> list[int]:
        """``n`` token ids of seeded random words, from the engine's own tokenizer."""
        words = " ".join(self.rng.choice(_WORDS) + str(self.rng.randrange(10_000)) for _ in range(n))
        async with self.session.post(f"{self.url}/tokenize", json={"model": self.model, "prompt": words}) as r:
            r.raise_for_status()
            ids = (await r.json())["tokens"]
        if len(ids) < n:
            raise RuntimeError(f"/tokenize gave {len(ids)} tokens for {n} words")
        return list(ids[:n])

    async def complete(self, prompt: list[int], max_tokens: int) -> int:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0.0}
        async with self.session.post(f"{self.url}/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"{self.url}/v1/completions: HTTP {r.status}: {(await r.text())[:300]}")
            usage = (await r.json()).get("usage") or {}
        return int(usage.get("completion_tokens", max_tokens))

    @contextlib.asynccontextmanager
    async def busy(self, max_tokens: int, keepers: int = 1) -> AsyncIterator[None]:
        """``keepers`` background requests decoding for the duration of the block, each past
        its first token before the block starts."""
        loop = asyncio.get_running_loop()
        started = [loop.create_future() for _ in range(keepers)]

        async def keep(started: asyncio.Future[None]) -> None:
            body = {"model": self.model, "prompt": await self.tokens(KEEPER_PROMPT), "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0.0, "stream": True}
            async with self.session.post(f"{self.url}/v1/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"{self.url}/v1/completions: HTTP {r.status}: {(await r.text())[:300]}")
                async for _ in r.content:
                    if not started.done():
                        started.set_result(None)

        tasks = [asyncio.create_task(keep(f)) for f in started]
        try:
            for f in started:
                await asyncio.wait({*tasks, f}, return_when=asyncio.FIRST_COMPLETED)
                if any(t.done() for t in tasks):
                    for t in tasks:
                        if t.done():
                            t.result()  # its error, if it failed
                    raise RuntimeError("a background request ended before it decoded")
            yield
            if any(t.done() for t in tasks):
                for t in tasks:
                    if t.done():
                        t.result()  # its error, if it failed
                raise KeeperEnded(f"a background request's {max_tokens} tokens ran out before the point was "
                                  "measured (a larger --max-model-len gives it more)")
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await t

    async def _counted(self, names: Sequence[str], before: dict[str, float], requests: int) -> dict[str, float]:
        """The metrics once ``requests`` more prefills than ``before`` are counted (a
        finished request's metrics can trail its response), or after a second."""
        after = before
        for _ in range(50):
            after = metric_sums(await self.metrics(), names)
            if after[PREFILL_COUNT] - before[PREFILL_COUNT] >= requests:
                break
            await asyncio.sleep(0.02)
        return after

    async def _phase_times(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, float, int]:
        """Run ``prompts`` at once: Δ prefill seconds, Δ prefill count, Δ decode seconds, decode tokens."""
        names = (PREFILL_SUM, PREFILL_COUNT, DECODE_SUM, DECODE_COUNT)
        before = metric_sums(await self.metrics(), names)
        outputs = await asyncio.gather(*(self.complete(p, max_tokens) for p in prompts))
        after = await self._counted(names, before, len(prompts))
        d = {k: after[k] - before[k] for k in names}
        return d[PREFILL_SUM], d[PREFILL_COUNT], d[DECODE_SUM], sum(max(n - 1, 0) for n in outputs)

    async def prefill(self, chunk: int, context: int, keep_tokens: int = 0, keepers: int = 1) -> float:
        """One ``chunk``-token prefill after ``context`` cached tokens; with ``keep_tokens``
        while ``keepers`` background requests decode (only the timed request inside their
        span, so a slow API server does not outlast them)."""
        prefix = await self.tokens(context) if context else []
        if prefix:
            await self.complete(prefix, 1)  # now cached
        prompt = prefix + await self.tokens(chunk)
        if keep_tokens:
            seconds, count, _, _ = await while_busy(self, keep_tokens, functools.partial(self._phase_times, [prompt], 1),
                                                    keepers=keepers)
        else:
            seconds, count, _, _ = await self._phase_times([prompt], 1)
        if count < 1:
            raise RuntimeError(f"{self.url}/metrics did not count the request's prefill (no {PREFILL_COUNT}?)")
        return seconds / count

    async def prefill_batch(self, chunk: int, batch: int, blocker_tokens: int, keep_tokens: int = 0) -> float:
        """Mean prefill seconds of ``batch`` ``chunk``-token requests scheduled in one step
        (see the module docstring); with ``keep_tokens`` while a background request decodes."""
        first, second = await self.tokens(blocker_tokens), await self.tokens(blocker_tokens)
        prompts = [await self.tokens(chunk) for _ in range(batch)]

        async def timed() -> float:
            names = (PREFILL_SUM, PREFILL_COUNT)
            before = metric_sums(await self.metrics(), names)
            await self.complete(first, 1)
            alone = await self._counted(names, before, 1)
            blocker = asyncio.create_task(self.complete(second, 1))
            await asyncio.sleep(0.002)  # the blocker reaches the engine first
            await asyncio.gather(*(self.complete(p, 1) for p in prompts))
            await blocker
            after = await self._counted(names, alone, batch + 1)
            blocker_s = alone[PREFILL_SUM] - before[PREFILL_SUM]
            return max(after[PREFILL_SUM] - alone[PREFILL_SUM] - blocker_s, 0.0) / batch

        return await (while_busy(self, keep_tokens, timed) if keep_tokens else timed())

    async def decode(self, batch: int, context: int, tokens: int, *, shared: int = 0) -> float:
        """Mean decode step of ``batch`` requests of ``context`` prompt tokens; the first
        ``shared`` of them a prefix common to all, cached first, so that a batch whose
        prompts would not fit one step's budget still prefills in one step."""
        prefix = await self.tokens(shared) if shared else []
        if prefix:
            await self.complete(prefix, 1)  # now cached
        prompts = [prefix + await self.tokens(context - shared) for _ in range(batch)]
        _, _, seconds, steps = await self._phase_times(prompts, tokens)
        if steps < 1 or seconds <= 0:
            raise RuntimeError(f"{self.url}/metrics did not count the decode (no {DECODE_SUM}?)")
        return seconds / steps  # Σ of B requests' K − 1 steps, each a step of the whole batch


async def measure_engine(url: str, model: str, plan: EnginePlan, *, max_len: int, max_num_seqs: int,
                         max_num_batched_tokens: int, block_size: int, seed: int = 0,
                         log: Any = print) -> tuple[list[Point], list[Point]]:
    """Prefill and decode points of a running engine, busy (fitted), and the prefill points
    timed from idle (see the module docstring)."""
    points: list[Point] = []
    idle: list[Point] = []
    keep_tokens = max_len - KEEPER_PROMPT - 1
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        probe = EngineProbe(session, url, model, seed)
        await probe.complete(await probe.tokens(16), 2)  # warm up
        for context in plan.prefill_contexts:
            context = context // block_size * block_size  # the cache holds whole blocks
            for chunk in plan.prefill_chunks:
                if context + chunk + 1 > max_len or chunk > max_num_batched_tokens - 1:
                    continue
                alone = [await probe.prefill(chunk, context) for _ in range(plan.repeats)]
                idle.append(Point("prefill", chunk, 0, context + chunk, statistics.median(alone), prefill_seqs=1))
                # a keeper each (cancelled, it leaves no stats behind)
                times = [await probe.prefill(chunk, context, keep_tokens) for _ in range(plan.repeats)]
                p = Point("prefill", chunk, 1, context + chunk + KEEPER_CONTEXT, statistics.median(times),
                          prefill_seqs=1)
                points.append(p)
                log(f"  prefill chunk {chunk:5d} after {context:5d} cached: {p.seconds * 1000:8.3f} ms busy, "
                    f"{idle[-1].seconds * 1000:8.3f} ms from idle")
        for keepers in plan.mixed_decode_batches:
            for chunk in plan.prefill_chunks[1:3]:
                if keepers + 1 > max_num_seqs or chunk + keepers > max_num_batched_tokens - 1 or chunk + 1 > max_len:
                    continue
                times = [await probe.prefill(chunk, 0, keep_tokens, keepers) for _ in range(plan.repeats)]
                p = Point("prefill", chunk, keepers, chunk + keepers * KEEPER_CONTEXT, statistics.median(times),
                          prefill_seqs=1)
                points.append(p)
                log(f"  prefill chunk {chunk:5d} beside {keepers:2d} decodes:   {p.seconds * 1000:8.3f} ms")
        blocker = min(max_num_batched_tokens - 1, max_len - 2)
        for chunk in plan.prefill_chunks[:2]:
            for batch in plan.prefill_batches:
                if batch > max_num_seqs - 2 or batch * chunk > max_num_batched_tokens - 1 or chunk + 1 > max_len:
                    continue
                times = [await probe.prefill_batch(chunk, batch, blocker, keep_tokens) for _ in range(plan.repeats)]
                p = Point("prefill", batch * chunk, 1, batch * chunk + KEEPER_CONTEXT, statistics.median(times),
                          prefill_seqs=batch)
                points.append(p)
                log(f"  prefill {batch} × {chunk:4d} in one step:        {p.seconds * 1000:8.3f} ms busy")
        k = plan.decode_tokens
        for context in plan.decode_contexts:
            for batch in plan.decode_batches:
                # one prefill step for the batch, then K − 1 steps of B decodes: past the step
                # budget, the prompts share a cached prefix and prefill only their own tails
                shared = 0
                if batch * context > max_num_batched_tokens:
                    shared = (context - DECODE_TAIL) // block_size * block_size
                    if batch * (context - shared) > max_num_batched_tokens:
                        continue
                if batch > max_num_seqs or context + k > max_len:
                    continue
                times = [await probe.decode(batch, context, k, shared=shared) for _ in range(plan.repeats)]
                p = Point("decode", 0, batch, batch * (context + k // 2), statistics.median(times))
                points.append(p)
                log(f"  decode  batch {batch:4d} context {context:5d}: {p.seconds * 1000:8.3f} ms per step")
    return points, idle


def idle_wake(coef: dict[str, float], idle: Sequence[Point]) -> float:
    """What a step starting from idle costs beyond the fitted (busy) step: the median over
    the idle prefill points, never negative."""
    if not idle:
        return 0.0
    return max(statistics.median(p.seconds - predict(coef, p) for p in idle), 0.0)


async def engine_model(url: str) -> tuple[str, int | None]:
    """The served model's name and ``max_model_len`` (vLLM's /v1/models carries it)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(f"{url.rstrip('/')}/v1/models") as r:
            r.raise_for_status()
            data = (await r.json())["data"]
    if not data:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return str(data[0]["id"]), data[0].get("max_model_len")


async def engine_cache(url: str) -> tuple[int, int] | None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(f"{url.rstrip('/')}/metrics") as r:
            r.raise_for_status()
            return cache_config(await r.text())


def engine_profile(*, name: str, model: str, url: str, coef: dict[str, float], points: Sequence[Point],
                   block_size: int, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
                   max_model_len: int, input_len: int, output_len: int, seconds: float) -> dict[str, Any]:
    """A sim profile of the measured engine. Its memory is the engine's KV cache as it
    reported it: one byte per token, ``num_blocks`` blocks, so the sim holds as much."""
    errors, parts = fitted_parts(coef, points, block_size=block_size, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                 input_len=input_len, output_len=output_len, batches=(1, 4, max_num_seqs))
    return {
        "name": name,
        "model": model,
        "comment": (f"Measured by meshserve calibrate --engine-url on the running engine at {url}: {len(points)} "
                    f"prefill chunks and decode batches timed by the engine's own phase metrics, fitted by "
                    f"non-negative least squares on relative error (median error "
                    f"{statistics.median(errors) * 100:.1f}%, worst {max(errors) * 100:.1f}%). Memory: the "
                    f"engine's KV cache ({num_blocks} blocks of {block_size} tokens), one nominal byte per token."),
        "step": parts["step"],
        "memory": {"hbm_bytes": num_blocks * block_size, "weights_bytes": 0, "reserve_bytes": 0,
                   "kv_bytes_per_token": 1},
        "engine_defaults": parts["engine_defaults"],
        "intended": parts["intended"],
        "calibration": {"device": f"engine at {url}", "seconds": round(seconds, 1),
                        "fit_error_median": statistics.median(errors), "fit_error_max": max(errors),
                        "points": point_rows(coef, points)},
    }


async def calibrate_engine(url: str, *, plan: EnginePlan, max_num_seqs: int, max_num_batched_tokens: int,
                           name: str | None = None, input_len: int = 512, output_len: int = 256, seed: int = 0,
                           log: Any = print) -> dict[str, Any]:
    """Measure the engine at ``url`` and return its sim profile."""
    t0 = time.monotonic()
    model, max_len = await engine_model(url)
    cache = await engine_cache(url)
    if cache is None:
        raise RuntimeError(f"{url}/metrics has no vllm:cache_config_info: block size and KV blocks unknown")
    block_size, num_blocks = cache
    max_len = int(max_len or 2048)
    log(f"calibrating {model} at {url}: {num_blocks} KV blocks of {block_size} tokens, max_model_len {max_len}")
    points, idle = await measure_engine(url, model, plan, max_len=max_len, max_num_seqs=max_num_seqs,
                                        max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                                        seed=seed, log=log)
    coef = fit(points)
    coef["idle_wake_s"] = idle_wake(coef, idle)
    return engine_profile(name=name or f"{model}-engine", model=model, url=url, coef=coef, points=points,
                          block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_len, input_len=input_len,
                          output_len=output_len, seconds=time.monotonic() - t0)


def run_engine(args: argparse.Namespace) -> int:
    """The CLI's ``--engine-url`` mode."""
    plan = EnginePlan(tuple(args.prefill_chunks), tuple(args.prefill_contexts), tuple(args.decode_batches),
                      tuple(args.decode_contexts), decode_tokens=args.decode_tokens, repeats=args.repeats)
    try:
        profile = asyncio.run(calibrate_engine(
            args.engine_url, plan=plan, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, name=args.name, input_len=args.input_len,
            output_len=args.output_len, seed=args.seed))
    except (aiohttp.ClientError, OSError, RuntimeError, ValueError) as exc:
        raise CliError(f"{args.engine_url}: {exc or type(exc).__name__}") from None
    out = Path(args.out)
    cal = profile["calibration"]
    points = [Point(**{k: v for k, v in row.items() if k != "predicted"}) for row in cal["points"]]
    unusable = save_profile(profile, out, points)
    print("fitted: " + ", ".join(f"{k} {v:.4g}" for k, v in profile["step"].items())
          + f" (fit error median {cal['fit_error_median']:.1%}, worst {cal['fit_error_max']:.1%})")
    if unusable:
        raise CliError(f"wrote the measurements to {out}, but they make no usable sim profile: {unusable}")
    print(f"wrote {out} (use it with: meshserve sim-server --profile {out})")
    return 0


__all__ = ["EnginePlan", "cache_config", "calibrate_engine", "engine_profile", "measure_engine", "metric_sums",
           "run_engine"]
