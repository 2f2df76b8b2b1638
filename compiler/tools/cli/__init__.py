"""`dsv41 <verb>`: the command line, one module per verb (`plan`, `bill`, `checkpoint`, `score`,
`compile`, `bundle`, `selftest`, `bench` and its sub-verbs, `run`, `ledger`, `tune`, `serve`,
`chat`), assembled into one parser tree by `main.build_parser`. A verb module has
`add_parser(subparsers)`; its `run(ns)` parses and validates, prints its arguments, builds one
options dataclass (`options(ns)`, also `ns.options(ns)` where the verb has one) and calls one API
function of the module that owns the work, then ends with a short summary.

Imports: a verb module imports the module that does its work inside `options` / `run` only where
that module imports torch or TVM, so that `dsv41 --help` and parsing stay fast; everything cheap
(argparse, the config presets, the options of torch-free modules) is imported at the top."""
