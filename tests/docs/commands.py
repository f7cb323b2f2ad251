"""What a shell command in the docs names, checked to exist without running it.

A command that installs, starts servers or talks to a store cannot run in a test, but
what it names can be checked: the extras of ``pip install``, the subcommands and
options of ``celery``, ``celery-exclusive`` and ``rq`` (parsed by their own click
commands), the module of ``python -m``, a script, a docker-compose service, a test
file, and the one command each of the stores' own clients is shown running
(``etcdctl lock``, ``consul lock``, ``psql -c``). A command of any other program is
refused: add a check here for it.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
import warnings
from collections.abc import Iterator

import click
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11: the docs extra installs tomli
    import tomli as tomllib  # type: ignore[no-redef]

from tests.docs.blocks import ROOT

PACKAGE = "celery-exclusive"


def commands_of(text: str) -> Iterator[list[str]]:
    """Each command of a shell block: lines joined at ``\\``, split at ``&&`` and ``;``,
    comments and leading ``VAR=value`` assignments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        command: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", ";", "||"):
                while command and re.match(r"^[A-Z_][A-Z0-9_]*=", command[0]):
                    command.pop(0)
                if command:
                    yield command
                command = []
            else:
                command.append(word)


def problems(command: list[str]) -> list[str]:
    program, args = command[0], command[1:]
    check = CHECKS.get(program)
    if check is None:
        return [f"{shlex.join(command)}: no check for {program!r} (tests/docs/commands.py)"]
    return check(args)


def extras() -> set[str]:
    with open(ROOT / "pyproject.toml", "rb") as file:
        return set(tomllib.load(file)["project"]["optional-dependencies"])


def pip(args: list[str]) -> list[str]:
    if not args or args[0] != "install":
        return [f"pip {shlex.join(args)}: only pip install is documented"]
    found = []
    for arg in args[1:]:
        if arg.startswith("-") and arg not in ("-e", "-q", "-U"):
            found.append(f"pip install {arg}: unknown option")
            continue
        if arg.startswith("-"):
            continue
        match = re.fullmatch(r"(?P<name>[\w.-]+)(?:\[(?P<extras>[\w,-]+)\])?", arg)
        if not match or match.group("name") not in (PACKAGE, "."):
            found.append(f"pip install {arg}: not this package")
            continue
        for extra in (match.group("extras") or "").split(","):
            if extra and extra not in extras():
                found.append(f"pip install {arg}: no extra {extra!r} in pyproject.toml")
    return found


def parse_click(command: click.Command, name: str, args: list[str]) -> list[str]:
    """Parse ``args`` with ``command`` as click would, without running anything."""
    try:
        context = command.make_context(name, list(args), resilient_parsing=False)
    except click.UsageError as exc:
        return [f"{name} {shlex.join(args)}: {exc.format_message()}"]
    if isinstance(command, click.Group):
        with warnings.catch_warnings():  # click 9 moves protected_args into args
            warnings.simplefilter("ignore", DeprecationWarning)
            rest = [*getattr(context, "protected_args", []), *context.args]
        if not rest:
            return []
        sub = command.get_command(context, rest[0])
        if sub is None:
            return [f"{name}: no subcommand {rest[0]!r}"]
        return parse_click(sub, f"{name} {rest[0]}", rest[1:])
    return []


def exclusive_group() -> click.Group:
    from celery_exclusive.cli import commands

    return commands.exclusive


def celery(args: list[str]) -> list[str]:
    """``celery -A APP SUBCOMMAND ...``: ours is parsed by our click group; Celery's own
    subcommands must exist and be given options they have."""
    from celery.bin.celery import celery as celery_group

    rest = list(args)
    if rest[:1] in (["-A"], ["--app"]):
        rest = rest[2:]
    if not rest:
        return ["celery: no subcommand"]
    sub, *options = rest
    if sub == "exclusive":
        return parse_click(exclusive_group(), "celery exclusive", options)
    command = celery_group.commands.get(sub)
    if command is None:
        return [f"celery: no subcommand {sub!r}"]
    known = {opt for param in command.params for opt in [*param.opts, *param.secondary_opts]}
    return [
        f"celery {sub}: no option {option.split('=')[0]!r}"
        for option in options
        if option.startswith("-") and option.split("=")[0] not in known
    ]


