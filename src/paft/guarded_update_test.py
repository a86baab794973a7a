"""Tests for paft.guarded_update's console line (the attempts themselves run in protect_test)."""

from __future__ import annotations

from paft.guard import GuardVerdict
from paft.guarded_update import verdict_line


def test_a_clean_recompute_names_the_detection_it_answers() -> None:
    assert verdict_line(7, 0, GuardVerdict("recompute", "grad_mismatch", [1])) == (
        "[guard] step 7 attempt 0: grad_mismatch on rank(s) [1] -> recompute")
    assert verdict_line(7, 1, GuardVerdict("proceed", "grad_mismatch", [1], "transient")) == (
        "[guard] step 7 attempt 1: clean recompute (of grad_mismatch on rank(s) [1]) -> proceed, cause transient")


def test_a_level_shift_on_a_recompute_is_no_clean_recompute() -> None:
    # The spike reproduced once more and is applied as the new level: the line called it
    # "clean recompute (of level_shift)", as if the fault had gone.
    assert verdict_line(23, 1, GuardVerdict("proceed", "level_shift", [], "data")) == (
        "[guard] step 23 attempt 1: level_shift -> proceed, cause data")
