"""The one registry through which hf_sp_trainer swaps library code (transformers, TRL, accelerate, torch, Python).

Every replacement of an attribute we don't own goes through ``patch``: a module function (the MoE router loss, the
hybrid mixers' kernels), a class attribute (MiniMax's lightning-attention forward), an interpreter hook
(``sys.excepthook``), or a member of one object (a model's ``forward``, a layer's ``__class__``). ``patch``

- runs a **check** of the installed behaviour first (``check(current)`` raising, or returning ``False``, refuses the
  patch with a ``PatchRefused`` that names the target, the installed version and the fix; the target is left
  unchanged). A patch without a check must say why none is possible (``unchecked=``);
- records the target and keeps the original, so ``applied()`` lists what is live and ``undo`` / ``undo_all`` restore
  the originals (the owner's own attribute, or none: an inherited attribute is deleted again);
- is idempotent: patching a target again returns its record (nothing stacks); a module or class attribute someone else
  replaced after us raises instead of wrapping their replacement (an object's method wrapped over ours by the host,
  such as accelerate's mixed-precision ``forward``, is still ours underneath: its record is returned);
- logs one debug line when a patch goes live (logger ``hf_sp_trainer.patches``).

Patches of one object (not a module or class) are held weakly: when the object dies its record goes with it.
docs/patches.md lists every patch the package can apply, with its reason and check.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import platform
import re
import threading
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

ORIGINAL_ATTR = "_hf_sp_original"  # set on function replacements: the library's own function (tests, scripts)
_NOTHING = object()  # no attribute of the owner's own (inherited, or absent)
_LOCK = threading.RLock()


class PatchRefused(ValueError):
    """A patch whose check failed against the installed library: nothing was changed."""


@dataclass
class _Values:
    """What a patch swapped: kept by the registry for a module or class, in the object itself for an object's patch
    (so that the registry holds the object only weakly, though a replacement such as a bound method refers to it)."""

    replacement: Any
    original: Any  # the owner's own attribute before (None with ``inherited``)
    inherited: bool  # the owner had none of its own (the attribute came from its class / bases): undo deletes ours
    before: Any  # ``getattr(owner, name)`` before the patch (what ``original()`` returns)
    on_undo: Callable[[Any], None] | None


_VALUES_ATTR = "_hf_sp_patched"  # an object's own dict: attribute name -> _Values


@dataclass(eq=False)
class Patch:
    """One swap: ``owner.name`` replaced by ``replacement`` (``label``: ``module.Class.attr``, or
    ``module.Class[where].attr`` for one object), why (``reason``) and what was checked first (``check``)."""

    label: str
    reason: str
    check: str  # what was checked before applying, or "none: <why no check is possible>"
    name: str
    _owner: Callable[[], Any] = field(repr=False)  # a strong (module, class) or weak (object) reference
    _values: _Values | None = field(default=None, repr=False)  # None: in the object's own dict

    @property
    def owner(self) -> Any:
        return self._owner()

    @property
    def per_object(self) -> bool:
        return self._values is None

    def _get(self) -> _Values | None:
        if self._values is not None:
            return self._values
        owner = self.owner
        return None if owner is None else vars(owner)[_VALUES_ATTR][self.name]

    @property
    def replacement(self) -> Any:
        return self._get().replacement

    @property
    def original(self) -> Any:
        return self._get().original

    @property
    def inherited(self) -> bool:
        return self._get().inherited

    @property
    def before(self) -> Any:
        return self._get().before

    def in_place(self) -> bool:
        """The owner still exists and holds our replacement itself (not something put over it since)."""
        owner = self.owner
        return owner is not None and _current(owner, self.name) is self.replacement

    def undo(self) -> None:
        """Restore the original (``RuntimeError`` if someone replaced ours since: undoing would drop theirs)."""
        undo(self)


_PATCHES: dict[tuple[int, str], Patch] = {}


def _current(owner: Any, name: str) -> Any:
    """What ``owner.name`` is now, as ``patch`` compares it (the raw class attribute: not a bound method)."""
    if name == "__class__":
        return type(owner)
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in vars(klass):
                return vars(klass)[name]
        return _NOTHING
    own = getattr(owner, "__dict__", None)
    if own is not None and name in own:
        return own[name]
    return getattr(owner, name, _NOTHING)


def _own(owner: Any, name: str) -> Any:
    """The owner's own attribute (what an undo puts back), or ``_NOTHING``."""
    if name == "__class__":
        return type(owner)
    own = getattr(owner, "__dict__", None)
    if own is None:
        return getattr(owner, name, _NOTHING)
    return own.get(name, _NOTHING)


def _qualified(owner: Any) -> str:
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    cls = owner if isinstance(owner, type) else type(owner)
    return f"{cls.__module__}.{cls.__qualname__}"


