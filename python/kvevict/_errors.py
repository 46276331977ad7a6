"""kvevict's wording of pybind11's "incompatible function arguments" TypeError.

The extension (python/src/bindings.cpp, ``type_errors``) wraps the dispatcher of every function,
method, constructor and property setter it binds; when pybind11 finds no overload that converts
the arguments, it calls ``explain`` here with the call's site, the function's docstring (whose
first lines are pybind11's signatures) and the arguments. The message names the function, the
argument, the type it takes and the type it got (never the value: a tensor's repr is kilobytes),
e.g. ``kvevict: attend: cache must be an MlaCache, got MlaLatentCache; for the latent layout use
attend_absorbed(q_absorbed, q_pe, cache, layer)``. It returns None to keep pybind11's message.
"""

from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Tuple

import torch

_SIGNATURE = re.compile(r"^(?:\d+\. )?(\w*)\((.*)\)(?: -> (.*))?$")
_PARAM = re.compile(r"^(\w+)(?:: (.*?))?(?: = (.*))?$")
_SCORERS = ("CumulativeAttention", "MeanObservedAttention", "LatestAttention", "DecayedAttention", "SnapKV")


def _split_top(text: str, sep: str) -> List[str]:
    """Splits at `sep` outside brackets."""
    out, depth, cur, i = [], 0, "", 0
    while i < len(text):
        ch = text[i]
        if ch in "[(<{":
            depth += 1
        elif ch in "])>}":
            depth -= 1
        if depth == 0 and text.startswith(sep, i):
            out.append(cur)
            cur, i = "", i + len(sep)
            continue
        cur += ch
        i += 1
    out.append(cur)
    return [p.strip() for p in out if p.strip()]


class _Param:
    __slots__ = ("name", "annotation", "has_default", "kw_only")

    def __init__(self, name: str, annotation: str, has_default: bool, kw_only: bool):
        self.name, self.annotation, self.has_default, self.kw_only = name, annotation, has_default, kw_only


def _signatures(doc: str) -> List[List[_Param]]:
    sigs = []
    for line in (doc or "").splitlines():
        m = _SIGNATURE.match(line.strip())
        if not m:
            continue
        if m.group(2) == "*args, **kwargs":  # the header of an overloaded function's docstring
            continue
        params, kw_only = [], False
        for p in _split_top(m.group(2), ","):
            if p == "*":
                kw_only = True
                continue
            if p.startswith("*"):  # *args / **kwargs: takes anything
                return []
            pm = _PARAM.match(p)
            if not pm:
                return []
            params.append(_Param(pm.group(1), pm.group(2) or "object", pm.group(3) is not None, kw_only))
        sigs.append(params)
    return sigs


def _short(annotation: str) -> str:
    return re.sub(r"\bkvevict\._kvevict\.", "", annotation)


def _pretty(annotation: str) -> str:
    """An annotation as the stubs write it: int, float, list[int], MlaCache."""
    a = _short(annotation)
    a = a.replace("typing.SupportsInt | typing.SupportsIndex", "int")
    a = a.replace("typing.SupportsFloat | typing.SupportsIndex", "float")
    return a.replace("collections.abc.Sequence[", "list[")


def _resolve(name: str):
    from . import _kvevict
    obj = _kvevict
    for part in _short(name).split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, type) else None


def _is_int(v) -> bool:
    return not isinstance(v, (float, str, bytes)) and (isinstance(v, int) or hasattr(type(v), "__index__"))


def _is_float(v) -> bool:
    return not isinstance(v, (str, bytes)) and (hasattr(type(v), "__float__") or hasattr(type(v), "__index__"))


_SIMPLE: Dict[str, Tuple[Callable[[object], bool], str]] = {
    "typing.SupportsInt": (_is_int, "an int"),
    "typing.SupportsIndex": (_is_int, "an int"),
    "int": (_is_int, "an int"),
    "typing.SupportsFloat": (_is_float, "a float"),
    "float": (_is_float, "a float"),
    "bool": (lambda v: isinstance(v, (bool, int)) or v is None or hasattr(type(v), "__bool__"), "a bool"),
    "str": (lambda v: isinstance(v, str), "a str"),
    "None": (lambda v: v is None, "None"),
    "torch.Tensor": (lambda v: isinstance(v, torch.Tensor), "a torch.Tensor"),
    "at::Tensor": (lambda v: isinstance(v, torch.Tensor), "a torch.Tensor"),
    "torch.dtype": (lambda v: isinstance(v, torch.dtype), "a torch.dtype"),
    "torch.device": (lambda v: isinstance(v, torch.device), "a torch.device"),
    "object": (lambda v: True, "any object"),
}


def _article(name: str) -> str:
    return ("an " if name[:1] in "AEIOU" or name.startswith(("Mla", "Lse")) else "a ") + name


