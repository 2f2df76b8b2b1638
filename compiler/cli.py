"""`dsv41 <verb>`: each verb parses and validates, prints its arguments, then calls one API
function and ends with a short summary."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from .assets import ensure_artifact, ensure_checkpoint

ENGINE_STALL_CHUNK = 128  # `bench serve`'s engine-side stall row without --prefill-chunk


def _args_from(ns):
    from dsv41.graph.config import resolve_args

    return resolve_args(getattr(ns, "preset", None), getattr(ns, "config", None))


def _print_args(verb: str, ns) -> None:
    shown = {k: v for k, v in vars(ns).items() if k != "func"}
    print(f"dsv41 {verb} " + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in shown.items()))


def cmd_plan(ns) -> int:
    from dsv41.graph.config import PRESETS
    from dsv41.graph.plan import build_plan, format_plan

    names = PRESETS if ns.preset == "all" else (ns.preset,)
    if ns.shards is not None:
        return _shard_plan(ns, names)
    for name in names:
        args = _args_from(argparse.Namespace(preset=name, config=ns.config))
        plan = build_plan(args)
        label = ns.config or name
        print(f"\n== layer plan: {label} (config {args.config_hash()[:12]}) ==")
        print(format_plan(plan))
        if ns.config:
            break
    return 0


def _shard_plan(ns, names) -> int:
    from dsv41.graph.bill import parse_contexts
    from dsv41.graph.sharding import format_shard_plan, shard_plan, shard_plan_json

    if not ns.config and len(names) != 1:
        raise ValueError("--shards needs one --preset (or --config), not all of them.")
    (context,) = parse_contexts(ns.context)
    args = _args_from(argparse.Namespace(preset=names[0], config=ns.config))
    plan = shard_plan(args, ns.shards)
    print(f"== shard plan: {ns.config or names[0]} (config {args.config_hash()[:12]}) ==")
    print(format_shard_plan(plan, context=context))
    if ns.json:
        Path(ns.json).write_text(json.dumps(shard_plan_json(plan, context=context), indent=1))
        print(f"json: {ns.json}")
    return 0


def cmd_bill(ns) -> int:
    from dsv41.graph.bill import bill_chart, bill_json, format_bill, make_bill, parse_contexts

    _print_args("bill", ns)
    bill = make_bill(_args_from(ns), contexts=parse_contexts(ns.context), kv_dtype=ns.kv_dtype)
    print(format_bill(bill))
    if ns.chart:
        print(f"chart: {bill_chart(bill, ns.chart)}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(bill_json(bill), indent=1))
        print(f"json: {ns.json}")
    return 0


def cmd_checkpoint(ns) -> int:
    from dsv41.graph.checkpoint import write_seeded_checkpoint

    _print_args("checkpoint", ns)
    t0 = time.time()
    out = write_seeded_checkpoint(_args_from(ns), ns.out, seed=ns.seed, progress=True,
                                  overwrite=ns.overwrite)
    print(f"wrote {out} in {time.time() - t0:.1f} s")
    return 0


def cmd_score(ns) -> int:
    import numpy as np
    from tqdm import tqdm

    from dsv41.graph.model import Model
    from dsv41.graph.score import GraphBackend, read_tokens, score

    _print_args("score", ns)
    tokens = read_tokens(ns.tokens)
    hidden = tuple(int(x) for x in ns.hidden_states.split(",")) if ns.hidden_states else ()
    t0 = time.time()
    model = Model.from_checkpoint(ns.checkpoint)
    for h in hidden:
        if not 0 <= h < model.args.n_layers:
            raise ValueError(f"--hidden-states {h} is not a block of 0..{model.args.n_layers - 1}.")
    phases, label = None, "the PyTorch graph"
    if ns.backend != "torch":
        from dsv41.runtime.artifact import Artifact
        from dsv41.runtime.compiled import CompiledPhases

        if not Path(ns.backend).is_dir():
            raise ValueError(f"--backend {ns.backend!r} is neither 'torch' nor an artifact "
                             "directory.")
        if hidden:
            raise ValueError("--hidden-states needs --backend torch (artifacts return logits, "
                             "selections and cache state only).")
        if ns.kv_dtype != "fp4":
            raise ValueError("Compiled artifacts hold the FP4 cache; --kv-dtype bf16 needs "
                             "--backend torch.")
        phases = CompiledPhases(Artifact.load(ns.backend, args=model.args), model)
        label = f"artifact {ns.backend}"
    images = _score_images(ns.images, model, tokens, ns.prefill)
    print(f"backend: {label}")
    res = score(GraphBackend(model, kv_dtype=ns.kv_dtype, phases=phases), tokens,
                prefill=ns.prefill, mode=ns.mode, hidden_layers=hidden, progress=tqdm,
                images=images)
    res.to_npz(ns.out, tokens)
    finite = np.isfinite(res.logits).all(-1).sum()
    if images:
        print(f"images: {len(images)}, spans of "
              f"{', '.join(str(im.grid.span_length) for im in images)} positions")
    print(f"scored {len(tokens)} tokens ({res.prefill} prefilled, mode {ns.mode}) in "
          f"{time.time() - t0:.1f} s: {finite} logit rows, perplexity "
          f"{res.perplexity(tokens):.4f}, {res.token_layers} token-layers -> {ns.out}")
    return 0


def _score_images(spec: str, model, tokens, prefill: int | None) -> list:
    """`--images a.png,b.png`: each image preprocessed, its span found in the prompt (laid out
    as the released `prepare_vl_inputs` writes it) and checked against its planned grid."""
    from dsv41.graph.image_processor import load_image
    from dsv41.graph.vision import find_spans

    if not spec:
        return []
    if not model.vision:
        raise ValueError("--images needs a checkpoint with a vision tower; this one holds no "
                         "vision.* tensors.")
    images = [load_image(Path(p), model.args) for p in spec.split(",")]
    spans = find_spans(tokens, [im.grid for im in images], model.args.image_token_id)
    p = len(tokens) if prefill is None else prefill
    if spans[-1].end > p:
        raise ValueError(f"Image {len(spans) - 1}'s span ends at {spans[-1].end}, past the "
                         f"{p} prefilled tokens: image spans must lie in the prompt.")
    return images


def cmd_compile(ns) -> int:
    from dsv41.compiler.build import PHASES, CompileOptions, compile_artifact
    from dsv41.compiler.progress import CompileBar
    from dsv41.graph.entries import ENTRIES, VISION_ENTRY
    from dsv41.graph.targets import target_names

    _print_args("compile", ns)
    if ns.target not in target_names():
        raise ValueError(f"Unknown target {ns.target!r}; targets: {', '.join(target_names())}.")
    entries = tuple(ns.entries.split(",")) if ns.entries else ENTRIES
    known = (*ENTRIES, VISION_ENTRY)  # vision: only when named (a model with a tower)
    bad = [e for e in entries if e not in known]
    if bad:
        raise ValueError(f"Unknown entries {bad}; entries: {', '.join(known)}.")
    args = _args_from(ns)
    name = ns.preset
    if ns.config:  # a checkpoint's config.json is named after its folder
        cfg = Path(ns.config)
        name = cfg.parent.name if cfg.name == "config.json" else cfg.stem
        name = cfg.parent.parent.name if name == "checkpoint" else name
    if ns.shards is not None:
        return _compile_sharded(ns, args, name, entries if ns.entries else ("prefill_all",))
    opts = CompileOptions(args=args, model_name=name, target=ns.target, out=Path(ns.out),
                          entries=entries,
                          debug_dump=Path(ns.debug_dump) if ns.debug_dump else None,
                          onnx=ns.format == "onnx")
    print(f"compile: {opts.display()}")
    print(f"phases per entry: {' -> '.join(PHASES)}")
    bar = CompileBar(entries, PHASES, desc="compile")
    try:
        report = compile_artifact(opts, progress=bar)
    finally:
        bar.close()
    print(f"\nartifact: {report.artifact_dir}")
    print(f"{'entry':16s}" + "".join(f"{p:>10s}" for p in PHASES) + f"{'library':>12s}")
    for entry, times in report.seconds.items():
        size = report.sizes.get(f"{entry}.so", 0)
        cols = "".join(f"{times.get(p, 0.0):9.1f}s" for p in PHASES) if times else \
            f"{'(kept from the existing artifact)':>50s}"
        print(f"{entry:16s}" + cols + f"{size / 1e6:10.1f}MB")
    if report.unfused:
        print(f"note: TVM's FuseTIR refused {', '.join(report.unfused)}; built unfused.")
    print(f"total {report.total_seconds:.1f} s, {sum(report.sizes.values()) / 1e6:.1f} MB")
    return 0


def _compile_sharded(ns, args, name: str, entries: tuple[str, ...]) -> int:
    """`dsv41 compile --shards N`: one worker's graph for every worker (compiler/sharded.py)."""
    from dsv41.compiler.sharded import compile_sharded
    from dsv41.graph.collectives import CclBackend

    if ns.format != "tvm" or ns.debug_dump:
        raise ValueError("--shards builds TVM libraries only (no --format onnx, --debug-dump).")
    out = Path(ns.out) / f"{name}-{args.config_hash()[:12]}" / f"{ns.target}-shards{ns.shards}"
    print(f"compile: model {name}, {ns.shards} workers, target {ns.target}, collectives "
          f"{ns.ccl}, entries {', '.join(entries)}, out {out}")
    path = compile_sharded(args, out, shards=ns.shards, entries=entries, target=ns.target,
                           ccl=CclBackend(ns.ccl), model_name=name)
    print(f"artifact: {path.parent}")
    return 0


