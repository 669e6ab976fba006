"""The package's tree, read from the source: dependencies point down only.

Every ``import`` of a fastload module counts, at module level or inside a function (a lazy import
is still a dependency); imports under ``if TYPE_CHECKING:`` do not (they never run), except for
the circle check of files, where a type-only import still ties two files together. The layers,
bottom up: ``core`` (and ``families``, the one place that asks which model family a model
belongs to, beside it), ``distributed`` and ``training`` (plugged into the core's pipeline
through the steps the entry passes in, :mod:`fastload.core.plan.steps`), ``reloading`` (the
record a load leaves, as a step too), the safetensors-compatible API, the Hugging Face layer (and
the diffusers layer above it), the integrations, the public entry (``fastload``, ``fastload.api``)
and the tools. Inside the core, its rooms point down only. No module and no package reaches itself
through its imports; the core names none of its callers; no module is over 400 lines, and no
function of the load's spine over 80; the plan's modes and actions are enums.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "fastload"

#: each package of the tree and the packages it may import (besides itself and fastload._core)
MAY_IMPORT: dict[str, set[str]] = {
    "fastload.core": set(),
    "fastload.families": set(),
    "fastload.distributed": {"fastload.core"},
    "fastload.training": {"fastload.core", "fastload.families"},
    "fastload.reloading": {"fastload.core", "fastload.distributed"},
    "fastload.safetensors": {
        "fastload.core",
        "fastload.distributed",
        "fastload.families",
        "fastload.training",
    },
    "fastload.hf": {
        "fastload.core",
        "fastload.distributed",
        "fastload.families",
        "fastload.training",
        "fastload.reloading",
        "fastload.safetensors",
    },
    "fastload.diffusion": {
        "fastload.core",
        "fastload.distributed",
        "fastload.families",
        "fastload.training",
        "fastload.reloading",
        "fastload.safetensors",
        "fastload.hf",
    },
    "fastload.integrations": {
        "fastload.core",
        "fastload.distributed",
        "fastload.families",
        "fastload.training",
        "fastload.reloading",
        "fastload.safetensors",
    },
}
ENTRY = {"fastload", "fastload.api"}
#: the most lines a module may have
MAX_LINES = 400
#: the rooms of the core, bottom up: each imports only the rooms before it; the spine
#: (``loading``, ``phases``, ``finishing``) sits on top, and no room imports it
CORE_ROOMS = ("basics", "checkpoint", "store", "memory", "model", "devices", "plan", "reads")
SPINE_MODULES = {
    "fastload.core",
    "fastload.core.loading",
    "fastload.core.phases",
    "fastload.core.finishing",
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def imports_of(name: str, path: Path, modules: set[str], *, type_only: bool = False) -> set[str]:
    """The fastload modules that module ``name`` (at ``path``) imports when it runs (with
    ``type_only``, also those it imports for type checkers only)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = set() if type_only else _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # ``from fastload.hf import hub`` depends on the submodule, not the package's names
            subs = {f"{origin}.{a.name}" for a in node.names} & modules
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(origin)
    return {m for m in out if m in modules and m != name}


#: the Rust extension: a leaf every layer may use
EXTENSION = "fastload._core"


