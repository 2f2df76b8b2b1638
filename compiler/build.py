"""`dsv41 compile`: capture -> lower -> fuse -> schedule -> build, per entry, into an artifact.

Layout: `<out>/<model>-<config hash[:12]>/<target>/` with one library per entry
(`<entry>.so`), `manifest.json` and a README. Weights are never in the libraries: capture runs on
a storage-less placeholder model, and every entry takes the weights as trailing arguments in the
order the manifest lists. CUDA targets are built in a child process that sees a stub libcuda
(`schedules.cuda_build`), so real SASS and PTX are produced without a GPU.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv41.compiler.capture import capture, dim_symbols, static_bounds
from dsv41.compiler.dedupe import dedupe_entry_invariants
from dsv41.compiler.launcher import build_launcher
from dsv41.compiler.onnx_export import export_onnx
from dsv41.compiler.progress import CompileProgress, SilentProgress
from dsv41.compiler.reshape_fusion import (
    legalize_fusable_reshapes,
    takes_of_constants_as_slices,
)
from dsv41.graph.artifact_format import (
    ArtifactTarget,
    EntryBounds,
    EntrySpec,
    Manifest,
    TensorSpec,
    freeze,
    sha256_file,
    write_manifest_file,
)
from dsv41.graph.config import ModelArgs, args_from_dict
from dsv41.graph.engram import host_resident
from dsv41.graph.entries import (
    ENTRIES,
    HOST_INPUTS,
    VISION_ENTRY,
    VISION_OUTPUTS,
    Entry,
    cache_names,
    entry_outputs,
)
from dsv41.graph.model import Model
from dsv41.graph.plan import build_plan, format_plan
from dsv41.graph.speculative import verify_tokens
from dsv41.graph.targets import TargetName, TargetSpec, get_target, target_cpu_features
from dsv41.runtime.backends.artifact import ArtifactError, verify
from dsv41.runtime.backends.launcher import LAUNCHER_FILE
from dsv41.schedules.cuda_build import build_cuda

PHASES = ("capture", "lower", "fuse", "schedule", "build")
# GEMM schedule hint: rows per call (None: prefill). `verify` runs decode's per-row kernels
# (each of its b(1+k) rows as a decode row: the same bits as decode steps), its FP8 GEMVs and
# experts on x86 in row groups sharing each weight load (`lower(verify_rows=)`), bit-identical
# per row; `draft` (a DSpark block of tokens per sequence) runs the same row-group forms.
# Measured at 64K on the bench preset (AMD EPYC Zen 4, AVX-512, quiet): the draft's FP8 linears
# as 4-row GEMM tiles took 72 of its 90 ms (the decode step: 153 ms).
ROWS_HINT = {"decode": 1, "draft": 1, "verify": 1}
# entries whose calls have few rows: one token (or 1 + k) per sequence, and the CED decoder's
# replay (at most `window` tokens); their pool sweep gathers per query (indexer.build_pool_topk)
BOUNDED_ROWS = frozenset({"decode", "draft", "verify", "decoder"})


@dataclass(frozen=True)
class CompileOptions:
    args: ModelArgs
    model_name: str  # e.g. "small" or a config file's stem
    target: str  # cpu | cpu-avx2 | cpu-x86-64 | cuda-sm80 | cuda-sm90 | cuda-sm100
    out: Path = Path("artifacts")
    entries: tuple[str, ...] = ENTRIES
    debug_dump: Path | None = None
    onnx: bool = False  # also write <entry>.onnx (the captured graph, for inspection)
    # CPU targets: entries built at once, each in a process of its own (the pipeline is one
    # thread; the libraries and the manifest are the same whatever the count)
    jobs: int = 1

    def __post_init__(self) -> None:
        if self.jobs < 1:
            raise ValueError(f"--jobs must be at least 1, got {self.jobs}.")

    def display(self) -> str:
        return (f"model {self.model_name} (config {self.args.config_hash()[:12]}), target "
                f"{self.target}, entries {', '.join(self.entries)}, out {self.out}"
                + (f", IR dumps in {self.debug_dump}" if self.debug_dump else ""))

    @property
    def artifact_dir(self) -> Path:
        return self.out / f"{self.model_name}-{self.args.config_hash()[:12]}" / self.target


@dataclass
class CompileReport:
    artifact_dir: Path
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # entry -> phase -> s
    sizes: dict[str, int] = field(default_factory=dict)  # file -> bytes
    unfused: list[str] = field(default_factory=list)  # entries TVM's FuseTIR refused
    tuned: dict[str, list[str]] = field(default_factory=dict)  # entry -> tuned functions (CPU;
    # a CUDA child applies the database too but does not report back)
    kept_tuned: dict[str, list[str]] = field(default_factory=dict)  # kept entries
    kept_seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # kept entries

    @property
    def total_seconds(self) -> float:
        return sum(sum(p.values()) for p in self.seconds.values())


def entry_bounds(model: Model, entry: str, ep, template) -> dict[str, int] | None:
    """TIR var name -> upper bound for an entry planned statically (capture.static_bounds)."""
    sb = static_bounds(model.args, entry)
    if sb is None:
        return None
    syms = dim_symbols(ep, template)
    top = max([1, *(st.ratio for st in template.stores.values())])
    bounds = {syms["batch"]: sb.batch}
    if "ctx" in syms:
        bounds[syms["ctx"]] = sb.context_tokens // top
    return bounds


def entry_signature(ep, template, plan, entry: str, *, host_engram: bool = True) -> EntrySpec:
    """Inputs (user inputs with symbolic shapes), cache tensor names and parameter order;
    `host_engram` (the entry was lowered so, `lower.lower`): the Engram tables and the hash ids
    are marked `host`, read in host memory whatever the artifact's device."""
    specs = ep.graph_signature.input_specs
    user, params = [], []
    nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    for spec in specs:
        val = nodes[spec.arg.name].meta.get("val")
        desc = {"name": spec.arg.name, "dtype": str(val.dtype).replace("torch.", ""),
                "shape": tuple(str(d) for d in val.shape)}
        if spec.kind.name == "PARAMETER":
            host = host_engram and host_resident(spec.target)
            params.append(TensorSpec(**desc, param=spec.target, host=True if host else None))
        else:
            host = host_engram and spec.arg.name in HOST_INPUTS
            user.append(TensorSpec(**desc, host=True if host else None))
    vision = entry == VISION_ENTRY  # no cache: patches in, aligned rows out
    sb = static_bounds(plan.args, entry)
    return EntrySpec(
        inputs=tuple(user), params=tuple(params),
        cache=() if vision else tuple(cache_names(template)),
        outputs=VISION_OUTPUTS if vision else tuple(entry_outputs(plan, entry, template)),
        # cache outputs are the input buffers, updated in place (ops.scatter_rows)
        inplace_cache=True,
        static_bounds=None if sb is None else EntryBounds(sb.batch, sb.context_tokens))


