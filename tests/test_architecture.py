"""The house rules a new reader relies on: stages meet on disk and share only the core (pipeline/), no folder
has an import circle, the speedup model lives once in the core (pipeline/decoding/cost.py), the committed
params.yaml is the default composition DVC runs from, each dvc.yaml stage depends on exactly the code it runs,
every model preset has the same keys, every timed comparison goes through eval/harness.py, no public function outside
the decoder's generate-style API takes more than 7 parameters, and no test can only pass."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import REPO

STAGES = ("data", "distill", "eval")


def imported_packages(path: Path) -> set[str]:
    """Top-level package of every import in a file, lazy imports inside functions included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_imports_no_other_stage(stage):
    offenders = {str(path.relative_to(REPO)): sorted(imported_packages(path) & (set(STAGES) - {stage}))
                 for path in (REPO / stage).rglob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def is_entry_point(path: Path) -> bool:
    """The two commands may run stage code: `python -m pipeline` and the workbench `python -m pipeline.tools`."""
    relative = path.relative_to(REPO).as_posix()
    return relative == "pipeline/__main__.py" or relative.startswith("pipeline/tools/")


def test_the_core_imports_no_stage():
    offenders = {str(path.relative_to(REPO)): sorted(imported_packages(path) & set(STAGES))
                 for path in (REPO / "pipeline").rglob("*.py") if not is_entry_point(path)}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_only_the_two_commands_are_exempt_from_the_core_rule():
    assert is_entry_point(REPO / "pipeline/__main__.py") and is_entry_point(REPO / "pipeline/tools/learning_curve.py")
    for core in ("pipeline/decoding/__main__.py", "pipeline/decoding/spec.py", "pipeline/toolsy.py", "pipeline/engines/tools/x.py"):
        assert not is_entry_point(REPO / core), core


def test_the_boundary_check_sees_a_cross_stage_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from eval.stage import run\n")
    assert "eval" in imported_packages(bad)


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, folders=("pipeline", "data", "distill", "eval")) -> dict[str, set[str]]:
    """module -> the project modules it imports (lazy imports included; `from a import b` counts b when b is
    a module)."""
    files = {module_name(path, root): path for folder in folders for path in (root / folder).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in files)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in files:
                subs = {f"{node.module}.{alias.name}" for alias in node.names} & set(files)
                edges.update(subs or {node.module})
        graph[name] = edges - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles among modules of one folder (depth-first search; a package's __init__ re-exporting its own
    modules is not a cycle: the package imports them, they never import it back)."""
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if nxt.split(".")[0] != node.split(".")[0]:
                continue
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every project module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def stage_crossings(graph: dict[str, set[str]], stage_modules: dict[str, str]) -> dict[str, list[str]]:
    """Per stage, the other stages' modules its code reaches: stages meet on disk, never through code."""
    return {name: sorted(set(stage_modules.values()) - {module} & reachable(graph, module))
            for name, module in stage_modules.items()}


def test_no_stage_module_imports_another_stage():
    from pipeline.__main__ import STAGES as STAGE_MODULES

    crossings = stage_crossings(import_graph(REPO), {name: run for name, (run, _) in STAGE_MODULES.items()})
    assert not {k: v for k, v in crossings.items() if v}, crossings


def test_the_stage_crossing_check_sees_one_stage_reaching_another(tmp_path):
    (tmp_path / "distill").mkdir()
    (tmp_path / "distill" / "stage.py").write_text("def read():\n    pass\n")
    (tmp_path / "distill" / "shared.py").write_text("from distill.stage import read\n")
    (tmp_path / "distill" / "calibrate_stage.py").write_text("import distill.shared\n")
    graph = import_graph(tmp_path, folders=("distill",))
    crossings = stage_crossings(graph, {"distill": "distill.stage", "calibrate": "distill.calibrate_stage"})
    assert crossings == {"distill": [], "calibrate": ["distill.stage"]}


def test_no_folder_has_an_import_circle():
    assert import_cycles(import_graph(REPO)) == []


def test_the_circle_check_sees_a_circle(tmp_path):
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval/a.py").write_text("from eval.b import x\n")
    (tmp_path / "eval/b.py").write_text("def f():\n    from eval.a import y\n")
    assert import_cycles(import_graph(tmp_path, ("eval",))) == [["eval.a", "eval.b", "eval.a"]]


