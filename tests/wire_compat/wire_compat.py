"""Wire-compatibility check of kvpool's protos against a previous release's descriptors.

A rolling upgrade mixes daemons and clients of two releases, so a release may add to the API
but never change what a byte on the wire means. Given the FileDescriptorSet of the previous
release (the baseline, tests/wire_compat/kvpool_v1_baseline.binpb) and of the protos now, this
lists every change that breaks that, in the packages kvpool.*:

- a field number kept with another type, another message/enum type, or another label;
- a field removed without its number reserved, or a reserved number taken by a field;
- a message, enum or service removed;
- an RPC removed or renamed, its request or response type changed, or its streaming changed;
- an enum value renumbered or removed without its number reserved.

Renaming a field or an enum value is allowed (the binary wire carries numbers, not names).

    python3 wire_compat.py BASELINE.binpb CURRENT.binpb    # prints the breaks, exit 1 if any
"""

from __future__ import annotations

import sys
from typing import Dict, Iterable, List, Tuple

from google.protobuf import descriptor_pb2

FDS = descriptor_pb2.FileDescriptorSet
Field = descriptor_pb2.FieldDescriptorProto

# Only kvpool's own packages are checked (imports such as google.rpc are not kvpool's to keep).
_CHECKED_PACKAGE_PREFIX = "kvpool."


def load(path: str) -> descriptor_pb2.FileDescriptorSet:
    fds = FDS()
    with open(path, "rb") as f:
        fds.ParseFromString(f.read())
    return fds


def _index(fds: descriptor_pb2.FileDescriptorSet) -> Tuple[Dict[str, object], Dict[str, object],
                                                         Dict[str, object]]:
    """(messages, enums, services) by full name, nested ones included."""
    messages: Dict[str, descriptor_pb2.DescriptorProto] = {}
    enums: Dict[str, descriptor_pb2.EnumDescriptorProto] = {}
    services: Dict[str, descriptor_pb2.ServiceDescriptorProto] = {}

    def walk(prefix: str, msgs: Iterable, enum_types: Iterable) -> None:
        for e in enum_types:
            enums[f"{prefix}.{e.name}"] = e
        for m in msgs:
            name = f"{prefix}.{m.name}"
            messages[name] = m
            walk(name, m.nested_type, m.enum_type)

    for f in fds.file:
        if not f.package.startswith(_CHECKED_PACKAGE_PREFIX):
            continue
        walk(f.package, f.message_type, f.enum_type)
        for s in f.service:
            services[f"{f.package}.{s.name}"] = s
    return messages, enums, services


def _in_ranges(number: int, ranges: Iterable) -> bool:
    # DescriptorProto.ReservedRange's end is exclusive; EnumReservedRange's is inclusive.
    return any(r.start <= number < r.end for r in ranges)


def _enum_reserved(number: int, ranges: Iterable) -> bool:
    return any(r.start <= number <= r.end for r in ranges)


def _type_of(f: descriptor_pb2.FieldDescriptorProto) -> str:
    name = Field.Type.Name(f.type)
    return f"{name}({f.type_name})" if f.type_name else name


def _check_message(name: str, old: descriptor_pb2.DescriptorProto,
                   new: descriptor_pb2.DescriptorProto) -> List[str]:
    breaks = []
    new_fields = {f.number: f for f in new.field}
    for of in old.field:
        nf = new_fields.get(of.number)
        where = f"{name}: field {of.number} ({of.name})"
        if nf is None:
            if not _in_ranges(of.number, new.reserved_range):
                breaks.append(f"{where} removed without reserving its number")
            continue
        if _type_of(of) != _type_of(nf):
            breaks.append(f"{where} changed type {_type_of(of)} -> {_type_of(nf)}")
        if of.label != nf.label:
            breaks.append(f"{where} changed label {Field.Label.Name(of.label)} -> "
                          f"{Field.Label.Name(nf.label)}")
    for nf in new.field:
        if _in_ranges(nf.number, old.reserved_range):
            breaks.append(f"{name}: field {nf.number} ({nf.name}) takes a reserved number")
    return breaks


def _check_enum(name: str, old: descriptor_pb2.EnumDescriptorProto,
                new: descriptor_pb2.EnumDescriptorProto) -> List[str]:
    breaks = []
    new_by_name = {v.name: v.number for v in new.value}
    new_numbers = {v.number for v in new.value}
    for ov in old.value:
        if ov.name in new_by_name and new_by_name[ov.name] != ov.number:
            breaks.append(f"{name}: value {ov.name} renumbered {ov.number} -> "
                          f"{new_by_name[ov.name]}")
        elif ov.number not in new_numbers and not _enum_reserved(ov.number, new.reserved_range):
            breaks.append(f"{name}: value {ov.name} ({ov.number}) removed without reserving "
                          "its number")
    for nv in new.value:
        if _enum_reserved(nv.number, old.reserved_range):
            breaks.append(f"{name}: value {nv.name} takes a reserved number {nv.number}")
    return breaks


def _check_service(name: str, old: descriptor_pb2.ServiceDescriptorProto,
                   new: descriptor_pb2.ServiceDescriptorProto) -> List[str]:
    breaks = []
    new_methods = {m.name: m for m in new.method}
    for om in old.method:
        nm = new_methods.get(om.name)
        where = f"{name}/{om.name}"
        if nm is None:
            breaks.append(f"{where}: RPC removed or renamed")
            continue
        if om.input_type != nm.input_type:
            breaks.append(f"{where}: request type {om.input_type} -> {nm.input_type}")
        if om.output_type != nm.output_type:
            breaks.append(f"{where}: response type {om.output_type} -> {nm.output_type}")
        if (om.client_streaming, om.server_streaming) != (nm.client_streaming,
                                                           nm.server_streaming):
            breaks.append(f"{where}: streaming changed")
    return breaks


def check(baseline: descriptor_pb2.FileDescriptorSet,
          current: descriptor_pb2.FileDescriptorSet) -> List[str]:
    """Every wire-incompatible change from `baseline` to `current`; empty when there is none."""
    old_msgs, old_enums, old_svcs = _index(baseline)
    new_msgs, new_enums, new_svcs = _index(current)
    breaks: List[str] = []
    for name, old in sorted(old_msgs.items()):
        if name not in new_msgs:
            breaks.append(f"{name}: message removed")
        else:
            breaks += _check_message(name, old, new_msgs[name])
    for name, old in sorted(old_enums.items()):
        if name not in new_enums:
            breaks.append(f"{name}: enum removed")
        else:
            breaks += _check_enum(name, old, new_enums[name])
    for name, old in sorted(old_svcs.items()):
        if name not in new_svcs:
            breaks.append(f"{name}: service removed")
        else:
            breaks += _check_service(name, old, new_svcs[name])
    return breaks


def main(argv: List[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    breaks = check(load(argv[1]), load(argv[2]))
    for b in breaks:
        print(b)
    if breaks:
        print(f"{len(breaks)} wire-incompatible change(s) from {argv[1]}", file=sys.stderr)
    return 1 if breaks else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
