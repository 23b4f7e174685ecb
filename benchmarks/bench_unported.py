"""HF's own Llama run unported on dtorch tensors (``dtorch.nn.parallelize``) against the
ported ``dtorch.models.llama`` and against HF eager, same weights, one device.

    python benchmarks/bench_unported.py [rounds=7]

The Llama of ``bench_llama.py`` (4 layers, hidden 512, batch 2 x 128). Measured in this one
run, the three sides interleaved round by round (this machine is shared and noisy), medians
over ``rounds``, every forward under ``torch.no_grad``:
1. client time of one forward (the call returning: every op issued, nothing waited for), the
   unported model against the ported one: what torch's module code and the override protocol
   (``client/overrides.py``) add per op. Goal <= 1.5x.
2. end-to-end forward (issued and finished, ``dtorch.sync()``) of both, against HF's eager.

The host gets every core (``DTORCH_CPU_HOSTS=1``), as eager torch does.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time

os.environ.setdefault("DTORCH_CPU_HOSTS", "1")  # before dtorch is imported

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_llama import build  # noqa: E402


def main(rounds: int) -> None:
    import dtorch

    hf, ported, ids = build()
    mesh = dtorch.DeviceMesh("cpu", [0])
    unported = dtorch.nn.parallelize(copy.deepcopy(hf), mesh)
    x = dtorch.from_torch(ids, mesh)
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(ported(ids).to_torch(), want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(unported(x, use_cache=False).logits.to_torch(), want,
                                   atol=1e-4, rtol=1e-4)
    times = {k: [] for k in ("hf", "ported_client", "ported", "unported_client", "unported")}
    for _ in range(rounds):
        with torch.no_grad():
            t0 = time.perf_counter()
            _ = hf(ids).logits
            times["hf"].append(time.perf_counter() - t0)
            for name, run in (("ported", lambda: ported(ids)),
                              ("unported", lambda: unported(x, use_cache=False).logits)):
                t0 = time.perf_counter()
                out = run()  # held until synced: an unread result would be dead code
                t1 = time.perf_counter()
                dtorch.sync()
                t2 = time.perf_counter()
                del out
                times[f"{name}_client"].append(t1 - t0)
                times[name].append(t2 - t0)
    t = {k: statistics.median(v) for k, v in times.items()}
    print(f"Llama (4 layers, hidden 512, batch 2 x 128), 1 device, host threads: "
          f"{torch.get_num_threads()}; medians of {rounds}")
    print(f"client time of a forward: unported {t['unported_client'] * 1e3:6.1f} ms, ported "
          f"{t['ported_client'] * 1e3:6.1f} ms: {t['unported_client'] / t['ported_client']:.2f}x "
          f"(goal <= 1.5x)")
    print(f"end-to-end forward: unported {t['unported'] * 1e3:6.1f} ms, ported "
          f"{t['ported'] * 1e3:6.1f} ms, HF eager {t['hf'] * 1e3:6.1f} ms: unported "
          f"{t['unported'] / t['hf']:.2f}x HF, ported {t['ported'] / t['hf']:.2f}x HF")


if __name__ == "__main__":
    main(int(sys.argv[1].split("=")[1]) if len(sys.argv) > 1 else 7)