def cmd_bench(ns, rest: list[str]) -> int:
    """`dsv41 bench kernels ...`: single kernels; `dsv41 bench soak ...`: the soak; `dsv41 bench
    serve ...`: the HTTP server; `dsv41 bench [options]`: end to end."""
    if rest and rest[0] == "serve":
        return cmd_bench_serve(build_bench_serve_parser().parse_args(rest[1:]))
    if rest and rest[0] == "kernels":
        from dsv41.compiler.bench_kernels import main as bench_main

        return bench_main(rest[1:])
    if rest and rest[0] == "pool":
        from dsv41.compiler.pool_bench import main as pool_main

        return pool_main(rest[1:])
    if rest and rest[0] == "soak":
        from dsv41.compiler.soak import main as soak_main

        return soak_main(rest[1:], default_checkpoint=ensure_checkpoint)
    if rest and rest[0] == "load":
        from dsv41.compiler.bench_load import main as load_main

        return load_main(rest[1:], default_checkpoint=ensure_checkpoint)
    if rest and rest[0] == "spec":
        from dsv41.compiler.spec_bench import main as spec_main

        return spec_main(rest[1:], default_checkpoint=ensure_checkpoint)
    if rest and not rest[0].startswith("-"):
        raise ValueError(f"Unknown benchmark {rest[0]!r}; `dsv41 bench [options]` runs the "
                         "end-to-end benchmark, `dsv41 bench kernels` the kernels, `dsv41 "
                         "bench soak` the soak, `dsv41 bench serve` the HTTP server, `dsv41 "
                         "bench pool` the snapshot pool's put / get (in-process vs Redis), "
                         "`dsv41 bench load` the checkpoint load's peak memory, "
                         "`dsv41 bench spec` speculative decoding.")
    from dsv41.compiler.bench import main as e2e_main

    return e2e_main(rest)