# ---- the phases (one function each) and the driver compile, the CUDA child and tune share ----


def lower_entry(model: Model, entry: str, ep, template, spec, kernels: dict | None = None):
    """The lower phase: the captured entry -> Relax, with the entry's row hint, static bounds
    and bounded-rows choice. `kernels` receives each kernel's key -> GlobalVar."""
    # heavy: TVM; tests patch lower.lower (build imports without TVM)
    from dsv41.compiler.lower import lower

    return lower(ep, spec, rows_hint=ROWS_HINT.get(entry), kernels=kernels,
                 bounds=entry_bounds(model, entry, ep, template),
                 bounded_rows=entry in BOUNDED_ROWS,
                 verify_rows=entry_rows(model.args, entry))


def entry_rows(args: ModelArgs, entry: str) -> int:
    """Rows per sequence of an entry's calls that its kernels take in groups sharing each weight
    load: verify's 1 + k, the draft's DSpark block; 1 elsewhere (decode: one row)."""
    if entry == "verify":
        return verify_tokens(args)
    if entry == "draft":
        return args.dspark_block_size
    return 1


@dataclass
class EntryRun:
    """One entry through the pipeline: what its phases made (None where a phase did not run)."""

    entry: str
    ep: object = None  # capture: the ExportedProgram
    template: object = None  # capture: the cache template
    module: object = None  # the Relax module after the last phase that ran
    fused: bool | None = None  # fuse: TVM's FuseTIR accepted every group
    kernels: dict = field(default_factory=dict)  # lower: kernel key -> GlobalVar


