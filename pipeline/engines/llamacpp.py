"""llama.cpp as a serving engine: built from the pinned source inside llama-cpp-python's sdist (its converter and
quantizer make the GGUF files), `llama-server` on 127.0.0.1 for evaluation, `llama-bench` for the passes' cost.

Its speculative rule (common/speculative.cpp, `draft-simple`): the draft proposes its argmax while its probability is
at least `p_min`, at most `n_max` tokens; the target accepts while its own sampled token equals the draft's. So a
drafted token is accepted with p_target(draft's argmax), and the block stops *before* an unsure token.
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.sampling import Sampling

BINARIES = ("llama-server", "llama-bench", "llama-quantize")
# Static binaries, no network features: no CURL/OpenSSL, no web UI download, native CPU kernels.
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON"]
# Without ggml's AMX kernels, which -march=native compiles in on an AMX Xeon: in this version they segfault on every
# multi-token batch, i.e. on every prompt and verify pass (ggml_backend_amx_mul_mat; docs/journal.md, "llama-server
# per draft position with 8 prompts"). GCC's explicit -mno-* wins over -march=native wherever it stands.
if platform.machine().lower() in ("x86_64", "amd64"):
    _NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CMAKE_FLAGS += [f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}"]


def binary(root: Path, name: str) -> Path:
    return root / "build" / "bin" / name


def is_built(root: Path) -> bool:
    """The binaries are there and were built with today's CMAKE_FLAGS (a cached build with other flags is redone)."""
    stamp = root / "build" / "cmake_flags.json"
    return (all(binary(root, name).is_file() for name in BINARIES) and (root / "src" / "convert_hf_to_gguf.py").is_file()
            and stamp.is_file() and json.loads(stamp.read_text()) == CMAKE_FLAGS)


def build(engines_dir: str | Path, version: str, log=print) -> Path:
    """The llama.cpp tree (source in src/, binaries in build/bin/) of llama-cpp-python==`version`, built once
    and cached under `engines_dir`; a failed build leaves nothing that looks built."""
    root = Path(engines_dir) / f"llama.cpp-{version}"
    if is_built(root):
        return root
    missing = [tool for tool in ("cmake", "ninja", "c++") if shutil.which(tool) is None]
    if missing:
        raise PipelineError(f"building llama.cpp needs {', '.join(missing)} on PATH: install them (e.g. apt-get "
                            f"install cmake ninja-build g++), or put a built tree at {root} (paths.engines)")
    root.mkdir(parents=True, exist_ok=True)
    source = _source(root, version, log)
    log(f"[llamacpp] building {', '.join(BINARIES)} from llama-cpp-python {version} (a few minutes on 2 cores)")
    build_dir, logfile = root / "build", root / "build.log"
    with open(logfile, "w") as out:
        steps = [["cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja", *CMAKE_FLAGS],
                 ["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2), "--target", *BINARIES]]
        for step in steps:
            if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise PipelineError(f"the llama.cpp build failed (log: {logfile}): fix the toolchain and rerun")
    (build_dir / "cmake_flags.json").write_text(json.dumps(CMAKE_FLAGS))
    return root


def _source(root: Path, version: str, log) -> Path:
    """vendor/llama.cpp of the pinned sdist, extracted to root/src."""
    source = root / "src"
    if (source / "CMakeLists.txt").is_file():
        return source
    download = root / "sdist"
    log(f"[llamacpp] fetching llama-cpp-python=={version} (sdist) from the package index")
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                             f"llama-cpp-python=={version}", "-d", str(download)], capture_output=True, text=True)
    archives = sorted(download.glob("llama_cpp_python-*.tar.gz"))
    if result.returncode != 0 or not archives:
        raise PipelineError(f"could not download llama-cpp-python=={version}'s sdist "
                            f"({(result.stderr.strip().splitlines() or ['no output'])[-1]}): check the package index")
    prefix = archives[0].name.removesuffix(".tar.gz") + "/vendor/llama.cpp/"
    tmp = root / "src.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(archives[0]) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for member in members:
            member.name = member.name[len(prefix):]
        tar.extractall(tmp, members=[m for m in members if m.name], filter="data")
    tmp.rename(source)
    shutil.rmtree(download, ignore_errors=True)
    return source