def cmd_bundle(ns) -> int:
    from dsv41.compiler.bundle import BundleOptions, write_bundle

    _print_args("bundle", ns)
    artifacts = tuple(Path(a) for a in ns.artifact or ())
    if ns.gpu_check is not None:  # the check's own artifacts, compiled when missing
        from dsv41.compiler.bundle import check_artifacts, check_bundle_folder

        if ns.case is None:
            raise ValueError("--gpu-check needs --case (the shared-small conformance case).")
        check_bundle_folder(Path(ns.out))  # refused before any compile
        artifacts += check_artifacts(ns.gpu_check, Path(ns.case), Path(ns.artifacts_out))
    report = write_bundle(BundleOptions(artifacts=artifacts, out=Path(ns.out),
                                        case=None if ns.case is None else Path(ns.case)))
    for name, info in report.artifacts.items():
        print(f"  artifact {name}: {', '.join(info['entries'])}")
    print(f"wrote {report.out}: {report.files} files, {report.total_bytes / (1 << 20):.1f} MiB; "
          f"run it with `python {report.out}/gpu_check.py` (needs torch and numpy)")
    return 0


def cmd_selftest(ns, rest: list[str]) -> int:
    from dsv41.compiler.selftest import main as selftest_main

    return selftest_main(rest)


def cmd_run(ns) -> int:
    from dsv41.runtime.agent_loop import AgentLoopConfig, run_agent_loop
    from dsv41.runtime.artifact import CED_ENTRIES, EXACT_ENTRIES

    _print_args("run", ns)
    ckpt = Path(ns.checkpoint) if ns.checkpoint else ensure_checkpoint(ns.preset, ns.seed)
    cfg = AgentLoopConfig(
        checkpoint=ckpt, artifact=None, store_dir=None if ns.store is None else Path(ns.store),
        context=ns.context, turns=ns.turns, suffix=ns.suffix, decode=ns.decode, exact=ns.exact,
        restart_between_turns=ns.restart_between_turns, keep_store=ns.keep_store,
        page_tokens=ns.page_tokens, seed=ns.seed)
    cfg.validate()  # arguments and the store folder, before anything is compiled
    artifact = None
    if ns.backend == "artifact":
        artifact = ensure_artifact(ckpt, ns.preset, ns.target,
                                   EXACT_ENTRIES if ns.exact else CED_ENTRIES, Path(ns.out))
    elif ns.backend != "torch":
        raise ValueError(f"--backend must be artifact or torch, got {ns.backend!r}.")
    run_agent_loop(replace(cfg, artifact=artifact))
    return 0


def cmd_ledger(ns) -> int:
    from tqdm import tqdm

    from dsv41.compiler.bench import parse_tokens, synthetic_cache
    from dsv41.graph.bill import parse_contexts
    from dsv41.graph.ledger import (
        SWITCHES,
        LedgerOptions,
        format_ledger,
        ledger_json,
        long_switches,
        run_ledger,
    )
    from dsv41.graph.model import Model

    _print_args("ledger", ns)
    switches = tuple(s.strip() for s in ns.switches.split(",")) if ns.switches else \
        tuple(SWITCHES)
    opts = LedgerOptions(
        contexts=parse_contexts(ns.contexts) if ns.contexts.strip() else (), decode=ns.decode,
        switches=switches, suffix=ns.suffix, seed=ns.seed,
        long_contexts=parse_tokens(ns.long_contexts) if ns.long_contexts else ())
    ckpt = Path(ns.checkpoint) if ns.checkpoint else ensure_checkpoint(ns.preset, ns.seed)
    t0 = time.time()
    model = Model.from_checkpoint(ckpt)
    print(f"checkpoint: {ckpt}")
    total = len(opts.contexts) * len(opts.switches) + \
        len(opts.long_contexts) * len(long_switches(opts))
    bar = tqdm(total=total, desc="ledger", unit="cmp")

    def progress(rec) -> None:
        bar.update(1)
        bar.set_postfix_str(f"{rec.switch} @ {rec.context} ({rec.source}): KL {rec.kl_mean:.3g}")

    def cache_at(n: int):
        return synthetic_cache(model, n, seed=ns.seed)

    ledger = run_ledger(model, opts, progress=progress, cache_at=cache_at)
    bar.close()
    print(format_ledger(ledger))
    if ns.json:
        Path(ns.json).write_text(json.dumps(ledger_json(ledger), indent=1))
        print(f"json: {ns.json}")
    print(f"{len(ledger.records)} comparisons in {time.time() - t0:.1f} s")
    return 0


