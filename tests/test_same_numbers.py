"""scripts/same_numbers.py: a record holds what each run logged by step; compare passes two equal records and
names the first value that differs, by its bits, in two that are not."""

from __future__ import annotations

import json
import sys

from helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import same_numbers  # noqa: E402


def test_compare_passes_equal_records_and_names_the_first_difference(tmp_path, capsys):
    logged = [[1, "loss", 4.125], [1, "grad_norm", 0.5], [2, "loss", 3.75]]
    before, same, other, short = (tmp_path / f"{n}.json" for n in ("before", "same", "other", "short"))
    before.write_text(json.dumps({"cp 2": logged}))
    same.write_text(json.dumps({"cp 2": [list(x) for x in logged]}))
    other.write_text(json.dumps({"cp 2": [*logged[:2], [2, "loss", 3.75 + 2 ** -50]]}))  # one bit in the mantissa
    short.write_text(json.dumps({"cp 2": logged[:2]}))
    assert same_numbers.main(["compare", str(before), str(same)]) == 0
    assert "cp 2: the same, bit for bit (3 values)" in capsys.readouterr().out
    assert same_numbers.main(["compare", str(before), str(other)]) == 1
    assert "cp 2: step 2 loss: 3.75 then 3.750000000000001" in capsys.readouterr().out
    assert same_numbers.main(["compare", str(before), str(short)]) == 1
    assert "3 values then 2" in capsys.readouterr().out
    assert same_numbers.main(["compare", str(before), str(tmp_path / "before.json")]) == 0


def test_every_run_it_records_composes_and_passes_the_checks():
    """Each of the runs a record makes is a config trainloop accepts (a typo would only show in a long record)."""
    from trainloop.config.compose import check_command_line, compose_config, validate

    for name, (processes, overrides) in same_numbers.RUNS.items():
        cfg = compose_config(overrides)
        check_command_line(cfg, overrides)
        validate(cfg)
