"""Property-based fuzzing of the fastshare.gpu modules' arguments, run the way Ansible runs them.

Hypothesis generates arguments for every module in plugins/modules/ (random, missing, wrongly
typed, huge and unicode values, unknown options, and near-valid ones so that the modules'
own checks are reached too); they run as tasks of one localhost play (the installed
collection, the virtualenv's interpreter) against simulated machines: each task its own copy,
so that what a task did can be checked on its own. The property, for every input:

- the module succeeds, or fails with a ``msg`` that names one of its arguments (or reports
  the unknown one), never a traceback ("MODULE FAILURE");
- a failed task reports ``changed: false`` and leaves its machine file (and an agent journal
  it was given) byte for byte as it was;
- k8s_manifests renders exactly the values it was given (no value can inject YAML).

    FASTSHARE_FUZZ_EXAMPLES=1000 make pytest PYTEST_ARGS='tests/ansible/test_ansible_fuzz.py -s'
(CI runs 40 inputs per module, about a minute.)
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
from fs_collection import COLLECTION, run_tasks
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fastshare.device import simnvml

EXAMPLES = int(os.environ.get("FASTSHARE_FUZZ_EXAMPLES", "40"))

ARGUMENTS = {
    "gpu_info": {"gpu_backend", "sim_state"},
    "mig_config": {"gpu_backend", "sim_state", "layout", "devices", "mig_enabled", "mig_devices",
                   "config_file", "config_name", "force", "agent_journal"},
    "k8s_manifests": {"values"},
}

wild = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=12),
    st.sampled_from(["", "all", "yes", "ü" * 40, "a" * 300, "{{ 1 }}", "-1", "7", "1g.5gb"]),
    st.lists(st.integers(-2, 9), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
profiles = st.sampled_from(["1g.5gb", "2g.10gb", "3g.20gb", "7g.40gb", "1g.10gb", "3g.40gb", "7g.80gb",
                            "4g.20gb", "5g.25gb", "1g.5gb+me", "ü", ""])


def _maybe(draw, strategy, wild_share: int = 4):
    """A plausible value, or (1 time in ``wild_share``) anything at all."""
    return draw(wild) if draw(st.integers(1, wild_share)) == 1 else draw(strategy)


@st.composite
def layout_entries(draw) -> dict:
    entry = {}
    if draw(st.integers(0, 4)):   # else the default, "all" (GPU 2 is a T4: no MIG)
        mig_gpus = st.lists(st.integers(0, 1), min_size=1, max_size=2, unique=True)
        entry["devices"] = _maybe(draw, mig_gpus | mig_gpus | st.lists(st.integers(0, 3), max_size=3))
    if draw(st.integers(0, 3)) == 0:
        entry["mig_enabled"] = _maybe(draw, st.booleans())
    if draw(st.integers(0, 4)):
        entry["mig_devices"] = _maybe(draw, st.dictionaries(profiles, st.integers(-1, 8), max_size=3))
    if draw(st.integers(0, 9)) == 0:
        entry[draw(st.sampled_from(["device", "colour", "ü"]))] = draw(wild)
    return entry


@st.composite
def backend_args(draw, paths: dict[str, str]) -> dict:
    args = {}
    if draw(st.integers(0, 9)):
        args["gpu_backend"] = _maybe(draw, st.just("sim"), 8)
    if draw(st.integers(0, 9)):
        args["sim_state"] = _maybe(draw, st.sampled_from(["MACHINE", paths["missing"], paths["garbage"],
                                                          paths["dir"]]) | st.just("MACHINE"), 8)
    return args


@st.composite
def mig_config_args(draw, paths: dict[str, str]) -> dict:
    args = draw(backend_args(paths))
    if draw(st.integers(0, 4)):
        args["layout"] = _maybe(draw, st.lists(layout_entries(), max_size=3), 8)
    if draw(st.integers(0, 4)) == 0:
        args["config_file"] = draw(st.sampled_from([paths["parted"], paths["missing"], paths["garbage"],
                                                    paths["dir"]]) | wild)
    if draw(st.integers(0, 4)) == 0:
        args["config_name"] = draw(st.sampled_from(["all-1g", "nope", ""]) | wild)
    if draw(st.integers(0, 4)) == 0:
        args["force"] = _maybe(draw, st.booleans())
    if draw(st.integers(0, 4)) == 0:
        args["agent_journal"] = draw(st.sampled_from(["JOURNAL", "GARBAGE_JOURNAL", paths["missing"],
                                                      paths["dir"]]) | wild)
    if draw(st.integers(0, 19)) == 0:
        args[draw(st.sampled_from(["colour", "gpus", "ü"]))] = draw(wild)
    return args


value_keys = st.sampled_from(["namespace", "image", "imagePullPolicy", "gpuNodeLabel", "labels",
                              "controller", "agent", "unknownKey"])
nested = st.dictionaries(st.sampled_from(["name", "replicas", "port", "runDir", "tlsSecret", "resources",
                                          "x"]),
                         wild | st.sampled_from(["fastshare-x", 3, "/run/x"]), max_size=2)
scalars = st.sampled_from(["fastshare-x", "ns-2", "Bad Name", "a\nkind: Secret", "x: y", "'", "\"", "#c",
                           "{{ 7*7 }}", "a" * 70, "ü"]) | st.text(max_size=10)
k8s_values = st.dictionaries(value_keys, scalars | wild | nested, max_size=3)


@pytest.fixture(scope="module")
def fuzz_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A machine (copied per task), a mig-parted file, an agent journal and some bad paths."""
    from fastshare.node.journal import Journal

    root = tmp_path_factory.mktemp("ansible-fuzz")
    machine = root / "machine.json"
    simnvml.create_machine(machine, ["A100-SXM4-40GB", "H100-SXM5-80GB", "T4"], mig_enabled=True)
    parted = root / "parted.yaml"
    parted.write_text("version: v1\nmig-configs:\n  all-1g:\n    - devices: [0]\n      mig-enabled: true\n"
                      "      mig-devices: {1g.5gb: 7}\n")
    journal = root / "journal.db"
    Journal(journal).close()
    garbage = root / "garbage"
    garbage.write_bytes(b"\x00not json, not yaml: [\xff")
    (root / "dir").mkdir()
    return {"root": root, "machine": machine, "parted": parted, "journal": journal, "garbage": garbage,
            "dir": root / "dir", "missing": root / "missing" / "nothing.json"}


