#!/usr/bin/env python3
"""Tests for rotationzoo_convert.py on synthetic torch.save archives (standard library only).

The archives are written by torch_save.py, whose pickle bytes have the same shape as torch's.
"""

import array
import contextlib
import io
import json
import math
import os
import struct
import sys
import tempfile
import unittest
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rotationzoo_convert as convert  # noqa: E402
import torch_save  # noqa: E402

FakeStorage = torch_save.Storage
FakeTensor = torch_save.Tensor


def write_pt(path, obj, storages, prefix="archive", storage_bytes_override=None):
    torch_save.write_archive(path, obj, storages, prefix=prefix,
                             storage_bytes_override=storage_bytes_override)


def hadamard(d, sign):
    """Orthonormal Sylvester Hadamard with row signs, row-major list."""
    s = 1.0 / math.sqrt(d)
    return [sign[i] * s * (-1.0 if bin(i & j).count("1") % 2 else 1.0)
            for i in range(d) for j in range(d)]


def rotation_dict(num_layers, d, objective, seed, key_type=int, transpose_layer=None):
    storages = []
    layers = {}
    for layer in range(num_layers):
        sign = [(-1.0 if (seed * 31 + layer * 7 + i) % 3 == 0 else 1.0) for i in range(d)]
        m = hadamard(d, sign)
        rot_storage = FakeStorage(str(2 * layer), m)
        eig_storage = FakeStorage(str(2 * layer + 1), [float(i + seed) for i in range(d)])
        storages += [rot_storage, eig_storage]
        if layer == transpose_layer:
            # A transposed view: the storage holds M^T, the tensor's strides make it M again.
            mt = [m[j * d + i] for i in range(d) for j in range(d)]
            rot_storage.values = mt
            rotation = FakeTensor(rot_storage, 0, (d, d), (1, d))
        else:
            rotation = FakeTensor(rot_storage, 0, (d, d), (d, 1))
        layers[key_type(layer)] = {
            "layer_id": layer,
            "rotation": rotation,
            "eigenvalues": FakeTensor(eig_storage, 0, (d,), (1,)),
        }
    obj = {"format_version": 1, "objective": objective, "source_grouping": "layer",
           "layers": layers}
    return obj, storages


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    base = 8 + n
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        tensors[name] = (info["shape"], array.array("f", data[base + b:base + e]).tolist())
    return header["__metadata__"], tensors, base


class ConverterTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.dir, name)

    def run_main(self, argv):
        err = io.StringIO()
        out = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = convert.main(argv)
        return rc, err.getvalue()

    def make_pair(self, num_layers=3, d=32, k_kwargs=None, v_kwargs=None):
        k_obj, k_st = rotation_dict(num_layers, d, "qqt_r_h_pbr", 1, **(k_kwargs or {}))
        v_obj, v_st = rotation_dict(num_layers, d, "sst_r_h_pbr", 2, **(v_kwargs or {}))
        write_pt(self.path("k.pt"), k_obj, k_st)
        write_pt(self.path("v.pt"), v_obj, v_st)
        return k_obj, v_obj

    def convert_pair(self, extra=()):
        return self.run_main(["--k", self.path("k.pt"), "--v", self.path("v.pt"),
                              "--model-id", "toy", "--out", self.path("out.safetensors")]
                             + list(extra))

    def test_converts_values_and_metadata(self):
        self.make_pair(v_kwargs={"key_type": str, "transpose_layer": 1})
        rc, err = self.convert_pair(["--clip-k", "0.97", "--clip-v", "0.3", "--v-prerotated"])
        self.assertEqual(rc, 0, err)
        meta, tensors, base = read_safetensors(self.path("out.safetensors"))
        self.assertEqual(base % 8, 0)
        self.assertEqual(meta["format"], "kvpool-rotation")
        self.assertEqual(meta["format_version"], "1")
        self.assertEqual(meta["rotation_kind"], "dense")
        self.assertEqual(meta["num_layers"], "3")
        self.assertEqual(meta["head_dim"], "32")
        self.assertEqual(meta["model_id"], "toy")
        self.assertEqual(meta["objective"], "qqt_r_h_pbr/sst_r_h_pbr")
        self.assertEqual(meta["clip_ratio_k"], "0.97")
        self.assertEqual(meta["clip_ratio_v"], "0.3")
        self.assertEqual(meta["v_prerotated"], "true")
        self.assertNotIn("codec_version", meta)
        self.assertEqual(len(tensors), 12)
        for layer in range(3):
            for tensor, seed in (("k", 1), ("v", 2)):
                sign = [(-1.0 if (seed * 31 + layer * 7 + i) % 3 == 0 else 1.0) for i in range(32)]
                want = array.array("f", hadamard(32, sign)).tolist()
                shape, got = tensors["layers.%d.%s_rotation" % (layer, tensor)]
                self.assertEqual(shape, [32, 32])
                self.assertEqual(got, want, (layer, tensor))
                shape, eig = tensors["layers.%d.%s_eigenvalues" % (layer, tensor)]
                self.assertEqual(shape, [32])
                self.assertEqual(eig, [float(i + seed) for i in range(32)])

    def test_refuses_foreign_globals_without_running_them(self):
        marker = self.path("pwned")
        for module, name in (("os", "system"), ("builtins", "eval"), ("subprocess", "call")):
            payload = ("c%s\n%s\nX%s%s\x85R." % (
                module, name, struct.pack("<I", len("touch " + marker)).decode("latin-1"),
                "touch " + marker)).encode("latin-1")
            with zipfile.ZipFile(self.path("evil.pt"), "w") as z:
                z.writestr("archive/data.pkl", b"\x80\x02" + payload)
            rc, err = self.run_main(["--k", self.path("evil.pt"), "--v", self.path("evil.pt"),
                                     "--model-id", "x", "--out", self.path("o.safetensors")])
            self.assertEqual(rc, 1)
            self.assertIn("refusing to load global %s.%s" % (module, name), err)
            self.assertFalse(os.path.exists(marker))
        self.assertFalse(os.path.exists(self.path("o.safetensors")))

    def test_rejects_missing_layers(self):
        k_obj, k_st = rotation_dict(3, 32, "qqt", 1)
        del k_obj["layers"][1]
        write_pt(self.path("k.pt"), k_obj, k_st)
        v_obj, v_st = rotation_dict(3, 32, "sst", 2)
        write_pt(self.path("v.pt"), v_obj, v_st)
        rc, err = self.convert_pair()
        self.assertEqual(rc, 1)
        self.assertIn("are not 0..1", err)

    def test_rejects_layer_count_mismatch(self):
        k_obj, k_st = rotation_dict(3, 32, "qqt", 1)
        v_obj, v_st = rotation_dict(2, 32, "sst", 2)
        write_pt(self.path("k.pt"), k_obj, k_st)
        write_pt(self.path("v.pt"), v_obj, v_st)
        rc, err = self.convert_pair()
        self.assertEqual(rc, 1)
        self.assertIn("K has 3 layers of D=32 but V has 2 layers", err)

    def test_rejects_truncated_storage(self):
        k_obj, k_st = rotation_dict(2, 32, "qqt", 1)
        write_pt(self.path("k.pt"), k_obj, k_st, storage_bytes_override={"2": b"\0" * 100})
        v_obj, v_st = rotation_dict(2, 32, "sst", 2)
        write_pt(self.path("v.pt"), v_obj, v_st)
        rc, err = self.convert_pair()
        self.assertEqual(rc, 1)
        self.assertIn("holds 100 bytes, expected 4096", err)

    def test_rejects_bad_shapes_and_values(self):
        k_obj, k_st = rotation_dict(2, 32, "qqt", 1)
        k_obj["layers"][1]["rotation"] = FakeTensor(k_st[2], 0, (16, 64), (64, 1))
        write_pt(self.path("k.pt"), k_obj, k_st)
        v_obj, v_st = rotation_dict(2, 32, "sst", 2)
        write_pt(self.path("v.pt"), v_obj, v_st)
        rc, err = self.convert_pair()
        self.assertEqual(rc, 1)
        self.assertIn("layer 1 rotation has shape [16, 64]", err)

        k_obj, k_st = rotation_dict(2, 32, "qqt", 1)
        k_st[0].values[5] = float("nan")
        write_pt(self.path("k.pt"), k_obj, k_st)
        rc, err = self.convert_pair()
        self.assertEqual(rc, 1)
        self.assertIn("layer 0 rotation has a non-finite value", err)

        k_obj, k_st = rotation_dict(2, 32, "qqt", 1)
        k_obj["format_version"] = 2
        write_pt(self.path("k.pt"), k_obj, k_st)
        rc, err = self.convert_pair()
        self.assertEqual(rc, 1)
        self.assertIn("format_version is 2", err)

    def test_rejects_non_archives(self):
        with open(self.path("k.pt"), "wb") as f:
            f.write(b"not a zip file at all")
        with open(self.path("v.pt"), "wb") as f:
            f.write(b"")
        rc, err = self.convert_pair()
        self.assertEqual(rc, 1)
        self.assertIn("not a torch.save zip archive", err)
        rc, err = self.run_main(["--k", self.path("missing.pt"), "--v", self.path("v.pt"),
                                 "--model-id", "x", "--out", self.path("o.safetensors")])
        self.assertEqual(rc, 1)

    def test_shortest_float32(self):
        self.assertEqual(convert.shortest_float32(0.96), "0.96")
        self.assertEqual(convert.shortest_float32(0.92), "0.92")
        self.assertEqual(convert.shortest_float32(1.0), "1")
        self.assertEqual(convert.shortest_float32(0.1 + 0.2), "0.3")
        self.assertEqual(convert.shortest_float32(1.0 / 3.0), "0.33333334")


if __name__ == "__main__":
    unittest.main()
