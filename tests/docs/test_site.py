"""The documentation site builds with warnings as errors and without a network, every
link and anchor resolves (MkDocs' own validation inside the site; this module for the
README, CONTRIBUTING.md and CHANGELOG.md, which live outside it), and the pages that
are generated from the code list everything the code has."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import yaml

from tests.docs.blocks import ROOT

#: Pages of the nav that may be missing from this tree: the architecture page is
#: written with the package's layout and lands on its own.
MAY_FOLLOW = {"explanation/architecture.md"}


def text_of(page: Path) -> str:
    html = page.read_text()
    return re.sub(r"<[^>]+>", " ", html[html.find("<article") : html.find("</article>")])


def test_the_site_builds_strictly_and_offline(site):
    assert (site / "index.html").exists()


def test_every_page_of_the_nav_exists():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    pages = re.findall(r"[\w/.-]+\.md", str(config["nav"]))
    missing = [p for p in pages if not (ROOT / "docs" / p).exists() and p not in MAY_FOLLOW]
    assert not missing, missing


def test_the_settings_page_lists_every_setting_with_its_comment(site):
    from celery_exclusive.core.config import Settings

    page = text_of(site / "reference" / "settings" / "index.html")
    for field in dataclasses.fields(Settings):
        assert f"exclusive_{field.name}" in page, field.name
    # A #: comment in the code is the setting's description on the page.
    assert "doubles with each requeue, with full jitter" in page


def test_every_setting_says_what_it_is_for(site):
    from celery_exclusive.core.config import Settings

    page = (site / "reference" / "settings" / "index.html").read_text()
    for field in dataclasses.fields(Settings):
        above_its_table = page.split(f'id="{field.name}"', 1)[1].split("<table", 1)[0]
        assert "<p>" in above_its_table, f"{field.name}: no #: comment above it in Settings"


def test_every_settings_table_has_a_heading_row_with_text(site):
    page = (site / "reference" / "settings" / "index.html").read_text()
    headings = re.findall(r"<thead>(.*?)</thead>", page, re.S)
    assert headings, "no table on the settings page"
    for heading in headings:
        cells = re.findall(r"<th[^>]*>(.*?)</th>", heading, re.S)
        assert cells and all(cell.strip() for cell in cells), heading


def test_the_home_page_names_the_packages_version(site):
    from celery_exclusive import __version__

    home = text_of(site / "index.html")
    assert f"This documents celery-exclusive {__version__}." in home
    assert "generated:" not in (site / "index.html").read_text()


def test_every_setting_links_to_the_guide_that_explains_it(site):
    from celery_exclusive.core.config import Settings

    page = (site / "reference" / "settings" / "index.html").read_text()
    for field in dataclasses.fields(Settings):
        section = page.split(f'id="{field.name}"', 1)[1].split("<h3", 1)[0]
        assert ">Guide<" in section, field.name


def test_the_signals_page_lists_every_signal(site):
    from celery.utils.dispatch import Signal

    from celery_exclusive import signals

    page = text_of(site / "reference" / "signals" / "index.html")
    for name, value in vars(signals).items():
        if isinstance(value, Signal):
            assert f'id="{name}"' in (site / "reference/signals/index.html").read_text(), name
            for argument in value.providing_args:
                assert argument in page, (name, argument)


def test_the_cli_page_lists_every_command(site):
    from celery_exclusive.cli.commands import exclusive

    page = text_of(site / "reference" / "cli" / "index.html")
    for name in exclusive.commands:
        assert f"celery -A proj exclusive {name}" in page, name


def test_the_cli_page_shows_the_stores_environment_variable(site):
    assert "env var: EXCLUSIVE_BACKEND_URL" in text_of(site / "reference" / "cli" / "index.html")


def test_the_cli_page_shows_the_store_options_on_every_command(site):
    from celery_exclusive.cli import exclusive

    page = text_of(site / "reference" / "cli" / "index.html")
    sections = page.split("celery -A proj exclusive ")[1:]
    for name in exclusive.commands:
        (section,) = [s for s in sections if s.startswith(f"{name} [OPTIONS]")]
        assert "--backend" in section and "--prefix" in section, name


def test_the_changelog_is_a_page_of_the_site(site):
    assert "Keep a Changelog" in text_of(site / "changelog" / "index.html")


# --- the Markdown files outside the site ---------------------------------------------

TOP = ["README.md", "CONTRIBUTING.md", "CHANGELOG.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's and MkDocs' anchor for a heading."""
    text = re.sub(r"[`*_\[\]()]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#+ (.+?)\s*$", text, re.M)}


@pytest.mark.parametrize("name", TOP)
def test_every_relative_link_of_a_top_level_file_resolves(name):
    source = ROOT / name
    text = re.sub(r"```.*?```", "", source.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (source.parent / path) if path else source
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors_of(resolved):
            broken.append(f"{target}: no such anchor")
    assert not broken, broken


def test_every_page_the_package_points_to_exists_with_its_section():
    """An error message names a page as ``docs: <page>.md#<section>``."""
    pointers = [
        (source, found)
        for source in (ROOT / "celery_exclusive").rglob("*.py")
        for found in re.findall(r"docs: ([\w/.-]+\.md)(?:#([\w-]+))?", source.read_text())
    ]
    assert pointers, "no pointer to check: the pattern no longer matches the package"
    broken = [
        f"{source.relative_to(ROOT)}: docs: {page}#{anchor}"
        for source, (page, anchor) in pointers
        if not (ROOT / "docs" / page).exists()
        or (anchor and anchor not in anchors_of(ROOT / "docs" / page))
    ]
    assert not broken, broken


def test_a_broken_link_is_reported(tmp_path, monkeypatch):
    (tmp_path / "README.md").write_text("[a](docs/missing.md) [b](#nowhere)\n\n# Here\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="no such file.*no such anchor"):
        test_every_relative_link_of_a_top_level_file_resolves("README.md")


def test_the_readme_is_short():
    """What it is, why, install, the quick start and links into the site: the rest is
    in the site."""
    assert len((ROOT / "README.md").read_bytes()) <= 10 * 1024


def test_the_readme_keeps_the_quick_start_the_site_includes():
    readme = (ROOT / "README.md").read_text()
    page = (ROOT / "docs" / "tutorial" / "quickstart.md").read_text()
    assert '--8<-- "README.md:quickstart"' in page
    assert "--8<-- [start:quickstart]" in readme and "--8<-- [end:quickstart]" in readme


def test_text_about_to_change_is_marked_in_one_way():
    """``<!-- pending: ... -->`` marks text describing behaviour that is changing, so it
    can be found; each says what changes."""
    for path in [*(ROOT / "docs").rglob("*.md"), *(ROOT / name for name in TOP)]:
        for found in re.findall(r"^<!-- ?pending\b(.*?)-->", path.read_text(), re.S | re.M):
            assert re.match(r": \S.{10,}", found), (path, found)
