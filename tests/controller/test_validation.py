"""Every invalid request is refused with the field name and the allowed range."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastshare.controller.model import Gpu, Kind, Spec
from fastshare.controller.validation import Request, ValidationError, validate

GiB = 1024**3
A100 = Gpu(0, "GPU-a", "NVIDIA A100-SXM4-40GB", 40 * GiB, 108, True, True)
L4 = Gpu(0, "GPU-l", "NVIDIA L4", 22 * GiB, 58)
GPUS = [A100, L4]


def _check(spec: Spec, field: str, match: str, gpus=GPUS, **kw) -> None:
    with pytest.raises(ValidationError, match=match) as exc:
        validate(Request(spec=spec, **kw), gpus, max_gpus_per_node=2)
    assert exc.value.field == field
    assert str(exc.value).startswith(field)


@pytest.mark.parametrize("spec", [
    Spec(Kind.FASTPOD, sm_percent=30, memory_bytes=8 * GiB, quota_request=0.3, quota_limit=0.6),
    Spec(Kind.FASTPOD, sm_percent=100, memory_bytes=40 * GiB),
    Spec(Kind.MPS, memory_bytes=GiB),
    Spec(Kind.EXCLUSIVE, mig_profile="3g.20gb"),
    Spec(Kind.EXCLUSIVE, sm_count=42),
    Spec(Kind.EXCLUSIVE, sm_percent=50, memory_bytes=10 * GiB),
    Spec(Kind.WHOLE, gpu_count=2, models=("*A100*",), node_selector=(("zone", "a"),)),
])
def test_valid_requests_pass(spec):
    validate(Request(spec=spec, owner="me", idempotency_key="job-1", lease_ttl=30), GPUS, 2)


@pytest.mark.parametrize(("spec", "field", "match"), [
    (Spec(Kind.FASTPOD, sm_percent=0, memory_bytes=GiB), "spec.sm_percent", r"1\.\.100, got 0"),
    (Spec(Kind.FASTPOD, sm_percent=101, memory_bytes=GiB), "spec.sm_percent", r"1\.\.100, got 101"),
    (Spec(Kind.FASTPOD, sm_percent=30), "spec.memory_bytes", "> 0"),
    (Spec(Kind.FASTPOD, sm_percent=30, memory_bytes=41 * GiB), "spec.memory_bytes",
     r"largest GPU's memory \(40.0 GiB\)"),
    (Spec(Kind.FASTPOD, sm_percent=30, memory_bytes=GiB, quota_request=0.6, quota_limit=0.3),
     "spec.quota_limit", r">= quota_request \(0.6\)"),
    (Spec(Kind.FASTPOD, sm_percent=30, memory_bytes=GiB, quota_request=1.5, quota_limit=1.5),
     "spec.quota_request", r"\(0, 1\], got 1.5"),
    (Spec(Kind.FASTPOD, sm_percent=30, memory_bytes=GiB, quota_limit=0.5), "spec.quota_request", r"\(0, 1\]"),
    (Spec(Kind.FASTPOD, sm_percent=30, memory_bytes=GiB, mig_profile="1g.5gb"), "spec.mig_profile",
     "does not apply"),
    (Spec(Kind.MPS), "spec.memory_bytes", "> 0"),
    (Spec(Kind.MPS, memory_bytes=GiB, sm_percent=20), "spec.sm_percent", "does not apply to kind mps"),
    (Spec(Kind.EXCLUSIVE), "spec.mig_profile", "exactly one of"),
    (Spec(Kind.EXCLUSIVE, mig_profile="3g.20gb", sm_count=3), "spec.mig_profile", "exactly one of"),
    (Spec(Kind.EXCLUSIVE, mig_profile="5g.30gb"), "spec.mig_profile", "does not exist on A100-SXM4-40GB"),
    (Spec(Kind.EXCLUSIVE, sm_percent=100), "spec.sm_percent", "has 98 of the GPU's 108 SMs; request a whole"),
    (Spec(Kind.EXCLUSIVE, sm_count=99), "spec.sm_count", "largest MIG slice on A100-SXM4-40GB has 98"),
    (Spec(Kind.EXCLUSIVE, sm_count=14, quota_limit=0.5), "spec.quota_limit", "does not apply"),
    (Spec(Kind.WHOLE), "spec.gpu_count", ">= 1"),
    (Spec(Kind.WHOLE, gpu_count=3), "spec.gpu_count", r"<= 2 \(the most GPUs any node has\)"),
    (Spec(Kind.WHOLE, gpu_count=1, memory_bytes=GiB), "spec.memory_bytes", "does not apply"),
    (Spec(Kind.MPS, memory_bytes=GiB, gpu_count=2), "spec.gpu_count", "use kind whole"),
    (Spec(Kind.MPS, memory_bytes=GiB, models=("",)), "spec.models", "empty"),
    (Spec(Kind.MPS, memory_bytes=GiB, affinity="a b"), "spec.affinity", "invalid"),
    (Spec(Kind.MPS, memory_bytes=GiB, node_selector=(("", "x"),)), "spec.node_selector", "empty"),
    (Spec(Kind.MPS, memory_bytes=GiB, node_selector=tuple((f"k{i}", "v") for i in range(65))),
     "spec.node_selector", "at most 64 entries, got 65"),
    (Spec(Kind.MPS, memory_bytes=GiB, node_selector=(("k" * 318, "v"),)), "spec.node_selector",
     "keys of at most 317 characters .* got 318 and 1"),
    (Spec(Kind.MPS, memory_bytes=GiB, node_selector=(("zone", "v" * 64),)), "spec.node_selector",
     "values of at most 63 .* got 4 and 64"),
])
def test_invalid_requests_name_the_field(spec, field, match):
    _check(spec, field, match)


def test_exclusive_without_mig_capable_gpu():
    _check(Spec(Kind.EXCLUSIVE, sm_count=10), "spec.kind", "no MIG-capable GPU", gpus=[L4])


def test_request_level_fields():
    ok = Spec(Kind.MPS, memory_bytes=GiB)
    _check(ok, "lease_ttl_seconds", r"5\.\.604800, got 2", lease_ttl=2)
    _check(ok, "idempotency_key", "1-256 characters", idempotency_key="has space")
    _check(ok, "owner", "at most 253", owner="x" * 300)
    for owner in ("alice\nbob", "job\t1", "x\x1b[2J"):   # would break the status table, or a log line
        _check(ok, "owner", "printable characters only", owner=owner)
    validate(Request(spec=ok, owner="Zoë's job (team a)"), GPUS)


@given(st.integers(min_value=-10, max_value=200), st.integers(min_value=0, max_value=64))
def test_fastpod_sm_percent_range_is_exact(sm, mem_gib):
    """Property: accepted iff sm in 1..100 and 0 < memory <= 40 GiB."""
    spec = Spec(Kind.FASTPOD, sm_percent=sm, memory_bytes=mem_gib * GiB)
    ok = 1 <= sm <= 100 and 0 < mem_gib <= 40
    try:
        validate(Request(spec=spec), GPUS)
        accepted = True
    except ValidationError:
        accepted = False
    assert accepted == ok


@pytest.mark.parametrize(("field", "kw"), [
    ("idempotency_key", {"idempotency_key": "job-1\n"}),
    ("spec.affinity", {"spec": Spec(Kind.MPS, memory_bytes=GiB, affinity="team\n")}),
    ("spec.anti_affinity", {"spec": Spec(Kind.MPS, memory_bytes=GiB, anti_affinity="team\n")}),
])
def test_a_trailing_newline_is_not_an_allowed_character(field, kw):
    """'$' also matches before a final newline: the whole value must match the pattern."""
    spec = kw.pop("spec", Spec(Kind.MPS, memory_bytes=GiB))
    _check(spec, field, "characters|invalid", **kw)



@pytest.mark.parametrize("gpus", [GPUS, []], ids=["gpus", "no-gpus-yet"])
def test_an_overlong_mig_profile_is_refused_by_its_length(gpus):
    """Without a bound the name came back in the error, too big for gRPC's trailers: the
    client saw only 'Stream removed (received metadata size exceeds hard limit)'."""
    _check(Spec(Kind.EXCLUSIVE, mig_profile="3g.20gb" * 10_000), "spec.mig_profile",
           r"at most 32 characters .*, got 70000", gpus=gpus)



@pytest.mark.parametrize(("value", "match"), [
    ("", "required"), ("fs-" + "0" * 300, "at most 128 characters, got 303"),
])
def test_allocation_ids_are_checked(value, match):
    from fastshare.controller.validation import check_allocation_id

    with pytest.raises(ValidationError, match=match) as exc:
        check_allocation_id(value)
    assert exc.value.field == "allocation_id"
    check_allocation_id("fs-0123456789abcdef")


# --- behaviour pinned after mutation testing ---------------------------------------------------
@pytest.mark.parametrize(("spec", "field", "match"), [
    (Spec(Kind.EXCLUSIVE, sm_percent=101), "spec.sm_percent", r"must be in 1\.\.100, got 101"),
    (Spec(Kind.EXCLUSIVE, sm_percent=0.5), "spec.sm_percent", r"must be in 1\.\.100, got 0.5"),
    (Spec(Kind.EXCLUSIVE, sm_count=-1), "spec.sm_count", r"must be in 1\.\.1024, got -1"),
    (Spec(Kind.EXCLUSIVE, sm_count=1025), "spec.sm_count", r"must be in 1\.\.1024, got 1025"),
    (Spec(Kind.MPS, memory_bytes=-1), "spec.memory_bytes", "must be > 0, got -1"),
    (Spec(Kind.WHOLE, gpu_count=1, memory_bytes=-1), "spec.memory_bytes", "must be >= 0, got -1"),
    (Spec(Kind.MPS, memory_bytes=GiB, cpu_milli=-1), "spec.cpu_milli", "must be >= 0, got -1"),
    (Spec(Kind.MPS, memory_bytes=GiB, host_memory_bytes=-1), "spec.host_memory_bytes",
     "must be >= 0, got -1"),
    (Spec(Kind.MPS, memory_bytes=GiB, models=tuple(f"m{i}" for i in range(65))), "spec.models",
     "at most 64 entries, got 65"),
    (Spec(Kind.MPS, memory_bytes=GiB, models=("m" * 129,)), "spec.models",
     "entries of at most 128 characters, got 129"),
    (Spec(Kind.EXCLUSIVE, mig_profile="1g.5gb", memory_bytes=5 * GiB), "spec.mig_profile",
     "1g.5gb on A100-SXM4-40GB has 4864 MiB"),
])
def test_more_invalid_requests_name_the_field_and_range(spec, field, match):
    _check(spec, field, match)


def test_the_largest_accepted_values_pass():
    """The ranges are inclusive (the FastPod CRD renders the same ones)."""
    for spec in (Spec(Kind.EXCLUSIVE, sm_count=98),
                 Spec(Kind.EXCLUSIVE, mig_profile="1g.5gb", memory_bytes=4864 * 2**20),
                 Spec(Kind.MPS, memory_bytes=GiB, models=(*(f"m{i}" for i in range(63)), "m" * 128))):
        validate(Request(spec=spec), GPUS)
    sixteen = [Gpu(i, f"GPU-{i}", "NVIDIA L4", 22 * GiB, 58) for i in range(16)]
    validate(Request(spec=Spec(Kind.WHOLE, gpu_count=16)), sixteen)     # no per-node figure given
    with pytest.raises(ValidationError, match=r"must be in 1\.\.16, got 17"):
        validate(Request(spec=Spec(Kind.WHOLE, gpu_count=17)), sixteen)
    with pytest.raises(ValidationError) as exc:
        validate(Request(spec=Spec(Kind.EXCLUSIVE, sm_count=1025)), [])
    assert (exc.value.field, exc.value.detail) == ("spec.sm_count", "must be in 1..1024, got 1025")
    assert str(exc.value) == "spec.sm_count: must be in 1..1024, got 1025"


def test_with_no_gpu_registered_the_cluster_checks_are_left_to_placement():
    for spec in (Spec(Kind.FASTPOD, sm_percent=30, memory_bytes=100 * GiB),
                 Spec(Kind.EXCLUSIVE, sm_count=1024), Spec(Kind.EXCLUSIVE, mig_profile="9" * 32),
                 Spec(Kind.EXCLUSIVE, sm_percent=100), Spec(Kind.EXCLUSIVE, sm_percent=1)):
        validate(Request(spec=spec), [])


def test_a_kind_that_is_not_a_kind_is_refused():
    _check(Spec("fastpod", sm_percent=30, memory_bytes=GiB), "spec.kind",   # type: ignore[arg-type]
           "must be one of fastpod, mps, exclusive, whole")


def test_node_names_and_labels_are_bounded():
    from fastshare.controller.validation import check_node_labels, check_node_name

    check_node_name("n" * 253)
    with pytest.raises(ValidationError, match=r"at most 253 characters .*got 254") as exc:
        check_node_name("n" * 254)
    assert exc.value.field == "node"
    check_node_labels({f"k{i}": "v" for i in range(62)} | {"topology.kubernetes.io/zone": "", "a": "b-1.c_2"})
    check_node_labels({"k": "v" * 63})
    for labels, match in [
        ({f"k{i}": "v" for i in range(65)}, "at most 64 labels, got 65"),
        ({"bad key": "v"}, "label key 'bad key'"),
        ({"k": "-v"}, "label value '-v' of 'k': empty or at most 63"),
        ({"k": "v" * 64}, "label value 'v{64}' of 'k'"),
    ]:
        with pytest.raises(ValidationError, match=match) as exc:
            check_node_labels(labels)
        assert exc.value.field == "labels"


def test_normalise_gives_an_unquoted_fastpod_its_sm_share_as_guaranteed_quota():
    from fastshare.controller.validation import normalise

    spec = normalise(Spec(Kind.FASTPOD, sm_percent=30, memory_bytes=GiB))
    assert (spec.quota_request, spec.quota_limit) == (0.3, 1.0)
    quoted = Spec(Kind.FASTPOD, sm_percent=30, memory_bytes=GiB, quota_request=0.1, quota_limit=0.2)
    assert normalise(quoted) == quoted
    assert normalise(Spec(Kind.MPS, memory_bytes=GiB)) == Spec(Kind.MPS, memory_bytes=GiB)


@pytest.mark.parametrize("spec", [
    Spec(Kind.FASTPOD, sm_percent=30, memory_bytes=GiB, quota_request=1.0, quota_limit=1.0),
    Spec(Kind.MPS, memory_bytes=GiB, gpu_count=1, affinity="team-a", anti_affinity="x/y.z_1",
         node_selector=tuple((f"k{i}", "v") for i in range(64))),
    Spec(Kind.MPS, memory_bytes=1, node_selector=(("k" * 317, "v" * 63),)),
    Spec(Kind.FASTPOD, sm_percent=1, memory_bytes=1),
])
@pytest.mark.parametrize("lease_ttl", [0, 5, 604800])
def test_boundary_values_pass(spec, lease_ttl):
    validate(Request(spec=spec, owner="o" * 253, idempotency_key="k" * 256, lease_ttl=lease_ttl), GPUS, 2)


@pytest.mark.parametrize(("spec", "field", "match"), [
    (Spec(Kind.FASTPOD, sm_percent=30, memory_bytes=GiB, quota_request=0.5), "spec.quota_limit",
     r"fraction in \(0, 1\], got 0"),
    (Spec(Kind.FASTPOD, sm_percent=30, memory_bytes=GiB, quota_request=0.5, quota_limit=1.5),
     "spec.quota_limit", r"fraction in \(0, 1\], got 1.5"),
    (Spec(Kind.EXCLUSIVE, mig_profile="1g.5gb", memory_bytes=4864 * 2**20 + 1), "spec.mig_profile",
     "1g.5gb on A100-SXM4-40GB has 4864 MiB"),              # memory is rounded up to whole MiB
])
def test_quota_and_rounding_edges_are_refused(spec, field, match):
    _check(spec, field, match)


def test_owner_length_is_inclusive_and_small_gpus_are_quoted_in_mib():
    _check(Spec(Kind.MPS, memory_bytes=GiB), "owner", "at most 253 characters, got 254", owner="o" * 254)
    tiny = Gpu(0, "GPU-t", "NVIDIA Tiny", 512 * 2**20, 8)
    _check(Spec(Kind.MPS, memory_bytes=600 * 2**20), "spec.memory_bytes",
           r"largest GPU's memory \(512 MiB\), got 600 MiB", gpus=[tiny])


def test_gpus_of_models_the_catalog_lacks_do_not_hide_the_mig_capable_ones():
    odd = Gpu(1, "GPU-x", "NVIDIA Mystery", 40 * GiB, 100, True, True)
    validate(Request(spec=Spec(Kind.EXCLUSIVE, mig_profile="3g.20gb")), [odd, A100])
    _check(Spec(Kind.EXCLUSIVE, sm_count=10), "spec.kind", "no MIG-capable GPU", gpus=[odd])


def test_the_longest_allocation_id_passes():
    from fastshare.controller.validation import check_allocation_id

    check_allocation_id("f" * 128)


def test_the_fastpod_crd_carries_the_ranges_the_controller_checks():
    """The CRD's schema is rendered from these ranges: the API server refuses the same FastPods
    (in-cluster a FastPod outside them is refused when applied, not at its first placement)."""
    from fastshare.controller import validation
    from fastshare.k8s import manifests

    gpu = manifests.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["gpu"]["properties"]
    assert (gpu["smCount"]["minimum"], gpu["smCount"]["maximum"]) == (1, validation.MAX_SM_COUNT)
    assert (gpu["count"]["minimum"], gpu["count"]["maximum"]) == (1, validation.MAX_GPUS_PER_NODE)
    assert gpu["models"]["maxItems"] == validation.MAX_LIST_ENTRIES
    assert gpu["models"]["items"]["maxLength"] == validation.MAX_MODEL_LENGTH
    assert {gpu[n]["pattern"] for n in ("affinity", "antiAffinity", "exclusion")} == {validation.TAG_PATTERN}


def test_memory_just_over_the_largest_gpu_is_not_quoted_as_equal_to_it():
    """A request a little over the largest GPU (80 GiB on an H100 whose NVML total is 79.65 GiB)
    read "must be <= ... (79.6 GiB), got 79.6 GiB": both figures are exact bytes when rounding
    makes them look the same."""
    h100 = Gpu(0, "GPU-h", "NVIDIA H100 80GB HBM3", 81559 * 2**20, 132)
    _check(Spec(Kind.MPS, memory_bytes=81560 * 2**20), "spec.memory_bytes",
           r"largest GPU's memory \(85520809984 bytes\), got 85521858560 bytes", gpus=[h100])
    one = Gpu(0, "GPU-o", "NVIDIA Small", GiB, 8)
    _check(Spec(Kind.MPS, memory_bytes=GiB + 1), "spec.memory_bytes",
           r"\(1073741824 bytes\), got 1073741825 bytes", gpus=[one])
    _check(Spec(Kind.MPS, memory_bytes=2 * GiB), "spec.memory_bytes",     # distinct: rounded figures
           r"largest GPU's memory \(1.0 GiB\), got 2.0 GiB", gpus=[one])


def test_a_label_key_over_the_length_limit_is_refused_naming_the_limit():
    """A key longer than any label key can be was checked first (before the key's syntax) and
    left ``problem`` unassigned: RegisterNode answered INTERNAL (UnboundLocalError) instead of
    naming the labels and the limit."""
    from fastshare.controller.validation import check_node_labels

    for labels in ({"k" * 318: "v"}, {"a": "b", "k" * 10_000: "v"}):
        with pytest.raises(ValidationError, match=r"label key 'k{80}': at most 317 characters$") as exc:
            check_node_labels(labels)
        assert exc.value.field == "labels"
    longest = ".".join(("a" * 63, "b" * 63, "c" * 63, "d" * 61)) + "/" + "n" * 63   # 253 + 1 + 63
    check_node_labels({longest: "v"})


H100 = Gpu(1, "GPU-h", "NVIDIA H100 80GB HBM3", 80 * GiB, 132, True, True)


@pytest.mark.parametrize(("spec", "kw", "field", "message"), [
    (Spec(Kind.MPS, memory_bytes=GiB, gpu_count=2), {}, "spec.gpu_count",
     "kind mps uses one GPU; use kind whole for 2 GPUs"),
    (Spec(Kind.MPS, memory_bytes=GiB, sm_percent=20), {}, "spec.sm_percent",
     "does not apply to kind mps; leave it unset"),
    (Spec(Kind.EXCLUSIVE, mig_profile="3g.20gb", sm_count=3), {}, "spec.mig_profile",
     "kind exclusive needs exactly one of mig_profile, sm_count or sm_percent, "
     "got ['mig_profile', 'sm_count']"),
    (Spec(Kind.EXCLUSIVE), {}, "spec.mig_profile",
     "kind exclusive needs exactly one of mig_profile, sm_count or sm_percent, got none"),
    (Spec(Kind.MPS, memory_bytes=GiB, affinity="a b"), {}, "spec.affinity",
     "tag 'a b' is invalid: 1-63 characters of letters, digits, '.', '_', '/', '-'"),
    (Spec(Kind.MPS, memory_bytes=GiB), {"lease_ttl": 2}, "lease_ttl_seconds",
     "must be 0 (no lease) or in 5..604800, got 2"),
    (Spec(Kind.MPS, memory_bytes=GiB, models=("ok", "m" * 130, "m" * 129)), {}, "spec.models",
     "entries of at most 128 characters, got 130"),                      # the first one too long
    (Spec(Kind.WHOLE, gpu_count=17), {}, "spec.gpu_count", "must be in 1..16, got 17"),
])
def test_refusals_read_in_full(spec, kw, field, message):
    """What a user reads: the field, the range or the choices, and what was given."""
    with pytest.raises(ValidationError) as exc:
        validate(Request(spec=spec, **kw), GPUS)
    assert (exc.value.field, exc.value.detail) == (field, message)


def test_no_mig_model_or_no_fitting_profile_says_so_with_each_models_reason():
    with pytest.raises(ValidationError) as exc:
        validate(Request(spec=Spec(Kind.EXCLUSIVE, sm_count=10)), [L4])
    assert exc.value.detail == ("no MIG-capable GPU model is present (present: ['NVIDIA L4']); "
                                "use kind fastpod, mps or whole")
    with pytest.raises(ValidationError) as exc:
        validate(Request(spec=Spec(Kind.EXCLUSIVE, sm_count=200)), [A100, H100, L4])
    assert exc.value.field == "spec.sm_count"
    assert exc.value.detail.startswith("no MIG profile of a GPU model present fits: 200 SMs requested but "
                                       "the largest MIG slice on A100-SXM4-40GB has 98"), exc.value.detail
    assert "GPU instead; 200 SMs requested but the largest MIG slice on H100-SXM5-80GB" in exc.value.detail


def test_node_label_refusals_quote_at_most_80_characters_of_the_label():
    from fastshare.controller.validation import check_node_labels

    with pytest.raises(ValidationError) as exc:
        check_node_labels({"k": "-" + "v" * 99})
    assert exc.value.detail == (f"label value '-{'v' * 79}' of 'k': empty or at most 63 letters, digits, "
                                "'-', '_' and '.', starting and ending with a letter or digit")
    with pytest.raises(ValidationError) as exc:
        check_node_labels({"-" + "k" * 99: "v"})
    assert exc.value.detail.startswith(f"label key '-{'k' * 79}': must be [PREFIX/]NAME"), exc.value.detail
