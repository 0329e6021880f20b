"""Each recipe has its own search space; one for another model is refused before any trial, naming the file to copy."""

from __future__ import annotations

from tests.helpers.processes import run_in_process


def test_a_search_space_for_another_model_names_the_file_to_copy(tmp_path):
    code, err = run_in_process("train", "experiment=gpt", "hparams_search=digits", log_dir=tmp_path)
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "error: hparams_search=digits searches model.net.channels, which model=gpt does not have; copy "
        "configs/hparams_search/digits.yaml to configs/hparams_search/gpt.yaml and list its keys."
    )
    code, err = run_in_process("train", "hparams_search=optuna", log_dir=tmp_path)
    assert code == 2 and "holds no search space; use hparams_search=digits or gpt" in err
