"""collect.text: rows whose completions are given text (a serving log's answers, a user's documents, a packaged corpus)
labelled by the target in one forward pass over them: a prefill's cost per label instead of a generation's. The
formats, which rows a file makes and how they are split: docs/architecture.md ("Collected data", text rows).

A JSONL (or JSON array) file holds one conversation or text per row: {"messages": [{"role", "content"}, ...]}
(OpenAI chat, TRL conversational), {"conversations": [{"from", "value"}, ...]} (ShareGPT), {"prompt", "completion"}
(strings) or {"text"}; a row may name its own "domain". Each assistant turn of a conversation is one row, its
context rendered with the target's chat template exactly as a generated row's is. Any other file is plain text, cut
into rows of collect.text.chunk_tokens tokens. Everything is read and checked before any stage writes."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.control.prompts import TEXT_FILE
from pipeline.settings import refuse, setting

_FIX = "fix the override (the settings: data/collect_text.py)"
_FORMATS = '{"messages": [...]}, {"conversations": [...]}, {"prompt": ..., "completion": ...} or {"text": ...}'
_ROLES = {"system": "system", "developer": "system", "user": "user", "human": "user", "assistant": "assistant",
          "gpt": "assistant", "model": "assistant", "bot": "assistant"}  # ShareGPT's "from" names beside OpenAI's


@dataclass(frozen=True)
class TextSettings:
    """`collect.text.*`: rows of given text labelled by the target (collect.topk labels), origin "text"."""
    paths: tuple[str, ...] = setting([], "files or folders: .jsonl / .json chat logs ({messages}, ShareGPT "
                                     "{conversations}, {prompt, completion}, {text}; a row may name its domain), any "
                                     "other file plain text; [] = off. Needs backend=hf and topk > 0; never held out")
    prepared: bool = setting(True, "also label the prepare stage's text (${paths.prompts}/text.jsonl: the running "
                             "Python's stdlib source and language reference, data.text) with backend=hf and topk > 0: "
                             "in-domain text for code and qa at a prefill's cost (docs/results.md)")
    domain: str = setting("text", "the rows' domain where a row names none (a log of chat traffic: chat)")
    max_tokens: int | None = setting(None, "label at most this many completion tokens, in file order; null = all")
    chunk_tokens: int = setting(256, "tokens per row of plain text, and the most of one answer of a conversation")

    def __post_init__(self):
        refuse([(self.max_tokens is not None and self.max_tokens < 1,
                 f"collect.text.max_tokens={self.max_tokens!r} must be an integer ≥ 1 (null = all): {_FIX}"),
                (self.chunk_tokens < 1, f"collect.text.chunk_tokens={self.chunk_tokens!r} must be an integer ≥ 1: {_FIX}"),
                (not self.domain, f"collect.text.domain={self.domain!r} must be a domain name: {_FIX}")])


@dataclass(frozen=True)
class Document:
    """One conversation (messages) or one plain text, where it came from and its domain."""
    source: str                      # "<file relative to its path>:<line>", the rows' prompt id
    domain: str
    messages: tuple[dict, ...] = ()
    text: str = ""


# ----------------------------------------------------------------------------- reading and checking

def read_documents(settings: TextSettings, prompts_dir: str | Path | None = None,
                   domains: tuple[str, ...] = ()) -> list[Document]:
    """Every document under collect.text.paths in a fixed order, or one line naming the first bad file or row; then,
    with collect.text.prepared and `prompts_dir`, the prepare stage's text rows (of `domains`, where given)."""
    documents = _prepared(prompts_dir, domains) if settings.prepared and prompts_dir is not None else []
    for root in settings.paths:
        for path, name in _files(Path(root)):
            documents += _parse(path, f"{Path(root).name}/{name}" if name else Path(root).name, settings.domain)
    if settings.paths and not documents:
        raise PipelineError(f"collect.text.paths={list(settings.paths)} hold no text to label: point them at "
                            "non-empty files")
    return documents


def _prepared(prompts_dir: str | Path, domains: tuple[str, ...]) -> list[Document]:
    path = Path(prompts_dir) / TEXT_FILE
    if not path.is_file():  # prompts written by hand, or by a prepare stage older than data.text
        print(f"[collect] collect.text.prepared: no {path} (stage=prepare writes it): no prepared text labelled")
        return []
    return [d for d in _parse(path, "prepared", "text") if not domains or d.domain in domains]


def _files(root: Path) -> list[tuple[Path, str]]:
    """(file, name under root) in sorted order; hidden files and folders skipped."""
    if root.is_file():
        return [(root, "")]
    if not root.is_dir():
        raise PipelineError(f"collect.text.paths: {root} does not exist: {_FIX}")
    files = sorted(p for p in root.rglob("*") if p.is_file() and not any(part.startswith(".")
                                                                         for part in p.relative_to(root).parts))
    if not files:
        raise PipelineError(f"collect.text.paths: the folder {root} holds no files: point it at text or chat logs")
    return [(p, p.relative_to(root).as_posix()) for p in files]


def _parse(path: Path, name: str, domain: str) -> list[Document]:
    raw = path.read_bytes()
    try:
        if b"\x00" in raw:
            raise UnicodeDecodeError("utf-8", raw, 0, 1, "NUL byte")
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise PipelineError(f"collect.text: {path} is not UTF-8 text (a binary file?): remove it from "
                            "collect.text.paths or convert it") from None
    if path.suffix == ".jsonl":
        lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        return [_document(_json(line, f"{path}:{n}"), f"{name}:{n}", domain, f"{path}:{n}") for n, line in lines]
    if path.suffix == ".json":
        rows = _json(text, str(path))
        rows = rows if isinstance(rows, list) else [rows]
        return [_document(row, f"{name}:{n}", domain, f"{path}[{n - 1}]") for n, row in enumerate(rows, 1)]
    return [Document(f"{name}:1", domain, text=text)] if text.strip() else []


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PipelineError(f"collect.text: {where} is not valid JSON ({e.msg}): fix or remove the row") from None


