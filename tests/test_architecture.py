"""The layers: ckpt and ettr on the ground floor with no arrow between them, integrations above; one layout owner."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _sources(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _imports(path: pathlib.Path) -> set[str]:
    """Modules a module imports (absolute imports only; relative ones stay inside the package)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


# One storage stack per root: ettr's ledger opens object-store roots through ckpt's storage mechanism (endpoint,
# credentials, timeouts configured once), and ettr's CLI takes the same storage options as ckpt's (one parser),
# never ckpt's policy or layout.
ALLOWED = {("ettr/ledger.py", "ckpt.storage"), ("ettr/cli.py", "ckpt.storage_args")}


@pytest.mark.parametrize(
    "package, forbidden", [("ckpt", {"ettr", "integrations", "bench"}), ("ettr", {"ckpt", "integrations", "bench"})]
)
def test_no_upward_arrow_and_none_between_ckpt_and_ettr(package, forbidden):
    found = {
        f"{p.relative_to(ROOT)} imports {m}"
        for p in _sources(package)
        for m in _imports(p)
        if m.split(".")[0] in forbidden and (str(p.relative_to(ROOT)), m) not in ALLOWED
    }
    assert not found, sorted(found)


def test_ettr_knows_nothing_of_ckpts_directory_names():
    """ettr attributes from its own ledger records; ckpt's layout (step directories, manifests) is ckpt.layout's."""
    pattern = re.compile(r"manifest|(^|/)step_[*0-9{%]|_quarantine|_IN_PROGRESS")
    found = [
        f"{p.relative_to(ROOT)}: {node.value!r}"
        for p in _sources("ettr")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.search(node.value)
    ]
    assert not found, found


def test_only_layout_spells_the_names_of_a_root():
    """Paths inside a root are built by ckpt.layout alone: no other module spells a marker's or file's name."""
    names = re.compile(
        r"manifest\.json|_IN_PROGRESS|_DAMAGED|_quarantine|_LEASE|_GC_LOCK|run\.json|(^|/)arrays/|step_\{"
    )
    found = []
    for p in _sources("ckpt"):
        if p.name == "layout.py":
            continue
        tree = ast.parse(p.read_text())
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body and isinstance(n.body[0], ast.Expr)
        }
        found += [
            f"{p.name}: {n.value!r}"
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant)
            and isinstance(n.value, str)
            and id(n) not in docstrings
            and names.search(n.value)
        ]
    assert not found, found
