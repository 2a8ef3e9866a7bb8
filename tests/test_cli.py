"""``zmrl`` command line: a lazy subcommand (``parity``, ``plan``) takes its own options on the first parse
(an argparse stub must not reject them), and every other subcommand still rejects unknown options."""
from __future__ import annotations

import pytest

from zmrl import cli


def test_lazy_subcommand_options_reach_their_parser(monkeypatch):
    seen = {}
    import zmrl.parity.audit as audit

    def fake_parity(args):
        seen.update(vars(args))
        return 0

    real_register = audit.add_parity_subcommand

    def register(sub):
        p = real_register(sub)
        p.set_defaults(func=fake_parity)
        return p

    monkeypatch.setattr(audit, "add_parity_subcommand", register)
    assert cli.main(["parity", "--device", "cpu", "--num-requests", "3"]) == 0
    assert seen["device"] == "cpu" and seen["num_requests"] == 3


@pytest.mark.parametrize("argv", [["smoke", "--bogus"], ["parity", "--bogus"]])
def test_unknown_options_are_one_line_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