CORE_LAYERS = (  # the core's packages, each importing only from its own layer and those before it
    ("pipeline.errors", "pipeline.atomic", "pipeline.machine", "pipeline.timing", "pipeline.sampling", "pipeline.heads",
     "pipeline.settings"),
    ("pipeline.decoding",),  # the decoder library: importable with nothing of a stage, a model loader or a profiler
    ("pipeline.engines",),  # each serving engine's rules and launch, in the decoder's terms
    ("pipeline.modelio",),
    ("pipeline.measure",),
    ("pipeline.control",),
)


def core_layer(module: str) -> int | None:
    return next((i for i, layer in enumerate(CORE_LAYERS) for top in layer
                 if module == top or module.startswith(top + ".")), None)


def layer_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a core package reaches up to a later layer or out of the core."""
    found = []
    for module, edges in graph.items():
        layer = core_layer(module)
        if layer is None:
            continue
        found += [(module, dep) for dep in sorted(edges) if core_layer(dep) is None or core_layer(dep) > layer]
    return found


def test_the_core_packages_import_only_their_own_layer_and_those_below():
    graph = import_graph(REPO)
    assert layer_violations(graph) == []
    loose = sorted(m for m in graph if m.count(".") == 1 and m.startswith("pipeline.") and core_layer(m) is None)
    assert loose == ["pipeline.__main__", "pipeline.tools"]  # the two commands; the rest sits in CORE_LAYERS


def test_the_layer_check_sees_the_decoder_reaching_for_a_model_loader(tmp_path):
    for folder in ("pipeline/decoding", "pipeline/modelio"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "pipeline/decoding/loop.py").write_text("from pipeline.modelio.models import load_model\n")
    (tmp_path / "pipeline/modelio/models.py").write_text("from pipeline.decoding.loop import x\n")
    graph = import_graph(tmp_path, ("pipeline",))
    assert layer_violations(graph) == [("pipeline.decoding.loop", "pipeline.modelio.models")]


def imported_closure(graph: dict[str, set[str]], starts) -> set[str]:
    """The modules importing `starts` runs: each one's imports, transitively, and the packages above each (Python
    runs a package's __init__ before any module in it)."""
    seen, todo = set(), list(starts)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in graph]
        todo += graph.get(name, ())
    return seen


def stage_code(root: Path, stages: dict) -> dict[str, set[str]]:
    """stage -> the project files `python -m pipeline stage=<stage>` imports: pipeline/__main__.py and the stage's
    run and settings modules (pipeline/__main__.py's STAGES), with all they import."""
    graph = import_graph(root)
    files = {module_name(path, root): path for folder in ("pipeline", "data", "distill", "eval")
             for path in (root / folder).rglob("*.py")}
    closures = {stage: imported_closure(graph, ["pipeline.__main__", *modules]) for stage, modules in stages.items()}
    return {stage: {files[m].relative_to(root).as_posix() for m in modules} for stage, modules in closures.items()}


def dvc_deps_mismatch(dvc_yaml: Path, root: Path, stages: dict) -> dict[str, dict[str, list[str]]]:
    """Per dvc.yaml stage, the imported files its deps miss and the Python files they list that it does not import
    (a folder dep counts as every .py file under it), plus deps that name nothing (outside artifacts/)."""
    import yaml

    declared = yaml.safe_load(dvc_yaml.read_text())["stages"]
    code = stage_code(root, stages)
    report = {}
    for stage in sorted(set(declared) | set(stages)):
        deps = [next(iter(d)) if isinstance(d, dict) else d for d in declared.get(stage, {}).get("deps", [])]
        listed = set()
        for dep in deps:
            path = root / dep
            listed |= {p.relative_to(root).as_posix() for p in path.rglob("*.py")} if path.is_dir() else {dep}
        problems = {"missing": sorted(code.get(stage, set()) - listed),
                    "not imported": sorted(d for d in listed if d.endswith(".py") and d not in code.get(stage, set())),
                    "absent": sorted(d for d in deps if not d.startswith("artifacts/") and not (root / d).exists())}
        if any(problems.values()):
            report[stage] = {k: v for k, v in problems.items() if v}
    return report


def test_each_dvc_stage_depends_on_exactly_the_code_it_imports():
    from pipeline.__main__ import STAGES

    assert dvc_deps_mismatch(REPO / "dvc.yaml", REPO, STAGES) == {}


