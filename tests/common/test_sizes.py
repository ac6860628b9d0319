"""parse_size and format_size: sizes as users write them."""

from __future__ import annotations

import re

import pytest

from offload.common.errors import OffloadError
from offload.common.sizes import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("512MiB", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1.5G", 3 * 2**29),
        ("100", 100),
        ("0", 0),
        ("7B", 7),
        ("10KB", 10_000),
        ("3KiB", 3 * 1024),
        ("1k", 1024),
        ("2M", 2 * 2**20),
        ("1T", 2**40),
        ("1TB", 10**12),
        ("2TiB", 2 * 2**40),
        ("8gib", 8 * 2**30),
        ("8GIB", 8 * 2**30),
        ("8 GiB", 8 * 2**30),
        ("  8GiB\t", 8 * 2**30),
        (" 250 mb ", 250 * 10**6),
        ("0.5KiB", 512),
        (100, 100),
        (0, 0),
        (2**40, 2**40),
    ],
)
def test_parse_size(text: str | int, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize(
    "text", ["", "   ", "abc", "GiB", "1.5.2G", "-1G", "1e9", "12 parsecs", "8 G iB", "1,5G", "5 GiB B"]
)
def test_parse_size_rejects_text_naming_field_and_value(text: str) -> None:
    with pytest.raises(OffloadError) as info:
        parse_size(text, what="--kv-cache")
    message = str(info.value)
    assert message.startswith("--kv-cache: ")
    assert repr(text) in message


def test_parse_size_default_field_name() -> None:
    with pytest.raises(OffloadError, match=r"^size: cannot read 'lots' as a size"):
        parse_size("lots")


def test_parse_size_rejects_negative_int_naming_field_and_value() -> None:
    with pytest.raises(OffloadError, match=r"^--cpu-memory: -5 is negative$"):
        parse_size(-5, what="--cpu-memory")


@pytest.mark.parametrize(("text", "nbytes"), [("4.1GB", 4_100_000_000), ("2.01KB", 2010), ("8.2MB", 8_200_000)])
def test_parse_size_exact_for_decimal_fractions(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (10 * 2**20, "10.0 MiB"),
        (3 * 2**29, "1.5 GiB"),
        (2**40, "1.0 TiB"),
        (2**50, "1024.0 TiB"),  # TiB is the largest unit
    ],
)
def test_format_size(nbytes: int, text: str) -> None:
    assert format_size(nbytes) == text


@pytest.mark.parametrize("text", ["1.5 KiB", "10.0 MiB", "1.5 GiB", "2.0 TiB"])
def test_format_size_round_trips_through_parse_size(text: str) -> None:
    assert format_size(parse_size(text)) == text


def test_format_size_picks_the_unit_after_rounding() -> None:
    assert format_size(2**20 - 1) == "1.0 MiB"
    assert format_size(1023) == "1023 B"


def test_max_memory_dict_maps_accelerate_keys_to_tiers():
    from offload.common.config import EngineConfig
    from offload.common.sizes import parse_max_memory

    assert parse_max_memory({0: "2GiB", "cpu": "500MB", "disk": 10**9}) == {
        "device": 2 << 30,
        "host": 500 * 10**6,
        "disk": 10**9,
    }
    assert parse_max_memory({"cuda:0": "1KiB", "host": "1KiB"}) == {"device": 1024, "host": 1024}
    config = EngineConfig.from_max_memory({"cuda": "3GiB", "cpu": "1GiB"}, block_size=32)
    assert (config.device_memory, config.host_memory, config.block_size) == (3 << 30, 1 << 30, 32)


@pytest.mark.parametrize(
    ("budgets", "message"),
    [({"tpu": "1GiB"}, "'tpu'"), ({0: "1GiB", "gpu": "2GiB"}, "second time"), ({"cpu": "lots"}, "max_memory['cpu']")],
)
def test_max_memory_errors_name_the_key(budgets, message):
    from offload.common.sizes import parse_max_memory

    with pytest.raises(OffloadError, match=re.escape(message)):
        parse_max_memory(budgets)
