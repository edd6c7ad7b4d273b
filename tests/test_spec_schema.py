"""The dataclass is the one schema of speculative.json and evidence.json: docs/architecture.md's table names
exactly SpeculativeSpec's fields, each in the file its metadata says."""
import re
from dataclasses import fields

from pipeline.decoding.spec import SpeculativeSpec
from tests.conftest import REPO

WHERE = {"recipe": "recipes", "speculative.json": "speculative.json", "evidence.json": "evidence.json"}


def documented(text: str) -> dict[str, str]:
    """{key: file} from the rows of the table under `| key | file | meaning |`."""
    lines = text.split("\n")
    start = lines.index("| key | file | meaning |") + 2
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        keys, where = line.split(" | ")[:2]
        rows |= {key: where.strip() for key in re.findall(r"`([a-z_]+)`", keys)}
    return rows


def schema() -> dict[str, str]:
    return {f.name: WHERE[f.metadata["file"]] for f in fields(SpeculativeSpec)}


def test_the_architecture_doc_names_exactly_the_spec_fields_and_their_files():
    assert documented((REPO / "docs" / "architecture.md").read_text()) == schema()


def test_the_schema_check_rejects_a_doc_missing_a_field_or_misplacing_one():
    text = (REPO / "docs" / "architecture.md").read_text()
    assert documented(text.replace("| `heldout` |", "| `held_out` |")) != schema()
    assert documented(text.replace("| `cost` | evidence.json |", "| `cost` | speculative.json |")) != schema()