def _label(owner: Any, name: str, where: str | None) -> str:
    if isinstance(owner, (type, types.ModuleType)):
        return f"{_qualified(owner)}.{name}"
    return f"{_qualified(owner)}[{where or f'0x{id(owner):x}'}].{name}"


def _top_module(owner: Any) -> str:
    if isinstance(owner, types.ModuleType):
        return owner.__name__.split(".")[0]
    cls = owner if isinstance(owner, type) else type(owner)
    return cls.__module__.split(".")[0]


def installed_version(owner: Any) -> str:
    """``"transformers 5.24.0"``: the distribution that defines ``owner`` (Python itself for the interpreter's)."""
    top = _top_module(owner)
    if top in ("sys", "builtins", "os"):
        return f"Python {platform.python_version()}"
    for dist in importlib.metadata.packages_distributions().get(top, [top]):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"{top} (version unknown)"


def tested_requirement(owner: Any) -> str | None:
    """The requirement hf_sp_trainer declares for ``owner``'s distribution (``"transformers<5.25,>=5.24"``)."""
    top = _top_module(owner).replace("_", "-").lower()
    try:
        requirements = importlib.metadata.requires("hf_sp_trainer") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for requirement in requirements:
        spec = requirement.split(";")[0].strip()
        name = re.match(r"[A-Za-z0-9_.-]+", spec)
        if name and name.group(0).replace("_", "-").lower() == top:
            return spec
    return None


def _describe(check: Callable | None, unchecked: str | None) -> str:
    if check is None:
        return f"none: {unchecked}"
    while isinstance(check, functools.partial):
        check = check.func
    name = getattr(check, "__qualname__", None) or type(check).__qualname__
    doc = (getattr(check, "__doc__", None) or "").strip().split("\n\n")[0]
    doc = " ".join(doc.split())
    return f"{getattr(check, '__module__', '')}.{name}" + (f": {doc}" if doc else "")


def _refuse(label: str, reason: str, owner: Any, detail: str, fix: str | None) -> PatchRefused:
    requirement = tested_requirement(owner)
    tested = f"; hf_sp_trainer is tested with {requirement}" if requirement else ""
    advice = f" {fix}" if fix else ""
    return PatchRefused(
        f"{detail} [hf_sp_trainer refused to patch {label} ({reason}): installed {installed_version(owner)}"
        f"{tested}.{advice}]"
    )


def _reference(owner: Any) -> Callable[[], Any]:
    owner_id = id(owner)
    return weakref.ref(owner, lambda _: _forget(owner_id))


def _forget(owner_id: int) -> None:
    with _LOCK:
        for key in [k for k in _PATCHES if k[0] == owner_id]:
            record = _PATCHES[key]
            if record.owner is None:
                del _PATCHES[key]


def patch(
    owner: Any,
    name: str,
    replacement: Any = _NOTHING,
    *,
    wrap: Callable[[Any], Any] | None = None,
    check: Callable[[Any], Any] | None = None,
    unchecked: str | None = None,
    reason: str,
    fix: str | None = None,
    where: str | None = None,
    on_undo: Callable[[Any], None] | None = None,
) -> Patch:
    """Replace ``owner.name`` (a module, class or object attribute; ``"__class__"`` swaps an object's class).

    ``replacement`` is the new value, or ``wrap(current)`` builds it from the current one. ``check(current)`` runs
    first, against what is installed (for a class attribute: the raw function; for ``__class__``: the class): an
    exception or a ``False`` refuses the patch (``PatchRefused``, naming the installed version and ``fix``) and
    changes nothing. Without a check, ``unchecked`` says why none is possible. ``reason``: why SP needs the patch.
    ``where`` names an object in a label (a module path in a model). ``on_undo(owner)`` runs after an undo.
    Returns the record; a target patched already returns its record unchanged.
    """
    if (replacement is _NOTHING) == (wrap is None):
        raise TypeError("patch() takes a replacement or wrap=, exactly one of them.")
    if check is None and not unchecked:
        raise TypeError(f"patch({_qualified(owner)}.{name}): give check=, or unchecked= saying why none is possible.")
    with _LOCK:
        key = (id(owner), name)
        existing = _PATCHES.get(key)
        if existing is not None and existing.owner is owner:
            # An object's method may be wrapped over ours by the host (accelerate's mixed-precision forward): still
            # in effect. A module or class attribute replaced since is someone else's: SP would silently be bypassed.
            if existing.in_place() or existing.per_object:
                return existing
            raise RuntimeError(
                f"{existing.label} was replaced by someone else after hf_sp_trainer patched it ({existing.reason}); "
                "hf_sp_trainer does not patch over another replacement."
            )
        label = _label(owner, name, where)
        if any(p.label == label for p in _PATCHES.values()):
            label = _label(owner, name, f"{where}@0x{id(owner):x}" if where else None)
        current = _current(owner, name)
        effective = getattr(owner, name) if current is not _NOTHING else None
        if check is not None:
            try:
                ok = check(effective)
            except Exception as error:  # noqa: BLE001 - any failure of the check refuses the patch
                raise _refuse(label, reason, owner, str(error) or type(error).__name__, fix) from error
            if ok is False:
                raise _refuse(label, reason, owner, f"{label} no longer behaves as {reason} assumes", fix)
        new = wrap(effective) if wrap is not None else replacement
        if callable(new) and isinstance(new, types.FunctionType) and effective is not None:
            try:
                setattr(new, ORIGINAL_ATTR, effective)
            except (AttributeError, TypeError):
                pass
        original = _own(owner, name)
        setattr(owner, name, new)
        values = _Values(
            replacement=_current(owner, name),
            original=None if original is _NOTHING else original,
            inherited=original is _NOTHING,
            before=effective,
            on_undo=on_undo,
        )
        per_object = not isinstance(owner, (type, types.ModuleType)) and hasattr(owner, "__dict__")
        if per_object:
            vars(owner).setdefault(_VALUES_ATTR, {})[name] = values
        record = Patch(
            label=label,
            reason=reason,
            check=_describe(check, unchecked),
            name=name,
            _owner=_reference(owner) if per_object else (lambda: owner),
            _values=None if per_object else values,
        )
        _PATCHES[key] = record
    logger.debug("patched %s (%s); checked: %s", record.label, reason, record.check)
    return record