def cmd_tune(ns) -> int:
    from dsv41.compiler.tune import (
        TuneOptions,
        compare_step,
        format_results,
        list_tasks,
        tune,
    )
    from dsv41.compiler.tuning_db import database_hash
    from dsv41.graph.targets import target_names
    from dsv41.schedules.tuning_space import PhaseShape

    _print_args("tune", ns)
    if ns.target not in target_names():
        raise ValueError(f"Unknown target {ns.target!r}; targets: {', '.join(target_names())}.")
    name = ns.preset
    if ns.config:  # named as `dsv41 compile` names the artifact
        cfg = Path(ns.config)
        name = cfg.parent.name if cfg.name == "config.json" else cfg.stem
        name = cfg.parent.parent.name if name == "checkpoint" else name
    opts = TuneOptions(
        args=_args_from(ns), model_name=name, target=ns.target, out=Path(ns.out),
        entries=tuple(e for e in ns.entries.split(",") if e),
        ops=tuple(o for o in ns.ops.split(",") if o), trials=ns.trials,
        per_round=ns.per_round, shape=PhaseShape(batch=ns.batch, tokens=ns.tokens,
                                                 context=ns.context),
        resume=ns.resume, seed=ns.seed, prefer=ns.prefer)
    print(f"tune: {opts.display()}")
    if ns.list:
        for t in list_tasks(opts):
            print(f"  {t.name:60s} {t.label}, {t.calls} call sites")
        return 0
    try:
        report = tune(opts)
    except KeyboardInterrupt:
        return 130
    if report.noop:
        print(f"nothing to do: every selected task has {opts.trials} trials and a current "
              "verdict; the database is unchanged")
    print(format_results(report))
    print(f"tuning time {report.seconds:.0f} s (search, build and measure "
          f"{report.search_seconds:.0f} s; task extraction {report.extract_seconds:.0f} s)")
    used = sum(r.apply for r in report.results)
    print(f"database: {opts.tuning_dir} (sha256 {(database_hash(opts.tuning_dir) or '-')[:16]})"
          f"; `dsv41 compile` uses {used} tuned function(s), the rest keep their hand "
          "schedules")
    if ns.compare_step:
        print(compare_step(opts))
    return 0


@dataclass
class ServingEngine:
    """What `serve`, `chat` and `bench serve` run on: the engine, its tokenizer and the served
    model's name; `close()` ends the engine and removes the temporary store it made."""

    engine: object  # runtime.engine.Engine
    tokenizer: object  # runtime.tokenizer.Tokenizer
    model_name: str
    backend: str
    temp_store: object | None = None  # tempfile.TemporaryDirectory when no --store was given

    closed: bool = False

    def close(self) -> None:  # idempotent
        if self.closed:
            return
        self.closed = True
        self.engine.close()
        if self.temp_store is not None:
            self.temp_store.cleanup()


def serving_engine(ns) -> ServingEngine:
    """The engine as `dsv41 run` builds it: --artifact DIR, or the artifact for the checkpoint
    (compiling what is missing), or --backend torch (the PyTorch graph); --checkpoint DIR or the
    preset's seeded one; --store DIR (a new or empty folder, or a store to continue) or a fresh
    temporary store removed at the end."""
    import tempfile

    from dsv41.graph.checkpoint import checkpoint_config, weights_fingerprint
    from dsv41.runtime.artifact import CED_ENTRIES
    from dsv41.runtime.engine import Engine
    from dsv41.runtime.tokenizer import Tokenizer

    if ns.backend not in ("artifact", "torch"):
        raise ValueError(f"--backend must be artifact or torch, got {ns.backend!r}.")
    if ns.artifact and ns.backend == "torch":
        raise ValueError("--artifact and --backend torch exclude each other.")
    if ns.page_tokens < 1:
        raise ValueError(f"--page-tokens must be positive, got {ns.page_tokens}.")
    if ns.store is not None:
        from dsv41.runtime.kv_store import FORMAT_VERSION, STORE_KIND
        from dsv41.runtime.store_folder import check_folder

        check_folder(Path(ns.store), kind=STORE_KIND, version=FORMAT_VERSION)
    ckpt = Path(ns.checkpoint) if ns.checkpoint else ensure_checkpoint(ns.preset, ns.seed)
    args = checkpoint_config(ckpt)
    tok = Tokenizer.for_model(args, ckpt)  # refused here when it does not fit the model
    name = ns.model_name or (ckpt.name if ns.checkpoint else ns.preset)
    temp = None
    if ns.store is None:
        temp = tempfile.TemporaryDirectory(prefix="dsv41-serve-store-")
    opts = {"store_dir": Path(ns.store) if ns.store else Path(temp.name) / "store",
            "page_tokens": ns.page_tokens, "redis_url": ns.redis_url}
    try:
        if ns.backend == "torch":
            from dsv41.graph.model import Model

            engine = Engine.from_model(Model.from_checkpoint(ckpt),
                                       weights_hash=weights_fingerprint(ckpt), **opts)
            backend = "PyTorch graph"
        else:
            art = Path(ns.artifact) if ns.artifact else ensure_artifact(
                ckpt, ns.preset, ns.target, CED_ENTRIES, Path(ns.out))
            engine = Engine.load(art, ckpt, **opts)
            backend = f"artifact {art}"
    except BaseException:
        if temp is not None:
            temp.cleanup()
        raise
    return ServingEngine(engine, tok, name, backend, temp)


def _batcher(ns, se: ServingEngine, chunk_tokens: int | None = None):
    """The batcher over `se` (prefill chunks of `chunk_tokens`, else --prefill-chunk, else the
    engine's); on a bad option the engine is closed before the error goes up."""
    from dsv41.runtime.batcher import Batcher

    try:
        for flag in ("max_running", "max_queue"):
            if getattr(ns, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got "
                                 f"{getattr(ns, flag)}.")
        return Batcher(se.engine, tokenizer=se.tokenizer, max_running=ns.max_running,
                       max_queue=ns.max_queue,
                       prefill_chunk_tokens=chunk_tokens or ns.prefill_chunk)
    except BaseException:
        se.close()
        raise


def _masked_url(url: str | None) -> str | None:
    from dsv41.runtime.redis_pool import masked_url

    return None if url is None else masked_url(url)


