"""Probe (issue 23): why does a TORCH_CHECK thrown inside the extension end the process on the
GPU machine? Each case runs in its own subprocess; prints rc and the last stderr lines."""
import os
import subprocess
import sys
import textwrap

import torch

PRE = "import torch\nfrom fp8train.kernels import native\ne = native.extension()\nassert e is not None, native.failure()\n"
INLINE = textwrap.dedent('''
    import torch
    from torch.utils.cpp_extension import load_inline
    from fp8train.kernels import native
    native._find_ninja()
    src = """
    #include <torch/extension.h>
    #include <stdexcept>
    void check_fail(int64_t v) { TORCH_CHECK(v > 0, "inline check failed with ", v); }
    void std_throw() { throw std::runtime_error("inline std throw"); }
    """
    m = load_inline(name="probe_throw_inline{suffix}", cpp_sources=src, functions=["check_fail", "std_throw"],
                    extra_cflags={cflags}, extra_ldflags={ldflags}, verbose=False)
    {pre}
    m.{fn}
''')


def inline(fn, pre="", cflags=(), ldflags=(), suffix=""):
    return (INLINE.replace("{fn}", fn).replace("{pre}", pre).replace("{cflags}", repr(list(cflags)))
            .replace("{ldflags}", repr(list(ldflags))).replace("{suffix}", suffix))


CASES = {
    "inline_check_fail": inline("check_fail(-1)"),
    "inline_check_fail_shared_libstdcxx": inline("check_fail(-1)", ldflags=["-l:libstdc++.so.6"], suffix="_shared"),
}

if __name__ == "__main__":
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    names = sys.argv[1:] or list(CASES)
    for name in names:
        p = subprocess.run([sys.executable, "-c", CASES[name]], env=env, capture_output=True, text=True, timeout=300)
        tail = [l for l in p.stderr.strip().splitlines() if l.strip()][-2:]
        print(f"{name:40s} rc={p.returncode:4d}  {' | '.join(tail)[:300]}")
