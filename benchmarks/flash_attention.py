"""FlashAttention benchmark: the Triton kernel of ``llmbook.kernels.flash_attention`` against its baselines.

Protocol (one run, every baseline measured in the same process on the same inputs):

* shapes ``(B, H, T, D)`` with ``H * D = 2048`` and ``B * T = 16384`` tokens; ``T`` from 512 to 16k;
  ``D`` 64 and 128; float16 and bfloat16; causal and non-causal; forward, and forward + backward;
* providers: ours (Triton, autotuned), naive PyTorch (the full score matrix), the tiled PyTorch version
  (``llmbook.lm.flash.tiled_attention``), and ``F.scaled_dot_product_attention`` with each backend pinned
  through ``torch.nn.attention.sdpa_kernel`` (FLASH, EFFICIENT, CUDNN where available, MATH);
* time: the median of ``triton.testing.do_bench``; throughput ``4 B H T^2 D`` FLOPs for the forward, half
  that when causal, and 2.5 times the forward for the backward (so 3.5 times for forward + backward);
* memory: the peak of ``torch.cuda.max_memory_allocated`` above the inputs during one call;
* the CUDA kernels that ran are recorded from the profiler once per provider, dtype and head size, with
  the block sizes the autotuner chose for ours;
* configurations that would run out of memory or take too long (naive attention and SDPA's MATH backend at
  16k, the tiled PyTorch loop beyond 2k, anything once the time budget is spent) are skipped and the JSON
  says why.

Results go to ``benchmarks/results/flash_attention.json`` and ``flash_attention.png`` with the GPU name and
the date. The targets checked at the end (bfloat16, ``D = 128``, ``T >= 4096``): forward at least 1.1x SDPA's
FLASH backend and 0.8x the fastest SDPA backend; forward + backward at least 1.0x FLASH.

Usage::

    python benchmarks/flash_attention.py                 # the full protocol, about 3 minutes on an H200
    python benchmarks/flash_attention.py --quick         # bfloat16, D = 128, T in {1k, 4k, 16k}
    python benchmarks/flash_attention.py --cpu-smoke     # tiny shapes on the CPU (Triton interpreter): checks
                                                         # the script itself; writes to a temporary folder
    python benchmarks/flash_attention.py --compile-report  # no GPU: compile every autotuning candidate for
                                                           # sm_90 and print shared memory, registers, spills

Without CUDA (and without ``--cpu-smoke``) it prints why nothing was measured and exits with status 0.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing llmbook
    sys.path.insert(0, str(ROOT))

HD = 2048  # H * D
TOKENS = 16384  # B * T
SEQ_LENS = [512, 1024, 2048, 4096, 8192, 16384]
HEAD_DIMS = [128, 64]
DTYPES = ["bfloat16", "float16"]
MODES = ["fwd", "fwd+bwd"]
WARMUP_MS, REP_MS = 10, 40  # do_bench: enough repetitions for a stable median, short enough for the budget
NAIVE_MAX_T = 8192  # naive attention and SDPA MATH materialise B*H*T^2 scores: skipped at 16k
TILED_MAX_T = 2048  # the tiled PyTorch version is a Python loop over (T/128)^2 tiles
TILED_BLOCK = 128
SDPA_BACKENDS = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]
PROVIDERS = ["ours"] + [f"sdpa_{b.split('_')[0].lower()}" for b in SDPA_BACKENDS] + ["naive", "tiled"]
TARGETS = [  # (mode, baseline, minimum ratio ours / baseline) at bfloat16, D = 128, T >= 4096
    ("fwd", "sdpa_flash", 1.1),
    ("fwd", "best_sdpa", 0.8),
    ("fwd+bwd", "sdpa_flash", 1.0),
]


def flops(B, H, T, D, causal, mode):
    fwd = 4 * B * H * T * T * D * (0.5 if causal else 1.0)
    return fwd * (3.5 if mode == "fwd+bwd" else 1.0)


def _precompile_task(task):
    """Worker process: compile the autotuning candidates of some kernels (fills Triton's disk cache)."""
    kinds, dtype_name, D, causal, H = task
    import torch

    from llmbook.kernels import flash_attention as fa

    t0 = time.perf_counter()
    fa._precompile(kinds, getattr(torch, dtype_name), D, causal, H)
    return time.perf_counter() - t0


def precompile(dtypes, head_dims, log):
    """Compile every candidate of every kernel in parallel processes before autotuning needs them."""
    tasks = [(kinds, dtype, D, causal, HD // D) for dtype in dtypes for D in head_dims for causal in (False, True)
             for kinds in (("fwd",), ("pre", "dkdv"), ("dq",))]
    workers = max(1, min(len(tasks), (os.cpu_count() or 2) - 1))
    t0 = time.perf_counter()
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
            per_task = list(pool.map(_precompile_task, tasks))
        log(f"precompiled {len(tasks)} kernel groups in {time.perf_counter() - t0:.1f}s on {workers} processes "
            f"(slowest group {max(per_task):.1f}s)")
        return {"ok": True, "seconds": time.perf_counter() - t0, "workers": workers, "groups": len(tasks)}
    except Exception as err:  # autotuning then compiles serially: slower, still correct
        log(f"parallel precompile failed ({type(err).__name__}: {err}); kernels compile during autotuning")
        return {"ok": False, "seconds": time.perf_counter() - t0, "error": f"{type(err).__name__}: {err}"}


class Runner:
    """Everything that differs between the GPU run and the CPU smoke run."""

    def __init__(self, smoke: bool):
        import torch

        self.torch = torch
        self.smoke = smoke
        self.device = "cpu" if smoke else "cuda"
        if not smoke:
            import triton.testing

            self.do_bench = triton.testing.do_bench

    def sync(self):
        if not self.smoke:
            self.torch.cuda.synchronize()

    def time_ms(self, fn, grad_to_none):
        if self.smoke:
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return sorted(times)[1]
        return self.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, grad_to_none=grad_to_none, return_mode="median")

    def peak_bytes(self, fn):
        if self.smoke:
            return None
        torch = self.torch
        self.sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        self.sync()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        return int(peak)

    def kernels_that_ran(self, fn, top=4):
        """Names of the device kernels one call launches, by total time (the backend that really ran)."""
        if self.smoke:
            return []
        from torch.profiler import ProfilerActivity, profile

        self.sync()
        try:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                self.sync()
            stats = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
        except Exception as err:  # the profiler is evidence, not a requirement
            return [f"profiler failed: {type(err).__name__}: {err}"]
        stats.sort(key=lambda e: -e.self_device_time_total)
        return [e.key[:120] for e in stats[:top]]


def make_providers(runner, fa, tiled_attention, smoke):
    """name -> attention(q, k, v, causal) -> o, plus the SDPA backends this torch knows."""
    torch = runner.torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    blocks = dict(block_m=16, block_n=16) if smoke else {}

    def ours(q, k, v, causal):
        return fa.flash_attention_triton(q, k, v, causal=causal, **blocks)

    def naive(q, k, v, causal):
        s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        if causal:
            T_q, T_k = s.shape[-2:]
            mask = torch.ones(T_q, T_k, dtype=torch.bool, device=q.device).triu(T_k - T_q + 1)
            s = s.masked_fill(mask, float("-inf"))
        return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v

    def tiled(q, k, v, causal):
        b = 16 if smoke else TILED_BLOCK
        return tiled_attention(q, k, v, causal=causal, block_q=b, block_k=b)

    providers = {"ours": ours}
    for name in SDPA_BACKENDS:
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue

        def sdpa(q, k, v, causal, _backend=backend):
            with sdpa_kernel([_backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        providers[f"sdpa_{name.split('_')[0].lower()}"] = sdpa
    providers["naive"] = naive
    providers["tiled"] = tiled
    return providers


def make_call(torch, attend, q, k, v, do, causal, train):
    """The timed call: a forward without autograd, or a forward and a backward."""
    if train:
        def call():
            attend(q, k, v, causal).backward(do)
    else:
        def call():
            with torch.no_grad():
                return attend(q, k, v, causal)
    return call


def skip_reason(provider, T, B, H, D, dtype_bytes, mode, total_mem, smoke):
    scores = B * H * T * T
    if provider in ("naive", "sdpa_math"):
        if not smoke and T > NAIVE_MAX_T:
            return f"skipped: materialises B*H*T^2 = {scores:.3g} scores; too slow and too large at T = {T}"
        need = scores * (dtype_bytes + 4 + dtype_bytes) * (3 if mode == "fwd+bwd" else 1)
        if total_mem and need > 0.6 * total_mem:
            return f"skipped: would need about {need / 2**30:.0f} GiB of the {total_mem / 2**30:.0f} GiB (OOM)"
    if provider == "tiled" and not smoke and T > TILED_MAX_T:
        return f"skipped: Python loop over {math.ceil(T / TILED_BLOCK) ** 2} tiles per head; too slow at T = {T}"
    return None


def configurations(args):
    if args.cpu_smoke:
        return [("float32", 16, causal, T, mode) for causal in (False, True) for mode in MODES for T in (32, 64)]
    dtypes, dims, lens = DTYPES, HEAD_DIMS, SEQ_LENS
    if args.quick:
        dtypes, dims, lens = ["bfloat16"], [128], [1024, 4096, 16384]
    # the configurations the targets are judged on come first, so a spent budget cannot drop them
    return [(dtype, D, causal, T, mode) for dtype in dtypes for D in dims for causal in (False, True)
            for mode in MODES for T in lens]


def measure(args):
    smoke = args.cpu_smoke
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    import torch

    if not smoke and not torch.cuda.is_available():
        print("flash_attention benchmark: no CUDA device here, nothing measured. It needs an NVIDIA GPU "
              "(or --cpu-smoke to check the script on the CPU).")
        return None
    try:
        import triton
    except ImportError:
        print("flash_attention benchmark: triton is not installed, nothing measured (pip install triton).")
        return None
    from tqdm import tqdm

    from llmbook.kernels import flash_attention as fa
    from llmbook.lm.flash import tiled_attention

    t_start = time.perf_counter()
    runner = Runner(smoke)
    log = tqdm.write
    warnings.filterwarnings("ignore", category=UserWarning)  # SDPA explains at length why a backend refuses
    gpu = "cpu (smoke test)" if smoke else torch.cuda.get_device_name()
    total_mem = None if smoke else torch.cuda.get_device_properties(0).total_memory
    meta = {
        "benchmark": "flash_attention",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "capability": None if smoke else ".".join(map(str, torch.cuda.get_device_capability())),
        "gpu_memory_bytes": total_mem,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": None if smoke else torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "protocol": {
            "shapes": "(B, H, T, D) with H*D = 2048 and B*T = 16384",
            "timing": f"triton.testing.do_bench median, warmup {WARMUP_MS} ms, rep {REP_MS} ms",
            "flops": "4*B*H*T^2*D forward, x0.5 causal, backward 2.5x forward (fwd+bwd = 3.5x)",
            "memory": "torch.cuda.max_memory_allocated above the inputs during one call",
            "tiled_block": TILED_BLOCK,
            "time_budget_s": args.budget_s,
        },
    }
    log(f"GPU {gpu}, torch {torch.__version__}, triton {triton.__version__}")
    configs = configurations(args)
    if not smoke and not args.no_precompile:
        meta["precompile"] = precompile(sorted({c[0] for c in configs}), sorted({c[1] for c in configs}), log)
    providers = make_providers(runner, fa, tiled_attention, smoke)
    results, profiled, ours_cfg = [], set(), {}
    gen = torch.Generator(device=runner.device).manual_seed(0)
    bar = tqdm(configs, desc="flash attention", unit="config", dynamic_ncols=True)
    for dtype_name, D, causal, T, mode in bar:
        dtype = getattr(torch, dtype_name)
        H = (HD // D) if not smoke else 2
        B = max(1, (TOKENS if not smoke else 128) // T)
        bar.set_postfix_str(f"{dtype_name} D={D} T={T} {'causal' if causal else 'full'} {mode}")
        shape = (B, H, T, D)
        q, k, v, do = (torch.randn(shape, device=runner.device, dtype=dtype, generator=gen) for _ in range(4))
        train = mode == "fwd+bwd"
        for x in (q, k, v):
            x.requires_grad_(train)
        reference = None
        for name, attend in providers.items():
            row = dict(dtype=dtype_name, D=D, H=H, B=B, T=T, causal=causal, mode=mode, provider=name)
            results.append(row)
            reason = skip_reason(name, T, B, H, D, q.element_size(), mode, total_mem, smoke)
            if reason is None and time.perf_counter() - t_start > args.budget_s:
                reason = f"skipped: time budget of {args.budget_s:.0f}s spent"
            if reason:
                row.update(status="skipped", reason=reason)
                continue

            fn = make_call(torch, attend, q, k, v, do, causal, train)
            try:
                out = fn()  # compiles and autotunes outside every measurement
                if not train:  # agreement with our kernel's output, which is computed first
                    if name == "ours":
                        reference = out.float()
                    elif reference is not None:
                        row["max_abs_diff_vs_ours"] = float((out.float() - reference).abs().max())
                del out
                for x in (q, k, v):
                    x.grad = None
                row["peak_bytes"] = runner.peak_bytes(fn)
                for x in (q, k, v):
                    x.grad = None
                ms = runner.time_ms(fn, [q, k, v] if train else None)
                row.update(status="ok", ms=ms, tflops=flops(B, H, T, D, causal, mode) / (ms * 1e-3) / 1e12)
                if name == "ours" and not smoke:
                    tuned = fa._kernels().TUNED
                    kinds = ("fwd", "dkdv", "dq") if train else ("fwd",)
                    row["ours_config"] = {kind: str(tuned[kind].best_config) for kind in kinds}
                    ours_cfg[(dtype_name, D, causal, T)] = row["ours_config"]
                key = (name, dtype_name, D, mode)
                if key not in profiled:
                    profiled.add(key)
                    row["kernels"] = runner.kernels_that_ran(fn)
            except torch.OutOfMemoryError:
                row.update(status="skipped", reason="skipped: out of memory")
            except Exception as err:  # a backend that cannot run this shape, dtype or GPU
                row.update(status="error", reason=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
                if args.verbose:
                    log(traceback.format_exc())
            finally:
                for x in (q, k, v):
                    x.grad = None
                if not smoke:
                    torch.cuda.empty_cache()
            if row["status"] == "ok":
                log(f"{dtype_name:8s} D={D:3d} T={T:5d} {'causal' if causal else 'full  '} {mode:7s} {name:15s} "
                    f"{row['ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s")
            else:
                log(f"{dtype_name:8s} D={D:3d} T={T:5d} {'causal' if causal else 'full  '} {mode:7s} {name:15s} "
                    f"{row['reason']}")
        del q, k, v, do
    meta["elapsed_s"] = time.perf_counter() - t_start
    return meta, results


def judge_targets(results):
    """Ratios of ours to the baselines at bfloat16, D = 128, T >= 4096, and whether each target holds."""
    ok = {(r["dtype"], r["D"], r["T"], r["causal"], r["mode"], r["provider"]): r["tflops"]
          for r in results if r.get("status") == "ok"}
    verdicts = []
    for mode, baseline, need in TARGETS:
        for T in (t for t in SEQ_LENS if t >= 4096):
            for causal in (False, True):
                ours = ok.get(("bfloat16", 128, T, causal, mode, "ours"))
                if baseline == "best_sdpa":
                    sdpa = {p: ok.get(("bfloat16", 128, T, causal, mode, p)) for p in PROVIDERS if p.startswith("sdpa")}
                    sdpa = {p: t for p, t in sdpa.items() if t}
                    name, base = max(sdpa.items(), key=lambda kv: kv[1]) if sdpa else (None, None)
                else:
                    name, base = baseline, ok.get(("bfloat16", 128, T, causal, mode, baseline))
                ratio = ours / base if ours and base else None
                verdicts.append(dict(mode=mode, T=T, causal=causal, baseline=name or baseline, required=need,
                                     ratio=ratio, met=None if ratio is None else ratio >= need))
    return verdicts


def plot(results, meta, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtype = "bfloat16" if any(r["dtype"] == "bfloat16" for r in results) else results[0]["dtype"]
    dims = sorted({r["D"] for r in results})
    panels = [(D, causal) for D in dims for causal in (False, True)]
    fig, axes = plt.subplots(len(MODES), len(panels), figsize=(4.2 * len(panels), 7), sharex=True, squeeze=False)
    colors = {p: plt.cm.tab10(i) for i, p in enumerate(PROVIDERS)}
    styles = {p: dict(color=colors[p], lw=1.2, marker=".") for p in PROVIDERS}
    styles["ours"] = dict(color="black", lw=2.5, marker="o")
    legend = {}
    for row_i, mode in enumerate(MODES):
        for col_i, (D, causal) in enumerate(panels):
            ax = axes[row_i][col_i]
            for provider in PROVIDERS:
                pts = sorted((r["T"], r["tflops"]) for r in results
                             if r["provider"] == provider and r["dtype"] == dtype and r["D"] == D
                             and r["causal"] == causal and r["mode"] == mode and r.get("status") == "ok")
                if pts:
                    (legend[provider],) = ax.plot(*zip(*pts, strict=True), label=provider, **styles[provider])
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode}, D = {D}, {'causal' if causal else 'non-causal'}", fontsize=10)
            ax.grid(alpha=0.3)
            if col_i == 0:
                ax.set_ylabel("TFLOP/s")
            if row_i == len(MODES) - 1:
                ax.set_xlabel("sequence length T")
    order = [p for p in PROVIDERS if p in legend]
    fig.legend([legend[p] for p in order], order, loc="lower center", ncol=max(1, len(order)), frameon=False)
    fig.suptitle(f"FlashAttention ({dtype}, H*D = {HD}, B*T = {TOKENS}) on {meta['gpu']}, {meta['date'][:10]}")
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compile_report(arch: int = 90) -> int:
    """Compile every autotuning candidate for ``sm_<arch>`` here, without a GPU, and print its resources.

    Triton's front end, the NVIDIA back end and ``ptxas`` all run on the CPU; ``cuobjdump`` then reads the
    registers and the stack (spills) of each binary. This is how ``TUNING`` in the kernel module was chosen.
    """
    import re
    import subprocess
    import tempfile

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from llmbook.kernels import flash_attention as fa

    fak = fa._kernels()  # the @triton.jit kernels (this needs TRITON_INTERPRET unset)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    bodies = {kind: fak.KERNELS[kind] for kind in ("fwd", "dkdv", "dq")}
    types = {"LSE": "*fp32", "DELTA": "*fp32", "qk_scale": "fp32", "sm_scale": "fp32", "H": "i32", "Tq": "i32",
             "Tk": "i32", "TQ_BUCKET": "i32", "TK_BUCKET": "i32"}
    print(f"sm_{arch}: kernel dtype D causal (BLOCK_M, BLOCK_N, warps, stages): shared bytes, registers, stack")
    failures = 0
    for kind, jit in bodies.items():
        for dtype, tt, D, cls in (("bfloat16", "bf16", 64, 64), ("bfloat16", "bf16", 128, 128),
                                  ("float32", "fp32", 64, "fp32")):
            for causal in (False, True):
                meta = fa._meta(torch.empty(0, D, dtype=getattr(torch, dtype)), causal)
                for bm, bn, warps, stages in fak.TUNING[kind][cls]:
                    consts = {**meta, "GROUP": 1, "BLOCK_M": bm, "BLOCK_N": bn}
                    sig = {a: ("constexpr" if a in consts else types.get(a, f"*{tt}")) for a in jit.arg_names}
                    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(jit.arg_names)
                             if sig[a].startswith("*") or sig[a] == "i32"}
                    mask = "causal" if causal else "full  "
                    label = f"{kind:5s} {dtype:8s} D={D:3d} {mask} {(bm, bn, warps, stages)}"
                    try:
                        kernel = triton.compile(ASTSource(jit, sig, constexprs=consts, attrs=attrs),
                                                target=GPUTarget("cuda", arch, 32),
                                                options={"num_warps": warps, "num_stages": stages})
                        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                            f.write(kernel.asm["cubin"])
                            f.flush()
                            usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name],
                                                   capture_output=True, text=True).stdout
                        regs = re.search(r"REG:(\d+)", usage)
                        stack = re.search(r"STACK:(\d+)", usage)
                        print(f"{label}: {kernel.metadata.shared:6d} B, {regs.group(1) if regs else '?'} regs, "
                              f"stack {stack.group(1) if stack else '?'} B", flush=True)
                    except Exception as err:
                        failures += 1
                        print(f"{label}: FAILED {type(err).__name__}: {str(err)[:500]}", flush=True)
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="bfloat16, D = 128, three lengths only")
    parser.add_argument("--budget-s", type=float, default=450.0, help="stop measuring after this many seconds")
    parser.add_argument("--out-dir", type=Path, default=None, help="default benchmarks/results (smoke: a temp dir)")
    parser.add_argument("--no-precompile", action="store_true", help="compile serially during autotuning")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, to check the script")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failing providers")
    parser.add_argument("--compile-report", type=int, nargs="?", const=90, metavar="SM",
                        help="no GPU needed: compile every autotuning candidate for sm_SM (default 90) and print "
                             "shared memory, registers and spill stack of each")
    args = parser.parse_args(argv)
    if args.compile_report is not None:
        return compile_report(args.compile_report)

    measured = measure(args)
    if measured is None:
        return 0
    meta, results = measured
    verdicts = judge_targets(results)
    skipped = [f"{r['provider']} {r['dtype']} D={r['D']} T={r['T']} {'causal' if r['causal'] else 'full'} "
               f"{r['mode']}: {r['reason']}" for r in results if r.get("status") != "ok"]
    out_dir = args.out_dir or (Path(tempfile.mkdtemp()) if args.cpu_smoke else ROOT / "benchmarks" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {**meta, "targets": verdicts, "not_measured": skipped, "results": results}
    json_path = out_dir / "flash_attention.json"
    json_path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    png_path = out_dir / "flash_attention.png"
    plot(results, meta, png_path)

    print(f"\n{meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  ({meta['elapsed_s']:.0f}s)")
    for v in verdicts:
        ratio = "n/a" if v["ratio"] is None else f"{v['ratio']:.2f}x"
        verdict = {True: "met", False: "MISSED", None: "not measured"}[v["met"]]
        print(f"  target {v['mode']:7s} T={v['T']:5d} {'causal' if v['causal'] else 'full  '} "
              f"ours / {v['baseline']}: {ratio} (need {v['required']}x) {verdict}")
    print(f"{len(skipped)} provider-configurations not measured (reasons in the JSON)")
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