def run_phases(model: Model, entry: str, target: str, *, until: str = "build",
               lib: Path | None = None, tuning: tuple[str, str] | None = None,
               dump: Path | None = None, say: CompileProgress | None = None,
               times: dict[str, float] | None = None) -> EntryRun:
    """capture -> lower -> fuse -> schedule -> build of one entry, through phase `until`
    (PHASES), each phase timed into `times` and reported to `say`; `dump`: a folder that
    receives the IR after each phase (`<entry>.<i>-<phase>.txt`); `tuning` as `schedule`'s;
    `lib`: where build writes the library."""

    assert until in PHASES, f"unknown phase {until!r}"
    spec = get_target(target)
    step = functools.partial(_timed_phase, say or SilentProgress(),
                             {} if times is None else times, entry)
    last = PHASES.index(until)
    run = EntryRun(entry)
    run.ep, run.template = step("capture", capture, model, entry)
    _dump(dump, entry, "capture", lambda: str(run.ep.graph_module.code))
    if last >= PHASES.index("lower"):
        run.module = step("lower", lower_entry, model, entry, run.ep, run.template, spec,
                          run.kernels)
        _dump(dump, entry, "lower", lambda: run.module.script(show_meta=False))
    if last >= PHASES.index("fuse"):
        run.module, run.fused = step("fuse", fuse, run.module, target)
        _dump(dump, entry, "fuse", lambda: run.module.script(show_meta=False))
    if last >= PHASES.index("schedule"):
        run.module = step("schedule", schedule, run.module, target, tuning)
        _dump(dump, entry, "schedule", lambda: run.module.script(show_meta=False))
    if last >= PHASES.index("build"):
        assert lib is not None, "the build phase needs the library's path"
        step("build", _build_library, run.module, spec, lib)
    return run


def _dump(folder: Path | None, entry: str, phase: str, text) -> None:
    """`text`: a callable giving the IR's text (only called when dumping)."""
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{entry}.{PHASES.index(phase)}-{phase}.txt").write_text(text())


def _timed_phase(say: CompileProgress, times: dict[str, float], entry: str, name: str, fn,
                 *args, **kwargs):
    """Run one phase of `entry`, telling `say` when it starts and ends; its seconds in `times`."""
    say.started(entry, name)
    t = time.perf_counter()
    result = fn(*args, **kwargs)
    times[name] = time.perf_counter() - t
    say.finished(entry, name, times[name])
    return result


def lowered_module(config: dict, entry: str, target: str):
    """Capture + lower one entry."""
    return run_phases(Model.placeholder(args_from_dict(config)), entry, target,
                      until="lower").module