def test_the_dvc_deps_check_sees_a_missing_an_extra_and_a_stale_dep(tmp_path):
    import yaml
    from pipeline.__main__ import STAGES

    dvc = yaml.safe_load((REPO / "dvc.yaml").read_text())
    dvc["stages"]["collect"]["deps"].remove("data/collect_rows.py")
    dvc["stages"]["eval"]["deps"].append("pipeline")  # the whole core: its tools command is no stage's code
    dvc["stages"]["prepare"]["deps"].append("data/gone.py")
    planted = tmp_path / "dvc.yaml"
    planted.write_text(yaml.safe_dump(dvc))
    report = dvc_deps_mismatch(planted, REPO, STAGES)
    assert report["collect"] == {"missing": ["data/collect_rows.py"]}
    assert "pipeline/tools/learning_curve.py" in report["eval"]["not imported"] and "missing" not in report["eval"]
    assert report["prepare"] == {"not imported": ["data/gone.py"], "absent": ["data/gone.py"]}
    assert set(report) == {"collect", "eval", "prepare"}


def test_a_stage_without_a_dvc_stage_is_reported(tmp_path):
    from pipeline.__main__ import STAGES

    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    assert set(dvc_deps_mismatch(tmp_path / "dvc.yaml", REPO, STAGES)) == set(STAGES)


# Calls that check nothing: a test making only these (and no assert) can only pass.
CHECKS_NOTHING = {"print", "items", "keys", "values", "range", "enumerate", "zip", "sorted", "len", "str", "format"}


def unfailable_tests(path: Path) -> list[str]:
    """Tests in a file that can only pass: no assert and no call but printing and looping (a helper or the code
    under test may raise, pytest.raises/fail are calls), or an assert of a constant."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test")):
            continue
        asserts = [n for n in ast.walk(node) if isinstance(n, ast.Assert)]
        calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)
                 and getattr(n.func, "id", getattr(n.func, "attr", None)) not in CHECKS_NOTHING]
        if (not asserts and not calls) or any(isinstance(a.test, ast.Constant) for a in asserts):
            found.append(node.name)
    return found


def test_no_test_can_only_pass():
    offenders = {str(path.relative_to(REPO)): unfailable_tests(path) for path in (REPO / "tests").glob("test_*.py")}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_the_cannot_fail_check_sees_a_print_only_test_and_a_constant_assert(tmp_path):
    planted = tmp_path / "test_planted.py"
    planted.write_text("def test_summary():\n    for name, r in RESULTS.items():\n        print(name, r)\n\n\n"
                       "def test_true():\n    x = 1\n    assert True\n\n\n"
                       "def test_real():\n    assert 1 + 1 == 2\n")
    assert unfailable_tests(planted) == ["test_summary", "test_true"]


def _names(node) -> set[str]:
    """Every name, attribute and string subscript key inside an expression."""
    out = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            out.add(sub.attr)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            out.add(sub.value)
    return out


def speedup_formulas(path: Path) -> list[int]:
    """Lines computing the shape of the speedup model, x / (D·c + r): a division whose denominator adds a
    product with the cost ratio c."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            denominator = node.right
            if isinstance(denominator, ast.BinOp) and isinstance(denominator.op, ast.Add):
                products = [side for side in (denominator.left, denominator.right)
                            if isinstance(side, ast.BinOp) and isinstance(side.op, ast.Mult)]
                if any("c" in _names(product) for product in products):
                    lines.append(node.lineno)
    return lines


def test_the_speedup_model_is_written_once_in_the_core():
    core = REPO / "pipeline/decoding/cost.py"
    offenders = {str(path.relative_to(REPO)): speedup_formulas(path) for folder in ("pipeline", *STAGES)
                 for path in (REPO / folder).rglob("*.py") if path != core}
    assert not {k: v for k, v in offenders.items() if v}, offenders
    assert speedup_formulas(core), "the check no longer sees the formula where it lives"


def test_the_formula_check_sees_a_copy(tmp_path):
    copy = tmp_path / "copy.py"
    copy.write_text("def f(a, cost, d, r):\n    return (1 + a) / (d * cost['c'] + r)\n")
    assert speedup_formulas(copy) == [2]


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_committed_params_yaml_is_the_default_composition():
    from pipeline.control.params import params_of

    committed = OmegaConf.to_container(OmegaConf.load(REPO / "params.yaml"))
    assert committed == params_of(_compose()), "conf/ changed: rerun `python -m pipeline stage=params`"


