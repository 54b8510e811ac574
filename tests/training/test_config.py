"""training/config.py: dataclass configs as command-line flags."""

from __future__ import annotations

import pytest

from sparserl_compile.commands.cli import main


@pytest.mark.parametrize("argv", [["eval"], ["train", "pretrain"], ["train", "sft"], ["train", "rl"]])
def test_every_flags_help_renders(argv, capsys):
    """argparse formats help text with %; a literal "10 %" in a help string once printed the
    option's internal dict instead of its help (sparserl eval --help)."""
    with pytest.raises(SystemExit) as done:
        main(argv + ["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "option_strings" not in text and "--device" in text
    if argv == ["eval"]:
        assert "about 10 % slower" in " ".join(text.split())
