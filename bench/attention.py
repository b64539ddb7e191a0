"""Attention-layer benchmarks: speed and peak memory of every quest formulation.

What it measures
  a. One training step (forward + backward of ``output.sum()``) of ViT-Ti/16 at 224 px, batch 8, on the CPU, for
     every registered formulation (``quest.models.create_model(..., attention=name)``) and for timm's stock fused
     ``Attention`` (plain ``timm.create_model``), all in this one process. Then one of its attention layers alone
     (a2), whose steps are short enough for many rounds: the formulation's own overhead, with less noise.
  b. A single attention layer (dim 192, 3 heads) at 1,024 and 4,096 tokens: QUEST written out with an explicit
     N x N logit matrix, softmax and ``@ v`` against the fused layer ``get_attention("quest")`` (same weights).
  c. With a GPU only: part a in bf16 autocast on the GPU, and which SDPA backends each formulation can use.
  d. torch.compile (trainer.compile=true): part a with every model compiled, against compiled timm, interleaved;
     per formulation the graph breaks (torch._dynamo.explain) and whether later steps recompile.
  e. Part a's step of each formulation with its transformed q', k' recomputed in the backward (quest.attention.
     recompute, the default) and kept for backward (as before), interleaved in one process: time and peak memory.

How
  Time: after warm-up steps, the variants run round-robin (the starting variant rotates every round), one timed
  step per variant per round, so machine load hits all of them alike. Reported: the median step time, and the
  median over rounds of the per-round ratio to the baseline (a paired ratio, robust to load drifting between
  rounds). Peak memory: one extra, untimed step under ``torch.profiler`` with ``profile_memory=True``; the
  allocations and frees PyTorch's CPU allocator reports during the step are replayed in order (frees matched to
  allocations by address) and the maximum of the running sum is the peak: the most bytes held at once by tensors
  allocated in the step (activations saved for backward, the new gradients, kernel workspaces), not memory that
  existed before it (weights, input, the last step's gradients), allocator caches or the process's RSS. On a GPU,
  ``torch.cuda.max_memory_allocated`` above the bytes allocated at the start of the step is used. The same profiled
  step records which ATen SDPA kernel ran.

Usage: ``python bench/attention.py [--threads 1] [--repeats 25] [--quick] [--skip a b c]`` (``--help`` lists all).
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Iterator

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # keep the profiler's own log lines out of the output
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing quest

import timm  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from timm.layers import Attention as TimmAttention  # noqa: E402
from torch._C._profiler import _EventType  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from quest.attention import get_attention, list_attentions  # noqa: E402
from quest.models import create_model  # noqa: E402

MODEL, BASELINE = "vit_tiny_patch16_224", "timm stock"
Step = Callable[[], None]


# --- measurement ---------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_times(steps: dict[str, Step], rounds: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds per step of each variant, measured round-robin; the first variant of a round rotates."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        print(f"  round {r + 1}/{rounds}", end="\r", file=sys.stderr, flush=True)
        gc.collect()
        for name in names[r % len(names):] + names[: r % len(names)]:
            _sync(device)
            t0 = time.perf_counter()
            steps[name]()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


@contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2: the profiler's C++ side prints start/stop lines there on every run."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def allocation_events(prof: profile) -> list[tuple[int, int, int]]:
    """(time ns, address, size) of every allocator event of a profile, in time order (size < 0: a free)."""
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size))
    return sorted(events)


def _peak_of_new_allocations(prof: profile) -> int:
    """Replay the allocator events of a profile in time order: the most bytes live at once among blocks allocated
    inside it. Frees are matched to allocations by address, so the free of a block that existed before the
    profile (last step's gradients) is ignored; the allocator's own size table can be stale for those."""
    live: dict[int, int] = {}
    current = peak = 0
    for _, ptr, size in allocation_events(prof):
        if size > 0:
            live[ptr] = size
            current += size
        elif ptr in live:
            current -= live.pop(ptr)
        peak = max(peak, current)
    return peak


def profiled_step(step: Step, device: torch.device) -> tuple[float, str]:
    """(peak MiB held at once by tensors allocated during ``step``, the SDPA kernels it ran)."""
    gc.collect()
    _sync(device)
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    with warnings.catch_warnings(), quiet_stderr():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=device.type == "cpu") as prof:
            step()
            _sync(device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        peak = _peak_of_new_allocations(prof)
    kernels = sorted({e.key.removeprefix("aten::") for e in prof.key_averages()
                      if e.key.startswith("aten::_scaled_dot_product") and not e.key.endswith("_backward")})
    return peak / 2**20, ", ".join(kernels) or "none (explicit)"


def report(title: str, steps: dict[str, Step], baseline: str, rounds: int, warmup: int,
           device: torch.device) -> dict[str, list[float]]:
    """Warm up, profile one step of each variant, time them interleaved; print one table against ``baseline``;
    return the step times."""
    print(f"\n## {title}\n")
    for step in steps.values():
        for _ in range(warmup):
            step()
    memory = {name: profiled_step(step, device) for name, step in steps.items()}
    times = interleaved_times(steps, rounds, device)
    rows = [["variant", "median ms", "p25-p75 ms", "min ms", "x base (paired)", "x base (medians)", "peak MiB",
             "SDPA kernel"]]
    base_med = statistics.median(times[baseline])
    for name, ts in times.items():
        q1, _, q3 = statistics.quantiles(ts, n=4, method="inclusive") if len(ts) > 1 else (ts[0],) * 3
        paired = statistics.median(t / b for t, b in zip(ts, times[baseline]))
        med = statistics.median(ts)
        rows.append([name, f"{med * 1e3:.1f}", f"{q1 * 1e3:.0f}-{q3 * 1e3:.0f}", f"{min(ts) * 1e3:.1f}",
                     f"{paired:.3f}", f"{med / base_med:.3f}", f"{memory[name][0]:.1f}", memory[name][1]])
    print_markdown(rows)
    print(f"\n{rounds} rounds after {warmup} warm-up steps per variant; baseline: {baseline}; "
          f"load average now {os.getloadavg()[0]:.2f}.")
    return times


def print_markdown(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    print(fmt(rows[0]))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows[1:]:
        print(fmt(r))


def train_step(model: nn.Module, x: torch.Tensor, amp: torch.dtype | None = None) -> Step:
    """A closure running forward + backward of ``model(x).sum()`` (gradients dropped first, as an optimizer would)."""
    ctx = (lambda: torch.autocast(x.device.type, dtype=amp)) if amp else nullcontext

    def step() -> None:
        model.zero_grad(set_to_none=True)
        x.grad = None
        with ctx():
            out = model(x)
        out.float().sum().backward()

    return step


def compile_check(batch: int) -> dict[str, Step]:
    """Compiled training steps of every formulation and of stock timm; prints graph breaks and recompiles."""
    import torch._dynamo as dynamo

    x = torch.randn(batch, 3, 224, 224)
    models: dict[str, nn.Module] = {BASELINE: timm.create_model(MODEL)}
    models.update({name: create_model(MODEL, attention=name) for name in list_attentions()})
    # Every variant is a compiled entry of the same code objects (timm's forward, guarded on the attention's type):
    # past dynamo's recompile limit (8) the later variants would silently run eagerly. One model per process, as in
    # training, never comes near it.
    dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 4 * len(models))
    rows = [["variant", "graph breaks", "graphs after 3 steps", "break reasons"]]
    steps: dict[str, Step] = {}
    for name, model in models.items():
        model.train()
        explained = dynamo.explain(model)(x)
        dynamo.reset()
        compiled = torch.compile(model)
        step = train_step(compiled, x)
        before = dynamo.utils.counters["stats"]["unique_graphs"]
        for _ in range(3):
            step()
        graphs = dynamo.utils.counters["stats"]["unique_graphs"] - before
        reasons = "; ".join(sorted({str(b.reason)[:60] for b in explained.break_reasons})) or "-"
        rows.append([name, str(explained.graph_break_count), str(graphs), reasons])
        steps[f"{name} (compiled)"] = step
    print("\n## d0. torch.compile: graph breaks and recompiles (forward + backward of a ViT-Ti step)\n")
    print_markdown(rows)
    return steps


# --- a / c: formulations inside ViT-Ti -----------------------------------------------------------------------------
def vit_steps(device: torch.device, batch: int, amp: torch.dtype | None) -> dict[str, Step]:
    x = torch.randn(batch, 3, 224, 224, device=device)
    models: dict[str, nn.Module] = {BASELINE: timm.create_model(MODEL)}
    models.update({name: create_model(MODEL, attention=name) for name in list_attentions()})
    return {name: train_step(m.to(device).train(), x, amp) for name, m in models.items()}


def recompute_steps(batch: int) -> dict[str, Step]:
    """e: each formulation's ViT-Ti step with its q', k' recomputed in the backward (today) and kept (as before
    quest.attention.recompute), in one process."""
    import quest.attention.base as base

    x = torch.randn(batch, 3, 224, 224)
    steps: dict[str, Step] = {}
    for name in list_attentions():
        step = train_step(create_model(MODEL, attention=name).train(), x)
        steps[name] = step
        if name != "standard":
            steps[f"{name} (kept)"] = _kept(step, base)
    return steps


def recompute_share(step: Step, rounds: int = 3) -> float:
    """The fraction of a step's CPU time spent recomputing q', k' (a count, not a race: no other variant needed)."""
    shares = []
    for _ in range(rounds + 1):  # the first one warms up
        with warnings.catch_warnings(), quiet_stderr():
            warnings.simplefilter("ignore")
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        shares.append(sum(e.cpu_time_total for e in events if e.key == "quest.attention.recompute") / total)
    return statistics.median(shares[1:])


