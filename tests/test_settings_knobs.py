"""Every EngineSettings knob is described once (field metadata), its range is the validation's, and
`fitted_to` is the one fit-to-model rule (the same answers as Profile.settings_for today)."""

from __future__ import annotations

import dataclasses

import pytest

from engine.settings import EngineSettings, knobs

KEYS = {"label", "short", "help", "unit", "range", "flag"}


def test_every_field_is_described():
    fields = dataclasses.fields(EngineSettings)
    # Every field is a knob but those marked otherwise (synthetic_rates, a measurement mode), which still say
    # what they are.
    others = [f for f in fields if f.metadata.get("knob", True) is False]
    assert [f.name for f in others] == ["synthetic_rates"]
    assert all(set(f.metadata) == {"knob", "help"} and len(f.metadata["help"]) > 20 for f in others)
    fields = [f for f in fields if f not in others]
    assert [k.name for k in knobs()] == [f.name for f in fields]
    for f in fields:
        assert set(f.metadata) == KEYS, f.name
        assert f.metadata["label"] and f.metadata["short"] and len(f.metadata["help"]) > 20, f.name
        assert f.metadata["flag"].startswith("--") and " " not in f.metadata["flag"], f.name
    assert len({k.flag for k in knobs()}) == len(knobs()) == len({k.short for k in knobs()})


@pytest.mark.parametrize("knob", knobs(), ids=lambda k: k.name)
def test_ranges_agree_with_the_validation(knob):
    ok = EngineSettings().replace
    if knob.type is bool:
        assert knob.range is None and knob.unit is None
        ok(**{knob.name: not knob.default})
        with pytest.raises(ValueError, match="true or false"):
            ok(**{knob.name: 1})
        return
    lo, hi = knob.range
    assert lo <= knob.default and (hi is None or knob.default <= hi)
    step = 1 if knob.type is int else 1e-6
    assert getattr(ok(**{knob.name: lo}), knob.name) == lo
    with pytest.raises(ValueError, match=knob.name):
        ok(**{knob.name: lo - step})
    if hi is None:
        ok(**{knob.name: 10**9})
    else:
        assert getattr(ok(**{knob.name: hi}), knob.name) == hi
        with pytest.raises(ValueError, match=knob.name):
            ok(**{knob.name: hi + step})
    with pytest.raises(ValueError, match=knob.name):
        ok(**{knob.name: True})


def test_fitted_to_without_a_fraction():
    s = EngineSettings(sub_vocab=5000)
    assert s.fitted_to(4096).sub_vocab == 0  # larger than the vocabulary: all
    assert s.fitted_to(5000) is s and s.fitted_to(151_936) is s
    assert EngineSettings().fitted_to(10) == EngineSettings()


def test_fitted_to_with_a_fraction():
    s = EngineSettings(sub_vocab=123, draft_depth=5)
    assert s.fitted_to(1000, 0.25) == s.replace(sub_vocab=250)
    assert s.fitted_to(1000, 1.0).sub_vocab == 0  # the whole vocabulary is "all"
    assert s.fitted_to(1000, 0.0001).sub_vocab == 1  # never 0 by rounding down
    assert s.fitted_to(1000, 0.25).draft_depth == 5


def test_fitted_to_is_the_profile_rule():
    from app.profiles import Profile

    for sub in (0, 1, 300, 4095, 4096, 4097, 200_000):
        for fraction in (None, 0.0001, 0.1, 0.5, 0.9999, 1.0):
            for vocab in (300, 4096, 151_936):
                s = EngineSettings(sub_vocab=sub)
                want = Profile(name="", settings=s, sub_vocab_fraction=fraction).settings_for(vocab)
                assert s.fitted_to(vocab, fraction) == want, (sub, fraction, vocab)
