"""Backends: what the engine runs phases on (a compiled artifact, a sharded artifact on disco
workers), the device, TVM threads, host-resident Engram and the torch <-> TVM tensor converter."""