def _kept(step: Step, *modules: object) -> Step:
    def kept_step() -> None:
        saved = [m.recompute_applies for m in modules]
        for m in modules:
            m.recompute_applies = lambda q: False
        try:
            step()
        finally:
            for m, f in zip(modules, saved):
                m.recompute_applies = f
    return kept_step


def layer_steps(batch: int, tokens: int = 197, dim: int = 192, heads: int = 3) -> dict[str, Step]:
    """One ViT-Ti attention layer alone (input requires grad, as inside a network): the attention's own cost."""
    x = torch.randn(batch, tokens, dim, requires_grad=True)
    layers: dict[str, nn.Module] = {BASELINE: TimmAttention(dim, num_heads=heads, qkv_bias=True)}
    layers.update({name: get_attention(name)(dim, num_heads=heads, qkv_bias=True) for name in list_attentions()})
    return {name: train_step(layer, x) for name, layer in layers.items()}


def sdpa_backends(device: torch.device, dtype: torch.dtype) -> None:
    """For each formulation: which SDPA backends accept its (q', k', v) when each is the only one allowed."""
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    rows = [["formulation"] + [b.name.lower() for b in backends]]
    x = torch.randn(8, 197, 192, device=device)
    for name in list_attentions():
        layer = get_attention(name)(192, num_heads=3, qkv_bias=True).to(device)
        row = [name]
        for backend in backends:
            try:
                with warnings.catch_warnings(), sdpa_kernel([backend]), torch.autocast(device.type, dtype=dtype):
                    warnings.simplefilter("ignore")
                    layer(x).float().sum().backward()
                row.append("yes")
            except RuntimeError:
                row.append("no")
        rows.append(row)
    print(f"\nSDPA backends usable alone (fwd+bwd, {dtype} autocast, ViT-Ti layer shape):\n")
    print_markdown(rows)


