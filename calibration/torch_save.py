"""Writes torch.save zip archives of float32 tensors without torch (standard library only).

Used by the RotationZoo converter's tests (synthetic archives) and by
tests/fixtures/compact_oscar_reference.py (the published rotations cut down to a few layers).

The pickle is written by Python's own pickler, with stand-ins registered as
`torch.FloatStorage` and `torch._utils._rebuild_tensor_v2` and storages emitted as persistent
ids, which is how torch.save itself pickles: the bytes are the ones torch writes for the same
object. The archive holds `<prefix>/data.pkl`, any leading entries, one `<prefix>/data/<key>`
entry per storage (little-endian, uncompressed, aligned like torch's), then any trailing entries.

    rot = Storage("0", values)                                # D*D floats
    obj = {"rotation": Tensor(rot, 0, (d, d), (d, 1))}
    write_archive("m.pt", obj, [rot])
"""

import array
import collections
import io
import pickle
import struct
import sys
import types
import zipfile


class FloatStorage:
    """Stands in for torch.FloatStorage: pickled as the global 'torch FloatStorage'."""


def _rebuild_tensor_v2(*args):
    raise AssertionError("a stand-in for pickling only")


FloatStorage.__module__ = "torch"
FloatStorage.__qualname__ = "FloatStorage"
_rebuild_tensor_v2.__module__ = "torch._utils"
_rebuild_tensor_v2.__qualname__ = "_rebuild_tensor_v2"
_TORCH = types.ModuleType("torch")
_TORCH_UTILS = types.ModuleType("torch._utils")
_TORCH.FloatStorage = FloatStorage
_TORCH_UTILS._rebuild_tensor_v2 = _rebuild_tensor_v2
_TORCH._utils = _TORCH_UTILS


class Storage:
    """A float32 storage: its key names the archive entry data/<key>."""

    def __init__(self, key, values):
        self.key = key
        self.values = values


class Tensor:
    """A strided view of a Storage, pickled as torch pickles a CPU tensor."""

    def __init__(self, storage, offset, size, stride):
        self.args = (storage, offset, tuple(size), tuple(stride), False,
                     collections.OrderedDict())

    def __reduce__(self):
        return (_rebuild_tensor_v2, self.args)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, Storage):
            return ("storage", FloatStorage, obj.key, "cpu", len(obj.values))
        return None


def pickle_bytes(obj):
    """The data.pkl bytes of `obj` (protocol 2, as torch.save writes)."""
    saved = {k: sys.modules.get(k) for k in ("torch", "torch._utils")}
    sys.modules["torch"] = _TORCH
    sys.modules["torch._utils"] = _TORCH_UTILS
    try:
        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(obj)
        return buf.getvalue()
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def float32_le_bytes(values):
    out = array.array("f", values)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


def _write_aligned(archive, name, data, alignment):
    """Stores `data` so that it starts at a multiple of `alignment` in the file (torch aligns
    storages to 64 bytes with a padding extra field in the local header)."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    if alignment > 1:
        start = archive.fp.tell() + 30 + len(name.encode("utf-8"))
        pad = (-(start + 4)) % alignment
        info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # id "FB", as torch's writer
    archive.writestr(info, data)


def write_archive(path, obj, storages, prefix="archive", leading=(("byteorder", b"little"),),
                  trailing=(), alignment=64, storage_bytes_override=None):
    """Writes a torch.save archive of `obj` whose tensors reference `storages`.

    leading / trailing: (name, bytes) entries under `prefix` written before and after the
    storages (torch writes .format_version, .storage_alignment and byteorder before them,
    version and .data/serialization_id after). storage_bytes_override maps a storage key to the
    bytes to store instead of its values (for tests of malformed archives).
    """
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        _write_aligned(z, prefix + "/data.pkl", pickle_bytes(obj), 1)
        for name, data in leading:
            _write_aligned(z, "%s/%s" % (prefix, name), data, 1)
        for s in storages:
            data = float32_le_bytes(s.values)
            if storage_bytes_override and s.key in storage_bytes_override:
                data = storage_bytes_override[s.key]
            _write_aligned(z, "%s/data/%s" % (prefix, s.key), data, alignment)
        for name, data in trailing:
            _write_aligned(z, "%s/%s" % (prefix, name), data, 1)
