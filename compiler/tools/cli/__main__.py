"""`python -m dsv41.compiler.tools.cli`: the same as the `dsv41` command."""

from dsv41.compiler.tools.cli.main import main

main()
