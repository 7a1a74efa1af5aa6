"""Command line: `fp8train demo` (more subcommands arrive with later features)."""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "train a small MLP in BF16 and FP8 side by side and compare"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: fp8train <command> [options]\n\ncommands:")
        for name, doc in commands.items():
            print(f"  {name:<8}{doc}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    from . import demo

    demo.main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
