"""`python -m vllm.entrypoints.openai.api_server` as kvhandoff's launcher calls it, answered by
tests/fake_vllm.py: its flags and --kv-transfer-config read as vLLM 0.32 reads them."""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))      # tests/
import fake_vllm  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--served-model-name", default=None)
p.add_argument("--host", default="0.0.0.0")
p.add_argument("--port", type=int, default=8000)
p.add_argument("--kv-transfer-config", default=None)
args, _ = p.parse_known_args()                  # (--dtype, --max-model-len, --enforce-eager, ...)
config = json.loads(args.kv_transfer_config) if args.kv_transfer_config else {}
connector = {"NixlConnector": "pull", "NixlPushConnector": "push"}.get(config.get("kv_connector"), "none")
extra = config.get("kv_connector_extra_config") or {}
argv = ["--port", str(args.port), "--host", args.host, "--model", args.served_model_name or args.model,
        "--connector", connector, "--kv-load-failure-policy", config.get("kv_load_failure_policy", "fail")]
if "kvhandoff_vllm_stream" in sys.modules:     # run through it (its patch needs the real serving classes)
    argv.append("--stream-kv-params")
if extra.get("bidirectional_kv_xfer"):
    argv += ["--bidirectional", "--ttl", str(extra.get("decoder_kv_blocks_ttl", 480))]
fake_vllm.main(argv)
