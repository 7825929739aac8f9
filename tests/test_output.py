"""Log lines and progress bars share stderr without cutting each other."""

from __future__ import annotations

import logging
import re

from tqdm import tqdm

from dflash_cache.runtime.log import setup_logging


def test_a_log_line_during_a_live_bar_starts_on_its_own_line(capsys):
    setup_logging()
    bar = tqdm(total=3, desc="work", mininterval=0)
    for i in range(3):
        bar.update(1)
        logging.getLogger("dflash.test").info("message %d", i)
    bar.close()
    err = capsys.readouterr().err
    lines = [line for line in err.split("\n") if "message" in line]
    assert len(lines) == 3
    for line in lines:
        # tqdm.write clears the bar (carriage return) before the line: after the last \r only the log line is left
        assert re.fullmatch(r"\d\d:\d\d:\d\d INFO dflash.test: message \d", line.rsplit("\r", 1)[-1]), repr(line)
    assert "work: 100%" in err.rstrip().split("\n")[-1]  # the bar goes on below the lines and ends last
