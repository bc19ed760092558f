"""Scores are printed as the paper prints them (B.3): one decimal, rounded half up."""

from actionopd_jax.eval.report import markdown_table, percent


def test_half_up_not_half_even():
    # 1/16 = 6.25%: Python's "{:.1f}" gives 6.2 (half to even on the binary value); the paper's 6.3
    assert f"{100 * (1 / 16):.1f}" == "6.2"
    assert percent(1 / 16) == "6.3"
    assert percent(3 / 16) == "18.8"       # 18.75
    assert percent(0.0) == "0.0" and percent(1.0) == "100.0"
    assert percent(33 / 200) == "16.5"     # no half at the second decimal: unchanged
    assert percent(1 / 3) == "33.3" and percent(2 / 3) == "66.7"
    # a float a hair under its decimal value (0.1455 * 100 = 14.549999999999999) is taken at that value
    assert 0.1455 * 100 < 14.55 and f"{0.1455 * 100:.1f}" == "14.5" and percent(0.1455) == "14.6"


def test_the_table_uses_it():
    table = markdown_table([{"env": "tau2_airline", "group": "base", "episodes": 16, "pass^1": 1 / 16}])
    assert "| 6.3 |" in table and "6.2" not in table