def find(owner: Any, name: str) -> Patch | None:
    """The live record of ``owner.name``, if hf_sp_trainer patched it."""
    with _LOCK:
        record = _PATCHES.get((id(owner), name))
    return record if record is not None and record.owner is owner else None


def original(owner: Any, name: str) -> Any:
    """``owner.name`` as it was before hf_sp_trainer patched it (the attribute itself if it is not patched)."""
    record = find(owner, name)
    return getattr(owner, name) if record is None else record.before


def _restore(owner: Any, name: str, values: _Values) -> None:
    if name == "__class__":
        owner.__class__ = values.original
    elif values.inherited:
        delattr(owner, name)
    else:
        setattr(owner, name, values.original)


def applied() -> list[Patch]:
    """The patches in effect now, in the order they were applied (an object's method another library wrapped since,
    such as accelerate's mixed-precision forward, is still in effect: ``in_place()`` is False for it)."""
    with _LOCK:
        return [p for p in _PATCHES.values() if p.owner is not None]


def table(patches: list[Patch] | None = None) -> list[tuple[str, str, str]]:
    """``(label, reason, check)`` of ``patches`` (default: ``applied()``)."""
    return [(p.label, p.reason, p.check) for p in (applied() if patches is None else patches)]


def undo(target: Patch | str, *, force: bool = False) -> None:
    """Restore the original of one patch (a record or its label). ``RuntimeError`` if someone replaced our replacement
    since (undoing would drop theirs) unless ``force``."""
    with _LOCK:
        if isinstance(target, str):
            matches = [p for p in _PATCHES.values() if p.label == target]
            if not matches:
                raise KeyError(f"no live hf_sp_trainer patch is labelled {target!r}")
            target = matches[0]
        owner = target.owner
        key = next((k for k, p in _PATCHES.items() if p is target), None)
        if key is None or owner is None:
            return
        if not target.in_place() and not force:
            raise RuntimeError(
                f"{target.label} was replaced or wrapped by someone else after hf_sp_trainer patched it: not undone "
                "(restoring the original would drop theirs)."
            )
        values = target._get()
        del _PATCHES[key]
        _restore(owner, target.name, values)
        if target.per_object:
            vars(owner)[_VALUES_ATTR].pop(target.name, None)
    if values.on_undo is not None:
        values.on_undo(owner)
    logger.debug("unpatched %s", target.label)


def undo_all() -> list[str]:
    """Undo every patch, newest first; returns the labels restored. Raises (after undoing the others) naming those
    another library replaced or wrapped since, which stay."""
    done, kept = [], []
    for record in reversed(applied()):
        if record.in_place():
            undo(record)
            done.append(record.label)
        else:
            kept.append(record.label)
    if kept:
        raise RuntimeError(f"not undone (replaced or wrapped by someone else since hf_sp_trainer patched them): {kept}")
    return done


__all__ = [
    "ORIGINAL_ATTR",
    "Patch",
    "PatchRefused",
    "applied",
    "find",
    "installed_version",
    "original",
    "patch",
    "table",
    "tested_requirement",
    "undo",
    "undo_all",
]
