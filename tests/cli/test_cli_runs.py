"""``covgrad runs``, ``covgrad ls``'s run column, the run's one report location and every subcommand's --help."""

import re
import shutil

import pytest

from flows.cli import main

SUBCOMMANDS = ("run", "plan", "report", "runs", "ls", "gc", "verify", "diff")


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_help_has_a_description_and_defaults(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    _, rest = text.split("\n\n", 1)
    assert rest.strip() and not rest.lstrip().startswith(("positional", "options")), text  # a description
    if command != "run":  # run's options have no argparse defaults: the config supplies them (epilog)
        flags = re.findall(r"^  (--[\w-]+)", text, flags=re.M)
        assert flags and "(default:" in text, text


def test_runs_lists_each_run_once_with_its_headline_and_ls_names_the_run(tiny_run, tmp_path, capsys):
    root = tmp_path / "root"
    shutil.copytree(tiny_run[0], root)
    key = tiny_run[1].run_key
    assert main(["runs", "--root", str(root), "--reports"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("tiny ")]
    assert len(rows) == 1 and key in rows[0], out  # the name alias is not a second run
    assert re.search(r" (\d+)/\1 ", rows[0]), rows[0]  # every stage complete
    assert "The top 1% of parameters by |G| shares" in rows[0] and "per-tensor random baseline" in rows[0]
    assert any(line.strip() == f"report: {root}/_reports/tiny/report.html" for line in out), out
    assert main(["ls", "--root", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["stage", "key", "state", "run"]
    assert all(line.split()[3] == "tiny" for line in lines[1:]), lines


def test_report_rebuilds_into_the_run_report_location(tiny_run, tmp_path, capsys):
    root = tmp_path / "root"
    shutil.copytree(tiny_run[0], root)
    assert main(["report", tiny_run[1].run_key, "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"report:  {root}/_reports/tiny/report.html" in out  # by key or by name: the run's name
    assert (root / "_reports" / "tiny" / "report.html").exists()
    assert "The top 1% of parameters by |G| shares" in out
