"""The fenced code blocks of the markdown docs, their doc-test directives, and a runner for one file's blocks.

A directive is an HTML comment (invisible when rendered) on the line right before a fence:

    <!-- doc-test: skip: REASON -->          not runnable as is (a signature, an output sample, a long command)
    <!-- doc-test: prelude=NAME[,NAME] -->  python: run tests/doc_preludes/NAME.py first; it defines what a
                                            fragment takes from the reader's own program (a model, a dataset);
                                            the block sees the objects it made, not the modules it imported
    <!-- doc-test: needs=PATH[,PATH] -->    PATH, written by an earlier block of the same file, must exist
    <!-- doc-test: replace=OLD -> NEW -->   run with OLD replaced by NEW (a 10,000-step run shortened)
    <!-- doc-test: requires=MODULE -->      an optional extra the block needs: skipped, saying so, when the
                                            module is not installed (as the extra's own tests are); a failure
                                            with CKPT_REQUIRE_EXTRAS=1 (scripts/test.sh)

Items are separated by `;` (a skip's reason is the rest of the comment). Every block is either run or marked
skip with a reason. Run as `python doc_blocks.py FILE.md` in an empty directory: python blocks are exec'd in
order, each in a fresh namespace (with its preludes) in this one interpreter, bash/console blocks line by
line with bash in the same directory, so a later block sees the files an earlier one wrote.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import BuiltinFunctionType, FunctionType, ModuleType

PRELUDES = Path(__file__).resolve().parent / "doc_preludes"
RUNNABLE = {"python": "python", "bash": "bash", "sh": "bash", "shell": "bash", "console": "console"}
DIRECTIVE = re.compile(r"^\s*<!--\s*doc-test:(.*?)-->\s*$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
COMMAND_TIMEOUT_S = 180


@dataclass
class Block:
    """One fenced block: where it starts (1-based line of the fence), its info-string language and text."""

    path: Path
    line: int
    lang: str
    code: str
    skip: str | None = None  # the reason, when marked skip ("" when marked without one)
    preludes: list[str] = field(default_factory=list)
    needs: list[str] = field(default_factory=list)
    requires: list[str] = field(default_factory=list)
    replace: list[tuple[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"

    def source(self) -> str:
        """The code as run: with the directive's replacements applied."""
        code = self.code
        for old, new in self.replace:
            code = code.replace(old, new)
        return code


def _apply_directive(block: Block, text: str) -> None:
    """Parse `text` (between 'doc-test:' and '-->') into the block's fields; bad items become errors."""
    text = text.strip()
    if text.startswith("skip"):
        block.skip = text[4:].lstrip(" :").strip()
        return
    for item in filter(None, (i.strip() for i in text.split(";"))):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not value:
            block.errors.append(f"directive item {item!r} is not KEY=VALUE")
        elif key == "prelude":
            block.preludes += [v.strip() for v in value.split(",")]
        elif key == "needs":
            block.needs += [v.strip() for v in value.split(",")]
        elif key == "requires":
            block.requires += [v.strip() for v in value.split(",")]
        elif key == "replace":
            old, arrow, new = value.partition(" -> ")
            if not arrow or not old:
                block.errors.append(f"replace needs 'OLD -> NEW', got {value!r}")
            else:
                block.replace.append((old, new))
        else:
            block.errors.append(f"unknown directive {key!r} (skip, prelude, needs, replace, requires)")


def parse(path: Path, text: str | None = None) -> list[Block]:
    """Every fenced block of a markdown file with the directive right before it; a dangling directive is an error."""
    lines = (path.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    pending: tuple[int, str] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        directive = DIRECTIVE.match(line)
        fence = FENCE.match(line)
        if directive:
            if pending is not None:
                blocks.append(Block(path, pending[0], "", "", errors=["directive not followed by a code block"]))
            pending = (i + 1, directive.group(1))
        elif fence:
            indent, marker, lang = fence.groups()
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith(marker):
                end += 1
            body = [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : end]]
            block = Block(path, i + 1, lang.lower(), "\n".join(body) + "\n")
            if pending is not None:
                _apply_directive(block, pending[1])
                pending = None
            blocks.append(block)
            i = end
        elif line.strip() and pending is not None:
            blocks.append(Block(path, pending[0], "", "", errors=["directive not followed by a code block"]))
            pending = None
        i += 1
    if pending is not None:
        blocks.append(Block(path, pending[0], "", "", errors=["directive not followed by a code block"]))
    return blocks


