"""`dsv41 bundle`: a self-contained folder that runs artifacts with only torch installed, and
the GPU check (compiler/tools/bundle.py, torch-free until it compiles)."""

from __future__ import annotations

from pathlib import Path

from dsv41.compiler.tools.bundle import (
    BundleOptions,
    check_artifacts,
    check_bundle_folder,
    write_bundle,
)
from dsv41.compiler.tools.cli.common import print_args


def add_parser(sub) -> None:
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
    sp.set_defaults(func=run)


def run(ns) -> int:
    print_args("bundle", ns)
    artifacts = tuple(Path(a) for a in ns.artifact or ())
    if ns.gpu_check is not None:  # the check's own artifacts, compiled when missing
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
