"""The config files' reader against the option table (the files themselves, read through
``paft train``, are tested in options_test.py, config_test.py and cli_test.py)."""

from __future__ import annotations

from paft.config import TrainConfig
from paft.config_files import _run_config_values
from paft.option_table import OPTIONS


def test_every_option_but_the_runs_folder_is_read_from_config_json() -> None:
    """One table maps config.json's fields to the options: none is left behind."""
    read = _run_config_values(TrainConfig().to_dict(), "--config: config.json")
    assert read.keys() == {opt.flag for opt in OPTIONS} - {"run-dir", "resume", "overwrite"}
