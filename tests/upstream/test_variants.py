import pytest

from dpadapter.upstream.variants import format_variant, parse_variant


def test_round_trip_and_types():
    name = format_variant("dpadapter", gamma=0.5, m1=2000)
    assert name == "dpadapter+gamma=0.5+m1=2000"
    assert parse_variant(name) == ("dpadapter", {"gamma": 0.5, "m1": 2000})
    assert parse_variant("standard") == ("standard", {})


@pytest.mark.parametrize("bad", ["dpadapter+gamma", "dpadapter+gamma=abc", "../etc", "DPA"])
def test_bad_names_are_rejected(bad):
    with pytest.raises(ValueError, match="bad upstream name"):
        parse_variant(bad)
