"""`lcx.configs.strict_from_dict`: the one builder of a config dataclass from a dict."""

from __future__ import annotations

import dataclasses

import pytest

from lcx.configs import strict_from_dict


@dataclasses.dataclass(frozen=True)
class Cfg:
    model: str
    lengths: tuple[int, ...] = (256,)
    notes: dict = dataclasses.field(default_factory=dict)
    derived: int = dataclasses.field(default=0, init=False)


def test_builds_with_defaults():
    assert strict_from_dict(Cfg, {"model": "m"}) == Cfg("m")
    assert strict_from_dict(Cfg, {"model": "m", "lengths": (1, 2), "notes": {"a": 1}}) == Cfg("m", (1, 2), {"a": 1})


def test_unknown_keys_are_named_with_the_accepted_ones():
    accepted = r"accepted: \['lengths', 'model', 'notes'\]"
    with pytest.raises(ValueError, match=r"unknown Cfg key\(s\) \['lenghts'\]; " + accepted):
        strict_from_dict(Cfg, {"model": "m", "lenghts": (1,)})
    with pytest.raises(ValueError, match="derived"):  # a field the constructor does not take
        strict_from_dict(Cfg, {"model": "m", "derived": 1})


def test_missing_required_keys_are_named():
    with pytest.raises(ValueError, match=r"Cfg: missing key\(s\) \['model'\]"):
        strict_from_dict(Cfg, {"lengths": (1,)})


def test_engine_config_uses_it():
    from lcx.engine.params import EngineConfig

    with pytest.raises(ValueError, match="unknown EngineConfig key"):
        EngineConfig.from_dict({"max_batch": 2, "max_batches": 3})
