"""A handle's operations, seen by type checkers and IDEs: each one declared on
SandboxHandle with the client method's own parameters (sandman_ray/handle_types.py),
the package's lazily imported names declared too, and mypy reading them: on a probe
that misuses the handle, on the examples and on the README's quick start."""

import ast
import re
import subprocess
import sys

import pytest

from conftest import ROOT


def declared_in_type_checking(tree: ast.AST) -> set:
    """Names assigned, annotated or imported under ``if TYPE_CHECKING:`` in ``tree``'s
    own body (a module's or a class's)."""
    out = set()
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for inner in node.body:
                if isinstance(inner, ast.Assign):
                    out.update(t.id for t in inner.targets if isinstance(t, ast.Name))
                elif isinstance(inner, ast.AnnAssign) and isinstance(inner.target, ast.Name):
                    out.add(inner.target.id)
                elif isinstance(inner, ast.ImportFrom):
                    out.update(a.asname or a.name for a in inner.names)
    return out


def test_every_operation_of_the_handle_is_declared_for_type_checkers():
    from sandman_ray.host import DESCRIBED, FORWARDED, STREAMED
    module = ast.parse((ROOT / "sandman_ray" / "handle.py").read_text())
    handle, = [n for n in module.body if isinstance(n, ast.ClassDef)
               and n.name == "SandboxHandle"]
    declared = declared_in_type_checking(handle)
    wanted = {name for op in FORWARDED + STREAMED + DESCRIBED for name in (op, op + "_async")}
    assert sorted(wanted - declared) == [] and sorted(declared - wanted) == []


def test_every_lazy_export_is_declared_for_type_checkers():
    import sandman_ray
    declared = declared_in_type_checking(ast.parse((ROOT / "sandman_ray" /
                                                    "__init__.py").read_text()))
    assert declared == set(sandman_ray.__all__)


PROBE = '''
import sandman_ray as sandman

sb = sandman.acquire("builtin:debian", pool="default", timeout=60)
reveal_type(sb.exec("true", timeout=5).exit_code)
reveal_type(sb.read_file.remote("/tmp/x"))
reveal_type(sb.spawn("sleep 1"))
with sandman.sandbox() as held:
    reveal_type(held.stat("/tmp"))


async def inside() -> None:
    reveal_type(await sb.run_async("cd /tmp"))

sb.exec("true", timout=5)
sb.spawn(5)
'''


def mypy(tmp_path, *paths: str) -> subprocess.CompletedProcess:
    """mypy on ``paths``, reading the checkout's package (an editable install is not
    found by mypy's import finder) and reporting only what is in ``paths``."""
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--follow-imports=silent",
         "--cache-dir", str(tmp_path / "cache"), "--no-error-summary", *paths],
        cwd=str(ROOT), capture_output=True, text=True, timeout=600,
        env={"MYPYPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mypy")
    (tmp / "probe.py").write_text(PROBE)
    text = (ROOT / "README.md").read_text()
    quick = re.search(r"## Quick start\n\n```python\n(.*?)```", text, re.S).group(1)
    (tmp / "quick_start.py").write_text(quick)
    return tmp


def test_a_type_checker_reads_the_handles_operations(checked):
    out = mypy(checked, str(checked / "probe.py")).stdout
    lines = [line.split(": ", 1)[1] for line in out.splitlines() if ": " in line]
    assert 'note: Revealed type is "int | None"' in lines, out
    assert 'note: Revealed type is "ray.includes.object_ref.ObjectRef[bytes]"' in lines, out
    assert 'note: Revealed type is "int"' in lines, out
    assert any("sandman_ray.results.FileStat" in line for line in lines), out
    assert sum("fallback=sandman_ray.results.ExecResult" in line for line in lines) == 1, out
    errors = [line for line in lines if line.startswith("error:")]  # and only these:
    assert len(errors) == 2, out
    assert 'Unexpected keyword argument "timout"' in errors[0], out
    assert 'incompatible type "int"; expected "str | Sequence[str]"' in errors[1], out


def test_mypy_passes_on_the_examples_and_the_quick_start(checked):
    ran = mypy(checked, "examples", str(checked / "quick_start.py"))
    assert ran.returncode == 0, ran.stdout + ran.stderr
