#!/usr/bin/env python3
"""Convert OSCAR RotationZoo rotations (.pt) into a kvpool rotation file (.safetensors).

The reference publishes one torch.save checkpoint per tensor (K and V), a zip archive holding a
pickled dict (docs/oscar-method.md section 14):

    {"format_version": 1, "objective": str, "source_grouping": "layer",
     "layers": {id: {"layer_id": int, "rotation": float32[D, D], "eigenvalues": float32[D]}}}

This converter reads them with the standard library only: the pickle is loaded by a restricted
Unpickler that knows the three globals such a checkpoint uses (torch._utils._rebuild_tensor_v2,
the typed storage classes, collections.OrderedDict) and rebuilds tensors from the raw
little-endian storages in the zip. Any other global is refused, so no code from the file runs.

The output is kvpool rotation format 1 (kernels/rotation_file.h), kind "dense", with the
eigenvalues, and without codec_version: the C++ reader computes it, and
`kvpool-rotation stamp IN OUT` writes a stamped copy.

    python3 calibration/rotationzoo_convert.py --k k_rotation_qqt_r_h_pbr.pt \\
        --v v_rotation_sst_r_h_pbr.pt --model-id qwen3-4b-thinking-2507 --out qwen3-4b.safetensors
"""

import argparse
import array
import collections
import json
import math
import os
import pickle
import struct
import sys
import zipfile

# Typed storages a RotationZoo file may use: (array typecode, bytes per element, safetensors dtype).
_STORAGE_TYPES = {
    "FloatStorage": ("f", 4),
    "DoubleStorage": ("d", 8),
}

# Largest storage we accept (elements): far above 256 x 256 matrices, far below a memory bomb.
_MAX_STORAGE_ELEMENTS = 1 << 26


class ConvertError(Exception):
    """A problem with the input files, reported as one clear line."""


class _StorageType:
    """Stands in for torch.FloatStorage & co. inside the pickle: only names a dtype."""

    def __init__(self, name):
        self.name = name
        self.typecode, self.itemsize = _STORAGE_TYPES[name]


class _Storage:
    """A flat typed storage read from the zip's data/<key> entry."""

    def __init__(self, values, name):
        self.values = values  # array.array
        self.name = name


class Tensor:
    """A rebuilt tensor: shape and row-major values (array.array of the storage type)."""

    def __init__(self, shape, values, typecode):
        self.shape = tuple(shape)
        self.values = values
        self.typecode = typecode

    def float32_bytes(self):
        """The values as little-endian float32 bytes (converted from float64 if need be)."""
        out = array.array("f", self.values) if self.typecode != "f" else self.values
        if sys.byteorder != "little":
            out = array.array("f", out)
            out.byteswap()
        return out.tobytes()


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
    """torch._utils._rebuild_tensor_v2, for dense strided CPU tensors only."""
    del requires_grad, backward_hooks, metadata  # irrelevant to the values
    if not isinstance(storage, _Storage):
        raise ConvertError("tensor does not reference a storage")
    size = tuple(size)
    stride = tuple(stride)
    if len(size) != len(stride) or any(not isinstance(x, int) or x < 0 for x in size + stride):
        raise ConvertError("tensor has a malformed size or stride")
    if not isinstance(storage_offset, int) or storage_offset < 0:
        raise ConvertError("tensor has a malformed storage offset")
    numel = math.prod(size)
    src = storage.values
    if numel == 0:
        return Tensor(size, array.array(src.typecode), src.typecode)
    last = storage_offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= len(src):
        raise ConvertError("tensor %s reaches past its storage (%d >= %d elements)"
                           % (storage.name, last, len(src)))
    contiguous = []
    expected = 1
    for n, s in reversed(list(zip(size, stride))):
        contiguous.append(s == expected or n == 1)
        expected *= n
    if all(contiguous):
        values = src[storage_offset:storage_offset + numel]
    else:
        # General strided gather, row-major order.
        values = array.array(src.typecode)
        index = [0] * len(size)
        for _ in range(numel):
            values.append(src[storage_offset + sum(i * s for i, s in zip(index, stride))])
            for d in reversed(range(len(size))):
                index[d] += 1
                if index[d] < size[d]:
                    break
                index[d] = 0
    return Tensor(size, values, src.typecode)


