"""One version number: the package's metadata, ``celery_exclusive.__version__``, the
newest release in the changelog and the version the site shows agree."""

from __future__ import annotations

import re

from tests.docs.blocks import ROOT
from tests.docs.commands import tomllib


def package_version() -> str:
    with open(ROOT / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["project"]["version"]


def test_the_package_says_the_version_its_metadata_says():
    import celery_exclusive

    assert celery_exclusive.__version__ == package_version()


def test_the_newest_release_in_the_changelog_is_the_packages_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+[^\]]*)\]", changelog, re.M)
    assert releases and releases[0] == package_version()


def test_the_changelog_keeps_an_unreleased_section_on_top():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    sections = re.findall(r"^## \[([^\]]+)\]", changelog, re.M)
    assert sections[0] == "Unreleased"


def test_the_site_shows_the_packages_version():
    """The home page writes the version from the package (docs/hooks/generated.py);
    no page writes another one by hand."""
    assert "<!-- generated: version -->" in (ROOT / "docs" / "index.md").read_text()
    for page in (ROOT / "docs").rglob("*.md"):
        for found in re.findall(r"celery-exclusive (\d+\.\d+\.\d+)", page.read_text()):
            assert found == package_version(), page
