"""Prices per model and the spend of one usage event (pure, no I/O but ``load_prices``).

A price table gives, per model, the price of a million input (prompt) tokens, of a
million cached input tokens (prompt tokens served from the prefix cache) and of a million
output (completion) tokens. An event's spend is

    (prompt − cached) · input + cached · cached_input + completion · output   (per 1e6 tokens)

computed in integers of 1e-9 currency units ("nano"), rounded half up once per event, so
ledger sums are exact and reproducible in any backend.

The file (``--prices FILE``, JSON, or TOML when it ends in ``.toml``)::

    currency = "USD"
    free_statuses = ["rejected", "failed"]   # counted, never charged (the default)

    [models."meta-llama/Llama-3.1-8B-Instruct"]
    input = 0.10          # per million prompt tokens
    cached_input = 0.025  # per million cached prompt tokens (default: the input price)
    output = 0.40         # per million completion tokens

    [models."*"]          # any model not named (absent: unknown models are free, and counted)
    input = 0.0
    output = 0.0

    [accelerators."H100-80GB"]   # what the fleet pays, per accelerator-hour (the fleet report)
    per_hour = 2.99
    [accelerators."*"]           # any other accelerator (absent: unknown ones are unpriced)
    per_hour = 0.0

An accelerator's name matches a key exactly (any case), else the key whose words appear
together in it, the longest such key winning (words: runs of letters and digits, any
case): "H100" prices vLLM's "NVIDIA H100 80GB HBM3", and "L4" does not price an "L40S".

Without a file every model costs zero (``DEFAULT_PRICES``): tokens are metered, spend is 0,
and accelerator time is counted but unpriced.
``prices.example.toml`` beside this module is a complete example.
Spend is fixed when an event is written: changing prices never rewrites history, and the
ledger keeps the three prices each event was charged at.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, NamedTuple

NANO = 1_000_000_000
PER = 1_000_000  # prices are per million tokens
WILDCARD = "*"
DEFAULT_FREE_STATUSES = frozenset({"rejected", "failed"})  # nothing useful was delivered


def to_nano(value: Any, what: str) -> int:
    """A price (currency per million tokens) as an integer of nano units, exactly."""
    if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
        raise ValueError(f"{what}: a price must be a number, got {value!r}")
    try:
        # str() first: 0.1 as a float is not 0.1, its shortest repr is.
        amount = Decimal(str(value)) if not isinstance(value, Decimal) else value
    except InvalidOperation:
        raise ValueError(f"{what}: not a number: {value!r}") from None
    if not amount.is_finite() or amount < 0:
        raise ValueError(f"{what}: a price must be a finite number >= 0, got {value!r}")
    nano = amount * NANO
    if nano != nano.to_integral_value():
        raise ValueError(f"{what}: prices have at most 9 decimal places, got {value!r}")
    return int(nano)


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """Nano currency units per million tokens."""

    input_nano: int = 0
    cached_input_nano: int = 0
    output_nano: int = 0

    @classmethod
    def of(cls, input: Any = 0, output: Any = 0, cached_input: Any = None, *, what: str = "price") -> ModelPrice:
        input_nano = to_nano(input, f"{what}.input")
        cached = input_nano if cached_input is None else to_nano(cached_input, f"{what}.cached_input")
        return cls(input_nano, cached, to_nano(output, f"{what}.output"))


FREE = ModelPrice()


class Charge(NamedTuple):
    spend_nano: int
    price: ModelPrice
    priced: bool  # False: no price for the model (not even "*"), charged zero


def spend_nano(price: ModelPrice, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
    """The spend of one request, rounded half up to a nano unit."""
    # A worker reporting more cached than prompt tokens is wrong; never bill more than the prompt.
    cached = min(max(cached_tokens, 0), max(prompt_tokens, 0))
    uncached = max(prompt_tokens, 0) - cached
    total = uncached * price.input_nano + cached * price.cached_input_nano + max(completion_tokens, 0) * price.output_nano
    whole, rest = divmod(total, PER)
    return whole + (1 if 2 * rest >= PER else 0)


def hourly_cost_nano(per_hour_nano: int, accelerator_s: float) -> int:
    """What ``accelerator_s`` accelerator-seconds cost at ``per_hour_nano`` an hour, rounded
    half up to a nano unit."""
    return int(Decimal(per_hour_nano) * Decimal(repr(max(accelerator_s, 0.0))) / 3600 + Decimal("0.5"))


def _words(name: str) -> tuple[str, ...]:
    return tuple(re.findall(r"[a-z0-9]+", name.lower()))


def _within(key: tuple[str, ...], name: tuple[str, ...]) -> bool:
    """``key``'s words appear in ``name``, together and in order."""
    n = len(key)
    return 0 < n <= len(name) and any(name[i:i + n] == key for i in range(len(name) - n + 1))


