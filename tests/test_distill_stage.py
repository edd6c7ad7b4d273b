"""The distill stage end to end on a tiny peaked target (conftest's session-scoped `setup` and `distilled`): a
short distillation raises held-out acceptance, the export (weights, tokenizer, calibration, model card, draft
length policy and trees; HF assisted generation), the held-out split, learning-curve points and their shared
labels, keep_best, a cost profile of another device, the typed settings (distill/settings.py), bad input refused
with one line, two processes under accelerate, and one smoke run on the real embedded target. CPU; fixed seeds."""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import types

import pytest
import torch

from pipeline.errors import PipelineError
from tests.conftest import (SHIPPED, read_spec, REPO, WORD_SPECIALS as SPECIALS, WORD_VOCAB as VOCAB, distill_overrides as overrides,
                            run_distill_stage as run_stage, tiny_llama)


# ---------------------------------------------------------------- the stage
def test_a_cost_profile_of_another_device_is_used_for_calibration(setup, distilled, tmp_path):
    """calibrate.cost.profile: γ and the policy are chosen for that profile's costs, which travel with
    the export; a profile for other model shapes is refused with one line."""
    from pipeline.measure.cost_profile import read_profile, write_profile

    measured = read_profile(distilled[2] / "draft" / "cost_profile.json")
    assert measured["machine"]["device"] == "cpu"
    slow_draft = json.loads(json.dumps(measured))
    slow_draft["draft"]["ms"] = measured["target"][str(min(map(int, measured["target"])))]["1"]["ms"] * 0.9
    write_profile(tmp_path / "slow_draft.json", slow_draft)
    run_stage(setup, tmp_path / "out", f"calibrate.cost.profile={tmp_path / 'slow_draft.json'}")
    spec = read_spec(tmp_path / "out" / "draft")
    assert spec["cost"]["c"] == pytest.approx(0.9, rel=0.01)
    fast = read_spec(distilled[2] / "draft")["predicted_speedup"]
    assert all(spec["predicted_speedup"][d] < fast[d] for d in fast), (spec["predicted_speedup"], fast)
    assert json.loads((tmp_path / "out" / "draft" / "cost_profile.json").read_text()) == slow_draft
    other = json.loads(json.dumps(measured))
    other["shapes"]["target"]["hidden_size"] += 1
    write_profile(tmp_path / "other.json", other)
    with pytest.raises(PipelineError, match="hidden_size"):
        run_stage(setup, tmp_path / "out2", f"calibrate.cost.profile={tmp_path / 'other.json'}")


def test_short_distillation_raises_heldout_acceptance(distilled):
    result, tracker, _ = distilled
    assert result["acceptance_after"] - result["acceptance_before"] > 0.15, result
    steps = [s for s, m in tracker.steps if "heldout/acceptance/overall" in m]
    assert steps == [20, 40]  # the acceptance simulator ran at every eval step
    assert "heldout/mean_accepted_length_g4/chat" in tracker.metrics


def test_bf16_autocast_training_learns_and_exports_in_the_serving_dtype(setup, tmp_path):
    # the path a CPU with native bf16 (or a GPU) takes by default: bf16 target, autocast over fp32 master weights
    result, _ = run_stage(setup, tmp_path, "runtime.dtype=bfloat16", "distill.trainer.bf16=auto", "distill.trainer.max_steps=20")
    assert result["acceptance_after"] - result["acceptance_before"] > 0.1, result
    spec = read_spec(tmp_path / "draft")
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["dtype"] == "bfloat16"
    assert_cost_is_the_ratio_of_its_forward_times(spec["cost"])