# --- b: explicit softmax against the fused QUEST layer ----------------------------------------------------------------
class ExplicitQuest(get_attention("quest")):  # type: ignore[misc]
    """QUEST written out: logits = q @ l2n(k)^T materialised (B, H, N, N), softmax, @ v. Same parameters."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
               is_causal: bool = False) -> torch.Tensor:
        logits = q @ F.normalize(k, dim=-1, eps=self.options["eps"]).transpose(-2, -1)
        return self.attn_drop(logits.softmax(dim=-1)) @ v


def long_sequence_steps(tokens: int, batch: int, dim: int = 192, heads: int = 3) -> dict[str, Step]:
    fused = get_attention("quest")(dim, num_heads=heads, qkv_bias=True)
    explicit = ExplicitQuest(dim, num_heads=heads, qkv_bias=True)
    explicit.load_state_dict(fused.state_dict())
    x = torch.randn(batch, tokens, dim, requires_grad=True)
    with torch.no_grad():
        err = (fused(x) - explicit(x)).abs().max().item()
    assert err < 1e-4, f"explicit and fused QUEST disagree by {err}"
    return {"fused (SDPA)": train_step(fused, x), "explicit softmax": train_step(explicit, x)}


# --- driver ----------------------------------------------------------------------------------------------------------
def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"timm {timm.__version__}, Python {platform.python_version()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=25, help="timed rounds for part a (and c)")
    parser.add_argument("--layer-repeats", type=int, default=60, help="timed rounds for the single-layer table")
    parser.add_argument("--long-repeats", type=int, default=10, help="timed rounds for part b")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant before timing")
    parser.add_argument("--batch", type=int, default=8, help="ViT-Ti batch on the CPU (part a)")
    parser.add_argument("--gpu-batch", type=int, default=128, help="ViT-Ti batch on the GPU (part c)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096], help="sequence lengths for part b")
    parser.add_argument("--long-batch", type=int, default=1, help="batch for part b")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default); 1 is steadier on a shared machine")
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 rounds, 1 warm-up step, 1,024 tokens")
    parser.add_argument("--skip", nargs="*", default=[], choices=["a", "b", "c", "d", "e"], help="parts to leave out")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.layer_repeats, args.long_repeats, args.warmup, args.tokens = 3, 3, 2, 1, [1024]
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"# Attention benchmarks\n\nMachine: {machine()}; load average at start {os.getloadavg()[0]:.2f}")
    cpu = torch.device("cpu")

    if "a" not in args.skip:
        report(f"a. {MODEL}, batch {args.batch}, fp32, CPU: forward + backward per step",
               vit_steps(cpu, args.batch, None), BASELINE, args.repeats, args.warmup, cpu)
        report(f"a2. one attention layer of {MODEL} (dim 192, 3 heads, 197 tokens), batch {args.batch}, fp32, CPU: "
               "forward + backward", layer_steps(args.batch), BASELINE, args.layer_repeats, args.warmup, cpu)
    if "e" not in args.skip:
        times = report(f"e. {MODEL}, batch {args.batch}, fp32, CPU: q', k' recomputed in the backward against kept",
                       recompute_steps(args.batch), "standard", args.repeats, args.warmup, cpu)
        print("\nrecomputed / kept, paired per round (median): " + ", ".join(
            f"{n} {statistics.median(a / b for a, b in zip(times[n], times[f'{n} (kept)'])):.3f}"
            for n in times if f"{n} (kept)" in times))
        print("\nthe recompute's own share of a step's CPU time (torch.profiler, the 'quest.attention.recompute' "
              "ranges over the step's total; median of 3 profiled steps): " + ", ".join(
                  f"{n} {recompute_share(step) * 100:.2f}%" for n, step in recompute_steps(args.batch).items()
                  if not n.endswith("(kept)") and n != "standard"))
    if "d" not in args.skip:
        report(f"d. {MODEL}, batch {args.batch}, fp32, CPU, torch.compile: forward + backward per step",
               compile_check(args.batch), f"{BASELINE} (compiled)", args.repeats, args.warmup, cpu)
    if "b" not in args.skip:
        for n in args.tokens:
            report(f"b. one QUEST layer (dim 192, 3 heads), {n} tokens, batch {args.long_batch}, fp32, CPU: "
                   "forward + backward", long_sequence_steps(n, args.long_batch), "explicit softmax",
                   args.long_repeats, 1, cpu)
    if "c" not in args.skip:
        if torch.cuda.is_available():
            gpu = torch.device("cuda")
            print(f"\nGPU: {torch.cuda.get_device_name(gpu)}")
            report(f"c. {MODEL}, batch {args.gpu_batch}, bf16 autocast, GPU: forward + backward per step",
                   vit_steps(gpu, args.gpu_batch, torch.bfloat16), BASELINE, args.repeats, args.warmup, gpu)
            sdpa_backends(gpu, torch.bfloat16)
        else:
            print("\n## c. GPU (bf16, SDPA backends)\n\nskipped: torch.cuda.is_available() is False on this machine.")
    print("\nPeak MiB: the most bytes held at once by tensors allocated during one step (activations saved for "
          "backward, new gradients, kernel workspaces); CPU: allocator events under torch.profiler(profile_memory="
          "True), GPU: torch.cuda.max_memory_allocated above the start. Not allocator caches, not RSS.")


if __name__ == "__main__":
    main()
