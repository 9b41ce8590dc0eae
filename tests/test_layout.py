"""The layout's walls (docs/design-notes.md, "Layout"): import-linter's contracts hold, imports sit
at the top of modules (but in cli/ and for heavy optional dependencies), no private name is used
outside its module, no module but one cohesive format is over ~600 lines, no function over 120 and no
class over 400, and the engine's host side imports no jax."""
import ast
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "medusa_jax")
#: Imported inside functions on purpose: heavy (seconds to import) and needed by few paths.
HEAVY_OPTIONAL = ("torch", "transformers", "matplotlib", "orbax", "jax.experimental", "accelerate")
#: The one module allowed over the size limit: one cohesive format (the heads' three file formats).
LONG_FORMATS = {"convert/medusa_format.py"}
MAX_LINES = 600


def modules():
    for dirpath, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                yield os.path.relpath(path, PACKAGE), path


def test_import_contracts_hold():
    """`lint-imports` (the contracts in pyproject.toml) passes; a broken contract prints its chain."""
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (it comes with the test extra)")
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_imports_are_at_the_top_outside_cli():
    late = []
    for rel, path in modules():
        if rel.startswith("cli" + os.sep):
            continue
        tree = ast.parse(open(path, encoding="utf-8").read())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = ["." * node.level + (node.module or "")]
                else:
                    continue
                late += [f"{rel}:{node.lineno} imports {n} inside {fn.name}()" for n in names
                         if not n.startswith(HEAVY_OPTIONAL)]
    assert not late, "\n".join(late)


def test_no_private_name_is_imported_from_another_module():
    found = []
    for rel, path in modules():
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("medusa_jax"):
                found += [f"{rel}:{node.lineno} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, "\n".join(found)


def test_modules_are_readable_in_one_sitting():
    long = [f"{rel}: {n} lines" for rel, path in modules()
            if (n := sum(1 for _ in open(path, encoding="utf-8"))) > MAX_LINES and rel not in LONG_FORMATS]
    assert not long, "\n".join(long)


#: The most lines of one function (a command's `main` included) and of one class.
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 120, 400


def test_functions_and_classes_fit_on_a_screen_or_two():
    long = []
    for rel, path in modules():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if (n := node.end_lineno - node.lineno + 1) > limit:
                    long.append(f"{rel}:{node.lineno} {node.name}: {n} lines (at most {limit})")
    assert not long, "\n".join(long)


#: The engine's host side (docs/design-notes.md, "Layout"): it decides and keeps the books; the
#: device's work is the runner's, the prefill's and the step's.
HOST_ONLY = ("engine/engine.py", "engine/scheduler.py", "engine/output.py", "engine/front.py", "engine/chooser.py",
             "engine/rows.py")


def test_the_engines_host_side_imports_no_jax():
    found = []
    for rel in HOST_ONLY:
        tree = ast.parse(open(os.path.join(PACKAGE, rel), encoding="utf-8").read())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{rel}:{node.lineno} imports {n}" for n in names if n == "jax" or n.startswith("jax.")]
    assert not found, "\n".join(found)
