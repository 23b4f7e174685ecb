"""The operator registry: every operator is one ``OpDef`` entry.

An entry carries the Python signature (torch's), the host kernel (normally the torch function run on
local shards), the metadata rule (by default: the kernel run once on meta tensors of the global
shapes, memoized by the client), and the placement rule (``ops/rules.py``). The client generates the
public function and ``Tensor`` methods from the signature; the hosts look the kernel up by name.

Where a signature is not enough (a random draw that advances the user's generator, ``to``'s
many forms, an index), the entry carries its ``front``: the public function, written beside the
entry, which calls ``issue(name, operands, static)``. An entry without a kernel is *composite*, as
in torch's native functions: only a front, made of other entries (``zeros_like``, ``type_as``).
Fronts are client code in the sense that only the client calls them; the hosts import these
modules for the kernels and never reach a front, so a front may not be imported from ``client/``.

A signature names tensor operands with ``: Tensor`` (a Python number may stand in their place and
travels as a value) or ``: TensorList``; every other parameter is static: it is part of the rule
cache key and is sent once per distinct call shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

# flags travel with each call template, so the controller needs no registry (and no torch)
from ..protocol import COMM, IMPURE, INPLACE, OVERWRITES, VIEW  # noqa: F401


class NoValue(Exception):
    """Raised by a kernel whose result has, by design, no value yet (a tensor made inside
    ``dtorch.nn.init_empty``): the result carries a failure that no one is told of, so nothing
    fails until the value is read (which raises this message) or written whole (which gives it
    one: ``protocol.OVERWRITES``)."""


NO_VALUE_KERNEL = "uninitialized"  # the kernel that raises it (``ops/random_fill.py``)


@dataclass(eq=False)
class OpDef:
    name: str
    signature: str  # "add(input: Tensor, other: Tensor, *, alpha=1)"
    kernel: Callable | None  # kernel(*local_operands, **static) -> Tensor | tuple; None: composite
    placement: Callable | None  # rule(call) -> Placed   (see ops/rules.py); None: composite
    meta: Callable | None = None  # like kernel, on meta tensors (default: the kernel itself)
    methods: tuple = ()  # Tensor method names ("add", "__add__")
    function: bool = True  # exported as dtorch.<name>
    functional: bool = False  # exported as dtorch.nn.functional.<name> too
    aliases: tuple = ()  # torch's other names for it (functions, and methods where it has some)
    flags: int = 0
    # (n_operands, static) -> the operands besides 0 an INPLACE call writes, where they depend
    # on the call (an optimizer's update of a list of parameters and their state)
    written: Callable | None = None
    uses_context: bool = False  # kernel(ctx, *operands, **static): needs the device's coordinate
    result: Callable | None = None  # wraps what a call returns (torch's named tuples)
    doc: str = ""
    front: Callable | None = None  # the public function, where the signature is not enough
    origin: str = "dtorch"  # the module that defined it (a user's, for dtorch.register_op)
    # a COMM kernel's: (in_specs, **static) -> the mesh dims its collectives run along, whose
    # devices agree on failures together (None: every dim of the first operand's mesh)
    comm_dims: Callable | None = None
    # a COMM kernel whose collectives are ``ops/exchange.py``'s, so that torch's autograd of it
    # is its gradient; its VJP then runs as a COMM kernel too (otherwise it has no gradient)
    comm_grad: bool = False
    # its placement rule makes or cuts sub-split Shards itself (cat, the segment cuts): the
    # client's check that every other rule keeps them (``rules.check_sub_splits``) skips it
    sub_splits: bool = False
    # its kernel reads its block's position along a dim (tril's diagonal, dropout's seed, a
    # vocabulary shard's first row): a sub-split block is several pieces with no one position,
    # so rows written for plain Shards do not carry a sub-split to it (the call is refused)
    positional: bool = False
    # filled from the signature
    params: list = field(default_factory=list)
    static_names: tuple = ()

    def __post_init__(self):
        self.params = parse_signature(self.signature)
        self.static_names = tuple(p.name for p in self.params if p.kind == "static")


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "tensor", "tensors" or "static"
    default: str | None  # source text of the default, None when required
    keyword_only: bool
    varargs: bool = False


_SIG = re.compile(r"^(\w+)\((.*)\)$")


def parse_signature(signature: str) -> list:
    m = _SIG.match(signature.replace("\n", " ").strip())
    if not m:
        raise ValueError(f"bad op signature {signature!r}")
    params, keyword_only = [], False
    for part in filter(None, (p.strip() for p in m.group(2).split(","))):
        if part == "*":
            keyword_only = True
            continue
        if part.startswith("*"):  # "*size": varargs that may also be given as one sequence
            name, _, ann = (s.strip() for s in part[1:].partition(":"))
            kind = "tensors" if ann == "TensorList" else "static"  # "*operands: TensorList"
            params.append(Param(name, kind, None, False, varargs=True))
            keyword_only = True
            continue
        name, _, default = (s.strip() for s in part.partition("="))
        name, _, ann = (s.strip() for s in name.partition(":"))
        kind = {"Tensor": "tensor", "TensorList": "tensors"}.get(ann, "static")
        params.append(Param(name, kind, default or None, keyword_only))
    return params


REGISTRY: dict = {}


def register(op: OpDef) -> OpDef:
    if op.name in REGISTRY:
        raise ValueError(f"operator {op.name!r} is already registered")
    REGISTRY[op.name] = op
    return op


def issue(name: str, operands: tuple, static: tuple):
    """Issues the entry ``name`` with these operands and static args (in signature order): how a
    front calls its entry, or others. It goes through the client's dispatch, which the client
    plugs in when it installs the fronts (``client/frontend.install``)."""
    return _dispatch(lookup(name), operands, static)


def _no_client(op, operands, static):
    raise RuntimeError(f"dtorch.{op.name}: a front was called before the client installed "
                       f"its dispatch (import dtorch first)")


_dispatch = _no_client


def plug_dispatch(dispatch: Callable) -> None:
    """The client's ``dispatch(op, operands, static)``, for ``issue``."""
    global _dispatch
    _dispatch = dispatch


def lookup(name: str) -> OpDef:
    try:
        return REGISTRY[name]
    except KeyError:
        raise NotImplementedError(f"dtorch has no operator {name!r}") from None


def freeze(value):
    """``value`` with every list or tuple inside it a tuple: hashable, to key a cache of calls."""
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value
