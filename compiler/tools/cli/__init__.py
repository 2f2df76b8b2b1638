"""`dsv41 <verb>`: the command line."""
