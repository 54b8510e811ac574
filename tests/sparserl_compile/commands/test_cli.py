"""The ``sparserl`` command line as a shell user runs it."""

from __future__ import annotations

import subprocess
import sys


def test_output_piped_into_a_reader_that_quits_early_is_no_traceback(tmp_path):
    """``sparserl cache ls | head -1``: once the reader has gone, the rest of the output is
    dropped quietly, as for any Unix command, not reported as a Python traceback."""
    p = subprocess.Popen([sys.executable, "-m", "sparserl_compile.commands.cli", "cache", "--dir", str(tmp_path), "ls"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader quits before the command writes a line
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
