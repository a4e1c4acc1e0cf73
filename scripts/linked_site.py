"""A site folder of links to the installed files of the given distributions and everything
they require (extras aside): `python linked_site.py DEST torch cuda-bindings`. For a fresh venv
on a machine with no package index (scripts/fresh_venv_check.sh)."""

import importlib.metadata as md
import re
import sys
from pathlib import Path


def closure(names):
    seen, stack = {}, list(names)
    while stack:
        name = stack.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            print(f"not installed (skipped): {name}")
            continue
        seen[key] = dist
        for req in dist.requires or []:
            spec, _, marker = req.partition(";")
            if "extra" in marker:
                continue
            stack.append(re.split(r"[ <>=!~\[(]", spec.strip(), maxsplit=1)[0])
    return seen


def main(dest, *names):
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for key, dist in sorted(closure(names).items()):
        tops = {Path(str(f)).parts[0] for f in dist.files or []}
        base = Path(dist.locate_file(""))
        for top in sorted(tops):
            src = base / top
            if top == ".." or not src.exists() or (dest / top).exists():
                continue
            (dest / top).symlink_to(src)
        print(f"linked {key} {dist.version}")


if __name__ == "__main__":
    main(*sys.argv[1:])
