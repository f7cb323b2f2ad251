"""Every code block of the docs and the README is checked as its annotation says
(see tests/docs/blocks.py): Python runs (test_typing.py type-checks it), shell commands
name what exists, shown output is compared by a test, diagrams and configuration
parse."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.docs import commands, preludes
from tests.docs.blocks import ROOT, Block, blocks_of, every_block, problems_of
from tests.docs.commands import tomllib

BLOCKS = every_block()


def of_kind(*kinds: str) -> list:
    return [pytest.param(b, id=b.where) for b in BLOCKS if b.kind in kinds]


# --- the annotation -----------------------------------------------------------------


def test_every_block_says_how_it_is_checked():
    found = [problem for block in BLOCKS for problem in problems_of(block)]
    assert not found, "\n".join(found)


def test_a_block_without_an_annotation_is_reported(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Some text.\n\n```python\nprint(1)\n```\n")
    (block,) = blocks_of(page)
    assert problems_of(block) == [f"{page}:3: a ```python block says nothing of how it is checked"]


def test_an_annotation_separated_by_prose_does_not_count(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- check: run -->\nProse between.\n\n```python\nprint(1)\n```\n")
    (block,) = blocks_of(page)
    assert block.kind is None


def test_an_output_block_names_the_test_that_compares_it(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- check: output -->\n```text\nhello\n```\n")
    (block,) = blocks_of(page)
    assert "run by PATH" in problems_of(block)[0]


def test_a_block_saved_as_a_file_is_named_by_the_paragraph_above(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Save this:\n\n<!-- check: run; file=tasks.py -->\n```python\nprint(1)\n```\n")
    (block,) = blocks_of(page)
    assert problems_of(block) == [
        f"{page}:4: saved as tasks.py, which the paragraph above never names"
    ]
    page.write_text(page.read_text().replace("Save this:", "Save this as `tasks.py`:"))
    assert problems_of(*blocks_of(page)) == []


def test_the_site_has_examples_of_every_kind_it_checks():
    """The kinds below are checked by the tests of this module: a kind nobody uses
    would be a check that cannot fail."""
    used = {block.kind for block in BLOCKS}
    assert {"run", "typecheck", "pytest", "shell", "output", "diagram", "acl", "hcl"} <= used


# --- Python ---------------------------------------------------------------------------


def environment(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        # The embedded default store of an example's app goes to a folder of its own.
        "XDG_STATE_HOME": str(tmp_path / "state"),
    }


def write_files(block: Block, folder: Path) -> None:
    for name, text in preludes.FILES.get(block.prelude or "", {}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


@pytest.mark.parametrize("block", of_kind("run"))
def test_a_python_example_runs(block, tmp_path):
    source, _ = preludes.source_of(block.prelude, block.text)
    source += preludes.EPILOGUES.get(block.prelude or "", preludes.CHECK_APPS)
    write_files(block, tmp_path)
    (tmp_path / "example.py").write_text(source)
    ran = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        env=environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, f"{block.where} failed:\n{ran.stderr}"


@pytest.mark.parametrize("block", of_kind("pytest"))
def test_a_test_example_passes(block, tmp_path):
    source, _ = preludes.source_of(block.prelude, block.text)
    write_files(block, tmp_path)
    (tmp_path / "test_example.py").write_text(source)
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_example.py"],
        cwd=tmp_path,
        env=environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, f"{block.where} failed:\n{ran.stdout}\n{ran.stderr}"
    assert re.search(r"\b\d+ passed\b", ran.stdout), ran.stdout


# --- shell ------------------------------------------------------------------------------


@pytest.mark.parametrize("block", of_kind("shell"))
def test_a_shell_example_names_what_exists(block):
    found = [
        f"{block.where}: {problem}"
        for command in commands.commands_of(block.text)
        for problem in commands.problems(command)
    ]
    assert not found, "\n".join(found)
    assert list(commands.commands_of(block.text)), f"{block.where}: no command"


@pytest.mark.parametrize(
    "command, problem",
    [
        ("pip install 'celery-exclusive[redsi]'", "no extra 'redsi'"),
        ("celery -A proj exclusive lst", "no subcommand 'lst'"),
        ("celery -A proj exclusive ls --jsn", "No such option"),
        ("celery -A proj worker --concurency 2", "no option '--concurency'"),
        ("rq worker --job-class celery_exclusive.rq.Job2", "does not exist"),
        ("python -m example_projet", "no such module"),
        ("docker compose up postgress", "no such service"),
        ("etcdctl put invoice:7 x", "only etcdctl lock NAME"),
        ("consul lock -limit 2 svc/x ./run.sh", "no option -limit"),
        ("consul lock svc/x", "needs a KV prefix and a command"),
        ("psql postgresql://db/app", "only psql CONNINFO -c STATEMENT"),
        ("curl http://example.org", "no check for 'curl'"),
    ],
)
def test_a_shell_command_that_names_nothing_is_reported(command, problem):
    (parsed,) = commands.commands_of(command)
    assert any(problem in found for found in commands.problems(parsed))


# --- text: output and examples -------------------------------------------------------


def test_the_settings_page_shows_the_error_a_bad_setting_gives():
    from celery import Celery

    from celery_exclusive import ConfigurationError, ExclusiveTask

    (block,) = [b for b in BLOCKS if b.path.name == "settings.md" and b.kind == "output"]
    app = Celery("billing")

    @app.task(base=ExclusiveTask, name="billing.settle", exclusive_on_duplicate="drop")
    def settle(invoice_id):
        pass

    with pytest.raises(ConfigurationError) as error:
        settle.exclusive_settings  # noqa: B018 - resolving is what raises
    # A worker prints the error on one line, after this prefix (tests/stores/sqlite).
    assert block.text.strip() == f"celery-exclusive: ConfigurationError: {error.value}"


@pytest.mark.parametrize("block", of_kind("example"))
def test_an_example_output_says_it_is_an_example(block):
    assert "example" in block.before.lower(), block.where


# --- diagrams and configuration ----------------------------------------------------------

DIAGRAMS = ("sequenceDiagram", "flowchart", "graph", "stateDiagram-v2", "classDiagram")


@pytest.mark.parametrize("block", of_kind("diagram"))
def test_a_diagram_is_one_mermaid_draws(block):
    lines = [line.strip() for line in block.text.splitlines() if line.strip()]
    assert lines[0].split()[0] in DIAGRAMS, block.where
    if lines[0] != "sequenceDiagram":
        return
    declared = {
        re.match(r"(?:participant|actor) (\w+)", line).group(1)
        for line in lines
        if line.startswith(("participant ", "actor "))
    }
    for line in lines:
        message = re.match(r"(\w+)\s*-[->x)]*>?>\s*(\w+)\s*:", line)
        if message:
            assert {message.group(1), message.group(2)} <= declared, f"{block.where}: {line}"
        note = re.match(r"Note (?:over|left of|right of) ([\w, ]+):", line)
        if note:
            names = {name.strip() for name in note.group(1).split(",")}
            assert names <= declared, f"{block.where}: {line}"


@pytest.mark.parametrize("block", of_kind("acl"))
def test_the_redis_acl_grants_what_the_store_needs(block):
    """Exactly what the store asks of a user of database 0 without min_replicas, on a
    plain Redis, or on Redis Cluster where the paragraph above says so: the rule its
    permission errors advise."""
    from celery_exclusive.backends.redis.client import StoreOptions
    from celery_exclusive.backends.redis.failures import acl_commands

    words = block.text.split()
    assert words[:2] == ["ACL", "SETUSER"], block.where
    granted = [word[1:] for word in words if word.startswith("+")]
    topology = "cluster" if "Redis Cluster" in block.before else "standalone"
    assert granted == acl_commands(StoreOptions(topology=topology)), block.where
    assert "~{exclusive:*" in words and "-@all" in words, block.where


@pytest.mark.parametrize("block", of_kind("hcl"))
def test_the_consul_policy_is_what_the_store_asks_for(block):
    from celery_exclusive.backends.consul.connection import policy_for

    rules = re.findall(r'^(\w+) "([^"]*)"\s*\{ policy = "(\w+)" \}', block.text, re.M)
    (root,) = [name for kind, name, _ in rules if kind == "key_prefix"]
    asked = " ".join(policy_for(root).split())
    for kind, name, policy in rules:
        assert f'{kind} "{name}" {{ policy = "{policy}" }}' in asked, block.where


@pytest.mark.parametrize("block", of_kind("tree"))
def test_a_layout_names_files_that_exist(block):
    folder = ROOT
    for line in block.text.splitlines():
        column = re.split(r"\s{2,}", line.strip())[0]
        names = [name.strip() for name in column.split(",")]
        if not all(re.fullmatch(r"[\w.]+/|[\w.]+\.py", name) for name in names):
            continue
        base = ROOT if not line.startswith(" ") else folder
        for name in names:
            assert (base / name).exists(), f"{block.where}: {base / name} does not exist"
        if not line.startswith(" "):
            folder = ROOT / names[0]


@pytest.mark.parametrize("block", of_kind("toml"))
def test_a_toml_example_parses(block):
    tomllib.loads(textwrap.dedent(block.text))
