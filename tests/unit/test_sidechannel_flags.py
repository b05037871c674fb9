"""The side-channel bench's size flags come from `ProbeConfig`'s fields: every field has a flag with the
field's default, and the flags build the config back."""

import argparse
from dataclasses import fields

from loadtests.bench.sidechannel import ProbeConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    ProbeConfig.add_flags(p)
    return p


def test_no_flags_give_the_default_config():
    assert ProbeConfig.from_args(_parser().parse_args([])) == ProbeConfig()


def test_every_field_is_a_flag_that_reaches_the_config():
    names = [f.name for f in fields(ProbeConfig)]
    argv = []
    for i, name in enumerate(names):
        argv += ["--" + name.replace("_", "-"), str(1000 + i)]
    cfg = ProbeConfig.from_args(_parser().parse_args(argv))
    assert [getattr(cfg, n) for n in names] == [1000 + i for i in range(len(names))]
    assert "warmup" in names  # had no flag before the flags were built from the fields


def test_every_flag_has_help():
    helps = {a.dest: a.help for a in _parser()._actions if a.dest != "help"}
    assert set(helps) == {f.name for f in fields(ProbeConfig)}
    assert all(helps.values())
