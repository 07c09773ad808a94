"""The layers: ckpt and ettr on the ground floor with no arrow between them, integrations above; one layout owner."""

import ast
import pathlib
import re
import subprocess
import sys
from typing import Iterator

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


def _root_kind_forks(tree: ast.AST) -> list[str]:
    """Where code asks what kind of root it has instead of what the root can do: an isinstance check against a
    backend class, a branch on `local_path(...)` being None (directly or through a name it was assigned to), a
    field read from the root's kvstore spec."""
    backends = {"LocalStorage", "KvStorage"}

    def local_path_call(n: ast.AST) -> bool:
        return isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "local_path"

    def bound(n: ast.Assign) -> Iterator[str]:
        """The names `n` binds to a `local_path(...)` call itself (``local, x = s.local_path(p), y`` included)."""
        for t in n.targets:
            pairs = (
                zip(t.elts, n.value.elts)
                if isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple)
                else [(t, n.value)]
            )
            yield from (a.id for a, v in pairs if isinstance(a, ast.Name) and local_path_call(v))

    local_names = {name for n in ast.walk(tree) if isinstance(n, ast.Assign) for name in bound(n)}

    def is_local_path(n: ast.AST) -> bool:
        return local_path_call(n) or (isinstance(n, ast.Name) and n.id in local_names)

    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "isinstance" and len(n.args) == 2:
            classes = {a.id for a in ast.walk(n.args[1]) if isinstance(a, ast.Name)}
            classes |= {a.attr for a in ast.walk(n.args[1]) if isinstance(a, ast.Attribute)}
            if backends & classes:
                found.append(f"line {n.lineno}: {ast.unparse(n)}")
        elif isinstance(n, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in n.ops):
            sides = [n.left, *n.comparators]
            if any(isinstance(s, ast.Constant) and s.value is None for s in sides) and any(map(is_local_path, sides)):
                found.append(f"line {n.lineno}: {ast.unparse(n)}")
        elif isinstance(n, (ast.If, ast.IfExp, ast.While)) and is_local_path(n.test):
            found.append(f"line {n.lineno}: {ast.unparse(n.test)}")
        elif (
            isinstance(n, ast.Subscript)
            and isinstance(n.value, ast.Call)
            and isinstance(n.value.func, ast.Attribute)
            and n.value.func.attr == "kvstore_spec"
        ):
            found.append(f"line {n.lineno}: {ast.unparse(n)}")
    return sorted(found, key=lambda f: int(f.split()[1].rstrip(":")))


def test_no_module_outside_storage_forks_on_the_kind_of_root():
    """A backend is one class: outside ckpt/storage/, code asks a root what it can do (`direct_path`,
    `lease_kind`, `keeps_written_buffers`, ...), never which backend it is, so a new one changes nothing else."""
    found = [
        f"{p.relative_to(ROOT)} {fork}"
        for p in _sources("ckpt")
        if p.relative_to(ROOT / "ckpt").parts[0] != "storage"
        for fork in _root_kind_forks(ast.parse(p.read_text()))
    ]
    assert not found, found


def test_the_fork_check_finds_the_forks_it_forbids():
    """The check above sees each form of the fork (so that its silence means something)."""
    code = """
def f(storage, spec):
    local = storage.local_path("")
    if local is None:
        pass
    a = 1 if storage.local_path("x") is not None else 2
    if isinstance(storage, KvStorage) or isinstance(storage, (storage_mod.LocalStorage, int)):
        pass
    memory = storage.kvstore_spec("")["driver"] == "memory"
    if storage.local_path(""):
        pass
    holder = read(storage.local_path(""))  # a path used, not a branch on it
    if holder is None:
        pass
    return where(storage, "x"), storage.direct_path("") is None
"""
    assert [f.split(":")[0] for f in _root_kind_forks(ast.parse(code))] == [
        "line 4",
        "line 6",
        "line 7",
        "line 7",
        "line 9",
        "line 10",
    ]


# The floors inside each package, top to bottom (docs/architecture.md): a module imports only its own floor or
# lower ones, and no package has an import cycle. A new module must be given a floor here.
FLOORS = {
    "ckpt": {
        "tools": {"cli", "__main__", "importers", "storage_args", "__init__"},
        "policy": {"manager", "options", "retention", "schedule", "target", "tiers", "fallback"},
        "mechanism": {
            "background",
            "root_lease",
            "observer",
            "save",
            "restore",
            "store",
            "chunk_files",
            "packs",
            "staging",
            "snapshot",
            "budget",
            "distributed",
            "planner",
            "lease",
            "catalog",
            "persist",
            "replica",
            "reader",
            "exporter",
            "run",
            "safetensors_file",
            "determinism",
        },
        "format": {"layout", "format", "state", "tree"},
        "roots": {"storage"},
        "base": {"errors", "paths", "pools", "_lazy"},
    },
    "ettr": {
        "tools": {"cli", "__main__", "__init__"},
        "reports": {"report", "advice", "simulate"},
        "recording": {"tracker", "telemetry"},
        "accounting": {"attribution", "replay", "formulas", "ledger", "clock", "stragglers"},
    },
}


def _package_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (relative imports, inside functions too)."""
    graph: dict[str, set[str]] = {}
    for p in _sources(package):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        here = parts[:-1]  # the package a relative import starts from
        mod = ".".join(parts[:-1] if p.name == "__init__.py" else parts)
        deps = graph.setdefault(mod, set())
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ImportFrom) and n.level > 0:
                base = here[: len(here) - n.level + 1]
                targets = [n.module] if n.module else [a.name for a in n.names]
                deps |= {".".join(base + t.split(".")) for t in targets}
    return graph


def _floor(package: str, module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for i, (_, names) in enumerate(FLOORS[package].items()):
        if top in names:
            return i
    raise AssertionError(f"{module} has no floor in tests/test_architecture.py FLOORS: give it one")


@pytest.mark.parametrize("package", ["ckpt", "ettr"])
def test_no_module_imports_a_floor_above_its_own(package):
    graph = _package_graph(package)
    found = []
    for mod, deps in graph.items():
        for dep in deps:
            key = (".".join(mod.split(".")[:2]), ".".join(dep.split(".")[:2]))
            same = key[0] == key[1]
            if not same and _floor(package, dep) < _floor(package, mod):
                found.append(f"{mod} ({_floor(package, mod)}) imports {dep} ({_floor(package, dep)})")
    assert not found, found


@pytest.mark.parametrize("package", ["ckpt", "ettr"])
def test_no_import_cycle_inside_a_package(package):
    """Between top-level modules (a subpackage counts as one)."""
    edges: dict[str, set[str]] = {}
    for mod, deps in _package_graph(package).items():
        src = ".".join(mod.split(".")[:2])
        for dep in deps:
            dst = ".".join(dep.split(".")[:2])
            if dst != src and dst != package:
                edges.setdefault(src, set()).add(dst)
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join(path + [node, nxt])}"
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
