"""The GPU check: the CUDA tests, then the 1-GPU benchmarks, as one table. A few minutes.

    python benchmarks/gpu_check.py [--tests-only | --bench-only]

1. Tests: ``tests/test_cuda.py`` (the ``cuda``-marked ones: factories on the GPU, NCCL,
   streams, memory figures, CUDA graphs), then a selection of the suite with its mesh fixtures
   on CUDA (``DTORCH_TEST_DEVICE=cuda``: the tests that need more GPUs than the machine has
   skip themselves).
2. Benchmarks on GPU 0, each against torch eager in the same run (medians): a stream of small
   ops (goal <= 1.0x), a Llama forward, ``generate`` and training step against HF's (goal
   <= 1.05x), and a hot loop replayed as a CUDA graph against its run without CUDA graphs or
   fusion (goal >= 2x faster).

It prints one table and exits non-zero when a test failed. Without a GPU it says so and stops.
Record the table in the README with the date and the GPU.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITE = ["tests/test_elementwise.py", "tests/test_reduction.py", "tests/test_redistribute.py",
         "tests/test_shape.py", "tests/test_creation.py", "tests/test_init.py",
         "tests/test_autograd.py", "tests/test_training.py", "tests/test_replay.py",
         "tests/test_fusion.py", "tests/test_checkpoint.py", "tests/test_llama.py"]


def pytest(args, env=None) -> tuple:
    """``(ok, last line)`` of a pytest run in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", *args],
                         cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, **(env or {})})
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    return out.returncode in (0, 5), lines[-1] if lines else out.stderr[-300:]


def timed(fn, rounds: int = 7) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_stream(n: int = 20000) -> tuple:
    import dtorch

    mesh = dtorch.DeviceMesh("cuda", [0])
    x0 = torch.rand(1000, device="cuda")

    def eager():
        x = x0
        for _ in range(n):
            x = x * 1.0001 + 0.001
        torch.cuda.synchronize()

    def mine():
        x = dtorch.from_torch(x0.cpu(), mesh)
        for _ in range(n):
            x = x * 1.0001 + 0.001
        dtorch.sync()

    return timed(mine, 3) / (2 * n), timed(eager, 3) / (2 * n)


def bench_cuda_graphs(n: int = 4000) -> tuple:
    """A hot loop replayed (CUDA graphs on, the default) against the same loop with CUDA
    graphs and fusion off: each in a runtime of its own."""
    code = ("import os, time, statistics, dtorch, torch\n"
            "mesh = dtorch.DeviceMesh('cuda', [0])\n"
            "x = dtorch.from_torch(torch.rand(4096), mesh)\n"
            "def run():\n"
            "    global x\n"
            f"    for _ in range({n}):\n"
            "        x = (x * 1.0001 + 0.001).tanh()\n"
            "    dtorch.sync()\n"
            "for _ in range(3): run()\n"
            "dtorch.default_graph.sync(compiles=True)\n"
            "t = []\n"
            "for _ in range(5):\n"
            "    t0 = time.perf_counter(); run(); t.append(time.perf_counter() - t0)\n"
            f"print('RESULT', statistics.median(t) / {3 * n})\n")
    results = []
    for env in ({"DTORCH_FUSION_AFTER": "32", "DTORCH_FUSION_AFTER_S": "0"},
                {"DTORCH_CUDA_GRAPHS": "0", "DTORCH_FUSION": "0"}):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, **env}, check=True)
        results.append(float(out.stdout.split("RESULT")[-1]))
    return tuple(results)


def bench_llama() -> list:
    """``(label, dtorch s, torch s)``: forward, generate and a training step on GPU 0."""
    import transformers

    import dtorch
    from dtorch.models.llama import LlamaForCausalLM

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_llama import CONFIG, NEW_TOKENS

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG)
    hf = transformers.LlamaForCausalLM(config).cuda().eval()
    mesh = dtorch.DeviceMesh("cuda", [0])
    model = LlamaForCausalLM(config, device_mesh=mesh)
    model.load_state_dict({k: v.cpu() for k, v in hf.state_dict().items()})
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 128), generator=torch.Generator()
                        .manual_seed(1))
    ids_cuda = ids.cuda()
    rows = []

    def hf_forward():
        with torch.no_grad():
            hf(ids_cuda).logits
        torch.cuda.synchronize()

    def forward():
        with torch.no_grad():
            logits = model(ids)
            dtorch.sync()
            del logits

    rows.append(("Llama forward", timed(forward), timed(hf_forward)))
    rows.append((f"Llama generate {NEW_TOKENS} tokens",
                 timed(lambda: model.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=[]),
                       3),
                 timed(lambda: (hf.generate(ids_cuda, max_new_tokens=NEW_TOKENS,
                                            do_sample=False, pad_token_id=0,
                                            attention_mask=torch.ones_like(ids_cuda)),
                                torch.cuda.synchronize()), 3)))
    model.train()
    hf.train()
    opt = dtorch.optim.AdamW(model.parameters(), lr=1e-5)
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-5)
    labels = ids.flatten()
    d_labels = dtorch.from_torch(labels, device_mesh=mesh)

    def step():
        loss = dtorch.nn.functional.cross_entropy(model(ids).flatten(0, 1), d_labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()

    def hf_step():
        loss = torch.nn.functional.cross_entropy(hf(ids_cuda).logits.flatten(0, 1),
                                                 labels.cuda())
        loss.backward()
        hf_opt.step()
        hf_opt.zero_grad()
        loss.item()

    rows.append(("Llama training step", timed(step, 5), timed(hf_step, 5)))
    return rows


def main(argv) -> int:
    if not torch.cuda.is_available():
        print("gpu_check: torch sees no GPU here; nothing to check")
        return 1
    name = torch.cuda.get_device_name(0)
    print(f"gpu_check on {torch.cuda.device_count()} x {name}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}")
    failed = False
    if "--bench-only" not in argv:
        for label, args, env in (
                ("CUDA tests", ["tests/test_cuda.py"], None),
                ("suite on CUDA meshes", ["-x", *SUITE], {"DTORCH_TEST_DEVICE": "cuda"})):
            ok, last = pytest(args, env)
            failed |= not ok
            print(f"{label:32} {'ok' if ok else 'FAILED':7} {last}")
    if "--tests-only" not in argv:
        rows = []
        mine, eager = bench_stream()
        rows.append(("small ops, per op", mine, eager, "<= 1.0x"))
        for label, a, b in bench_llama():
            rows.append((label, a, b, "<= 1.05x"))
        graphs, plain = bench_cuda_graphs()
        rows.append(("hot loop: CUDA graph vs no graph, per op", graphs, plain, "<= 0.5x"))
        print(f"{'benchmark':42} {'dtorch':>12} {'baseline':>12} {'ratio':>7}  goal")
        for label, a, b, goal in rows:
            print(f"{label:42} {a * 1e3:10.3f}ms {b * 1e3:10.3f}ms {a / b:6.2f}x  {goal}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
