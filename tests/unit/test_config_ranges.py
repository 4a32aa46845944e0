"""Every Config field and its RLINK_* variable refuse NaN, infinities, negatives and values out
of range with a ConfigError naming the setting (and the variable)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from rlink_ucx import Config, ConfigError

FIELDS = dataclasses.fields(Config)
NUMERIC = [f for f in FIELDS if type(f.default) in (int, float)]
BOOLS = [f for f in FIELDS if type(f.default) is bool]
STRINGS = [f for f in FIELDS if type(f.default) is str]
BAD_NUMBERS = [math.nan, math.inf, -math.inf, -1, 10**30, 1e300]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for f in FIELDS:
        monkeypatch.delenv(f"RLINK_{f.name.upper()}", raising=False)


def test_every_field_has_a_rule() -> None:
    # A field of another type would go unchecked: extend config._checked before adding one.
    assert len(NUMERIC) + len(BOOLS) + len(STRINGS) == len(FIELDS)
    assert NUMERIC and BOOLS and STRINGS


@pytest.mark.parametrize("field", NUMERIC, ids=lambda f: f.name)
@pytest.mark.parametrize("bad", BAD_NUMBERS, ids=repr)
def test_numbers_out_of_range_are_refused(field: dataclasses.Field, bad: float) -> None:
    with pytest.raises(ConfigError, match=rf"^Config\.{field.name} must be"):
        Config(**{field.name: bad})


@pytest.mark.parametrize("field", NUMERIC, ids=lambda f: f.name)
@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "-1", "1e30", "1e400", "NaN"])
def test_variables_out_of_range_name_the_variable(field: dataclasses.Field, raw: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    var = f"RLINK_{field.name.upper()}"
    monkeypatch.setenv(var, raw)
    with pytest.raises(ConfigError, match=rf"^{var}='{raw}'.*Config\.{field.name}"):
        Config()
    with pytest.raises(ConfigError, match=rf"^{var}="):
        Config.from_env()


@pytest.mark.parametrize("field", NUMERIC, ids=lambda f: f.name)
def test_zero_only_where_it_switches_a_feature_off(field: dataclasses.Field) -> None:
    from rlink_ucx.config import _MAY_BE_ZERO

    if field.name in _MAY_BE_ZERO:
        assert getattr(Config(**{field.name: 0}), field.name) == 0
    else:
        with pytest.raises(ConfigError, match=rf"Config\.{field.name}"):
            Config(**{field.name: 0})


@pytest.mark.parametrize("field", [f for f in NUMERIC if type(f.default) is int], ids=lambda f: f.name)
def test_counts_and_sizes_are_whole_numbers(field: dataclasses.Field, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=rf"Config\.{field.name} must be a whole number"):
        Config(**{field.name: field.default + 0.5})
    var = f"RLINK_{field.name.upper()}"
    monkeypatch.setenv(var, f"{field.default}.5")
    with pytest.raises(ConfigError, match=rf"{var}="):
        Config()
    monkeypatch.setenv(var, f"{float(field.default)!r}")  # integral ("1048576.0"): taken, as an int
    value = getattr(Config(), field.name)
    assert value == field.default and type(value) is int


@pytest.mark.parametrize("field", NUMERIC, ids=lambda f: f.name)
def test_in_range_values_are_kept(field: dataclasses.Field, monkeypatch: pytest.MonkeyPatch) -> None:
    value = getattr(Config(**{field.name: field.default}), field.name)
    assert value == field.default and type(value) is type(field.default)
    monkeypatch.setenv(f"RLINK_{field.name.upper()}", str(field.default))
    assert getattr(Config(), field.name) == field.default


def test_numpy_numbers_become_python_numbers() -> None:
    cfg = Config(put_timeout=np.float32(2.5), max_fields=np.int64(7))
    assert cfg.put_timeout == 2.5 and type(cfg.put_timeout) is float
    assert cfg.max_fields == 7 and type(cfg.max_fields) is int


def test_reported_cases() -> None:
    with pytest.raises(ConfigError, match=r"Config\.preauth_timeout must be > 0 and finite"):
        Config(preauth_timeout=math.inf)
    with pytest.raises(ConfigError, match=r"Config\.preauth_timeout"):
        Config(preauth_timeout=math.nan)
    with pytest.raises(ConfigError, match=r"Config\.max_handshakes must be a whole number"):
        Config(max_handshakes=math.inf)
    with pytest.raises(ConfigError, match=r"Config\.rank_port_base must be a whole number from 0 to 65535"):
        Config(rank_port_base=70000)


@pytest.mark.parametrize("field", BOOLS, ids=lambda f: f.name)
def test_switches(field: dataclasses.Field, monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (2, -1, math.nan, "yes", None):
        with pytest.raises(ConfigError, match=rf"Config\.{field.name} must be True or False"):
            Config(**{field.name: bad})
    var = f"RLINK_{field.name.upper()}"
    for raw, value in (("0", False), ("off", False), ("No", False), ("1", True), ("TRUE", True), ("on", True)):
        monkeypatch.setenv(var, raw)
        assert getattr(Config(), field.name) is value
    monkeypatch.setenv(var, "maybe")  # once read as False, silently
    with pytest.raises(ConfigError, match=rf"{var}='maybe' is not one of .*Config\.{field.name}"):
        Config()


@pytest.mark.parametrize("field", NUMERIC + STRINGS, ids=lambda f: f.name)
def test_wrong_types_are_refused(field: dataclasses.Field) -> None:
    bad = 5 if type(field.default) is str else "5"
    with pytest.raises(ConfigError, match=rf"Config\.{field.name} must be"):
        Config(**{field.name: bad})
    with pytest.raises(ConfigError, match=rf"Config\.{field.name}"):
        Config(**{field.name: None})