def celery_exclusive(args: list[str]) -> list[str]:
    return parse_click(exclusive_group(), "celery-exclusive", args)


def rq(args: list[str]) -> list[str]:
    from rq.cli import main

    found = parse_click(main, "rq", args)
    if "--job-class" in args:
        module, _, name = args[args.index("--job-class") + 1].rpartition(".")
        if not hasattr(importlib.import_module(module), name):
            found.append(f"rq: --job-class {module}.{name} does not exist")
    return found


def python(args: list[str]) -> list[str]:
    if args[:1] != ["-m"] or len(args) < 2:
        return [f"python {shlex.join(args)}: only python -m MODULE is documented"]
    if importlib.util.find_spec(args[1]) is None:
        return [f"python -m {args[1]}: no such module"]
    return []


def bash(args: list[str]) -> list[str]:
    return [] if (ROOT / args[0]).is_file() else [f"bash {args[0]}: no such script"]


def docker(args: list[str]) -> list[str]:
    if args[:2] != ["compose", "up"]:
        return [f"docker {shlex.join(args)}: only docker compose up is documented"]
    services = set(yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"])
    return [
        f"docker compose up {name}: no such service"
        for name in args[2:]
        if not name.startswith("-") and name not in services
    ]


def pytest_(args: list[str]) -> list[str]:
    return [
        f"pytest {path}: no such file"
        for path in args
        if path.startswith("tests/") and not (ROOT / path.split("::")[0]).exists()
    ]


def etcdctl(args: list[str]) -> list[str]:
    """etcd's client: the docs name only its mutex, ``etcdctl lock NAME [CMD...]``."""
    if args[:1] != ["lock"] or len(args) < 2 or args[1].startswith("-"):
        return [f"etcdctl {shlex.join(args)}: only etcdctl lock NAME [CMD...] is documented"]
    return []


#: ``consul lock``'s options (hashicorp/consul command/lock/lock.go, and the HTTP client
#: flags it merges), as ``-name`` or ``-name=value``; those that take a value.
CONSUL_LOCK_FLAGS = {"-child-exit-code", "-monitor-retry", "-pass-stdin", "-shell", "-verbose"}
CONSUL_LOCK_VALUED = {
    "-n",
    "-name",
    "-timeout",
    "-http-addr",
    "-token",
    "-token-file",
    "-ca-file",
    "-client-cert",
    "-client-key",
    "-tls-server-name",
    "-datacenter",
}


def consul(args: list[str]) -> list[str]:
    """Consul's command: the docs name only ``consul lock [options] PREFIX CMD...``."""
    if args[:1] != ["lock"]:
        return [f"consul {shlex.join(args)}: only consul lock is documented"]
    rest = args[1:]
    while rest and rest[0].startswith("-"):
        option = rest.pop(0)
        name = option.split("=", 1)[0]
        if name not in CONSUL_LOCK_FLAGS | CONSUL_LOCK_VALUED:
            return [f"consul lock: no option {name}"]
        if "=" not in option and name in CONSUL_LOCK_VALUED:
            rest = rest[1:]
    if len(rest) < 2:
        return [f"consul {shlex.join(args)}: consul lock needs a KV prefix and a command"]
    return []


def psql(args: list[str]) -> list[str]:
    """PostgreSQL's client: a connection string and one ``-c`` statement."""
    if "-c" not in args or args.index("-c") + 1 >= len(args):
        return [f"psql {shlex.join(args)}: only psql CONNINFO -c STATEMENT is documented"]
    return []


CHECKS = {
    "pip": pip,
    "celery": celery,
    "celery-exclusive": celery_exclusive,
    "rq": rq,
    "python": python,
    "bash": bash,
    "docker": docker,
    "pytest": pytest_,
    "etcdctl": etcdctl,
    "consul": consul,
    "psql": psql,
}
