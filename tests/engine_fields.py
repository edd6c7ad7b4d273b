"""The configuration keys each serving engine accepts, read from the engine's own source (pipeline/engines/fields.json).

`python -m tests.engine_fields <engine> <source> <version>` rewrites one engine's entry from its source at that
version: vLLM's `SpeculativeConfig` fields (pydantic, extra keys forbidden) and the values of its Literal-typed
fields, from vllm/config/speculative.py of the wheel; SGLang's server flags (one per `Arg`-annotated field of
sglang/srt/arg_groups/fields/*.py, plus server_args.py's own add_argument calls), from the wheel's sglang/srt
folder; llama-server's flags (common/arg.cpp options offered to the server and not removed) and `--spec-type`'s
names (common/speculative.cpp), from the llama.cpp tree llama-cpp-python's sdist vendors. The wheels are too big
to fetch in the suite (vLLM 239 MB); the llama.cpp tree is the one the llama.cpp tests build, so a test reads it
again there. TensorRT-LLM publishes no wheel on PyPI and its repository is too big to fetch here: its entry was
written by hand from tensorrt_llm/llmapi/llm_args.py at the commit it names.
"""
from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

FIELDS_JSON = Path(__file__).resolve().parents[1] / "pipeline" / "engines" / "fields.json"


def _literal_strings(node, aliases: dict) -> list[str]:
    """Every string a Literal annotation admits, following module-level aliases (X = Literal[...])."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name):
        return _literal_strings(aliases[node.id], aliases) if node.id in aliases else []
    return [s for child in ast.iter_child_nodes(node) for s in _literal_strings(child, aliases)]


def pydantic_fields(source: str, class_name: str) -> dict:
    """{fields, values}: a config class's field names and, for Literal-typed ones, the strings they admit."""
    tree = ast.parse(source)
    aliases = {n.targets[0].id: n.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(
        n.targets[0], ast.Name) and isinstance(n.value, ast.Subscript) and ast.unparse(n.value).startswith("Literal")}
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    fields, values = [], {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and not node.target.id.startswith("_"):
            fields.append(node.target.id)
            admitted = _literal_strings(node.annotation, aliases)
            if admitted:
                values[node.target.id] = sorted(set(admitted))
    return {"fields": sorted(fields), "values": values}


def _keyword(call: ast.Call, name: str):
    return next((ast.literal_eval(k.value) for k in call.keywords if k.arg == name), None)


def struct_flags(source: str) -> list[str]:
    """The CLI flags of SGLang's msgspec structs: `--name-with-dashes` (or Arg's cli_name) and its aliases, for
    each field annotated A[type, help | Arg(...)] unless Arg(no_cli=True)."""
    flags = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(node.annotation, ast.Subscript) and not node.target.id.startswith("_")):
            continue
        parts = node.annotation.slice.elts if isinstance(node.annotation.slice, ast.Tuple) else []
        arg = next((p for p in parts[1:] if isinstance(p, ast.Call) and getattr(p.func, "id", "") == "Arg"), None)
        if len(parts) < 2 or (arg is not None and _keyword(arg, "no_cli")):
            continue
        name = (arg is not None and _keyword(arg, "cli_name")) or "--" + node.target.id.replace("_", "-")
        flags += [name, *((arg is not None and _keyword(arg, "aliases")) or [])]
    return flags


def argparse_flags(source: str) -> list[str]:
    """The option strings of every add_argument call."""
    return [a.value for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "add_argument"
            for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")]


def llama_server_flags(arg_cpp: str) -> list[str]:
    """llama.cpp's options (common/arg.cpp `add_opt(common_arg({...}, ...))`) that the server takes, as its parser
    picks them: examples (set_examples, a literal list or a named one; default LLAMA_EXAMPLE_COMMON) naming the
    server or COMMON, and no set_excludes naming the server; an option whose handler calls arg_removed is gone."""
    named = dict(re.findall(r"llama_example> (\w+) = \{([^}]*)\}", arg_cpp))
    flags = []
    for block in arg_cpp.split("add_opt(common_arg(")[1:]:
        examples = re.search(r"set_examples\(\{?([^)}]*)", block)
        examples = named.get(examples.group(1).strip(), examples.group(1)) if examples else "LLAMA_EXAMPLE_COMMON"
        excludes = re.search(r"set_excludes\(\{([^}]*)\}", block)
        if "arg_removed(" in block or not re.search(r"\bLLAMA_EXAMPLE_(SERVER|COMMON)\b", examples) or (
                excludes and re.search(r"\bLLAMA_EXAMPLE_SERVER\b", excludes.group(1))):
            continue
        lists = re.match(r"\s*\{([^}]*)\}(?:,\s*\{([^}]*)\})?", block)
        flags += re.findall(r'"(-[^"]+)"', lists.group(1) + (lists.group(2) or "")) if lists else []
    return flags


def extract(engine: str, source: Path) -> dict:
    """One engine's entry from its source tree (see the module docstring for which tree)."""
    if engine == "vllm":
        return pydantic_fields((source / "vllm/config/speculative.py").read_text(), "SpeculativeConfig")
    if engine == "sglang":
        flags = [f for path in sorted((source / "sglang/srt/arg_groups/fields").glob("*.py"))
                 for f in struct_flags(path.read_text())] + argparse_flags((source / "sglang/srt/server_args.py").read_text())
        return {"fields": sorted(set(flags)), "values": {}}
    if engine == "llamacpp":
        types = re.search(r"common_speculative_type_from_name_map = \{(.*?)\};",
                          (source / "common/speculative.cpp").read_text(), re.S).group(1)
        return {"fields": sorted(set(llama_server_flags((source / "common/arg.cpp").read_text()))),
                "values": {"--spec-type": sorted(re.findall(r'\{"([\w-]+)",', types))}}
    raise SystemExit(f"no extractor for {engine}: vllm, sglang or llamacpp")


SOURCES = {"vllm": "vllm/config/speculative.py (SpeculativeConfig)",
           "sglang": "sglang/srt/arg_groups/fields/*.py, sglang/srt/server_args.py",
           "llamacpp": "common/arg.cpp, common/speculative.cpp of the llama.cpp tree the sdist vendors"}


def write(entries: dict) -> None:
    """fields.json with one line per engine (the lists are long)."""
    body = ",\n".join(f" {json.dumps(name)}: {json.dumps(entry)}" for name, entry in sorted(entries.items()))
    FIELDS_JSON.write_text("{\n" + body + "\n}\n")


if __name__ == "__main__":
    engine, source, version = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    entries = json.loads(FIELDS_JSON.read_text()) if FIELDS_JSON.is_file() else {}
    entries[engine] = {"version": version, "source": SOURCES[engine], **extract(engine, source)}
    write(entries)
