"""docs/cli.md is generated from the `rlink` parsers (ci/cli_reference.py): it names every
subcommand and option, and it is not stale. Also the CLI's own wording: where ucxx comes from,
and bench progress columns that stay apart."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "cli.md"


@pytest.fixture(scope="module")
def reference():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "ci" / "cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(60)
def test_docs_cli_md_is_what_the_parsers_generate(reference):
    assert DOC.read_text() == reference.render(), "docs/cli.md is stale: run python ci/cli_reference.py --write"
    assert reference.main(["--check"]) == 0


@pytest.mark.timeout(60)
def test_every_subcommand_and_option_of_every_parser_is_in_docs_cli_md(reference):
    text = DOC.read_text()
    sections = dict(re.findall(r"\n## `([^`]+)`\n(.*?)(?=\n## |\Z)", text, flags=re.S))
    seen = 0
    for title, _summary, parser in reference._parsers():
        assert title in sections, f"no section for {title} in docs/cli.md"
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert f"`{option}" in sections[title], f"{title} {option} is not in docs/cli.md"
                seen += 1
    assert seen > 80  # every parser was read, the bench suites and the demo included
    for title in ("rlink stats", "rlink doctor", "rlink learner", "rlink demo", "rlink bench --suite replay",
                  "rlink bench --suite formats", "rlink bench --suite scale"):  # fmt: skip
        assert title in sections, title
    for needle in ("`--envs-per-actor", "`--unroll", "`--plain", "`--kill-one-actor-after", "`--handover-only"):
        assert needle in text, needle
    assert "`--batch-size" in sections["rlink learner"] and "`--log-every" in sections["rlink learner"]
    assert "`--attempts" in sections["rlink doctor"] and "`--token-file" in sections["rlink doctor"]
    assert "without a port means port 8443" in text


@pytest.mark.timeout(60)
def test_a_missing_option_makes_the_check_fail(reference, tmp_path, monkeypatch):
    stale = tmp_path / "cli.md"
    stale.write_text(reference.render().replace("`--log-every LOG_EVERY`", "`--log-evry LOG_EVERY`"))
    monkeypatch.setattr(reference, "DOC", stale)
    assert reference.main(["--check"]) == 1


def test_readme_links_the_cli_reference():
    assert "(docs/cli.md)" in (ROOT / "README.md").read_text()


def test_bench_names_the_ucx_extra_for_ucxx_and_bench_for_the_peers(monkeypatch):
    from rlink_ucx.bench import systems

    monkeypatch.setattr(systems, "installed", lambda module: False)
    monkeypatch.setattr(systems.peers, "missing", lambda harness: None)
    assert "rlink-ucx[ucx]" in (systems.missing(systems.SYSTEMS["raw-ucxx"]) or "")
    assert "rlink-ucx[bench]" not in (systems.missing(systems.SYSTEMS["raw-ucxx"]) or "")
    assert "rlink-ucx[bench]" in (systems.missing(systems.SYSTEMS["pyzmq-copy"]) or "")


def test_bench_progress_columns_stay_apart_for_the_longest_system_name():
    from rlink_ucx.bench.suite import row_label
    from rlink_ucx.bench.systems import SYSTEMS

    for key in SYSTEMS:
        label = row_label("cartpole", key, 1)
        assert f"{key} " in label and label.endswith(" x1"), label
    assert row_label("atari", "raw-socket-ring", 4).split() == ["atari", "raw-socket-ring", "x4"]
