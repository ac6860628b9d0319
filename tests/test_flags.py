"""Settings declared once: the flags come from the config's knobs, and docs/flags.md from the flags."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from offload.cli import build_parser, engine_config, flag_reference
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError
from offload.common.knobs import GROUPS, add_flags, flag_name, from_args, knob, knobs
from offload.server.settings import ServeSettings

ROOT = Path(__file__).resolve().parents[1]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["generate", *argv])


def test_the_flag_reference_is_the_generated_one():
    stale = (ROOT / "docs" / "flags.md").read_text() != flag_reference()
    assert not stale, "docs/flags.md differs from the flags' declarations: run `make docs`"


@pytest.mark.parametrize("cls", [EngineConfig, SamplingParams, ServeSettings])
def test_every_setting_is_a_knob_with_a_flag_in_a_group(cls):
    declared = {f.name for f, _ in knobs(cls)}
    asked = {"logprobs", "prompt_logprobs", "prompt_logprobs_start"}  # requests ask for logprobs
    assert declared == {f.name for f in dataclasses.fields(cls)} - asked
    reference = flag_reference()
    for f, k in knobs(cls):
        assert k.group in GROUPS
        assert f"`{flag_name(f, k)}" in reference, f.name


def test_generate_and_serve_and_batch_share_every_engine_flag():
    flags = {flag_name(f, k) for f, k in knobs(EngineConfig)}
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("generate", "serve", "batch"):
        options = {o for a in sub.choices[name]._actions for o in a.option_strings}
        assert flags <= options, (name, flags - options)


def test_unset_flags_leave_the_config_defaults_and_set_ones_are_read_as_declared():
    assert engine_config(parse()) == EngineConfig()
    config = engine_config(
        parse("--device-memory", "600MB", "--kv-cache-memory", "1MiB", "--no-prefix-cache", "--kv-group-size", "64")
    )
    assert config == EngineConfig(
        device_memory=600_000_000, kv_cache_bytes=1 << 20, prefix_cache=False, kv_group_size=64
    )
    params = from_args(SamplingParams, parse("--stop", "a", "--stop", "b", "--temperature", "0.5", "--ignore-eos"))
    assert params == SamplingParams(stop=("a", "b"), temperature=0.5, ignore_eos=True)
    # numbers whose default is None are read as numbers all the same
    assert engine_config(parse("--max-num-seqs", "4")).max_num_seqs == 4
    assert from_args(SamplingParams, parse("--seed", "7")).seed == 7


def test_a_bad_size_names_its_flag():
    with pytest.raises(OffloadError, match="--kv-host-memory: cannot read '12 parsecs'"):
        engine_config(parse("--kv-host-memory", "12 parsecs"))


def test_a_bad_choice_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse("--kv-group-size", "48")
    assert "--kv-group-size" in capsys.readouterr().err


def test_generate_help_is_one_line_a_flag(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "usage: offload generate [options]"
    wrapped = [line for line in out if line.startswith(" " * 20)]  # a help text continued on a second line
    assert len(wrapped) <= 8, wrapped
    for title in {GROUPS[k.group] for cls in (EngineConfig, SamplingParams) for _, k in knobs(cls)}:
        assert f"{title}:" in out


def test_serve_flags_are_the_serve_settings(monkeypatch, tmp_path):
    parse_serve = build_parser().parse_args
    monkeypatch.delenv("OFFLOAD_API_KEY", raising=False)
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path))
    assert from_args(ServeSettings, parse_serve(["serve"])) == ServeSettings()
    settings = from_args(
        ServeSettings, parse_serve(["serve", "--max-waiting", "4", "--port", "9000", "--api-key", "k"])
    )
    assert settings == ServeSettings(max_waiting=4, port=9000, api_key="k")
    # what the flags leave open, filled in for the model as `offload serve` does
    assert ServeSettings().for_model(Path("models/m")) == ServeSettings(
        model_name="m", batch_dir=tmp_path / "batches" / "m"
    )
    monkeypatch.setenv("OFFLOAD_API_KEY", "env")
    given = ServeSettings(model_name="n", api_key="k", batch_dir="~/b").for_model(Path("m"))
    assert given == ServeSettings(model_name="n", api_key="k", batch_dir=Path.home() / "b")
    assert ServeSettings().for_model(Path("m")).api_key == "env"


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (("--max-waiting", "-1"), "max_waiting must be >= 0, got -1"),
        (("--drain-timeout", "-2"), "drain_timeout must be >= 0, got -2.0"),
    ],
)
def test_bad_serve_settings_name_the_value(flags, match):
    with pytest.raises(OffloadError, match=match):
        from_args(ServeSettings, build_parser().parse_args(["serve", *flags]))


def test_a_knob_declares_its_flag():
    @dataclasses.dataclass(frozen=True)
    class Settings:
        size: int | None = knob(None, "budgets", "a size", size=True)
        on: bool = knob(True, "kv", "do the thing")
        name: str = knob("a", "io", "a name", choices=("a", "b"))

    parser = argparse.ArgumentParser()
    add_flags(parser, Settings)
    assert from_args(Settings, parser.parse_args([])) == Settings()
    args = parser.parse_args(["--size", "2KiB", "--no-on", "--name", "b"])
    assert from_args(Settings, args) == Settings(2048, False, "b")