def _document(row, source: str, domain: str, where: str) -> Document:
    """One JSON row as a Document, or one line saying what is wrong with it."""
    def bad(why: str) -> PipelineError:
        return PipelineError(f"collect.text: {where}: {why}; a row is {_FORMATS}")

    if not isinstance(row, dict):
        raise bad(f"a {type(row).__name__}, not an object")
    domain = row.get("domain", domain)
    if not isinstance(domain, str) or not domain:
        raise bad(f"domain {domain!r} is not a name")
    if "text" in row and not ({"messages", "conversations", "prompt"} & row.keys()):
        if not isinstance(row["text"], str):
            raise bad("text is not a string")
        return Document(source, domain, text=row["text"])
    if "messages" in row:
        turns = [(m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
                 for m in _list(row["messages"], "messages", bad)]
    elif "conversations" in row:
        turns = [(m.get("from"), m.get("value")) if isinstance(m, dict) else (None, None)
                 for m in _list(row["conversations"], "conversations", bad)]
    elif "prompt" in row and "completion" in row:
        turns = [("user", row["prompt"]), ("assistant", row["completion"])]
    else:
        raise bad(f"unknown keys {sorted(row)}")
    messages = tuple({"role": _role(role, bad), "content": _content(content, bad)} for role, content in turns)
    if not any(m["role"] == "assistant" and m["content"] for m in messages[1:]):
        raise bad("no assistant answer after a first message")
    return Document(source, domain, messages=messages)


def _list(value, key: str, bad) -> list:
    if not isinstance(value, list) or not value:
        raise bad(f"{key} is not a non-empty list")
    return value


def _role(role, bad) -> str:
    if role not in _ROLES:
        raise bad(f"role {role!r} is none of {sorted(_ROLES)}")
    return _ROLES[role]


def _content(content, bad) -> str:
    """A string, or OpenAI's list of parts whose text parts are joined."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise bad(f"content {content!r:.40} is not text")
    return content


# ----------------------------------------------------------------------------- rows

def text_rows(documents: list[Document], settings: TextSettings, tokenizer, stop_ids: list[int]) -> list[dict]:
    """The rows to label, in document order, until collect.text.max_tokens completion tokens: per assistant answer of
    a conversation (its context the chat template's, as a generated row's), per chunk of a plain text."""
    from pipeline.modelio.chat import encode_chat

    rows, total, stops = [], 0, set(stop_ids)
    for document in documents:
        if document.messages:
            answers = [i for i, m in enumerate(document.messages) if i and m["role"] == "assistant" and m["content"]]
            pieces = []
            for turn, i in enumerate(answers):
                context = encode_chat(tokenizer, list(document.messages[:i]))[0].tolist()
                pieces.append((turn, context, _answer_ids(tokenizer, document.messages[:i + 1], context, stops)))
        else:
            ids = tokenizer(document.text, add_special_tokens=False).input_ids
            step = settings.chunk_tokens + 1
            pieces = [(turn, chunk[:1], chunk[1:]) for turn, chunk in enumerate(ids[i:i + step]
                                                                              for i in range(0, len(ids), step))
                      if len(chunk) > 1]
        for turn, context, completion in pieces:
            completion = completion[:settings.chunk_tokens]
            if settings.max_tokens is not None and total + len(completion) > settings.max_tokens:
                return rows
            total += len(completion)
            ended = bool(document.messages) and completion[-1] in stops
            rows.append({"id": f"text/{document.source}/t{turn}/s0", "prompt_id": f"text/{document.source}",
                         "domain": document.domain, "turn": turn, "sample": 0, "prompt_ids": context,
                         "completion_ids": completion, "finish_reason": "eos" if ended else "length",
                         "origin": "text"})
    return rows


def _answer_ids(tokenizer, messages: tuple[dict, ...], context: list[int], stops: set[int]) -> list[int]:
    """The tokens the template puts after `context` for the last (assistant) message, through its end-of-turn id:
    what the target would have generated to say it. Without a template, or where the rendering of the whole does not
    start with the context's, the answer's own tokens and the first stop id."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False)
        full = tokenizer(text, add_special_tokens=False).input_ids
        tail = full[len(context):]
        end = next((j for j, t in enumerate(tail) if t in stops), None)
        if full[:len(context)] == context and end:
            return tail[:end + 1]
    return tokenizer(messages[-1]["content"], add_special_tokens=False).input_ids + sorted(stops)[:1]


def text_shards(rows: list[dict], shard_size: int) -> list[tuple[str, list[dict]]]:
    """(name, rows) per shard_size rows: a shard's name hashes its rows, so a rerun reuses exactly the shards whose
    rows are unchanged (more files, a larger max_tokens)."""
    shards = []
    for index, start in enumerate(range(0, len(rows), shard_size)):
        part = rows[start:start + shard_size]
        digest = hashlib.sha256(json.dumps([[r["id"], r["prompt_ids"], r["completion_ids"]] for r in part])
                                .encode()).hexdigest()[:8]
        shards.append((f"text-{index:05d}-{digest}", part))
    return shards
