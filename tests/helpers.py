"""Shared test helpers: SQNR, bf16 bit patterns, FP8 byte comparison, the TP backward's
reduction / wgrad order."""
import torch


def sqnr_db(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `actual` against `reference`, in dB (float64)."""
    ref = reference.detach().double()
    noise = (actual.detach().double() - ref).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / noise)) if noise > 0 else float("inf")


def all_bf16_values(device="cpu") -> torch.Tensor:
    """Every one of the 65536 bfloat16 bit patterns (NaNs, infs, subnormals included)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32, device=device).to(torch.int16)
    return bits.view(torch.bfloat16)


def fp8_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


class RecordDgradOverlap:
    """While active, records in order (`.events`) what the TP backward does around its
    activation-gradient reductions, from the host's view:

      "issue"  a sum over ranks (all-reduce / reduce-scatter) of a tensor of 2 or more dims
               is called (parameter gradients and amaxes are vectors or scalars: not recorded)
      "done"   its result is ready: a synchronous call returned, or an async one's wait()
      "wgrad"  fp8train.gemm.wgrad is called

    The library looks the torch.distributed functions and gemm.wgrad up per call, so
    replacing the attributes is enough; a deprecated name forwarding to the new one records
    once."""

    REDUCTIONS = {"all_reduce": 0, "reduce_scatter_single": 1, "reduce_scatter_tensor": 1}  # name: tensor arg

    def __enter__(self):
        import torch.distributed as dist
        from fp8train import gemm

        self.events = []
        self._orig = [(dist, n, getattr(dist, n)) for n in self.REDUCTIONS if hasattr(dist, n)]
        self._orig.append((gemm, "wgrad", gemm.wgrad))
        events, depth = self.events, [0]

        class _Work:  # an async collective's handle: "done" when waited for
            def __init__(self, work):
                self._work = work

            def wait(self, *args, **kwargs):
                out = self._work.wait(*args, **kwargs)
                events.append("done")
                return out

        def reduction(fn, arg):
            def recorded(*args, **kwargs):
                t = args[arg] if len(args) > arg else kwargs.get("tensor" if arg == 0 else "input")
                record = depth[0] == 0 and t.dim() >= 2
                if record:
                    events.append("issue")
                depth[0] += 1
                try:
                    work = fn(*args, **kwargs)
                finally:
                    depth[0] -= 1
                if record and work is None:
                    events.append("done")
                return _Work(work) if record and work is not None else work
            return recorded

        def wgrad(*args, **kwargs):
            events.append("wgrad")
            return self._orig[-1][2](*args, **kwargs)

        for owner, name, fn in self._orig[:-1]:
            setattr(owner, name, reduction(fn, self.REDUCTIONS[name]))
        gemm.wgrad = wgrad
        return self

    def __exit__(self, *exc):
        for owner, name, fn in self._orig:
            setattr(owner, name, fn)