def test_a_learning_curve_point_trains_on_a_nested_share_and_reports_the_same_heldout(setup, distilled, tmp_path):
    full = read_spec(distilled[2] / "draft")
    run_stage(setup, tmp_path, "distill.split.train_fraction=0.5", "distill.trainer.max_steps=4",
              "distill.heldout.eval_steps=4", "distill.checkpoint.save_steps=4")
    half = read_spec(tmp_path / "draft")
    assert half["training"]["train_fraction"] == 0.5 and full["training"]["train_fraction"] == 1.0
    assert 0 < half["training"]["rows"] < full["training"]["rows"]
    assert 0 < half["training"]["data_tokens"] < full["training"]["data_tokens"]
    assert half["heldout"] == full["heldout"]  # the same held-out prompts judge every point
    assert half["training"]["fingerprint"] != full["training"]["fingerprint"]
    with pytest.raises(PipelineError, match="train_fraction"):
        run_stage(setup, tmp_path / "bad", "distill.split.train_fraction=0")


def test_learning_curve_points_share_one_head_and_one_labelling_of_every_train_row(setup, tmp_path, monkeypatch):
    from distill import labels

    labelled = []
    original = labels.cached_teacher_labels
    monkeypatch.setattr(labels, "cached_teacher_labels",
                        lambda inputs, vocab, train, k, log: labelled.append(len(train))
                        or original(inputs, vocab, train, k, log))
    specs = {}
    for share in (0.5, 1.0):
        run_stage(setup, tmp_path / str(share), "model.draft.vocab_subset=40", f"distill.split.train_fraction={share}",
                  "distill.trainer.max_steps=2", "distill.heldout.eval_steps=2", "distill.checkpoint.save_steps=2")
        specs[share] = read_spec(tmp_path / str(share) / "draft")
    assert specs[0.5]["training"]["rows"] < specs[1.0]["training"]["rows"]
    assert labelled == [specs[1.0]["training"]["rows"]] * 2  # the half point labelled every row, not its half
    assert specs[0.5]["vocab_subset"] == specs[1.0]["vocab_subset"]  # the same FR-Spec head for every point


def test_teacher_labels_are_computed_once_per_rows_and_subset(setup, tmp_path, monkeypatch):
    from datasets import Dataset
    from omegaconf import OmegaConf

    from distill import labels
    from distill.aligned import Truncation
    from pipeline.modelio.models import load_model

    target = load_model(setup["target"], torch.device("cpu"), torch.float32)
    train = Dataset.from_dict({"prompt_ids": [[3, 4, 5], [6, 7]], "completion_ids": [[8, 9, 10, 11], [12, 13]]})
    inputs = types.SimpleNamespace(target=target, target_ident={"path": "tiny"}, truncation=Truncation(8, 8),
                                   is_main=True, settings=OmegaConf.create({"heldout": {"batch_size": 2}}),
                                   tokenizer=types.SimpleNamespace(pad_token_id=0),
                                   cfg=OmegaConf.create({"paths": {"cache": str(tmp_path)}}))
    vocab = torch.tensor([1, 8, 9, 10, 12])
    first = labels.cached_teacher_labels(inputs, vocab, train, 4, print)
    monkeypatch.setattr(labels, "teacher_labels", lambda *a, **k: pytest.fail("the target pass ran again"))
    assert labels.cached_teacher_labels(inputs, vocab, train, 4, print) == first  # same rows, same subset: from disk
    assert [len(x) for x in first["subset_logmass"]] == [4, 2]
    with pytest.raises(pytest.fail.Exception, match="ran again"):  # another subset: other labels
        labels.cached_teacher_labels(inputs, torch.tensor([1, 8, 9]), train, 4, print)