def cmd_serve(ns) -> int:
    import uvicorn

    from dsv41.runtime.server import ServerOptions, create_app

    shown = argparse.Namespace(**{**vars(ns), "api_key": "***" if ns.api_key else None,
                                  "redis_url": _masked_url(ns.redis_url)})
    _print_args("serve", shown)
    if not 0 < ns.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {ns.port}.")
    timeout = None if ns.request_timeout <= 0 else ns.request_timeout
    if ns.api_key is not None and not ns.api_key:
        raise ValueError("--api-key must not be empty (leave it out for no key).")
    if ns.role not in ("all", "vision", "prefill", "decode"):
        raise ValueError(f"--role must be all, vision, prefill or decode, got {ns.role!r}.")
    if ns.role != "all" and not ns.redis_url:
        raise ValueError(f"--role {ns.role} needs --redis-url: the stages meet on a Redis "
                         "server (queues, hand-offs, the snapshot pool).")
    se = serving_engine(ns)
    args = se.engine.model.args
    opts = ServerOptions(model_name=se.model_name, vocab_size=args.vocab_size,
                         max_seq_len=args.max_seq_len, api_key=ns.api_key,
                         request_timeout_s=timeout,
                         image_token_id=args.image_token_id if se.engine.model.vision else None)
    if ns.role != "all":
        return _serve_stage(ns, se, opts)
    batcher = _batcher(ns, se)
    batcher.start()
    print(f"serving {se.model_name!r} ({se.backend}; tokenizer {se.tokenizer.file.path.name}, "
          f"{se.tokenizer.file.source.value}) on http://{ns.host}:{ns.port}/v1"
          f"{' with an API key' if ns.api_key else ''}", flush=True)
    try:
        uvicorn.run(create_app(batcher, se.tokenizer, opts), host=ns.host, port=ns.port,
                    log_level=ns.log_level)
    finally:
        batcher.stop()
        st = batcher.stats()
        se.close()
    print(f"summary: {st.finished} requests finished, {st.cancelled} cancelled, "
          f"{st.prompt_tokens} prompt and {st.completion_tokens} completion tokens")
    return 0


def _serve_stage(ns, se: ServingEngine, opts) -> int:
    """`serve --role prefill|decode`: the stage's worker on its engine, and the OpenAI server
    in front of the queues (any worker takes requests); /metrics adds the stage's series."""
    import redis
    import uvicorn

    from dsv41.runtime.epd import (
        DecodeWorker,
        EpdGateway,
        EpdServerMetrics,
        PrefillWorker,
        VisionWorker,
    )
    from dsv41.runtime.server import create_app

    try:
        client = redis.Redis.from_url(ns.redis_url)
        if ns.role == "vision":
            if not se.engine.model.vision:
                raise ValueError("--role vision needs a checkpoint with a vision tower.")
            worker = VisionWorker(se.engine, client)
        elif ns.role == "prefill":
            worker = PrefillWorker(se.engine, client)
        else:
            worker = DecodeWorker(se.engine, client, max_running=ns.max_running)
        gateway = EpdGateway(client, se.engine.key_salt.fingerprint(),
                             vocab_size=opts.vocab_size, max_seq_len=opts.max_seq_len,
                             tokenizer=se.tokenizer, max_queue=ns.max_queue,
                             model=se.engine.model)
    except BaseException:
        se.close()
        raise
    worker.start()
    print(f"serving {se.model_name!r} ({se.backend}) as the {ns.role} stage over "
          f"{_masked_url(ns.redis_url)} on http://{ns.host}:{ns.port}/v1", flush=True)
    try:
        uvicorn.run(create_app(gateway, se.tokenizer, opts, metrics=EpdServerMetrics(worker)),
                    host=ns.host, port=ns.port, log_level=ns.log_level)
    finally:
        worker.stop()
        gateway.close()
        n = worker.counters
        se.close()
    print(f"summary: {ns.role} stage finished {n.requests} requests, {n.tokens} tokens, "
          f"{n.errors} errors, {n.handoffs_rejected} hand-offs rejected")
    return 0


def cmd_chat(ns) -> int:
    from dsv41.runtime.sampling import SamplingParams
    from dsv41.runtime.terminal_chat import ChatSettings, run_chat

    _print_args("chat", ns)
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, seed=ns.seed_sampling,
                            max_tokens=ns.max_tokens).validate()
    se = serving_engine(ns)
    batcher = _batcher(ns, se)
    batcher.start()
    print(f"chat with {se.model_name!r} ({se.backend}); /reset clears the history, /exit ends",
          flush=True)
    try:
        summary = run_chat(batcher, se.tokenizer, ChatSettings(params, ns.system, ns.thinking),
                           sys.stdin, sys.stdout)
    finally:
        batcher.stop()
        se.close()
    print(f"summary: {summary.turns} replies, {summary.completion_tokens} tokens, prompts of "
          f"{', '.join(str(n) for n in summary.prompt_tokens) or 'none'} tokens")
    return 0


