"""`dsv41 bench` and its sub-verbs: one module per benchmark, and what they measure with."""