def test_rows_with_stored_hidden_states_need_no_target_pass_for_the_subset_mass(setup, tmp_path, monkeypatch):
    """collect.hidden_states rows: the FR-Spec subset's mass comes from the target's head alone (the label pass
    never runs), equals what that pass gives on the same rows, and the stage trains and exports as before."""
    from datasets import load_from_disk

    from distill import labels
    from distill.aligned import Truncation
    from pipeline.modelio.models import load_model
    from tests.conftest import write_collect_output

    target = load_model(setup["target"], torch.device("cpu"), torch.float32)
    collect = write_collect_output(target, tmp_path / "collect", n_prompts=12, new_tokens=8, hidden=True)
    rows = load_from_disk(str(collect / "dataset")).to_list()[:4]
    vocab = torch.arange(0, target.config.vocab_size, 2)
    forward = labels.teacher_labels(target, rows, Truncation(64, 64), 4, vocab, 2, 0)
    stored = labels.labels_from_hidden(target, [torch.tensor(r["final_hidden"]) for r in rows],
                                       [len(r["completion_ids"]) for r in rows], 4, vocab)
    assert stored["topk_ids"] == forward["topk_ids"]
    for a, b in zip(stored["subset_logmass"], forward["subset_logmass"]):
        assert a == pytest.approx(b, abs=1e-4)
    monkeypatch.setattr(labels, "teacher_labels", lambda *a, **k: pytest.fail("a target pass ran over the rows"))
    run_stage(setup, tmp_path / "out", f"paths.collect={collect}", "model.draft.vocab_subset=40",
              "distill.trainer.max_steps=2", "distill.heldout.eval_steps=2", "distill.checkpoint.save_steps=2")
    spec = read_spec(tmp_path / "out" / "draft")
    assert spec["training"]["steps"] == 2 and len(spec["vocab_subset"]) == 40


def test_heldout_prompts_split_into_disjoint_calibration_and_reporting_parts():
    """keep_best, τ, γ and the draft-length policy are chosen on the calibration part; every reported number
    comes from the reporting part, so no number is measured on the rows that chose it."""
    from pipeline.control.split import split_heldout

    prompt_ids = [f"{d}-{i}" for d in ("chat", "code") for i in range(6) for _turn in range(2)]
    domains = [p.split("-")[0] for p in prompt_ids]
    calibration, reporting, disjoint = split_heldout(prompt_ids, domains, 0.5, seed=0)
    chosen, reported = {prompt_ids[i] for i in calibration}, {prompt_ids[i] for i in reporting}
    assert disjoint and not chosen & reported and chosen | reported == set(prompt_ids)
    assert {p.split("-")[0] for p in chosen} == {p.split("-")[0] for p in reported} == {"chat", "code"}
    assert len(calibration) + len(reporting) == len(prompt_ids)  # every turn of a prompt stays with it
    # a domain with a single held-out prompt: it serves both, and the split says it is not disjoint
    _, _, disjoint = split_heldout(["a-0", "b-0", "b-1"], ["a", "b", "b"], 0.5, seed=0)
    assert not disjoint


def test_the_export_reports_on_the_reporting_part(distilled):
    _, _, out = distilled
    spec = read_spec(out / "draft")
    parts = spec["heldout"]
    assert parts["disjoint"] and parts["calibration"]["rows"] > 0 and parts["reporting"]["rows"] > 0
    ids = parts["prompt_ids"]  # which prompts, for eval.prompts_file=heldout
    assert ids["reporting"] and ids["calibration"] and not set(ids["reporting"]) & set(ids["calibration"])
    card = (out / "draft" / "README.md").read_text()
    assert "reporting part" in card and ids["reporting"][0] not in card


def test_distill_leaves_the_collected_data_untouched(distilled, setup):
    # datasets' cache files written next to the input would make DVC rerun collect on every repro
    assert not list((setup["collect"] / "dataset").glob("cache-*.arrow"))


def test_export_has_weights_tokenizer_calibration_and_model_card(distilled):
    _, _, out = distilled
    spec = read_spec(out / "draft")
    for key in ("version", "target", "sampling", "recipes", "vocab_subset", "acceptance", "cost"):
        assert key in spec
    assert set(spec["recipes"]) == {"chat", "code", "default"}
    assert all(r["draft_temperature"] is not None and r["gamma"] >= 1 and r["chain"] for r in spec["recipes"].values())
    assert spec["acceptance"]["after"]["overall"] > spec["acceptance"]["before"]["overall"]
    assert_cost_is_the_ratio_of_its_forward_times(spec["cost"])
    card = (out / "draft" / "README.md").read_text()
    assert f"{spec['acceptance']['after']['chat']:.3f}" in card  # the card shows this run's numbers
    assert (out / "draft_init" / "config.json").exists() and (out / "draft" / "tokenizer.json").exists()


