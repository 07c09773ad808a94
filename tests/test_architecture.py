"""The layers: ckpt and ettr on the ground floor with no arrow between them, integrations above; one layout owner."""

import ast
import pathlib
import re
import subprocess
import sys

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


def test_the_lazy_package_root_and_its_type_checking_imports_name_the_same_homes():
    """`ckpt`'s public names load on first use: each loads from the module `_HOME` names, and the imports for type
    checkers say the same (a name moved to another module must move in both)."""
    import ckpt

    init = ROOT / "ckpt" / "__init__.py"
    guarded = next(
        n for n in ast.parse(init.read_text()).body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    )
    typed = {a.name: node.module for node in guarded.body for a in node.names}
    assert typed == ckpt._HOME
    assert sorted(ckpt.__all__) == sorted(ckpt._HOME) == sorted(n for n in dir(ckpt) if n in ckpt._HOME)
    for name, home in ckpt._HOME.items():
        assert getattr(ckpt, name).__module__ == f"ckpt.{home}", name
    with pytest.raises(AttributeError, match="no attribute 'CheckpointManagr'"):
        ckpt.CheckpointManagr  # noqa: B018


def test_ettrs_cli_and_ckpts_storage_do_not_import_torch():
    """ettr's report/advise CLI reads ledgers through ckpt.storage: neither may pay torch's import (~2 s a call)."""
    code = "import sys, ettr.cli, ckpt.storage; print(sorted(m for m in ('torch', 'ckpt.manager') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
