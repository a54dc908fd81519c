"""The package's shape: no import cycles (function-local and TYPE_CHECKING imports included), no
import from a lower layer to a higher one, a benchmark client that loads no torch, and a README
whose package map is the tree."""

from __future__ import annotations

import ast
import fnmatch
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KILN = ROOT / "kiln"

# lowest first: a module may import its own layer (without cycles) and the ones below
LAYERS = [
    {
        "kiln.errors",
        "kiln.paths",
        "kiln.native",
        "kiln.default_model",
        "kiln.sampling_params",
        "kiln.outputs",
    },
    {"kiln.config"},
    {"kiln.layers", "kiln.attention", "kiln.models", "kiln.loader"},
    {"kiln.compiler", "kiln.cudagraphs", "kiln.compile_cache"},
    {"kiln.engine", "kiln.spec"},
    {"kiln.runner"},
    {"kiln.boot"},
    {"kiln.llm", "kiln.server"},
    {"kiln.cli", "kiln.__main__"},
]
# the benchmark is an HTTP client of any server: it may use its profiles, never the engine
CLIENT = {
    "kiln.bench": {"kiln.bench", "kiln.profiles", "kiln.errors", "kiln.default_model"},
    "kiln.profiles": {"kiln.profiles", "kiln.config", "kiln.errors", "kiln.default_model"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every kiln module `path` imports, wherever the import statement is."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kiln"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import mod`
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kiln"))
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in KILN.rglob("*.py")}
    return {
        name: {m for m in _imports(path) if m in files} - {name} for name, path in files.items()
    }


def _unit(module: str) -> str:
    """The package a module belongs to for layering: kiln.<package> or a top-level module."""
    return ".".join(module.split(".")[:2])


def _layer(unit: str) -> int | None:
    return next((i for i, layer in enumerate(LAYERS) if unit in layer), None)


def test_every_package_has_a_place():
    units = {_unit(m) for m in _graph()} - {"kiln"}
    placed = set().union(*LAYERS) | set(CLIENT)
    assert units <= placed, f"give {sorted(units - placed)} a layer in this test"


def test_no_import_cycles():
    graph, state, cycles = _graph(), {}, []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_from_a_lower_layer_to_a_higher_one():
    wrong = []
    for module, deps in _graph().items():
        unit = _unit(module)
        for dep in deps:
            target = _unit(dep)
            if target == "kiln":  # the root package: lazy, it imports nothing at run time
                continue
            if unit in CLIENT:
                ok = target in CLIENT[unit]
            elif unit in ("kiln", "kiln.cli"):  # the package's two front doors
                ok = True
            else:
                ok = _layer(target) is not None and _layer(target) <= _layer(unit)
            if not ok:
                wrong.append(f"{module} -> {dep}")
    assert not wrong, "\n".join(sorted(wrong))


@pytest.mark.parametrize(
    "code",
    [
        "from kiln.cli.main import main\ntry:\n    main(['bench', '--help'])\nexcept SystemExit:\n"
        "    pass",
        "import kiln.cli.bench, kiln",
        "from kiln.cli.main import main\ntry:\n    main(['serve', '--help'])\nexcept SystemExit:\n"
        "    pass",
    ],
)
def test_the_benchmark_and_help_load_no_torch(code):
    check = f"{code}\nimport sys\nassert 'torch' not in sys.modules, sorted(sys.modules)"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_public_names_resolve():
    import kiln

    assert set(kiln.__all__) == set(kiln._EXPORTS)
    for name in kiln.__all__:
        assert getattr(kiln, name).__name__ == name


def _package_map() -> str:
    """The code block of the README's '## Map of the package' section."""
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"^## Map of the package\n.*?^```\n(.*?)^```$", readme, re.M | re.S)
    assert match, "README.md needs a '## Map of the package' section with the tree in a block"
    return match.group(1)


def test_the_readme_package_map_is_the_tree():
    text = _package_map()
    # each line: names in its first column ("config/", "models/, layers/"), then what they hold
    first_columns = [re.split(r"\s{2,}", line.strip())[0] for line in text.splitlines()]
    named = {n for col in first_columns for n in re.findall(r"\b([a-z_]+)/", col)} - {"kiln"}
    packages = {p.name for p in KILN.iterdir() if (p / "__init__.py").exists()}
    assert named == packages, f"README's map: {sorted(named)}; the tree: {sorted(packages)}"
    for module in re.findall(r"\b([a-z_]+\.py)\b", text):
        assert list(KILN.rglob(module)), f"README's map names {module}, which is not in kiln/"


def test_every_kernel_source_and_what_it_includes_ships_with_the_package():
    """kiln builds its C++ kernels at first use from the sources in the installed package, so a
    wheel must carry each csrc/ file and every header they include (a missing header leaves
    both CPU attention kernels unbuilt, with only a warning)."""
    from kiln.native import included_headers

    tomllib = pytest.importorskip("tomllib")  # the standard library's from Python 3.11

    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]
    sources = sorted(KILN.glob("**/csrc/*.cpp"))
    assert sources  # the attention kernels and the int4 matmul
    for source in sources:
        for path in [source, *included_headers(source)]:
            package = ".".join(path.parent.parent.relative_to(ROOT).parts)
            relative = path.relative_to(path.parent.parent).as_posix()
            globs = package_data.get(package, [])
            assert any(fnmatch.fnmatch(relative, g) for g in globs), (package, relative, globs)
