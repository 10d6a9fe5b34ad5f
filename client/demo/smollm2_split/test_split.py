"""The SmolLM2 prefill/decode split end to end (run_split.py, as `make run` runs it), with the
issue's checks asserted: prompts of more than 2048 tokens with at least 75 % of the attended
tokens in INT2; the remote decode choosing at every step the token that the same codec applied
in-process chooses (the tier layouts equal too); the daemon's codec version equal to the local
codec's; against the BF16-cache decode, teacher-forced top-1 >= 0.85 and KL <= 0.1 with the
calibrated rotation (the data-free rotation is measured beside it, not held to them).

Needs the model (make venv), kvpoold and libkvpool_eval_codec.so (CTest passes their paths).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_split_decode_matches_local_codec_and_bf16(tmp_path):
    kvpoold = os.environ.get("KVPOOL_KVPOOLD")
    codec = os.environ.get("KVPOOL_CODEC_LIB")
    if not kvpoold or not codec:
        pytest.skip("needs KVPOOL_KVPOOLD and KVPOOL_CODEC_LIB (set by CTest)")
    out = tmp_path / "summary.json"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    r = subprocess.run([sys.executable, os.path.join(HERE, "run_split.py"), "--kvpoold", kvpoold,
                        "--codec-lib", codec, "--json", str(out)], env=env, cwd=HERE,
                       capture_output=True, text=True, timeout=1500)
    print(r.stdout[-6000:], r.stderr[-3000:])
    s = json.loads(out.read_text())
    cal, free = s["configs"]["calibrated"], s["configs"]["data-free"]
    assert min(p["prompt_tokens"] for p in s["prompts"]) >= 2048
    for c in (cal, free):
        assert c["int2_share_min"] >= 0.75
        assert c["codec_version_daemon"] == c["codec_version_local"]
        assert c["local_layout_matches_daemon"]
        assert c["steps_compared"] >= 3 * 10
        # The service changes where the math runs, not the tokens: every step agrees, except
        # where the two best logits are closer than the two paths' logits differ (a tie).
        assert c["remote_equals_local"] or c["only_near_ties"], c["disagreements"]
        assert c["max_logit_delta"] < 0.05
    assert cal["remote_equals_local"]
    assert cal["top1"] >= 0.85 and cal["kl"] <= 0.1
    assert cal["teacher_forced_positions"] >= 30
    assert cal["bf16_bytes"] > 4 * cal["pool_bytes"]
    assert r.returncode == 0