def _check(annotation: str, v) -> Tuple[Optional[bool], str]:
    """(whether `v` fits, what the annotation takes in words); None: cannot tell."""
    alts = _split_top(annotation, "|")
    if len(alts) > 1:
        names = [_short(a) for a in alts]
        if all(n in names for n in _SCORERS):  # the scorer argument
            ok = [_check(a, v)[0] for a in alts]
            return (True if any(o for o in ok) else (None if None in ok else False),
                    "a scorer (" + ", ".join(_SCORERS) + ") or a scorer name")
        results = [_check(a, v) for a in alts]
        words = list(dict.fromkeys(w for _, w in results))
        ok = [r[0] for r in results]
        fit = True if any(o for o in ok) else (None if None in ok else False)
        return fit, " or ".join(words)
    a = annotation.strip()
    if a in _SIMPLE:
        check, words = _SIMPLE[a]
        return check(v), words
    m = re.match(r"^(?:collections\.abc\.Sequence|typing\.Sequence|List|list|Sequence)\[(.*)\]$", a)
    if m:
        inner = m.group(1)
        _, words = _check(inner, 0)
        if not isinstance(v, (list, tuple)):
            return False, f"a list of {words.split(' ', 1)[-1]}s"
        return all(_check(inner, x)[0] is not False for x in v), f"a list of {words.split(' ', 1)[-1]}s"
    m = re.match(r"^Optional\[(.*)\]$", a)
    if m:
        return _check(m.group(1) + " | None", v)
    cls = _resolve(a)
    if cls is not None:
        return isinstance(v, cls), _article(cls.__qualname__)
    return None, _short(a)


def _got(v) -> str:
    if v is None:
        return "None"
    if isinstance(v, (list, tuple)) and v:
        kinds = sorted({type(x).__name__ for x in v})
        return f"{type(v).__name__} of {', '.join(kinds)}"
    return type(v).__name__


def _bind(params: List[_Param], args: tuple, kwargs: dict) -> Tuple[Optional[str], Dict[str, object]]:
    """Python's binding of the call to one signature: (structural problem or None, name -> value)."""
    positional = [p for p in params if not p.kw_only]
    bound: Dict[str, object] = {}
    if len(args) > len(positional):
        n = len(positional)
        return f"takes at most {n} positional argument{'' if n == 1 else 's'}, got {len(args)}", bound
    for p, v in zip(positional, args):
        bound[p.name] = v
    names = {p.name for p in params}
    for k, v in kwargs.items():
        if k not in names:
            return f"has no argument '{k}' (its arguments: {', '.join(p.name for p in params)})", bound
        if k in bound:
            return f"got {k} twice (by position and by keyword)", bound
        bound[k] = v
    missing = [p.name for p in params if p.name not in bound and not p.has_default]
    if missing:
        return "missing argument " + ", ".join(missing), bound
    return None, bound


def _hint(where: str, name: str, v) -> str:
    """A pointer to the call that takes `v`, where there is one."""
    from . import _kvevict
    func = where.split(".")[-1]
    if name == "cache" and isinstance(v, _kvevict.MlaLatentCache) and hasattr(_kvevict, func + "_absorbed"):
        call = {"attend": "attend_absorbed(q_absorbed, q_pe, cache, layer)",
                "observe_lse": "observe_lse_absorbed(q_absorbed, q_pe, cache, layer, lse)"}.get(
                    func, func + "_absorbed(...)")
        return f"; for the latent layout use {call}"
    if name == "cache" and isinstance(v, _kvevict.MlaCache) and func.endswith("_absorbed"):
        return f"; for the expanded layout use {func[:-len('_absorbed')]}(...)"
    if isinstance(v, str) and isinstance(getattr(torch, v, None), torch.dtype):
        return f"; use torch.{v}"
    if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point() is False:
        return "; use int(t) for a 0-d tensor"
    return ""


def explain(where: str, kind: str, doc: str, args: tuple, kwargs: dict) -> Optional[str]:
    """kvevict's TypeError message for a call of `where` that no overload converts (see the module
    docstring), or None to keep pybind11's."""
    sigs = _signatures(doc)
    if not sigs:
        return None
    if kind in ("method", "init", "getter", "setter"):
        sigs = [s[1:] for s in sigs]
        args = args[1:]
    if kind == "setter":
        if not args:
            return None
        ok, words = _check(sigs[0][0].annotation if sigs and sigs[0] else "object", args[0])
        if ok is not False:
            return None
        return f"kvevict: {where} must be {words}, got {_got(args[0])}{_hint(where, where.split('.')[-1], args[0])}"
    problems = []  # per overload: (rank, message): a wrong type ranks before a wrong count or name
    for params in sigs:
        structural, bound = _bind(params, args, kwargs)
        bad = []
        for p in params:
            if p.name not in bound:
                continue
            ok, words = _check(p.annotation, bound[p.name])
            if ok is False:
                bad.append(f"{p.name} must be {words}, got {_got(bound[p.name])}{_hint(where, p.name, bound[p.name])}")
        if structural:
            problems.append((1000 + len(bad), "; ".join(bad + [structural])))
        else:
            problems.append((1 + len(bad), "; ".join(bad)) if bad else (0, ""))
    best = min(r for r, _ in problems)
    messages = list(dict.fromkeys(m for r, m in problems if r == best))
    if best == 0 or len(messages) > 1 or not any(messages):
        # it cannot tell which argument (or which form): the forms it takes and the types it got
        forms = " or ".join("(" + ", ".join(f"{p.name}: {_pretty(p.annotation)}" for p in params) + ")"
                            for params in sigs)
        got = ", ".join([_got(a) for a in args] + [f"{k}={_got(v)}" for k, v in kwargs.items()])
        return f"kvevict: {where}: takes {forms}, got ({got})"
    return f"kvevict: {where}: {messages[0]}"
