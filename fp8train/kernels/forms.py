"""The launch shapes in force, as one string (`KEY`), kept by launcher.LaunchOverride (triton-free,
so traced module code can read it anywhere). A compiled model's kernels are chosen inside custom
ops' bodies, which Dynamo does not guard on: the layers read KEY while traced (modules/base.py), so
a graph traced under one override is not reused under another (a benchmark's A/B of launch shapes
in one process) and recompiles instead. Outside any override KEY is ""."""
from __future__ import annotations

KEY = ""
