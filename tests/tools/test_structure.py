"""The shape of the code, checked from its imports: no import cycles inside neox/ or zerocore/,
no import hidden inside a function to dodge one, and what lies outside the engine (neox, the
examples, the benchmarks, the documentation's code) using only zerocore's public surface
(``zerocore.PUBLIC_MODULES``, docs/api.md)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("neox", "zerocore")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _imports(path: Path, *, top_level_only: bool) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for each import of a file."""
    return _imports_of(ast.parse(path.read_text()), top_level_only=top_level_only)


def _imports_of(tree: ast.Module, *, top_level_only: bool) -> list[tuple[str, list[str], int]]:
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names], node.lineno))
    return out


def _resolve(module: str, names: list[str]) -> list[str]:
    """The project modules an import statement loads (``from pkg import mod`` loads pkg.mod)."""
    targets = [module] if module in MODULES else []
    targets += [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
    return targets


def test_no_import_cycles():
    graph = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for module, names, _ in _imports(path, top_level_only=True):
            for target in _resolve(module, names):
                if target != name:
                    graph[name].add(target)
    # A package's __init__ importing its own modules is its face, not a cycle, as long as no
    # module beneath imports the face back: then every cycle is a real one, and none is allowed.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_no_imports_inside_functions():
    # An import inside a function hides a cycle instead of removing it (STYLE.md).
    hidden = []
    for name, path in MODULES.items():
        top = {(m, line) for m, _, line in _imports(path, top_level_only=True)}
        for module, _, line in _imports(path, top_level_only=False):
            if (module, line) not in top and module.split(".")[0] in PACKAGES:
                hidden.append(f"{path.relative_to(REPO)}:{line}: import {module}")
    assert not hidden, hidden


# zerocore's public surface: the modules zerocore.PUBLIC_MODULES names, and in each the names of
# its __all__ (docs/api.md); every other module is implementation. What lies outside the engine
# (the application, the examples, the benchmarks, the documentation's code) uses only that.
OUTSIDE = ("neox", "examples", "bench")
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
API_PAGE = REPO / "docs" / "api.md"


def _public_modules() -> tuple[str, ...]:
    return importlib.import_module("zerocore").PUBLIC_MODULES


def _python_fences(path: Path) -> list[tuple[str, int]]:
    """(code, line of its first line in the file) of each ```python block of a Markdown file."""
    blocks, code, start = [], None, 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if code is None and line.strip().startswith("```python"):
            code, start = [], number + 1
        elif code is not None and line.strip().startswith("```"):
            blocks.append(("\n".join(code), start))
            code = None
        elif code is not None:
            code.append(line)
    return blocks


def _fence_imports(code: str, first: int) -> list[tuple[str, list[str], int]]:
    """The imports of a code block, each statement parsed on its own: a block may be a sketch
    (``...`` in an argument list, a prompt) that does not parse whole."""
    found, lines, i = [], code.splitlines(), 0
    while i < len(lines):
        statement, line = lines[i].split("#")[0].strip(), first + i
        if statement.startswith(("import ", "from ")):
            while statement.count("(") > statement.count(")") or statement.endswith("\\"):
                i += 1
                statement = statement.rstrip("\\") + " " + lines[i].split("#")[0].strip()
            found += [(m, names, line) for m, names, _ in
                      _imports_of(ast.parse(statement), top_level_only=True)]
        i += 1
    return found


def _surface_breaches(module: str, names: list[str], public: tuple[str, ...]) -> list[str]:
    """What an import takes of zerocore beyond its public surface."""
    if module != "zerocore" and not module.startswith("zerocore."):
        return []
    if module not in public:
        return [f"{module} is not a public module (zerocore.PUBLIC_MODULES)"]
    declared = importlib.import_module(module).__all__
    return [f"{name} is not in {module}.__all__" for name in names if name not in declared]


def test_outside_code_uses_only_zerocores_public_surface():
    public = _public_modules()
    found = []
    for folder in OUTSIDE:
        for path in sorted((REPO / folder).rglob("*.py")):
            for module, names, line in _imports(path, top_level_only=False):
                found += [f"{path.relative_to(REPO)}:{line}: {breach}"
                          for breach in _surface_breaches(module, names, public)]
    for path in DOCS:
        for code, first in _python_fences(path):
            for module, names, line in _fence_imports(code, first):
                found += [f"{path.relative_to(REPO)}:{line}: {breach}"
                          for breach in _surface_breaches(module, names, public)]
    assert not found, found


def test_neox_reaches_no_private_zerocore_attribute():
    # Attributes are not imports: what neox reaches through a public object stays public too.
    for name, path in MODULES.items():
        if name.startswith("neox"):
            text = path.read_text()
            for token in ("._mirror", "zerocore._", "._ShardReader"):
                assert token not in text, f"{path}: uses {token}"


def test_each_public_module_declares_names_it_has():
    public = _public_modules()
    assert len(set(public)) == len(public), public
    wrong = []
    for name in public:
        assert not any(part.startswith("_") for part in name.split(".")), name
        module = importlib.import_module(name)
        declared = getattr(module, "__all__", None)
        if declared is None:
            wrong.append(f"{name} has no __all__")
            continue
        wrong += [f"{name}.__all__ names {n} twice" for n in set(declared)
                  if declared.count(n) > 1]
        wrong += [f"{name}.__all__ names {n}, which {name} does not have" for n in declared
                  if not hasattr(module, n)]
        # A module handed on as a name (zerocore.ops) is public itself, with its own __all__.
        wrong += [f"{name}.{n} is the module {getattr(module, n).__name__}, not a public one"
                  for n in declared if hasattr(module, n)
                  and isinstance(getattr(module, n), type(module))
                  and getattr(module, n).__name__ not in public]
    assert not wrong, wrong


def _api_page() -> dict[str, list[str]]:
    """docs/api.md: each public module (a heading ``## `zerocore.x` ``) and the names its list
    items give (``- `name`, `other`: what it is``), in the page's order."""
    sections: dict[str, list[str]] = {}
    for line in API_PAGE.read_text().splitlines():
        heading = re.fullmatch(r"## `([\w.]+)`.*", line)
        if heading:
            sections[heading.group(1)] = []
        item = re.match(r"- ((?:`\w+`(?:, )?)+):", line)
        if item and sections:
            sections[list(sections)[-1]] += re.findall(r"`(\w+)`", item.group(1))
    return sections


def test_the_api_page_lists_the_public_surface():
    page = _api_page()
    public = list(_public_modules())
    assert list(page) == public, ("docs/api.md's modules (## headings), in order, differ from "
                                  f"zerocore.PUBLIC_MODULES: {list(page)} != {public}")
    differ = {}
    for name, listed in page.items():
        declared = importlib.import_module(name).__all__
        if sorted(listed) != sorted(declared):
            differ[name] = {"on the page only": sorted(set(listed) - set(declared)),
                            "in __all__ only": sorted(set(declared) - set(listed)),
                            "listed twice": sorted({n for n in listed if listed.count(n) > 1})}
    assert not differ, differ


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name):
    importlib.import_module(name)