def test_the_undistilled_draft_ships_with_its_own_calibration(distilled):
    # a fair "before": the initial weights get τ, γ, policy and tree from the same calibration part and cost profile
    from pipeline.decoding.spec import SpeculativeSpec

    _, _, out = distilled
    init, tuned = SpeculativeSpec.read(out / "draft_init"), SpeculativeSpec.read(out / "draft")
    assert not init.distilled and init.selected == "init" and tuned.distilled
    assert set(init.recipes) == {"chat", "code", "default"} and all(r.chain for r in init.recipes.values())
    assert init.cost == tuned.cost  # one cost profile: the draft's shape sets it, not its weights
    assert init.acceptance["after"] == init.acceptance["before"] == tuned.acceptance["before"]
    assert init.predicted_speedup != tuned.predicted_speedup  # calibrated on the initial weights, not copied
    assert (out / "draft_init" / "cost_profile.json").exists()


def test_export_carries_the_draft_length_policy_for_our_decoder_and_for_hf(distilled):
    from transformers import GenerationConfig

    from pipeline.decoding.draft_length import DraftLength
    from pipeline.decoding.spec import SpeculativeSpec

    _, _, out = distilled
    spec = SpeculativeSpec.read(out / "draft")
    assert set(spec.recipes) == {"chat", "code", "default"}
    default = spec.recipe("default").chain
    assert isinstance(default, DraftLength) and default.max >= 1
    assert all(v > 0 for v in spec.predicted_speedup.values())
    config = GenerationConfig.from_pretrained(out / "draft")
    assert config.num_assistant_tokens == default.max
    expected_threshold = default.threshold if default.policy == "confidence" else 0.0
    assert config.assistant_confidence_threshold == pytest.approx(expected_threshold)
    assert config.num_assistant_tokens_schedule == ("heuristic" if default.policy == "heuristic" else "constant")


def test_greedy_serving_calibrates_a_tree_or_a_chain_per_domain(setup, tmp_path):
    from pipeline.decoding.spec import SpeculativeSpec

    run_stage(setup, tmp_path, "distill.serving.temperature=0", "distill.trainer.max_steps=20")
    spec = SpeculativeSpec.read(tmp_path / "draft")
    assert set(spec.recipes) == {"chat", "code", "default"}
    assert_trees_are_candidates_with_their_predicted_speedup(spec)
    # this run (session setup, seed 0) picks a tree for at least one domain: the check above is not vacuous
    assert any(r.tree is not None for r in spec.recipes.values()), spec.recipes


def assert_cost_is_the_ratio_of_its_forward_times(cost: dict) -> None:
    """c is the draft step over the 1-token target step of the same profile (no bound on how fast either is), and
    the verify ratios grow with γ from at least 1."""
    assert cost["draft_forward_ms"] > 0 and cost["target_forward_ms"] > 0
    assert cost["c"] == pytest.approx(cost["draft_forward_ms"] / cost["target_forward_ms"], rel=1e-6)
    ratios = [cost["verify_ratio"][g] for g in sorted(cost["verify_ratio"], key=int)]
    assert ratios and ratios[0] >= 1.0 and all(a <= b for a, b in zip(ratios, ratios[1:]))