class _RestrictedUnpickler(pickle.Unpickler):
    """Loads a torch.save data.pkl without torch, refusing every other global."""

    def __init__(self, file, archive, prefix):
        super().__init__(file)
        self._archive = archive
        self._prefix = prefix
        self._storages = {}

    def find_class(self, module, name):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "torch" and name in _STORAGE_TYPES:
            return _StorageType(name)
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        raise pickle.UnpicklingError(
            "refusing to load global %s.%s: not part of a RotationZoo tensor checkpoint"
            % (module, name))

    def persistent_load(self, pid):
        # ('storage', storage_type, key, location, numel)
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
            raise pickle.UnpicklingError("unsupported persistent id %r" % (pid,))
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError("unsupported storage type %r" % (storage_type,))
        if not isinstance(key, str) or not key.isdigit():
            raise pickle.UnpicklingError("malformed storage key %r" % (key,))
        if not isinstance(numel, int) or not 0 <= numel <= _MAX_STORAGE_ELEMENTS:
            raise pickle.UnpicklingError("storage %s has an unsupported size %r" % (key, numel))
        if key in self._storages:
            return self._storages[key]
        entry = "%s/data/%s" % (self._prefix, key)
        try:
            info = self._archive.getinfo(entry)
        except KeyError:
            raise pickle.UnpicklingError("storage %s is missing from the archive" % entry)
        nbytes = numel * storage_type.itemsize
        if info.file_size != nbytes:
            raise pickle.UnpicklingError("storage %s holds %d bytes, expected %d (%d x %s)"
                                         % (entry, info.file_size, nbytes, numel,
                                            storage_type.name))
        values = array.array(storage_type.typecode)
        values.frombytes(self._archive.read(entry))
        if sys.byteorder != "little":
            values.byteswap()  # torch.save storages are little-endian (checked in load_pt)
        storage = _Storage(values, entry)
        self._storages[key] = storage
        return storage


def load_pt(path):
    """Returns the unpickled object of a torch.save zip archive, without importing torch."""
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as e:
        raise ConvertError("%s: not a torch.save zip archive (%s)" % (path, e))
    with archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise ConvertError("%s: expected one <name>/data.pkl in the archive, found %d"
                               % (path, len(pickles)))
        prefix = pickles[0][: -len("/data.pkl")]
        byteorder_entry = prefix + "/byteorder"
        if byteorder_entry in archive.namelist():
            order = archive.read(byteorder_entry).decode("ascii", "replace").strip()
            if order != "little":
                raise ConvertError("%s: storages are %s-endian; only little is supported"
                                   % (path, order))
        with archive.open(pickles[0]) as f:
            try:
                return _RestrictedUnpickler(f, archive, prefix).load()
            except ConvertError as e:
                raise ConvertError("%s: %s" % (path, e))
            except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError,
                    AttributeError, IndexError) as e:
                raise ConvertError("%s: %s" % (path, e))


def parse_rotations(obj, path):
    """Validates the RotationZoo schema. Returns (objective, [(rotation, eigenvalues)], D)."""
    if not isinstance(obj, dict):
        raise ConvertError("%s: top level is %s, expected a dict" % (path, type(obj).__name__))
    if obj.get("format_version") != 1:
        raise ConvertError("%s: format_version is %r, expected 1"
                           % (path, obj.get("format_version")))
    if obj.get("source_grouping", "layer") != "layer":
        raise ConvertError("%s: source_grouping %r is not supported (only per-layer rotations)"
                           % (path, obj.get("source_grouping")))
    objective = obj.get("objective", "")
    if not isinstance(objective, str):
        raise ConvertError("%s: objective is not a string" % path)
    layers = obj.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise ConvertError("%s: 'layers' is missing or empty" % path)
    by_id = {}
    for key, entry in layers.items():
        try:
            layer_id = int(key)
        except (TypeError, ValueError):
            raise ConvertError("%s: layer key %r is not an integer" % (path, key))
        if layer_id in by_id:
            raise ConvertError("%s: layer %d appears twice" % (path, layer_id))
        if not isinstance(entry, dict):
            raise ConvertError("%s: layer %d is not a dict" % (path, layer_id))
        if "layer_id" in entry and entry["layer_id"] != layer_id:
            raise ConvertError("%s: layer key %d holds layer_id %r"
                               % (path, layer_id, entry["layer_id"]))
        by_id[layer_id] = entry
    ids = sorted(by_id)
    if ids != list(range(len(ids))):
        raise ConvertError(
            "%s: layer ids %s are not 0..%d; kvpool rotation format 1 stores every layer "
            "(hybrid models with attention-only layer ids are not supported)"
            % (path, ids[:8] + (["..."] if len(ids) > 8 else []), len(ids) - 1))
    d = None
    out = []
    for layer_id in ids:
        entry = by_id[layer_id]
        rotation = entry.get("rotation")
        eigen = entry.get("eigenvalues")
        if not isinstance(rotation, Tensor):
            raise ConvertError("%s: layer %d has no rotation tensor" % (path, layer_id))
        if len(rotation.shape) != 2 or rotation.shape[0] != rotation.shape[1]:
            raise ConvertError("%s: layer %d rotation has shape %s, expected [D, D]"
                               % (path, layer_id, list(rotation.shape)))
        if d is None:
            d = rotation.shape[0]
        if rotation.shape != (d, d):
            raise ConvertError("%s: layer %d rotation has shape %s, expected [%d, %d]"
                               % (path, layer_id, list(rotation.shape), d, d))
        if eigen is not None and (not isinstance(eigen, Tensor) or eigen.shape != (d,)):
            raise ConvertError("%s: layer %d eigenvalues are not a [%d] tensor"
                               % (path, layer_id, d))
        for name, t in (("rotation", rotation), ("eigenvalues", eigen)):
            if t is not None and not all(math.isfinite(x) for x in t.values):
                raise ConvertError("%s: layer %d %s has a non-finite value" % (path, layer_id, name))
        out.append((rotation, eigen))
    if d < 32 or d > 256 or d & (d - 1):
        raise ConvertError("%s: head_dim %d is not a power of two in [32, 256]" % (path, d))
    return objective, out, d


