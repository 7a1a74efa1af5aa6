"""Run a script with kernel-module flags set (A/B comparisons in one device call).

    PYTHONPATH=. python3 tools/run_with_flags.py norm._FUSED_TRANSPOSE_ON_CUDA=1 -- benchmarks/small.py --sizes 1024

Each NAME=VALUE before `--` sets fp8train.kernels.<module>.<attribute> to int(VALUE); the
script after `--` then runs as __main__ with the arguments that follow it.
"""
import importlib
import runpy
import sys


def main():
    argv = sys.argv[1:]
    split = argv.index("--")
    for item in argv[:split]:
        name, value = item.split("=")
        module, attr = name.rsplit(".", 1)
        mod = importlib.import_module(f"fp8train.kernels.{module}")
        if not hasattr(mod, attr):
            raise SystemExit(f"run_with_flags: fp8train.kernels.{module} has no {attr}")
        setattr(mod, attr, type(getattr(mod, attr))(int(value)))
        print(f"run_with_flags: fp8train.kernels.{module}.{attr} = {getattr(mod, attr)}")
    sys.argv = argv[split + 1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
