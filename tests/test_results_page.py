"""The results page and the figures quoted from it (benchmarks/results_page.py, benchmarks/publish.py): every
generated table of the README, docs/ and benchmarks/RESULTS.md is what the data file renders now, each claim is on
the page once, every claim's runs are archive files and its command runs as written, and `publish` keeps each run as
an archive file with one run-log line."""

from __future__ import annotations

import copy
import datetime
import pathlib
import re
import shutil
import sys

import pytest
import yaml
from documented_commands import problem_with_command

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import publish  # noqa: E402
import results_page  # noqa: E402

DATA = results_page.load()


@pytest.mark.parametrize("document", results_page.documents(), ids=lambda p: p.name)
def test_the_generated_tables_quote_the_current_figures(document):
    text = document.read_text()
    assert text == results_page.refreshed(text, DATA, document), (
        f"{document.relative_to(ROOT)} quotes figures that are not figures.yaml's: "
        "run `python benchmarks/results_page.py --write`"
    )


def test_the_readme_opens_with_the_headline_table_and_docs_quote_the_rest():
    names = {p.name: [name for name, _, _ in results_page.blocks(p.read_text())] for p in results_page.documents()}
    assert names["README.md"] == ["headline"]
    assert names["RESULTS.md"] == ["page"]
    quoted = {name for found in names.values() for name in found}
    assert set(DATA["views"]) <= quoted  # every view is shown somewhere
    assert {cid for cid, c in DATA["claims"].items() if "table" in c} - quoted <= {"block-precision", "text-encoder"}


def test_the_page_gives_each_claim_once_and_every_quote_links_to_it():
    page = results_page.PAGE.read_text()
    for cid in DATA["claims"]:
        assert page.count(f'<a id="{cid}"></a>') == 1, cid
    readme = (ROOT / "README.md").read_text()
    for cid in re.findall(r"\{([\w-]+)\}", " ".join(" ".join(r) for r in DATA["views"]["headline"]["rows"])):
        assert f"(benchmarks/RESULTS.md#{cid})" in readme, cid  # README figure -> its claim -> its runs
        assert DATA["claims"][cid]["figure"] in readme


def test_a_new_figure_in_the_data_file_changes_every_quote_of_it():
    data = copy.deepcopy(DATA)
    data["claims"]["forward-fp8"]["figure"] = "0.0999 s"
    readme = ROOT / "README.md"
    new = results_page.refreshed(readme.read_text(), data, readme)
    assert "0.0999 s" in new and DATA["claims"]["forward-fp8"]["figure"] not in new
    page = results_page.render(data, "page", results_page.PAGE)
    assert page.count("0.0999 s") == 1


def test_the_data_file_refuses_a_claim_without_its_run_or_with_a_partial_one(tmp_path):
    data = yaml.safe_load(results_page.DATA.read_text())
    archive = tmp_path / "archive"
    shutil.copytree(results_page.ARCHIVE, archive)
    claim = data["claims"]["forward-fp8"]

    claim["runs"] = ["2026-12-04-9999-bench_krea2_speed.md"]
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"claim 'forward-fp8': run '2026-12-04-9999-bench_krea2_speed.md' is not"):
        results_page.load(tmp_path / "a.yaml", archive)

    (archive / "2026-12-05-1200-bench_krea2_speed.md").write_text("## Krea-2 full-size sampling speed (partial)\n")
    claim["runs"] = ["2026-12-05-1200-bench_krea2_speed.md"]
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"claim 'forward-fp8': run .* is a partial run"):
        results_page.load(tmp_path / "b.yaml", archive)

    claim["runs"] = DATA["claims"]["forward-fp8"]["runs"]
    data["claims"]["ray-replicas"]["table"]["rows"][0][0] = False  # YAML's unquoted `off`
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"claim 'ray-replicas': table row \[False, .* needs 4 cells, each text"):
        results_page.load(tmp_path / "d.yaml", archive)
    data["claims"]["ray-replicas"]["table"]["rows"][0][0] = "off"

    del claim["date"]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"claim 'forward-fp8': 'date' is missing"):
        results_page.load(tmp_path / "c.yaml", archive)


@pytest.mark.parametrize("cid", [cid for cid, c in DATA["claims"].items() if "command" in c])
def test_every_claim_can_be_measured_again_as_its_command_says(cid):
    command = DATA["claims"][cid]["command"]
    if command == "python -m pytest":
        return
    assert problem_with_command(command) is None, f"{cid}: {command}: {problem_with_command(command)}"


def test_every_run_of_the_archive_is_in_the_run_log_once():
    page = results_page.PAGE.read_text()
    log = page[page.index(publish.RUN_LOG_HEADING) :]
    linked = re.findall(r"\]\(results/archive/([^)]+)\)$", log, re.MULTILINE)
    assert sorted(linked) == sorted(p.name for p in results_page.ARCHIVE.glob("*.md"))
    assert len(linked) == len(set(linked)) > 90
    assert page.rstrip().endswith(".md)")  # the run log is the page's end: publish appends there


def test_publish_keeps_the_run_as_written_and_logs_it(tmp_path, capsys):
    page = tmp_path / "RESULTS.md"
    page.write_text("# Benchmark results\n\nthe claims\n\n## Run log\n\n- an earlier run\n")
    text = (
        "\n## Krea-2 full-size sampling speed (2026-12-05 10:00)\n\n"
        "Command: `python benchmarks/bench_krea2_speed.py --mode compiled --quantization fp8`  \n"
        "Machine: NVIDIA H200, torch 2.11.0+cu130, torch.bfloat16 + fp8; more detail\n\n| a |\n|---|\n| 1 |\n"
    )
    when = datetime.datetime(2026, 12, 5, 10, 0, tzinfo=datetime.timezone.utc)
    first = publish.publish(text, page, now=when)
    second = publish.publish(text, page, now=when)
    assert capsys.readouterr().out.count("| 1 |") == 2  # printed each time
    assert first == tmp_path / "results" / "archive" / "2026-12-05-1000-bench_krea2_speed.md"
    assert second.name == "2026-12-05-1000-bench_krea2_speed-2.md"
    assert first.read_text() == text.lstrip("\n")
    lines = page.read_text().splitlines()
    assert lines[:7] == ["# Benchmark results", "", "the claims", "", "## Run log", "", "- an earlier run"]
    assert lines[7] == (
        "- 2026-12-05 10:00 UTC · Krea-2 full-size sampling speed (2026-12-05 10:00) · "
        "`python benchmarks/bench_krea2_speed.py --mode compiled --quantization fp8` · "
        "NVIDIA H200, torch 2.11.0+cu130, torch.bfloat16 + fp8 · "
        "[2026-12-05-1000-bench_krea2_speed.md](results/archive/2026-12-05-1000-bench_krea2_speed.md)"
    )
    assert lines[8].endswith("(results/archive/2026-12-05-1000-bench_krea2_speed-2.md)") and len(lines) == 9


def test_publish_without_results_prints_only_and_starts_a_missing_page(tmp_path, capsys):
    assert publish.publish("## Probe (2026-12-05)\n\nno command\n", None) is None
    assert "no command" in capsys.readouterr().out
    page = tmp_path / "new" / "RESULTS.md"
    path = publish.publish("## Probe (2026-12-05)\n\nno command\n", page)
    assert path.name.endswith("-probe-2026-12-05.md")
    assert page.read_text().startswith(f"# Benchmark results\n\n{publish.RUN_LOG_HEADING}\n\n- ")
