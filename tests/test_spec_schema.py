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


def test_a_recipe_round_trips_and_files_of_each_format_read_into_the_same_recipes():
    from pipeline.decoding.draft_length import DraftLength
    from pipeline.decoding.spec import OFF, Recipe
    from pipeline.sampling import Sampling

    code = Recipe(True, DraftLength("confidence", 16, 0.3), 5, (3, 1), 1.2)
    chat = Recipe(False, DraftLength("fixed", 3), 3, None, 1.0)
    for recipe in (code, chat, Recipe()):
        assert Recipe.from_dict(recipe.to_dict(), "x") == recipe
    assert chat.to_dict()["drafting"] == OFF and chat.drafting is None and code.drafting == (3, 1)
    spec = SpeculativeSpec({}, Sampling(0.7), {}, recipes={"code": code, "default": chat})
    assert SpeculativeSpec.from_dict(spec.to_dict()).recipes == spec.recipes
    # format 3 as written before `tree` was always there: a list `drafting` is the tree
    older = {"code": {k: v for k, v in code.to_dict().items() if k != "tree"}}
    assert SpeculativeSpec.from_dict(spec.to_dict() | {"recipes": older}).recipe("code") == code
    # format 2: one flat object, a map per recipe part
    flat = {"version": 2, "target": {}, "sampling": {"temperature": 0.7}, "draft": {},
            "gamma": {"code": 5, "default": 3}, "draft_temperature": {"code": 1.2, "default": 1.0},
            "draft_length": {"code": code.chain.to_dict(), "default": chat.chain.to_dict()},
            "tree": {"code": [3, 1], "default": None}, "speculate": {"code": True, "default": False}}
    old = SpeculativeSpec.from_dict(flat)
    assert old.recipe("code") == code and old.recipe("chat") == chat  # an unseen domain: the default's
    assert old.recipe("code") != Recipe(True, code.chain, 5, None, 1.2)  # the wrong variant: the tree dropped
