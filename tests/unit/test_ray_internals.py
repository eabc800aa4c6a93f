"""Ray's private APIs stay behind one door: elastic_gpt/elastic/ray_internals.py is their only
importer, `check_ray_internals()` verifies exactly the names it imports, and a missing one is
reported by name (with the Ray version) instead of surfacing as an AttributeError mid-run."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

from elastic_gpt.elastic import ray_internals
from elastic_gpt.elastic.ray_internals import (
    PRIVATE_APIS,
    PRIVATE_MEMBERS,
    TEST_APIS,
    Api,
    api_problems,
)

REPO = Path(__file__).resolve().parents[2]
DOOR = REPO / "elastic_gpt/elastic/ray_internals.py"


def _private(module: str, name: str = "") -> bool:
    """A Ray module or name that is not public API."""
    if not (module == "ray" or module.startswith("ray.")):
        return False
    return (any(part.startswith("_") for part in module.split("."))
            or module.startswith("ray.core.generated") or name.startswith("_"))


def _private_imports(path: Path) -> set[tuple[str, str]]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {(node.module, a.name) for a in node.names if _private(node.module, a.name)}
        elif isinstance(node, ast.Import):
            found |= {(a.name, "") for a in node.names if _private(a.name)}
    return found


def test_ray_internals_have_the_shape_we_rely_on():
    verified = ray_internals.check_ray_internals()  # raises, naming what changed, on another ray
    assert verified == [a.qualname for a in PRIVATE_APIS + PRIVATE_MEMBERS]


def test_the_tooling_the_deploy_tests_use_has_the_shape_they_rely_on():
    assert [p for api in TEST_APIS for p in api_problems(api)] == []


def test_the_check_covers_exactly_the_private_names_the_module_imports():
    imported = _private_imports(DOOR)
    listed = {(a.module, a.name) for a in PRIVATE_APIS + TEST_APIS if a.imported}
    assert imported == listed, (
        f"imported but not checked: {sorted(imported - listed)}; "
        f"checked but not imported (mark imported=False if only its shape is used): "
        f"{sorted(listed - imported)}")
    assert all(_private(a.module, a.name) for a in PRIVATE_APIS + TEST_APIS)
    assert not any(_private(a.module, a.name) for a in PRIVATE_MEMBERS), \
        "PRIVATE_MEMBERS is for private members of public classes"


def test_private_members_the_policies_and_the_trainer_hook_inherit_are_checked():
    """policies.py and controller.py subclass Ray classes and override or call their underscore
    members: each such member must be listed, or a Ray upgrade that renames it would pass the
    check while our override silently stopped being called."""
    from elastic_gpt.elastic import controller, policies

    listed = {m for a in PRIVATE_APIS + PRIVATE_MEMBERS for m in a.members}
    inherited = {}
    for cls in (policies.LiveCapacityScalingPolicy, policies.ElasticFailurePolicy,
                controller.ElasticTorchTrainer):
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        ray_bases = [b for b in cls.__mro__[1:] if b.__module__.startswith("ray.")]
        inherited[cls.__name__] = {n for n in names if n.startswith("_") and not n.startswith("__")
                                   and any(n in vars(b) for b in ray_bases)}
        assert inherited[cls.__name__] <= listed, cls.__name__
    assert inherited["LiveCapacityScalingPolicy"] == {"_get_num_workers_for_resource_request",
                                                      "_maybe_send_resource_request"}
    assert inherited["ElasticTorchTrainer"] == {"_initialize_and_run_controller"}


def test_no_other_module_touches_private_ray():
    needles = ("ray._private", "ray._raylet", "_internal_kv", "ray.train.v2._internal",
               "ray.core.generated")
    offenders = []
    for folder in ("elastic_gpt", "tests", "bench"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path in (DOOR, Path(__file__).resolve()):
                continue
            text = path.read_text()
            hits = sorted(_private_imports(path)) + [n for n in needles if n in text]
            if hits:
                offenders.append(f"{path.relative_to(REPO)}: {hits}")
    assert not offenders, "use elastic_gpt.elastic.ray_internals instead:\n" + "\n".join(offenders)


def test_a_missing_name_is_reported_by_name():
    gone = api_problems(Api("ray._private.state", "no_such_thing"))
    assert gone and "ray._private.state.no_such_thing is gone" in gone[0]
    changed = api_problems(Api("ray.experimental.internal_kv", "_internal_kv_put",
                               members=("no_such_member",), params={"": ("no_such_param",)}))
    assert changed == ["ray.experimental.internal_kv._internal_kv_put.no_such_member is gone",
                       "ray.experimental.internal_kv._internal_kv_put has no 'no_such_param' "
                       "parameter"]


