"""The documentation stands alone and matches the tree.

- Every relative link in README.md and docs/*.md resolves to a file or folder of this repository,
  and its `#anchor` to a heading of the linked page; no link is absolute or leaves the repository.
- Every repository path (`elastic_gpt/...`, `tests/...`, `bench/...`, ...) and every module
  (`elastic_gpt.x.y`, `elastic_gpt.x.y.name`) the docs, the cluster files and the job configs name
  exists, so the package map and the guides cannot drift from the code unnoticed.
- No file points outside the repository (a sibling checkout, a machine's absolute path).
Pure file reading: no Ray, no torch.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MARKDOWN = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Files whose prose names repository paths: the docs, plus the comments of the deploy files.
NAMING_PATHS = [*MARKDOWN, REPO / "Makefile", REPO / "ray-cluster.yaml",
                *sorted((REPO / "deploy").rglob("*.yaml")), *sorted((REPO / "jobs").rglob("*.yaml"))]
# Outputs the docs describe that exist only after a command has run (all in .gitignore or $OUT).
GENERATED = {"bench/results.json", "bench/recovery.json", "bench/gpu_results.json"}
# Dotted names that are not modules: MLflow tags the tracking code sets.
NOT_MODULES = {"elastic_gpt.model_uri", "elastic_gpt.failure"}

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
# A path starts a word (not inside a URL or an absolute path) with one of the repository's folders.
REPO_PATH = re.compile(r"(?<![\w./$-])((?:elastic_gpt|tests|bench|jobs|deploy|docs)/[\w.*/-]*)")
MODULE = re.compile(r"(?<![\w./-])elastic_gpt(?:\.\w+)+")
# Pointers out of the repository: the sibling folder the design notes once lived in. (Written so
# that this line does not match itself.)
OUTSIDE = re.compile(r"\.\./share[d]\b|/wor[k]/share[d]")
# Not part of the repository's text: local environments, run outputs, caches, binary fixtures.
SKIP_TOP = {".git", ".venv", "runs", "data", "mlartifacts", "mlruns", ".ray_tmp", "build", ".whl", ".gl"}
SKIP_ANY = {"__pycache__", ".ruff_cache", ".pytest_cache", "mlruns"}


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _prose_lines(text: str):
    """Lines outside fenced code blocks, with their 1-based numbers."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for _, line in _prose_lines(page.read_text()):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = _slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _inside_repo(path: Path) -> bool:
    try:
        path.resolve().relative_to(REPO)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("page", MARKDOWN, ids=_rel)
