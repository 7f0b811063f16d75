"""The node's CPU runtime against llama.cpp on the same machine and the same weights, side by side in one run.

What users who offer CPU servers would run instead is llama.cpp. This measures, for one model, in each
precision class a node offers:

| class  | this project, on the checkpoint    | this project and llama.cpp, on the same GGUF file   |
|--------|------------------------------------|-----------------------------------------------------|
| 16     | `--dtype bfloat16`                 | F16 (`convert_hf_to_gguf.py --outtype f16`)          |
| 8      | `--quantize q8_0`                  | Q8_0 (`--outtype q8_0`)                              |
| 4      | `--quantize q4_0`                  | Q4_0 (`llama_model_quantize` from the F16 file)      |
| 4k     | `--quantize q4_1`                  | Q4_K_M (`llama_model_quantize` from the F16 file)    |

The quantized rows run at the node's default dtype, float32, where a Llama block of ggml matrices decodes through
`runtime.ggml.decode_step` (two C calls a block); `--quantize int8` / `int4` run in bfloat16.

(`--quantize int8` / `int4`, PyTorch's kernels, measured 0.78x / 0.80x of llama.cpp's decode here: run with
`--ours-quantize int8,int4,int4,int4` to see them again.)

Three sides per row (`SIDES`): `ours` (the node's runtime on the safetensors checkpoint, quantized on load), `gguf`
(the node's runtime on llama.cpp's own GGUF file, served as stored with `runtime.ggml`'s kernels, float32
activations) and `llamacpp`. `decode_ratio` etc. are `ours` over llama.cpp, `gguf_decode_ratio` etc. `gguf` over
llama.cpp.

- decode: a `--prompt-tokens` prompt, then `--new-tokens` greedy tokens one at a time (tokens/s of those);
- prefill: a `--prefill-tokens` prompt as one step into an empty cache (tokens/s);
- sessions: `--sessions` sessions (8) decoding together, a quarter of `--new-tokens` each: aggregate tokens/s,
  and `*_sessions_gain`, that over the side's single-session decode rate (decode is memory-bound, so batching
  should be nearly free). This project batches them as a node's scheduler does (one `BlockStack.step` over all
  sessions' caches); llama.cpp decodes them as parallel sequences of one context (`n_seq_max`), one
  `llama_decode` per token for all, as its server's slots and `llama-batched-bench` do.

Both sides run the whole model in one process with `--threads` threads: embeddings, every block, final norm
and head, the greedy pick included. This project's side is the node's own runtime: `runtime.blocks.BlockStack`
over all blocks (the node's caches, masks and quantized modules, prompts chunked as the node chunks them) and
`runtime.model_ends.ModelEnds` for the ends; its head is quantized like the blocks in the 8- and 4-bit rows, as
llama.cpp's files quantize theirs (in a swarm the client holds the head). llama.cpp runs through
`llama-cpp-python`'s bindings (`Llama.eval`, one batch for the prompt), in a worker process of its own
environment. Rounds interleave the two sides, so load from elsewhere hits both alike; medians over
`--rounds`. `ratio` is this project's tokens/s over llama.cpp's: the aim is >= 0.9 in every row.

The bandwidth ceiling: decode reads every weight once per token, so the machine's read bandwidth (bytes per
second of summing a 1 GiB tensor, `read_bandwidth`, measured before and after the models and the better kept)
over each side's bytes per token (blocks plus head, as stored) is about the fastest any implementation could
decode; `*_decode_of_ceiling` is each side's fraction of it.

llama.cpp is the benchmark's reference, not a dependency of the product: when `--env` (default
`~/.cache/swarmnode/bench-llamacpp`) has no working install, this builds `llama-cpp-python` 0.3.36 (which
vendors llama.cpp at commit 0c1e570) from its source release for this CPU (native flags, AMX taken out where the
CPU has it, see `build_args`; about 15 minutes on 2 cores), with what its converter needs (`torch==2.13.0` from this machine's wheel, `transformers` 4.57.6,
`sentencepiece`), and converts checkpoints with the `convert_hf_to_gguf.py` that ships in that release.
GGUF files are cached in the environment, keyed by the checkpoint's folder.

`--model` defaults to `/work/models/llama-1b`, written by `make_random_checkpoint.py --shape 1b` when
missing. `--decode-only-model` adds a decode row per precision for a second checkpoint, measured once
(e.g. the dense 8B shape: `make_random_checkpoint.py --shape 8b --out /work/models/llama-8b`).

Prints progress on stderr and ONE JSON line last on stdout.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_cpu_runtime.py [--rounds 4] [--threads 2]
        [--precisions 16,8,4,4k] [--decode-only-model /work/models/llama-8b]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

LLAMA_CPP_PYTHON = "0.3.36"  # vendors llama.cpp 0c1e570
CONVERTER_REQUIREMENTS = ["torch==2.13.0", "transformers==4.57.6", "sentencepiece>=0.1.98,<0.3.0", "numpy~=2.2",
                          "protobuf>=4.21.0,<5.0.0", "safetensors"]
DEFAULT_ENV = Path.home() / ".cache" / "swarmnode" / "bench-llamacpp"
#: who is measured: this project's node on the checkpoint (`--quantize`), the node on llama.cpp's own GGUF file
#: (served as stored, `runtime.ggml`), and llama.cpp on that file
SIDES = ("ours", "gguf", "llamacpp")
DEFAULT_MODEL = Path("/work/models/llama-1b")
#: precision class -> (this project's `--quantize`, GGUF type)
PRECISIONS = {"16": ("none", "f16"), "8": ("q8_0", "q8_0"), "4": ("q4_0", "q4_0"), "4k": ("q4_1", "q4_k_m")}
#: GGUF types llama.cpp's quantizer makes from the F16 file (the converter writes the others itself)
QUANTIZED_FROM_F16 = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}

WORKER = r'''
import json, sys, time
import numpy as np
import llama_cpp

path, threads, context, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=context, n_batch=batch,
                      n_ubatch=batch, verbose=False)
print(json.dumps({"ready": True, "vocab": llm.n_vocab()}), flush=True)


def sessions_decode(ids, new, sessions):
    """`sessions` sequences in one context: each prompt, then `new` greedy tokens for all of them per decode call
    (the way llama-server's slots and llama-batched-bench run parallel sequences); aggregate tokens/s."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = sessions * (len(ids) + new + 8)
    params.n_batch = params.n_ubatch = max(len(ids), sessions)
    params.n_seq_max = sessions
    params.n_threads = params.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(llm.model, params)
    vocab = llm.n_vocab()
    batch = llama_cpp.llama_batch_init(max(len(ids), sessions), 0, sessions)

    def run(rows):  # rows: (token, position, sequence, wants logits)
        batch.n_tokens = len(rows)
        for i, (token, position, sequence, logits) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0], batch.logits[i] = sequence, logits
        if llama_cpp.llama_decode(ctx, batch):
            raise RuntimeError("llama_decode failed")
        return [int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(vocab,))))
                for i, row in enumerate(rows) if row[3]]

    try:
        tokens = []
        for sequence in range(sessions):
            tokens += run([(t, p, sequence, p == len(ids) - 1) for p, t in enumerate(ids)])
        began = time.perf_counter()
        for step in range(new):
            tokens = run([(tokens[s], len(ids) + step, s, True) for s in range(sessions)])
        return sessions * new / (time.perf_counter() - began)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)