def test_a_params_file_of_another_version_is_refused(tmp_path):
    from pipeline.errors import PipelineError
    from pipeline.control.params import from_params_file

    stale = OmegaConf.load(REPO / "params.yaml")
    stale.distill.objective.no_such_knob = 1
    path = tmp_path / "params.yaml"
    OmegaConf.save(stale, path)
    cfg = _compose("stage=distill", f"params_file={path}")
    with pytest.raises(PipelineError, match="no_such_knob"):
        from_params_file(cfg, ["stage=distill", f"params_file={path}"])
    with pytest.raises(PipelineError, match="whole config"):
        from_params_file(cfg, ["stage=distill", f"params_file={path}", "seed=1"])


def test_every_model_preset_has_the_same_keys():
    def keys(tree, prefix=""):
        out = set()
        for key, value in tree.items():
            out |= keys(value, f"{prefix}{key}.") if isinstance(value, dict) and key != "package" else {prefix + key}
        return out

    presets = [p.stem for p in (REPO / "conf/model").glob("*.yaml") if not p.stem.startswith("_")]
    shapes = {p: keys(OmegaConf.to_container(_compose(f"model={p}").model)) for p in presets}
    reference = shapes.pop("smollm2-135m")
    assert all(shape == reference for shape in shapes.values()), {p: s ^ reference for p, s in shapes.items()}


# ---------------------------------------------------------------- one timing harness

CLOCKS = {"perf_counter", "perf_counter_ns", "monotonic", "process_time", "time", "clock", "now"}
HARNESS = "eval/harness.py"
# Loops that time work but compare no decoders: each module and what its clock readings price.
PRICES = {
    "pipeline/measure/batch_profile.py": "forward and host costs per batch size, the inputs of the batch calibration",
    "pipeline/modelio/dtype.py": "one forward per dtype, runtime.dtype=auto's choice",
    "data/collect.py": "each label source's CPU and wall seconds (manifest label_cost)",
    "distill/training.py": "the learning-rate probe's seconds, counted as training time",
}


def _reads_clock(node) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Attribute):
        return f.attr in CLOCKS and isinstance(f.value, ast.Name) and f.value.id == "time"
    return isinstance(f, ast.Name) and f.id in CLOCKS