def test_no_test_module_imports_another():
    # What tests share lives in tests/support (STYLE.md): a test module imported as a library
    # runs its import-time code twice and ties one subject's tests to another's.
    found = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for module, names, line in _imports(path, top_level_only=False):
            targets = [module] + [f"{module}.{n}" for n in names]
            if any(t.split(".")[-1].startswith("test_") for t in targets):
                found.append(f"{path.relative_to(REPO)}:{line}: {module} {names}")
    assert not found, found


# zerocore's floors, lowest first (zerocore/__init__.py's docstring draws them): a module imports
# only modules of its own floor or of floors below it, so nothing runs back up to the face.
ZEROCORE_FLOORS = (
    ("zerocore.policies",),                    # leaf data every floor reads
    ("zerocore.kernels",),
    ("zerocore.comm",),
    ("zerocore.engine",),
    ("zerocore.optim", "zerocore.planning", "zerocore.plan"),
    ("zerocore.loss_scale",),
    ("zerocore.checkpoint",),
    ("zerocore",),                             # the face: __init__ names what users call
    # commands and integrations, above it
    ("zerocore.tools", "zerocore.hf_trainer", "zerocore.hf_pretrained", "zerocore.selftest",
     "zerocore.consolidate", "zerocore.from_deepspeed", "zerocore.__main__"),
)