def test_every_relative_link_resolves_inside_the_repository(page):
    broken = []
    for number, line in _prose_lines(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*://|mailto:", target):
                continue  # a web link: not this test's business
            where = f"{_rel(page)}:{number}: {target}"
            path_part, _, anchor = target.partition("#")
            if path_part.startswith("/") or target.startswith("file:"):
                broken.append(f"{where} (absolute: make it relative to the page)")
                continue
            dest = (page.parent / path_part) if path_part else page
            if not _inside_repo(dest):
                broken.append(f"{where} (points outside the repository)")
            elif not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where} (no heading #{anchor} in {_rel(dest.resolve())})")
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", NAMING_PATHS, ids=_rel)
def test_every_repository_path_and_module_named_exists(doc):
    missing = []
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        for path in REPO_PATH.findall(line):
            path = path.rstrip(".,:;")
            found = any(REPO.glob(path)) if "*" in path else (REPO / path).exists()
            if not found and path not in GENERATED:
                missing.append(f"{_rel(doc)}:{number}: {path}")
        for dotted in MODULE.findall(line):
            problem = None if dotted in NOT_MODULES else _module_problem(dotted.rstrip("."))
            if problem:
                missing.append(f"{_rel(doc)}:{number}: {dotted} ({problem})")
    assert not missing, "named but not in the tree:\n" + "\n".join(missing)


def _module_problem(dotted: str) -> str | None:
    """None when `elastic_gpt.a.b[.name]` is a module (or a top-level name of one)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:cut])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if source.is_file():
            break
    else:
        return "no such module"
    rest = parts[cut:]
    if not rest:
        return None
    if len(rest) > 1 and not (base.is_dir() and (base / rest[0]).exists()):
        rest = rest[:1]  # `module.Class.method`: the class is what must exist
    if rest[0] not in _top_level_names(source):
        return f"no module or top-level name {rest[0]!r} in {_rel(source)}"
    return None


def _top_level_names(source: Path) -> set[str]:
    names = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_nothing_points_outside_the_repository():
    suffixes = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sh", ".cfg", ".json", ""}
    offenders = []
    for root, dirs, files in os.walk(REPO):
        rel_root = Path(root).relative_to(REPO)
        dirs[:] = sorted(d for d in dirs if not (
            (rel_root == Path(".") and d in SKIP_TOP) or d in SKIP_ANY or d.endswith(".egg-info")
            or (rel_root / d).as_posix() == "tests/fixtures"))
        for name in sorted(files):
            path = Path(root) / name
            if path.suffix not in suffixes or path.stat().st_size > 1_000_000:
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            for number, line in enumerate(text.splitlines(), 1):
                if OUTSIDE.search(line):
                    offenders.append(f"{_rel(path)}:{number}: {line.strip()}")
    assert not offenders, "points outside the repository:\n" + "\n".join(offenders)


# The package maps. design.md's "Package map" has one row per package (`elastic_gpt/<name>/`,
# `elastic_gpt/*.py` for the top-level modules, `data_pipelines/` and its subpackages) naming every
# file; README's "How it works" has one row per package, naming none.
PACKAGE_ROOTS = ("elastic_gpt", "data_pipelines")


def _tree() -> dict[str, set[str]]:
    tree = {}
    for root in PACKAGE_ROOTS:
        for init in sorted((REPO / root).rglob("__init__.py")):
            d = init.parent
            if d.name == "__pycache__":
                continue
            files = {p.name for p in d.glob("*.py") if p.name != "__init__.py"}
            if d.name == "elastic_gpt":
                tree["elastic_gpt/*.py"] = files
            else:
                tree[f"{_rel(d)}/"] = files
    return tree


def _map_rows(page: str, section: str) -> dict[str, set[str]]:
    text = (REPO / page).read_text()
    start = text.index(f"## {section}\n")
    end = text.find("\n## ", start + 1)
    rows = {}
    for line in text[start:end if end > 0 else None].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith(tuple(f"| `{r}" for r in PACKAGE_ROOTS)) and len(cells) >= 2:
            rows[cells[0].strip("`")] = set(re.findall(r"`(\w+\.py)`", " ".join(cells[1:])))
    return rows


def test_design_package_map_names_every_package_and_file_of_the_tree():
    tree, rows = _tree(), _map_rows("docs/design.md", "Package map")
    problems = [f"no row for {name}" for name in sorted(set(tree) - set(rows))]
    problems += [f"row {name} names no package of the tree" for name in sorted(set(rows) - set(tree))]
    for name in sorted(set(tree) & set(rows)):
        if rows[name] != tree[name]:
            problems.append(f"{name}: missing {sorted(tree[name] - rows[name])}, "
                            f"not in the tree {sorted(rows[name] - tree[name])}")
    assert not problems, "docs/design.md 'Package map' disagrees with the tree:\n" + "\n".join(problems)


def test_readme_package_map_names_every_top_package():
    """A newcomer's map: every package of the tree below the top, and nothing else."""
    top = {name for name in _tree() if name.count("/") <= (2 if name.startswith("elastic_gpt") else 1)}
    rows = _map_rows("README.md", "How it works")
    assert set(rows) == top, (sorted(top - set(rows)), sorted(set(rows) - top))