for line in sys.stdin:
    ask = json.loads(line)
    ids = ask["ids"]
    if ask["kind"] == "sessions":
        print(json.dumps({"tps": sessions_decode(ids, ask["new"], ask["sessions"])}), flush=True)
        continue
    llm.reset()
    if ask["kind"] == "prefill":
        began = time.perf_counter()
        llm.eval(ids)
        print(json.dumps({"tps": len(ids) / (time.perf_counter() - began)}), flush=True)
        continue
    llm.eval(ids)
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    began = time.perf_counter()
    for _ in range(ask["new"]):
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    print(json.dumps({"tps": ask["new"] / (time.perf_counter() - began)}), flush=True)
'''


def log(message: str) -> None:
    print(f"[bench_cpu_runtime {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- llama.cpp's environment -------------------------------------------------------------------------------
def llama_python(env: Path) -> Path:
    return env / "venv" / "bin" / "python"


def converter_dir(env: Path) -> Path:
    return env / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


def _imports(env: Path, code: str) -> str | None:
    """What `code` prints in llama.cpp's environment, or None when it fails there."""
    python = llama_python(env)
    if not python.exists():
        return None
    probe = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 else None


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


#: Compiler options that take AMX out of a native build (explicit -mno-* options win over -march=native's).
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def build_args() -> str:
    """CMake options for llama.cpp: native CPU flags (`GGML_NATIVE`, so AVX-512 FP16 and the rest are used where
    the CPU has them), with AMX taken out on CPUs that have it: in this release ggml's AMX kernels (which it
    prefers for Q8_0 and Q4_0 there) die with SIGILL on `tilezero` in its worker threads (seen on a Xeon with AMX
    in a VM, where oneDNN's AMX kernels run), while its AVX-512 kernels, with the repacked Q4_0 layout, run."""
    if "amx_tile" not in cpu_flags():
        return "-DGGML_NATIVE=ON"
    return f"-DGGML_NATIVE=ON '-DCMAKE_C_FLAGS={_NO_AMX}' '-DCMAKE_CXX_FLAGS={_NO_AMX}'"


def _has_llamacpp(env: Path) -> bool:
    stamp = env / "build-args.txt"
    return (_imports(env, "import llama_cpp; print(llama_cpp.__version__)") == LLAMA_CPP_PYTHON
            and stamp.exists() and stamp.read_text() == build_args())


def _has_converter(env: Path) -> bool:
    return ((converter_dir(env) / "convert_hf_to_gguf.py").exists()
            and _imports(env, "import torch, transformers, sentencepiece; print('ok')") == "ok")


def _works(env: Path) -> bool:
    return _has_llamacpp(env) and _has_converter(env)


def ensure_llamacpp(env: Path) -> None:
    """Install llama-cpp-python (built from source with native CPU flags) and its converter into `env`; each part
    is installed only when missing."""
    if _works(env):
        return
    env.mkdir(parents=True, exist_ok=True)
    python = llama_python(env)
    if not python.exists():
        log(f"creating llama.cpp's environment in {env}")
        subprocess.run([sys.executable, "-m", "venv", str(env / "venv")], check=True)
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    source = env / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not source.exists():
        log(f"downloading llama-cpp-python {LLAMA_CPP_PYTHON}'s source release")
        subprocess.run([str(python), "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
                        "--no-binary", ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(env)], check=True)
    if not _has_llamacpp(env):
        log(f"building llama-cpp-python {LLAMA_CPP_PYTHON} (llama.cpp 0c1e570) from source for this CPU "
            f"({build_args()}): about 15 minutes on 2 cores")
        began = time.monotonic()
        build_env = {**os.environ, "CMAKE_ARGS": build_args(), "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count())}
        subprocess.run([*pip, "--force-reinstall", "--no-cache-dir", str(source)], check=True, env=build_env)
        (env / "build-args.txt").write_text(build_args())
        log(f"built in {time.monotonic() - began:.0f} s")
    if not _has_converter(env):
        log("installing the requirements of llama.cpp's converter")
        subprocess.run([*pip, *CONVERTER_REQUIREMENTS], check=True)
        with tarfile.open(source) as archive:
            inside = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
            wanted = tuple(inside + part for part in ("convert_hf_to_gguf.py", "conversion/", "gguf-py/"))
            members = [m for m in archive.getmembers() if m.name.startswith(wanted)]
            archive.extractall(env / "src", members=members, filter="data")
    if not _works(env):
        raise SystemExit(f"llama.cpp's environment in {env} does not work after installing; remove it and retry")


def gguf_file(env: Path, model: Path, kind: str) -> Path:
    """The GGUF of checkpoint `model` in `kind` (f16, q8_0 or q4_0), converted once and cached in `env`."""
    folder = env / "gguf"
    folder.mkdir(exist_ok=True)
    target = folder / f"{model.name}-{kind}.gguf"
    stamp = target.with_suffix(".source")
    if target.exists() and stamp.exists() and stamp.read_text() == str(model.resolve()):
        return target
    if kind in QUANTIZED_FROM_F16:
        f16 = gguf_file(env, model, "f16")
        log(f"quantizing {f16.name} to {kind.upper()}")
        code = ("import llama_cpp, sys\np = llama_cpp.llama_model_quantize_default_params()\n"
                f"p.ftype = llama_cpp.{QUANTIZED_FROM_F16[kind]}\np.nthread = 0\n"
                "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
        done = subprocess.run([str(llama_python(env)), "-c", code, str(f16), str(target)], capture_output=True,
                              text=True)
        if done.returncode:
            raise SystemExit(f"llama.cpp could not quantize {f16} to {kind.upper()}:\n{done.stderr[-2000:]}")
    else:
        log(f"converting {model} to GGUF {kind.upper()} with llama.cpp's convert_hf_to_gguf.py")
        converter = converter_dir(env)
        subprocess.run([str(llama_python(env)), str(converter / "convert_hf_to_gguf.py"),
                        str(converter_input(env, model)), "--outtype",
                        kind, "--outfile", str(target)], check=True, cwd=converter,
                       env={**os.environ, "PYTHONPATH": str(converter / "gguf-py"), "HF_HUB_OFFLINE": "1"},
                       stdout=subprocess.DEVNULL)
    stamp.write_text(str(model.resolve()))
    return target


def converter_input(env: Path, model: Path) -> Path:
    """`model` as the converter's transformers 4 reads it: links to its files, with a `tokenizer_config.json` that
    names the fast tokenizer class transformers 4 knows instead of transformers 5's `TokenizersBackend`."""
    staging = env / "staging" / model.name
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    for item in model.iterdir():
        if item.name != "tokenizer_config.json":
            (staging / item.name).symlink_to(item.resolve())
    config = model / "tokenizer_config.json"
    if config.exists():
        settings = json.loads(config.read_text())
        if settings.get("tokenizer_class") == "TokenizersBackend":
            settings["tokenizer_class"] = "PreTrainedTokenizerFast"
        (staging / config.name).write_text(json.dumps(settings))
    return staging


class LlamaCpp:
    """A llama.cpp worker process holding one GGUF file."""

    def __init__(self, env: Path, path: Path, threads: int, context: int, batch: int):
        self.path = path
        self.proc = subprocess.Popen([str(llama_python(env)), "-c", WORKER, str(path), str(threads), str(context),
                                      str(batch)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = json.loads(self.proc.stdout.readline() or "{}")
        if not ready.get("ready"):
            self.close()
            raise SystemExit(f"llama.cpp could not load {path}")

    def ask(self, **request) -> float:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["tps"]

    def decode(self, ids: list[int], new: int) -> float:
        return self.ask(kind="decode", ids=ids, new=new)

    def prefill(self, ids: list[int]) -> float:
        return self.ask(kind="prefill", ids=ids)

    def sessions(self, ids: list[int], new: int, sessions: int) -> float:
        return self.ask(kind="sessions", ids=ids, new=new, sessions=sessions)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --- this project's runtime ---------------------------------------------------------------------------------
def checkpoint_dtype(quantization: str) -> torch.dtype:
    """The dtype of this project's side on the checkpoint: bfloat16 for the 16-bit row and PyTorch's int8/int4,
    float32 (the node's default) for ggml's blocks, whose Llama blocks decode in C (`runtime.ggml.decode_step`)."""
    from swarmnode.runtime.quantize import GGML_MODES

    return torch.float32 if quantization in GGML_MODES else torch.bfloat16


class NodeRuntime:
    """The whole model through the node's runtime: `BlockStack` over every block, `ModelEnds` around it."""

    def __init__(self, model: Path, quantization: str, dtype: torch.dtype = torch.bfloat16):
        """`model`: a checkpoint folder (blocks quantized on load by `quantization`), or a GGUF file (served as
        stored, `quantization` "gguf", the kernels of `runtime.ggml`)."""
        from swarmnode.runtime.blocks import BlockStack
        from swarmnode.runtime.model_ends import ModelEnds
        from swarmnode.runtime.quantize import block_bytes, quantized_linear
        from swarmnode.runtime.scheduler import DEFAULT_PREFILL_CHUNK
        from swarmnode.runtime.sources import open_checkpoint

        checkpoint = open_checkpoint(str(model))
        self.blocks = checkpoint.num_blocks
        self.ends = ModelEnds(checkpoint, dtype)
        self.stack = BlockStack(checkpoint, 0, self.blocks, dtype=dtype, quantization=quantization)
        self.chunk = DEFAULT_PREFILL_CHUNK
        head = self.ends.output_embeddings()
        if quantization not in ("none", "gguf") and isinstance(head, torch.nn.Linear) and head.weight is not None:
            self.ends.model.set_output_embeddings(quantized_linear(head, quantization, dtype))
        if quantization == "gguf":
            self.weight_bytes = sum(checkpoint.loaded_block_bytes(i, dtype) for i in range(self.blocks))
        else:
            self.weight_bytes = sum(block_bytes(layer, quantization, dtype) for layer in self.stack.layers.values())
        head = self.ends.output_embeddings()
        self.head_bytes = sum(t.numel() * t.element_size() for t in [*head.buffers(), *head.parameters()])

    def _logits(self, cache, ids: torch.Tensor, position: int) -> torch.Tensor:
        n = ids.shape[1]
        positions = torch.arange(position, position + n)[None]
        mask = torch.ones(1, n, dtype=torch.bool)
        outputs = []

        def blocks(hidden):
            for a in range(0, n, self.chunk):  # as the node's scheduler runs a long prompt
                b = min(a + self.chunk, n)
                outputs.append(self.stack.step([cache], 0, self.blocks, hidden[:, a:b], positions[:, a:b],
                                               mask[:, a:b]))
            return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

        return self.ends.logits(blocks, input_ids=ids, position_ids=positions, logits_to_keep=1)

    def decode(self, ids: list[int], new: int) -> float:
        cache = self.stack.new_session_cache(0, self.blocks, 1, len(ids) + new + 1)
        logits = self._logits(cache, torch.tensor([ids]), 0)
        token = int(logits[0, -1].argmax())
        began = time.perf_counter()
        for i in range(new):
            logits = self._logits(cache, torch.tensor([[token]]), len(ids) + i)
            token = int(logits[0, -1].argmax())
        return new / (time.perf_counter() - began)

    def sessions(self, ids: list[int], new: int, sessions: int) -> float:
        """`sessions` sessions, each prefilled on its own, then decoding together: one batched step per token for
        all of them, as the node's scheduler batches concurrent sessions' steps; aggregate tokens/s."""
        caches = [self.stack.new_session_cache(0, self.blocks, 1, len(ids) + new + 1) for _ in range(sessions)]
        tokens = []
        for cache in caches:
            tokens.append(int(self._logits(cache, torch.tensor([ids]), 0)[0, -1].argmax()))
        began = time.perf_counter()
        for step in range(new):
            positions = torch.full((sessions, 1), len(ids) + step)
            mask = torch.ones(sessions, 1, dtype=torch.bool)
            logits = self.ends.logits(
                lambda hidden, p=positions, m=mask: self.stack.step(caches, 0, self.blocks, hidden, p, m),
                input_ids=torch.tensor(tokens)[:, None], position_ids=positions, logits_to_keep=1)
            tokens = logits[:, -1].argmax(dim=-1).tolist()
        return sessions * new / (time.perf_counter() - began)

    def prefill(self, ids: list[int]) -> float:
        cache = self.stack.new_session_cache(0, self.blocks, 1, len(ids))
        began = time.perf_counter()
        self._logits(cache, torch.tensor([ids]), 0)
        return len(ids) / (time.perf_counter() - began)


def gguf_bytes_per_token(path: Path) -> int:
    """Bytes a decode step reads from a GGUF file: every tensor but the token embeddings (one row of them)."""
    sys.path.insert(0, str(path.parent.parent / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" /
                           "llama.cpp" / "gguf-py"))
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight")


def read_bandwidth(threads: int, size: int = 2**30, repeats: int = 5) -> float:
    """Bytes read per second by the best of `repeats` sums of a `size`-byte float32 tensor on `threads` threads:
    what a decode step does with the weights (a copy, as `bench_generate` times, also writes, and reads at
    about half this rate on the machines measured)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones(size // 4)
        data.sum()
        best = float("inf")
        for _ in range(repeats):
            began = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - began)
        return size / best
    finally:
        torch.set_num_threads(previous)


# --- the run --------------------------------------------------------------------------------------------------
def ensure_model(model: Path) -> None:
    if (model / "config.json").exists():
        return
    if model != DEFAULT_MODEL:
        raise SystemExit(f"{model} holds no checkpoint (config.json); write one with make_random_checkpoint.py")
    import make_random_checkpoint

    log(f"writing the random 1B Llama checkpoint into {model}")
    make_random_checkpoint.make_random_checkpoint(make_random_checkpoint.SHAPES["1b"], model)


def random_ids(count: int, vocab: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count,), generator=generator).tolist()


def measure_model(args, model: Path, *, decode_only: bool) -> dict:
    from swarmnode.runtime.checkpoint import Checkpoint

    vocab = Checkpoint(str(model)).config.vocab_size
    prompt = random_ids(args.prompt_tokens, vocab, 1)
    long_prompt = random_ids(args.prefill_tokens, vocab, 2)
    context = max(args.prefill_tokens, args.prompt_tokens + args.new_tokens) + 8
    rounds = 1 if decode_only else args.rounds
    sides: dict[str, tuple[NodeRuntime, NodeRuntime, LlamaCpp]] = {}
    times: dict[str, dict[str, list[float]]] = {}
    rows = {}
    try:
        for precision in args.precisions:
            quantization, kind = PRECISIONS[precision]
            path = gguf_file(args.env, model, kind)
            if decode_only:
                times[precision] = {f"{side}_decode": [] for side in SIDES}
                rows[precision] = decode_once(args, model, path, precision, prompt, context, times[precision])
                continue
            log(f"loading {model.name} as {quantization} (this project) and {kind} (llama.cpp)")
            ours = NodeRuntime(model, quantization, checkpoint_dtype(quantization))
            on_gguf = NodeRuntime(path, "gguf", torch.float32)
            theirs = LlamaCpp(args.env, path, args.threads, context, args.prefill_tokens)
            sides[precision] = (ours, on_gguf, theirs)
            times[precision] = {f"{side}_{what}": [] for what in ("decode", "prefill", "sessions")
                                for side in SIDES}
            rows[precision] = {"gguf": kind.upper(), "quantize": quantization,
                               "ours_bytes_per_token": ours.weight_bytes + ours.head_bytes,
                               "gguf_bytes_per_token": on_gguf.weight_bytes + on_gguf.head_bytes,
                               "llamacpp_bytes_per_token": gguf_bytes_per_token(path)}
        for number in range(rounds if not decode_only else 0):
            log(f"round {number + 1} of {rounds}")
            for precision, runtimes in sides.items():
                measure_round(precision, runtimes, times[precision], prompt, long_prompt, args, decode_only)
    finally:
        for *_ours, theirs in sides.values():
            theirs.close()
    for precision, row in rows.items():
        for key, values in times[precision].items():
            if values:
                row[key + "_tps"] = round(statistics.median(values), 2)
        for side, prefix in (("ours", ""), ("gguf", "gguf_")):  # each of this project's sides over llama.cpp
            row[f"{prefix}decode_ratio"] = round(row[f"{side}_decode_tps"] / row["llamacpp_decode_tps"], 3)
            if not decode_only:
                row[f"{prefix}prefill_ratio"] = round(row[f"{side}_prefill_tps"] / row["llamacpp_prefill_tps"], 3)
            if f"{side}_sessions_tps" in row:
                row[f"{prefix}sessions_ratio"] = round(row[f"{side}_sessions_tps"] / row["llamacpp_sessions_tps"], 3)
        if "ours_sessions_tps" in row:
            row["sessions"] = args.sessions
            for side in SIDES:  # aggregate over the single session's rate
                row[f"{side}_sessions_gain"] = round(row[f"{side}_sessions_tps"] / row[f"{side}_decode_tps"], 2)
    return rows


def decode_once(args, model: Path, path: Path, precision: str, prompt: list[int], context: int,
                times: dict[str, list[float]]) -> dict:
    """The decode row of a decode-only model (the 8B shape), measured once: the sides one after the other, each
    freed before the next loads (three copies of an 8B model do not fit the memory of a machine that holds one)."""
    import gc

    quantization, kind = PRECISIONS[precision]
    row = {"gguf": kind.upper(), "quantize": quantization, "llamacpp_bytes_per_token": gguf_bytes_per_token(path)}
    makers = {"ours": lambda: NodeRuntime(model, quantization, checkpoint_dtype(quantization)),
              "gguf": lambda: NodeRuntime(path, "gguf", torch.float32),
              "llamacpp": lambda: LlamaCpp(args.env, path, args.threads, context, args.prefill_tokens)}
    for side in SIDES:
        log(f"loading {model.name} for {side} ({quantization if side == 'ours' else kind})")
        runtime = makers[side]()
        try:
            if isinstance(runtime, NodeRuntime):
                row[f"{side}_bytes_per_token"] = runtime.weight_bytes + runtime.head_bytes
            times[f"{side}_decode"].append(runtime.decode(prompt, args.new_tokens))
            log(f"  {precision}-bit {side} decode {times[f'{side}_decode'][-1]:.2f} tok/s")
        finally:
            if isinstance(runtime, LlamaCpp):
                runtime.close()
            del runtime
            gc.collect()
    return row


def measure_round(precision, runtimes, times, prompt, long_prompt, args, decode_only) -> None:
    """One round of every measurement, the sides in turn (`SIDES` order) for each."""
    for side, runtime in zip(SIDES, runtimes):
        times[f"{side}_decode"].append(runtime.decode(prompt, args.new_tokens))
    if not decode_only:
        for side, runtime in zip(SIDES, runtimes):
            times[f"{side}_prefill"].append(runtime.prefill(long_prompt))
        if args.sessions > 1:
            new = max(8, args.new_tokens // 4)
            for side, runtime in zip(SIDES, runtimes):
                times[f"{side}_sessions"].append(runtime.sessions(prompt, new, args.sessions))
    log(f"  {precision}-bit: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in times.items() if v))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--decode-only-model", type=Path, default=None)
    parser.add_argument("--env", type=Path, default=DEFAULT_ENV)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precisions", default="16,8,4,4k")
    parser.add_argument("--ours-quantize", default=None,
                        help="this project's --quantize per precision, comma-separated (default: none,q8_0,q4_0,q4_1)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--sessions", type=int, default=8, help="concurrent sessions decoding together (1: skip)")
    args = parser.parse_args()
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [p for p in args.precisions if p not in PRECISIONS]
    if unknown or not args.precisions:
        parser.error(f"--precisions takes a comma-separated subset of {', '.join(PRECISIONS)}; got {unknown or 'none'}")
    if args.ours_quantize:
        modes = [m.strip() for m in args.ours_quantize.split(",")]
        if len(modes) != len(args.precisions):
            parser.error("--ours-quantize takes one mode per precision of --precisions")
        for precision, mode in zip(args.precisions, modes):
            PRECISIONS[precision] = (mode, PRECISIONS[precision][1])
    if args.rounds < 1 or args.threads < 1 or min(args.prompt_tokens, args.new_tokens, args.prefill_tokens) < 1:
        parser.error("--rounds, --threads and the token counts must be at least 1")
    if shutil.which("cmake") is None and not _works(args.env):
        parser.error("building llama-cpp-python needs cmake and a C++ compiler on PATH")
    torch.set_num_threads(args.threads)

    began = time.monotonic()
    ensure_llamacpp(args.env)
    ensure_model(args.model)
    bandwidth = read_bandwidth(args.threads)
    log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    result = {"benchmark": "cpu_runtime", "threads": args.threads, "llama_cpp_python": LLAMA_CPP_PYTHON,
              "llama_cpp_commit": "0c1e570", "torch": torch.__version__, "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "prefill_tokens": args.prefill_tokens, "rounds": args.rounds,
              "models": {}}
    models = [(args.model, False)] + ([(args.decode_only_model, True)] if args.decode_only_model else [])
    for model, decode_only in models:
        ensure_model(model)
        rows = measure_model(args, model, decode_only=decode_only)
        bandwidth = max(bandwidth, read_bandwidth(args.threads))
        result["models"][model.name] = rows
    result["read_bandwidth_gbs"] = round(bandwidth / 1e9, 2)
    for rows in result["models"].values():
        for row in rows.values():
            for side in SIDES:
                ceiling = bandwidth / row[f"{side}_bytes_per_token"]
                row[f"{side}_decode_of_ceiling"] = round(row[f"{side}_decode_tps"] / ceiling, 3)
    result["seconds"] = round(time.monotonic() - began, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