def problems(blocks: list[Block]) -> list[str]:
    """What keeps these blocks from being either run or knowingly skipped (empty: all is well)."""
    out = [f"{b.where}: {e}" for b in blocks for e in b.errors]
    for b in blocks:
        if b.errors:
            continue
        if b.skip is not None:
            if not b.skip:
                out.append(f"{b.where}: skip without a reason: write <!-- doc-test: skip: WHY -->")
            continue
        if b.lang not in RUNNABLE:
            out.append(
                f"{b.where}: a ```{b.lang} block cannot run: mark it <!-- doc-test: skip: WHY --> "
                f"(a signature, an output sample) or tag it python/bash"
            )
            continue
        if b.preludes and RUNNABLE[b.lang] != "python":
            out.append(
                f"{b.where}: a prelude is for python blocks; a command block uses needs= on what an earlier "
                f"block of the file wrote"
            )
        for name in b.preludes:
            if not (PRELUDES / f"{name}.py").is_file():
                out.append(f"{b.where}: prelude {name!r} not found in {PRELUDES}")
        for old, _ in b.replace:
            if old not in b.code:
                out.append(f"{b.where}: replace: {old!r} does not occur in the block")
        if RUNNABLE[b.lang] == "python":
            try:
                compile(b.source(), b.where, "exec")
            except SyntaxError as e:
                out.append(f"{b.where}: python does not compile (block line {e.lineno}): {e.msg}")
    return out


def commands(block: Block) -> list[str]:
    """The shell commands of a bash block (one per line, backslash continuations joined, comments dropped)."""
    out, current = [], ""
    for raw in block.source().splitlines():
        line = raw.rstrip()
        if RUNNABLE[block.lang] == "console":
            if not current and not line.lstrip().startswith("$ "):
                continue  # output shown in the block, not a command
            line = line.lstrip()[2:] if not current else line
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        out.append(current + line)
        current = ""
    return out


def _defined_in(value: object, module: str) -> bool:
    """False for modules and for classes/functions a prelude imported: the block must import those itself."""
    if isinstance(value, ModuleType):
        return False
    if isinstance(value, (type, FunctionType, BuiltinFunctionType)):
        return getattr(value, "__module__", None) == module
    return True


def _run_python(block: Block) -> None:
    """Exec the block in a fresh namespace holding only the preludes' stand-ins (no modules: a block imports them)."""
    given: dict[str, object] = {}
    for name in block.preludes:
        prelude = PRELUDES / f"{name}.py"
        scope = {"__name__": f"doc_prelude_{name}", **given}
        exec(compile(prelude.read_text(), str(prelude), "exec"), scope)  # noqa: S102 - test-owned code
        given.update((k, v) for k, v in scope.items() if not k.startswith("_") and _defined_in(v, scope["__name__"]))
    exec(compile(block.source(), f"{block.path}:{block.line}", "exec"), {"__name__": "__main__", **given})  # noqa: S102


def _run_bash(block: Block) -> None:
    for command in commands(block):
        proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(
                f"`{command}` exited with status {proc.returncode}\n"
                f"--- stdout\n{proc.stdout[-3000:]}--- stderr\n{proc.stderr[-3000:]}"
            )


def run(path: Path) -> int:
    """Run the file's runnable blocks in order in the current directory; 0 if all ran, else 1 (first failure)."""
    blocks = parse(path)
    found = problems(blocks)
    if found:
        print("\n".join(found))
        return 1
    for block in blocks:
        if block.skip is not None:
            print(f"skip {block.where}: {block.skip}", flush=True)
            continue
        absent = [m for m in block.requires if importlib.util.find_spec(m) is None]
        if absent and os.environ.get("CKPT_REQUIRE_EXTRAS") == "1":  # scripts/test.sh: extras are not optional
            print(f"FAILED {block.where}: {', '.join(absent)} not installed (CKPT_REQUIRE_EXTRAS=1)", flush=True)
            return 1
        if absent:
            print(f"skip {block.where}: {', '.join(absent)} not installed", flush=True)
            continue
        t0 = time.monotonic()
        try:
            missing = [p for p in block.needs if not Path(p).exists()]
            if missing:
                raise FileNotFoundError(f"needs {missing}, which no earlier block of {path.name} wrote")
            (_run_python if RUNNABLE[block.lang] == "python" else _run_bash)(block)
        except BaseException:  # a block's SystemExit is a failure too
            print(f"FAILED {block.where} ({block.lang} block)\n{traceback.format_exc()}", flush=True)
            return 1
        print(f"ok {block.where} ({time.monotonic() - t0:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    code = run(Path(sys.argv[1]).resolve())
    gc.freeze()  # the runner ends here: no final collections over what the blocks imported (torch: ~0.8 s)
    sys.exit(code)
