"""collect.backend=server: rows from OpenAI-compatible servers. Against a real llama-server on the embedded model
(started here on 127.0.0.1 at a free port): the HF backend's schema and prompt ids, kill-and-resume equal to an
uninterrupted run, a context the server cannot hold skipped and counted, the chat endpoint, one-line CLI errors.
A local HTTP stub only for what a real server will not do on demand: 429, 503, timeouts, a 400, a second model."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from data.server_client import probe
from pipeline.errors import PipelineError
from pipeline.control.tracking import _NullRun
from tests.conftest import SHIPPED, REPO, SERVER, tiny_tokenizer

PROMPTS = [{"id": "chat-0", "domain": "chat", "turns": ["What is the capital of France?", "And of Italy?"]},
           {"id": "chat-1", "domain": "chat", "turns": ["Say hello in one word."]},
           {"id": "math-0", "domain": "math", "turns": ["What is 12 + 30? Answer with the number."]},
           {"id": "math-1", "domain": "math", "turns": ["Compute 7 * 6. Solve it step by step."]}]
SERVER_CONTEXT = 256  # tokens per request of the test servers: room for PROMPTS, not for LONG
LONG = {"id": "math-long", "domain": "math", "turns": ["Add up 1 + 2 + 3 + 4 + 5 + 6 + 7 + 8 + 9. " * 24, "Why?"]}


def write_prompts(artifacts: Path, prompts=PROMPTS) -> None:
    (artifacts / "prompts").mkdir(parents=True, exist_ok=True)
    (artifacts / "prompts" / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))


def overrides(artifacts: Path, target: Path, extra=()) -> list[str]:
    target = [f"model.target.path={target}"] if target else []  # None: the packaged preset's own target
    return [f"paths.artifacts={artifacts}", *target, "tracking.enabled=false",
            "runtime.device=cpu", "runtime.dtype=float32", "runtime.threads=1", "collect.max_new_tokens=10",
            "collect.shard_size=1", "collect.batch_size=4", "collect.topk=0", *extra]


def on_server(url: str, *extra: str) -> list[str]:
    return ["collect.backend=server", f"collect.server.urls=[{url}]", "collect.server.retries=1",
            "collect.server.backoff=0.01", "collect.server.timeout=60", *extra]


def collect(artifacts: Path, target: Path, extra=()) -> dict:
    from hydra import compose, initialize_config_dir

    from data.collect import run

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides(artifacts, target, extra))
    return run(cfg, _NullRun())


def rows_of(artifacts: Path) -> list[dict]:
    from datasets import load_from_disk

    return load_from_disk(str(artifacts / "collect" / "dataset")).to_list()


def manifest_of(artifacts: Path) -> dict:
    return json.loads((artifacts / "collect" / "manifest.json").read_text())


def llama_server(root: Path, gguf: Path, log: Path):
    """One single-slot llama-server on 127.0.0.1 at a free port, one thread (the thread count is part of what
    makes its rows reproducible: it orders the sums)."""
    from pipeline.engines import llamacpp

    return llamacpp.Server(root, gguf, threads=1, context=SERVER_CONTEXT, log_path=log,
                           start_timeout=SERVER["start_timeout"])


@pytest.fixture(scope="module")
def server(llamacpp_build, embedded_gguf, tmp_path_factory):
    with llama_server(llamacpp_build, embedded_gguf, tmp_path_factory.mktemp("server") / "server.log") as running:
        yield running


# ----------------------------------------------------------------------------- a real llama-server

@pytest.mark.smoke
def test_server_rows_have_the_hf_backends_schema_prompt_ids_and_labels(tmp_path, real_target, real_target_path,
                                                                      server):
    from datasets import load_from_disk

    from pipeline.modelio.chat import encode_chat, messages_for

    model, tokenizer = real_target
    greedy = ["collect.temperature=0", "collect.topk=4"]
    for name, extra in (("hf", greedy), ("server", greedy + on_server(server.url, "collect.server.logprobs=true"))):
        write_prompts(tmp_path / name)
        collect(tmp_path / name, real_target_path, extra)
    hf, served = rows_of(tmp_path / "hf"), rows_of(tmp_path / "server")
    features = [load_from_disk(str(tmp_path / name / "collect" / "dataset")).features for name in ("hf", "server")]
    # the same schema, but for the hidden states only an in-process target can give (collect.hidden_states)
    assert "final_hidden" in features[0] and "final_hidden" not in features[1]
    assert {k: v for k, v in features[0].items() if k != "final_hidden"} == features[1]
    assert [r["id"] for r in served] == [r["id"] for r in hf] and len(served) == 5
    # turn 0: the very ids the HF backend feeds its target; turn 1 follows the server's own turn-0 answer
    assert [r["prompt_ids"] for r in served if r["turn"] == 0] == [r["prompt_ids"] for r in hf if r["turn"] == 0]
    by_id, prompts = {r["id"]: r for r in served}, {p["id"]: p for p in PROMPTS}
    stop = manifest_of(tmp_path / "server")["stop_token_ids"]
    top1, gaps, shifted = [], [], []
    for r in served:
        answers = [by_id[f"{r['prompt_id']}/t{t}/s0"]["text"] for t in range(r["turn"])]
        messages = messages_for(prompts[r["prompt_id"]], answers, r["turn"])
        assert r["prompt_ids"] == encode_chat(tokenizer, messages)[0].tolist()
        assert r["text"] == tokenizer.decode(r["completion_ids"], skip_special_tokens=True)
        assert (r["finish_reason"] == "eos") == (r["completion_ids"][-1] in stop)
        assert r["finish_reason"] == "eos" or len(r["completion_ids"]) == 10
        # the server's labels are the target's raw T=1 distribution, a fresh HF forward of the same ids up to the
        # engines' numerics (Q4_1 kernels with 8-bit activations vs the de-quantised fp32 weights) ...
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        with torch.no_grad():
            fresh = torch.log_softmax(model(ids).logits[0, len(r["prompt_ids"]) - 1:-1].float(), -1)
        top_ids, stored = torch.tensor(r["topk_ids"]).long(), torch.tensor(r["topk_logprobs"], dtype=torch.float32)
        top1.append(top_ids[:, 0].eq(fresh.argmax(-1)).float())
        gaps.append((fresh.gather(1, top_ids) - stored).abs().flatten())
        # ... and not one position off (the wrong alignment a label/id mix-up would give)
        shifted.append((fresh[1:].gather(1, top_ids[:-1]) - stored[:-1]).abs().flatten())
    assert torch.cat(top1).mean() >= 0.9
    # measured here: 0.10 nats mean, 0.35 at most (greedy, 50 positions x 4 labels); a shift by one position: > 1
    assert torch.cat(gaps).mean() < 0.2 and torch.cat(gaps).max() < 1.0
    assert torch.cat(shifted).mean() > 10 * torch.cat(gaps).mean()
    manifests = [manifest_of(tmp_path / name) for name in ("hf", "server")]
    assert set(manifests[0]) <= set(manifests[1])
    assert (manifests[0]["labels"], manifests[1]["labels"]) == ("target-forward", "server")
    assert manifests[1]["server"]["engine"] == "llamacpp" and manifests[1]["token_ids"] == {"server": 5}


@pytest.mark.smoke
def test_a_server_killed_mid_collect_resumes_to_the_uninterrupted_rows(tmp_path, real_target_path, llamacpp_build,
                                                                      embedded_gguf, monkeypatch):
    """Sampled (T=0.7, two samples per turn, a seed per request): rows are a function of (prompt, seed), so a
    fresh server after a kill gives the rows the killed one would have given."""
    import data.collect as stage

    sampled = ["collect.temperature=0.7", "collect.samples_per_prompt=2"]
    write_prompts(tmp_path / "whole")
    with llama_server(llamacpp_build, embedded_gguf, tmp_path / "whole.log") as first:
        collect(tmp_path / "whole", real_target_path, sampled + on_server(first.url))

    crashed = tmp_path / "crashed"
    write_prompts(crashed)
    real_save, saved = stage._save_shard, []
    with llama_server(llamacpp_build, embedded_gguf, tmp_path / "killed.log") as doomed:
        def save_then_kill_after_two(final, *args):
            real_save(final, *args)
            saved.append(final.name)
            if len(saved) == 2:
                doomed.process.kill()
                doomed.process.wait()
        monkeypatch.setattr(stage, "_save_shard", save_then_kill_after_two)
        with pytest.raises(PipelineError, match="every server failed") as failure:
            collect(crashed, real_target_path, sampled + on_server(doomed.url))
    assert "\n" not in str(failure.value)
    assert not (crashed / "collect" / "dataset").exists() and not (crashed / "collect" / "manifest.json").exists()
    assert len(saved) == 2 and len(list((crashed / "collect" / "shards").glob("*/*"))) == 2

    redone = []
    monkeypatch.setattr(stage, "_save_shard", lambda final, *a: (redone.append(final.name), real_save(final, *a)))
    with llama_server(llamacpp_build, embedded_gguf, tmp_path / "restarted.log") as restarted:
        collect(crashed, real_target_path, sampled + on_server(restarted.url))
        resumed_shards = list(redone)
        write_prompts(tmp_path / "seed1")
        collect(tmp_path / "seed1", real_target_path, sampled + on_server(restarted.url) + ["seed=1"])
    assert not set(saved) & set(resumed_shards) and len(resumed_shards) == 2  # shards of one prompt: 4 in all
    resumed, whole = rows_of(crashed), rows_of(tmp_path / "whole")
    assert resumed == whole and len(whole) == 10
    assert len({r["id"] for r in resumed}) == len(resumed)  # no duplicates
    assert rows_of(tmp_path / "seed1") != whole  # the equality above is not one any seed would give


@pytest.mark.smoke
def test_a_prompt_longer_than_the_servers_context_is_a_counted_skip(tmp_path, real_target_path, server):
    write_prompts(tmp_path, PROMPTS[1:2] + [LONG])
    collect(tmp_path, real_target_path, on_server(server.url))
    manifest = manifest_of(tmp_path)
    assert [r["id"] for r in rows_of(tmp_path)] == ["chat-1/t0/s0"]  # the long prompt's second turn is not tried
    assert manifest["skipped"] == {"context": 1} and manifest["skipped_total"] == 1 and manifest["rows"] == 1


@pytest.mark.smoke
def test_the_chat_endpoint_renders_the_same_prompt_and_gives_the_completions_rows(tmp_path, real_target_path,
                                                                                  server):
    greedy = ["collect.temperature=0"]
    for endpoint in ("completions", "chat"):
        write_prompts(tmp_path / endpoint, PROMPTS[:2])
        collect(tmp_path / endpoint, real_target_path,
                greedy + on_server(server.url, f"collect.server.endpoint={endpoint}"))
    assert rows_of(tmp_path / "chat") == rows_of(tmp_path / "completions")
    assert manifest_of(tmp_path / "chat")["server"]["endpoint"] == "chat"


@pytest.mark.smoke
def test_launch_serves_the_targets_gguf_for_the_run_with_the_rows_of_a_given_url(tmp_path, real_target_path, server):
    sampled = ["collect.temperature=0.7", "engines.llamacpp.threads=1"]
    write_prompts(tmp_path / "url", PROMPTS[:2])
    collect(tmp_path / "url", real_target_path, sampled + on_server(server.url))
    write_prompts(tmp_path / "launch", PROMPTS[:2])
    models = {"paths.models": REPO / "artifacts/models", "paths.cache": REPO / "artifacts/cache",
              "paths.engines": REPO / "artifacts/engines"}
    collect(tmp_path / "launch", None, sampled + [f"{k}={v}" for k, v in models.items()]
            + ["collect.backend=server", "collect.server.launch=true"])
    assert rows_of(tmp_path / "launch") == rows_of(tmp_path / "url")
    url = manifest_of(tmp_path / "launch")["server"]["urls"][0]
    with pytest.raises(PipelineError, match="does not answer"):  # stopped with the run
        probe((url,), None, "auto")


def run_collect_cli(artifacts: Path, target: Path, extra: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pipeline", "stage=collect", *overrides(artifacts, target, extra)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.smoke
def test_an_unreachable_url_or_a_wrong_model_name_is_one_line_exit_2_nothing_written(tmp_path, real_target_path,
                                                                                    server):
    from pipeline.engines.llamacpp import free_port

    cases = [(on_server(f"http://127.0.0.1:{free_port()}"), "does not answer GET /v1/models"),
             (on_server(server.url, "collect.server.model=not-the-target"),
              "not collect.server.model='not-the-target'")]
    for i, (extra, needle) in enumerate(cases):
        write_prompts(tmp_path / str(i))
        done = run_collect_cli(tmp_path / str(i), real_target_path, extra)
        err = done.stderr.strip()
        assert done.returncode == 2 and len(err.splitlines()) == 1 and needle in err, err[-2000:]
        assert not (tmp_path / str(i) / "collect").exists()


# ----------------------------------------------------------------------------- a stub for the faults

def llama_reply(tokens: list[int], stop_type: str = "limit") -> dict:
    return {"choices": [{"text": "", "index": 0, "logprobs": None,
                         "finish_reason": "stop" if stop_type == "eos" else "length"}],
            "__verbose": {"tokens": tokens, "stop_type": stop_type, "truncated": False}}


class Stub:
    """An OpenAI-shaped HTTP server on 127.0.0.1 (a thread) that answers POSTs from a script: each entry is
    (status, JSON body, seconds to wait first, headers); the last entry repeats. Records every POST body."""

    def __init__(self, script, models=("target",), owned_by="llamacpp"):
        self.script, self.posts = list(script), []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                data = [{"id": name, "object": "model", "owned_by": owned_by, "meta": {"n_ctx": 512}}
                        for name in models]
                self._send(200, {"object": "list", "data": data}, {})

            def do_POST(self):
                stub.posts.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                status, body, delay, headers = stub.script.pop(0) if len(stub.script) > 1 else stub.script[0]
                time.sleep(delay)
                self._send(status, body, headers)

            def _send(self, status, body, headers):
                payload = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    for key, value in headers.items():
                        self.send_header(key, value)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout test)
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stubs():
    made = []
    yield lambda *args, **kwargs: made.append(Stub(*args, **kwargs)) or made[-1]
    for stub in made:
        stub.close()


STOP = [1, 3]  # tiny_tokenizer's </s> and <|im_end|>


def backend_for(urls, **server):
    """A ServerBackend on tiny_tokenizer (max_new_tokens 4, T=0.7), probing `urls` as the stage does."""
    from data.collect_rows import CollectSettings, ServerSettings
    from data.collect_server import ServerBackend

    options = {**SHIPPED.collect.server, "urls": list(urls), "retries": 2,
               "backoff": 0.01, "timeout": 5, **server}
    settings = CollectSettings(temperature=0.7, max_new_tokens=4, samples_per_prompt=1, topk=server.get("topk", 0),
                               hidden_states=False, batch_size=1, shard_size=1, backend="server", seed=0, keep_shards=True, domains=None,
                               max_prompts_per_domain=None, max_minutes=None, vllm={},
                               server=ServerSettings(**{k: v for k, v in options.items() if k != "topk"}))
    return ServerBackend.connect(settings, tiny_tokenizer(), STOP)


def test_429_and_503_are_retried_with_backoff_and_the_row_is_the_servers(stubs):
    stub = stubs([(503, {"error": {"message": "loading"}}, 0, {}),
                  (429, {"error": "busy"}, 0, {"Retry-After": "0"}),
                  (200, llama_reply([7, 8, 3], "eos"), 0, {})])
    backend = backend_for([stub.url])
    (done,) = backend.generate([[2, 4, 9]], seed=5)
    assert (done.ids, done.finish_reason) == ([7, 8, 3], "eos") and len(stub.posts) == 3
    body = stub.posts[-1]
    assert body["prompt"] == [2, 4, 9] and body["max_tokens"] == 4 and body["temperature"] == 0.7
    assert body["samplers"] == ["temperature", "top_k", "top_p"] and body["cache_prompt"] is False
    assert len({p["seed"] for p in stub.posts}) == 1  # a retry is the same request
    assert backend.take_stats() == {"skipped": {}, "token_ids": {"server": 1}}


def test_per_request_seeds_follow_the_request_not_the_server(stubs):
    reply = (200, llama_reply([7, 8, 9, 10]), 0.05, {})  # 50 ms a request: every worker gets some
    one, two = stubs([reply]), stubs([reply])
    backend_for([one.url, two.url], concurrency=2).generate([[2]] * 6, seed=11)
    alone = stubs([(200, llama_reply([7, 8, 9, 10]), 0, {})])
    backend_for([alone.url]).generate([[2]] * 6, seed=11)
    seeds = sorted(p["seed"] for p in one.posts + two.posts)
    assert seeds == sorted(p["seed"] for p in alone.posts) and len(set(seeds)) == 6
    assert one.posts and two.posts  # both servers took work


def test_a_timeout_is_a_failed_try_and_a_dead_server_hands_its_work_to_a_live_one(stubs):
    slow = stubs([(200, llama_reply([7, 8, 9, 10]), 2.0, {})])
    live = stubs([(200, llama_reply([5, 6, 3], "eos"), 0, {})])
    backend = backend_for([slow.url, live.url], timeout=0.3, retries=1)
    done = backend.generate([[2], [2, 4], [2, 5]], seed=0)
    assert [c.ids for c in done] == [[5, 6, 3]] * 3
    assert len(slow.posts) == 2  # one request, two tries, then it is dropped for the turn
    with pytest.raises(PipelineError, match="every server failed") as failure:
        backend_for([slow.url], timeout=0.3, retries=1).generate([[2]], seed=0)
    assert "\n" not in str(failure.value) and "2 tries" in str(failure.value)


def test_a_400_context_error_is_a_skip_and_another_400_is_one_line(stubs):
    too_long = {"error": {"code": 400, "message": "request (700 tokens) exceeds the available context size (512 "
                          "tokens), try increasing it", "type": "exceed_context_size_error"}}
    backend = backend_for([stubs([(400, too_long, 0, {})]).url])
    assert backend.generate([[2, 4]], seed=0) == [None]
    assert backend.take_stats()["skipped"] == {"context": 1}
    assert backend.generate([[2] * 509], seed=0) == [None]  # 509 + 4 new tokens ≥ n_ctx 512: not even sent
    bad = stubs([(400, {"error": {"message": "Unsupported param: best_of"}}, 0, {})])
    with pytest.raises(PipelineError, match="refused a request .*best_of"):
        backend_for([bad.url]).generate([[2]], seed=0)


def test_the_probe_names_the_model_the_servers_serve(stubs):
    two = stubs([(200, {}, 0, {})], models=("target", "other"))
    with pytest.raises(PipelineError, match=r"serves 2 models .*set collect.server.model"):
        backend_for([two.url])
    assert backend_for([two.url], model="other").describe()["model"] == "other"
    with pytest.raises(PipelineError, match=r"not collect.server.model='nope'"):
        backend_for([two.url], model="nope")
    vllm = stubs([(200, {}, 0, {})], owned_by="vllm")
    assert backend_for([vllm.url]).engine == "vllm"


def test_vllm_replies_give_ids_and_raw_labels_and_text_replies_are_retokenized(stubs):
    legacy = {"tokens": ["token_id:7", "token_id:3"],
              "top_logprobs": [{"token_id:7": -0.1, "token_id:9": -2.5, "token_id:4": -3.0},
                               {"token_id:3": -0.2, "token_id:8": -1.9, "token_id:5": -4.0, "token_id:6": -6.0}]}
    vllm = stubs([(200, {"choices": [{"text": "w1", "token_ids": [7, 3], "finish_reason": "stop",
                                       "logprobs": legacy}]}, 0, {})], owned_by="vllm")
    backend = backend_for([vllm.url], logprobs=True, topk=2)
    (done,) = backend.generate([[2]], seed=0)
    assert done.ids == [7, 3] and done.finish_reason == "eos"
    assert done.topk_ids.tolist() == [[7, 9], [3, 8]]
    assert done.topk_logprobs.ravel().tolist() == pytest.approx([-0.1, -2.5, -0.2, -1.9], abs=1e-3)
    body = vllm.posts[-1]
    assert body["logprobs"] == 2 and body["stop_token_ids"] == STOP and body["top_k"] == -1
    assert body["return_token_ids"] is True and "samplers" not in body

    text_only = stubs([(200, {"choices": [{"text": "w1 w2", "finish_reason": "stop"}]}, 0, {})], owned_by="x")
    backend = backend_for([text_only.url])
    (done,) = backend.generate([[2]], seed=0)
    tokenizer = tiny_tokenizer()
    assert done.ids == tokenizer.encode("w1 w2", add_special_tokens=False) + [3] and done.finish_reason == "eos"
    assert backend.take_stats()["token_ids"] == {"retokenized": 1}


def test_replies_that_cannot_be_rows_are_counted_skips(stubs):
    early = stubs([(200, llama_reply([7, 8], "eos"), 0, {})])  # stopped at 8: an EOG of the server's, not ours
    unaligned = {"content": [{"id": 7, "logprob": -0.1, "top_logprobs": [{"id": 7, "logprob": -0.1}]}]}
    reply = llama_reply([7, 8, 9, 10])
    reply["choices"][0]["logprobs"] = unaligned  # one label row for four tokens
    short = stubs([(200, reply, 0, {})])
    loose_text = stubs([(200, {"choices": [{"text": "w1  w2", "finish_reason": "length"}]}, 0, {})], owned_by="x")
    cases = ((early, "foreign_stop", {}), (short, "unaligned_logprobs", {"logprobs": True, "topk": 1}),
             (loose_text, "retokenize", {}))
    for stub, reason, extra in cases:
        backend = backend_for([stub.url], **extra)
        assert backend.generate([[2]], seed=0) == [None]
        assert backend.take_stats()["skipped"] == {reason: 1}, reason


@pytest.mark.parametrize("extra, message", [
    (["collect.backend=server"], r"needs collect\.server\.urls"),
    (["collect.server.urls=[localhost:8080]"], r"must be http\(s\):// base URLs"),
    (["collect.server.urls=[http://a:1,http://a:1]"], "lists a server twice"),
    (["collect.server.endpoint=responses"], r"unknown collect\.server\.endpoint='responses'"),
    (["collect.server.engine=tgi"], r"unknown collect\.server\.engine='tgi'"),
    (["collect.server.concurrency=0"], r"collect\.server\.concurrency=0 must be ≥ 1"),
    (["collect.server.timeout=0"], r"collect\.server\.timeout=0\.0 must be > 0"),
    (["collect.server.logprobs=maybe"], r"collect\.server\.logprobs=maybe: Value 'maybe' is not a valid bool"),
    (["collect.server.launch=true", "collect.server.urls=[http://a:1]"], "leave collect.server.urls empty"),
    (["+collect.server.api_key=x"], r"unknown setting\(s\) collect\.server\.api_key"),
])
def test_bad_server_settings_are_one_line_before_anything_runs(extra, message):
    from data.collect_rows import CollectSettings
    from pipeline.control.params import compose_config

    with pytest.raises(PipelineError, match=message) as e:  # the schema refuses a value of the wrong type first
        cfg = compose_config(extra)
        CollectSettings.from_config(cfg.collect, cfg.seed)
    assert "\n" not in str(e.value)


def test_the_fingerprint_holds_what_decides_server_rows_not_where_they_run():
    from dataclasses import replace

    from data.collect_rows import CollectSettings, ServerSettings

    options = dict(SHIPPED.collect.server, urls=["http://a:1"])
    base = CollectSettings(temperature=0.7, max_new_tokens=4, samples_per_prompt=1, topk=0, hidden_states=False,
                           batch_size=1, shard_size=1, backend="server", seed=0, keep_shards=True, domains=None, max_prompts_per_domain=None,
                           max_minutes=None, vllm={}, server=ServerSettings(**options))
    moved = replace(base, server=ServerSettings(**{**options, "urls": ["http://b:2", "http://c:3"],
                                                   "concurrency": 4, "retries": 9}))
    assert moved.generation_key() == base.generation_key()
    for change in ({"model": "other"}, {"endpoint": "chat"}, {"logprobs": True}):
        changed = replace(base, server=ServerSettings(**{**options, **change}))
        assert changed.generation_key() != base.generation_key(), change
    hf = replace(base, backend="hf")
    assert "server" not in hf.generation_key()  # the in-process backends' fingerprints are as before
