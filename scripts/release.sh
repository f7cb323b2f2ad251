#!/usr/bin/env bash
# Publish a release in one command: build the sdist and the wheel, check them, install
# the wheel in a clean virtual environment and run the example project on it, then print
# the upload command, or run it.
#
#   bash scripts/release.sh              build, check, try; print the upload command
#   bash scripts/release.sh --upload     the same, then upload (twine reads TWINE_USERNAME
#                                        and TWINE_PASSWORD, or ~/.pypirc)
#   bash scripts/release.sh --no-example build and check only
#
# The files land in dist/ (emptied first), or in $RELEASE_DIST. Where $RELEASE_TAG is set
# (the release workflow sets it to the pushed tag), it must be v<version>.
# The tools (build, twine) come from the `release` extra, installed in a virtual
# environment of the script's own: nothing is installed where it runs.
set -euo pipefail
cd "$(dirname "$0")/.."

upload=false
example=true
for arg in "$@"; do
    case "$arg" in
        --upload) upload=true ;;
        --no-example) example=false ;;
        *)
            echo "usage: bash scripts/release.sh [--upload] [--no-example]" >&2
            exit 2
            ;;
    esac
done

dist="${RELEASE_DIST:-dist}"
work="$(mktemp -d "${TMPDIR:-/tmp}/release.XXXXXX")"
trap 'rm -rf "$work"' EXIT
started=$SECONDS

# The version to release and the release extra's tools, from pyproject.toml.
mapfile -t project < <(python3 - <<'PY'
try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib
with open("pyproject.toml", "rb") as file:
    project = tomllib.load(file)["project"]
print(project["version"])
print("\n".join(project["optional-dependencies"]["release"]))
PY
)
version="${project[0]:-}"
tools=("${project[@]:1}")
if [ -z "$version" ] || [ ${#tools[@]} -eq 0 ]; then
    echo "pyproject.toml: no version, or no release extra" >&2
    exit 1
fi
if [ -n "${RELEASE_TAG:-}" ] && [ "$RELEASE_TAG" != "v$version" ]; then
    echo "the tag $RELEASE_TAG does not name the version in pyproject.toml: v$version" >&2
    exit 1
fi

echo "== tools: ${tools[*]}"
python3 -m venv "$work/tools"
"$work/tools/bin/python" -m pip install -q "${tools[@]}"

echo "== build: sdist and wheel into $dist/"
rm -rf "$dist"
"$work/tools/bin/python" -m build --outdir "$dist" . >"$work/build.log" 2>&1 || {
    cat "$work/build.log" >&2
    exit 1
}
shopt -s nullglob
sdists=("$dist"/celery_exclusive-"$version".tar.gz)
wheels=("$dist"/celery_exclusive-"$version"-py3-none-any.whl)
if [ ${#sdists[@]} -ne 1 ] || [ ${#wheels[@]} -ne 1 ]; then
    echo "expected one sdist and one wheel in $dist/, found: $(ls "$dist")" >&2
    exit 1
fi
echo "celery-exclusive $version: $(basename "${sdists[0]}"), $(basename "${wheels[0]}")"

echo "== check: twine check"
"$work/tools/bin/python" -m twine check --strict "${sdists[0]}" "${wheels[0]}"

if $example; then
    echo "== try: the wheel in a clean virtual environment, python -m example_project"
    python3 -m venv "$work/try"
    "$work/try/bin/python" -m pip install -q "${wheels[0]}"
    # The example in a folder of its own, so that the package it imports is the wheel's,
    # not the checkout's.
    mkdir "$work/example"
    cp -R example_project "$work/example/"
    rm -rf "$work/example/example_project/__pycache__" "$work/example/example_project/var"
    cd "$work/example"
    env -u PYTHONPATH "$work/try/bin/python" -c \
        "import celery_exclusive; print('celery_exclusive from', celery_exclusive.__file__)"
    env -u PYTHONPATH "$work/try/bin/python" -m example_project
    cd - >/dev/null
fi

echo "== ready in $((SECONDS - started)) s"
upload_command=(python3 -m twine upload "${sdists[0]}" "${wheels[0]}")
if $upload; then
    "$work/tools/bin/python" -m twine upload --non-interactive "${sdists[0]}" "${wheels[0]}"
else
    echo "To publish, run (twine comes with: pip install '.[release]'):"
    echo "  ${upload_command[*]}"
fi
