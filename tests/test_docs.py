"""The README and docs/ as a reader meets them: generated blocks equal what results/ gives now
(and each run's own files), every link and image resolves inside the repository, the README stays
short, and a number its prose quotes is one the generated answer shows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "experiments" / "configs" / "README.md",
         REPO / "experiments" / "studies" / "README.md"]


@pytest.fixture(scope="module")
def blocks():
    from mlresearch.frontier import read_points
    from mlresearch.study import collect, generated_blocks
    from mlresearch.study_runner import headlines

    results = REPO / "results"
    return generated_blocks(collect(results), headlines(results), read_points(results))


def test_every_generated_block_is_what_results_gives_now(blocks):
    from mlresearch.study import block_text

    seen = []
    for page in PAGES:
        body = page.read_text()
        for name in re.findall(r"<!-- (\w+):start -->", body):  # every marker a page has, so none is left behind
            assert name in blocks, f"{page.relative_to(REPO)}: block {name!r} is not one `mlresearch table` writes"
            seen.append((page.name, name))
            assert block_text(body, name) == blocks[name], (f"{page.relative_to(REPO)}: block {name!r} is stale; run "
                                                            "`mlresearch table --docs README.md docs/results.md`")
    assert {("README.md", "answer"), ("README.md", "methods"), ("results.md", "results"),
            ("results.md", "frontiers"), ("results.md", "seeds_deit_fractals_2l_12k")} <= set(seen), seen


def test_the_seed_by_seed_table_shows_each_runs_own_files(blocks):
    """Every cell of the DeiT study's seed-by-seed block is what that run's summary.json and
    downstream.json say (read here directly, not through collect), in the row of its variant."""
    import json

    experiment = "deit_fractals_2l_12k"
    rows = {}
    for line in blocks[f"seeds_{experiment}"].splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[2:]
    assert len(rows) >= 10 and list(rows)[0] == "baseline 1.0x"
    checked = 0
    for run in sorted((REPO / "results" / experiment).glob("*-seed*/summary.json")):
        summary = json.loads(run.read_text())
        down = json.loads((run.parent / "downstream.json").read_text())
        cell = (f"{summary['final_full_val']['val_loss']:.3f}; {100 * down['accuracy']:.1f}%; "
                f"{100 * down['transfer_accuracy']:.1f}%")
        column = summary["seed"]
        assert any(cells[column] == cell for cells in rows.values()), (run.parent.name, cell)
        if summary["kind"] == "baseline":
            assert rows["baseline 1.0x"][column] == cell
        checked += 1
    assert checked >= 25


def _prose(body: str) -> list[str]:
    """Paragraphs outside code fences, tables, headings and generated blocks."""
    body = re.sub(r"```.*?```", "", body, flags=re.S)
    body = re.sub(r"<!-- (\w+):start -->.*?<!-- \1:end -->", "", body, flags=re.S)
    paragraphs = [p for p in re.split(r"\n\s*\n", body) if p.strip()]
    return [p for p in paragraphs if not p.lstrip().startswith(("|", "#", "!["))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_and_image_resolves_inside_the_repository(page):
    text = page.read_text()
    body = re.sub(r"```.*?```", "", text, flags=re.S)
    targets = re.findall(r"\]\(([^)\s]+)\)", body)
    # A relative path in plain text or code (`../notes/x.md`) must stay inside the repository too.
    for mention in re.findall(r"(?<![\w.])\.\./[\w./-]+", text):
        path = (page.parent / mention).resolve()
        assert REPO in path.parents or path == REPO, f"{page.relative_to(REPO)} cites {mention}, outside the repository"
    for target in targets:
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.relative_to(REPO)} links to {target}, which does not exist"
        assert REPO in path.parents or path == REPO, f"{page.relative_to(REPO)} links outside the repository: {target}"


def test_the_readme_is_short_and_its_paragraphs_are_readable():
    body = (REPO / "README.md").read_text()
    assert len(body.splitlines()) <= 250
    long = [p[:80] for p in _prose(body) if len(p.split()) > 120]
    assert not long, f"paragraphs over 120 words: {long}"


def test_every_spread_the_readme_quotes_is_one_the_answer_shows(blocks):
    # "12.4 ± 3.6%" in a sentence must be a cell of the generated answer, so the sentence cannot go stale
    # while the table moves on.
    prose = "\n".join(_prose((REPO / "README.md").read_text()))
    quoted = re.findall(r"(\d+\.\d+) ± (\d+\.\d+)", prose)
    assert quoted, "the README's answer sentence quotes no result"
    cells = set(re.findall(r"[+-]?(\d+\.\d+) ± (\d+\.\d+)", blocks["answer"]))
    missing = [f"{m} ± {s}" for m, s in quoted if (m, s) not in cells]
    assert not missing, f"the README quotes {missing}, which the generated answer does not show"


def test_the_paper_tables_put_each_reported_row_beside_our_variants_of_that_method():
    """Every row the paper's Tables 1, 2 and 3 report appears with its reported numbers, and each of our
    rows beside it carries the saving and seeds that the study table (variants) gives that variant
    on the experiment the table is read against; the V-cycle shows only its headline variants."""
    from mlresearch.study import PAPER_TABLE_EXPERIMENTS, PAPER_TABLES, collect, paper_tables, variant_name, variants
    from mlresearch.study_runner import headlines
    from mlresearch.training.methods import title_of

    results = REPO / "results"
    runs, heads = collect(results), headlines(results)
    table = paper_tables(runs, heads)
    for r in PAPER_TABLES.itertuples(index=False):
        mine = table[(table.table == r.table) & (table.method == title_of(r.method))]
        assert len(mine), (r.table, r.method)
        shown = mine["paper: FLOPs saving %"].iloc[0]
        assert shown == ("not in our sources" if r.flops != r.flops else f"{r.flops:+.1f}"), (r.table, r.method)
    for name, experiment in PAPER_TABLE_EXPERIMENTS.items():
        ours = variants(runs[runs.experiment == experiment])
        cells = {f"{experiment}: {variant_name(v)}": (v.saved_pct_cell if hasattr(v, "saved_pct_cell")
                                                      else "no frontier yet", int(v.seeds))
                 for v in ours.itertuples(index=False)}
        shown = table[(table.table == name) & table.seeds.gt(0)]
        assert len(shown)
        for row in shown.itertuples(index=False):
            assert (row[table.columns.get_loc("ours: FLOPs saved % at matched loss")], row.seeds) == cells[row.ours]
        vcycle = runs[(runs.experiment == experiment) & (runs.method == "vcycle")]
        headline_vcycles = variants(vcycle[vcycle.run.isin(list(heads.get(experiment, {})))])
        assert (shown.method == "V-cycle").sum() == len(headline_vcycles)


def test_the_headline_rows_do_not_depend_on_the_directory_they_are_read_from(monkeypatch, tmp_path):
    """A notebook reads the committed results from notebooks/: the best V-cycle (found by reading
    its candidates' runs) must be labelled there as it is from the repository root."""
    from mlresearch.study_runner import headlines

    monkeypatch.chdir(REPO)
    here = headlines(REPO / "results")
    assert "best by tuning loss" in set(here["gpt2_regime"].values())
    monkeypatch.chdir(tmp_path)
    assert headlines(REPO / "results") == here