def _generate(strategy: st.SearchStrategy, n: int) -> list:
    """``n`` inputs from ``strategy`` (generation only: the tasks run together in one play)."""
    drawn: list = []

    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(value) -> None:
        drawn.append(value)

    collect()
    return drawn


# ansible-core 2.19 lists no_log values before it validates types; a list-of-dicts option given
# a string fails there with this bare message (arg_spec.py: NoLogError), before any module code.
CORE_NO_LOG_ERROR = "dictionary requested, could not parse JSON or key=value"


def _names_an_argument(module: str, msg: str) -> bool:
    return "Unsupported parameters" in msg or any(name in msg for name in ARGUMENTS[module])


def _materialise(args: dict, files: dict[str, Path], task_dir: Path) -> dict:
    """Replace the placeholders by this task's own copies (so its changes are its own)."""
    out = dict(args)
    if out.get("sim_state") == "MACHINE":
        shutil.copy(files["machine"], task_dir / "machine.json")
        out["sim_state"] = str(task_dir / "machine.json")
    if out.get("agent_journal") in ("JOURNAL", "GARBAGE_JOURNAL"):
        source = files["journal"] if out["agent_journal"] == "JOURNAL" else files["garbage"]
        shutil.copy(source, task_dir / "journal.db")
        out["agent_journal"] = str(task_dir / "journal.db")
    return out


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file's bytes; the simulated NVML's lock files (its stand-in for /dev/nvidiactl) aside."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.suffix != ".lock"}


@pytest.mark.parametrize("module", sorted(ARGUMENTS))
def test_module_arguments_are_refused_by_name_and_change_nothing(
        module: str, collections_path: Path, fuzz_files: dict[str, Path], tmp_path: Path, capsys) -> None:
    paths = {k: str(v) for k, v in fuzz_files.items()}
    strategy = {"gpu_info": backend_args(paths), "mig_config": mig_config_args(paths),
                "k8s_manifests": st.fixed_dictionaries({}, optional={"values": k8s_values | wild})}[module]
    inputs = _generate(strategy, EXAMPLES)
    tasks, dirs = [], []
    for i, args in enumerate(inputs):
        task_dir = tmp_path / f"task-{i}"
        task_dir.mkdir()
        dirs.append(task_dir)
        tasks.append({f"{COLLECTION}.{module}": _materialise(args, fuzz_files, task_dir)})
    before = [_snapshot(d) for d in dirs]
    shared_before = _snapshot(fuzz_files["root"])
    results = run_tasks(collections_path, tasks, tmp_path)
    assert len(results) == len(inputs)
    seen: Counter[str] = Counter()
    problems: list[str] = []
    for args, result, task_dir, files_before in zip(inputs, results, dirs, before, strict=True):
        msg = str(result.get("msg", ""))
        if "MODULE FAILURE" in msg or "Traceback" in msg:
            problems.append(f"crashed on {args}: {msg} {result.get('module_stderr', '')}")
        elif result.get("failed"):
            seen["refused"] += 1
            if msg == CORE_NO_LOG_ERROR and isinstance(args.get("layout"), str):
                seen["refused by ansible-core without the option's name"] += 1
            elif not _names_an_argument(module, msg):
                problems.append(f"no argument named for {args}: {msg}")
            if result.get("changed") or _snapshot(task_dir) != files_before:
                problems.append(f"failed but changed something: {args}: {msg}")
        else:
            seen["accepted"] += 1
            if module == "k8s_manifests":
                problems += _rendered_as_given(args.get("values") or {}, result)
    assert not problems, "\n".join(problems[:15])
    assert _snapshot(fuzz_files["root"]) == shared_before, "a task changed a file it was only given to read"
    with capsys.disabled():
        print(f"\nfuzz {module}: {len(inputs)} inputs, {dict(seen)}")


def _rendered_as_given(values: dict, result: dict) -> list[str]:
    """What k8s_manifests rendered differently from the values it was given."""
    resources = result["resources"]
    problems = []
    if not all(isinstance(r, dict) and r.get("kind") and (r.get("metadata") or {}).get("name")
               for r in resources):
        problems.append(f"resources without kind or name from {values}")
    if isinstance(values.get("namespace"), str) and result["namespace"] != values["namespace"]:
        problems.append(f"namespace {values['namespace']!r} rendered as {result['namespace']!r}")
    if isinstance(values.get("image"), str):
        images = {c["image"] for r in resources if r["kind"] in ("Deployment", "DaemonSet")
                  for c in r["spec"]["template"]["spec"]["containers"]}
        if images != {values["image"]}:
            problems.append(f"image {values['image']!r} rendered as {images}")
    return problems
