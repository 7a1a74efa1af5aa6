"""Command line: `fp8train demo` and `fp8train inspect LOG --plot OUT.png`."""
from __future__ import annotations

import argparse
import sys

COMMANDS = {
    "demo": "train a GPT on Python stdlib bytes in BF16 and FP8 (both recipes) and compare",
    "inspect": "summarise (and plot) a numerics log written by fp8train.inspect.Inspector",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: fp8train <command> [options]\n\ncommands:")
        for name, doc in COMMANDS.items():
            print(f"  {name:<9}{doc}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "demo":
        from . import demo

        demo.main(argv[1:])
        return 0
    return inspect_main(argv[1:])


def inspect_main(argv) -> int:
    p = argparse.ArgumentParser(prog="fp8train inspect", description=COMMANDS["inspect"])
    p.add_argument("log", help="JSON-lines file of an Inspector (e.g. demo_out/numerics_fp8_delayed.jsonl)")
    p.add_argument("--plot", metavar="OUT.png", help="draw amax, scale, saturation, underflow and SQNR over steps")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    from . import inspect

    try:
        records = inspect.load(args.log)
    except (OSError, ValueError) as e:
        print(f"fp8train inspect: cannot read {args.log}: {e}", file=sys.stderr)
        return 1
    if not records:
        print(f"fp8train inspect: {args.log} holds no records", file=sys.stderr)
        return 1
    print_summary(records)
    if args.plot:
        from .plots import plot_numerics

        plot_numerics(records, args.plot, title=args.title or args.log)
        print(f"wrote {args.plot}")
    return 0


def print_summary(records) -> None:
    """The last inspected step of every (layer, role), worst saturation and SQNR over all steps."""
    last = max(r["step"] for r in records)
    print(f"{len(records)} records, steps {min(r['step'] for r in records)}..{last}; at step {last}:")
    print(f"{'layer':<24}{'role':<12}{'amax':>10}{'scale':>10}{'saturated':>11}{'flushed':>9}{'SQNR dB':>9}")
    fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
    for r in (r for r in records if r["step"] == last):
        print(f"{r['layer']:<24}{r['role']:<12}{fmt(r['amax'], '10.3g')}{fmt(r['scale'], '10.3g')}"
              f"{fmt(r['saturated'], '11.2%')}{fmt(r['underflow'], '9.2%')}{fmt(r['sqnr_db'], '9.1f')}")
    worst = max(records, key=lambda r: r["saturated"] or 0.0)
    print(f"most saturated: {worst['layer']} {worst['role']} at step {worst['step']} ({worst['saturated']:.3%})")


if __name__ == "__main__":
    sys.exit(main())