def shortest_float32(x):
    """The shortest decimal that reads back as the same float32 (as C++ std::to_chars writes)."""
    f = struct.unpack("<f", struct.pack("<f", x))[0]
    for digits in range(1, 10):
        s = "%.*g" % (digits, f)
        if struct.unpack("<f", struct.pack("<f", float(s)))[0] == f:
            return s
    return repr(f)


def write_safetensors(path, metadata, tensors):
    """tensors: list of (name, shape, float32 bytes). Data section 8-byte aligned, no holes."""
    header = {"__metadata__": metadata}
    offset = 0
    for name, shape, data in tensors:
        header[name] = {"dtype": "F32", "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, data in tensors:
            f.write(data)
    os.replace(tmp, path)


def convert(args):
    k_obj = load_pt(args.k)
    v_obj = load_pt(args.v)
    k_objective, k_layers, d = parse_rotations(k_obj, args.k)
    v_objective, v_layers, v_d = parse_rotations(v_obj, args.v)
    if len(k_layers) != len(v_layers) or d != v_d:
        raise ConvertError("K has %d layers of D=%d but V has %d layers of D=%d"
                           % (len(k_layers), d, len(v_layers), v_d))
    has_k_eigen = all(e is not None for _, e in k_layers)
    has_v_eigen = all(e is not None for _, e in v_layers)

    tensors = []
    for i, ((k_rot, k_eig), (v_rot, v_eig)) in enumerate(zip(k_layers, v_layers)):
        tensors.append(("layers.%d.k_rotation" % i, (d, d), k_rot.float32_bytes()))
        tensors.append(("layers.%d.v_rotation" % i, (d, d), v_rot.float32_bytes()))
        if has_k_eigen:
            tensors.append(("layers.%d.k_eigenvalues" % i, (d,), k_eig.float32_bytes()))
        if has_v_eigen:
            tensors.append(("layers.%d.v_eigenvalues" % i, (d,), v_eig.float32_bytes()))

    metadata = {
        "format": "kvpool-rotation",
        "format_version": "1",
        "model_id": args.model_id,
        "num_layers": str(len(k_layers)),
        "head_dim": str(d),
        "rotation_kind": "dense",
        "objective": "%s/%s" % (k_objective, v_objective),
        "v_prerotated": "true" if args.v_prerotated else "false",
        "bits": str(args.bits),
        "group_size": str(args.group_size),
        "quantizer": args.quantizer,
        "scale_dtype": args.scale_dtype,
        "clip_ratio_k": shortest_float32(args.clip_k),
        "clip_ratio_v": shortest_float32(args.clip_v),
        "block_tokens": str(args.block_tokens),
        "sink_tokens": str(args.sink_tokens),
        "recent_tokens": str(args.recent_tokens),
        "demotion_batch": str(args.demotion_batch),
        "source_k": os.path.basename(args.k),
        "source_v": os.path.basename(args.v),
    }
    write_safetensors(args.out, metadata, tensors)
    not_ascending = [i for i, (_, e) in enumerate(k_layers + v_layers)
                     if e is not None and any(a > b for a, b in zip(e.values, e.values[1:]))]
    print("wrote %s: %d layers, D=%d, objective %s, eigenvalues K:%s V:%s%s"
          % (args.out, len(k_layers), d, metadata["objective"], "yes" if has_k_eigen else "no",
             "yes" if has_v_eigen else "no",
             "" if not not_ascending else " (warning: some eigenvalues not ascending)"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--k", required=True, help="RotationZoo K file, e.g. k_rotation_qqt_r_h_pbr.pt")
    p.add_argument("--v", required=True, help="RotationZoo V file, e.g. v_rotation_sst_r_h_pbr.pt")
    p.add_argument("--model-id", required=True)
    p.add_argument("--out", required=True, help="output .safetensors rotation file")
    p.add_argument("--clip-k", type=float, default=0.96)
    p.add_argument("--clip-v", type=float, default=0.92)
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--group-size", type=int, default=0, help="0 means G = D")
    p.add_argument("--quantizer", default="uniform", choices=["uniform", "lloyd_max", "bypass"])
    p.add_argument("--scale-dtype", default="fp16", choices=["fp16", "bf16"])
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--sink-tokens", type=int, default=64)
    p.add_argument("--recent-tokens", type=int, default=256)
    p.add_argument("--demotion-batch", type=int, default=16)
    p.add_argument("--v-prerotated", action="store_true",
                   help="the engine folds M_V into its V projection (V arrives rotated)")
    args = p.parse_args(argv)
    if not args.model_id:
        p.error("--model-id must not be empty")
    try:
        convert(args)
    except ConvertError as e:
        print("rotationzoo_convert: error: %s" % e, file=sys.stderr)
        return 1
    except OSError as e:
        print("rotationzoo_convert: error: %s" % e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
