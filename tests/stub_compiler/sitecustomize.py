"""Imported at start-up by each process of a runtime whose PYTHONPATH holds this folder
(``tests/test_fusion.py``): once a host imports inductor, its ``compile`` is replaced by a stub
chosen by ``DTORCH_TEST_COMPILER``: ``exact`` runs the traced graph as it is, ``ulp`` makes
every floating result one ulp larger in its first element, ``raise`` raises. Nothing is
imported before inductor is (a controller never imports torch)."""

import importlib.abc
import importlib.util
import os
import sys


def stub(kind):
    import torch

    def compile_(gm, example_inputs, options=None):
        if kind == "raise":
            raise RuntimeError("the stub compiler refuses")
        if kind == "exact":
            return lambda *args: list(gm(*args))

        def ulp(*args):
            out = []
            for r in gm(*args):
                if r.dtype.is_floating_point and r.numel():
                    r = r.clone()
                    flat = r.view(-1)
                    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=r.dtype))
                out.append(r)
            return out
        return ulp

    return compile_


class _PatchInductor(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch._inductor":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            module.compile = stub(os.environ["DTORCH_TEST_COMPILER"])

        spec.loader.exec_module = patched
        return spec


if os.environ.get("DTORCH_TEST_COMPILER"):
    sys.meta_path.insert(0, _PatchInductor())