def serving_opts(sp, *, server: bool) -> None:
    """The engine and batcher options of `serve`, `chat` and `bench serve`."""
    sp.add_argument("--artifact", default=None, help="a compiled artifact folder")
    sp.add_argument("--backend", default="artifact",
                    help="artifact (compiled; compiles what is missing) | torch")
    sp.add_argument("--checkpoint", default=None, help="a checkpoint folder (wins over --preset)")
    sp.add_argument("--preset", default="small", help="seeded checkpoint of this preset")
    sp.add_argument("--seed", type=int, default=0, help="the seeded checkpoint's seed")
    sp.add_argument("--store", default=None,
                    help="the SSD store's folder: new or empty, or a store to continue (default:"
                         " a fresh temporary store, removed at the end)")
    sp.add_argument("--page-tokens", type=int, default=64,
                    help="runtime-cache page and SSD block, in positions")
    sp.add_argument("--target", default="cpu", help="the artifact's target")
    sp.add_argument("--out", default="artifacts", help="where artifacts live")
    sp.add_argument("--model-name", default=None,
                    help="the served model's id (default: the preset, or the checkpoint folder)")
    sp.add_argument("--max-running", type=int, default=16, help="sequences decoded together")
    sp.add_argument("--max-queue", type=int, default=64,
                    help="requests waiting for a slot (beyond: 429)" if server else
                    "requests waiting for a slot")
    sp.add_argument("--prefill-chunk", type=int, default=None,
                    help="prefill tokens per batcher step (default: the batcher's)")
    sp.add_argument("--redis-url", default=None,
                    help="the DRAM snapshot pool on this Redis server, shared by every process "
                         "that names it (default: an in-process pool)")


def build_bench_serve_parser() -> argparse.ArgumentParser:
    sp = argparse.ArgumentParser(prog="dsv41 bench serve",
                                 description="the HTTP server under concurrent streaming clients")
    serving_opts(sp, server=True)
    sp.add_argument("--clients", default="1,4,16", help="concurrent client counts")
    sp.add_argument("--requests", type=int, default=2, help="requests per client, in turn")
    sp.add_argument("--prompt-tokens", type=int, default=32)
    sp.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    sp.add_argument("--long-streams", type=int, default=8,
                    help="streams decoding while a long prompt arrives (0: no such row)")
    sp.add_argument("--long-prompt-tokens", type=int, default=512)
    sp.add_argument("--long-max-tokens", type=int, default=48,
                    help="tokens each of those streams generates")
    sp.add_argument("--json", default=None, help="write the rows as JSON here")
    return sp


