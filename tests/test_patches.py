"""The patch registry (``hf_sp_trainer.patches``): every swap of library code goes through it, checked first, listed by
``applied()``, undone by ``undo`` / ``undo_all``; and what an SP model or trainer built in this process applies."""

from __future__ import annotations

import gc
import logging
import sys
import types

import pytest
import torch

from hf_sp_trainer import patches


@pytest.fixture
def dummy():
    """A module with a function, a class with a method, and an object: what the registry patches."""
    module = types.ModuleType("dummy_library")

    def double(x):
        return 2 * x

    class Layer:
        def forward(self, x):
            return x + 1

        @staticmethod
        def helper():
            return "static"

    class Child(Layer):
        pass

    module.double, module.Layer, module.Child = double, Layer, Child
    for obj in (double, Layer, Child):
        obj.__module__ = "dummy_library"
    sys.modules["dummy_library"] = module
    yield module
    sys.modules.pop("dummy_library", None)
    for record in patches.applied():
        if record.label.startswith("dummy_library"):
            patches.undo(record, force=True)


def doubles(fn) -> None:
    """The installed function doubles its input."""
    if fn(3) != 6:
        raise ValueError("it no longer doubles")


def test_patch_is_listed_checked_and_undone(dummy, caplog):
    original = dummy.double
    with caplog.at_level(logging.DEBUG, logger="hf_sp_trainer.patches"):
        record = patches.patch(dummy, "double", wrap=lambda f: lambda x: f(x) + 1, check=doubles, reason="testing")
    assert dummy.double(3) == 7 and record.label == "dummy_library.double"
    assert patches.original(dummy, "double") is original
    assert ("dummy_library.double", "testing", record.check) in patches.table()
    assert "doubles its input" in record.check
    assert [r.message for r in caplog.records].count(
        f"patched dummy_library.double (testing); checked: {record.check}"
    ) == 1
    patches.undo("dummy_library.double")
    assert dummy.double is original  # identity: the very function, not a copy
    assert patches.find(dummy, "double") is None


def test_patching_twice_does_not_stack(dummy):
    first = patches.patch(dummy, "double", wrap=lambda f: lambda x: f(x) + 1, check=doubles, reason="testing")
    second = patches.patch(dummy, "double", wrap=lambda f: lambda x: f(x) + 1, check=doubles, reason="testing")
    assert first is second and dummy.double(3) == 7  # not 8


def test_a_failing_check_refuses_and_changes_nothing(dummy):
    original = dummy.double
    dummy.double = lambda x: 3 * x  # "a new release" that changed the function
    changed = dummy.double
    with pytest.raises(patches.PatchRefused, match=r"it no longer doubles \[hf_sp_trainer refused to patch") as error:
        patches.patch(dummy, "double", replacement=original, check=doubles, reason="testing", fix="Pin it.")
    assert "installed dummy_library (version unknown)" in str(error.value) and "Pin it." in str(error.value)
    assert dummy.double is changed and patches.find(dummy, "double") is None


def test_a_check_returning_false_refuses(dummy):
    with pytest.raises(patches.PatchRefused, match="no longer behaves as testing assumes"):
        patches.patch(dummy, "double", replacement=abs, check=lambda fn: False, reason="testing")


def test_the_refusal_names_the_installed_version_and_the_tested_range():
    import transformers.models.mixtral.modeling_mixtral as mixtral

    with pytest.raises(patches.PatchRefused) as error:
        patches.patch(mixtral, "load_balancing_loss_func", replacement=abs, check=lambda fn: False, reason="testing")
    message = str(error.value)
    assert f"installed transformers {__import__('transformers').__version__}" in message
    assert "hf_sp_trainer is tested with transformers" in message and "<5.25" in message
    assert patches.find(mixtral, "load_balancing_loss_func") is None


def test_a_patch_needs_a_check_or_a_reason_for_none(dummy):
    with pytest.raises(TypeError, match="unchecked="):
        patches.patch(dummy, "double", replacement=abs, reason="testing")
    record = patches.patch(dummy, "double", replacement=abs, unchecked="nothing to rely on", reason="testing")
    assert record.check == "none: nothing to rely on"


