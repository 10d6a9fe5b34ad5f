"""The protos now against the previous release's descriptors (kvpool_v1_baseline.binpb), and the
checker itself against breaks made on purpose in a copy of the baseline."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
from google.protobuf import descriptor_pb2

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import wire_compat  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BASELINE = os.path.join(HERE, "kvpool_v1_baseline.binpb")
Field = descriptor_pb2.FieldDescriptorProto


def current_descriptors() -> descriptor_pb2.FileDescriptorSet:
    """The protos as they are now, described by the same script that writes the baseline."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "current.binpb")
        subprocess.run([os.path.join(ROOT, "scripts", "wire-compat-baseline.sh"), out],
                       check=True)
        return wire_compat.load(out)


@pytest.fixture
def baseline() -> descriptor_pb2.FileDescriptorSet:
    return wire_compat.load(BASELINE)


def message(fds, full_name):
    package, _, name = full_name.rpartition(".")
    for f in fds.file:
        if f.package == package:
            for m in f.message_type:
                if m.name == name:
                    return m
    raise KeyError(full_name)


def enum(fds, full_name):
    package, _, name = full_name.rpartition(".")
    for f in fds.file:
        if f.package == package:
            for e in f.enum_type:
                if e.name == name:
                    return e
    raise KeyError(full_name)


def service(fds, full_name):
    package, _, name = full_name.rpartition(".")
    for f in fds.file:
        if f.package == package:
            for s in f.service:
                if s.name == name:
                    return s
    raise KeyError(full_name)


def field(m, number):
    (f,) = [f for f in m.field if f.number == number]
    return f


def copy(fds):
    c = descriptor_pb2.FileDescriptorSet()
    c.CopyFrom(fds)
    return c


def test_the_protos_now_stay_wire_compatible_with_the_baseline(baseline):
    assert wire_compat.check(baseline, current_descriptors()) == []


def test_the_baseline_describes_kvpool_v1(baseline):
    packages = {f.package for f in baseline.file}
    assert "kvpool.v1" in packages
    assert service(baseline, "kvpool.v1.StatsService").method
    # Compact: no source info (comments, spans) is stored.
    assert all(not f.HasField("source_code_info") for f in baseline.file)


def test_an_unchanged_set_and_added_fields_rpcs_and_values_pass(baseline):
    assert wire_compat.check(baseline, baseline) == []
    new = copy(baseline)
    stats = message(new, "kvpool.v1.GetStatsResponse")
    added = stats.field.add(name="added_later", number=999, type=Field.TYPE_STRING,
                            label=Field.LABEL_OPTIONAL, json_name="addedLater")
    assert added.number == 999
    svc = service(new, "kvpool.v1.StatsService")
    svc.method.add(name="AddedLater", input_type=".kvpool.v1.GetStatsRequest",
                   output_type=".kvpool.v1.GetStatsResponse")
    enum(new, "kvpool.v1.TenantRole").value.add(name="ROLE_ADDED_LATER", number=999)
    assert wire_compat.check(baseline, new) == []


def test_a_renamed_field_passes(baseline):
    new = copy(baseline)
    field(message(new, "kvpool.v1.GetStatsResponse"), 6).name = "renamed_tenant"
    assert wire_compat.check(baseline, new) == []


def test_a_field_number_kept_with_another_type_fails(baseline):
    new = copy(baseline)
    f = field(message(new, "kvpool.v1.GetStatsResponse"), 7)  # uint64 quota_bytes
    f.type = Field.TYPE_STRING
    (b,) = wire_compat.check(baseline, new)
    assert "GetStatsResponse: field 7 (quota_bytes) changed type" in b


def test_a_field_number_kept_with_another_message_type_fails(baseline):
    new = copy(baseline)
    f = field(message(new, "kvpool.v1.GetStatsResponse"), 1)  # PoolStats pool
    f.type_name = ".kvpool.v1.ServiceStats"
    (b,) = wire_compat.check(baseline, new)
    assert "field 1 (pool) changed type" in b


