#!/usr/bin/env python3
"""fidelity.py's per-layer clip rows: the clip fit read from a kvpool-calibrate file, and
LayerClipCodec, which must give each layer exactly what the production codec gives with that
layer's own pair (and the model-wide pair where a layer's optimum equals it).

    fidelity_clip_test.py LIBKVPOOL_EVAL_CODEC ROTATION_FILE
"""

import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fidelity  # noqa: E402

LIB, ROTATION = sys.argv[1], sys.argv[2]


class LayerClipTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.lib = fidelity.CodecLib(LIB)
        cls.pair, cls.per_layer, cls.objective = fidelity.fitted_clips(ROTATION)
        pair_codec = fidelity.Codec(cls.lib, ROTATION, len(cls.per_layer), 64,
                                    use_file_quant=True)
        cls.num_layers, cls.head_dim = pair_codec.num_layers, pair_codec.head_dim
        cls.file_pair = (pair_codec.clip_k, pair_codec.clip_v)

    def test_fit_matches_the_file(self):
        self.assertEqual(len(self.per_layer), self.num_layers)
        self.assertEqual(self.pair, self.file_pair)  # the file stores the model-wide fit
        self.assertTrue(self.objective)
        ks = {k for k, _ in self.per_layer}
        self.assertGreater(len(ks), 1, "the layers' optima differ")

    def test_each_layer_uses_its_own_pair(self):
        rows = np.random.default_rng(7).standard_normal((40, 3, self.head_dim)) * 2
        rows[:, :, 5] *= 8  # an outlier channel, so that the clip matters
        rows = rows.astype(np.float32)
        for rotation in (ROTATION, "hadamard"):
            per_layer = fidelity.LayerClipCodec(self.lib, rotation, self.num_layers,
                                                self.head_dim, self.per_layer)
            pair = fidelity.Codec(self.lib, rotation, self.num_layers, self.head_dim,
                                  clip_k=self.pair[0], clip_v=self.pair[1])
            differs = 0
            for layer, (ck, cv) in enumerate(self.per_layer):
                own = fidelity.Codec(self.lib, rotation, self.num_layers, self.head_dim,
                                     clip_k=ck, clip_v=cv)
                for tensor in (0, 1):
                    got = per_layer.roundtrip(layer, tensor, rows)[1]
                    np.testing.assert_array_equal(got, own.roundtrip(layer, tensor, rows)[1])
                    same_as_pair = np.array_equal(got, pair.roundtrip(layer, tensor, rows)[1])
                    if (ck, cv)[tensor] == self.pair[tensor]:
                        self.assertTrue(same_as_pair, (rotation, layer, tensor))
                    differs += not same_as_pair
            self.assertGreater(differs, 0, rotation)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1])
