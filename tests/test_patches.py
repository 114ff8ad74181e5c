"""The patch registry (``hf_sp_trainer.patches``): every swap of library code goes through it, checked first, listed by
``applied()``, undone by ``undo`` / ``undo_all``; and what an SP model or trainer built in this process applies."""

from __future__ import annotations

import ast
import gc
import importlib
import logging
import pathlib
import sys
import types

import pytest
import torch

from hf_sp_trainer import patches

pytestmark = pytest.mark.unit  # in-process


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
    assert "hf_sp_trainer is tested with transformers" in message and "<5.26" in message
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


# -- nothing swaps library code around the registry ------------------------------------------------------------------
PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hf_sp_trainer"
# (file, function): the places allowed to do what the scan below flags, and why
ALLOWED = {
    ("memory/arguments.py", "resolve_deprecated_flags"): "our own config's deprecated field moved to its new name",
    ("integrations/accelerate_sp.py", "apply_environ"): "the one entry point of the accelerate SP route",
    ("cli/launch.py", "train_or_launch"): "every command's entry point: DeepSpeed's accelerator (setdefault)",
    ("trainers/resume.py", "prepare_resume"): "our own trainers' generation counters (GENERATION_COUNTERS) restored",
}


def _imported_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Names bound to modules (``import x``) and to classes imported by name (``from x import Class``)."""
    modules, classes = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            classes |= {a.asname or a.name for a in node.names if (a.asname or a.name)[:1].isupper()}
    return modules, classes


def _swaps(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    modules, classes = _imported_names(tree)
    where = str(path.relative_to(PACKAGE))
    found = []

    def flag(node, what, function):
        if (where, function) not in ALLOWED:
            found.append(f"{where}:{node.lineno} ({function}): {what}")

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            targets = child.targets if isinstance(child, ast.Assign) else []
            targets += [child.target] if isinstance(child, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for t in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                    if isinstance(t, ast.Attribute) and t.attr == "__class__":
                        flag(child, "assigns __class__", name)
                    elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                        if t.value.id in modules | classes:
                            flag(child, f"assigns {t.value.id}.{t.attr}", name)
                    if isinstance(t, ast.Subscript) and ast.unparse(t.value) == "os.environ":
                        flag(child, "writes os.environ", name)
            if isinstance(child, ast.Call):
                func = ast.unparse(child.func)
                if func == "setattr" and not (
                    len(child.args) > 1 and isinstance(child.args[1], ast.Name) and child.args[1].id.endswith("_MARK")
                ):  # marks: hf_sp_trainer's own attribute names on a module (position_rules, image_blocks, ulysses)
                    flag(child, "calls setattr", name)
                if func in ("os.environ.update", "os.environ.setdefault", "os.environ.pop", "os.putenv"):
                    flag(child, f"calls {func}", name)
            visit(child, name)

    visit(tree, "<module>")
    return found


def test_no_swap_of_library_code_outside_the_registry():
    """An AST scan of the package: no ``__class__`` assignment, no assignment to an attribute of an imported module or
    class, no ``setattr`` and no ``os.environ`` write outside ``patches.py`` and the places in ``ALLOWED``."""
    found = [
        s for p in sorted(PACKAGE.rglob("*.py")) if p.name != "patches.py" or p.parent != PACKAGE for s in _swaps(p)
    ]
    assert not found, "swap these through hf_sp_trainer.patches.patch (or allow them with a reason):\n" + "\n".join(
        found
    )


def test_the_scan_finds_swaps(tmp_path):
    sample = PACKAGE / "_scan_sample.py"
    try:
        sample.write_text(
            "import sys\nfrom torch import Tensor\n\ndef f(layer, new):\n    layer.__class__ = new\n"
            "    sys.excepthook = print\n    Tensor.add = None\n    setattr(layer, 'forward', None)\n"
        )
        assert [s.split(": ", 1)[1] for s in _swaps(sample)] == [
            "assigns __class__", "assigns sys.excepthook", "assigns Tensor.add", "calls setattr"
        ]  # fmt: skip
    finally:
        sample.unlink()


# -- what a trainer built in this process applies ------------------------------------------------------------------
def _hybrid_trainer(tmp_path, model):
    from hf_sp_trainer import SPTrainer, TrainingArguments
    from tests.harness import CHECKPOINTING_ARG, quiet_args, synthetic_dataset

    args = TrainingArguments(
        **quiet_args(str(tmp_path), 1), per_device_train_batch_size=2, remove_unused_columns=False,
        sp_size=1, tiled_mlp=True, fused_loss=True, checkpoint_policy="sequence_aware", **{CHECKPOINTING_ARG: True},
    )  # fmt: skip
    return SPTrainer(model=model, args=args, train_dataset=synthetic_dataset(4, seed=1))


def test_a_trainer_lists_its_patches_and_undo_all_restores_them(tmp_path):
    """A hybrid model at sp_size 1 (documents kept apart: the mixer kernels) with the memory stack (fused loss: the
    model's forward; tiled MLP and sequence-aware checkpointing: the MLPs' and layers' classes): ``applied()`` names
    each, a second trainer on the same model stacks nothing, ``undo_all`` gives back the very originals."""
    from hf_sp_trainer.memory.checkpointing import checkpointed_modules
    from tests.harness import tiny_model

    model = tiny_model("qwen3_5")
    module = sys.modules[type(model).__module__]
    kernels = {n: getattr(module, n) for n in ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")}
    for record in patches.applied():  # what earlier tests left on this module: start from transformers' own
        if record.owner is module:
            patches.undo(record)
    kernels = {n: getattr(module, n) for n in kernels}
    layers = {name: type(m) for name, m in model.named_modules() if type(m).__name__ in ("Qwen3_5DecoderLayer",)}
    mlps = {name: type(m) for name, m in model.named_modules() if type(m).__name__ == "Qwen3_5MLP"}
    assert layers and mlps and "forward" not in vars(model)

    trainer = _hybrid_trainer(tmp_path / "a", model)
    labels = {r.label for r in patches.applied()}
    prefix = f"{module.__name__}."
    assert {prefix + n for n in kernels} <= labels
    assert f"{prefix}Qwen3_5ForCausalLM[Qwen3_5ForCausalLM].forward" in labels
    assert {f"{prefix}Qwen3_5MLP[{name}].__class__" for name in mlps} <= labels
    assert {f"{prefix}Qwen3_5DecoderLayer[{name}].__class__" for name in layers} <= labels
    assert "sys.excepthook" in labels
    assert all(r.check and r.reason for r in patches.applied())
    trainer.model.gradient_checkpointing_enable()  # transformers assigns the layers' checkpoint function
    assert checkpointed_modules(model)

    before = len(patches.applied())
    _hybrid_trainer(tmp_path / "b", model)  # the same model again: no second layer of anything
    assert len(patches.applied()) == before
    assert getattr(module.causal_conv1d_fn, patches.ORIGINAL_ATTR) is kernels["causal_conv1d_fn"]

    del trainer
    gc.collect()
    restored = patches.undo_all()
    assert not patches.applied() and len(restored) == before
    assert all(getattr(module, n) is fn for n, fn in kernels.items())  # identity: transformers' own functions
    assert "forward" not in vars(model)
    assert {n: type(m) for n, m in model.named_modules() if n in layers} == layers
    assert {n: type(m) for n, m in model.named_modules() if n in mlps} == mlps
    assert all("_gradient_checkpointing_func" in vars(m) for m in checkpointed_modules(model))  # transformers' own


def _present(module: str, names: tuple[str, ...]) -> set[str]:
    """``transformers.models.<module>.<name>`` for the names the installed module has (a ``Class[path].attr``
    label counts when the class is there): what a run can patch on this transformers."""
    installed = importlib.import_module(f"transformers.models.{module}")
    return {f"{installed.__name__}.{n}" for n in names if hasattr(installed, n.split("[")[0])}


def _sp_run_patches(family: str, out_dir: str) -> list[tuple[str, str, str]]:
    """One SP training step (sp 2) of a tiny ``family`` model, no memory features: what is live afterwards."""
    from hf_sp_trainer import SPTrainer, TrainingArguments
    from tests.harness import quiet_args, synthetic_dataset, tiny_model

    args = TrainingArguments(**quiet_args(out_dir, 1), per_device_train_batch_size=2, remove_unused_columns=False,
                             sp_size=2, ddp_backend="gloo")  # fmt: skip
    trainer = SPTrainer(model=tiny_model(family), args=args, train_dataset=synthetic_dataset(4, seed=1))
    trainer.train()
    table = patches.table()
    trainer.end()
    return table


@pytest.mark.dist
@pytest.mark.parametrize(
    "family, expected",
    [
        ("llama", set()),
        ("qwen3_moe", {"transformers.models.qwen3_moe.modeling_qwen3_moe.load_balancing_loss_func",
                       "transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func"}),
        ("qwen3_5", _present("qwen3_5.modeling_qwen3_5", (  # + recompute in scope; 5.25: the layer function
            "causal_conv1d_fn", "torch_chunk_gated_delta_rule", "causal_conv1d_update", "causal_conv1d_forward",
            "torch_recurrent_gated_delta_rule", "Qwen3_5DecoderLayer[model.layers.0].__class__",
            "Qwen3_5DecoderLayer[model.layers.1].__class__"))),
        ("jamba", _present("jamba.modeling_jamba", (  # Mamba1 + MoE; the layers: recompute in scope
            "causal_conv1d_fn", "mamba_selective_scan", "mamba_inner_fn", "causal_conv1d_update",  # inner fn: < 5.25
            "mamba_selective_state_update", "load_balancing_loss_func", "causal_conv1d_forward", "mamba_scan_forward",
            "JambaMambaDecoderLayer[model.layers.0].__class__", "JambaAttentionDecoderLayer[model.layers.1].__class__",
        )) | {"transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func"}),
    ],
)  # fmt: skip
def test_a_plain_sp_run_applies_only_what_its_model_needs(family, expected, tmp_path):
    """A plain SP run (sp 2, no memory features): the exit hook, and only the swaps its model's layers need (a dense
    decoder none: SP attention is registered through transformers' AttentionInterface, no patch)."""
    from tests.harness import run_distributed, unwrap_results

    # fresh processes: a pooled world keeps the module-level swaps earlier cases applied
    tables = unwrap_results(run_distributed(2, _sp_run_patches, family, str(tmp_path), fresh=True))
    assert tables[0] == tables[1]
    labels = {label for label, _, _ in tables[0]}
    assert labels == {"sys.excepthook"} | expected, tables[0]
    print(family, *tables[0], sep="\n")


def test_docs_list_every_module_that_patches():
    """docs/patches.md's table names every module that calls ``patches.patch``."""
    docs = (PACKAGE.parent / "docs" / "patches.md").read_text()
    callers = {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name != "patches.py" and "patches.patch(" in p.read_text()
    }
    assert callers and not {c for c in callers if f"`{c}`" not in docs}, callers
