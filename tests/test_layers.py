"""The layers of edgekv, checked from the import statements (every one, also inside functions):

    errors < graph < format < runtime < chat < tools < cli        (export/ and jetson/ above all of edgekv)

A module may import its own layer or a lower one, never a higher one, and no modules import
each other in a circle. edgekv never imports export/ or jetson/: the CLI reaches them by module
name at run time (COMMANDS), and bench runs the transformers baseline as `python -m` in a
subprocess; those name references are listed here and nowhere else allowed."""
import ast
import re
from pathlib import Path

from tests.conftest import ROOT

LAYERS = [  # (module prefix, layer): the longest matching prefix decides
    ("edgekv", 0),  # the package itself: its version only
    ("edgekv.errors", 0),
    ("edgekv.graph", 0.5),  # the graph index and its passes (onnx, numpy): below format, whose TensorRT staging uses them
    ("edgekv.format", 1),
    ("edgekv.runtime", 2),
    ("edgekv.chat", 3),
    ("edgekv.serve", 3),
    # inside serve, downwards: what each API shares, its requests and replies, the app, the process
    ("edgekv.serve.api", 3.1), ("edgekv.serve.listen", 3.1), ("edgekv.serve.signals", 3.1),
    ("edgekv.serve.fields", 3.2), ("edgekv.serve.stops", 3.2), ("edgekv.serve.front", 3.2),
    # structured output and tools: request checks whose 400s are api's bad_request
    ("edgekv.serve.structured", 3.2), ("edgekv.serve.tools", 3.2), ("edgekv.serve.tool_plan", 3.2),
    ("edgekv.serve.tool_grammar", 3.2), ("edgekv.serve.tool_stream", 3.2), ("edgekv.serve.tool_constraint", 3.2),
    ("edgekv.serve.reply", 3.3),
    ("edgekv.serve.chat", 3.4), ("edgekv.serve.messages", 3.4), ("edgekv.serve.responses", 3.4),
    ("edgekv.serve.app", 3.5),
    ("edgekv.serve.server", 3.6),
    ("edgekv.serve.bench", 3.7),
    ("edgekv.tools", 4),
    ("edgekv.cli", 5),
    ("edgekv.__main__", 5),
    ("export", 6),
    ("jetson", 6),
]
# edgekv file -> the export/jetson modules it may name in a string (run by name, not imported)
NAME_REFERENCES = {
    "edgekv/cli/__init__.py": {"export.pipeline", "jetson.build_engine"},
    "edgekv/tools/bench.py": {"export.bench_transformers"},
}
PROJECT = ("edgekv", "export", "jetson")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_files() -> dict[str, Path]:
    return {module_name(p): p for top in PROJECT for p in sorted((ROOT / top).rglob("*.py"))}


def imports_of(source: str, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The project modules a module's import statements name (a `from X import Y` of a
    submodule Y counts as importing X.Y)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t.split(".")[0] in PROJECT and t != name}
    return out


def layer(mod: str) -> int:
    best = max((p for p, _ in LAYERS if mod == p or mod.startswith(p + ".")), key=len)
    return dict(LAYERS)[best]


def import_graph() -> dict[str, set[str]]:
    files = project_files()
    return {m: imports_of(p.read_text(), m, p.name == "__init__.py", set(files)) for m, p in files.items()}