def cmd_bench_serve(ns) -> int:
    from dsv41.compiler.serve_bench import ServeBenchOptions, run_serve_bench
    from dsv41.runtime.server import ServerOptions, ServerThread, create_app

    _print_args("bench serve", ns)
    try:
        clients = tuple(int(c) for c in ns.clients.split(",") if c.strip())
    except ValueError:
        raise ValueError(f"--clients must be comma-separated counts, got {ns.clients!r}.") from None
    se = serving_engine(ns)
    args = se.engine.model.args
    batcher = None
    try:
        opts = ServeBenchOptions(
            clients=clients, requests=ns.requests, prompt_tokens=ns.prompt_tokens,
            max_tokens=ns.max_tokens, long_streams=ns.long_streams,
            long_prompt_tokens=ns.long_prompt_tokens, long_max_tokens=ns.long_max_tokens,
            seed=ns.seed).validate(args.max_seq_len)
        if max((*clients, ns.long_streams + 1)) > ns.max_running + ns.max_queue:
            raise ValueError("--max-running + --max-queue must hold every client at once.")
        # both long-prompt rows (over HTTP, and the engine's own) prefill in chunks of this size
        chunk = ns.prefill_chunk or ENGINE_STALL_CHUNK
        batcher = _batcher(ns, se, chunk)
        batcher.start()
        app = create_app(batcher, se.tokenizer, ServerOptions(
            model_name=se.model_name, vocab_size=args.vocab_size, max_seq_len=args.max_seq_len))
        print(f"bench serve: {se.model_name!r} ({se.backend}), --max-running "
              f"{ns.max_running}; noisy when other work shares the machine")
        t0 = time.time()
        with ServerThread(app) as server:
            result = run_serve_bench(server.host, server.port, se.model_name, opts,
                                     vocab_size=args.vocab_size)
        batcher.stop()
        batcher = None
        if opts.long_streams:  # the same stall measured on the engine's side, no HTTP
            from dsv41.runtime.batcher import measure_long_prompt_stall

            stall = measure_long_prompt_stall(
                se.engine, streams=opts.long_streams, stream_prompt=opts.prompt_tokens,
                stream_tokens=opts.long_max_tokens, long_prompt=opts.long_prompt_tokens,
                chunk_tokens=chunk, seed=ns.seed)
            result["long_prompt_engine"] = stall.to_dict()
            print(f"  engine side: worst gap {stall.worst_gap_s * 1e3:.1f} ms during the "
                  f"{stall.chunks}-chunk prefill ({stall.chunk_tokens} tokens a chunk, "
                  f"{stall.chunk_s * 1e3:.1f} ms each), median gap "
                  f"{stall.median_gap_s * 1e3:.1f} ms")
    finally:
        if batcher is not None:
            batcher.stop()
        se.close()
    result.update(backend=se.backend, max_running=ns.max_running,
                  prefill_chunk_tokens=ns.prefill_chunk or ENGINE_STALL_CHUNK)
    if ns.json:
        Path(ns.json).write_text(json.dumps({"serve": result}, indent=1))
        print(f"json: {ns.json}")
    rows = result["clients"]
    print("summary: " + "; ".join(
        f"{r['clients']} clients {r['tokens_per_s']:.1f} tok/s TTFT p50 "
        f"{r['ttft_p50_s'] * 1e3:.0f} ms p99 {r['ttft_p99_s'] * 1e3:.0f} ms" for r in rows)
        + f" ({time.time() - t0:.0f} s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv41", description="DeepSeek-V4.1-Flash deployment tools")
    sub = p.add_subparsers(dest="verb", required=True)

    def model_opts(sp, default="small"):
        sp.add_argument("--preset", default=default, help="small | bench | full | long")
        sp.add_argument("--config", default=None, help="a config.json (inference or HF form)")

    sp = sub.add_parser("plan", help="print the layer plan")
    sp.add_argument("--preset", default="all", help="small | bench | full | long | all")
    sp.add_argument("--config", default=None)
    sp.add_argument("--shards", type=int, default=None,
                    help="the sharding plan over N workers (expert + tensor parallel) instead")
    sp.add_argument("--context", default="1M",
                    help="--shards: the one context the cache bytes are given at")
    sp.add_argument("--json", default=None, help="--shards: also write the plan as JSON")
    sp.set_defaults(func=cmd_plan)

    sp = sub.add_parser("bill", help="the KV bill: global bytes per token and local state")
    model_opts(sp, "full")
    sp.add_argument("--context", default="128K,1M", help="e.g. 128K,1M (K=1e3, Ki=1024)")
    sp.add_argument("--kv-dtype", default="fp4", choices=("fp4", "bf16"))
    sp.add_argument("--chart", default=None, help="write a PNG chart here")
    sp.add_argument("--json", default=None, help="write the bill as JSON here")
    sp.set_defaults(func=cmd_bill)

    sp = sub.add_parser("checkpoint", help="write a seeded checkpoint in the official layout")
    model_opts(sp)
    sp.add_argument("--out", required=True)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--overwrite", action="store_true")
    sp.set_defaults(func=cmd_checkpoint)

    sp = sub.add_parser("score", help="teacher-forced logits of a token sequence")
    sp.add_argument("--checkpoint", required=True)
    sp.add_argument("--tokens", required=True, help=".npy or whitespace-separated ids")
    sp.add_argument("--prefill", type=int, default=None, help="tokens prefilled at position 0")
    sp.add_argument("--mode", default="exact", choices=("exact", "ced"))
    sp.add_argument("--backend", default="torch")
    sp.add_argument("--kv-dtype", default="fp4", choices=("fp4", "bf16"))
    sp.add_argument("--hidden-states", default="", help="e.g. 0,1,2,3")
    sp.add_argument("--images", default="",
                    help="comma-separated image files whose spans the prompt holds, in order")
    sp.add_argument("--out", required=True)
    sp.set_defaults(func=cmd_score)

    sp = sub.add_parser("compile", help="compile the model's phases into an artifact")
    model_opts(sp)
    sp.add_argument("--target", default="cpu",
                    help="cpu | cpu-x86-64 | cuda-sm80 | cuda-sm90 | cuda-sm100")
    sp.add_argument("--out", default="artifacts")
    sp.add_argument("--entries", default="", help="comma-separated subset of the entries")
    sp.add_argument("--debug-dump", default=None, help="write the IR after each phase here")
    sp.add_argument("--format", default="tvm", choices=("tvm", "onnx"),
                    help="onnx: also export the captured graphs as ONNX (dsv41 domain)")
    sp.add_argument("--shards", type=int, default=None,
                    help="a sharded artifact: one worker's graph for N workers (CPU targets; "
                         "default entries: prefill_all)")
    sp.add_argument("--ccl", default="cpu-test", choices=("cpu-test", "disco"),
                    help="--shards: the collectives: cpu-test (the in-process test "
                         "collective, a ThreadedSession) or disco (the session's NCCL)")
    sp.set_defaults(func=cmd_compile)

    sp = sub.add_parser("bundle", help="a self-contained folder that runs artifacts with only "
                                       "torch installed (and the GPU check)")
    sp.add_argument("--artifact", action="append", default=None,
                    help="an artifact folder (repeat for more)")
    sp.add_argument("--out", required=True)
    sp.add_argument("--case", default=None, help="a conformance case folder to carry")
    sp.add_argument("--gpu-check", default=None, metavar="TARGET",
                    help="also the artifacts gpu_check.py runs for TARGET (cuda-sm90: "
                         "shared-small's prefill_all + decode, bench's decode), compiled into "
                         "--artifacts-out when missing")
    sp.add_argument("--artifacts-out", default="artifacts")
    sp.set_defaults(func=cmd_bundle)

    sp = sub.add_parser("selftest", add_help=False,
                        help="the device check: conformance, gpu kernel tests, decode roofline "
                             "(`dsv41 selftest --help`)")
    sp.set_defaults(func=cmd_selftest, passthrough=True)

    sp = sub.add_parser("bench", add_help=False,
                        help="end to end: `dsv41 bench [--help]`; kernels: `dsv41 bench "
                             "kernels [--help]`; soak: `dsv41 bench soak [--help]`")
    sp.set_defaults(func=cmd_bench, passthrough=True)

    sp = sub.add_parser("run", help="the agent-loop demo: long context, then short turns")
    sp.add_argument("--preset", default="small")
    sp.add_argument("--checkpoint", default=None)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--context", type=int, default=512)
    sp.add_argument("--turns", type=int, default=3)
    sp.add_argument("--suffix", type=int, default=32, help="new tokens per turn")
    sp.add_argument("--decode", type=int, default=16, help="tokens decoded per turn")
    sp.add_argument("--exact", action="store_true", help="exact phases throughout (no CED)")
    sp.add_argument("--restart-between-turns", action="store_true",
                    help="a new engine per turn: only the SSD store carries over")
    sp.add_argument("--backend", default="artifact", help="artifact (compiled) | torch")
    sp.add_argument("--target", default="cpu", help="the artifact's target")
    sp.add_argument("--out", default="artifacts", help="where artifacts live")
    sp.add_argument("--store", default=None,
                    help="the SSD store's folder: new or empty, or a store to continue with "
                         "--keep-store (default: a fresh temporary store, removed at the end)")
    sp.add_argument("--page-tokens", type=int, default=64,
                    help="runtime-cache page and SSD block, in positions")
    sp.add_argument("--keep-store", action="store_true",
                    help="continue from the --store folder's contents (without it that folder "
                         "must be new or empty; dsv41 run never deletes a folder)")
    sp.set_defaults(func=cmd_run)

    sp = sub.add_parser("ledger", help="each approximation's cost against exact mode")
    sp.add_argument("--preset", default="small", help="seeded checkpoint of this preset")
    sp.add_argument("--checkpoint", default=None, help="a checkpoint folder (wins over --preset)")
    sp.add_argument("--seed", type=int, default=0, help="seeded checkpoint and prompt ids")
    sp.add_argument("--contexts", default="64,256,900",
                    help="prompt lengths, e.g. 64,256,900 ('' for none)")
    sp.add_argument("--long-contexts", default="",
                    help="candidate_pool and shared_selection also over the bench's synthetic "
                         "cache of these many positions, decode steps scored (e.g. 32K,64K; "
                         "K = 1024)")
    sp.add_argument("--decode", type=int, default=8, help="teacher-forced steps scored after it")
    sp.add_argument("--suffix", type=int, default=32, help="replay: new tokens after the prefix")
    sp.add_argument("--switches", default="",
                    help="comma-separated subset of ced,replay,fp4_kv,candidate_pool,"
                         "decoder_carry,shared_selection (default all)")
    sp.add_argument("--json", default=None, help="write the records as JSON here")
    sp.set_defaults(func=cmd_ledger)

    sp = sub.add_parser("tune", help="MetaSchedule the artifact's kernels (database in tuning/)")
    model_opts(sp)
    sp.add_argument("--target", default="cpu",
                    help="cpu | cpu-x86-64 | cuda-sm80 | cuda-sm90 | cuda-sm100 (CUDA: on a GPU)")
    sp.add_argument("--trials", type=int, default=64,
                    help="measured candidates per task, counted in the database")
    sp.add_argument("--ops", default="",
                    help="comma-separated op families (fp8_linear, sparse_attend, index_scores, "
                         "fp8_dequant, quant_fp8, quant_fp4_kv, quant_mxfp4, qdq_mxfp4, dense) "
                         "or task names (--list); default all")
    sp.add_argument("--resume", action="store_true",
                    help="add to the database an earlier (or interrupted) run left")
    sp.add_argument("--entries", default="decode", help="entries whose kernels are tuned")
    sp.add_argument("--context", type=int, default=8192, help="cache tokens at tuning time")
    sp.add_argument("--tokens", type=int, default=256, help="tokens per call (not decode)")
    sp.add_argument("--batch", type=int, default=1, help="sequences per call")
    sp.add_argument("--per-round", type=int, default=8, help="candidates per search round")
    sp.add_argument("--prefer", default="faster", choices=("faster", "tuned"),
                    help="use a tuned function when faster than the hand schedule (default), "
                         "or whenever its outputs match")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--out", default="artifacts", help="where artifacts live")
    sp.add_argument("--list", action="store_true", help="list the tasks and exit")
    sp.add_argument("--compare-step", action="store_true",
                    help="also time the decode step compiled with and without the database "
                         "(compiles the decode entry twice)")
    sp.set_defaults(func=cmd_tune)

    sp = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching)")
    serving_opts(sp, server=True)
    sp.add_argument("--host", default="127.0.0.1", help="the address to bind (default: local)")
    sp.add_argument("--port", type=int, default=8000)
    sp.add_argument("--api-key", default=None,
                    help="require `Authorization: Bearer KEY` on /v1 (default: no key)")
    sp.add_argument("--request-timeout", type=float, default=600.0,
                    help="seconds a request may run before it is cancelled (0: none)")
    sp.add_argument("--log-level", default="info", help="uvicorn's log level")
    sp.add_argument("--role", default="all",
                    help="all (one process) | vision | prefill | decode: one EPD stage, its queues "
                         "and hand-offs on --redis-url (runtime/epd.py)")
    sp.set_defaults(func=cmd_serve)

    sp = sub.add_parser("chat", help="a terminal chat on the embedded engine (reads stdin)")
    serving_opts(sp, server=False)
    sp.add_argument("--system", default=None, help="a system message")
    sp.add_argument("--thinking", action="store_true", help="thinking mode")
    sp.add_argument("--max-tokens", type=int, default=64, help="tokens per reply at most")
    sp.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    sp.add_argument("--top-p", type=float, default=1.0)
    sp.add_argument("--seed-sampling", type=int, default=None, help="the sampler's seed")
    sp.set_defaults(func=cmd_chat)
    return p


def load_disco_first(ns) -> bool:
    """A command given a sharded artifact (`--artifact DIR`) runs it on disco workers, whose
    runtime libraries must be loaded before anything imports tvm: load them first thing.
    Whether it did."""
    from dsv41.runtime.disco import is_sharded_dir, load_disco

    art = getattr(ns, "artifact", None)
    if isinstance(art, str) and is_sharded_dir(art):
        load_disco()
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    from dsv41.runtime.onednn import bound_onednn_caches

    ns, rest = build_parser().parse_known_args(argv)
    if rest and not getattr(ns, "passthrough", False):
        build_parser().parse_args(argv)  # reports the unknown arguments and exits
    try:
        load_disco_first(ns)
        bound_onednn_caches()  # before any torch work of any command (runtime/onednn.py)
        if getattr(ns, "passthrough", False):
            return ns.func(ns, rest)
        return ns.func(ns)
    except ValueError as e:
        print(f"dsv41 {ns.verb}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