def assert_trees_are_candidates_with_their_predicted_speedup(spec):
    """Each domain's tree is a candidate token tree that is not a chain, and the domain's predicted speedup is that
    tree's own figure on the reporting part (tree_candidates); a domain on a chain has no tree."""
    from distill.tree_choice import CANDIDATES

    assert set(spec.tree_candidates) == set(spec.recipes)
    for domain, tree in ((d, r.tree) for d, r in spec.recipes.items()):
        predicted = spec.predicted_speedup["overall" if domain == "default" else domain]
        if tree is None:
            continue
        assert tuple(tree) in CANDIDATES and set(tree) != {1}, (domain, tree)
        key = ",".join(map(str, tree))
        assert predicted == pytest.approx(spec.tree_candidates[domain][key]["predicted_speedup"]), (domain, tree)


def test_sampled_serving_calibrates_trees_from_the_sibling_acceptance(setup, tmp_path):
    from pipeline.decoding.spec import SpeculativeSpec

    run_stage(setup, tmp_path, "distill.trainer.max_steps=20", "calibrate.tree_samples=4")
    spec = SpeculativeSpec.read(tmp_path / "draft")
    assert not spec.sampling.greedy and set(spec.recipes) == {"chat", "code", "default"}
    assert_trees_are_candidates_with_their_predicted_speedup(spec)
    run_stage(setup, tmp_path / "chains", "distill.trainer.max_steps=20", "calibrate.tree_samples=0")
    assert {r.tree for r in SpeculativeSpec.read(tmp_path / "chains" / "draft").recipes.values()} == {None}


def test_export_works_as_hf_assistant_model_with_greedy_output_equal_to_target(distilled, setup):
    from transformers import AutoModelForCausalLM

    _, _, out = distilled
    target = AutoModelForCausalLM.from_pretrained(setup["target"]).eval()
    draft = AutoModelForCausalLM.from_pretrained(out / "draft").eval()
    assert draft.config.num_hidden_layers == 1 and draft.config.vocab_size == VOCAB
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = torch.cat([torch.tensor([[2, 4]]), torch.randint(6, VOCAB, (1, 6), generator=g)], 1)
        kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=1, eos_token_id=None)
        plain = target.generate(ids, **kwargs)
        assisted = target.generate(ids, assistant_model=draft, **kwargs)
        assert torch.equal(plain, assisted)


def test_vocab_subset_online_teacher_and_on_policy_batches(setup, tmp_path):
    result, tracker = run_stage(setup, tmp_path, "model.draft.vocab_subset=48", "distill.objective.teacher=online",
                                "distill.objective.lmbda=0.5", "distill.trainer.max_epochs=1", "distill.objective.loss=fkl")
    spec = read_spec(tmp_path / "draft")
    assert spec["training"]["steps"] == 5  # max_epochs=1 caps max_steps: ceil(18 train rows / batch 4)
    assert len(spec["vocab_subset"]) == 48 and 1 in spec["vocab_subset"] and 3 in spec["vocab_subset"]
    assert tracker.metrics["on_policy_batches"] > 0


@pytest.mark.parametrize("extra,match", [
    (("paths.collect=/nonexistent",), "no collected data"),
    (("distill.objective.loss=kl",), "unknown distillation loss"),
    (("model.draft.derive.layers=[0,9]",), "out of range"),
    (("distill.objective.teacher=cloud",), r"unknown distill\.objective\.teacher='cloud'"),
    (("distill.objective.lmbda=0.5", "distill.objective.loss=ce"), "loss=ce does not use"),
    (("distill.split.heldout_fraction=1.5",), r"distill\.split\.heldout_fraction=1\.5 must be in \(0, 1\)"),
    (("distill.trainer.max_steps=null", "distill.trainer.max_epochs=null"), "both null"),
    (("calibrate.tree_samples=null",), r"field 'calibrate\.tree_samples' is not Optional"),
    (("distill.trainer.lr_probe={factors:[1.0,2.0],steps:10}",), r"distill\.trainer\.lr_probe=.* must be null or"),
    (("distill.trainer.stop_patience=0",), r"distill\.trainer\.stop_patience=0 is not a count"),
    (("+distill.objective.no_such_knob=1",), r"unknown setting\(s\) distill\.objective\.no_such_knob"),
])
def test_bad_input_is_one_clear_error(setup, tmp_path, extra, match):
    with pytest.raises(PipelineError, match=match) as e:
        run_stage(setup, tmp_path, *extra)
    assert "\n" not in str(e.value) and ": " in str(e.value)
    assert not (tmp_path / "draft").exists()


