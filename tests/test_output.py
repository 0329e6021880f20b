"""What a run prints and files is plain text: no colour codes off a terminal, no product tips."""

from __future__ import annotations

import contextlib
import io
import logging

from mlproject.utils.rank_logging import drop_lightning_console_handler
from tests.helpers.processes import run_dirs, run_in_process


def test_piped_output_and_log_file_are_plain(tmp_path):
    """One batch of everything (debug=fdr), in this process: its console is a pipe-like stream, no terminal.
    The stream stays open: Hydra's console handler keeps it until the next run reconfigures logging."""
    with contextlib.redirect_stdout(stdout := io.StringIO()):
        code, stderr = run_in_process(
            "train", "debug=fdr", "trainer=cpu", "extras.print_config=false", log_dir=tmp_path
        )
    assert code == 0, stderr
    (run_dir,) = run_dirs(tmp_path, "debug")
    log = (run_dir / "train.log").read_text()
    assert "Seed set to 42" in stdout.getvalue()  # the console stream is the one read here
    for text in (stdout.getvalue() + stderr, log):
        assert "\x1b[" not in text  # colorlog colours only a terminal
        assert "litlogger" not in text and "litmodels" not in text
    assert "Seed set to 42" in log  # Lightning's own messages still reach the file


def test_lightning_tips_are_dropped_but_not_its_other_messages():
    drop_lightning_console_handler()
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # where Lightning logs its tips
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        logger.warning("💡 Tip: For seamless cloud logging, try installing [litlogger]")
        logger.warning("a real warning")
    finally:
        logger.removeHandler(handler)
    assert seen == ["a real warning"]