@dataclass(frozen=True, slots=True)
class PriceTable:
    models: Mapping[str, ModelPrice] = field(default_factory=dict)
    currency: str = "USD"
    free_statuses: frozenset[str] = DEFAULT_FREE_STATUSES
    accelerators: Mapping[str, int] = field(default_factory=dict)  # nano currency units per accelerator-hour

    def accelerator_price(self, accelerator: str) -> int | None:
        """Nano units per hour of one ``accelerator``; None when the table has no price for it."""
        wanted = accelerator.strip().lower()
        for key, price in self.accelerators.items():
            if key != WILDCARD and key.lower() == wanted:
                return price
        words = _words(accelerator)
        inside = [key for key in self.accelerators if key != WILDCARD and _within(_words(key), words)]
        if inside:
            return self.accelerators[max(inside, key=lambda k: (len(_words(k)), len(k)))]
        return self.accelerators.get(WILDCARD)

    def price_for(self, model: str, base_model: str = "") -> ModelPrice | None:
        """The model's own price; for an adapter without one, its base model's; else "*"."""
        found = self.models.get(model)
        if found is None and base_model:
            found = self.models.get(base_model)
        return found if found is not None else self.models.get(WILDCARD)

    def charge(self, model: str, status: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
               base_model: str = "") -> Charge:
        price = self.price_for(model, base_model)
        if price is None:
            return Charge(0, FREE, False)
        if status in self.free_statuses:
            return Charge(0, price, True)
        return Charge(spend_nano(price, prompt_tokens, cached_tokens, completion_tokens), price, True)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> PriceTable:
        unknown = set(raw) - {"currency", "free_statuses", "models", "accelerators"}
        if unknown:
            raise ValueError(f"unknown price table keys: {sorted(unknown)}")
        models_raw = raw.get("models", {})
        if not isinstance(models_raw, Mapping):
            raise ValueError("models must be a table of model name → prices")
        models: dict[str, ModelPrice] = {}
        for name, entry in models_raw.items():
            if not isinstance(entry, Mapping):
                raise ValueError(f"models.{name}: expected a table with input, cached_input, output")
            bad = set(entry) - {"input", "cached_input", "output"}
            if bad:
                raise ValueError(f"models.{name}: unknown keys {sorted(bad)}")
            models[str(name)] = ModelPrice.of(
                entry.get("input", 0), entry.get("output", 0), entry.get("cached_input"), what=f"models.{name}"
            )
        accelerators_raw = raw.get("accelerators", {})
        if not isinstance(accelerators_raw, Mapping):
            raise ValueError("accelerators must be a table of accelerator name → per_hour")
        accelerators: dict[str, int] = {}
        for name, entry in accelerators_raw.items():
            if not isinstance(entry, Mapping) or set(entry) != {"per_hour"}:
                raise ValueError(f"accelerators.{name}: expected a table with per_hour (and nothing else)")
            accelerators[str(name)] = to_nano(entry["per_hour"], f"accelerators.{name}.per_hour")
        currency = raw.get("currency", "USD")
        if not isinstance(currency, str) or not currency:
            raise ValueError("currency must be a non-empty string")
        free = raw.get("free_statuses", sorted(DEFAULT_FREE_STATUSES))
        if not isinstance(free, Iterable) or isinstance(free, str | bytes):
            raise ValueError("free_statuses must be a list of statuses")
        return cls(models=models, currency=currency, free_statuses=frozenset(str(s) for s in free),
                   accelerators=accelerators)


DEFAULT_PRICES = PriceTable(models={WILDCARD: FREE})


def parse_prices(text: str, *, toml: bool) -> PriceTable:
    # Decimal parsing keeps "0.1" exactly 0.1 (floats would not be).
    raw = tomllib.loads(text, parse_float=Decimal) if toml else json.loads(text, parse_float=Decimal)
    if not isinstance(raw, Mapping):
        raise ValueError("a price table must be a JSON object / TOML document")
    return PriceTable.from_mapping(raw)


def load_prices(path: str | Path | None) -> PriceTable:
    """The price table in ``path`` (JSON, or TOML by extension); the zero table without one."""
    if not path:
        return DEFAULT_PRICES
    path = Path(path)
    try:
        return parse_prices(path.read_text(), toml=path.suffix.lower() == ".toml")
    except (OSError, ValueError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