def test_distill_settings_are_the_composed_keys_frozen_and_checked_on_every_build():
    """DistillSettings (distill/settings.py) holds the composed distill and calibrate groups: a field per key at every
    level, no other, their values, read-only; a missing or unknown key and a bad value (also through
    dataclasses.replace) are one line."""
    import dataclasses

    from omegaconf import OmegaConf, open_dict

    from distill.settings import DistillSettings

    yaml = OmegaConf.create(OmegaConf.to_container(SHIPPED.distill))  # plain containers: keys may be added and deleted
    calibrate = OmegaConf.create(OmegaConf.to_container(SHIPPED.calibrate))
    both = OmegaConf.create({"distill": yaml, "calibrate": calibrate})
    # the distill stage builds every distill key, the calibrate stage every calibrate key: together the whole shape
    settings = dataclasses.replace(DistillSettings.from_config(both, "distill"),
                                   calibration=DistillSettings.from_config(both, "calibrate").calibration)
    with open_dict(yaml):
        yaml.calibration = calibrate  # the shape of the settings: calibrate's group is their `calibration` field

    def same_keys(value, tree, where="distill"):
        if dataclasses.is_dataclass(value):
            assert [f.name for f in dataclasses.fields(value)] == list(tree), where
            for f in dataclasses.fields(value):
                same_keys(getattr(value, f.name), tree[f.name], f"{where}.{f.name}")

    same_keys(settings, OmegaConf.to_container(yaml))
    assert list(settings.trainer) == [key for key in yaml.trainer if key != "extra"]  # by name, max_epochs among them
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.objective.loss = "ce"
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.split = None
    with pytest.raises(TypeError):
        settings.trainer["max_steps"] = 1
    assert isinstance(settings.calibration.gammas, tuple) and isinstance(settings.calibration.cost.contexts, tuple)
    assert dataclasses.replace(settings) == settings  # normalising again changes nothing

    def one_line(match, build):
        with pytest.raises(PipelineError, match=match) as e:
            build()
        assert "\n" not in str(e.value) and ": " in str(e.value)

    one_line(r"distill\.split\.calibration_share=1 must be in \(0, 1\)", lambda: dataclasses.replace(
        settings, split=dataclasses.replace(settings.split, calibration_share=1)))
    one_line("is outside \\(0, 1\\)", lambda: dataclasses.replace(
        settings, objective=dataclasses.replace(settings.objective, loss="jsd", beta=1.0)))
    unknown, missing, unread = (OmegaConf.create({"distill": copy.deepcopy(yaml),
                                                  "calibrate": copy.deepcopy(calibrate)}) for _ in range(3))
    with open_dict(unknown), open_dict(missing), open_dict(unread):
        unknown.distill.heldout.no_such_knob = 1
        del missing.calibrate.cost.repeats
        del unread.distill.trainer.bf16  # a key the stage reads itself; any other TrainingArguments name may come and go
    one_line(r"unknown setting\(s\) distill\.heldout\.no_such_knob",
             lambda: DistillSettings.from_config(unknown, "calibrate"))
    one_line(r"calibrate\.cost\.repeats missing", lambda: DistillSettings.from_config(missing, "calibrate"))
    one_line(r"distill\.trainer\.bf16 missing", lambda: DistillSettings.from_config(unread, "distill"))
    assert DistillSettings.from_config(unread, "calibrate").trainer is None  # calibration reads no trainer key
    # the distill stage reads calibrate's keep_best and keep_best_rule alone: the rest of the group is calibrate's
    assert DistillSettings.from_config(missing, "distill").calibration.keep_best == calibrate.keep_best
    with open_dict(missing):
        missing.calibrate.keep_best_rule = "nope"
    one_line(r"calibrate\.keep_best_rule='nope'", lambda: DistillSettings.from_config(missing, "distill"))