def import_graph(*, type_only: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    names = set(modules) | {EXTENSION}
    return {
        name: imports_of(name, path, names, type_only=type_only) for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_reader_sees_module_level_lazy_and_relative_imports(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import fastload.b\n"
        "if TYPE_CHECKING:\n    from fastload import c\n"
        "def f():\n    from fastload.pkg import d\n"
    )
    got = imports_of(
        "fastload.a",
        tmp_path / "a.py",
        {"fastload.a", "fastload.b", "fastload.c", "fastload.pkg", "fastload.pkg.d"},
    )
    assert got == {"fastload.b", "fastload.pkg.d"}


def test_the_cycle_finder_finds_a_circle_and_nothing_else() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_real_graph_has_the_edges_of_a_load() -> None:
    graph = import_graph()
    loading = graph["fastload.core.loading"]
    assert {"fastload.core.plan.planning", "fastload.core.plan.load_options"} <= loading
    assert "fastload.core.loading" in graph["fastload.hf.front"]


def test_no_module_of_the_package_reaches_itself_through_its_imports() -> None:
    assert cycles(import_graph()) == []


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_each_layer_imports_only_the_layers_below_it() -> None:
    graph = import_graph()
    offending = {
        m: sorted(
            d for d in deps if _package(d) not in (_package(m), EXTENSION, *MAY_IMPORT[_package(m)])
        )
        for m, deps in graph.items()
        if _package(m) in MAY_IMPORT
    }
    assert {m: d for m, d in offending.items() if d} == {}
    assert sum(1 for m in graph if m.startswith("fastload.core.")) > 30


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` folded into its packages: package -> the other packages its modules import."""
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        others = {_package(d) for d in deps} - {_package(module)}
        out.setdefault(_package(module), set()).update(others)
    return out


def test_the_package_graph_folds_modules_into_their_packages_and_finds_a_loop() -> None:
    graph = {
        "fastload.core.loading": {"fastload.distributed.collective", "fastload.core.basics.errors"},
        "fastload.distributed.collective": {"fastload.core.basics.errors"},
        "fastload.core.basics.errors": set(),
    }
    folded = package_graph(graph)
    assert folded == {
        "fastload.core": {"fastload.distributed"},
        "fastload.distributed": {"fastload.core"},
    }
    # no circle of files, but a loop of packages
    assert cycles(graph) == [] and cycles(folded) == [["fastload.core", "fastload.distributed"]]


def test_no_package_reaches_itself_through_its_imports() -> None:
    assert cycles(package_graph(import_graph())) == []


def test_no_file_reaches_itself_even_through_imports_for_type_checkers() -> None:
    assert cycles(import_graph(type_only=True)) == []


def test_the_core_imports_no_other_package_and_loads_without_them() -> None:
    graph = import_graph()
    above = {
        m: sorted(d for d in deps if _package(d) not in ("fastload.core", EXTENSION))
        for m, deps in graph.items()
        if _package(m) == "fastload.core"
    }
    assert {m: d for m, d in above.items() if d} == {}
    from fresh import run_script

    # measured from outside: a fresh interpreter that imports the whole core holds none of them
    out = run_script(
        """
        import pkgutil, sys
        import fastload.core
        for info in pkgutil.walk_packages(fastload.core.__path__, "fastload.core."):
            __import__(info.name)
        assert "fastload.core.plan.planning" in sys.modules  # the rooms' modules too
        names = ("distributed", "training", "hf", "api", "integrations", "safetensors", "families",
                 "diffusion", "reloading")
        above = {f"fastload.{n}" for n in names}
        print(sorted(m for m in sys.modules if ".".join(m.split(".")[:2]) in above))
        """
    )
    assert out.strip() == "[]"


#: what the core's source may not name, comments and docstrings included: the frameworks and
#: model families it serves through the hooks of the layer above, and that layer itself
CALLER_NAMES = re.compile(
    r"(?i:transformers|diffusers|vllm|sglang|pretrained_?model|hugging ?face|\bhf_|_hf_)|"
    r"(?i:fastload\.(hf|diffusion|api|integrations|families)\b)|"
    # model families: their class names, and their lowercase names as words
    r"\b(Bert|Llama|Mistral|Mixtral|Qwen|Gemma|GPT|CLIP|Reformer|Sam3|DeepSeek|T5)|"
    r"\b(bert|llama|mistral|mixtral|qwen|gemma|gpt2|deepseek)\b"
)
#: the one exception: the hub client's switch for every progress bar, which fastload's bars
#: honour in every load, including those that never reach the Hugging Face layer
ALLOWED_IN_CORE = ("HF_HUB_DISABLE_PROGRESS_BARS",)


def caller_names(text: str) -> list[str]:
    for allowed in ALLOWED_IN_CORE:
        text = text.replace(allowed, "")
    return [m.group(0) for m in CALLER_NAMES.finditer(text)]


def test_the_name_check_finds_a_family_predicate_and_a_callers_name() -> None:
    predicate = (
        "def is_transformers_model(obj):\n"
        "    return isinstance(obj, sys.modules['transformers'].PreTrainedModel)\n"
    )
    assert caller_names(predicate) == ["transformers", "transformers", "PreTrainedModel"]
    assert caller_names("if 'vllm' in sys.modules: ...  # SGLang too") == ["vllm", "SGLang"]
    assert caller_names("from fastload.hf.hooks import x; p._is_hf_initialized") == [
        "fastload.hf",
        "_hf_",
    ]
    assert caller_names("a LlamaForCausalLM, a BertModel, a llama") == ["Llama", "Bert", "llama"]
    assert caller_names("clipped slices, the hub's HF_HUB_DISABLE_PROGRESS_BARS") == []
    assert caller_names("a diffusers UNet; from fastload.diffusion import x") == [
        "diffusers",
        "fastload.diffusion",
    ]


def test_the_core_names_none_of_its_callers() -> None:
    found = {
        str(path.relative_to(PACKAGE)): caller_names(path.read_text(encoding="utf-8"))
        for path in (PACKAGE / "core").rglob("*.py")
    }
    assert {p: names for p, names in found.items() if names} == {}


#: the load's spine: each of its functions reads at a glance
SPINE = ("api.py", "core/loading.py")
#: the most lines a function of the spine may have, its docstring not counted (``from_pretrained``
#: documents every option in its own docstring, which ``help()`` and the API pages show)
MAX_SPINE_FUNCTION_LINES = 80


def function_lengths(source: str) -> dict[str, int]:
    """Lines of each function (nested ones on their own) from ``def`` to its end, less its
    docstring."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                assert first.end_lineno is not None
                lines -= first.end_lineno - first.lineno + 1
            out[f"{node.name}:{node.lineno}"] = lines
    return out


def test_function_lengths_count_code_not_docstrings() -> None:
    source = 'def f():\n    """Doc,\n    two lines."""\n    a = 1\n    return a\n'
    assert function_lengths(source) == {"f:1": 3}


def test_no_function_of_the_loads_spine_is_longer_than_the_limit() -> None:
    lengths = {
        f"{module}:{name}": n
        for module in SPINE
        for name, n in function_lengths((PACKAGE / module).read_text(encoding="utf-8")).items()
    }
    assert any(name.startswith("core/loading.py:load:") for name in lengths)
    assert {f: n for f, n in lengths.items() if n > MAX_SPINE_FUNCTION_LINES} == {}


def test_the_core_imports_nothing_from_the_hugging_face_layer() -> None:
    graph = import_graph()
    core = [m for m in graph if _package(m) in ("fastload.core", "fastload.distributed")]
    assert not {m: d for m in core for d in graph[m] if d.startswith("fastload.hf")}


def test_nothing_below_the_tools_imports_them() -> None:
    graph = import_graph()
    users = {
        m: sorted(d for d in deps if d.startswith("fastload.tools"))
        for m, deps in graph.items()
        if not m.startswith("fastload.tools")
    }
    assert {m: d for m, d in users.items() if d} == {}


def test_the_tools_import_only_public_names() -> None:
    """No private module (``fastload._core``) and no underscore name of another module."""
    found = []
    for path in (PACKAGE / "tools").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fastload"):
                names = [a.name for a in node.names]
                private = [n for n in names if n.startswith("_") and n != "__version__"]
                if private and not (node.module or "").startswith("fastload.tools"):
                    found.append(f"{path.name}: {node.module} {private}")
    assert found == []


def test_no_module_is_longer_than_the_limit() -> None:
    lengths = {
        str(path.relative_to(PACKAGE)): len(path.read_text(encoding="utf-8").splitlines())
        for path in PACKAGE.rglob("*.py")
    }
    assert {p: n for p, n in lengths.items() if n > MAX_LINES} == {}


def test_the_plans_modes_and_actions_are_enums_not_strings() -> None:
    from enum import Enum

    from fastload.core.plan.actions import Action, Mode
    from fastload.core.plan.load_plan import Group, Source

    assert issubclass(Mode, Enum) and issubclass(Action, Enum)
    fields = {**Source.__dataclass_fields__, **Group.__dataclass_fields__}
    assert (fields["mode"].type, fields["action"].type) == ("Mode", "Action")
    # and nobody compares them with a bare string
    compared = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                attrs = [s.attr for s in sides if isinstance(s, ast.Attribute)]
                strings = [
                    s for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)
                ]
                if strings and {"mode", "action"} & set(attrs):
                    compared.append(f"{path.name}:{node.lineno}")
    assert compared == []


def test_only_the_integrations_import_the_integrations_and_import_fastload_imports_no_server() -> (
    None
):
    graph = import_graph()
    reaching = {
        m: sorted(d for d in deps if d.startswith("fastload.integrations"))
        for m, deps in graph.items()
        if not m.startswith("fastload.integrations")
    }
    assert {m: d for m, d in reaching.items() if d} == {}
    from fresh import run_script

    # the entry point's module too: vLLM imports it, and it imports vLLM only when vLLM calls it
    out = run_script(
        """
        import sys
        import fastload
        import fastload.integrations.vllm
        fastload.load_file, fastload.from_pretrained
        print(sorted({m.split(".")[0] for m in sys.modules} & {"vllm", "sglang"}))
        """
    )
    assert out.strip() == "[]"


def _room(module: str) -> str:
    """The room of the core ``module`` lives in (``"spine"`` for the modules on top)."""
    return "spine" if module in SPINE_MODULES else module.split(".")[2]


def test_every_module_of_the_core_lives_in_a_room_or_the_spine() -> None:
    core = [m for m in import_graph() if _package(m) == "fastload.core"]
    homeless = [
        m
        for m in core
        if m not in SPINE_MODULES and (len(m.split(".")) < 3 or m.split(".")[2] not in CORE_ROOMS)
    ]
    assert homeless == []
    assert {_room(m) for m in core} == {*CORE_ROOMS, "spine"}


def test_each_room_of_the_core_imports_only_the_rooms_below_it() -> None:
    order = {room: i for i, room in enumerate((*CORE_ROOMS, "spine"))}
    graph = import_graph()
    upward = {
        m: sorted(
            d for d in deps if _package(d) == "fastload.core" and order[_room(d)] > order[_room(m)]
        )
        for m, deps in graph.items()
        if _package(m) == "fastload.core"
    }
    assert {m: d for m, d in upward.items() if d} == {}


def test_the_room_order_check_finds_a_room_importing_one_above_it() -> None:
    order = {room: i for i, room in enumerate((*CORE_ROOMS, "spine"))}
    assert order[_room("fastload.core.memory.budget")] < order[_room("fastload.core.plan.actions")]
    assert _room("fastload.core.loading") == "spine"


def test_each_room_says_what_it_owns_and_what_it_must_not_know() -> None:
    import ast as _ast

    for room in CORE_ROOMS:
        doc = _ast.get_docstring(_ast.parse((PACKAGE / "core" / room / "__init__.py").read_text()))
        assert doc and "Owns:" in doc and "Must not know:" in doc, room
