"""Tests of the numpy SmolLM2-135M: tokenizer, forward pass, greedy continuations, perplexity on
ordinary English, the RoPE layout, mixed attention and the disjointness of the texts.

Needs the venv and the model file (`make venv`). Run: .venv/bin/python calibration/smollm2_test.py
"""

from __future__ import annotations

import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import smollm2  # noqa: E402
import st_io  # noqa: E402
import texts  # noqa: E402

ENGLISH = (
    "The history of the city goes back more than two thousand years. It was founded as a small "
    "settlement on the banks of the river, where traders stopped to rest and exchange goods. "
    "Over the centuries it grew into an important center of commerce and culture. Today it is "
    "known for its museums, its old churches and its lively markets, which attract visitors "
    "from all over the world. In the summer, the streets are full of people enjoying the warm "
    "weather, and many restaurants put their tables outside. The local food is simple but "
    "delicious, and most dishes are made with fresh vegetables from the surrounding farms."
)

_MODEL = None
_TOK = None


def model():
    global _MODEL, _TOK
    if _MODEL is None:
        _MODEL = smollm2.Model.load()
        _TOK = smollm2.Tokenizer.from_gguf()
    return _MODEL, _TOK


class TokenizerTest(unittest.TestCase):
    def test_round_trip_and_known_ids(self):
        _, tok = model()
        ids = tok.encode("The capital of France is")
        self.assertEqual(ids, [504, 3575, 282, 4649, 314])
        for s in ["Hello, world!  12345 tokens\n\ttabs", "naïve café — ünïcödé", ENGLISH]:
            self.assertEqual(tok.decode(tok.encode(s)), s)
        # digits are split one by one (the smollm pre-tokenizer); control tokens are atomic
        self.assertEqual(len(tok.encode("2024")), 4)
        self.assertEqual(tok.encode("<|im_start|>"), [1])


class ForwardTest(unittest.TestCase):
    def test_metadata(self):
        m, _ = model()
        c = m.cfg
        self.assertEqual((c.num_layers, c.q_heads, c.kv_heads, c.head_dim), (30, 9, 3, 64))
        self.assertEqual(c.rope_base, 100000.0)
        self.assertEqual(c.context_length, 8192)

    def test_greedy_continuations_are_sensible(self):
        m, tok = model()
        out = tok.decode(m.generate(tok.encode("The capital of France is"), 4))
        self.assertIn("Paris", out)
        reply = tok.decode(m.generate(tok.encode(tok.chat_prompt(
            "What is the capital of Germany?")), 16, eos=tok.eos_id))
        self.assertIn("Berlin", reply)
        counting = tok.decode(m.generate(tok.encode("Monday, Tuesday, Wednesday,"), 4))
        self.assertIn("Thursday", counting)

    def test_perplexity_on_ordinary_english(self):
        m, tok = model()
        ids = tok.encode(ENGLISH)
        ppl = smollm2.perplexity(m.forward(np.array(ids)), ids)
        # SmolLM2-135M scores roughly 8-15 on plain prose; shuffled tokens score far worse.
        self.assertLess(ppl, 20.0)
        shuffled = list(np.random.RandomState(0).permutation(ids))
        self.assertGreater(smollm2.perplexity(m.forward(np.array(shuffled)), shuffled), 5 * ppl)

    def test_unpermuted_layout_matches_gguf_interleaved_rope(self):
        """llama.cpp's layout (GGUF rows, interleaved-pair RoPE) gives the same attention
        scores as ours (rows un-permuted, half-split RoPE)."""
        m, tok = model()
        ids = np.array(tok.encode(ENGLISH)[:40])
        x = m.w["token_embd.weight"][ids]
        pos = np.arange(len(ids))
        q, k, _ = m.qkv(3, x, pos)
        ours = np.einsum("thd,shd->hts", q[:, :3], np.repeat(k[:, :1], 3, axis=1))
        # Re-permute to the GGUF layout and apply interleaved RoPE.
        d = m.cfg.head_dim
        h = m.rms_norm(x, m.w["blk.3.attn_norm.weight"])

        def gguf_rows(w, heads):
            return w.reshape(heads, 2, d // 2, -1).swapaxes(1, 2).reshape(w.shape)

        qg = (h @ gguf_rows(m.w["blk.3.attn_q.weight"], 9).T).reshape(-1, 9, d)
        kg = (h @ gguf_rows(m.w["blk.3.attn_k.weight"], 3).T).reshape(-1, 3, d)

        def rope_interleaved(t):
            ang = pos[:, None] * m._inv_freq[None, :]
            cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
            a, b = t[..., 0::2], t[..., 1::2]
            out = np.empty_like(t)
            out[..., 0::2] = a * cos - b * sin
            out[..., 1::2] = b * cos + a * sin
            return out

        theirs = np.einsum("thd,shd->hts", rope_interleaved(qg)[:, :3],
                           np.repeat(rope_interleaved(kg)[:, :1], 3, axis=1))
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-3)


class AttentionTest(unittest.TestCase):
    def test_mixed_attention_matches_a_direct_loop(self):
        rng = np.random.RandomState(0)
        t_len = 300
        q = rng.randn(t_len, 6, 32).astype(np.float32)
        k, v = (rng.randn(t_len, 2, 32).astype(np.float32) for _ in range(2))
        kq = k + 0.3 * rng.randn(*k.shape).astype(np.float32)
        vq = v + 0.3 * rng.randn(*v.shape).astype(np.float32)
        sink, window = 8, 40
        got = smollm2.mixed_attention(q, k, v, kq, vq, sink=sink, window=window, block=64)
        for t in (0, 20, 47, 48, 120, 299):
            for j in range(6):
                s = np.arange(t + 1)
                full = (s < sink) | (s > t - window)
                kk = np.where(full[:, None], k[:t + 1, j // 3], kq[:t + 1, j // 3])
                vv = np.where(full[:, None], v[:t + 1, j // 3], vq[:t + 1, j // 3])
                lg = kk.astype(np.float64) @ q[t, j] / np.sqrt(32)
                p = np.exp(lg - lg.max())
                np.testing.assert_allclose(got[t, j], (p / p.sum()) @ vv, atol=2e-5)

    def test_bf16_rounding(self):
        x = np.array([1.0, 1.00390625, 1.01171875, -3.14159, 1e-30], dtype=np.float32)
        r = st_io.round_bf16(x)
        self.assertEqual(r[0], 1.0)
        self.assertEqual(r[1], 1.0)           # tie to even
        self.assertEqual(r[2], 1.015625)      # tie to even (up)
        self.assertAlmostEqual(float(r[3]), -3.140625)


class TextsTest(unittest.TestCase):
    def test_calibration_and_evaluation_are_disjoint(self):
        held = texts._shingles(texts._words(texts.eval_text()))
        for doc in texts.calibration_texts():
            self.assertFalse(texts._shingles(texts._words(doc)) & held)
        self.assertNotIn(texts.EVAL_FILE, texts.CALIBRATION_FILES)
        _, tok = model()
        self.assertEqual(len(texts.evaluation_tokens(tok)), 4096)
        seqs = texts.calibration_sequences(tok, 3000, 1024)
        self.assertEqual(sum(len(s) for s in seqs), 3000)
        self.assertTrue(all(len(s) <= 1024 for s in seqs))


if __name__ == "__main__":
    unittest.main(verbosity=2)