def test_draft_with_another_tokenizer_is_refused(setup, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + [f"w{i}" for i in range(VOCAB - len(SPECIALS))]
    words[10], words[11] = words[11], words[10]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    other = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", pad_token="</s>")
    draft = tiny_llama(vocab_size=VOCAB, layers=1)
    draft.save_pretrained(tmp_path / "other")
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(PipelineError, match="different ids"):
        run_stage(setup, tmp_path / "out", "model.draft.init=pretrained", f"model.draft.path={tmp_path / 'other'}")


def test_two_processes_with_accelerate(setup, tmp_path):
    """`accelerate launch --num_processes 2 -m pipeline stage=distill` on CPU (gloo)."""
    if shutil.which("accelerate") is None:
        pytest.skip("accelerate CLI not installed")
    cmd = ["accelerate", "launch", "--num_processes", "2", "--cpu", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "-m", "pipeline", "stage=distill",
           *overrides(setup, tmp_path, "runtime.threads=1", "distill.trainer.max_steps=10", "distill.heldout.eval_steps=5",
                      "distill.checkpoint.save_steps=5")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    # No skip on "Connection refused" / "DistNetworkError": a rank that crashes makes the others print those too,
    # so they are no proof the machine cannot rendezvous; a failed run fails.
    assert proc.returncode == 0, output[-3000:]
    record = json.loads((tmp_path / "trained" / "training.json").read_text())  # distill's output; calibrate is 1 process
    assert record["training"]["steps"] == 10
    assert output.count("held-out acceptance before") == 1  # evaluation runs on the main process only


@pytest.mark.smoke
def test_real_target_derived_draft_with_vocab_subset_exports_a_working_assistant(real_target, tmp_path):
    """The embedded SmolLM2 target: a two-layer derived draft with an FR-Spec head, exported, reloaded and used
    as HF `assistant_model`: greedy output equals the target's own."""
    from transformers import AutoModelForCausalLM

    from pipeline.modelio.draft_init import build_draft
    from distill.export import ExportParts, save_draft
    from pipeline.heads import restore_full_head, use_subset_head
    from pipeline.sampling import Sampling
    from pipeline.decoding.spec import SpeculativeSpec

    target, tokenizer = real_target
    draft, draft_tok, info = build_draft({"init": "derive", "derive": {"layers": [0, 1]}}, target, tokenizer, {})
    head = use_subset_head(draft, torch.arange(4096))
    assert draft(torch.tensor([[1, 2, 3]])).logits.shape[-1] == 4096
    restore_full_head(draft, head)
    spec = SpeculativeSpec({"name": "SmolLM2"}, Sampling(), info, list(range(4096)))
    save_draft(draft, draft_tok, tmp_path / "draft", target.generation_config, ExportParts(spec, "# card"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "draft").eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").input_ids
    kwargs = dict(max_new_tokens=20, do_sample=False)
    assert torch.equal(target.generate(ids, **kwargs), target.generate(ids, assistant_model=reloaded, **kwargs))


def test_a_draft_that_training_made_worse_is_not_shipped(setup, tmp_path):
    # a learning rate this high wrecks the one-layer draft; keep_best exports the initial weights instead (the probe,
    # which would train at a lower rate, off)
    result, _ = run_stage(setup, tmp_path, "distill.trainer.lr_probe=null", "distill.trainer.learning_rate=3.0", "distill.trainer.max_steps=10", "distill.trainer.warmup_steps=0",
                          "distill.trainer.max_grad_norm=1e9")
    spec = read_spec(tmp_path / "draft")
    assert spec["acceptance"]["after_training"]["overall"] < spec["acceptance"]["before"]["overall"]
    assert spec["selected"] == "init" and spec["acceptance"]["after"] == spec["acceptance"]["before"]
    assert "the initial draft" in (tmp_path / "draft" / "README.md").read_text()
    verdict = spec["training"]["keep_best"]
    assert verdict["difference"] < 0 and verdict["rule"] == "interval" and verdict["selected"] == "init"
    # what ships is the initial draft as saved before training (on disk, not a copy held in memory through it): the
    # same weights as draft_init/, and the staged copy is gone with the checkpoints
    from safetensors.torch import load_file

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.modelio.draft_init import build_draft

    shipped, initial = (load_file(tmp_path / "trained" / d / "model.safetensors") for d in ("draft", "draft_init"))
    assert shipped.keys() == initial.keys() and all(torch.equal(shipped[k], initial[k]) for k in shipped)
    target = AutoModelForCausalLM.from_pretrained(setup["target"])
    built = build_draft({"init": "derive", "derive": {"layers": [0]}}, target,
                        AutoTokenizer.from_pretrained(setup["target"]), {})[0].state_dict()
    assert all(torch.equal(built[k], initial[k]) for k in initial)  # draft_init/ is the draft as built, untrained
    assert not list((tmp_path / "distill_ckpt").glob("*.draft_init"))


def test_compare_drafts_judges_every_draft_on_the_same_heldout_rows(setup, distilled, tmp_path, capsys):
    """`pipeline.tools compare-drafts`: a draft against itself differs by exactly 0; the undistilled draft trails
    the distilled one beyond the paired CI on the same rows; fewer than two drafts is one line."""
    from pipeline.tools.__main__ import run as tools

    def main(extra: list[str]):
        return tools(["compare-drafts", *extra])

    run = distilled[2]
    copy = shutil.copytree(run / "draft", tmp_path / "copy")
    drafts = f"tool.drafts=[{run / 'draft'},{run / 'draft_init'},{copy}]"
    result = main(overrides(setup, tmp_path, drafts, f"tool.json={tmp_path / 'compare.json'}"))
    overall = result["domains"]["overall"]
    spec = read_spec(run / "draft")
    assert overall["acceptance"][str(run / "draft")] == pytest.approx(spec["acceptance"]["after"]["overall"], abs=1e-3)
    same = overall["difference"][str(copy)]
    assert same[0] == 0 and same[1] == [0, 0]
    delta, (lo, hi) = overall["difference"][str(run / "draft_init")]
    assert delta < 0 and hi < 0, overall
    assert json.loads((tmp_path / "compare.json").read_text())["drafts"][1] == str(run / "draft_init")
    assert "Δ" in capsys.readouterr().out
    with pytest.raises(PipelineError, match="two or more different"):
        main(overrides(setup, tmp_path, f"tool.drafts=[{run / 'draft'}]"))
    # a distill stage's own output (paths.trained), before any calibration: the same weights as their export
    trained = f"tool.drafts=[{run / 'draft_init'},{run / 'trained' / 'draft_init'}]"
    delta, _ = main(overrides(setup, tmp_path, trained))["domains"]["overall"]["difference"][
        str(run / "trained" / "draft_init")]
    assert abs(delta) < 1e-3
    with pytest.raises(PipelineError, match="not a draft export"):
        main(overrides(setup, tmp_path, trained, "tool.temperature=calibrated"))
    # drafting the argmax (llama.cpp's rule): another measure of the same drafts, on the same rows
    argmax = main(overrides(setup, tmp_path, drafts, "tool.temperature=argmax"))["domains"]["overall"]
    assert argmax["difference"][str(copy)][0] == 0 and argmax["rows"] == overall["rows"]
    assert abs(argmax["acceptance"][str(run / "draft")] - overall["acceptance"][str(run / "draft")]) > 1e-3
    with pytest.raises(PipelineError, match="tool.temperature='hot'"):
        main(overrides(setup, tmp_path, drafts, "tool.temperature=hot"))
