"""bench/cache_exchange.py (the cache's exchange of ids between two processes, against
the key-value store): small payloads as a test."""

import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "cache_exchange.py")


def test_records_both_transports():
    cmd = [sys.executable, BENCH, "--sizes-mb", "0.01,0.5", "--reps", "3"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    lines = [json.loads(x) for x in out.splitlines()]
    assert [r["payload_MB"] for r in lines] == [0.01, 0.5]
    for r in lines:
        assert r["cpu"] and r["processes"] == 2
        assert r["exchange_ms"] > 0 and r["key_value_store_ms"] > 0
