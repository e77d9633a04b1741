"""Evaluation counts every validation item once at any process count (issue 33): each objective's
step-0 evaluation, every value of its eval line, on 2 processes x batch 4 equals 1 process x batch 8,
on validation splits that are no whole number of global batches (tests/evaluation_ranks.py), chat's
under FSDP2, where the rank left without items still joins every forward."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import warm
from evaluation_ranks import CASES, THIS, evaluations, write_data


@pytest.mark.slow
def test_two_processes_evaluate_every_objective_as_one_does(tmp_path):
    write_data(tmp_path)
    with ThreadPoolExecutor(1) as pool:  # the one-process reference is computed while the ranks start
        two = pool.submit(warm, 2, [str(tmp_path), "4"], cwd=tmp_path, timeout=300, script=THIS)
        one = evaluations(tmp_path, 8)
        two = json.loads(two.result().stdout.strip().splitlines()[-1])
    assert set(one) == set(two) == set(CASES)
    for case in CASES:
        assert one[case]["valid"] % 8 and one[case].keys() == two[case].keys(), (case, one[case], two[case])
        for key, value in one[case].items():  # values of ~100 (log-probs, perplexity) held in float32: relative
            assert two[case][key] == pytest.approx(value, rel=1e-6, abs=1e-6), (case, key, one[case], two[case])