def fuse(mod, target_name: str):
    """Library dispatch (sort/scan), legalisation, then operator fusion. Returns (module,
    fused?): when TVM's FuseTIR rejects a fused group, the module is built unfused (each
    legalised op its own loop nest) rather than not at all, and the report says so."""
    from tvm import relax  # heavy: TVM (build imports without it: assets, bench e2e)

    target = get_target(target_name).tvm_target()
    if get_target(target_name).is_cuda:
        # heavy: TVM (build imports without it: assets, bench e2e)
        from tvm.relax.backend.cuda import pipeline as backend
    else:
        # heavy: TVM (build imports without it: assets, bench e2e)
        from tvm.relax.backend.cpu_generic import pipeline as backend
    with target:
        # reshape stays a Relax op: the VM lowers it to a view (vm.builtin.reshape) and memory
        # planning counts it as an alias. Legalised, every reshape became a copy kernel with
        # symbolic index arithmetic (2,099 calls per bench decode step), and TVM's
        # RewriteDataflowReshape, which would turn them back into views, rejects our top-k
        # kernels (see finish_pipeline).
        legalize = relax.transform.LegalizeOps(skip_ops=["relax.reshape"])
        mod = dedupe_entry_invariants(mod)  # what every layer recomputes from the inputs, once
        mod = takes_of_constants_as_slices(mod)  # RoPE's (re, im) parts: injective slices
        for p in [*backend.library_dispatch_passes(target), legalize,
                  relax.transform.AnnotateTIROpPattern()]:
            mod = p(mod)
        mod = legalize_fusable_reshapes(mod)  # a reshape beside a fusable op joins its kernel
        mod = relax.transform.FoldConstant()(mod)
        try:
            fused = relax.transform.FuseTIR()(relax.transform.FuseOps()(mod))
        except Exception:  # noqa: BLE001 - TVM raises InternalError subclasses of many kinds
            return relax.transform.DeadCodeElimination()(mod), False
    return relax.transform.DeadCodeElimination()(fused), True


def finish_pipeline(target_name: str):
    """What tvm.compile still has to do after `fuse` and `schedule`: dataflow lowering and
    finalisation (memory planning, VM codegen)."""
    import tvm  # heavy: TVM (build imports without it: assets, bench e2e)

    spec = get_target(target_name)
    target = spec.tvm_target()
    if spec.is_cuda:
        # heavy: TVM (build imports without it: assets, bench e2e)
        from tvm.relax.backend.cuda import pipeline as backend
    else:
        # heavy: TVM (build imports without it: assets, bench e2e)
        from tvm.relax.backend.cpu_generic import pipeline as backend

    @tvm.transform.module_pass(opt_level=0)
    def _finish(mod, _ctx):
        # RewriteDataflowReshape only turns reshape kernels into views, and it rejects kernels
        # whose body is not a single root block (our top-k selects): leave it out
        lower = [p for p in backend.dataflow_lower_passes(target)
                 if p.info.name != "RewriteDataflowReshape"]
        with target:
            return tvm.transform.Sequential(lower + backend.finalize_passes(target))(mod)

    return _finish


def schedule(mod, target_name: str, tuning: tuple[str, str] | None = None):
    """CUDA: dlight default schedules for everything our kernels do not already schedule. CPU:
    parallel / vectorised loop nests that keep every reduction's order (`cpu_rules`), so the
    results are bit-identical to the unscheduled module. `tuning` = (tuning folder, entry):
    first, the functions `dsv41 tune` verified are replaced by their tuned versions."""

    if tuning is not None:
        # heavy: tuning_db loads TVM (build imports without it)
        from dsv41.compiler.tuning_db import apply_tuning

        mod = apply_tuning(mod, target_name, *tuning)

    spec = get_target(target_name)
    if not spec.is_cuda:
        from dsv41.schedules.cpu_rules import apply_cpu_schedules  # heavy: the CPU rules load TVM

        return apply_cpu_schedules(mod, spec)
    # heavy: TVM (build imports without it: assets, bench e2e)
    import tvm
    from tvm.s_tir import dlight as dl

    rules = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                    dl.gpu.GeneralReduction(), dl.gpu.Fallback())
    out = mod
    with spec.tvm_target():
        for gv, func in mod.functions.items():
            if not isinstance(func, tvm.tirx.PrimFunc) or (
                    func.attrs and func.attrs.get("tirx.is_scheduled")):
                continue
            one = tvm.IRModule({gv.name_hint: func})
            try:
                scheduled = rules(one)[gv.name_hint]
            except Exception:  # noqa: BLE001 - dlight raises TVM internal errors
                scheduled = _bind_flat(func)  # symbolic extents dlight cannot split
            out[gv] = scheduled
    return out


