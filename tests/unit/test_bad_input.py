"""Every invalid configuration of every module raises a ValueError naming the argument, the value and the fix."""

import pytest

from tests.bad_configs import BadConfig, collect

CASES = collect()


def test_the_table_is_large_and_ids_are_unique() -> None:
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_configuration_is_refused_with_argument_value_and_fix(case: BadConfig) -> None:
    with pytest.raises(ValueError) as info:
        case.build()
    message = str(info.value)
    assert case.argument in message, f"the message does not name the argument `{case.argument}`: {message}"
    assert case.value in message, f"the message does not show the value {case.value}: {message}"
    assert "Fix:" in message, f"the message gives no fix: {message}"


#: unknown options of the sharded strategies, and the option each one meant
MEANT = {"sharded-site-size": "shard_size", "sharded-misspelt-option": "shard_size",
         "fabric-sharded-site-size": "shard_size", "fabric-sharded-misspelt-option": "compressor"}


@pytest.mark.parametrize("case", [c for c in CASES if c.id in MEANT], ids=lambda c: c.id)
def test_an_unknown_sharded_option_names_the_one_meant(case: BadConfig) -> None:
    """`ShardedGradCompStrategy(site_size=2)` (the DDP engine's option) and a misspelt option name the option meant
    ("did you mean"), as a ValueError that is also the TypeError Python raises for an unknown keyword."""
    with pytest.raises(TypeError) as info:
        case.build()
    assert f"Fix: did you mean {MEANT[case.id]!r}?" in str(info.value), str(info.value)
    assert isinstance(info.value, ValueError)
