"""The report's sections are numbered in order over those it shows: no gaps (it once showed
1, 2, 7 for the main grid alone)."""

from dpadapter.stages.report import SECTIONS, section_titles


def test_the_main_grid_alone_is_numbered_1_2_3():
    titles = section_titles({"finetune", "upstream", "speed"})
    assert [titles[k] for k in ("finetune", "upstream", "speed")] == [
        "1. Fine-tuning",
        "2. Upstream robustness",
        "3. Speed",
    ]
    assert titles["sweeps"] == titles["upstream"]


def test_every_section_present_keeps_the_order_and_sorts_by_name():
    every = {k for k, _ in SECTIONS}
    titles = section_titles(every)
    shown = [titles[k] for k, _ in SECTIONS]
    assert [t.split(".")[0] for t in shown] == [str(i) for i in range(1, len(SECTIONS) + 1)]
    assert sorted(shown) == shown
    some = section_titles({"finetune", "upstream", "audit", "speed"})
    assert (some["audit"], some["speed"]) == ("3. Audit", "4. Speed")