def timing_loops(path: Path) -> list[str]:
    """Where a file times work in a loop (a loop reading a clock twice or more: start and stop around its body) or
    takes the harness's per-request pieces (`timed`, `rotated`, `time_round`) to build a loop of its own."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.For, ast.While, ast.AsyncFor)):
            if sum(_reads_clock(n) for n in ast.walk(node)) >= 2:
                found.append(f"loop at line {node.lineno}")
        elif isinstance(node, ast.ImportFrom) and node.module == "eval.harness":
            found += [f"imports {a.name}" for a in node.names if a.name in ("timed", "rotated", "time_round")]
    return found


def test_every_timed_comparison_goes_through_the_one_harness():
    offenders = {}
    for folder in ("pipeline", "data", "distill", "eval"):
        for path in (REPO / folder).rglob("*.py"):
            relative = path.relative_to(REPO).as_posix()
            if relative != HARNESS and relative not in PRICES and timing_loops(path):
                offenders[relative] = timing_loops(path)
    assert not offenders, f"time through eval/harness.py's time_requests: {offenders}"
    assert all((REPO / path).is_file() and timing_loops(REPO / path) for path in PRICES), "a stale exemption"


def test_the_harness_check_sees_a_planted_second_timing_loop(tmp_path):
    sweeps = (REPO / "eval/sweeps.py").read_text()
    assert not timing_loops(REPO / "eval/sweeps.py")
    planted = tmp_path / "sweeps.py"
    planted.write_text(sweeps + "\n\ndef again(methods, requests, clock):\n    out = []\n"
                       "    for request in requests:\n        for name, fn in methods.items():\n"
                       "            start = clock()\n            fn(request)\n            out.append(clock() - start)\n"
                       "    return out\n")
    end = len(sweeps.splitlines())
    assert timing_loops(planted) == [f"loop at line {end + 5}", f"loop at line {end + 6}"]
    borrowed = tmp_path / "borrowed.py"
    borrowed.write_text("from eval.harness import rotated, timed\n")
    assert timing_loops(borrowed) == ["imports rotated", "imports timed"]


# ---------------------------------------------------------------- each default once, in its settings dataclass

# A parameter named like a setting (a name only one setting has) whose literal default means something else there.
OTHER_MEANING = {
    ("distill/losses.py", "beta"): "the loss functions' own API (TRL's generalized_jsd_loss has beta=0.5 too)",
    ("eval/fidelity.py", "keep"): "a dict of results kept, not distill.checkpoint.keep",
    ("eval/sweeps.py", "warmup"): "whether a sweep decodes one untimed request first, not calibrate.cost.warmup's count",
    ("pipeline/measure/cost_profile.py", "device"): "a loader's device; runtime.device's 'auto' is resolved before the call",
    ("pipeline/modelio/models.py", "device"): "a loader's device; runtime.device's 'auto' is resolved before the call",
    ("pipeline/modelio/dtype.py", "context"): "the cached tokens of the dtype probe's forward, not llama-server's -c",
    ("pipeline/engines/llamacpp.py", "timeout"): "eval's requests to its own server; collect.server.timeout is collect's",
    ("pipeline/measure/pass_overhead.py", "steps"): "a list of decode steps, not distill.trainer.lr_probe.steps",
}


def setting_names(cfg: dict) -> set[str]:
    """The leaf names only one setting of the composed config has (a model's `package` is one leaf)."""
    counts: dict[str, int] = {}

    def walk(tree):
        for key, value in tree.items():
            if isinstance(value, dict) and key != "package":
                walk(value)
            else:
                counts[key] = counts.get(key, 0) + 1
    walk(cfg)
    return {name for name, n in counts.items() if n == 1}


def restated_defaults(path: Path, names: set[str]) -> list[tuple[str, int]]:
    """(name, line) of each literal default a function parameter or dataclass field named like a setting carries."""
    def literal(node) -> bool:
        try:
            return ast.literal_eval(node) is not None
        except ValueError:
            return False

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        pairs = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            positional = node.args.posonlyargs + node.args.args
            pairs += zip([a.arg for a in positional[len(positional) - len(node.args.defaults):]], node.args.defaults)
            pairs += [(a.arg, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            pairs.append((node.target.id, node.value))
        found += [(name, default.lineno) for name, default in pairs if name in names and literal(default)]
    return found


def test_no_setting_has_a_second_default_in_code():
    from pipeline.control.params import compose_config

    names = setting_names(OmegaConf.to_container(compose_config([]), resolve=False))
    offenders = {}
    for folder in ("pipeline", *STAGES):
        for path in (REPO / folder).rglob("*.py"):
            relative = path.relative_to(REPO).as_posix()
            found = [(n, line) for n, line in restated_defaults(path, names) if (relative, n) not in OTHER_MEANING]
            if found:
                offenders[relative] = found
    assert not offenders, f"a setting's default restated outside its dataclass (pass the setting instead): {offenders}"
    assert all(any(n == name for n, _ in restated_defaults(REPO / path, names)) for path, name in OTHER_MEANING), \
        "a stale exemption"


def test_the_default_check_sees_a_restated_guard_window(tmp_path):
    planted = tmp_path / "guard.py"
    planted.write_text("from dataclasses import dataclass\n\n@dataclass\nclass G:\n    window: float = 16.0\n\n"
                       "def server(root, *, start_timeout=120.0, parallel=1):\n    pass\n")
    assert sorted(restated_defaults(planted, {"window", "start_timeout", "other"})) == [("start_timeout", 7), ("window", 5)]


# the generate-style decoder API (keyword arguments as HF generate takes them) and the functional loss (keyword-only,
# as torch.nn.functional's) may take more; no other public function does
WIDE_SIGNATURES_ALLOWED = {"pipeline/decoding", "distill/losses.py:distillation_loss"}


def wide_signatures(root: Path, allowed=WIDE_SIGNATURES_ALLOWED, most: int = 7) -> list[str]:
    """'path:function (n)' for each public function or method of the source folders taking more than `most`
    parameters (self and cls not counted), outside `allowed` (a folder, or path:function)."""
    found = []
    for folder in ("pipeline", "data", "distill", "eval"):
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if any(relative.startswith(a + "/") for a in allowed):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                    continue
                args = node.args
                names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
                n = len([a for a in names if a not in ("self", "cls")])
                if n > most and f"{relative}:{node.name}" not in allowed:
                    found.append(f"{relative}:{node.name} ({n})")
    return found


def test_no_public_function_takes_more_than_seven_parameters():
    assert wide_signatures(REPO) == []


def test_the_signature_check_sees_an_eighth_parameter(tmp_path):
    (tmp_path / "eval").mkdir(parents=True)
    (tmp_path / "eval" / "m.py").write_text("def wide(a, b, c, d, e, f, g, *, h=0):\n    pass\n\n"
                                            "def _private(a, b, c, d, e, f, g, h):\n    pass\n\n"
                                            "class A:\n    def method(self, a, b, c, d, e, f, g):\n        pass\n")
    assert wide_signatures(tmp_path) == ["eval/m.py:wide (8)"]