def test_a_field_number_kept_with_another_label_fails(baseline):
    new = copy(baseline)
    field(message(new, "kvpool.v1.GetStatsResponse"), 7).label = Field.LABEL_REPEATED
    (b,) = wire_compat.check(baseline, new)
    assert "changed label" in b


def test_a_removed_field_fails_unless_its_number_is_reserved(baseline):
    new = copy(baseline)
    stats = message(new, "kvpool.v1.GetStatsResponse")
    kept = [f for f in stats.field if f.number != 6]
    del stats.field[:]
    stats.field.extend(kept)
    (b,) = wire_compat.check(baseline, new)
    assert "field 6 (tenant) removed without reserving its number" in b
    stats.reserved_range.add(start=6, end=7)
    assert wire_compat.check(baseline, new) == []


def test_a_reserved_number_taken_by_a_field_fails(baseline):
    old = copy(baseline)
    message(old, "kvpool.v1.GetStatsResponse").reserved_range.add(start=900, end=901)
    new = copy(old)
    message(new, "kvpool.v1.GetStatsResponse").field.add(
        name="reuse", number=900, type=Field.TYPE_BOOL, label=Field.LABEL_OPTIONAL)
    (b,) = wire_compat.check(old, new)
    assert "field 900 (reuse) takes a reserved number" in b


def test_a_removed_or_renamed_rpc_fails(baseline):
    new = copy(baseline)
    svc = service(new, "kvpool.v1.StatsService")
    name = svc.method[0].name
    svc.method[0].name = name + "Renamed"
    (b,) = wire_compat.check(baseline, new)
    assert f"kvpool.v1.StatsService/{name}: RPC removed or renamed" in b
    del svc.method[0]
    assert wire_compat.check(baseline, new) == [b]


def test_a_changed_request_or_response_type_fails(baseline):
    new = copy(baseline)
    svc = service(new, "kvpool.v1.StatsService")
    svc.method[0].input_type = ".kvpool.v1.GetStatsResponse"
    svc.method[0].output_type = ".kvpool.v1.GetStatsRequest"
    breaks = wire_compat.check(baseline, new)
    assert len(breaks) == 2
    assert "request type" in breaks[0] and "response type" in breaks[1]


def test_a_changed_streaming_fails(baseline):
    new = copy(baseline)
    svc = service(new, "kvpool.v1.StatsService")
    svc.method[0].server_streaming = not svc.method[0].server_streaming
    (b,) = wire_compat.check(baseline, new)
    assert "streaming changed" in b


def test_a_renumbered_or_removed_enum_value_fails(baseline):
    new = copy(baseline)
    role = enum(new, "kvpool.v1.TenantRole")
    last = role.value[-1]
    old_number = last.number
    last.number = old_number + 100
    (b,) = wire_compat.check(baseline, new)
    assert (f"kvpool.v1.TenantRole: value {last.name} renumbered {old_number} -> "
            f"{old_number + 100}") in b
    del role.value[-1]
    (b,) = wire_compat.check(baseline, new)
    assert "removed without reserving its number" in b


def test_a_removed_message_or_service_fails(baseline):
    new = copy(baseline)
    for f in new.file:
        if f.package == "kvpool.v1":
            kept = [s for s in f.service if s.name != "StatsService"]
            del f.service[:]
            f.service.extend(kept)
    assert wire_compat.check(baseline, new) == ["kvpool.v1.StatsService: service removed"]


def test_the_command_line_exits_1_on_a_break(baseline):
    new = copy(baseline)
    field(message(new, "kvpool.v1.GetStatsResponse"), 7).type = Field.TYPE_STRING
    with tempfile.TemporaryDirectory() as d:
        broken = os.path.join(d, "broken.binpb")
        with open(broken, "wb") as out:
            out.write(new.SerializeToString())
        script = os.path.join(HERE, "wire_compat.py")
        ok = subprocess.run([sys.executable, script, BASELINE, BASELINE])
        bad = subprocess.run([sys.executable, script, BASELINE, broken], capture_output=True,
                             text=True)
    assert ok.returncode == 0
    assert bad.returncode == 1 and "field 7 (quota_bytes) changed type" in bad.stdout
