"""The package's modules import each other without a circle and never up the layers,
and the janitor, a process of its own, loads no Ray. Read from the source (every import, at module level or in a
function), so a circle that only bites on some code path is found too."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"sandman_ray": ROOT / "sandman_ray"}


def modules():
    """Module name -> source path of every module of the project's packages."""
    found = {}
    for package, base in PACKAGES.items():
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if "docs" in parts:
                continue
            found[".".join([package] + parts)] = path
    return found


def imports(name, path, known):
    """The project modules that ``name`` imports."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # "from package import module" names the module; otherwise the module itself
            targets = [base + "." + a.name if base + "." + a.name in known else base
                       for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def test_no_import_circles():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert len(graph) > 40 and graph["sandman_ray.api"], "the reader found the project"
    circles, state = [], {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == [], "\n".join(" -> ".join(c) for c in circles)


# The layers, lowest first: a module imports its own layer and those below it, never one
# above (a module is in the layer of the longest prefix that names it).
LAYERS = (
    ("the names everything shares", ("sandman_ray._lazy", "sandman_ray.names",
                                     "sandman_ray.errors", "sandman_ray.results",
                                     "sandman_ray.daemon")),
    ("what a sandbox is and how to talk to it", ("sandman_ray.spec", "sandman_ray.client",
                                                 "sandman_ray.handle_types",
                                                 "sandman_ray.control", "sandman_ray.raised")),
    ("images", ("sandman_ray.images", "sandman_ray.image_builders", "sandman_ray.image_files",
                "sandman_ray.image_layers", "sandman_ray.image_layouts",
                "sandman_ray.image_budget", "sandman_ray.bundle")),
    ("providers", ("sandman_ray.providers",)),
    ("the pool", ("sandman_ray.pool",)),
    ("handles and their hosts", ("sandman_ray.host", "sandman_ray.handle", "sandman_ray.direct",
                                 "sandman_ray.lookup", "sandman_ray.touches",
                                 "sandman_ray.forking", "sandman_ray.pool_calls")),
    ("the public API", ("sandman_ray", "sandman_ray.api", "sandman_ray.forks",
                        "sandman_ray.remote")),
    ("what is built on it", ("sandman_ray.service", "sandman_ray.integrations",
                             "sandman_ray.cli")),
)


def layer_of(module: str):
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and \
                    (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def test_no_import_runs_up_the_layers():
    known = modules()
    assert [m for m in sorted(known) if layer_of(m) is None] == [], "a module in no layer"
    upward = ["%s -> %s (%s -> %s)" % (a, b, LAYERS[layer_of(a)][0], LAYERS[layer_of(b)][0])
              for a, path in sorted(known.items()) for b in sorted(imports(a, path, known))
              if layer_of(b) > layer_of(a)]
    assert upward == [], "\n".join(upward)


def test_the_layer_check_sees_an_upward_import():
    assert layer_of("sandman_ray.spec") < layer_of("sandman_ray.providers.syscalls")
    assert layer_of("sandman_ray.images") < layer_of("sandman_ray.providers.base")
    assert layer_of("sandman_ray.providers.nodes") < layer_of("sandman_ray.pool.cluster")


def test_the_janitor_loads_no_ray():
    """Started by each node agent as a process of its own, for every provider's sandboxes:
    it must start fast and must not depend on Ray's state."""
    code = ("import sys, sandman_ray.providers.janitor as j, sandman_ray.providers.docker.engine;"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_verl_tool_imports_and_works_without_verl():
    """With verl not importable, SandboxTool is still there, with the same constructor,
    a dict schema and the stand-in ToolResponse (a subprocess, so that this process's
    verl stays loaded)."""
    script = (
        "import sys\n"
        "class NoVerl:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'verl' or name.startswith('verl.'):\n"
        "            raise ImportError('verl is not installed here')\n"
        "sys.meta_path.insert(0, NoVerl())\n"
        "from sandman_ray.integrations.verl import BaseTool, SandboxTool, ToolResponse\n"
        "tool = SandboxTool({'pool': 'p', 'linger_s': 5})\n"
        "assert BaseTool is object and type(tool).__mro__[1] is object\n"
        "assert tool.name == 'shell' and tool.get_openai_tool_schema()['type'] == 'function'\n"
        "assert ToolResponse(text='x').text == 'x'\n"
        "assert not any(m == 'verl' or m.startswith('verl.') for m in sys.modules)\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=str(ROOT))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