def _bind_flat(func):
    """The simplest GPU schedule: per block, the spatial loops fused and bound to blocks of 256
    threads; reduction loops stay sequential per thread (so results keep the serial order)."""
    from tvm import s_tir  # heavy: TVM (build imports without it: assets, bench e2e)

    sch = s_tir.Schedule(func)
    root = sch.get_sblock("root") if _has_root(sch) else None
    blocks = sch.get_child_blocks(root) if root is not None else []
    for blk in blocks:
        loops = sch.get_loops(blk)
        info = sch.get(blk)
        spatial = [lp for lp, iv in zip(loops, info.iter_vars, strict=False)
                   if iv.iter_type == 0]  # kDataPar
        if not spatial:
            continue
        if len(spatial) == 1:
            bx, tx = sch.split(spatial[0], [None, 256])
            sch.bind(bx, "blockIdx.x")
            sch.bind(tx, "threadIdx.x")
            continue
        # several spatial loops with symbolic extents (which fuse cannot always prove): the
        # outermost over thread blocks, the innermost over threads, the rest per thread
        sch.bind(spatial[0], "blockIdx.x")
        _, tx = sch.split(spatial[-1], [None, 128])
        sch.bind(tx, "threadIdx.x")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _has_root(sch) -> bool:
    try:
        sch.get_sblock("root")
        return True
    except Exception:  # noqa: BLE001
        return False


def built_module(config: dict, entry: str, target: str, tuning: list | None = None):
    """The CUDA child's builder (it runs under the stub): the scheduled module, ready for
    tvm.compile."""
    return run_phases(Model.placeholder(args_from_dict(config)), entry, target,
                      until="schedule", tuning=tuple(tuning) if tuning else None).module


def compile_artifact(opts: CompileOptions,
                     progress: CompileProgress | None = None) -> CompileReport:
    # heavy: tuning_db loads TVM (build imports without it)
    from dsv41.compiler.tuning_db import tuned_functions

    spec = get_target(opts.target)
    out = opts.artifact_dir
    out.mkdir(parents=True, exist_ok=True)
    report = CompileReport(out)
    model = Model.placeholder(opts.args)
    say = progress or SilentProgress()
    kept = _verified_manifest(out, opts.args, opts.target)
    entries = {e: sig for e, sig in (kept.entries if kept else {}).items()
               if e not in opts.entries}
    for e in entries:
        report.seconds[e] = {}
        report.kept_seconds[e] = dict((kept.compile_seconds or {}).get(e, {}))
        if e in (kept.tuning_applied or {}):
            report.kept_tuned[e] = list(kept.tuning_applied[e])
    if entries:
        say.note(f"keeping the artifact's other entries: {', '.join(entries)}")
    for stale in out.glob("*.so"):
        if stale.stem not in entries and stale.stem not in opts.entries \
                and stale.name != LAUNCHER_FILE:
            stale.unlink()
    if entry_jobs_ran(opts, spec):
        entries.update(_build_entries_in_processes(opts, report, say))
    else:
        for entry in opts.entries:
            tuning = (str(out / "tuning"), entry) if (out / "tuning").is_dir() else None
            times = report.seconds.setdefault(entry, {})
            lib = out / f"{entry}.so"
            # CUDA: capture here (the signature), the rest in a child under the stub libcuda
            until = "capture" if spec.is_cuda else "build"
            run = run_phases(model, entry, opts.target, until=until, lib=lib, tuning=tuning,
                             dump=opts.debug_dump, say=say, times=times)
            entries[entry] = entry_signature(run.ep, run.template, model.plan, entry)
            if spec.is_cuda:
                _build_cuda_child(opts, entry, tuning, lib, say, times)
                continue
            report.unfused.extend([] if run.fused else [entry])
            report.tuned[entry] = tuned_functions(run.module)
            if tuning:
                say.note(f"{entry}: {len(report.tuned[entry])} tuned function(s) from the "
                         "database")
    if opts.onnx:

        for path in export_onnx(opts):
            say.note(f"onnx: {path}")
    if spec.is_cuda:
        (out / LAUNCHER_FILE).unlink(missing_ok=True)
    else:  # the entries' parallel loops run on it (`runtime.backends.launcher`)
        build_launcher(out)
    write_manifest(opts, entries, report)
    return report


