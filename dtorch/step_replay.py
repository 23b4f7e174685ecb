"""Replayed steps: a function that issues the same records call after call (a training step:
forward, backward, the optimizer's update) is sent again as one record a call, without running
its Python -- what a CUDA graph is to a CUDA stream, for dtorch's op records.

>>> import dtorch
>>> w = dtorch.ones(3, device_mesh=dtorch.DeviceMesh("cpu", [0]))
>>> @dtorch.replayed_step
... def step(x):
...     w.add_(x)
...     return (w * 2).sum()
>>> [step(dtorch.ones(3, device_mesh=w.device_mesh)).item() for _ in range(4)]
[12.0, 18.0, 24.0, 30.0]
>>> step.replays
2

**Learning.** The first calls run the function, while the session shows this module every
record the calling thread appends (``Session.watch``). Each call's records are put in a
canonical form (``_observe``): an id made during the call becomes its index among those
(``m``), an id the previous call made its index there (``p``: a gradient one step makes and the
next drops), a tensor argument its position (``a``); any other id (a parameter, an optimizer's
moment) stays as it is (``x``). Once two calls in a row have the same form -- the same
operators, from the same lines, on the same ids, with the same scalars -- the later one is the
template (``Template``), sent to the controller once as its records with holes
(``protocol.DefineStep``). From then on a call allocates fresh ids for the made ones and sends
them, the previous call's and the arguments' ids, and the changing scalars as one ``Step``
record, which the controller expands or binds to the step's program
(``controller/step_templates.py``).

What a replay does as the function's Python would have:
- the scalars that change from step to step come from their providers (``scalars_from``): an
  optimizer's update gives its step counts, incremented as its ``step`` does, and the learning
  rate (and Adam's betas) a scheduler set;
- tensors the last call made and left in Python objects (a gradient, when ``zero_grad`` comes
  first in the step) hold the replay's ids afterwards, as if the replay had made them;
- the returned tensors are new each call and carry no autograd history (the step ran its own
  backward; one returned with history is returned as a copy without it): each call, learning
  or replaying, returns tensors of its own.

What it does not: any other effect of the function's Python (a print, a counter, a list
appended to) happens only in the calls that learn. A function that reads a value (``.item()``,
a fetch, a sync), draws random numbers (each call's seed is a different scalar), changes its
operators from call to call, or leaves made tensors in objects the next call does not drop
(autograd history kept past the step) is never replayed: after ``LEARN_CALLS`` calls without
two alike it runs as a plain function, and a warning says where its calls differed.

**Guards**, checked before each replay (one failing: the call learns again): the same runtime;
every tensor the template names (a parameter, a moment, an object given the replay's ids) alive
and holding the id it had; arguments of the same structure, non-tensor values and tensor
layouts; each provider's optimizer group with its other options unchanged.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import warnings
import weakref

import torch
from torch.utils import _pytree as pytree

from . import protocol as P
from .client import session as _session
from .tensor import DEFERRED_GRADS, Tensor, symbol

LEARN_CALLS = 8  # calls a step learns for before it runs as a plain function
_template_ids = itertools.count(1)  # DefineStep ids: one per ReplayedStep
# one call learns at a time in the process: the session has one watch (a second call that
# would learn meanwhile, on another thread, runs as Python)
_learning = threading.Lock()
_local = threading.local()  # ``watch``: the learning call's _Watch on this thread


class Unfit(Exception):
    """Why a call cannot be a template (told in the warning when the step gives up)."""


class Stale(Exception):
    """A provider's or a guard's: what the template was learnt on has changed."""


@contextlib.contextmanager
def scalars_from(check, values):
    """The one record issued inside that has scalar operands takes them, at each replay, from
    ``values()``: a list of the values in their order in the record, computed as the issuing
    code would compute them then (with its side effects: an optimizer's step counts).
    ``check()``, called with the guards (before any ``values()``), raises ``Stale`` when they
    no longer can be (what the record was learnt on changed). Outside a learning call it does
    nothing."""
    watch = getattr(_local, "watch", None)
    start = len(watch.records) if watch is not None else 0
    yield
    if watch is not None:
        watch.dynamic.append((start, len(watch.records), (check, values)))


class _Watch:
    """One learning call's records, as the session appends them."""

    def __init__(self, s):
        self.thread = threading.get_ident()
        self.records: list = []
        self.dynamic: list = []  # (first record, end, provider) per ``scalars_from``
        self.foreign = False  # another thread appended meanwhile: this call's form is unsure
        self.start_id = next(s.ids)  # ids above it are made during the call

    def __call__(self, record) -> None:
        if threading.get_ident() != self.thread:
            self.foreign = True
        elif not P.is_definition(record):  # (sent once; a replay uses them as they are)
            self.records.append(record)


class Hole:
    """An id in a canonical form: ``kind`` m (made by the call), p (by the previous call), a
    (a tensor argument), x (any other: kept as it is), and its index there (x: the id)."""

    __slots__ = ("k", "kind")

    def __init__(self, kind: str, k: int):
        self.kind, self.k = kind, k

    def __eq__(self, other) -> bool:
        return type(other) is Hole and other.kind == self.kind and other.k == self.k

    def __hash__(self) -> int:
        return hash((self.kind, self.k))

    def __repr__(self) -> str:
        return f"{self.kind}{self.k}"


DYNAMIC = Hole("dynamic", 0)  # a provider's scalar, in a form


class _Call:
    """One learning call, canonical (``_observe``): ``form`` (its records and outputs, as
    compared), ``made`` (its made ids, by index), what the template needs of it."""

    def __init__(self, form, made, entries, outputs, alive, released_prev, externals):
        self.form, self.made, self.entries = form, made, entries
        self.outputs, self.alive, self.released_prev = outputs, alive, released_prev
        self.externals = externals


_SCALARS = (int, float, bool, str, type(None), torch.dtype)


def _argument(leaf):
    """What a replay's argument must equal the template's in: a tensor's layout, a value."""
    if isinstance(leaf, Tensor):
        return leaf._spec
    if isinstance(leaf, _SCALARS):
        return _value(leaf)
    raise TypeError(f"a replayed step's arguments are dtorch tensors and Python scalars (in "
                    f"lists, tuples and dicts), not {type(leaf).__name__}: a replay would not "
                    f"see its contents change (make it a dtorch tensor, or read it in the step "
                    f"from where it lives)")


def _value(v):
    # 1 == 1.0 == True, but they travel as different scalars (an int operand keeps a dtype)
    return (type(v), v)


def _positions(s, record, cache: dict):
    """The positions of ``record`` (an Op or a Recorded) that hold ids, and of its scalars."""
    if record[0] == P.RECORDED:
        return (1, 2), ()
    call = record[P.OP_CALL]
    got = cache.get(call)
    if got is None:
        n_out = s.call_defs[call - 1][1]
        first = P.OP_OUTS + n_out
        ids = set(range(P.OP_OUTS, first)) | {first + k for k in s.id_operands[call - 1]}
        scalars = tuple(k for k in range(first, len(record)) if k not in ids)
        got = cache[call] = (tuple(sorted(ids)), scalars)
    return got


def _observe(s, watch: _Watch, args: dict, prev: dict, out_leaves: list) -> _Call:
    """The canonical form of a learning call's records (see the module docstring); raises
    Unfit for a call no replay can stand for."""
    if watch.foreign:
        raise Unfit("another thread issued operators while it ran")
    start, made, positions = watch.start_id, {}, {}
    externals: set = set()

    def ref(i: int) -> Hole:
        k = args.get(i)
        if k is not None:
            return Hole("a", k)
        if i > start:
            k = made.get(i)
            if k is None:
                k = made[i] = len(made)
            return Hole("m", k)
        k = prev.get(i)
        if k is not None:
            return Hole("p", k)
        externals.add(i)
        return Hole("x", i)

    dynamic, records = {}, watch.records
    for first, end, provider in watch.dynamic:
        carrying = [n for n in range(first, end) if type(records[n]) is not int
                    and records[n][0] == P.OP and _positions(s, records[n], positions)[1]]
        if len(carrying) != 1:
            raise Unfit(f"{len(carrying)} records with scalars came from one provider")
        dynamic[carrying[0]] = provider
    form, entries, released = [], [], set()
    for n, rec in enumerate(watch.records):
        if type(rec) is int:
            r = ref(rec)
            if r.kind in "xa":
                raise Unfit("it drops a tensor it did not make (an argument, or one made "
                            "before the previous call)")
            released.add(r)
            form.append(r)
            entries.append(r)
            continue
        if rec[0] not in (P.OP, P.RECORDED):
            raise Unfit(f"it {_WHAT.get(rec[0], 'sends a record')} inside the step")
        ids, scalars = _positions(s, rec, positions)
        refs = {k: ref(rec[k]) for k in ids}
        dyn = dynamic.get(n)
        dyn_at = frozenset(scalars) if dyn is not None else frozenset()
        form.append(tuple(refs[k] if k in refs else DYNAMIC if k in dyn_at else _value(v)
                          for k, v in enumerate(rec)))
        entries.append((list(rec), refs, tuple(sorted(dyn_at)), dyn))
    outputs = []
    for leaf in out_leaves:
        if isinstance(leaf, Tensor):
            r = ref(leaf._id)
            if r.kind == "p":
                raise Unfit("it returns a tensor the call before it made")
            outputs.append((r, leaf._spec, leaf._graph))
        else:
            outputs.append(_value(leaf))
    if DEFERRED_GRADS:
        raise Unfit("gradients are held unreduced (no_sync) past it")
    made_ids = sorted(made, key=made.get)
    alive = {Hole("m", k) for k in range(len(made))} - released - {o[0] for o in outputs
                                                                  if type(o[0]) is Hole}
    released_prev = {r for r in released if r.kind == "p"}
    form.append(("outputs", tuple(o[0] if type(o[0]) is Hole else o for o in outputs),
                 tuple(sorted(r.k for r in alive))))
    return _Call(tuple(form), made_ids, entries, outputs, alive, released_prev, externals)


_WHAT = {P.FETCH: "reads a value (a fetch: .item(), .tolist(), to_torch)",
         P.SYNC: "waits for the devices (a sync)", P.TRACE: "starts or stops a trace"}


def _holders(ids: set) -> dict:
    """id -> the live dtorch Tensors holding it, among ``ids``."""
    found: dict = {}
    for o in gc.get_objects():
        if issubclass(type(o), Tensor):  # (not isinstance: some objects warn on __class__)
            i = getattr(o, "_id", None)
            if i in ids:
                found.setdefault(i, []).append(o)
    return found


class Template:
    """A learnt call: its records with holes, sent to the controller once (``DefineStep``:
    a hole is an index into a replay's ids: made, then the previous call's made, then the
    arguments), what a replay returns and re-points, and what the guards check."""

    def __init__(self, s, call: _Call, arg_key, out_spec, n_args: int, template_id: int):
        self.session, self.arg_key = s, arg_key
        # a Step's ids: made, the previous call's made (as many: its form was the same), args
        self.n_made = len(call.made)
        base = {"m": 0, "p": self.n_made, "a": 2 * self.n_made}
        entries, self.providers = [], []
        for e in call.entries:
            if type(e) is Hole:
                entries.append(base[e.kind] + e.k)
                continue
            fields, holes, dyn_at, provider = e
            for k, h in holes.items():
                if h.kind != "x":
                    fields[k] = 0
            entries.append([fields, [[k, base[h.kind] + h.k] for k, h in holes.items()
                                     if h.kind != "x"], list(dyn_at)])
            if provider is not None:
                self.providers.append(provider)
        self.out_spec = out_spec
        found = _holders(call.externals | {call.made[r.k] for r in call.alive})
        # per output: ("m", index in env, spec, graph), ("a", the argument's position),
        # ("x", a weak reference to the tensor), or ("value", v)
        self.outputs = []
        for o in call.outputs:
            r = o[0]
            if type(r) is not Hole:
                self.outputs.append(("value", o[1]))
            elif r.kind == "m":
                self.outputs.append(("m", r.k, o[1], o[2]))
            elif r.kind == "a":
                self.outputs.append(("a", r.k))
            else:
                self.outputs.append(("x", weakref.ref(found[r.k][0])))
        self.externals = []
        for i in call.externals:  # (one not held by a tensor, a kept graph's key: not guarded)
            self.externals += [(weakref.ref(o), i) for o in found.get(i, ())]
        self.holders = []  # (a tensor the replay's made id k goes to, k)
        for r in call.alive:
            held = found.get(call.made[r.k])
            if not held:
                raise Unfit("it leaves a made id in an object other than a tensor (autograd "
                            "history kept past the step, or a graph's key)")
            self.holders += [(weakref.ref(o), r.k) for o in held]
        self.prev = call.made  # the ids the first replay's p refs name: the last call's
        self.n_records = len(entries)  # what flow control counts a replay as
        self.id = template_id  # (a step's next template replaces it on the controller)
        s.append(P.DefineStep(P.DEFINE_STEP, self.id, 2 * self.n_made + n_args, entries))

    def guard(self, s) -> None:
        if s is not self.session:
            raise Stale
        for ref, i in self.externals:  # (a returned one among them)
            o = ref()
            if o is None or o._id != i:
                raise Stale
        prev = self.prev
        for ref, k in self.holders:
            o = ref()
            if o is None or o._id != prev[k]:
                raise Stale
        for check, _ in self.providers:
            check()

    def replay(self, s, args: list):
        """Sends one replay with these tensor arguments; returns the output leaves."""
        dynamic = []
        for _, values in self.providers:
            dynamic += values()
        made = list(itertools.islice(s.ids, self.n_made))
        s.send_batch([(P.STEP, self.id, *made, *self.prev, *[t._id for t in args],
                       *dynamic)], weight=self.n_records)
        for ref, k in self.holders:
            o = ref()
            if o is not None:
                o._id = made[k]
        self.prev = made
        made_out: dict = {}  # (a tensor returned twice is one tensor)
        return [(made_out.get(o[1]) or made_out.setdefault(o[1], symbol(made[o[1]], o[2], o[3])))
                if o[0] == "m" else args[o[1]] if o[0] == "a" else o[1]() if o[0] == "x"
                else o[1] for o in self.outputs]


class ReplayedStep:
    """``dtorch.replayed_step(fn)``: calls ``fn`` until two calls in a row issue the same
    records, then replays them (see the module docstring). ``replays``: the calls replayed so
    far; ``reset()`` forgets what was learnt (after changing the model or the optimizer's
    options other than the learning rate, which the guards do not see)."""

    def __init__(self, fn):
        self.fn = fn
        self.__wrapped__ = fn
        self.__doc__ = getattr(fn, "__doc__", None)
        self.replays = 0
        self.template_id = next(_template_ids)  # the controller keeps one template a step
        # ... until the step is gone (not at exit: the runtime goes then anyway)
        self._drop = weakref.finalize(self, _session.release_step, self.template_id)
        self._drop.atexit = False
        self._lock = threading.RLock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.template = None
            self.last = None  # the last learning call's _Call
            self.last_key = None
            self.learnt = 0  # learning calls since the last template
            self.given_up = False
            self.why = None

    def __call__(self, *args, **kwargs):
        with self._lock:
            s = _session.current()  # (raises the runtime's failure)
            if s.alarm:
                s.raise_alarm()
            leaves, spec = pytree.tree_flatten((args, kwargs))
            key = (spec, tuple(map(_argument, leaves)),
                   tuple(t._graph for t in leaves if isinstance(t, Tensor)))
            template = self.template
            if template is not None:
                if key == template.arg_key:
                    try:
                        template.guard(s)
                        out = template.replay(s, [t for t in leaves
                                                  if isinstance(t, Tensor)])
                    except Stale:
                        pass
                    else:
                        self.replays += 1
                        return pytree.tree_unflatten(out, template.out_spec)
                self.template, self.last = None, None
            if self.given_up or not _learning.acquire(blocking=False):
                leaves, spec = pytree.tree_flatten(self.fn(*args, **kwargs))
                return pytree.tree_unflatten(list(map(_without_history, leaves)), spec)
            try:
                return self._learn(s, args, kwargs, leaves, key)
            finally:
                _learning.release()

    def _learn(self, s, args, kwargs, leaves, key):
        arg_ids: dict = {}  # id -> its first position among the tensor arguments
        for k, t in enumerate(t for t in leaves if isinstance(t, Tensor)):
            arg_ids.setdefault(t._id, k)
        gc.collect()  # earlier code's garbage is not this call's to drop
        enabled = gc.isenabled()
        gc.disable()
        watch = _Watch(s)
        s.watch = _local.watch = watch
        try:
            out_leaves, out_spec = pytree.tree_flatten(self.fn(*args, **kwargs))
            out_leaves = [_without_history(t) for t in out_leaves]
            result = pytree.tree_unflatten(out_leaves, out_spec)
            gc.collect()  # this call's garbage: its drops are the call's records
        finally:
            s.watch = _local.watch = None
            if enabled:
                gc.enable()
        prev = self.last
        try:
            call = _observe(s, watch, arg_ids,
                            {i: k for k, i in enumerate(prev.made)} if prev else {}, out_leaves)
        except Unfit as e:
            self.why, call = str(e), None
        if call is not None and prev is not None and key == self.last_key \
                and call.form == prev.form:
            try:
                if call.released_prev != {Hole("p", r.k) for r in prev.alive}:
                    raise Unfit("it leaves made tensors the next call does not drop")
                self.template = Template(s, call, key, out_spec,
                                         sum(isinstance(t, Tensor) for t in leaves),
                                         self.template_id)
            except Unfit as e:
                self.why = str(e)
            else:
                self.learnt, self.last = 0, None
                return result
        elif call is not None and prev is not None:
            self.why = _difference(s, prev.form, call.form)
        self.last, self.last_key = call, key
        self.learnt += 1
        if self.learnt >= LEARN_CALLS:
            self.given_up, self.last = True, None
            warnings.warn(f"dtorch.replayed_step({getattr(self.fn, '__name__', self.fn)}): "
                          f"no two of {LEARN_CALLS} calls in a row issued the same records, "
                          f"so it runs as a plain function from now on: {self.why}",
                          stacklevel=3)
        return result


def _without_history(leaf):
    """A returned tensor with autograd history, as a copy without it (a detached view would
    keep the history's tensor alive past the step, which the controller's replays refuse);
    anything else as it is."""
    if isinstance(leaf, Tensor) and getattr(leaf, "_node", None) is not None:
        with torch.no_grad():
            return leaf.clone()
    return leaf


def _difference(s, before: tuple, after: tuple) -> str:
    """Where two calls' forms first differ, as the warning names it."""
    for n, (a, b) in enumerate(zip(before, after)):
        if a != b:
            if type(b) is tuple and b and b[0] == _value(P.OP):
                op, _ = s.call_defs[b[1][1] - 1]
                where = s.site_names[b[2][1]] if b[2][1] < len(s.site_names) else "?"
                return f"the calls differ at their record {n}, dtorch.{op} called at {where}"
            return f"the calls differ at their record {n}"
    return f"one call issued {len(before)} records, the next {len(after)}"


def replayed_step(fn) -> ReplayedStep:
    """Decorator: ``fn``, replayed once two calls in a row issue the same records (see
    ``dtorch.step_replay``)."""
    return ReplayedStep(fn)
