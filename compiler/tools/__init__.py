"""The tools on top of the compiler and the runtime: the CLI, the benchmarks, selftest, bundle,
score, ledger and the assets they share. The compiler proper (`dsv41.compiler.*` outside this
package) imports nothing from here."""