def entry_jobs_ran(opts: CompileOptions, spec: TargetSpec) -> bool:
    """Whether compile_artifact builds the entries in processes of their own (`jobs`)."""
    return opts.jobs > 1 and not spec.is_cuda and len(opts.entries) > 1


@dataclass(frozen=True)
class EntryJob:
    """One CPU entry built in a process of its own: what `run_phases` needs, by value."""

    config: dict
    entry: str
    target: str
    lib: Path
    tuning: tuple[str, str] | None
    dump: Path | None


@dataclass(frozen=True)
class EntryJobResult:
    entry: str
    spec: EntrySpec
    fused: bool
    tuned: list[str]
    seconds: dict[str, float]


def build_entry_job(job: EntryJob) -> EntryJobResult:
    """capture -> build of one entry (a worker process's whole task)."""
    # heavy: tuning_db loads TVM (build imports without it)
    from dsv41.compiler.tuning_db import tuned_functions

    model = Model.placeholder(args_from_dict(job.config))
    times: dict[str, float] = {}
    run = run_phases(model, job.entry, job.target, lib=job.lib, tuning=job.tuning,
                     dump=job.dump, times=times)
    return EntryJobResult(job.entry, entry_signature(run.ep, run.template, model.plan, job.entry),
                          bool(run.fused), tuned_functions(run.module), times)


def _build_entries_in_processes(opts: CompileOptions, report: CompileReport,
                                say: CompileProgress) -> dict[str, EntrySpec]:
    """Every entry of `opts` built by `build_entry_job` in `opts.jobs` spawned processes; the
    results in the order of `opts.entries` (the manifest does not depend on which finished
    first)."""

    out = opts.artifact_dir
    tuning = (out / "tuning").is_dir()
    jobs = [EntryJob(opts.args.to_dict(), e, opts.target, out / f"{e}.so",
                     (str(out / "tuning"), e) if tuning else None, opts.debug_dump)
            for e in opts.entries]
    name = "capture..build (own process)"
    results: dict[str, EntryJobResult] = {}
    ctx = multiprocessing.get_context("spawn")  # no fork of a process holding TVM's threads
    with ProcessPoolExecutor(max_workers=min(opts.jobs, len(jobs)), mp_context=ctx) as pool:
        futures = {pool.submit(build_entry_job, j): j.entry for j in jobs}
        for e in opts.entries:
            say.started(e, name)
        for f in as_completed(futures):
            r = f.result()
            results[r.entry] = r
            say.finished(r.entry, name, sum(r.seconds.values()), phases=len(PHASES))
    for e in opts.entries:
        r = results[e]
        report.seconds[e] = dict(r.seconds)
        report.unfused.extend([] if r.fused else [e])
        report.tuned[e] = list(r.tuned)
        if tuning:
            say.note(f"{e}: {len(r.tuned)} tuned function(s) from the database")
    return {e: results[e].spec for e in opts.entries}


def _build_cuda_child(opts: CompileOptions, entry: str, tuning, lib: Path,
                      say: CompileProgress, times: dict[str, float]) -> None:
    """lower + fuse + schedule + build of a CUDA entry in a child process that sees a stub
    libcuda (`schedules.cuda_build`): `built_module` there, then `finish_pipeline`."""

    name = "lower+fuse+schedule+build (CUDA child)"
    say.started(entry, name)
    t = time.perf_counter()
    build_cuda("dsv41.compiler.build:built_module",
               {"config": opts.args.to_dict(), "entry": entry, "target": opts.target,
                "tuning": list(tuning) if tuning else None},
               opts.target, lib, timeout=3600, pipeline="dsv41.compiler.build:finish_pipeline")
    times["build"] = time.perf_counter() - t
    say.finished(entry, name, times["build"], phases=len(PHASES) - 1)


def tir_pipeline(target_name: str) -> str:
    """The TIR lowering `tvm.compile` runs for a target: on CPU TVM's default plus
    `compiler.tir_passes` (a parallel loop of one iteration runs inline, no pool wake-up)."""
    if get_target(target_name).is_cuda:
        return "default"
    from dsv41.compiler.tir_passes import register_cpu_tir_pipeline  # heavy: TVM

    return register_cpu_tir_pipeline()


