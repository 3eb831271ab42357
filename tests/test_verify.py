"""The greedy check of miniserve/runners/verify.py on hand-built logits: what it accepts and
rejects."""

import torch

from miniserve.runners.verify import BOUND_BFLOAT16, BOUND_FLOAT32, bound_for, check_greedy


def rows(*pairs):
    """One row per step: {token: logit}, every other token at -10."""
    out = torch.full((len(pairs), 8), -10.0, dtype=torch.float64)
    for i, logits in enumerate(pairs):
        for token, value in logits.items():
            out[i, token] = value
    return out


def test_a_decided_step_must_take_the_top_token():
    reference = rows({1: 5.0, 2: 4.0}, {3: 7.0, 4: 6.9})
    assert check_greedy(reference, [1, 3], 0.01).ok
    result = check_greedy(reference, [2, 3], 0.01)
    assert not result.ok and result.wrong == [(0, 2, 1, 1.0)]
    assert result.decided == 2 and result.first_undecided == 2


def test_a_near_tie_may_go_either_way_but_not_further():
    reference = rows({1: 5.0, 2: 4.999, 3: 4.5})
    for token in (1, 2):
        result = check_greedy(reference, [token], 0.01)
        assert result.ok and result.decided == 0 and result.first_undecided == 0
    assert not check_greedy(reference, [3], 0.01).ok  # 0.5 below the top: not a tie


def test_the_margin_is_twice_the_bound():
    reference = rows({1: 5.0, 2: 4.0})
    assert check_greedy(reference, [1], 0.49).decided == 1
    assert check_greedy(reference, [1], 0.5).decided == 0  # 1.0 is not > 2 x 0.5
    assert check_greedy(reference, [2], 0.5).ok


def test_bounds_by_arithmetic():
    assert bound_for(torch.float32) == BOUND_FLOAT32 < bound_for(torch.bfloat16) == BOUND_BFLOAT16


def test_an_end_step_is_checked_with_the_nearest_end_token():
    reference = rows({1: 5.0, 2: 4.0}, {6: 3.0, 7: 2.0, 5: 0.0})
    assert check_greedy(reference, [1], 0.01, end_ids={6, 5}).ok  # stopped on 6: the top
    result = check_greedy(reference, [1], 0.01, end_ids={7, 5})  # no end token was the top
    assert not result.ok and result.steps == 2 and result.wrong[0][:3] == (1, 7, 6)