def hf_to_gguf(root: Path, hf_dir: str | Path, out: str | Path, quant: str | None) -> Path:
    """An HF directory as GGUF at `out`: llama.cpp's own convert_hf_to_gguf.py (f16), then llama-quantize to `quant`
    (e.g. Q4_1, Q4_K_M, Q8_0; None: the f16 file itself); each written through a temporary name, the f16
    intermediate removed once quantised."""
    out = Path(out)
    f16 = out if quant is None else out.with_name(out.name + ".f16")
    tmp = f16.with_name(f16.name + ".partial")
    env = {**os.environ, "PYTHONPATH": str(root / "src" / "gguf-py")}  # the converter's own gguf package
    _run([sys.executable, str(root / "src" / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(tmp),
          "--outtype", "f16"],
         f"llama.cpp could not convert {hf_dir} to GGUF", "export a Llama/Qwen2-family draft", env)
    tmp.rename(f16)
    if quant is None:
        return out
    try:
        tmp = out.with_name(out.name + ".partial")
        _run([str(binary(root, "llama-quantize")), str(f16), str(tmp), quant],
             f"llama-quantize {quant} failed on {f16}", "pick another quantisation type")
        return tmp.rename(out)
    finally:
        f16.unlink(missing_ok=True)


def _run(command: list[str], what: str, fix: str, env: dict | None = None) -> str:
    """A tool's stdout; on failure a one-line error: `what` (the tool's last line of stderr): `fix`."""
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise PipelineError(f"{what} ({(result.stderr.strip().splitlines() or ['no output'])[-1]}): {fix}")
    return result.stdout


def gguf_file_type(path: str | Path) -> str | None:
    """The quantisation family of a GGUF file (general.file_type as llama-quantize names it), or None."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.file_type")
    if field is None:
        return None
    value = int(field.parts[field.data[0]][0])
    try:
        return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_")
    except ValueError:
        return None


# ---------------------------------------------------------------- the server
@dataclass(frozen=True)
class DraftSettings:
    """llama-server's draft flags: --spec-draft-n-max, --spec-draft-p-min (None: the server's defaults)."""
    n_max: int | None = None
    p_min: float | None = None

    def flags(self) -> list[str]:
        out = []
        if self.n_max is not None:
            out += ["--spec-draft-n-max", str(int(self.n_max))]
        if self.p_min is not None:
            out += ["--spec-draft-p-min", f"{float(self.p_min):g}"]
        return out


# llama-server's own defaults for draft-simple (tools/server/README.md of the pinned version: --spec-draft-n-max 3,
# --spec-draft-p-min 0.00): what a user who passes only -md gets, predicted beside the calibrated setting.
SERVER_DEFAULTS = DraftSettings(n_max=3, p_min=0.0)
PASS_LINE = re.compile(r"accepted +(\d+)/ *(\d+) draft tokens")  # a verify pass, logged under LLAMA_TRACE


def draft_flags(draft: str | Path, settings: DraftSettings) -> list[str]:
    """llama-server's flags for a draft model under the draft-simple rule (pipeline/engines/rules.py)."""
    return ["-md", str(draft), "--spec-type", "draft-simple", *settings.flags()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One llama-server process on 127.0.0.1 (a free port), optionally with a draft; a context manager. `parallel`
    slots (-np) are decoded as one batch: one unless a caller batches requests, as collect.backend=server does."""

    def __init__(self, root: Path, model: str | Path, draft: str | Path | None = None,
                 settings: DraftSettings = DraftSettings(), threads: int | None = None, *, context: int,
                 start_timeout: float, log_path: str | Path | None = None, parallel: int = 1, trace: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path or Path(model).with_suffix(f".server-{self.port}.log"))
        command = [str(binary(root, "llama-server")), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                   "-c", str(context), "-np", str(int(parallel)), "-t", str(threads or os.cpu_count() or 1),
                   "--no-webui"]
        if draft is not None:
            command += draft_flags(draft, settings)
        self.command, self.start_timeout, self.process = command, start_timeout, None
        self.trace = trace  # LLAMA_TRACE=1: the server logs every verify pass (passes_logged)

    def __enter__(self) -> "Server":
        self.log_file = open(self.log_path, "w")
        env = {**os.environ, "LLAMA_TRACE": "1"} if self.trace else None
        self.process = subprocess.Popen(self.command, stdout=self.log_file, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PipelineError(f"llama-server exited at start ({self._last_log_line()}): check the GGUF files "
                                    f"and flags (log: {self.log_path})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise PipelineError(f"llama-server did not come up within {self.start_timeout:.0f} s (log: {self.log_path}): "
                            "a smaller model or a longer engines.llamacpp.start_timeout")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log_file.close()

    def _last_log_line(self) -> str:
        self.log_file.flush()
        lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1][:200] if lines else "no output"

    def complete(self, prompt_ids: list[int], n_predict: int, sampling: Sampling, seed: int,
                 stop_ids: list[int] = (), timeout: float = 600.0) -> dict:
        """One /completion of token ids with exactly `sampling` (temperature, then top-k, then top-p; llama.cpp's
        other samplers off), the prompt not cached between requests. Returns the server's JSON (`tokens`,
        `timings` with predicted_n / predicted_ms and, with a draft, draft_n / draft_n_accepted)."""
        body = {"prompt": list(prompt_ids), "n_predict": int(n_predict), "seed": int(seed), "cache_prompt": False,
                "return_tokens": True, "temperature": float(sampling.temperature), "top_k": int(sampling.top_k),
                "top_p": float(sampling.top_p), "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0,
                "samplers": ["temperature", "top_k", "top_p"]}
        request = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        logged_from = self.log_path.stat().st_size if self.trace else 0
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                out = json.loads(response.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            alive = self.process is not None and self.process.poll() is None
            raise PipelineError(f"llama-server {'did not answer' if alive else 'died'} mid-request ({e}; "
                                f"{self._last_log_line()}): see {self.log_path}") from None
        tokens, stops = list(out.get("tokens") or []), set(stop_ids)
        # the server stops at EOG tokens itself; cut at ours as the HF path does
        tokens = tokens[:next((i + 1 for i, token in enumerate(tokens) if token in stops), len(tokens))]
        result = {"tokens": tokens, "timings": out.get("timings") or {}, "stop_type": out.get("stop_type")}
        if self.trace:
            result["passes"] = self.passes_logged(logged_from, result["timings"])
        return result

    def passes_logged(self, offset: int, timings: dict, wait_s: float = 10.0) -> list[tuple[int, int]]:
        """(accepted, drafted) of every verify pass of the request whose log starts at byte `offset`, from the
        server's trace lines (tools/server/server-context.cpp: "accepted %2zu/%2zu draft tokens", then "stop
        processing" at the slot's release, which may be logged after the response is sent). They must add up to
        the response's draft counters, or this reading of the log is wrong."""
        deadline = time.monotonic() + wait_s
        while True:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
            if "stop processing" in text or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        passes = [(int(a), int(d)) for a, d in PASS_LINE.findall(text.split("stop processing")[0])]
        counted = (sum(a for a, _ in passes), sum(d for _, d in passes))
        if counted != (int(timings.get("draft_n_accepted", 0)), int(timings.get("draft_n", 0))):
            raise PipelineError(f"llama-server's per-pass log ({counted[0]} of {counted[1]} drafts accepted) disagrees "
                                f"with its response (draft_n_accepted {timings.get('draft_n_accepted')}, draft_n "
                                f"{timings.get('draft_n')}): see {self.log_path}")
        return passes


# ---------------------------------------------------------------- the cost of the passes
def bench(root: Path, model: str | Path, batch_sizes: tuple[int, ...], depth: int, repeats: int = 3,
          threads: int | None = None) -> dict[int, float]:
    """{tokens fed: ms} of one forward of that many tokens after `depth` cached tokens, measured by llama-bench
    (prompt processing of n tokens at depth d: the shape of a verify pass; 1 token = a decoding step)."""
    command = [str(binary(root, "llama-bench")), "-m", str(model), "-p", ",".join(str(b) for b in batch_sizes),
               "-n", "0", "-d", str(depth), "-r", str(repeats), "-t", str(threads or os.cpu_count() or 1), "-o", "json"]
    rows = json.loads(_run(command, f"llama-bench failed on {model}", "check the GGUF file"))
    return {int(row["n_prompt"]): float(row["avg_ns"]) / 1e6 for row in rows if row.get("n_prompt")}