def _build_library(mod, spec, lib: Path) -> None:
    import tvm  # heavy: TVM (build imports without it: assets, bench e2e)

    ex = tvm.compile(mod, target=spec.tvm_target(), relax_pipeline=finish_pipeline(spec.name),
                     tir_pipeline=tir_pipeline(spec.name))
    ex.export_library(str(lib))


def _verified_manifest(artifact_dir: Path, args: ModelArgs, target: str) -> Manifest | None:
    """The manifest of an existing artifact for the same config, target and TVM whose files
    verify and whose entries were built with the tuning database now in its `tuning/`; None
    otherwise (such an artifact contributes nothing: its entries are compiled again)."""
    # heavy: tuning_db loads TVM (build imports without it)
    from dsv41.compiler.tuning_db import database_hash

    if not (artifact_dir / "manifest.json").is_file():
        return None
    try:
        m = verify(artifact_dir, args=args, check_device=False)
    except (ArtifactError, ValueError, KeyError):
        return None
    if m.tuning_database_sha256 != database_hash(artifact_dir / "tuning"):
        return None
    return m if m.target.name == target else None


def built_entries(artifact_dir: Path, args: ModelArgs, target: str) -> dict[str, EntrySpec]:
    """The verified entries of an existing artifact (see `_verified_manifest`)."""
    m = _verified_manifest(artifact_dir, args, target)
    return {} if m is None else dict(m.entries)


def missing_entries(artifact_dir: Path, args: ModelArgs, target: str,
                    wanted: tuple[str, ...]) -> tuple[str, ...]:
    have = built_entries(artifact_dir, args, target)
    # prefill_all is prefill with every position's logits: it serves for prefill
    return tuple(e for e in wanted if e not in have
                 and not (e == Entry.PREFILL and Entry.PREFILL_ALL in have))


def write_manifest(opts: CompileOptions, entries: dict[str, EntrySpec],
                   report: CompileReport) -> Path:
    import tvm  # heavy: TVM (build imports without it: assets, bench e2e)

    # heavy: tuning_db loads TVM (build imports without it)
    from dsv41.compiler.tuning_db import database_hash

    out = opts.artifact_dir
    readme = out / "README.md"
    readme.write_text(
        f"# dsv41 artifact: {opts.model_name} for {opts.target}\n\n"
        f"Config hash {opts.args.config_hash()}. One library per entry "
        f"({', '.join(entries)}); weights are not inside: load them with "
        "`dsv41.runtime.engine.Engine.load(artifact_dir, checkpoint_dir)`, which verifies "
        "`manifest.json` (checksums, config, target, TVM version) first.\n")
    files = {p.name: sha256_file(p) for p in sorted(out.iterdir())
             if p.is_file() and p.name != "manifest.json"}
    report.sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    db_hash = database_hash(out / "tuning")
    manifest = Manifest(
        model=opts.model_name,
        config=freeze(opts.args.to_dict()),
        config_hash=opts.args.config_hash(),
        layer_plan=tuple(format_plan(build_plan(opts.args)).splitlines()),
        target=ArtifactTarget(TargetName(opts.target), freeze(get_target(opts.target).target),
                              target_cpu_features(get_target(opts.target).target)),
        versions=freeze({"tvm": tvm.__version__, "torch": torch.__version__}),
        entries=freeze({Entry(e): sig for e, sig in entries.items()}),
        tuning_database_sha256=db_hash,
        tuning_applied=freeze({**report.kept_tuned, **report.tuned}),
        files=freeze(files),
        compile_seconds=freeze({**report.kept_seconds, **{e: t for e, t in
                                                           report.seconds.items() if t}}),
        created_unix=int(time.time()),
        built_on=os.uname().nodename,
    )
    path = write_manifest_file(out, manifest)  # sealed: its digest covers every field above
    report.sizes["manifest.json"] = path.stat().st_size
    return path

