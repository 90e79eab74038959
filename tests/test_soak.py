"""The chaos soak, short (issue 26): `python -m kvhandoff.bench.soak --kill-every-s` against a push stack
of two prefill and two decode workers under `kvhandoff up`, a worker SIGKILLed every few seconds while
clients stream, chat, hang up and send bad requests. Every request is a full, consistent answer or a
clear error, every killed worker is restarted and answers again, every pool is back at baseline and the
stack serves a request at the end (the script's own checks, exit status 1 otherwise); here also that
at least two kills happened and that answers were compared (float32: batch-invariant, so a greedy
prompt's answers must all be equal)."""
from __future__ import annotations

import json
import subprocess
import sys


def test_a_short_chaos_soak_loses_nothing_and_recovers_every_worker(tmp_path):
    out = tmp_path / "chaos"
    run = subprocess.run([sys.executable, "-m", "kvhandoff.bench.soak", "--minutes", "0.3", "--kill-every-s", "5",
                          "--dtype", "float32", "--concurrency", "4", "--sample-s", "5", "--retention-ttl", "3",
                          "--num-blocks", "256", "--out", str(out)], capture_output=True, text=True, timeout=400)
    output = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode == 0, output
    result = json.loads((out / "soak.json").read_text())
    chaos = result["chaos"]
    assert len(chaos["kills"]) >= 2, (chaos, output)
    assert all(kill["recovered_s"] is not None for kill in chaos["kills"]), chaos
    assert result["outcomes"].get("ok", 0) >= 20, result["outcomes"]
    assert result["tokens_checked"], ("float32 is batch-invariant: every prompt's answers must have been compared",
                                      output)
    assert not result["unexpected"] and not result["leaks"] and result["serving_at_end"] == "ok", output
