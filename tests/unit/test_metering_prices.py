"""Metering prices: the spend formula, exact integer arithmetic, price files."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.metering.prices import (
    DEFAULT_PRICES,
    FREE,
    ModelPrice,
    PriceTable,
    load_prices,
    parse_prices,
    spend_nano,
    to_nano,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "services" / "metering" / "prices.example.toml"


def test_to_nano_is_exact_for_decimal_prices() -> None:
    assert to_nano(0.1, "p") == 100_000_000  # a float 0.1 is not 0.1; its shortest repr is
    assert to_nano("0.000000001", "p") == 1
    assert to_nano(Decimal("2.5"), "p") == 2_500_000_000
    assert to_nano(3, "p") == 3_000_000_000


@pytest.mark.parametrize("bad", [-1, "abc", float("nan"), float("inf"), "0.0000000001", True, None, [1]])
def test_to_nano_rejects_bad_prices(bad: object) -> None:
    with pytest.raises(ValueError):
        to_nano(bad, "models.x.input")


def test_spend_bills_cached_tokens_at_the_cached_price() -> None:
    # $1/M input, $0.25/M cached input, $2/M output
    price = ModelPrice.of(input=1, cached_input="0.25", output=2)
    # 1000 prompt tokens of which 600 cached, 500 completion:
    # 400 × 1 + 600 × 0.25 + 500 × 2 = 400 + 150 + 1000 = 1550 per million = $0.00155
    assert spend_nano(price, 1000, 600, 500) == 1_550_000
    # no cache hits: the whole prompt at the input price
    assert spend_nano(price, 1000, 0, 0) == 1_000_000


def test_cached_price_defaults_to_the_input_price() -> None:
    price = ModelPrice.of(input="0.5", output=1)
    assert price.cached_input_nano == price.input_nano == 500_000_000
    assert spend_nano(price, 100, 100, 0) == spend_nano(price, 100, 0, 0)


def test_more_cached_than_prompt_never_bills_beyond_the_prompt() -> None:
    price = ModelPrice.of(input=1, cached_input=0, output=0)
    # a worker bug (cached > prompt) must not produce negative uncached tokens
    assert spend_nano(price, 10, 50, 0) == 0
    assert spend_nano(price, 10, 4, 0) == 6000  # 6 uncached tokens × $1/M = 6000 nano


def test_rounding_is_half_up_once_per_event() -> None:
    price = ModelPrice(input_nano=1, cached_input_nano=0, output_nano=0)  # 1 nano per million tokens
    assert spend_nano(price, 499_999, 0, 0) == 0
    assert spend_nano(price, 500_000, 0, 0) == 1
    assert spend_nano(price, 1_499_999, 0, 0) == 1
    assert spend_nano(price, 1_500_000, 0, 0) == 2


@given(
    prices=st.tuples(*[st.integers(0, 10**13)] * 3),
    tokens=st.tuples(st.integers(0, 2**32), st.integers(0, 2**32), st.integers(0, 2**32)),
)
def test_spend_matches_exact_rational_arithmetic(prices: tuple[int, int, int], tokens: tuple[int, int, int]) -> None:
    price = ModelPrice(*prices)
    prompt, cached, completion = tokens
    cached_billed = min(cached, prompt)
    exact = Fraction((prompt - cached_billed) * prices[0] + cached_billed * prices[1] + completion * prices[2], 10**6)
    got = spend_nano(price, prompt, cached, completion)
    assert -Fraction(1, 2) < got - exact <= Fraction(1, 2)  # nearest, ties up


def test_price_table_lookup_wildcard_and_free_statuses() -> None:
    table = PriceTable(models={"big": ModelPrice.of(input=1, output=1), "*": ModelPrice.of(input=2, output=2)})
    assert table.charge("big", "finished", 1_000_000, 0, 0).spend_nano == 10**9
    assert table.charge("other", "finished", 1_000_000, 0, 0).spend_nano == 2 * 10**9
    charge = table.charge("big", "rejected", 1_000_000, 0, 0)
    assert charge.spend_nano == 0 and charge.priced  # counted, not charged
    assert table.charge("big", "failed", 1_000_000, 0, 10).spend_nano == 0
    assert table.charge("big", "cancelled", 0, 0, 1_000_000).spend_nano == 10**9  # tokens delivered are billed
    no_wildcard = PriceTable(models={"big": ModelPrice.of(input=1)})
    unknown = no_wildcard.charge("other", "finished", 10**6, 0, 0)
    assert unknown.spend_nano == 0 and not unknown.priced and unknown.price == FREE


def test_an_adapter_costs_its_own_price_else_its_base_models() -> None:
    """An adapter's usage is recorded under its own name: without a price of its own it
    costs what its base model costs, not the "*" price or nothing."""
    table = PriceTable(models={"base": ModelPrice.of(input=1), "tuned": ModelPrice.of(input=3),
                               "*": ModelPrice.of(input=2)})
    assert table.charge("tuned", "finished", 10**6, 0, 0, base_model="base").spend_nano == 3 * 10**9
    assert table.charge("other-adapter", "finished", 10**6, 0, 0, base_model="base").spend_nano == 10**9
    assert table.charge("other-adapter", "finished", 10**6, 0, 0, base_model="unpriced").spend_nano == 2 * 10**9


def test_default_table_is_all_zero() -> None:
    charge = DEFAULT_PRICES.charge("any-model", "finished", 10**9, 10, 10**9)
    assert charge.spend_nano == 0 and charge.priced


def test_parse_json_and_toml_agree() -> None:
    json_text = """{"currency": "EUR", "free_statuses": ["rejected"],
                   "models": {"m": {"input": 0.1, "cached_input": 0.025, "output": 0.4}}}"""
    toml_text = """currency = "EUR"
free_statuses = ["rejected"]
[models.m]
input = 0.1
cached_input = 0.025
output = 0.4
"""
    a, b = parse_prices(json_text, toml=False), parse_prices(toml_text, toml=True)
    assert a == b
    assert a.currency == "EUR" and a.free_statuses == frozenset({"rejected"})
    assert a.models["m"] == ModelPrice(100_000_000, 25_000_000, 400_000_000)


@pytest.mark.parametrize(
    "text",
    [
        '{"models": {"m": {"input": -1}}}',
        '{"models": {"m": {"inptu": 1}}}',
        '{"modles": {}}',
        '{"models": {"m": 3}}',
        '{"models": [], "currency": "USD"}',
        '{"currency": ""}',
        '{"free_statuses": "rejected"}',
        "[1, 2]",
        "not json",
    ],
)
def test_bad_price_files_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_prices(text, toml=False)


def test_load_prices_reads_the_shipped_example(tmp_path: Path) -> None:
    table = load_prices(EXAMPLE)
    assert table.currency == "USD"
    assert table.models["sim-llama-8b"] == ModelPrice.of(input="0.10", cached_input="0.025", output="0.40")
    assert table.price_for("unlisted") == ModelPrice.of(input="0.20", output="0.80")
    assert load_prices(None) is DEFAULT_PRICES
    bad = tmp_path / "prices.json"
    bad.write_text('{"models": {"m": {"input": "x"}}}')
    with pytest.raises(ValueError, match=r"prices\.json"):
        load_prices(bad)