def test_class_attributes_own_and_inherited(dummy):
    own = vars(dummy.Layer)["helper"]
    patches.patch(dummy.Layer, "helper", replacement=staticmethod(lambda: "ours"), unchecked="test", reason="testing")
    patches.patch(dummy.Child, "forward", wrap=lambda f: lambda self, x: f(self, x) * 10, check=callable, reason="t")
    assert dummy.Layer.helper() == "ours" and dummy.Child().forward(1) == 20 and dummy.Layer().forward(1) == 2
    for record in reversed([r for r in patches.applied() if r.label.startswith("dummy_library")]):
        patches.undo(record)
    assert vars(dummy.Layer)["helper"] is own and "forward" not in vars(dummy.Child)  # inherited: ours deleted
    assert dummy.Child().forward(1) == 2


def test_someone_elses_replacement_is_not_patched_over_or_undone(dummy):
    patches.patch(dummy, "double", wrap=lambda f: lambda x: f(x) + 1, check=doubles, reason="testing")
    theirs = dummy.double = lambda x: 0
    with pytest.raises(RuntimeError, match="replaced by someone else"):
        patches.patch(dummy, "double", replacement=abs, check=callable, reason="testing")
    with pytest.raises(RuntimeError, match="not undone"):
        patches.undo("dummy_library.double")
    assert dummy.double is theirs


def test_object_patches_are_held_weakly_and_undone(dummy):
    layer = dummy.Layer()

    class Faster(dummy.Layer):
        pass

    record = patches.patch(layer, "__class__", replacement=Faster, check=callable, reason="testing", where="layers.0")
    bound = patches.patch(layer, "forward", wrap=lambda f: types.MethodType(lambda self, x: f(x) - 1, f.__self__),
                          check=callable, reason="testing")  # fmt: skip
    assert type(layer) is Faster and layer.forward(1) == 1
    assert record.label.endswith("Layer[layers.0].__class__") and record in patches.applied()
    patches.undo(bound)
    assert "forward" not in vars(layer) and layer.forward(1) == 2
    patches.undo(record)
    assert type(layer) is dummy.Layer
    patches.patch(layer, "forward", wrap=lambda f: types.MethodType(lambda self, x: f(x), f.__self__), check=callable,
                  reason="testing")  # fmt: skip
    del layer
    gc.collect()
    assert not [r for r in patches.applied() if "Layer[" in r.label]  # the record died with the object


def test_teardown_excepthook_goes_through_the_registry(monkeypatch):
    from hf_sp_trainer.topology import teardown

    earlier = patches.find(sys, "excepthook")  # a trainer built earlier in this process registered it
    if earlier is not None:
        patches.undo(earlier)
    monkeypatch.setitem(teardown._state, "registered", False)
    monkeypatch.setattr(teardown.atexit, "register", lambda fn: None)
    before = sys.excepthook
    teardown.register_exit_hook()
    record = patches.find(sys, "excepthook")
    assert record is not None and record.label == "sys.excepthook" and sys.excepthook is not before
    patches.undo(record)
    assert sys.excepthook is before


def test_router_loss_swap_is_listed_and_undone():
    """A MoE model's router loss: the swap of its modeling module's function (and Mixtral's, for TRL's fused head)."""
    import torch.distributed as dist

    from hf_sp_trainer.losses.router import RouterLoss
    from tests.harness import tiny_model

    model = tiny_model("qwen3_moe")
    module = sys.modules[type(model).__module__]
    original = module.load_balancing_loss_func
    RouterLoss(group=dist.group.WORLD).attach(model)
    label = f"{type(model).__module__}.load_balancing_loss_func"
    record = next(r for r in patches.applied() if r.label == label)
    assert "computes_the_formula" in record.check or "check_the_formula" in record.check
    assert module.load_balancing_loss_func is not original
    RouterLoss(group=dist.group.WORLD).attach(model)  # a second model: no second layer
    assert module.load_balancing_loss_func.__wrapped__ is original
    patches.undo(record)
    assert module.load_balancing_loss_func is original
    torch.manual_seed(0)