def upward(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
            for a, deps in sorted(graph.items()) for b in sorted(deps) if layer(b) > layer(a)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_imports_point_down_the_layers():
    graph = import_graph()
    assert "edgekv.runtime.stats" in graph and "edgekv.chat.session" in graph  # the walk found the tree
    assert upward(graph) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_edgekv_names_export_and_jetson_only_where_it_runs_them_by_name():
    pattern = re.compile(r"^(export|jetson)(\.\w+)+$")
    found = {}
    for mod, path in project_files().items():
        if not mod.startswith("edgekv"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.match(node.value):
                found.setdefault(str(path.relative_to(ROOT)), set()).add(node.value)
    assert found == NAME_REFERENCES
    for names in NAME_REFERENCES.values():
        for name in names:  # each names a module that exists
            assert (ROOT / (name.replace(".", "/") + ".py")).is_file(), name


def test_the_checks_catch_an_upward_import_and_a_cycle():
    """The checker itself: a planted upward import (also one inside a function) and a planted
    cycle are reported."""
    modules = {"edgekv.format.bundle", "edgekv.runtime.cache", "edgekv.runtime.sequence"}
    src = "import numpy\n\ndef f():\n    from edgekv.runtime.cache import KVCache\n"
    deps = imports_of(src, "edgekv.format.bundle", False, modules)
    assert deps == {"edgekv.runtime.cache"}
    assert upward({"edgekv.format.bundle": deps}) != []
    assert imports_of("from . import sequence\n", "edgekv.runtime.cache", False, modules) == {"edgekv.runtime.sequence"}
    assert upward({"jetson.selftest": {"edgekv.runtime.cache"}}) == []
    assert upward({"edgekv.tools.bench": {"export.bench_transformers"}}) != []
    planted = {"edgekv.runtime.cache": {"edgekv.runtime.sequence"}, "edgekv.runtime.sequence": {"edgekv.runtime.cache"}}
    assert cycles(planted) == [["edgekv.runtime.cache", "edgekv.runtime.sequence"]]


# -- where a piece lives ------------------------------------------------------------------------
# The TensorRT parser rules are the format layer's: the exporter and `edgekv check-trt` both import
# them. A command module of tools/ holds its command only, and the exporter imports no command.
RULES = ("edgekv.format.trt_rules", "edgekv.format.trt_graph")  # the rules, what they see of a graph
COMMAND_ONLY = {"edgekv.tools.trt_check"}
EXPORT_MAY_USE_FROM_TOOLS = {"edgekv.tools.progress", "edgekv.tools.corpus"}  # stage lines on stderr; the eval text


def top_level_names(source: str) -> set[str]:
    return {n.name for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def misplaced(sources: dict[str, str], graph: dict[str, set[str]]) -> list[str]:
    rules = set().union(*(top_level_names(sources[m]) for m in RULES))
    out = []
    for mod, src in sorted(sources.items()):
        names = top_level_names(src)
        if mod.startswith("edgekv.tools") and names & rules:
            out.append(f"{mod} defines {', '.join(sorted(names & rules))}, which the format layer's rule checker defines")
        if mod in COMMAND_ONLY and (extra := sorted(n for n in names if not n.startswith("cmd_"))):
            out.append(f"{mod} is a command module but defines {', '.join(extra)}")
    for mod, deps in sorted(graph.items()):
        bad = sorted(d for d in deps if d.startswith("edgekv.tools") and d not in EXPORT_MAY_USE_FROM_TOOLS)
        if mod.split(".")[0] == "export" and bad:
            out.append(f"{mod} imports the command module(s) {', '.join(bad)}")
    return out


def test_the_trt_rules_live_in_the_format_layer():
    sources = {m: p.read_text() for m, p in project_files().items()}
    assert {"check_model", "check_as_built"} <= top_level_names(sources[RULES[0]])
    assert {"Violation", "GraphFacts", "read_onnx"} <= top_level_names(sources[RULES[1]])
    assert misplaced(sources, import_graph()) == []


def test_the_placement_check_catches_the_rules_back_in_tools():
    sources = {m: p.read_text() for m, p in project_files().items()}
    planted = dict(sources)
    planted["edgekv.tools.trt_check"] = sources["edgekv.tools.trt_check"] + "\n\ndef check_model(m):\n    return []\n"
    assert any("defines check_model" in x for x in misplaced(planted, import_graph()))
    planted = dict(sources, **{"edgekv.tools.trt_check": "def helper():\n    pass\n"})
    assert any("command module but defines helper" in x for x in misplaced(planted, import_graph()))
    graph = dict(import_graph(), **{"export.graph_file": {"edgekv.tools.trt_check"}})
    assert any("export.graph_file imports the command" in x for x in misplaced(sources, graph))


def test_the_cli_does_not_touch_argparse_internals():
    """One small function per command builds its parser; none reaches into argparse's private
    `_actions` to change an option after it was added."""
    files = sorted((ROOT / "edgekv" / "cli").glob("*.py"))
    assert files, "edgekv/cli/ not found"
    private = {(f.name, n.attr) for f in files for n in ast.walk(ast.parse(f.read_text()))
               if isinstance(n, ast.Attribute) and n.attr.startswith("_actions")}
    assert private == set()