def _floor(module: str) -> int:
    best, floor = "", None
    for i, names in enumerate(ZEROCORE_FLOORS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > len(best):
                best, floor = name, i
    assert floor is not None, f"{module} is on no floor of ZEROCORE_FLOORS"
    return floor


def test_zerocore_imports_only_downwards():
    upward = []
    for name, path in MODULES.items():
        if not name.startswith("zerocore"):
            continue
        for module, names, line in _imports(path, top_level_only=False):
            for target in _resolve(module, names):
                if target.startswith("zerocore") and _floor(target) > _floor(name):
                    upward.append(f"{path.relative_to(REPO)}:{line}: {name} imports {target}")
    assert not upward, upward


def _is_command(name: str, path: Path) -> bool:
    """A command: a module with a ``main`` (defined, or taken from the command it runs), or one
    of ``neox.commands`` (the commands and the flags they share)."""
    if name == "neox.commands" or name.startswith("neox.commands."):
        return True
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            return True
        if isinstance(node, ast.ImportFrom) and any(a.name == "main" for a in node.names):
            return True
    return False


def test_the_library_of_neox_imports_no_argparse_and_no_command():
    # neox's model, weights, data and run are a library: parsing flags is the commands' work
    # (STYLE.md: a command, a module with a main, is not a library module).
    commands = {name for name, path in MODULES.items()
                if name.startswith("neox") and _is_command(name, path)}
    assert {"neox.finetune", "neox.evaluate", "neox.generate", "neox.export",
            "neox.plan"} <= commands
    found = []
    for name, path in MODULES.items():
        if not name.startswith("neox") or name in commands:
            continue
        for module, names, line in _imports(path, top_level_only=False):
            loaded = set(_resolve(module, names)) | {module}
            if module.split(".")[0] == "argparse" or loaded & commands:
                found.append(f"{path.relative_to(REPO)}:{line}: import {module} {names}")
    assert not found, found


def test_importing_zerocore_needs_only_the_engines_dependencies():
    # `import zerocore` loads what training needs (torch, numpy), not the file formats that only
    # exports write (safetensors: zerocore.consolidate) nor the integrations: .ci's CUDA check
    # imports zerocore in a venv holding only torch, as a minimal install would.
    code = ("import sys, zerocore; print(sorted(m for m in "
            "('safetensors', 'transformers', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True).stdout
    assert out.strip() == "[]", out


def _called_names(path: Path) -> list[tuple[str, int]]:
    """(name, line) of every call of a plain or dotted name in a file: ``f(...)`` and
    ``a.b.f(...)`` give ``f``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name is not None:
                out.append((name, node.lineno))
    return out


# torch's object collectives put their bytes on torch.cuda.current_device() on a NCCL group,
# whatever device the group or the model is on (zerocore/comm/objects.py's docstring).
TORCH_OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object",
                            "scatter_object_list", "send_object_list", "recv_object_list"}


def test_zerocore_exchanges_objects_only_on_a_device_it_names():
    found = [f"{path.relative_to(REPO)}:{line}: {called}"
             for name, path in MODULES.items()
             if name.startswith("zerocore") and name != "zerocore.comm.objects"
             for called, line in _called_names(path) if called in TORCH_OBJECT_COLLECTIVES]
    assert not found, found


def test_zerocore_reads_the_current_device_only_for_its_defaults():
    # comm/device.py: the device shard() computes on when none is given, Platform.detect, and
    # the last resort of choose_comm_device; the commands (selftest) choose their own device.
    allowed = {"zerocore.comm.device"}
    found = [f"{path.relative_to(REPO)}:{line}"
             for name, path in MODULES.items()
             if name.startswith("zerocore") and name not in allowed
             and not _is_command(name, path)
             for called, line in _called_names(path) if called == "current_device"]
    assert not found, found


def test_the_zerocore_library_logs_and_never_prints():
    # The library speaks through the ``zerocore`` logger (logging.getLogger(__name__) beneath
    # it), which the application configures; only commands (a module with a main) print.
    commands = {name for name, path in MODULES.items()
                if name.startswith("zerocore") and _is_command(name, path)}
    assert {"zerocore.__main__", "zerocore.from_deepspeed", "zerocore.checkpoint.consolidate",
            "zerocore.tools.selftest"} <= commands, commands
    found = [f"{path.relative_to(REPO)}:{node.lineno}"
             for name, path in MODULES.items()
             if name.startswith("zerocore") and name not in commands
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print"]
    assert not found, found


def test_no_deprecated_transformers_checkpointing_names():
    """transformers 5.24 renamed gradient checkpointing to activation checkpointing
    (``TrainingArguments(activation_checkpointing=...)``, ``activation_checkpointing_enable``);
    the old names still work but warn (a FutureWarning at each use: 29 in the suite before).
    Neither the README's code blocks nor our code, examples and tests call them (PEFT's own
    calls are PEFT's; prose may still name the old ones)."""
    calls = []
    for folder in ("zerocore", "neox", "examples", "tests", "bench"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and (
                        getattr(node.func, "attr", None) == "gradient_checkpointing_enable"
                        or any(k.arg == "gradient_checkpointing" for k in node.keywords)):
                    calls.append(f"{path.relative_to(REPO)}:{node.lineno}")
    readme_code = "".join(REPO.joinpath("README.md").read_text().split("```")[1::2])
    assert "gradient_checkpointing" not in readme_code
    assert "activation_checkpointing=True" in readme_code  # the ShardedTrainer snippet's
    assert not calls, calls
